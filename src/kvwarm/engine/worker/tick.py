"""The tick: one round of forward passes over every active slot.

Invariants: the batch strategy decides which tokens share a call (``batching``), and only
slots of one LoRA adapter set share a call (the context runs each call under one set: a call
the plan shares between sets runs as one call per set); a failed call
with several slots is retried one slot at a time so one slot's failure never fails another;
after each call, a slot's ``kv_tokens`` grows by exactly what the call decoded for it and kept
(a speculating slot's draft past its first rejected token is removed again: ``sampling``), and
its canonical prefix shrinks when a chunk was cut short by the budget (``kvwarm.alignment``;
``docs/architecture.md``, "Engine"). Drafts (``drafts``) are made before the plan, within
what the pass has room for, and only for requests that may speculate (``speculates``).

A media span (``kvwarm.tokens``) is decoded whole, in a call of its own (its embeddings, with
causal attention off where the projector says so), once its encode is done; a prefill chunk
stops at a span's start and the next begins at its end, so no chunk holds part of a span.
While a span's embeddings are still being encoded (``encoder``) the other slots run as
usual; a round in which nothing but such waits remained reports ``"waiting"``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal, cast

import numpy as np

from kvwarm.alignment import canonical_after_chunk
from kvwarm.backends.base import GREEDY_BELOW, AdapterSet, BatchToken
from kvwarm.engine.types import SpecType
from kvwarm.engine.worker.batching import Chunk, PrefillWant, isolate, waited_after
from kvwarm.engine.worker.cacheport import CachePort
from kvwarm.engine.worker.draftmodel import ModelDrafter
from kvwarm.engine.worker.drafts import (
    Drafter,
    Elsewhere,
    Predicted,
    SentenceEnds,
    with_predicted,
)
from kvwarm.engine.worker.forks import Forks
from kvwarm.engine.worker.outcomes import Outcomes, unexpected
from kvwarm.engine.worker.runtime import Runtime
from kvwarm.engine.worker.sampling import token_logprob
from kvwarm.engine.worker.slots import Active, Slot
from kvwarm.errors import BackendError, KvwarmError
from kvwarm.tenants import tenant_of
from kvwarm.tokens import Span

log = logging.getLogger(__name__)

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
                try:
                    self.outcomes.finish(slot, "cancelled", None)
                except Exception as exc:  # its finish save: this slot's alone
                    self.outcomes.fail(slot, unexpected(exc, self.rt.name))
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
                prefilling.append(
                    PrefillWant(
                        i,
                        act.prefill_pos,
                        stop,
                        act.deterministic,
                        whole=self.rt.cfg.whole,
                        waited=act.prefill_waited,
                    )
                )
        for slot, index, span in spans:
            self._run_span(slot, index, span)
        if not decoding and not prefilling:
            return "waiting" if waiting and not spans else ("ran" if spans else "idle")
        self._run_plan(decoding, prefilling)
        return "ran"

    def _run_plan(self, decoding: list[int], prefilling: list[PrefillWant]) -> None:
        cfg = self.rt.cfg
        drafted = self._draft(decoding, prefilling=bool(prefilling))
        decoding = [i for i in decoding if self.rt.slots[i].active is not None]
        held = max((self._active(i).decode_waited for i in decoding), default=0)
        plan = cfg.strategy.plan(
            decoding, prefilling, cfg.n_batch, cfg.n_ubatch, drafted, decode_waited=held
        )
        for i, waited in waited_after(plan, prefilling).items():
            act = self.rt.slots[i].active
            if act is not None:
                act.prefill_waited = waited
        for i in decoding:
            act = self._active(i)
            act.decode_waited = 0 if i in plan.decode_slots else act.decode_waited + 1
        if drafted:
            for i in set(decoding) - set(plan.decode_slots):
                act = self.rt.slots[i].active
                if act is not None:
                    act.draft = []  # this slot does not decode this tick
        alone: tuple[int, ...] = ()
        if (
            len(plan.decode_slots) + len(plan.shared_chunks) > 1
            and not self.rt.ctx.params.kv_unified
        ):
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

    def _active(self, i: int) -> Active:
        act = self.rt.slots[i].active
        assert act is not None
        return act

    def _draft(self, decoding: Sequence[int], *, prefilling: bool = False) -> int:
        """Give each generating slot that speculates a draft to verify with its next token;
        the number of drafted tokens (all of them fit one pass beside one token per slot).
        While a prompt waits to be prefilled, drafts take at most half the pass's room left
        after the slots' tokens: the strategy fills the rest with prefill, which drafts that
        took it all starved until the speculating requests ended (found by review)."""
        rt = self.rt
        room = rt.cfg.n_batch - len(decoding)
        if prefilling:
            room //= 2
        total = 0
        for i in decoding:
            slot = rt.slots[i]
            act = slot.active
            assert act is not None
            act.draft = []
            try:
                if not act.spec_decided:
                    act.spec_decided = True
                    act.drafter = self._drafter(act, slot.seq)
                if act.drafter is None or room <= 0:
                    continue
                drafted = self._propose(slot, act, room, fill=not prefilling)
            except Exception as exc:
                if isinstance(act.drafter, Drafter):
                    # An n-gram drafter's state is its request's alone and its drafts change
                    # no token: its fault (a bug) ends the request's drafting, logged, and
                    # the request decodes plainly, as a draft model's failure does.
                    log.exception("%s: drafting failed; decoding plainly", self.rt.name)
                    act.drafter, act.draft = None, []
                else:  # making its drafter failed, or this loop around a draft model's draft
                    # (the draft model's own faults end only its drafting, in
                    # ``ModelDrafter.propose``): its request fails, no other
                    self.outcomes.fail(slot, unexpected(exc, self.rt.name))
                continue
            room -= drafted
            total += drafted
        return total

    def _propose(self, slot: Slot, act: Active, room: int, *, fill: bool = True) -> int:
        """Give ``act`` (its drafter made) a draft within ``room`` tokens; how many it holds.
        ``fill``: the pass may take filler rows (``Tick._pad``: not beside a waiting prompt's
        chunk), so its draft is priced with those that fit its reach and the room."""
        rt = self.rt
        assert act.drafter is not None
        n = len(slot.kv_tokens)
        # Rows n .. n + k must stay inside the slot's window and the token budget (the
        # pending token is the first of them), and a memory that cannot roll back far
        # limits how far past n the pass may go.
        window = rt.cfg.n_ctx_slot - 1 - n
        end = min(window, act.req.options.max_tokens - len(act.generated) - 1)
        reach = window  # how far past n the pass's rows may go, filler rows included
        ahead = rt.memory.lookahead(n)
        if ahead is not None:
            reach = min(reach, ahead - 1)
        if rt.memory.kind == "swa" and not rt.memory.trimmable:
            reach = min(reach, rt.cfg.n_ubatch - 1)  # its pass fits one ubatch (``_run_call``)
        limit = min(room, end, reach)
        if limit <= 0:
            return 0
        # ``end``: the request stops right after these rows (its max_tokens, its window).
        cost = replace(rt.pass_cost.cost, reach=min(reach, room) if fill else 0)
        act.draft = act.drafter.propose(act.generated, limit, cost, end=limit == end)
        act.pad_room = max(0, reach - len(act.draft))
        return len(act.draft)

    def _drafter(self, act: Active, seq: int) -> Drafter | ModelDrafter | None:
        """The request's drafter, or None where it decodes plainly: its own ``spec_type``
        or else the model's is "none", it is deterministic (a verify pass is a batch of
        another shape than a one-token decode, so its logits differ in the last bits), or
        the model cannot speculate (``WorkerConfig.speculates``; a memory that cannot roll
        back is found by ``lookahead`` per pass), or an adapter of its set makes a verify
        pass differ from one-token passes (``Runtime.adapters_exact``)."""
        cfg = self.rt.cfg
        opts = act.req.options
        kind = cfg.spec_type if opts.spec_type is None else opts.spec_type
        if kind == "none" and opts.spec_type is None and act.req.predicted:
            kind = "ngram-simple"  # a prediction drafts where the model's own type is none
        draft_max = cfg.spec_draft_max if opts.spec_draft_max is None else opts.spec_draft_max
        if kind == "none" or draft_max <= 0 or act.deterministic or not cfg.speculates:
            return None
        if self.rt.adapters_exact is not None and not self.rt.adapters_exact(act.adapters):
            return None  # an adapter whose products differ by a pass's rows (measured)
        if self.rt.memory.lookahead(0) == 0:
            return None
        if kind == "draft-simple":
            draft = self.rt.draft
            if draft is None:
                return None  # refused at submission; a model without one decodes plainly
            ns = draft.namespace_for(act.req.options.salt_bytes())
            return ModelDrafter(
                draft, self.port, seq, ns, act.req.prompt_tokens, draft_max, self.rt.pass_cost.plain
            )
        rows = self.port.drafts(cfg.spec_ngram_n)
        ns = act.namespace  # the salted one: drafts come from this tenant's rows only
        rows.refresh(ns, tenant_of(opts.cache_salt))  # its tenant's share of the index
        if self.rt.sentence_ends is None:  # a model whose spec_type is none: made here, once
            self.rt.sentence_ends = SentenceEnds(self.rt.model.vocabulary()[0])
        elsewhere: Elsewhere = functools.partial(rows.matches, ns)
        if act.req.predicted and kind != "ngram-cache":  # which drafts from no row
            predicted = Predicted(cfg.spec_ngram_n, act.req.prompt_tokens, act.req.predicted)
            elsewhere = with_predicted(predicted, elsewhere)
        return Drafter(
            cast(SpecType, kind),
            cfg.spec_ngram_n,
            draft_max,
            act.req.prompt_tokens,
            elsewhere,
            lambda ngram: rows.counts(ns, ngram),
            self.rt.sentence_ends,
            self.rt.copy_ends,
            # An earlier reply repeats token for token only where a request samples greedily:
            # a sampled one keeps a draft token with its probability, so a whole reply drafted
            # at once would mostly be rejected (and would teach the trust nothing about copies).
            self.rt.row_trust if opts.temperature < GREEDY_BELOW else None,
        )

    def _batch(
        self, decode_slots: Sequence[int], chunks: Sequence[Chunk]
    ) -> tuple[list[BatchToken], list[tuple[Slot, int, Chunk | None]]]:
        """The call's tokens, and per slot: the batch row of its logits and its chunk."""
        batch: list[BatchToken] = []
        rows: list[tuple[Slot, int, Chunk | None]] = []
        drafting = [i for i in decode_slots if self._drafting(i)]
        for i in [i for i in decode_slots if i not in drafting]:
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
        # A verify pass last: its rejected draft's cells are then the top of the cells in use
        # when they are removed, and the next pass fills them again (``_run_call``).
        verifying: Slot | None = None
        for i in drafting:
            verifying = slot = self.rt.slots[i]
            act = slot.active
            assert act is not None and act.pending is not None
            act.pad = 0
            rows.append((slot, len(batch), None))
            n = len(slot.kv_tokens)
            batch.append(BatchToken(act.pending, n, slot.seq, True))
            for j, token in enumerate(act.draft):
                batch.append(BatchToken(token, n + 1 + j, slot.seq, True))
        if verifying is not None and not chunks:
            self._pad(verifying, batch)
        return batch, rows

    def _pad(self, slot: Slot, batch: list[BatchToken]) -> None:
        """Fill a decode-only pass that verifies ``slot``'s draft (its rows last) up to a whole
        tile of the CPU's matrix kernel with filler rows after the draft, where they cost less
        than the rest of a tile would (``Cost.pad``): every row of such a pass wants logits,
        so each goes through the output's product, which reads the weights once more for
        the rows past a multiple of the tile. The filler's positions follow the draft's, in
        its sequence and within its reach (``Active.pad_room``); a row sees only the cells
        before it, so the draft's rows are what they were, and the filler's cells are removed
        with the rejected draft's (``Sampling.on_verify``)."""
        act = slot.active
        assert act is not None
        pad = self.rt.pass_cost.cost.pad(len(batch))
        if pad <= 0 or pad > act.pad_room or len(batch) + pad > self.rt.cfg.n_batch:
            return
        start = len(slot.kv_tokens) + 1 + len(act.draft)
        filler = act.draft[-1]
        batch.extend(BatchToken(filler, start + j, slot.seq, True) for j in range(pad))
        act.pad = pad

    def _splits_verify(self, n_batch: int, n_rows: int) -> bool:
        """Whether the last ``n_rows`` of a call of ``n_batch`` tokens (a verify pass) would
        span two of llama.cpp's ubatches (a unified buffer splits a call in order, every
        ``n_ubatch`` tokens) in a sliding-window memory; elsewhere a split changes no cell."""
        mem, ub = self.rt.memory, self.rt.cfg.n_ubatch
        if mem.kind != "swa" or mem.trimmable or not self.rt.ctx.params.kv_unified:
            return False
        return (n_batch - n_rows) // ub != (n_batch - 1) // ub

    def _drafting(self, i: int) -> bool:
        """Whether slot ``i`` verifies a draft in this tick's pass."""
        act = self.rt.slots[i].active
        return act is not None and act.pending is not None and bool(act.draft)

    def _run_call(self, decode_slots: Sequence[int], chunks: Sequence[Chunk]) -> None:
        # One slot's work is one group (the common decode step skips the grouping).
        if (
            len(decode_slots) + len(chunks) > 1
            and len(groups := self._by_adapters(decode_slots, chunks)) > 1
        ):
            for group_slots, group_chunks in groups:
                self._run_call(group_slots, group_chunks)
            return
        drafting = [i for i in decode_slots if self._drafting(i)]
        if len(drafting) > 1 and self.rt.ctx.params.kv_unified and not self.rt.cfg.verify_together:
            # One verify pass a call, its rows last (``_batch``), so that its rejected cells
            # are the top of the cells in use when they are removed: in one unified KV buffer
            # another slot's rows placed after them would otherwise take the freed cells in
            # the next pass, below that slot's earlier cells, and attention adds cells in
            # cell order (docs/internals.md, "Cell order is numerics"): its logits then
            # differed from plain decoding's (found by specrev's review). A model that need
            # not keep replies plain decoding's (``verify_together``) verifies them together.
            rest = set(drafting[1:])
            self._run_call([i for i in decode_slots if i not in rest], chunks)
            for i in drafting[1:]:
                self._run_call((i,), ())
            return
        batch, rows = self._batch(decode_slots, chunks)
        if not batch:
            return
        verify = 0
        if drafting:
            first = self._active(drafting[0])
            verify = 1 + len(first.draft) + first.pad
        if len(batch) > verify > 0 and self._splits_verify(len(batch), verify):
            # A sliding window's verify pass split over two ubatches: llama.cpp places the
            # later ubatch as if the earlier one's draft rows were kept (a cell masked for
            # them is free), so a cell the window needs once the rejected part is removed
            # could be given away. The pass then runs in a call of its own.
            self._run_call([i for i in decode_slots if i != drafting[0]], chunks)
            self._run_call((drafting[0],), ())
            return
        try:
            act = rows[0][0].active
            self.rt.use_adapters(act.adapters if act is not None else ())
            started = time.perf_counter()
            self.rt.ctx.decode(batch)
            if not chunks:
                # A decode-only pass: what one more token costs (drafts' trade-off).
                slots = len(rows)
                self.rt.pass_cost.observe(slots, len(batch) - slots, time.perf_counter() - started)
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
            except Exception as exc:  # this slot's step: its request fails, no other
                self.outcomes.fail(slot, unexpected(exc, self.rt.name))

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
            self.rt.use_adapters(act.adapters)  # the LoRA set its request runs under
            self.rt.ctx.decode_embd(
                slot.seq,
                span.start,
                embd,
                span.length,
                non_causal=encoder.non_causal(span.kind),
                logits=last,
            )
            self._after_chunk(slot, span.length - 1, Chunk(slot.seq, span.start, span.end))
        except Exception as exc:
            self.outcomes.fail(slot, unexpected(exc, self.rt.name))

    def _by_adapters(
        self, decode_slots: Sequence[int], chunks: Sequence[Chunk]
    ) -> list[tuple[list[int], list[Chunk]]]:
        """The call's work split by the adapter set each slot runs under, in first-seen
        order (one group: no LoRA, or one set for all)."""
        groups: list[tuple[AdapterSet, list[int], list[Chunk]]] = []

        def group(i: int) -> tuple[AdapterSet, list[int], list[Chunk]]:
            act = self.rt.slots[i].active
            adapters = act.adapters if act is not None else ()
            for g in groups:
                if g[0] == adapters:
                    return g
            groups.append((adapters, [], []))
            return groups[-1]

        for i in decode_slots:
            group(i)[1].append(i)
        for chunk in chunks:
            group(chunk.slot)[2].append(chunk)
        return [(slots, chunks) for _, slots, chunks in groups]

    def _after_chunk(self, slot: Slot, row: int, chunk: Chunk) -> None:
        act = slot.active
        assert act is not None
        toks = act.req.prompt_tokens
        if act.req.options.prompt_logprobs is not None:
            self._prompt_logprobs(slot, row, chunk)
        slot.kv_tokens.extend(toks[chunk.start : chunk.end])
        if act.req.upkeep:
            self.rt.stats.prewarm_prefilled_tokens += chunk.end - chunk.start
        else:
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
        if act.req.kind == "score":
            # The rank pooling of this call read the sequence's last position (an encoder:
            # its whole sequence, which ran whole in this call); llama-server's score is the
            # first value (a decoder reranker's p("yes")).
            self.outcomes.finish(slot, "length", None, score=self.rt.ctx.pooled(slot.seq)[0])
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
        if act.draft:
            draft, act.draft = act.draft, []
            pad, act.pad = act.pad, 0
            self.sampling.on_verify(slot, row, draft, pad)
            return
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
