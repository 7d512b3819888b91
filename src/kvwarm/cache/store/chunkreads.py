"""Reading a manifest's chunks for ``Cache.open_row`` (a collaborator of the facade, handed
the ``CacheCore``, the scratch buffers and the remote I/O pool).

Invariants: every chunk is verified (head, key replay, payload CRC32C) before a caller sees
it; a missing or corrupt chunk drops the row that names it (in a shared tier only forgets
it: a miss, never a wrong restore);
chunks read from local storage land in the thread's reusable arena (``ScratchBuffers``), whose
views end with the ``open_row`` lease; a remote tier's chunks are fetched concurrently.
See docs/architecture.md ("Chunks").
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from kvwarm.cache.protocols import StoredRow, Tier
from kvwarm.cache.store.chunking import load_chunks
from kvwarm.cache.store.core import CacheCore, ScratchBuffers
from kvwarm.errors import CacheFormatError, CacheIOError, CacheKeyError

__all__ = ["ChunkReads"]

log = logging.getLogger(__name__)


class ChunkReads:
    """Chunk reads of one cache: the thread's arena (``scratch``) for local tiers, and the
    cache's remote I/O pool (``pool``, None without remote tiers) for concurrent GETs."""

    def __init__(
        self, core: CacheCore, scratch: ScratchBuffers, pool: ThreadPoolExecutor | None
    ) -> None:
        self._core = core
        self._scratch = scratch
        self._pool = pool

    def chunk_arena(self, stored: StoredRow) -> bytearray | None:
        """The thread's chunk buffer, large enough for every chunk of ``stored`` whose
        stored size the index knows (a fresh 45 MB buffer costs more to fault in than to
        fill), or None."""
        if not stored.chunks:
            return None
        sizes = self._core.index.chunk_sizes(stored.info.tier, stored.chunks)
        known = [n for n in sizes if n is not None]
        return self._scratch.take_arena(sum(known)) if len(known) == len(sizes) else None

    def load_parts(
        self, tier: Tier, stored: StoredRow, arena: bytearray | None
    ) -> tuple[memoryview, ...]:
        """A manifest's chunks, verified, in order; () for a whole-blob row."""
        if not stored.chunks:
            return ()
        key = stored.info.key
        try:
            pool = self._pool
            if not tier.capabilities.local and pool is not None and len(stored.chunks) > 1:
                # A remote store answers several GETs at once: one round trip, not one each.
                chunks = list(pool.map(tier.load_chunk, stored.chunks))
            else:
                sizes = self._core.index.chunk_sizes(tier.name, stored.chunks) if arena else []
                chunks = load_chunks(tier, stored.chunks, arena, sizes)
        except (CacheFormatError, CacheKeyError) as exc:
            # A chunk is corrupt or gone: the row cannot be restored. Drop the row (in a
            # shared tier only forget it: ``CacheCore.drop_unreadable``).
            self._core.drop_unreadable(tier, key, exc)
            raise
        except CacheIOError:
            self._core.counters.incr("store_errors")
            raise
        return tuple(chunks)
