"""The cache's public surface as the engine, server and CLI use it.

``kvwarm.cache.Cache`` implements ``CacheApi``. Everything here is thread-safe. Lookups never
wait behind writers (except ``lookup_exact_or_wait``, which waits on purpose); saves never
block the caller unless ``sync=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from kvwarm.cache.explain import ReuseReport
from kvwarm.cache.protocols import RowEvents, TierCapabilities
from kvwarm.cache.types import (
    DEFAULT_GRACE_S,
    EvictResult,
    Namespace,
    PrefixMatch,
    RowInfo,
    SaveRequest,
    SweepResult,
    TierName,
)


@dataclass(frozen=True, slots=True)
class LoadedRow:
    """A row's bytes, valid while its ``open_row`` context is open (the row is checked out,
    so eviction cannot remove it, nor any chunk it names). ``payload`` is a zero-copy view:
    ``kv_unpack`` reads it directly -- unless ``chunks`` is set: the row is then a manifest,
    ``chunks`` are its KV's pieces in token order, for the backend's ``kv_join``, and
    ``payload`` is empty."""

    info: RowInfo
    tokens: tuple[int, ...]
    payload: memoryview
    logits: bytes | None
    chunks: tuple[memoryview, ...] = ()
    #: The first position ``chunks`` cover: 0, or the chunk boundary a tail read
    #: (``open_row(from_token=...)``) started at; the KV before it was not read.
    chunks_from: int = 0
    #: A manifest's rest in chunks (an iSWA window: ``RestChunks``), for the backend's
    #: ``join_rest`` after ``join`` of ``chunks``, the window starting at ``rest_from``; ()
    #: when the rest (if any) is ``payload``.
    rest_chunks: tuple[memoryview, ...] = ()
    rest_from: int = 0


@dataclass(frozen=True, slots=True)
class VerifyReport:
    checked: int
    bad: tuple[tuple[str, str], ...]  # (path or key hex, reason)
    # What startup scans already set aside (``quarantine/`` of each file tier): row files
    # (invalid, or manifests whose chunks were gone) and chunk files. Fixed, not bad.
    quarantined_rows: int = 0
    quarantined_chunks: int = 0


class CacheApi(Protocol):
    def tier_names(self) -> tuple[TierName, ...]: ...

    def tier_capabilities(self) -> dict[TierName, TierCapabilities]:
        """What each configured tier is (persistent, shared, local)."""
        ...

    def watch_rows(self, events: RowEvents | None) -> None:
        """Tell ``events`` of every indexed row now, then of every row joining or leaving
        the index (``protocols.RowEvents``: called under the index's lock)."""
        ...

    def has(self, key: bytes) -> bool:
        """Published or in flight. Counts nothing; never waits."""
        ...

    def key_for(self, namespace: Namespace, tokens: Sequence[int]) -> bytes: ...

    def hold(self, key: bytes) -> None:
        """Mark ``key`` in flight before its save starts: waiters (``lookup_exact_or_wait``)
        wait for it. Every ``hold`` needs one ``release``, after the save was handed over."""
        ...

    def release(self, key: bytes) -> None: ...

    def lookup_exact(self, key: bytes) -> RowInfo | None:
        """The published row of ``key`` (shared tiers probed for it). Counts nothing: a
        lookup is no hit (``record_hit``)."""
        ...

    def settled(self, key: bytes, timeout_s: float) -> bool:
        """Whether the row of ``key`` is published, after waiting up to ``timeout_s`` for a
        save of it in flight to end. Counts nothing."""
        ...

    def lookup_exact_or_wait(self, key: bytes, timeout_s: float) -> RowInfo | None:
        """The row of ``key``, waiting up to ``timeout_s`` for a save of it in flight to
        publish. Counts nothing: reading a row's metadata is no hit (``record_hit``)."""
        ...

    def longest_prefix(
        self,
        namespace: Namespace,
        tokens: Sequence[int],
        *,
        min_shared: int = 1,
        probe_lengths: Sequence[int] = (),
    ) -> PrefixMatch | None:
        """The row of ``namespace`` sharing the longest prefix with ``tokens`` (ties: fewest
        bytes). Cost grows with ``len(tokens)``, not with the number of rows. Counts no hit:
        what the caller then restores from it, if anything, is counted by ``record_hit``.

        ``probe_lengths``: prefix lengths whose keys shared tiers are asked for when the index
        offers nothing that long (``savegates.probe_lengths``): rows another process published
        are found at once, at a bounded number of round trips (``CacheConfig.probe_max``)."""
        ...

    def whole_prefixes(
        self, namespace: Namespace, tokens: Sequence[int], limit: int = 4
    ) -> list[PrefixMatch]:
        """Up to ``limit`` rows of ``namespace`` whose tokens are all a prefix of ``tokens``
        (``n_shared == row.n_tokens``), longest first: the candidates for a model whose state
        cannot be trimmed (``kvwarm.memory``), where a longer row sharing more is of no use."""
        ...

    def note_namespace(self, namespace: Namespace) -> None:
        """A model serves under this unsalted namespace (``explain_miss`` may look there)."""
        ...

    def noted_namespaces(self) -> tuple[Namespace, ...]: ...

    def explain_miss(
        self,
        namespace: Namespace,
        tokens: Sequence[int],
        beyond: int,
        others: Sequence[Namespace] = (),
    ) -> ReuseReport | None:
        """What would have served more than ``beyond`` tokens and did not: a gone row of
        ``namespace`` (evicted, expired, unreadable), a dropped or in-flight save, or a row in
        one of ``others`` (``cache/explain.py``). Cheap: one tree walk per namespace."""
        ...

    def open_row(
        self, key: bytes, *, chunks: bool = True, payload: bool = True, from_token: int = 0
    ) -> AbstractContextManager[LoadedRow]:
        """Check out, read and verify (CRC) a row. ``CacheKeyError`` if absent,
        ``CacheFormatError`` if corrupt (the bad row is dropped from index and tier).
        ``chunks=False`` reads a manifest's own file alone (its tokens and logits), none of
        the chunks it names (``LoadedRow.chunks`` is then empty). ``payload=False`` reads
        only the metadata (tokens, logits; ``Tier.load_meta``): no payload, no chunks.
        ``from_token``: read only the chunks from the last chunk boundary at or before it
        (``LoadedRow.chunks_from``; 0 for a row that is not a manifest of chunks alone): a
        caller that holds the KV before it live restores the tail alone."""
        ...

    def chunk_lens(self, key: bytes) -> tuple[int, ...]:
        """How many tokens each chunk of row ``key`` covers, in order (() for a row stored
        whole, or none)."""
        ...

    def save(
        self, request: SaveRequest, *, sync: bool = False, timeout_s: float = 30.0
    ) -> bytes | None:
        """Write a row; returns its key, or None if it was not saved. Async (default): queue
        it and return at once; None if the writer pool was full (counted as ``saves_dropped``).
        The key is marked in flight before returning, so ``lookup_exact_or_wait`` sees it.
        Sync: wait up to ``timeout_s``; the key only if the row was published."""
        ...

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every held key (``hold``) was handed over and every queued save has
        finished; True if that happened in time."""
        ...

    def record_hit(self, counter: str) -> None:
        """Count one hit of the kind that served a prefix (``counters.HIT_COUNTERS``:
        ``hits_exact``, ``hits_resume``, ``hits_longest_prefix``, ``hits_live``,
        ``hits_draft_prefix``); any other name is a ``ValueError``. The engine counts a
        request's one outcome once its prompt's KV is in its slot (``CachePort.counted``)."""
        ...

    def record_miss(self) -> None:
        """Count a request that reused no KV (``misses``)."""
        ...

    def record_admission_failure(self) -> None:
        """Count a request that failed before it was seated (``admission_failures``): its
        one outcome, neither a hit nor a miss."""
        ...

    def record_restore(self, tier: TierName, nbytes: int, seconds: float) -> None:
        """A row of ``tier`` restored into a request's slot: ``nbytes`` read for it,
        ``seconds`` from opening the row to its KV in the slot. Counted per tier
        (``tier_<name>_restores``, ``_restored_bytes``, ``_restore_seconds``) and as the
        ``restore`` latency. Not a tier's ``hits`` (rows opened, which LFU reads)."""
        ...

    def record_latency(self, name: str, seconds: float) -> None:
        """Add to a latency total (``pack``, ``unpack``, …) reported in ``counters()``."""
        ...

    def evict_bytes(self, n_bytes: int, tiers: Sequence[TierName] | None = None) -> EvictResult:
        """Remove not-checked-out rows, first victim first by the eviction policy (LRU unless
        ``CacheConfig.eviction`` says otherwise), until ``n_bytes`` are freed; only from
        ``tiers`` when given (``InvalidRequestError`` for a tier not configured, or for none)."""
        ...

    def gc(self, *, count_downtime: bool = False) -> EvictResult:
        """Remove expired (TTL) rows and reap stale reservations now. A row's idle time runs
        from its last use, but no earlier than this cache's opening (a restart after downtime
        expires nothing at once) unless ``count_downtime`` (``kvwarm cache gc``: an
        operator's collection, in a process that has just opened the cache)."""
        ...

    def gc_shared(self, grace_s: float = DEFAULT_GRACE_S) -> list[SweepResult]:
        """Mark-and-sweep the chunks of shared, non-local tiers (s3, a shared directory):
        delete those no manifest in the store names and older than ``grace_s``."""
        ...

    def delete(self, key: bytes) -> bool: ...

    def rows(self, namespace: Namespace | None = None) -> list[RowInfo]: ...

    def row_tokens(self, key: bytes) -> tuple[int, ...] | None:
        """The tokens a published row holds (None: no such row), from the index alone: no
        tier is read. Speculative decoding drafts from them (``engine/worker/drafts.py``)."""
        ...

    def counters(self) -> Mapping[str, float]:
        """One snapshot: request outcomes (hits by kind, misses), saves by reason,
        saves_dropped, evictions, per-tier bytes/rows/quota (``tier_<name>_bytes`` …),
        latency totals."""
        ...

    def verify(self, *, repair: bool = False) -> VerifyReport:
        """Check every row's CRC and report every bad file, including those the startup scan
        found invalid. Bad rows are dropped (bytes deleted) only with ``repair``."""
        ...

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain the writer pool (bounded), stop background threads. Idempotent."""
        ...
