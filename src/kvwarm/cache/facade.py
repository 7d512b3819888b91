"""``Cache``: the one object callers use (implements ``api.CacheApi``).

It is the one door of the cache's wings and holds no body of its own beyond lookups and
lifetime: it builds the collaborators, each an object with its own state, hands them what they
use and delegates. The index wing decides (``index.index.Index``); the store wing stores
(``store.core.CacheCore``: the index and the tiers and the primitives between them;
``store.reads.RowReads``: ``open_row``; ``store.saves.Saves``: ``save``, ``flush``); the upkeep
wing keeps it (``upkeep.scans.CacheUpkeep``: scans, sweeps, verify; ``upkeep.shared.SharedTiers``:
discovery in shared tiers and promotion; ``upkeep.sharedgc.SharedSweep``: their chunks'
mark-and-sweep; ``upkeep.pressure``); tiers are built by name or URL (``tiers.registry``).

Invariants:

- The index decides, the tiers store: every row enters the index through the publish protocol
  or an adopt of bytes a tier vouched for, and leaves it *before* its bytes are deleted, so no
  lookup can return a row whose bytes are already gone on purpose. (Bytes removed behind our
  back, e.g. by another process, surface as ``CacheKeyError``/``CacheFormatError`` on open and
  the row is dropped then.)
- Tiers are used only through the ``Tier`` protocol and their capabilities.
- A key is marked in flight before ``save`` returns and unmarked when its job ends (published,
  failed or dropped), so ``lookup_exact_or_wait`` never waits for a save that cannot come.
- No tier I/O happens under the index lock.
- With ``repair=False`` (``kvwarm cache verify`` without ``--repair``) opening the cache and
  verifying it create, move and delete nothing (a missing file tier's directory is
  ``CacheDirMissingError``): no quarantine, no temp-file reaping, no quota
  enforcement, no sweeper; every bad file is reported instead.
- A row's prompt text reaches a tier only with ``CacheConfig.store_prompt_text``; otherwise
  ``save`` blanks it, whoever built the request.
- A tier that cannot be reached (``CacheIOError``, e.g. a dead s3 store) costs a miss or a
  dropped save, counted in ``store_errors``; the row stays indexed (the store may come back).
See docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from types import TracebackType

from kvwarm.cache.api import LoadedRow, VerifyReport
from kvwarm.cache.counters import HIT_COUNTERS, Counters
from kvwarm.cache.eviction import build_policy
from kvwarm.cache.explain import MissHistory, MissReason, ReuseReport
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.index.index import Index
from kvwarm.cache.protocols import RowEvents, Tier, TierCapabilities
from kvwarm.cache.store.core import CacheCore, ScratchBuffers
from kvwarm.cache.store.reads import LOCAL_READ_HELPERS, READ_PARALLEL, RowReads
from kvwarm.cache.store.saves import Saves
from kvwarm.cache.store.writer import WriterPool
from kvwarm.cache.tiers.registry import TierOptions, build_tier
from kvwarm.cache.types import (
    DEFAULT_GRACE_S,
    CacheConfig,
    EvictResult,
    Namespace,
    PrefixMatch,
    PressureConfig,
    RowInfo,
    SaveRequest,
    SweepResult,
    TierName,
)
from kvwarm.cache.upkeep.pressure import PressureScheduler, PressureSource, make_source
from kvwarm.cache.upkeep.scans import CacheUpkeep
from kvwarm.cache.upkeep.shared import SharedTiers
from kvwarm.cache.upkeep.sharedgc import SharedSweep, SweepStep
from kvwarm.cache.validate import validate_cache_config
from kvwarm.errors import CacheError, ConfigError, InvalidRequestError

__all__ = ["Cache"]

log = logging.getLogger(__name__)


class Cache:
    """A multi-tier, token-exact KV cache. Thread-safe; close it (or use ``with``).

    Composed of explicit collaborators, each with its own state: the ``Index`` (rows,
    reservations, eviction order), the ``CacheCore`` (the tiers and the primitives that turn
    index decisions into tier calls), ``RowReads`` (reading a row), ``Saves`` (saving one),
    ``CacheUpkeep`` (scans, sweeps, verify), ``SharedTiers`` (discovery in shared tiers,
    promotion) and ``SharedSweep`` (chunk mark-and-sweep). This class holds them and implements
    ``api.CacheApi`` by calling them; none inherits from another."""

    def __init__(
        self,
        config: CacheConfig | None = None,
        *,
        tiers: Sequence[Tier] | None = None,
        pressure_source: PressureSource | Callable[[], tuple[int, int]] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        background: bool = True,
        repair: bool = True,
        maintenance: bool = False,
    ) -> None:
        """``tiers`` replaces the tiers built from ``config.tiers`` (tests, custom storage);
        ``clock``/``monotonic`` drive TTLs and reservation deadlines; ``background=False``
        starts no sweeper or pressure thread (call ``gc()``/``pressure.tick()`` yourself);
        ``repair=False`` opens the cache read-only for inspection (see the module invariants);
        ``maintenance=True`` opens it for a process that saves nothing (``kvwarm cache gc``,
        ``verify --repair``): it evicts nothing to meet a tier's quota (the quotas its settings
        give may not be the server's, and a row it evicted for one was deleted without a word),
        and its file tiers register as maintenance, which the processes writing them do not
        count as a co-tenant (``tiers/cotenants.py``).
        """
        self.config = config if config is not None else CacheConfig()
        validate_cache_config(self.config)
        self._counters = Counters()
        self._index = Index(
            reservation_ttl_s=self.config.reservation_ttl_s,
            ttl_seconds=self.config.ttl_seconds,
            clock=clock,
            monotonic=monotonic,
            eviction=build_policy(self.config.eviction),
            eviction_name=self.config.eviction,
            history=MissHistory(clock=clock),
        )
        self._history = self._index.history
        # Unsalted namespaces of the models using this cache (``note_namespace``): where
        # ``explain_miss`` may look besides the request's own. Bounded, oldest first out.
        self._bases: dict[Namespace, None] = {}
        self._bases_lock = threading.Lock()
        # Everything that can refuse the configuration runs before any thread starts.
        source: PressureSource | None = None
        if self.config.pressure.enabled:
            source = make_source(
                pressure_source if pressure_source is not None else self.config.pressure.source
            )
        own_tiers = tiers is None
        if tiers is None:
            options = TierOptions(repair=repair, maintenance=maintenance)
            built: list[Tier] = []
            try:
                for tc in self.config.tiers:
                    built.append(build_tier(tc, options))
            except BaseException:
                for tier in built:  # a later tier refused: the earlier ones hold fds
                    tier.close()
                raise
            tiers = built
        self._tiers: dict[TierName, Tier] = {tier.name: tier for tier in tiers}
        pressure = self.config.pressure
        if source is not None:
            try:
                pressure = self._pressure_config()
            except ConfigError:
                if own_tiers:
                    for tier in tiers:
                        tier.close()
                raise
        self._closed = False
        self._scratch = ScratchBuffers()
        self._close_lock = threading.Lock()
        self._stop = threading.Event()
        self._writer = WriterPool(self.config.writer_threads, self.config.writer_queue)
        self._core = CacheCore(
            self._index, self._tiers, self._counters, self._writer, quota_evictions=not maintenance
        )
        self._tiers = self._core.tiers  # one dict: the collaborators see the same tiers
        # Probes and chunk reads of a remote tier run concurrently; local directories are
        # read inline (a failed open costs microseconds, a thread hand-off more).
        self._remote_pool: ThreadPoolExecutor | None = None
        remote = any(not t.capabilities.local for t in self._core.shared_tiers())
        if remote and self.config.probe_max > 0:
            self._remote_pool = ThreadPoolExecutor(
                max_workers=self.config.probe_parallel, thread_name_prefix="kvwarm-probe"
            )
        # A row's chunk GETs go at once, up to READ_PARALLEL (a probe's bound is its own).
        self._read_pool = (
            ThreadPoolExecutor(max_workers=READ_PARALLEL, thread_name_prefix="kvwarm-read")
            if remote
            else None
        )
        # A local row's chunk files are read by the restoring thread and helpers together.
        local_files = any(
            t.capabilities.local and t.capabilities.persistent for t in self._tiers.values()
        )
        self._local_read_pool = (
            ThreadPoolExecutor(max_workers=LOCAL_READ_HELPERS, thread_name_prefix="kvwarm-readl")
            if local_files and LOCAL_READ_HELPERS
            else None
        )
        self._shared = SharedTiers(self._core, self.config, self._remote_pool)
        self._reads = RowReads(
            self._core,
            self._scratch,
            self._read_pool,
            self._shared.promote,
            self._local_read_pool,
            LOCAL_READ_HELPERS,
        )
        self._saves = Saves(
            self._core, self.config, self._writer, self._history, lambda: self._closed
        )
        self._sweep = SharedSweep(self._core)
        self._upkeep = CacheUpkeep(
            self._core, self._sweep, sweep_interval_s=self.config.sweep_interval_s, stop=self._stop
        )
        for tier in self._tiers.values():
            self._upkeep.scan(tier)
        self._index.resort()
        for tier in self._tiers.values():
            if repair:
                self._core.enforce_quota(tier)
        self.pressure: PressureScheduler | None = None
        if source is not None:
            self.pressure = PressureScheduler(pressure, source, self.evict_bytes)
        self._sweeper: threading.Thread | None = None
        if background and repair:
            self._sweeper = threading.Thread(
                target=self._upkeep.sweep_loop, name="kvwarm-sweep", daemon=True
            )
            self._sweeper.start()
            if self.pressure is not None:
                self.pressure.start()

    def _pressure_config(self) -> PressureConfig:
        """The pressure settings with ``evict_tiers`` cut to the tiers this cache has: a
        built-in name it lacks (the default names ``ram`` and ``ram_file``) made every
        eviction an ``InvalidRequestError``, so no tick ever freed a byte (found by review).
        ``ConfigError`` when none is left (tiers given to the constructor under other names)."""
        cfg = self.config.pressure
        present = tuple(name for name in cfg.evict_tiers if name in self._tiers)
        if not present:
            raise ConfigError(
                f"pressure.evict_tiers ({', '.join(cfg.evict_tiers)}) names none of this "
                f"cache's tiers ({', '.join(self._tiers)}): the scheduler could evict nothing"
            )
        return dataclasses.replace(cfg, evict_tiers=present)

    # ------------------------------------------------------------------ lookups

    def has(self, key: bytes) -> bool:
        """Published or being saved right now. Counts nothing; never waits."""
        return key in self._index or self._index.in_flight(key)

    def tier_names(self) -> tuple[TierName, ...]:
        """The configured tiers, in configuration order (the first is the default save tier)."""
        return tuple(self._tiers)

    def tier_capabilities(self) -> dict[TierName, TierCapabilities]:
        """What each configured tier is (persistent, shared with other processes, local)."""
        return {name: tier.capabilities for name, tier in self._tiers.items()}

    def watch_rows(self, events: RowEvents | None) -> None:
        """Tell ``events`` of every row indexed now and of every row that joins or leaves the
        index from here on (``protocols.RowEvents``; None stops)."""
        self._index.watch_rows(events)

    def key_for(self, namespace: Namespace, tokens: Sequence[int]) -> bytes:
        return cache_key(namespace, tokens)

    def hold(self, key: bytes) -> None:
        self._saves.hold(key)

    def release(self, key: bytes) -> None:
        self._saves.release(key)

    def lookup_exact(self, key: bytes) -> RowInfo | None:
        # A lookup, not a restore: counts nothing (the engine counts what served a request).
        info = self._index.get(key)
        if info is None:
            info = self._core.probe(key)
        return info

    def settled(self, key: bytes, timeout_s: float) -> bool:
        """Whether the row of ``key`` is published, after waiting up to ``timeout_s`` for a
        save of it in flight to end. Counts nothing."""
        return self._index.wait_for(key, timeout_s) is not None

    def lookup_exact_or_wait(self, key: bytes, timeout_s: float) -> RowInfo | None:
        # A read of the row's metadata (GET /cache/rows/{key}), not a restore: counts nothing.
        info = self._index.wait_for(key, timeout_s)
        if info is None:
            info = self._core.probe(key)
        return info

    def longest_prefix(
        self,
        namespace: Namespace,
        tokens: Sequence[int],
        *,
        min_shared: int = 1,
        probe_lengths: Sequence[int] = (),
    ) -> PrefixMatch | None:
        # Latency is not recorded here: the engine times its whole lookup step as "lookup"
        # (record_latency), and counting it twice would double the reported total. No hit is
        # counted either: the row found may go unused (live KV serves the prompt, the restore
        # fails), so the engine counts what served the request (record_hit, record_miss).
        match = self._index.longest(namespace, tokens, min_shared)
        floor = max(min_shared - 1, 0 if match is None else match.n_shared)
        if probe_lengths and self._shared.discover(namespace, tokens, probe_lengths, floor):
            match = self._index.longest(namespace, tokens, min_shared)
        return match

    def whole_prefixes(
        self, namespace: Namespace, tokens: Sequence[int], limit: int = 4
    ) -> list[PrefixMatch]:
        # Rows the index knows: shared tiers are probed at the lengths longest_prefix asks
        # for (cold saves, turn ends), and a row found there is in the index from then on.
        return self._index.whole_prefixes(namespace, tokens, limit)

    # ------------------------------------------------------------------ explaining misses

    def note_namespace(self, namespace: Namespace) -> None:
        """A model serves under this (unsalted) namespace: ``explain_miss`` may name its rows
        to requests of the same salt under another model, adapter set or context."""
        if namespace in self._bases:  # every request asks: the common case takes no lock
            return
        with self._bases_lock:
            self._bases[namespace] = None
            while len(self._bases) > 64:
                del self._bases[next(iter(self._bases))]

    def noted_namespaces(self) -> tuple[Namespace, ...]:
        with self._bases_lock:
            return tuple(self._bases)

    def explain_miss(
        self,
        namespace: Namespace,
        tokens: Sequence[int],
        beyond: int,
        others: Sequence[Namespace] = (),
    ) -> ReuseReport | None:
        """What would have served more than ``beyond`` tokens of ``tokens`` and did not: a
        row of ``namespace`` that is gone (evicted, expired, unreadable), a save of it dropped
        or still in flight, or a live row in one of ``others`` (another adapter set, model or
        context the caller may learn about). None: nothing did. Counts nothing."""
        best = self._history.lookup(namespace, tokens, beyond)
        for other in others:
            if other == namespace:
                continue
            match = self._index.longest(other, tokens)
            floor = beyond if best is None else best.found_tokens
            if match is not None and match.n_shared > floor:
                differs = "fingerprint" if other.fingerprint != namespace.fingerprint else "context"
                if other.quant != namespace.quant:
                    differs = "quant"
                best = ReuseReport(
                    MissReason.OTHER_NAMESPACE, match.n_shared, 0, None, match.row.tier, differs
                )
        return best

    # ------------------------------------------------------------------ reading a row

    def open_row(
        self, key: bytes, *, chunks: bool = True, payload: bool = True, from_token: int = 0
    ) -> AbstractContextManager[LoadedRow]:
        return self._reads.open_row(key, chunks=chunks, payload=payload, from_token=from_token)

    def chunk_lens(self, key: bytes) -> tuple[int, ...]:
        return self._index.chunk_lens(key)

    # ------------------------------------------------------------------ saving

    def save(
        self, request: SaveRequest, *, sync: bool = False, timeout_s: float = 30.0
    ) -> bytes | None:
        return self._saves.save(request, sync=sync, timeout_s=timeout_s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self._saves.flush(timeout_s)

    # ------------------------------------------------------------------ removing

    def evict_bytes(self, n_bytes: int, tiers: Sequence[TierName] | None = None) -> EvictResult:
        # A tier not configured here (a typo) freed nothing and said so as "0 rows": refused.
        # So is an empty list, which did the same (found by review): None means every tier.
        if tiers is not None and not tiers:
            raise InvalidRequestError(
                "tiers is empty: name at least one tier, or leave it out for every tier",
                param="tiers",
            )
        unknown = [t for t in tiers or () if t not in self._tiers]
        if unknown:
            raise InvalidRequestError(
                f"no tier {unknown[0]!r} in this cache (its tiers: {', '.join(self._tiers)})",
                param="tiers",
            )
        return self._core.retire(self._index.evict(n_bytes, tiers), count=True)

    def delete(self, key: bytes) -> bool:
        # True only where a row's bytes were removed: one whose delete the tier refused (a
        # disk gone read-only) stays stored and indexed (``CacheCore.retire``), and was
        # reported deleted all the same (found by review).
        row = self._index.remove(key)
        found = False
        if row is not None:
            info = row.info
            self._history.gone(
                info.namespace, key, row.tokens, MissReason.EVICTED, info.tier, "deleted"
            )
            found = self._core.retire([row]).rows > 0
        # Also a copy in a shared tier: another process's row we never adopted, or the one
        # a promotion copied into ram from (found by review: deleting the ram copy alone
        # answered True, and the next lookup found the row in the shared store again).
        for tier in self._core.shared_tiers():
            if row is not None and tier.name == row.info.tier:
                continue
            try:
                stray = tier.probe(key)
            except CacheError as exc:
                if row is None:
                    raise
                # The row itself is gone; a store that is down keeps its copy for now.
                self._counters.incr("store_errors")
                log.warning(
                    "%s: deleted %s, but cannot look for its copy: %s", tier.name, key.hex(), exc
                )
                continue
            if stray is not None and self._core.retire([stray]).rows:
                found = True
        return found

    def resize_tier(self, name: TierName, quota_bytes: int) -> None:
        """Give the ram tier ``name`` a new quota and evict down to it now (the memory
        budget)."""
        self._core.resize_tier(name, quota_bytes)

    def rows(self, namespace: Namespace | None = None) -> list[RowInfo]:
        return self._index.rows(namespace)

    def row_tokens(self, key: bytes) -> tuple[int, ...] | None:
        return self._index.tokens(key)

    # ------------------------------------------------------------------ counting

    def record_hit(self, counter: str) -> None:
        if counter not in HIT_COUNTERS:
            raise ValueError(f"not a hit counter: {counter!r} (one of {', '.join(HIT_COUNTERS)})")
        self._counters.incr(counter)

    def record_miss(self) -> None:
        self._core.record_miss()

    def record_admission_failure(self) -> None:
        self._core.record_admission_failure()

    def record_restore(self, tier: TierName, nbytes: int, seconds: float) -> None:
        self._core.record_restore(tier, nbytes, seconds)

    def record_latency(self, name: str, seconds: float) -> None:
        self._core.record_latency(name, seconds)

    def counters(self) -> Mapping[str, float]:
        return self._core.snapshot()

    # ------------------------------------------------------------------ upkeep (upkeep.py,
    # sharedgc.py)

    def gc(self, *, count_downtime: bool = False) -> EvictResult:
        """Remove expired (TTL) rows and reap stale reservations now."""
        return self._upkeep.gc(count_downtime=count_downtime)

    def verify(self, *, repair: bool = False) -> VerifyReport:
        return self._upkeep.verify(repair=repair)

    def rescan(self) -> int:
        """Adopt rows other processes published in shared tiers since we last looked."""
        return self._upkeep.rescan()

    def persist_hits(self) -> None:
        """Write batched hit counts and last-used times to the tiers."""
        self._upkeep.persist_hits()

    def sweep(self) -> None:
        """One sweeper pass (TTL, reservations, hits, rescans, the local chunk sweep)."""
        self._upkeep.sweep()

    def sweep_local(self, grace_s: float = DEFAULT_GRACE_S, *, force: bool = False) -> None:
        """The chunk sweep of local directories other processes use (``sharedgc.py``)."""
        self._sweep.sweep_local(grace_s, force=force)

    def gc_shared(
        self,
        grace_s: float = DEFAULT_GRACE_S,
        *,
        now: float | None = None,
        on_step: SweepStep | None = None,
    ) -> list[SweepResult]:
        return self._sweep.gc_shared(grace_s, now=now, on_step=on_step)

    # ------------------------------------------------------------------ lifetime

    def close(self, timeout_s: float = 30.0) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self.pressure is not None:
            self.pressure.stop()
        if self._sweeper is not None:
            self._sweeper.join(timeout_s)
        self._shutdown_remote_pool()
        if not self._writer.close(timeout_s):
            log.warning("cache closed with saves still running")
        self._index.clear_all_in_flight()
        try:
            self._upkeep.persist_hits()
        finally:
            for tier in self._tiers.values():
                try:
                    tier.close()
                except Exception:
                    log.exception("%s: close failed", tier.name)

    def _shutdown_remote_pool(self) -> None:
        for pool in (self._remote_pool, self._read_pool, self._local_read_pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Cache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
