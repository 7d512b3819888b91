"""Shared tiers as the facade uses them: bounded prefix discovery and promotion of hits.

A shared tier (capability ``shared``: s3, a directory other processes write) holds rows this
process's index has not seen. A collaborator of ``Cache`` (facade.py), handed the
``CacheCore``.

Invariants:
- Discovery is bounded: a prefix lookup probes at most ``CacheConfig.probe_max`` keys, only
  the keys of prefix lengths some save can produce (``savegates.probe_lengths``), only lengths
  longer than what the index already offers, longest first, ``probe_parallel`` at a time;
  the first wave that finds a row ends it (later waves hold only shorter prefixes). So a
  lookup costs at most ``ceil(probe_max / probe_parallel)`` rounds of concurrent requests.
- A probe failure (dead store) is a miss, counted in ``store_errors``; never an exception.
- Promotion copies a row read from a tier that is not local into ``promote_tier`` through
  that tier's publish protocol, on the writer pool (never on the caller's thread, never
  blocking it). The index then names the local copy; the shared copy stays for the others.
  If the local publish fails, the shared row is put back in the index. A row someone has
  checked out is not promoted (its reader's pin must stay on the row it read); a later hit is.
See docs/architecture.md ("Shared tiers").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from kvwarm.cache.formats.key import PrefixKeyer
from kvwarm.cache.protocols import RowBytes, StoredRow, Tier
from kvwarm.cache.store.core import CacheCore
from kvwarm.cache.types import CacheConfig, Namespace, SaveRequest, Splitter
from kvwarm.errors import CacheError

__all__ = ["SharedTiers"]

log = logging.getLogger(__name__)


class SharedTiers:
    """Discovery in, and promotion from, the shared tiers of one cache. ``pool``: the cache's
    remote I/O pool (None when no tier is remote), which runs a wave of probes at once."""

    def __init__(
        self, core: CacheCore, config: CacheConfig, pool: ThreadPoolExecutor | None
    ) -> None:
        self._core = core
        self.config = config
        self._probe_pool = pool

    def discover(
        self, namespace: Namespace, tokens: Sequence[int], lengths: Sequence[int], floor: int
    ) -> bool:
        """Probe shared tiers for rows of ``lengths`` longer than ``floor``; adopt what is
        found. True if a row was adopted."""
        if not lengths or self.config.probe_max <= 0 or not self._core.shared_tiers():
            return False
        wanted = sorted({n for n in lengths if floor < n <= len(tokens)}, reverse=True)
        wanted = wanted[: self.config.probe_max]
        if not wanted:
            return False
        keyer = PrefixKeyer(namespace, tokens)
        keys = {n: keyer.key(n) for n in reversed(wanted)}  # ascending: one running hash
        todo = [
            keys[n]
            for n in wanted
            if keys[n] not in self._core.index and not self._core.index.in_flight(keys[n])
        ]
        step = self.config.probe_parallel
        for start in range(0, len(todo), step):
            wave = todo[start : start + step]
            self._core.counters.incr("probe_rounds")
            self._core.counters.incr("probes", len(wave))
            pool = self._probe_pool
            probe = self._core.probe
            found = list(pool.map(probe, wave)) if pool else [probe(k) for k in wave]
            if any(info is not None for info in found):
                self._core.counters.incr("hits_shared")
                return True
        return False

    def _promote_target(self) -> Tier | None:
        name = self.config.promote_tier
        if name is not None:
            return self._core.tiers.get(name)
        for tier in self._core.tiers.values():
            if tier.capabilities.local:
                return tier
        return None

    def promote(
        self, source: Tier, stored: StoredRow, data: RowBytes, parts: tuple[memoryview, ...]
    ) -> None:
        """Queue a copy of a row just read from ``source`` (not local) into the local tier.
        Takes its own view of the payload: the caller's is released when its lease ends. A
        manifest is copied with its chunks (``parts``): those the local tier lacks are
        written, then the manifest (``chunking.store_row``)."""
        target = self._promote_target()
        key = stored.info.key
        fields = data.fields
        if target is None or fields is None or self._core.index.in_flight(key):
            return
        view = data.payload[:]
        split = split_rest = None
        rest = fields.rest_chunks
        if parts and fields.chunks:
            # s3 bodies are immutable bytes: views suffice.
            n_main = len(fields.chunks)
            split = _picker(tuple(p[:] for p in parts[:n_main]), 0, fields.chunk_lens)
            if rest is not None:
                held = tuple(p[:] for p in parts[n_main:])
                split_rest = _picker(held, rest.start, rest.lens)
        # The payload is copied on the writer thread: copying MBs here would stall a tick.
        request = SaveRequest(
            namespace=fields.namespace,
            tokens=stored.tokens,
            payload=b"",
            reason=fields.reason,
            tier=target.name,
            logits=fields.logits,
            prompt_text=fields.prompt_text if self.config.store_prompt_text else "",
            ttl_class=fields.ttl_class,
            context_size=fields.context_size,
            quant_bits=fields.quant_bits,
            fingerprint_mode=fields.fingerprint_mode,
            canonical_tokens=fields.canonical_tokens,
            memory=fields.memory,
            split=split,
            # A manifest's payload is its rest (``kvc``): copied as it is; a rest in chunks is
            # copied chunk by chunk under its keys.
            rest=_as_is if split is not None and view.nbytes else None,
            split_rest=split_rest,
            rest_chunks=rest if split_rest is not None else None,
            chunk_lens=fields.chunk_lens if split is not None else (),
            # Its chunks keep their keys: past its canonical prefix they are not the plain
            # chain of its tokens (``chunkfmt.chunk_chain``).
            chunk_keys=fields.chunks if split is not None else (),
        )
        self._core.index.mark_in_flight(key)

        def job() -> bool:
            try:
                full = replace(request, payload=bytes(view))
                view.release()
                return self._copy_to(target, source, stored, full)
            finally:
                self._core.index.clear_in_flight(key)

        if not self._core.writer.submit(job):
            view.release()
            self._core.index.clear_in_flight(key)
            self._core.counters.incr("promotions_dropped")

    def _copy_to(self, target: Tier, source: Tier, stored: StoredRow, request: SaveRequest) -> bool:
        key = stored.info.key
        # The shared copy stays in its store for the others; the index forgets it only if no
        # reader holds it (a reader's check-in must find the row it checked out).
        removed = self._core.index.remove_unpinned(key, source.name)
        if removed is None:
            return False  # evicted or copied meanwhile, or being read: a later hit promotes
        row: StoredRow | None = None
        try:
            row = self._core.store_row(key, request, target, 0, count_chunks=False)
        except CacheError as exc:
            log.warning("%s: promoting %s failed: %s", target.name, key.hex(), exc)
        finally:
            if row is None and key not in self._core.index:
                self._core.index.adopt(removed)
        if row is None:
            return False
        self._core.counters.incr("promotions")
        self._core.enforce_quota(target)
        return True


def _picker(held: tuple[memoryview, ...], start: int, lens: Sequence[int]) -> Splitter:
    """A splitter that hands back chunks already read (a promoted manifest's, cut at
    ``lens`` tokens from ``start``), by where each starts."""
    starts: dict[int, int] = {}
    at = start
    for i, length in enumerate(lens):
        starts[at] = i
        at += length

    def pick(_blob: object, bounds: Sequence[int]) -> list[bytes]:
        return [bytes(held[starts[b]]) for b in bounds[:-1]]

    return pick


def _as_is(payload: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """A promoted manifest's rest: its payload already is."""
    return payload
