"""One worker thread per model: owns the ``llama_context`` and every slot's sequence.

Invariants:
- Only this thread touches the context (decode, pack, unpack, seq ops). Other threads talk to
  it through ``submit`` (requests, FIFO) and ``call`` (jobs run between ticks).
- A save's bytes are packed here, between decode calls, and handed to the cache's writer pool;
  async saves never block a tick.
- A request's namespace (effective fingerprint) is fixed when it is admitted to a slot; adapter
  changes are jobs that wait until no slot is active, so they never affect a running request.
- Any failure is confined to the requests it touches; the loop itself never dies while the
  model is loaded (an unexpected error fails the in-flight requests and clears their KV).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kvwarm.backends.base import BackendContext, BackendModel, BatchToken
from kvwarm.cache.api import CacheApi
from kvwarm.cache.policy import cold_save_length, should_continued_save, should_finish_save
from kvwarm.cache.types import (
    FingerprintMode,
    Namespace,
    PolicyConfig,
    SaveReason,
    SaveRequest,
    TierName,
    TtlClass,
)
from kvwarm.engine.batching import BatchStrategy, Chunk, PrefillWant
from kvwarm.engine.planner import Plan, better, canonical_after, common_prefix, usable_length
from kvwarm.engine.request import Done, Failed, Request
from kvwarm.engine.slots import Active, Slot
from kvwarm.engine.text import TextAssembler
from kvwarm.engine.types import (
    CacheHitKind,
    Completion,
    CompletionStats,
    FinishReason,
    TokenLogprob,
)
from kvwarm.errors import BackendError, EngineClosedError, KvwarmError, QueueFullError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class WorkerConfig:
    n_parallel: int
    n_ctx_slot: int
    n_batch: int
    n_ubatch: int
    policy: PolicyConfig
    save_tier: TierName
    quant_bits: int
    fingerprint_mode: FingerprintMode
    max_queue: int
    strategy: BatchStrategy


@dataclass(slots=True)
class WorkerStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_ms: float = 0.0
    generation_ms: float = 0.0
    ticks: int = 0
    hits: dict[str, int] = field(default_factory=lambda: {"exact": 0, "partial": 0, "cold": 0})


@dataclass(slots=True, eq=False)
class _Job:
    fn: Callable[[], object]
    future: Future[object]
    needs_idle: bool


class Worker:
    def __init__(
        self,
        name: str,
        model: BackendModel,
        ctx: BackendContext,
        cache: CacheApi,
        config: WorkerConfig,
        namespace: Callable[[], Namespace],
    ) -> None:
        self.name = name
        self.model = model
        self.ctx = ctx
        self.cache = cache
        self.cfg = config
        self._namespace = namespace
        self.slots = [Slot(seq=i) for i in range(config.n_parallel)]
        self.stats = WorkerStats()
        self._eog: tuple[int, ...] | None = None
        self._queue: deque[Request] = deque()
        self._jobs: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvwarm-{name}", daemon=True)
        self._thread.start()

    # ---- called from other threads -------------------------------------------------------

    def submit(self, req: Request) -> None:
        with self._cond:
            if self._closing:
                raise EngineClosedError(f"model {self.name!r} is shut down")
            if len(self._queue) >= self.cfg.max_queue:
                raise QueueFullError(
                    f"model {self.name!r} has {len(self._queue)} queued requests (max_queue)"
                )
            self._queue.append(req)
            self._cond.notify_all()

    def call(self, fn: Callable[[], T], *, needs_idle: bool = False) -> Future[T]:
        """Run ``fn`` on the worker thread between ticks (after active slots drain if
        ``needs_idle``)."""
        fut: Future[T] = Future()
        with self._cond:
            if self._closing:
                raise EngineClosedError(f"model {self.name!r} is shut down")
            self._jobs.append(_Job(fn, fut, needs_idle))  # type: ignore[arg-type]
            self._cond.notify_all()
        return fut

    def cancel(self, req: Request) -> None:
        """Cancel ``req``: answered here at once if still queued (even while the worker is
        inside a forward pass), else observed by the worker between tokens."""
        req.cancelled.set()
        with self._cond:
            try:
                self._queue.remove(req)
            except ValueError:
                queued = False
            else:
                queued = True
            self._cond.notify_all()
        if queued:
            self._reply_cancelled_unstarted(req)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return sum(1 for s in self.slots if s.active is not None)

    def stop(self, shutdown_save: Callable[[], object] | None, timeout_s: float) -> None:
        """Cancel everything, run ``shutdown_save`` on the worker, and end the thread."""
        with self._cond:
            if self._closing:
                pending_stop = True
            else:
                pending_stop = False
                self._closing = True
                self._shutdown_save = shutdown_save
                self._cond.notify_all()
        if not pending_stop:
            for req in list(self._queue):
                req.cancelled.set()
        self._closed.wait(timeout_s)

    # ---- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._has_work() and not self._closing:
                        self._cond.wait()
                    closing = self._closing
                if closing:
                    self._drain_on_close()
                    return
                try:
                    self._run_jobs()
                    self._admit()
                    self._tick()
                except Exception as exc:  # never let the loop die: fail what is in flight
                    log.exception("worker %s: unexpected error; failing active requests", self.name)
                    self._fail_all_active(exc)
        except BaseException:
            log.exception("worker %s: thread is dying; refusing further requests", self.name)
            with self._cond:
                self._closing = True
            self._drain_on_close()
            raise
        finally:
            self._closed.set()

    def _has_work(self) -> bool:
        if any(s.active is not None for s in self.slots):
            return True
        if self._jobs:
            return True
        return bool(self._queue) and not self._blocked_by_idle_job()

    def _blocked_by_idle_job(self) -> bool:
        return any(j.needs_idle for j in self._jobs)

    def _run_jobs(self) -> None:
        idle = all(s.active is None for s in self.slots)
        while True:
            with self._cond:
                if not self._jobs or (self._jobs[0].needs_idle and not idle):
                    return
                job = self._jobs.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(job.fn())
            except BaseException as exc:
                job.future.set_exception(exc)

    def _drain_on_close(self) -> None:
        for slot in self.slots:
            if slot.active is not None:
                self._finish(slot, "cancelled", None)
        while self._queue:
            req = self._queue.popleft()
            req.channel.put(Failed(EngineClosedError(f"model {self.name!r} was unloaded")))
        while self._jobs:
            job = self._jobs.popleft()
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(EngineClosedError(f"model {self.name!r} was unloaded"))
        save = getattr(self, "_shutdown_save", None)
        if save is not None:
            try:
                save()
            except Exception:
                log.exception("worker %s: shutdown save failed", self.name)

    # ---- admission ----------------------------------------------------------------------

    def _admit(self) -> None:
        if self._blocked_by_idle_job():
            return
        while True:
            free = [s for s in self.slots if s.active is None]
            if not free:
                return
            with self._cond:
                if not self._queue:
                    return
                req = self._queue.popleft()
            if req.cancelled.is_set():
                self._reply_cancelled_unstarted(req)
                continue
            try:
                self._start(req, free)
            except Exception as exc:
                self._admission_failed(req, exc)

    def _admission_failed(self, req: Request, exc: Exception) -> None:
        """Whatever went wrong, the caller gets an answer and no slot stays taken."""
        err: KvwarmError
        if isinstance(exc, KvwarmError):
            err = exc
        else:
            log.exception("worker %s: admission failed", self.name)
            err = BackendError(f"admission failed: {exc!r}")
            err.__cause__ = exc
        for slot in self.slots:
            if slot.active is not None and slot.active.req is req:
                self._fail(slot, err)
                return
        req.channel.put(Failed(err))

    def _plan(self, req: Request, free: Sequence[Slot]) -> tuple[Slot, Plan, Namespace]:
        tokens = req.prompt_tokens
        n = len(tokens)
        nb = self.cfg.n_batch
        det = req.deterministic
        ns = self._namespace()
        # Prefix affinity: the free slot whose own live KV shares the most with the prompt.
        best_slot = min(free, key=lambda s: s.last_used)
        best = Plan("none", 0)
        for slot in free:
            shared = common_prefix(slot.kv_tokens, tokens)
            keep, _ = usable_length(
                shared, n, canonical=slot.canonical, n_batch=nb, deterministic=det
            )
            cand = Plan("self", keep, shared=shared)
            if better(best, cand) is cand and keep > 0:
                best, best_slot = cand, slot
        if best.kind == "none":
            # Prefer an empty slot over overwriting a warm one.
            empty = [s for s in free if not s.kv_tokens]
            best_slot = empty[0] if empty else best_slot
        # Another slot's live KV (active or idle) can be shared with seq_cp.
        for other in self.slots:
            if other is best_slot or not other.kv_tokens:
                continue
            shared = common_prefix(other.kv_tokens, tokens)
            keep, _ = usable_length(
                shared, n, canonical=other.canonical, n_batch=nb, deterministic=det
            )
            cand = Plan("copy", keep, src_seq=other.seq, shared=shared)
            if keep > 0:
                best = better(best, cand)
        # The cache. A parent_key row was waited for on the caller's thread, so it is
        # published by now and this lookup scores it by what it really shares.
        t0 = time.perf_counter()
        match = self.cache.longest_prefix(ns, tokens)
        self.cache.record_latency("lookup", time.perf_counter() - t0)
        if match is not None:
            row = match.row
            shared = min(match.n_shared, n)
            keep, use_logits = usable_length(
                shared,
                n,
                canonical=row.canonical_tokens,
                n_batch=nb,
                deterministic=det,
                row_tokens=row.n_tokens,
                row_has_logits=row.has_logits,
            )
            if keep > 0:
                best = better(best, Plan("row", keep, use_logits, row_key=row.key, shared=shared))
        return best_slot, best, ns

    def _start(self, req: Request, free: Sequence[Slot]) -> None:
        slot, plan, ns = self._plan(req, free)
        tokens = req.prompt_tokens
        n = len(tokens)
        banned = self.eog_tokens() if req.options.ignore_eos else ()
        sampler = self.model.new_sampler(req.options.sampling(req.grammar, banned))
        logits_from_row: bytes | None = None
        keep = plan.keep
        try:
            source_canonical: int | None = None
            if plan.kind == "row":
                try:
                    keep, source_canonical, logits_from_row = self._restore_row(slot, plan, req)
                except KvwarmError as exc:
                    log.warning(
                        "worker %s: cache restore failed, prefilling cold: %s", self.name, exc
                    )
                    keep, source_canonical, logits_from_row = 0, None, None
            elif plan.kind == "copy":
                src = self.slots[plan.src_seq]
                self._reset_seq(slot)
                self.ctx.seq_cp(src.seq, slot.seq, 0, keep)
                source_canonical = src.canonical
                slot.kv_tokens[:] = tokens[:keep]
            elif plan.kind == "self":
                source_canonical = slot.canonical
                if len(slot.kv_tokens) > keep:
                    self.ctx.seq_rm(slot.seq, keep, -1)
                    del slot.kv_tokens[keep:]
            else:
                self._reset_seq(slot)
            if keep == 0:
                self._reset_seq(slot)
                source_canonical = None
            slot.canonical = canonical_after(keep, source_canonical, n, self.cfg.n_batch)
        except Exception:
            sampler.close()
            self._reset_seq(slot)
            raise
        hit: CacheHitKind
        if keep == 0:
            hit = "cold"
            if plan.kind in ("none", "row"):
                self.cache.record_miss()
        elif plan.shared >= n:
            hit = "exact"
        else:
            hit = "partial"
        active = Active(
            req=req,
            namespace=ns,
            sampler=sampler,
            assembler=TextAssembler(req.options.stop),
            prefill_pos=keep,
            pause_at=self._cold_pause(keep, n, req.deterministic),
            cached_tokens=keep,
            hit_kind=hit,
            admitted=time.perf_counter(),
            last_continued=n,  # continued saves count generated tokens from the prompt's end
        )
        slot.active = active
        slot.phase = "prefill"
        if logits_from_row is not None:
            # Exact hit with stored final logits: no decode at all before the first token.
            active.prefill_done = time.perf_counter()
            slot.phase = "generate"
            try:
                self._on_logits(slot, None, logits_from_row)
            except KvwarmError as exc:
                self._fail(slot, exc)

    def _restore_row(
        self, slot: Slot, plan: Plan, req: Request
    ) -> tuple[int, int | None, bytes | None]:
        assert plan.row_key is not None
        tokens = req.prompt_tokens
        keep = plan.keep
        nb = self.cfg.n_batch
        with self.cache.open_row(plan.row_key) as row:
            shared = common_prefix(row.tokens, tokens)
            if shared < keep:
                # Token-exact, always: the plan is stale (the row changed). Use what really
                # matches, trimmed the same way.
                keep, _ = usable_length(
                    shared,
                    len(tokens),
                    canonical=row.info.canonical_tokens,
                    n_batch=nb,
                    deterministic=req.deterministic,
                )
                if keep == 0:
                    return 0, None, None
            self._reset_seq(slot)
            t0 = time.perf_counter()
            n_restored = self.ctx.kv_unpack(slot.seq, row.payload)
            self.cache.record_latency("unpack", time.perf_counter() - t0)
            slot.kv_tokens[:] = row.tokens[:n_restored]
            use_logits = plan.use_logits and row.logits is not None and keep == len(tokens)
            if not use_logits and keep >= len(tokens):
                keep = len(tokens) - 1
            if keep > n_restored:  # a blob holding fewer cells than its tokens claim
                keep, use_logits = n_restored, False
            if req.deterministic and not use_logits:
                keep -= keep % nb
            if n_restored > keep:
                self.ctx.seq_rm(slot.seq, keep, -1)
                del slot.kv_tokens[keep:]
            return keep, row.info.canonical_tokens, row.logits if use_logits else None

    def _cold_pause(self, keep: int, n: int, deterministic: bool) -> int | None:
        boundary = cold_save_length(n, self.cfg.policy)
        # Pausing between aligned chunks keeps the cold row canonical.
        boundary -= boundary % self.cfg.n_batch
        if boundary <= keep or boundary >= n or boundary < self.cfg.policy.min_tokens:
            return None
        return boundary

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token id (computed once: one native call per vocab entry)."""
        if self._eog is None:
            n_vocab = self.model.facts.n_vocab
            self._eog = tuple(t for t in range(n_vocab) if self.model.is_eog(t))
        return self._eog

    def _reset_seq(self, slot: Slot) -> None:
        if slot.kv_tokens:
            self.ctx.seq_rm(slot.seq, 0, -1)
        slot.reset_kv()

    # ---- one tick -----------------------------------------------------------------------

    def _tick(self) -> None:
        decoding: list[int] = []
        prefilling: list[PrefillWant] = []
        for i, slot in enumerate(self.slots):
            act = slot.active
            if act is None:
                continue
            if act.req.cancelled.is_set():
                self._finish(slot, "cancelled", None)
                continue
            if slot.phase == "generate" and act.pending is not None:
                decoding.append(i)
            elif slot.phase == "prefill":
                stop = act.pause_at if act.pause_at is not None else len(act.req.prompt_tokens)
                prefilling.append(PrefillWant(i, act.prefill_pos, stop, act.deterministic))
        if not decoding and not prefilling:
            return
        plan = self.cfg.strategy.plan(decoding, prefilling, self.cfg.n_batch, self.cfg.n_ubatch)
        self.stats.ticks += 1
        if plan.decode_slots or plan.shared_chunks:
            self._run_call(plan.decode_slots, plan.shared_chunks)
        for chunk in plan.isolated_chunks:
            self._run_call((), (chunk,))

    def _run_call(self, decode_slots: Sequence[int], chunks: Sequence[Chunk]) -> None:
        batch: list[BatchToken] = []
        rows: list[tuple[Slot, int, Chunk | None]] = []  # slot, batch row of its logits, chunk
        for i in decode_slots:
            slot = self.slots[i]
            act = slot.active
            if act is None or act.pending is None:
                continue
            rows.append((slot, len(batch), None))
            batch.append(BatchToken(act.pending, len(slot.kv_tokens), slot.seq, True))
        for chunk in chunks:
            slot = self.slots[chunk.slot]
            act = slot.active
            if act is None:
                continue
            toks = act.req.prompt_tokens
            last = chunk.end == len(toks)
            for pos in range(chunk.start, chunk.end):
                batch.append(BatchToken(toks[pos], pos, slot.seq, last and pos == chunk.end - 1))
            rows.append((slot, len(batch) - 1, chunk))
        if not batch:
            return
        try:
            self.ctx.decode(batch)
        except KvwarmError as exc:
            if len(rows) > 1:
                # One slot's failure must not fail the others: retry each alone.
                for slot, _, one in rows:
                    if slot.active is None:
                        continue
                    if one is None:
                        self._run_call((slot.seq,), ())
                    else:
                        self._run_call((), (one,))
                return
            slot = rows[0][0]
            self._fail(slot, exc)
            return
        for slot, row, done in rows:
            if slot.active is None:
                continue
            try:
                if done is None:
                    self._after_decode(slot, row)
                else:
                    self._after_chunk(slot, row, done)
            except KvwarmError as exc:
                self._fail(slot, exc)

    def _after_chunk(self, slot: Slot, row: int, chunk: Chunk) -> None:
        act = slot.active
        assert act is not None
        toks = act.req.prompt_tokens
        slot.kv_tokens.extend(toks[chunk.start : chunk.end])
        act.prefill_pos = chunk.end
        nb = self.cfg.n_batch
        if chunk.end % nb and chunk.end != len(toks):
            # Cut short by the tick budget: from this chunk's aligned start on, the KV is not
            # what an aligned-chunk prefill computes.
            slot.canonical = min(slot.canonical, chunk.start - chunk.start % nb)
        if act.pause_at is not None and chunk.end == act.pause_at:
            act.pause_at = None
            self._save(slot, SaveReason.COLD, None, act.namespace, sync=False)
        if chunk.end < len(toks):
            return
        act.prefill_done = time.perf_counter()
        slot.phase = "generate"
        if act.req.kind == "prewarm":
            logits = bytes(self.ctx.logits(row))
            self._finish(slot, "length", logits)
            return
        self._on_logits(slot, row, None)

    def _after_decode(self, slot: Slot, row: int) -> None:
        act = slot.active
        assert act is not None and act.pending is not None
        slot.kv_tokens.append(act.pending)
        act.pending = None
        live = len(slot.kv_tokens)
        if should_continued_save(live, act.last_continued, self.cfg.policy):
            act.last_continued = live
            self._save(slot, SaveReason.CONTINUED, None, act.namespace, sync=False)
        self._on_logits(slot, row, None)

    def _on_logits(self, slot: Slot, row: int | None, stored: bytes | None) -> None:
        """Sample the next token from batch row ``row`` (or stored logits) and route it."""
        act = slot.active
        assert act is not None
        opts = act.req.options
        if len(act.generated) >= opts.max_tokens or len(slot.kv_tokens) >= self.cfg.n_ctx_slot:
            # max_tokens (0 for a prewarm-style request) or the slot's window is used up.
            self._finish(slot, "length", self._logits_bytes(row, stored))
            return
        lp_source = None
        if opts.logprobs is not None:
            lp_source = np.frombuffer(
                stored if stored is not None else self.ctx.logits(-1 if row is None else row),
                dtype=np.float32,
            ).copy()
        if stored is not None:
            token = act.sampler.sample_logits(stored)
        else:
            assert row is not None
            token = act.sampler.sample(self.ctx, row)
        if lp_source is not None:
            act.logprobs.append(self._logprob(token, lp_source, opts.logprobs or 0))
        if self.model.is_eog(token):
            self._finish(slot, "stop", self._logits_bytes(row, stored))
            return
        act.generated.append(token)
        fragment = act.assembler.feed(self.model.token_to_piece(token))
        if fragment and act.req.fragments:
            act.req.channel.put(fragment)
        if act.assembler.stopped:
            self._finish(slot, "stop", self._logits_bytes(row, stored))
            return
        act.pending = token
        if len(act.generated) >= opts.max_tokens:
            # The limit is reached: the last token is reported but never decoded.
            act.pending = None
            self._finish(slot, "length", self._logits_bytes(row, stored))

    def _logits_bytes(self, row: int | None, stored: bytes | None) -> bytes | None:
        if stored is not None:
            return stored
        if row is None:
            return None
        try:
            return bytes(self.ctx.logits(row))
        except KvwarmError:
            return None

    def _logprob(self, token: int, logits: np.ndarray, top_n: int) -> TokenLogprob:
        m = float(logits.max())
        lse = m + math.log(float(np.exp(logits - m).sum()))
        top: tuple[tuple[int, str, float], ...] = ()
        if top_n > 0:
            idx = np.argpartition(-logits, top_n)[:top_n]
            idx = idx[np.argsort(-logits[idx])]
            top = tuple((int(i), self._piece_text(int(i)), float(logits[i]) - lse) for i in idx)
        return TokenLogprob(token, self._piece_text(token), float(logits[token]) - lse, top)

    def _piece_text(self, token: int) -> str:
        return self.model.token_to_piece(token).decode("utf-8", errors="replace")

    # ---- completion, saves, failures ----------------------------------------------------

    def _finish(self, slot: Slot, reason: FinishReason, logits: bytes | None) -> None:
        act = slot.active
        assert act is not None
        now = time.perf_counter()
        tail = act.assembler.finish()
        if tail and act.req.fragments:
            act.req.channel.put(tail)
        key: bytes | None = None
        # A cancelled prefill leaves a partial, unaligned prompt: not worth a row.
        if slot.phase == "generate" and should_finish_save(len(slot.kv_tokens), self.cfg.policy):
            save_reason = SaveReason.PREWARM if act.req.kind == "prewarm" else SaveReason.FINISH
            key = self._save(slot, save_reason, logits, act.namespace, sync=False)
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
        )
        self._account(stats)
        completion = Completion(
            text=act.assembler.text,
            prompt_tokens=act.req.prompt_tokens,
            completion_tokens=tuple(act.generated),
            stats=stats,
            logprobs=tuple(act.logprobs) if act.req.options.logprobs is not None else None,
        )
        slot.active = None
        slot.phase = "idle"
        slot.last_used = time.monotonic()
        act.req.channel.put(Done(completion))

    def _account(self, st: CompletionStats) -> None:
        s = self.stats
        s.requests += 1
        s.prompt_tokens += st.prompt_tokens
        s.cached_tokens += st.cached_tokens
        s.completion_tokens += st.completion_tokens
        s.prefill_ms += st.prefill_ms
        s.generation_ms += st.generation_ms
        s.hits[st.cache_hit] += 1

    def _save(
        self,
        slot: Slot,
        reason: SaveReason,
        logits: bytes | None,
        ns: Namespace,
        *,
        sync: bool,
        ttl: TtlClass | None = None,
    ) -> bytes | None:
        """Pack the slot's sequence and hand it to the cache. Returns the row key if the save
        was accepted (async) or published (sync)."""
        tokens = tuple(slot.kv_tokens)
        if len(tokens) < self.cfg.policy.min_tokens or not tokens:
            return None
        t0 = time.perf_counter()
        payload = self.ctx.kv_pack(slot.seq)
        self.cache.record_latency("pack", time.perf_counter() - t0)
        act = slot.active
        if ttl is None:
            ttl = act.req.ttl_class if act is not None else TtlClass.SHORT
        canonical = slot.canonical if slot.canonical < len(tokens) else None
        request = SaveRequest(
            namespace=ns,
            tokens=tokens,
            payload=payload,
            reason=reason,
            tier=self.cfg.save_tier,
            logits=logits,
            prompt_text=act.req.prompt_text[:4096] if act is not None else "",
            ttl_class=ttl,
            context_size=self.cfg.n_ctx_slot,
            quant_bits=self.cfg.quant_bits,
            fingerprint_mode=self.cfg.fingerprint_mode,
            canonical_tokens=canonical,
        )
        timeout = self.cfg.policy.evict_save_timeout_ms / 1e3
        ok = self.cache.save(request, sync=sync, timeout_s=timeout)
        return self.cache.key_for(ns, tokens) if ok else None

    def save_idle_slots(self, reason: SaveReason, *, release: bool) -> int:
        """Sync-save every idle slot's live KV (evict / shutdown). Worker thread only."""
        saved = 0
        ns = self._namespace()
        for slot in self.slots:
            if slot.active is not None or not slot.kv_tokens:
                continue
            if self.cache.has(self.cache.key_for(ns, slot.kv_tokens)):
                # A row (maybe still in flight, like its finish save) holds exactly this KV:
                # packing it again would only lose the reservation race.
                saved += 1
            elif self._save(slot, reason, None, ns, sync=True) is not None:
                saved += 1
            if release:
                self._reset_seq(slot)
        return saved

    def invalidate_live_kv(self) -> None:
        """Forget every idle slot's live KV (after the adapter set changed)."""
        for slot in self.slots:
            if slot.active is None:
                self._reset_seq(slot)

    def _fail(self, slot: Slot, exc: BaseException) -> None:
        act = slot.active
        if act is None:
            return
        act.sampler.close()
        slot.active = None
        slot.phase = "idle"
        try:
            self._reset_seq(slot)
        except KvwarmError:
            slot.reset_kv()
        act.req.channel.put(Failed(exc))

    def _fail_all_active(self, exc: BaseException) -> None:
        for slot in self.slots:
            self._fail(slot, exc)

    def _reply_cancelled_unstarted(self, req: Request) -> None:
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
        req.channel.put(Done(Completion("", req.prompt_tokens, (), stats)))
