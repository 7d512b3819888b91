"""Saving a row for ``Cache.save``: plan its cuts, pack what the tier lacks, mark it in flight
and hand it to the bounded writer pool, which stores it through the tier's publish protocol (a
collaborator of the facade, handed the ``CacheCore``, the writer pool and the miss history).

Invariants: a key is marked in flight before ``save`` returns and unmarked when its job ends
(published, failed or dropped), so ``lookup_exact_or_wait`` never waits for a save that cannot
come; a save that cannot be packed or queued is dropped (counted and remembered as the row's
miss reason), never a failed request; a row's prompt text reaches a tier only with
``CacheConfig.store_prompt_text``; ``flush`` waits for held keys before draining the writer.
See docs/architecture.md ("Chunks").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from kvwarm.cache.explain import MissHistory, MissReason
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.index.inflight import Holds
from kvwarm.cache.protocols import Tier
from kvwarm.cache.store.chunking import PlanBook, pack_request
from kvwarm.cache.store.core import CacheCore
from kvwarm.cache.store.writer import WriterPool
from kvwarm.cache.types import CacheConfig, SaveRequest
from kvwarm.errors import CacheError, CacheNetworkError, InvalidRequestError, KvwarmError

__all__ = ["Saves"]

log = logging.getLogger(__name__)


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
        if request.pack is not None:
            try:
                request = pack_request(request, tier, self._core.index, lens)
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
                return self._run_save(key, planned, tier)
            finally:
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
            self._plans.done(key)
            self._history.saved(key)
            self._dropped(key, request, "queue_full")
            self._core.counters.incr("saves_dropped")
            return None
        return key

    def _dropped(self, key: bytes, request: SaveRequest, why: str) -> None:
        """A save that will not publish: remembered as the row's miss reason, no longer in
        flight."""
        self._history.gone(
            request.namespace, key, request.tokens, MissReason.SAVE_DROPPED, request.tier, why
        )
        self._core.index.clear_in_flight(key)

    def _run_save(self, key: bytes, request: SaveRequest, tier: Tier) -> bool:
        t0 = time.perf_counter()
        published = False
        try:
            row = self._core.store_row(key, request, tier, self._config.chunk_tokens)
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
        self._core.retain(tier, row, self._config.state_history)
        self._core.enforce_quota(tier)
        return True

    def flush(self, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        if not self._holds.wait_none(timeout_s):
            return False
        return self._writer.drain(max(0.0, deadline - time.monotonic()))
