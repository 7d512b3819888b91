"""Reading a row for ``Cache.open_row``: the lease, its metadata and payload, a manifest's
chunks (a collaborator of the facade, handed the ``CacheCore``, the scratch buffers, the remote
I/O pool and the shared tiers' promotion).

Invariants: a row is read only while it is checked out of the index (its bytes cannot be
retired under the reader), and checked in when the lease ends; every chunk is verified (head,
key replay, payload CRC32C) before a caller sees it; a missing or corrupt row or chunk drops
the row that names it (in a shared tier only forgets it: a miss, never a wrong restore); a
manifest that is not the indexed copy (the key evicted and published again by another process,
cut otherwise) is a miss that indexes the row there now, never a drop of it;
reads from local storage land in the thread's reusable buffers (``ScratchBuffers``), whose
views end with the lease; a local row's chunk files are read by the restoring thread and
helper threads together, each into its own slice of that thread's arena, all done before the
row is yielded; a remote tier's chunks are fetched concurrently, and a remote row read whole
is promoted to a local tier. See docs/architecture.md ("Chunks").
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import replace

from kvwarm.cache.api import LoadedRow
from kvwarm.cache.protocols import RowBytes, StoredRow, Tier
from kvwarm.cache.store.chunking import ChunkRead, chunk_reads, gather_reads, load_chunks
from kvwarm.cache.store.core import CacheCore, ScratchBuffers
from kvwarm.errors import CacheFormatError, CacheIOError, CacheKeyError, ChunkFormatError
from kvwarm.tokens import tail_of

__all__ = ["LOCAL_READ_HELPERS", "READ_PARALLEL", "Promote", "RowReads"]

#: Chunk GETs of remote rows in flight at once: a row of up to this many objects is read in
#: one round trip (a 1,000-token Gemma 3 270M row in chunks is 13 of them; a 4,096-token
#: SmolLM2 row 17), within the s3 client's 32 connections.
READ_PARALLEL = 16

#: Threads that read a local row's chunk files beside the thread restoring it
#: (``chunking.load_chunks``): one fewer than the cores, at most 2. A 1,000-token Gemma 3 270M
#: row in chunks is 13 files; with one helper on a two-core host its reads and CRC32C checks
#: took 0.45-0.5 ms instead of 0.79 (``bench/chunks.py --only window``). None on one core.
LOCAL_READ_HELPERS = max(0, min(2, (os.cpu_count() or 1) - 1))

#: Copies a remote row read whole into a local tier (``upkeep.shared.SharedTiers.promote``).
Promote = Callable[[Tier, StoredRow, RowBytes, tuple[memoryview, ...]], None]

log = logging.getLogger(__name__)


class RowReads:
    """Row reads of one cache: the thread's scratch buffer and chunk arena (``scratch``) for
    local tiers, the cache's read pool (``pool``, None without remote tiers) for concurrent
    GETs, ``promote`` for a remote row once it is read whole, and ``local_helpers`` tasks on
    ``local_pool`` that read a local row's chunk files beside the restoring thread."""

    def __init__(
        self,
        core: CacheCore,
        scratch: ScratchBuffers,
        pool: ThreadPoolExecutor | None,
        promote: Promote,
        local_pool: ThreadPoolExecutor | None = None,
        local_helpers: int = 0,
    ) -> None:
        self._core = core
        self._scratch = scratch
        self._pool = pool
        self._promote = promote
        self._local_pool = local_pool
        self._local_helpers = local_helpers

    @contextmanager
    def open_row(
        self, key: bytes, *, chunks: bool = True, payload: bool = True, from_token: int = 0
    ) -> Iterator[LoadedRow]:
        """``CacheApi.open_row``: the row of ``key`` leased (checked out) while the context
        is open; ``CacheKeyError`` when there is none."""
        index = self._core.index
        chunks = chunks and payload  # the metadata alone names chunks but reads none
        leased = index.lease(key)
        if leased is None and self._core.probe(key) is not None:
            leased = index.lease(key)
        if leased is None:
            raise CacheKeyError(f"no cache row {key.hex()}")
        stored, gen = leased
        whole = stored
        skip, chunks_from = tail_of(stored.chunk_lens, from_token) if chunks else (0, 0)
        if skip:
            stored = replace(
                stored,
                chunks=stored.chunks[skip:],
                chunk_lens=stored.chunk_lens[skip:],
                locs=stored.locs[skip:],
            )
        tier = self._core.tiers[stored.info.tier]
        local = tier.capabilities.local
        # A remote row's buffer may outlive this lease (promotion): never the thread's scratch.
        scratch = self._scratch.take() if local else None
        data: RowBytes | None = None
        parts: tuple[memoryview, ...] = ()
        # Chunks read from local storage land in the thread's arena; ram holds them already.
        persistent = tier.capabilities.persistent
        arena = None
        # A remote row's chunks are named by the index: their GETs start before the
        # manifest's, so a row costs one round trip, not two (a tail read waits for the
        # manifest, which may send it back to the whole row). In a tier with packs, one
        # ranged GET per run of adjacent chunks in a pack (``chunking.chunk_reads``).
        ahead = (
            [self._pool.submit(read) for read in chunk_reads(tier, stored.chunk_refs, stored.locs)]
            if chunks and not skip and not local and self._pool is not None
            else None
        )
        try:
            data = self._load(tier, stored, scratch, payload=payload)
            if self._core.stale(tier, whole, data):
                # The manifest under the key is not the one indexed: another process evicted
                # it and published the key again, cut otherwise. Our copy's chunks may be
                # swept by now, and a failed read of them would drop (in a local tier,
                # delete) the valid row there: the copy is replaced by it, and this is a miss.
                self._core.replace_stale(tier, key)
                raise CacheKeyError(f"row {key.hex()} was published again since it was indexed")
            if skip and (data.payload.nbytes or stored.rest is not None):
                # A manifest's rest (an iSWA window, a recurrent state) belongs to the whole
                # row: it is read whole.
                stored, chunks_from = whole, 0
            if chunks and local and persistent:
                arena = self.chunk_arena(stored)
            if chunks:
                parts = self.load_parts(tier, stored, arena, ahead)
                ahead = None
            main, rest = parts[: len(stored.chunks)], parts[len(stored.chunks) :]
            yield LoadedRow(
                stored.info,
                data.tokens,
                data.payload,
                data.logits,
                main,
                chunks_from,
                rest,
                stored.rest.first if stored.rest is not None and rest else 0,
            )
        finally:
            if ahead is not None:  # the manifest's read failed: its chunks are not wanted
                for future in ahead:
                    future.cancel()
            index.checkin(key, gen)
            if local:
                self._scratch.reclaim(scratch, data)
                self._scratch.reclaim_arena(arena, parts)
            elif data is not None:
                # Neither metadata alone nor a tail of the chunks is a row to promote.
                if payload and stored is whole:
                    self._promote(tier, stored, data, parts)
                _release(data)

    def _load(
        self,
        tier: Tier,
        stored: StoredRow,
        scratch: bytearray | None = None,
        *,
        payload: bool = True,
    ) -> RowBytes:
        key = stored.info.key
        t0 = time.perf_counter()
        try:
            data = tier.load(stored, scratch) if payload else tier.load_meta(stored)
            if data.tokens != stored.tokens:
                raise CacheFormatError(f"row {key.hex()} holds other tokens than indexed")
        except (CacheFormatError, CacheKeyError) as exc:
            # Corrupt, or removed behind our back (another process): never restore it again;
            # in a shared tier only forgotten, its bytes left to the others (core.py).
            self._core.drop_unreadable(tier, key, exc)
            raise
        except CacheIOError:
            self._core.counters.incr("store_errors")  # unreachable, not wrong: the row stays
            raise
        self._core.counters.record_latency("load", time.perf_counter() - t0)
        return data

    def chunk_arena(self, stored: StoredRow) -> bytearray | None:
        """The thread's chunk buffer, large enough for every chunk of ``stored`` whose
        stored size the index knows (a fresh 45 MB buffer costs more to fault in than to
        fill), or None."""
        if not stored.chunks:
            return None
        sizes = self._core.index.chunk_sizes(stored.info.tier, stored.chunk_refs)
        known = [n for n in sizes if n is not None]
        return self._scratch.take_arena(sum(known)) if len(known) == len(sizes) else None

    def load_parts(
        self,
        tier: Tier,
        stored: StoredRow,
        arena: bytearray | None,
        ahead: list[Future[list[tuple[int, memoryview]]]] | None = None,
    ) -> tuple[memoryview, ...]:
        """A manifest's chunks, verified, in order (its first cache's, then its rest's); ()
        for a whole-blob row. ``ahead``: their reads, already started on the remote pool."""
        refs = stored.chunk_refs
        if not refs:
            return ()
        key = stored.info.key
        try:
            pool = self._pool
            if ahead is not None:
                chunks = gather_reads((future.result() for future in ahead), len(refs))
            elif not tier.capabilities.local:
                # A remote store answers several GETs at once: one round trip, not one each.
                reads = chunk_reads(tier, refs, stored.locs)
                done = (
                    pool.map(_run, reads)
                    if pool is not None and len(reads) > 1
                    else map(_run, reads)
                )
                chunks = gather_reads(done, len(refs))
            else:
                sizes = self._core.index.chunk_sizes(tier.name, refs) if arena else []
                # Local files: read and checked by this thread and a helper together (ram
                # holds its chunks already: nothing to share out).
                helper = self._local_pool if tier.capabilities.persistent else None
                chunks = load_chunks(tier, refs, arena, sizes, helper, self._local_helpers)
        except (CacheFormatError, CacheKeyError) as exc:
            # A chunk is corrupt or gone: the row cannot be restored. Drop the row (in a
            # shared tier only forget it: ``CacheCore.drop_unreadable``), and a corrupt
            # chunk itself, which a save of its tokens would otherwise reuse.
            if isinstance(exc, ChunkFormatError):
                self._core.set_aside_chunk(tier, exc, refs)
            self._core.drop_unreadable(tier, key, exc)
            raise
        except CacheIOError:
            self._core.counters.incr("store_errors")
            raise
        return tuple(chunks)


def _run(read: ChunkRead) -> list[tuple[int, memoryview]]:
    return read()


def _release(data: RowBytes) -> None:
    """End a remote row's lease: the caller's view goes (a promotion holds its own)."""
    # Still exported by the caller: harmless, the bytes are immutable and never reused.
    with suppress(BufferError):
        data.payload.release()
