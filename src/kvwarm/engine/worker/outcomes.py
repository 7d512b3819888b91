"""Outcomes: how a request leaves its slot — finished (with its finish save), failed, or
cancelled before it started.

Invariant: every request gets exactly one final event on its channel (``Done`` or
``Failed``), and the slot it held is free afterwards (``docs/architecture.md``, "Engine"). A
request that leaves before its prompt KV was forked takes its waiting forks (``n > 1``) with it:
they are cancelled or failed alike, never left waiting.
"""

from __future__ import annotations

import logging
import time

from kvwarm.engine.request import Done, Failed, Fragment, Request
from kvwarm.engine.types import Completion, CompletionStats, FinishReason
from kvwarm.engine.worker.cacheport import CachePort
from kvwarm.engine.worker.runtime import Runtime
from kvwarm.engine.worker.slots import Active, Slot
from kvwarm.errors import BackendError, KvwarmError

log = logging.getLogger(__name__)


def unexpected(exc: Exception, name: str) -> KvwarmError:
    """``exc`` as the typed error a request fails with: itself if a ``KvwarmError``, else
    (a bug, logged with its traceback) a ``BackendError`` naming it. One slot's step that
    raises fails that slot's request only, never the others' (``loop.py``)."""
    if isinstance(exc, KvwarmError):
        return exc
    log.error("worker %s: unexpected error in one slot's step", name, exc_info=exc)
    err = BackendError(f"the worker failed this request: {exc!r}")
    err.__cause__ = exc
    return err


class Outcomes:
    def __init__(self, rt: Runtime, port: CachePort) -> None:
        self.rt = rt
        self.port = port

    def finish(
        self, slot: Slot, reason: FinishReason, logits: bytes | None, *, score: float | None = None
    ) -> None:
        act = slot.active
        assert act is not None
        _drop_encodes(act)
        for waiting in self._take_forks(slot):
            self.finish(waiting, "cancelled", None)
        now = time.perf_counter()
        tail = act.assembler.finish()
        rest = act.unsent_logprobs()
        if (tail or rest) and act.req.fragments:
            act.req.channel.put(Fragment(tail, rest))
        key, held = self.port.finishing(slot)
        act.sampler.close()
        if not act.prefill_done:
            act.prefill_done = now
        stats = CompletionStats(
            prompt_tokens=len(act.req.prompt_tokens),
            cached_tokens=act.cached_tokens,
            completion_tokens=len(act.generated),
            prefill_ms=(act.prefill_done - act.admitted) * 1e3,
            generation_ms=(now - act.prefill_done) * 1e3,
            queue_ms=(act.admitted - act.req.submitted) * 1e3,
            cache_hit=act.hit_kind,
            finish_reason=reason,
            key=key,
            stop_sequence=act.assembler.matched,
            stopped_by=act.stopped_by,
            reuse=act.reuse,
            drafted_tokens=act.drafted,
            accepted_tokens=act.accepted,
            sampled_tokens=act.sampled,
            decode_steps=max(0, act.sampled - 1),
            decode_ms=(act.last_sampled - act.first_sampled) * 1e3,
        )
        self.rt.stats.account(stats, upkeep=act.req.upkeep, fork=act.fork)
        completion = Completion(
            text=act.assembler.text,
            prompt_tokens=act.req.prompt_tokens,
            completion_tokens=tuple(act.generated),
            stats=stats,
            logprobs=tuple(act.logprobs) if act.req.options.logprobs is not None else None,
            prompt_logprobs=(
                tuple(act.prompt_logprobs) if act.req.options.prompt_logprobs is not None else None
            ),
            score=score,
        )
        # The caller has its answer before the finish save packs the sequence (a copy of
        # every cell, the largest cost of a cached request): the pack runs while the reply
        # goes out, and the row it names may still be in flight (``stats.key``). Its slot is
        # shown free first: a caller who got its answer never sees it busy.
        self.rt.publish(freed=slot)
        act.req.answer(Done(completion))
        self.port.finished(slot, held, logits)
        if self.rt.cfg.whole:
            self.rt.reset_seq(slot)  # an encoder's KV serves no other prompt
        slot.active = None
        slot.phase = "idle"
        slot.last_used = time.monotonic()
        self.rt.publish()

    def _take_forks(self, slot: Slot) -> list[Slot]:
        """The slots still waiting for ``slot``'s prompt KV; they are no longer its forks."""
        act = slot.active
        assert act is not None
        forks = [s for s in act.forks if s.active is not None and s.active.req in act.req.forks]
        act.forks = []
        return forks

    def fail(self, slot: Slot, exc: BaseException) -> None:
        act = slot.active
        if act is None:
            return
        _drop_encodes(act)
        for waiting in self._take_forks(slot):
            self.fail(waiting, exc)
        slot.active = None
        slot.phase = "idle"
        try:
            try:
                act.sampler.close()
            finally:
                self.rt.reset_seq(slot)
        except KvwarmError:
            slot.reset_kv()
        finally:
            # Answered whatever the cleanup raised (found by review: an unexpected error from
            # seq_rm left the caller waiting for ever, its slot already marked free).
            self.rt.publish()
            act.req.answer(Failed(exc))

    def fail_all_active(self, exc: BaseException) -> None:
        for slot in self.rt.slots:
            self.fail(slot, exc)

    def ended_like(self, req: Request, after: Request | None) -> None:
        """A queued request that will not start: cancelled, or ``after`` a request that
        failed (the same error) or was cancelled."""
        out = None if after is None else after.outcome
        if isinstance(out, Failed) and not req.cancelled.is_set():
            for one in req.group:
                one.answer(Failed(out.error))
        else:
            self.cancelled_unstarted(req)

    def cancelled_unstarted(self, req: Request) -> None:
        """A request (and its forks) cancelled while still queued: a cold, empty ``Done``,
        counted like every request that ended (found by review: the server counted it in
        ``kvwarm_generations_total{reason="cancelled"}`` and the model nowhere, so
        ``kvwarm_requests_total`` fell behind). Runs on the worker's thread or on the
        canceller's (``Worker.cancel``)."""
        now = time.perf_counter()
        stats = CompletionStats(
            prompt_tokens=len(req.prompt_tokens),
            cached_tokens=0,
            completion_tokens=0,
            prefill_ms=0.0,
            generation_ms=0.0,
            queue_ms=(now - req.submitted) * 1e3,
            cache_hit="cold",
            finish_reason="cancelled",
            key=None,
        )
        for one in req.group:
            if one.answered:  # answered already: counted then, or never to be
                continue
            self.rt.stats.account(stats, upkeep=one.upkeep)
            one.answer(Done(Completion("", req.prompt_tokens, (), stats)))


def _drop_encodes(act: Active) -> None:
    """The encodes of ``act``'s spans that have not started are cancelled as it ends: encodes
    run one at a time, in order, so a cancelled or failed request's queued pictures would be
    encoded for nobody while every later request's waited behind them."""
    for future in act.encodes.values():
        future.cancel()
    act.encodes.clear()
