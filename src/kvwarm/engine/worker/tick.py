"""The tick: one round of forward passes over every active slot.

Invariants: the batch strategy decides which tokens share a call (``batching``); a failed call
with several slots is retried one slot at a time so one slot's failure never fails another;
after each call, a slot's ``kv_tokens`` grows by exactly what the call decoded for it, and its
canonical prefix shrinks when a chunk was cut short by the budget (``kvwarm.alignment``;
``docs/architecture.md``, "Engine").

A media span (``kvwarm.tokens``) is decoded whole, in a call of its own (its embeddings, with
causal attention off where the projector says so), once its encode is done; a prefill chunk
stops at a span's start and the next begins at its end, so no chunk holds part of a span.
While a span's embeddings are still being encoded (``encoder``) the other slots run as
usual; a round in which nothing but such waits remained reports ``"waiting"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

import numpy as np

from kvwarm.alignment import canonical_after_chunk
from kvwarm.backends.base import BatchToken
from kvwarm.engine.worker.batching import Chunk, PrefillWant, isolate
from kvwarm.engine.worker.cacheport import CachePort
from kvwarm.engine.worker.forks import Forks
from kvwarm.engine.worker.outcomes import Outcomes
from kvwarm.engine.worker.runtime import Runtime
from kvwarm.engine.worker.sampling import token_logprob
from kvwarm.engine.worker.slots import Slot
from kvwarm.errors import BackendError, KvwarmError
from kvwarm.tokens import Span

TickResult = Literal["ran", "idle", "waiting"]


class Tick:
    def __init__(self, rt: Runtime, forks: Forks, outcomes: Outcomes, port: CachePort) -> None:
        self.rt = rt
        self.forks = forks
        self.sampling = forks.sampling
        self.outcomes = outcomes
        self.port = port

    def run(self) -> TickResult:
        """Cancel what was cancelled, then decode every generating slot's pending token, the
        prefill chunks the strategy picks and each media span whose embeddings are ready."""
        decoding: list[int] = []
        prefilling: list[PrefillWant] = []
        spans: list[tuple[Slot, int, Span]] = []
        waiting = False
        for i, slot in enumerate(self.rt.slots):
            act = slot.active
            if act is None:
                continue
            if act.req.cancelled.is_set():
                self.outcomes.finish(slot, "cancelled", None)
                continue
            if slot.phase == "generate" and act.pending is not None:
                decoding.append(i)
            elif slot.phase == "prefill":
                stop = act.pauses[0] if act.pauses else len(act.req.prompt_tokens)
                due = _next_span(act.req.prompt.spans, act.prefill_pos)
                if due is not None and due[1].start == act.prefill_pos:
                    future = act.encodes.get(due[0])
                    if future is None or future.done():
                        spans.append((slot, *due))
                    else:
                        waiting = True
                    continue
                if due is not None:
                    stop = min(stop, due[1].start)
                prefilling.append(PrefillWant(i, act.prefill_pos, stop, act.deterministic))
        for slot, index, span in spans:
            self._run_span(slot, index, span)
        if not decoding and not prefilling:
            return "waiting" if waiting and not spans else ("ran" if spans else "idle")
        self._run_plan(decoding, prefilling)
        return "ran"

    def _run_plan(self, decoding: list[int], prefilling: list[PrefillWant]) -> None:
        cfg = self.rt.cfg
        plan = cfg.strategy.plan(decoding, prefilling, cfg.n_batch, cfg.n_ubatch)
        alone: tuple[int, ...] = ()
        if not self.rt.ctx.params.kv_unified:
            det = {
                i
                for i, slot in enumerate(self.rt.slots)
                if slot.active is not None and slot.active.deterministic
            }
            plan, alone = isolate(plan, det)
        self.rt.stats.ticks += 1
        if plan.decode_slots or plan.shared_chunks:
            self._run_call(plan.decode_slots, plan.shared_chunks)
        for i in alone:
            self._run_call((i,), ())
        for chunk in plan.isolated_chunks:
            self._run_call((), (chunk,))

    def _batch(
        self, decode_slots: Sequence[int], chunks: Sequence[Chunk]
    ) -> tuple[list[BatchToken], list[tuple[Slot, int, Chunk | None]]]:
        """The call's tokens, and per slot: the batch row of its logits and its chunk."""
        batch: list[BatchToken] = []
        rows: list[tuple[Slot, int, Chunk | None]] = []
        for i in decode_slots:
            slot = self.rt.slots[i]
            act = slot.active
            if act is None or act.pending is None:
                continue
            rows.append((slot, len(batch), None))
            batch.append(BatchToken(act.pending, len(slot.kv_tokens), slot.seq, True))
        for chunk in chunks:
            slot = self.rt.slots[chunk.slot]
            act = slot.active
            if act is None:
                continue
            toks = act.req.prompt_tokens
            last = chunk.end == len(toks)
            # Prompt logprobs need every position's logits; otherwise only the prompt's last.
            every = act.req.options.prompt_logprobs is not None
            for pos in range(chunk.start, chunk.end):
                wanted = every or (last and pos == chunk.end - 1)
                batch.append(BatchToken(toks[pos], pos, slot.seq, wanted))
            rows.append((slot, len(batch) - 1, chunk))
        return batch, rows

    def _run_call(self, decode_slots: Sequence[int], chunks: Sequence[Chunk]) -> None:
        batch, rows = self._batch(decode_slots, chunks)
        if not batch:
            return
        try:
            self.rt.ctx.decode(batch)
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
            self.outcomes.fail(rows[0][0], exc)
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
                self.outcomes.fail(slot, exc)

    def _run_span(self, slot: Slot, index: int, span: Span) -> None:
        """Decode one media span of ``slot``'s prompt whole, in a call of its own."""
        act = slot.active
        encoder = self.rt.encoder
        assert act is not None
        future = act.encodes.pop(index, None)
        try:
            if encoder is None or future is None:
                raise BackendError("a media span reached the worker with nothing to decode it")
            embd = future.result()
            last = span.end == len(act.req.prompt_tokens)
            self.rt.ctx.decode_embd(
                slot.seq,
                span.start,
                embd,
                span.length,
                non_causal=encoder.non_causal(span.kind),
                logits=last,
            )
            self._after_chunk(slot, span.length - 1, Chunk(slot.seq, span.start, span.end))
        except KvwarmError as exc:
            self.outcomes.fail(slot, exc)

    def _after_chunk(self, slot: Slot, row: int, chunk: Chunk) -> None:
        act = slot.active
        assert act is not None
        toks = act.req.prompt_tokens
        if act.req.options.prompt_logprobs is not None:
            self._prompt_logprobs(slot, row, chunk)
        slot.kv_tokens.extend(toks[chunk.start : chunk.end])
        self.rt.stats.prefilled_tokens += chunk.end - chunk.start
        act.prefill_pos = chunk.end
        slot.canonical = canonical_after_chunk(
            slot.canonical,
            chunk.start,
            chunk.end,
            len(toks),
            self.rt.cfg.n_batch,
            cuts=span_cuts(act.req.prompt.spans),
        )
        packed = None  # the state as packed since this chunk, if it was
        if act.deterministic and not self.rt.memory.trimmable:
            packed = self.rt.settle_layout(slot)
        paused = bool(act.pauses) and chunk.end == act.pauses[0]
        if paused:
            del act.pauses[0]
        self.port.prefilled(
            slot,
            chunk.end,
            paused=paused,
            logits=lambda: bytes(self.rt.ctx.logits(row)),
            packed=packed,
        )
        if chunk.end < len(toks):
            return
        act.prefill_done = time.perf_counter()
        slot.phase = "generate"
        if act.req.kind == "prewarm":
            self.outcomes.finish(slot, "length", bytes(self.rt.ctx.logits(row)))
            return
        self.forks.prefilled(slot, row, None)

    def _prompt_logprobs(self, slot: Slot, last_row: int, chunk: Chunk) -> None:
        """Each prompt token after the first, scored by the logits of the position before it
        (the chunk's rows are contiguous and end at ``last_row``)."""
        act = slot.active
        assert act is not None
        toks = act.req.prompt_tokens
        top_n = act.req.options.prompt_logprobs or 0
        first_row = last_row - (chunk.end - chunk.start - 1)
        for pos in range(chunk.start, min(chunk.end, len(toks) - 1)):
            logits = np.frombuffer(self.rt.ctx.logits(first_row + pos - chunk.start), np.float32)
            act.prompt_logprobs.append(token_logprob(self.rt.model, logits, toks[pos + 1], top_n))

    def _after_decode(self, slot: Slot, row: int) -> None:
        act = slot.active
        assert act is not None and act.pending is not None
        slot.kv_tokens.append(act.pending)
        act.pending = None
        self.port.decoded(slot)
        self.sampling.on_logits(slot, row, None)


def _next_span(spans: Sequence[Span], pos: int) -> tuple[int, Span] | None:
    """The first span (and its index) that ends after ``pos``."""
    for index, span in enumerate(spans):
        if span.end > pos:
            return index, span
    return None


def span_cuts(spans: Sequence[Span]) -> frozenset[int]:
    """Where a prompt's spans start and end: where its prefill chunks are cut besides the
    multiples of ``n_batch`` (``kvwarm.alignment``)."""
    return frozenset(p for span in spans for p in (span.start, span.end))
