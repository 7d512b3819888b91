"""Saving a row for ``Cache.save``: plan its cuts, pack what the tier lacks, mark it in flight
and hand it to the bounded writer pool, which stores it through the tier's publish protocol (a
collaborator of the facade, handed the ``CacheCore``, the writer pool and the miss history).

Invariants: a key is marked in flight before ``save`` returns and unmarked when its job ends
(published, failed or dropped), so ``lookup_exact_or_wait`` never waits for a save that cannot
come; a save that cannot be packed or queued is dropped (counted and remembered as the row's
miss reason), never a failed request; a row's prompt text reaches a tier only with
``CacheConfig.store_prompt_text``; ``flush`` waits for held keys before draining the writer;
a row larger than its save tier's quota is saved, through the same publish protocol, to the
first tier after it that is local to this host and whose quota holds it (``_place``, then
``_store`` for what only the writer's exact check finds), never to a tier other processes
share, and refused only when no such tier holds it (docs/cache.md, "Where a save goes"); so
is a row its save tier has no room for when it is stored (``_store``: the rest of the tier
checked out or held by saves in flight, a full filesystem with nothing left to evict).
See docs/architecture.md ("Chunks").
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from kvwarm.cache.explain import MissHistory, MissReason
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.index.inflight import Holds
from kvwarm.cache.protocols import StoredRow, Tier
from kvwarm.cache.store.chunking import (
    NoRoomError,
    PlanBook,
    RowTooLargeError,
    pack_request,
    pin_lead,
    row_size,
)
from kvwarm.cache.store.core import CacheCore
from kvwarm.cache.store.writer import WriterPool
from kvwarm.cache.types import CacheConfig, SaveRequest, TierName
from kvwarm.errors import (
    CacheError,
    CacheIOError,
    CacheNetworkError,
    InvalidRequestError,
    KvwarmError,
)

__all__ = ["Saves"]

log = logging.getLogger(__name__)

# Why a row left its save tier (``Saves._spilled``'s line).
_TOO_LARGE = "is larger than the tier's quota"
_NO_ROOM = "has no room now"


class Saves:
    """The saves of one cache. ``closed`` says whether the cache was closed (its tiers are,
    so nothing could be stored)."""

    def __init__(
        self,
        core: CacheCore,
        config: CacheConfig,
        writer: WriterPool,
        history: MissHistory,
        closed: Callable[[], bool],
    ) -> None:
        self._core = core
        self._config = config
        self._writer = writer
        self._history = history
        self._closed = closed
        self._plans = PlanBook()
        self._holds = Holds()
        # (save tier, spill tier, why) said at INFO
        self._said: set[tuple[TierName, TierName, str]] = set()
        self._said_lock = threading.Lock()

    def hold(self, key: bytes) -> None:
        self._holds.take()
        self._core.index.mark_in_flight(key)

    def release(self, key: bytes) -> None:
        self._core.index.clear_in_flight(key)
        self._holds.give()

    def save(
        self, request: SaveRequest, *, sync: bool = False, timeout_s: float = 30.0
    ) -> bytes | None:
        """``CacheApi.save``: the row's key once the save is accepted (published when it
        runs), None when it was dropped."""
        tier = self._core.tiers.get(request.tier)
        if tier is None:
            raise InvalidRequestError(
                f"cache tier {request.tier!r} is not configured", param="tier"
            )
        if request.prompt_text and not self._config.store_prompt_text:
            request = replace(request, prompt_text="")
        key = cache_key(request.namespace, request.tokens)
        if key in self._core.index:
            return key  # already published: the bytes would be identical
        if self._closed():  # tiers are closed: nothing could be stored
            self._core.counters.incr("saves_dropped")
            return None
        # Cuts are planned now, in submission order, so saves queued together line up; then
        # the payload is packed (only what the tier lacks), before the save is announced.
        lens = self._plans.plan(key, request, self._core.index, self._config.chunk_tokens)
        if lens is not None:
            request = replace(request, chunk_lens=lens)
        save_tier = tier.name
        try:
            # A row larger than its save tier's quota goes to the next tier that can hold it.
            tier, request, lead = self._place(tier, request, lens)
        except (KvwarmError, MemoryError) as exc:
            # The backend could not copy the state out (llama.cpp refused, no memory for
            # the blob): a dropped save, never a failed request or a dead worker.
            self._plans.done(key)
            log.warning("%s save dropped: packing failed: %s", request.reason.name, exc)
            self._history.gone(
                request.namespace, key, request.tokens, MissReason.SAVE_DROPPED,
                request.tier, "pack_failed",
            )  # fmt: skip
            self._core.counters.incr("save_failures")
            self._core.counters.incr("saves_dropped")
            return None
        except BaseException:
            self._plans.done(key)
            raise
        planned = request
        self._core.index.mark_in_flight(key)
        self._history.saving(key, request.namespace, request.tokens, request.tier)

        def job() -> bool:
            try:
                return self._run_save(key, planned, tier, save_tier)
            finally:
                self._core.index.unpin_chunks(tier.name, lead)
                self._plans.done(key)
                self._history.saved(key)

        if sync:
            try:
                return key if self._writer.submit_sync(job, timeout_s) else None
            except TimeoutError:
                log.warning(
                    "sync %s save still running after %.1fs", request.reason.name, timeout_s
                )
                return None
        if not self._writer.submit(job):
            self._core.index.unpin_chunks(tier.name, lead)
            self._plans.done(key)
            self._history.saved(key)
            self._dropped(key, request, "queue_full")
            self._core.counters.incr("saves_dropped")
            return None
        return key

    def _place(
        self, tier: Tier, request: SaveRequest, lens: tuple[int, ...] | None
    ) -> tuple[Tier, SaveRequest, list[bytes]]:
        """The tier a save goes to, its request packed for it (``request.pack``: only what
        that tier lacks), and the chunks of that tier the packed tail goes after, pinned there
        until the save has run (``pin_lead``: the caller unpins them). Its save tier, unless
        the row is larger than that tier's quota: then the first of ``CacheCore.spill_tiers``
        whose quota holds it, its payload packed again when that tier lacks leading chunks the
        save tier had (a conversation whose next turn outgrew the ram tier). None can: its
        save tier, which refuses it. On the saving (worker) thread, so against the configured
        quotas only: a file tier's effective quota asks its filesystem (``statvfs``: an NFS
        mount can hang), which the writer does (``_store``)."""
        index = self._core.index
        unpacked = request
        held: list[tuple[int, int]] = []
        lead: list[bytes] = []
        try:
            if request.pack is not None:
                held, lead = pin_lead(request, tier, index, lens)
                request = pack_request(request, tier, index, lens, held)
            size = row_size(request, held)
            if size <= tier.quota_bytes:
                return tier, request, lead
            for other in self._core.spill_tiers(tier):
                if size > other.quota_bytes:
                    continue
                index.unpin_chunks(tier.name, lead)
                tier, lead = other, []  # what is pinned from here on is other's
                if request.payload_from and unpacked.pack is not None:
                    there, lead = pin_lead(unpacked, other, index, lens)
                    if request.payload_from > (there[-1][0] if there else 0):
                        request = unpacked  # the save tier's tail is freed before a new pack
                        request = pack_request(unpacked, other, index, lens, there)
                return other, replace(request, tier=other.name), lead
            return tier, request, lead
        except BaseException:
            index.unpin_chunks(tier.name, lead)
            raise

    def _spilled(self, save_tier: TierName, row: StoredRow, why: str) -> None:
        """A row was published in a later tier than its save tier (``why`` it left that
        tier: too large for its quota, no room there now): counted, and said at INFO the
        first time each pair of tiers sees it for that reason, at DEBUG after (a long context
        outgrows a tier turn after turn: one line, not a warning a save)."""
        self._core.counters.incr("saves_spilled")
        said = (save_tier, row.info.tier, why)
        with self._said_lock:
            first = said not in self._said
            self._said.add(said)
        log.log(
            logging.INFO if first else logging.DEBUG,
            "%s: row %s (%d tokens) %s: saved to %s instead%s",
            save_tier,
            row.info.key.hex(),
            row.info.n_tokens,
            why,
            row.info.tier,
            " (said once per tier; counted in saves_spilled)" if first else "",
        )

    def _store(
        self, key: bytes, request: SaveRequest, tier: Tier
    ) -> tuple[Tier, StoredRow | None, str]:
        """``CacheCore.store_row`` into ``tier``; the tier that took the row, and why not
        ``tier`` ("" when it did). A row ``tier`` refuses for room it cannot make goes to the
        first of ``CacheCore.spill_tiers`` that takes it, where its payload serves that tier;
        else the refusal stands. That is a row its exact check finds larger than the
        effective quota (``_place`` estimated it before its payload was cut, against the
        configured quota, which a filesystem short of room or a memory budget may have cut
        since), one within the quota that the tier has no room for now (a ram tier whose
        other rows are checked out, or held by saves in flight: ``NoRoomError``), and one a
        full filesystem refuses with nothing of the tier left to evict (ENOSPC): under load
        as in a quiet moment, a later tier with room saves it."""
        chunk_tokens = self._config.chunk_tokens
        try:
            return tier, self._core.store_row(key, request, tier, chunk_tokens), ""
        except CacheError as exc:
            size = exc.size if isinstance(exc, RowTooLargeError) else None
            if size is not None:
                why = _TOO_LARGE
            elif isinstance(exc, NoRoomError) or _out_of_space(exc):
                why = _NO_ROOM
            else:
                raise
            for other in self._core.spill_tiers(tier):
                if size is not None and size > self._core.limit(other):
                    continue
                try:
                    row = self._core.store_row(
                        key, replace(request, tier=other.name), other, chunk_tokens
                    )
                except CacheError as not_there:
                    log.info("%s: %s not spilled to %s: %s", tier.name, key.hex(), other.name,
                             not_there)  # fmt: skip
                    continue
                return other, row, why
            raise

    def _dropped(self, key: bytes, request: SaveRequest, why: str) -> None:
        """A save that will not publish: remembered as the row's miss reason, no longer in
        flight."""
        self._history.gone(
            request.namespace, key, request.tokens, MissReason.SAVE_DROPPED, request.tier, why
        )
        self._core.index.clear_in_flight(key)

    def _run_save(self, key: bytes, request: SaveRequest, tier: Tier, save_tier: TierName) -> bool:
        t0 = time.perf_counter()
        published = False
        try:
            placed = tier.name
            tier, row, why = self._store(key, request, tier)
            published = True
        except CacheNetworkError as exc:
            # The tier warned when the store went down; one line per dropped save is noise.
            self._core.counters.incr("save_failures")
            self._core.counters.incr("store_errors")
            log.info("%s: %s save dropped: %s", tier.name, request.reason.name, exc)
            return False
        except CacheError as exc:
            self._core.counters.incr("save_failures")
            log.warning("%s: %s save failed: %s", tier.name, request.reason.name, exc)
            return False
        except Exception:
            self._core.counters.incr("save_failures")
            log.exception("%s: %s save failed", tier.name, request.reason.name)
            return False
        finally:
            if published:
                self._core.index.clear_in_flight(key)
            else:
                self._dropped(key, request, "failed")
        self._core.counters.record_latency("save", time.perf_counter() - t0)
        if row is None:  # another writer had it reserved or published: fine if it is there now
            return key in self._core.index
        self._core.counters.record_save(request.reason)
        if tier.name != save_tier:  # ``_place`` spills only rows too large for its quota
            self._spilled(save_tier, row, why if placed == save_tier else _TOO_LARGE)
        self._core.retain(tier, row, self._config.state_history)
        self._core.enforce_quota(tier)
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        if not self._holds.wait_none(timeout_s):
            return False
        return self._writer.drain(max(0.0, deadline - time.monotonic()))


def _out_of_space(exc: CacheError) -> bool:
    """Whether ``exc`` is a full filesystem's refusal that evicting from the tier did not
    cure (``CacheCore.store_row`` evicts and retries once before it raises it)."""
    return isinstance(exc, CacheIOError) and exc.errno == errno.ENOSPC
