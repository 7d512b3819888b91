"""Admission: a queued request gets a free slot and its prompt KV (own, copied, restored from a
row, or none), then waits for the tick to prefill the rest.

Three named steps, each handing the next a value: ``look_up`` (the cache's candidates, the
planner's choice: a ``Planned``), ``restore`` (the plan carried out into the slot: a
``Restored``), ``seat`` (the slot becomes the request's, with its checkpoints and the reason it
reused no more). Every call to the cache goes through the worker's one port (``CachePort``).

Invariants: the plan comes from ``planner.choose`` (pure); this module only carries it out and
never decides how much KV to reuse itself. A request's adapter set and namespace (the model's,
with that set and the request's cache salt folded in) are fixed here, when it is admitted, and
recorded on its slot.
Whatever goes wrong, no slot stays taken: a failed restore falls back to a cold prefill, any
other failure answers the request and its forks (``docs/architecture.md``, "Engine"). A request
asking for prompt logprobs reuses no KV: every prompt position needs its logits, and restored KV
has none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvwarm.alignment import align_down, canonical_after
from kvwarm.backends.base import AdapterSet, Buffer, Sampler
from kvwarm.cache.api import LoadedRow
from kvwarm.cache.explain import MissReason, ReuseReport
from kvwarm.cache.types import Namespace
from kvwarm.engine.request import Failed, Request
from kvwarm.engine.text import TextAssembler
from kvwarm.engine.types import CacheHitKind
from kvwarm.engine.worker.cacheport import CachePort
from kvwarm.engine.worker.explain import Found, best_found
from kvwarm.engine.worker.forks import Forks
from kvwarm.engine.worker.outcomes import Outcomes
from kvwarm.engine.worker.planner import (
    Plan,
    RowCandidate,
    choose,
    recheck_row,
    trim_restored,
    within_spans,
)
from kvwarm.engine.worker.runtime import Runtime
from kvwarm.engine.worker.slots import Active, Slot
from kvwarm.errors import (
    BackendError,
    CacheFormatError,
    CacheKeyError,
    KvwarmError,
    StateRestoreError,
)
from kvwarm.tokens import common_prefix

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Planned:
    """What ``look_up`` found and chose for a request."""

    slot: Slot
    plan: Plan
    namespace: Namespace
    #: The namespace unsalted: the model's with the request's adapter set folded in.
    base: Namespace
    #: The LoRA adapters the request runs under (``Runtime.adapter_set``).
    adapters: AdapterSet
    #: Where the prefill should also checkpoint, besides the cold save (``CachePort.pauses``).
    resume: tuple[int, ...]
    #: The source sharing the most with the prompt, for explaining the reuse.
    found: Found


@dataclass(frozen=True, slots=True)
class Restored:
    """What ``restore`` put into the slot: the prompt tokens kept, the stored final logits to
    sample from (an exact hit on a row holding them), and why a restore that was planned did
    not happen (the request is then cold)."""

    keep: int
    logits: bytes | None = None
    failed: tuple[MissReason, str] | None = None


class Admission:
    def __init__(self, rt: Runtime, forks: Forks, outcomes: Outcomes, port: CachePort) -> None:
        self.rt = rt
        self.forks = forks
        self.outcomes = outcomes
        self.port = port

    def admit(self, req: Request, free: Sequence[Slot]) -> None:
        """Seat ``req`` in one of the ``free`` slots; on any failure, answer it instead. Either
        way it counts one outcome: ``seat`` counts what served it, first thing; a failure
        before that counts ``admission_failures`` (the counters count each request once)."""
        try:
            planned = self.look_up(req, free)
            samplers: list[Sampler] = []
            try:
                for one in req.group:
                    banned = self.rt.eog_tokens() if one.options.ignore_eos else ()
                    params = one.options.sampling(one.grammar, banned, one.preserved)
                    samplers.append(self.rt.model.new_sampler(params))
                restored = self.restore(planned, req)
            except Exception:
                for made in samplers:
                    made.close()
                self.rt.reset_seq(planned.slot)
                raise
        except Exception as exc:
            if not req.upkeep:  # a prewarm is no request served: no outcome of one
                self.port.admission_failed()
            self._failed(req, exc)
            return
        try:
            self.seat(req, planned, restored, samplers, free)
        except Exception as exc:  # counted already: seat counts before anything can fail
            self._failed(req, exc)

    def _failed(self, req: Request, exc: Exception) -> None:
        """Whatever went wrong, the caller gets an answer and no slot stays taken."""
        err: KvwarmError
        if isinstance(exc, KvwarmError):
            err = exc
        else:
            log.exception("worker %s: admission failed", self.rt.name)
            err = BackendError(f"admission failed: {exc!r}")
            err.__cause__ = exc
        for one in req.group:
            for slot in self.rt.slots:
                if slot.active is not None and slot.active.req is one:
                    self.outcomes.fail(slot, err)
            one.answer(Failed(err))  # a no-op for one answered just now

    # -- step 1: look up and plan --------------------------------------------------------------

    def look_up(self, req: Request, free: Sequence[Slot]) -> Planned:
        """The cache's candidates for ``req`` and the planner's choice among them and the
        slots' live KV."""
        rt = self.rt
        port = self.port
        adapters, base = rt.adapter_set(req.options.lora)
        ns = port.namespace(base, req.options.salt_bytes())
        # A parent_key row was waited for on the caller's thread, so it is published by now
        # and this lookup scores it by what it really shares. The lookup is confined to ns:
        # a parent_key of another salt's row waits, but never restores.
        # Shared tiers (s3, a shared directory) are probed for the prefixes a save of another
        # process could have written, bounded by the cache (docs/architecture.md).
        prompt = req.prompt_tokens
        eog = frozenset(rt.eog_tokens())
        ends = [i for i, t in enumerate(prompt) if t in eog]  # where earlier chat turns ended
        # A state that cannot be trimmed is of use only whole: the longest row that is all a
        # prefix of the prompt is a candidate beside the one sharing the most (kvwarm.memory).
        match, whole = port.lookup(ns, prompt, ends)
        mem = rt.memory
        if req.options.prompt_logprobs is not None:
            match, whole = None, []  # every position's logits are needed: prefill from start
        # A row's chunk lengths say where a restore onto live KV of its leading tokens can
        # start (only where the context restores tails: full attention, one KV stream).
        tails = rt.ctx.restores_tails and not req.deterministic
        rows = [
            RowCandidate.of(m, mem, port.chunk_lens(m.row.key) if tails else ())
            for m in (match, *whole)
            if m is not None
        ]
        if req.kind == "score":
            # A rerank document's score comes from a decode of its last token, so a row's
            # stored logits cannot stand in for it: at least that token is prefilled.
            rows = [replace(r, has_logits=False) for r in rows]
        rt.refresh_floors()
        port.note_model(base)
        found = best_found(
            prompt,
            slots=rt.slots,
            rows=rows,
            namespace=ns,
            n_batch=rt.cfg.n_batch,
            deterministic=req.deterministic,
            spans=req.prompt.spans,
        )
        slot, plan = choose(
            prompt,
            free=free,
            slots=rt.slots,
            row=None,
            rows=rows,
            n_batch=rt.cfg.n_batch,
            deterministic=req.deterministic,
            namespace=ns,
            tails=tails,
            spans=req.prompt.spans,
        )
        if req.options.prompt_logprobs is not None:
            plan = Plan("none", 0)
        # A state that cannot be trimmed resumes only where it was saved, so its prefill also
        # checkpoints where later prompts will resume: where the row sharing the most diverges
        # from this prompt (the next prompt sharing as much), after the first turn's end (the
        # system message every conversation repeats) and after the last one (a regenerated
        # or edited newest message). CachePort.pauses drops them for full attention.
        resume = [] if match is None else [match.n_shared]
        if ends:
            resume += [ends[0] + 1, ends[-1] + 1]
        if req.deterministic:
            resume = [align_down(p, rt.cfg.n_batch) for p in resume]
        return Planned(slot, plan, ns, base, adapters, tuple(resume), found)

    # -- step 2: restore -----------------------------------------------------------------------

    def restore(self, planned: Planned, req: Request) -> Restored:
        """Put the plan's KV into its slot: a row restored (re-checked against what it
        really holds), another slot's live KV copied, the slot's own trimmed, or nothing. A
        restore the cache or the memory refuses is a miss (``Restored.failed`` says why),
        never a failed request."""
        rt = self.rt
        slot, plan = planned.slot, planned.plan
        tokens = req.prompt_tokens
        keep = plan.keep
        logits_from_row: bytes | None = None
        source_canonical: int | None = None
        failed: tuple[MissReason, str] | None = None
        if plan.kind == "row":
            try:
                keep, source_canonical, logits_from_row = self._restore_row(slot, plan, req)
            except KvwarmError as exc:
                log.warning("worker %s: cache restore failed, prefilling cold: %s", rt.name, exc)
                keep, source_canonical, logits_from_row = 0, None, None
                if isinstance(exc, CacheKeyError):
                    failed = (MissReason.UNREADABLE, "missing")
                elif isinstance(exc, CacheFormatError):
                    failed = (MissReason.UNREADABLE, "corrupt")
                else:
                    failed = (MissReason.RESTORE_FAILED, "")
        elif plan.kind == "copy":
            src = rt.slots[plan.src_seq]
            rt.reset_seq(slot)
            try:
                rt.ctx.seq_cp(src.seq, slot.seq, 0, keep)
                source_canonical = src.canonical
                slot.kv_tokens[:] = tokens[:keep]
            except StateRestoreError as exc:  # the memory refused: a miss, never a guess
                log.warning("worker %s: live KV not copyable, prefilling cold: %s", rt.name, exc)
                keep = 0
        elif plan.kind == "self":
            source_canonical = slot.canonical
            if plan.row_key is not None:  # the live KV holds the prompt; the row its logits
                logits_from_row = self._row_logits(plan.row_key, tokens)
                if logits_from_row is None:
                    # The row went: decode the last position for its logits (a prompt ending
                    # in a span decodes the whole span again).
                    keep = within_spans(keep - 1, req.prompt.spans)
            if len(slot.kv_tokens) > keep:
                try:
                    rt.ctx.seq_rm(slot.seq, keep, -1)
                    del slot.kv_tokens[keep:]
                except StateRestoreError as exc:  # the memory refused: a miss, never a guess
                    log.warning(
                        "worker %s: live KV not trimmable, prefilling cold: %s", rt.name, exc
                    )
                    keep = 0
        else:
            rt.reset_seq(slot)
        if keep == 0:
            rt.reset_seq(slot)
            source_canonical = None
        slot.canonical = canonical_after(keep, source_canonical, len(tokens), rt.cfg.n_batch)
        return Restored(keep, logits_from_row, failed)

    # -- step 3: seat --------------------------------------------------------------------------

    def seat(
        self,
        req: Request,
        planned: Planned,
        restored: Restored,
        samplers: Sequence[Sampler],
        free: Sequence[Slot],
    ) -> None:
        """The slot becomes ``req``'s (its forks seated beside it), with where its prefill
        pauses to save and why it reused no more than it did."""
        slot, plan, ns = planned.slot, planned.plan, planned.namespace
        keep = restored.keep
        n = len(req.prompt_tokens)
        hit: CacheHitKind
        if keep == 0:
            hit = "cold"
        elif plan.shared >= n:
            hit = "exact"
        else:
            hit = "partial"
        # The request's one outcome, for what served it (the lookup counted nothing); first,
        # so a failure below is not counted again as an admission failure (``admit``). A
        # prewarm (``Request.upkeep``) serves no request: it counts none (found by review:
        # keep-alive's re-warms counted hits, so an idle server's hit rate kept rising).
        if not req.upkeep:
            self.port.counted(
                plan.kind, keep, whole=hit == "exact", resumed=req.options.parent_key is not None
            )
        sampler, fork_samplers = samplers[0], samplers[1:]
        fork_slots = self.forks.pick(slot, free, len(req.forks))
        self.forks.seat(
            fork_slots, list(zip(req.forks, fork_samplers, strict=True)), ns, planned.adapters
        )
        saved = self.port.saved_below(
            ns, req.prompt_tokens, keep, restored=plan.kind == "row",
            resume_points=planned.resume, deterministic=req.deterministic,
        )  # fmt: skip
        pauses = self.port.pauses(
            keep,
            n,
            resume_points=planned.resume,
            saved=saved,
            kind=req.kind,
            spans=req.prompt.spans,
        )
        # Explained before seating: an exact hit from a row's logits may finish right there.
        try:
            reuse: ReuseReport | None = self._explain(req, planned, restored)
        except Exception:  # an explanation never costs a request its answer
            log.exception("worker %s: explaining the cache use failed", self.rt.name)
            reuse = None
        active = Active(
            req=req,
            namespace=ns,
            sampler=sampler,
            assembler=TextAssembler(req.options.stop, n_indent=req.options.n_indent),
            prefill_pos=keep,
            pauses=pauses,
            cached_tokens=keep,
            hit_kind=hit,
            admitted=time.perf_counter(),
            last_continued=n,  # continued saves count generated tokens from the prompt's end
            forks=fork_slots,
            reuse=reuse,
            adapters=planned.adapters,
        )
        encoder = self.rt.encoder
        for index, span in enumerate(req.prompt.spans):
            # Only the spans it did not restore; encoded while the worker decodes the rest.
            if span.end > keep and encoder is not None:
                active.encodes[index] = encoder.start(req.media[index])
        slot.active = active
        slot.kv_namespace = ns  # whatever KV the slot holds from now on was computed under ns
        slot.phase = "prefill"
        if restored.logits is not None:
            # Exact hit with stored final logits: no decode at all before the first token.
            active.prefill_done = time.perf_counter()
            slot.phase = "generate"
            try:
                self.forks.prefilled(slot, None, restored.logits)
            except KvwarmError as exc:
                self.outcomes.fail(slot, exc)
        if slot.active is not None and slot.active.req is req:
            self.port.resumed(slot, keep, resume_points=planned.resume)

    def _explain(self, req: Request, planned: Planned, restored: Restored) -> ReuseReport:
        """Why ``req`` kept ``restored.keep`` prompt tokens and no more."""
        found, keep, ns = planned.found, restored.keep, planned.namespace
        if req.options.prompt_logprobs is not None:
            return ReuseReport(MissReason.PROMPT_LOGPROBS, found.shared, keep)
        if restored.failed is not None and keep == 0:
            reason, detail = restored.failed
            if detail == "missing":
                # The row may simply have left between the lookup and the read (evicted,
                # expired): then the cache remembers why, and that is the better answer.
                gone = self.port.explain_gone(ns, req.prompt_tokens)
                if gone is not None and gone.found_tokens >= found.shared:
                    reason, detail = gone.reason, gone.detail
            return ReuseReport(reason, found.shared, keep, detail=detail)
        return self.port.explain(
            req.prompt_tokens,
            found,
            keep,
            namespace=ns,
            base=planned.base,
            salt=req.options.salt_bytes(),
            deterministic=req.deterministic,
            spans=req.prompt.spans,
        )

    # -- restoring a row ---------------------------------------------------------------------

    def _row_logits(self, key: bytes, tokens: Sequence[int]) -> bytes | None:
        """The final logits of row ``key`` if it holds exactly ``tokens`` (its metadata alone
        is read: no chunks, no payload); None if it is gone, unreadable or not that prompt's
        row."""
        try:
            with self.port.open_row(key, chunks=False, payload=False) as row:
                if row.logits is None or tuple(row.tokens) != tuple(tokens):
                    return None
                return bytes(row.logits)
        except KvwarmError as exc:
            log.info("worker %s: row logits unavailable: %s", self.rt.name, exc)
            return None

    def _restore_row(
        self, slot: Slot, plan: Plan, req: Request
    ) -> tuple[int, int | None, bytes | None]:
        assert plan.row_key is not None
        rt = self.rt
        tokens = req.prompt_tokens
        nb = rt.cfg.n_batch
        det = req.deterministic
        opened = time.perf_counter()
        with self.port.open_row(plan.row_key, from_token=plan.base) as row:
            canonical = row.info.canonical_tokens
            shared = common_prefix(row.tokens, tokens)
            floor = rt.memory.saved_floor(row.info.n_tokens)
            keep = recheck_row(
                plan.keep,
                shared,
                len(tokens),
                canonical=canonical,
                n_batch=nb,
                det=det,
                floor=floor,
                spans=req.prompt.spans,
            )
            if keep == 0:
                return 0, None, None
            t0 = time.perf_counter()
            if row.chunks_from:
                n_restored, base_canonical = self._restore_tail(
                    slot, plan, row.chunks_from, row.chunks, keep
                )
                # The state is canonical no further than its live base was.
                canonical = base_canonical if canonical is None else min(canonical, base_canonical)
            else:
                rt.reset_seq(slot)
                n_restored = self._restore_whole(slot, row)
            if n_restored is not None:
                done = time.perf_counter()
                self.port.restored(row, done - t0, done - opened)
                slot.kv_tokens[:] = row.tokens[:n_restored]
                keep, use_logits = trim_restored(
                    keep,
                    n_restored,
                    len(tokens),
                    use_logits=plan.use_logits and row.logits is not None,
                    n_batch=nb,
                    det=det,
                    floor=rt.memory.live_floor(n_restored, rt.ctx.seq_pos_min(slot.seq)),
                    spans=req.prompt.spans,
                )
                if keep == 0:
                    return 0, None, None
                if n_restored > keep:
                    rt.ctx.seq_rm(slot.seq, keep, -1)
                    del slot.kv_tokens[keep:]
                return keep, canonical, row.logits if use_logits else None
        # The tail alone would not restore (chunks of the first format): the whole row,
        # read anew outside that lease.
        return self._restore_row(slot, replace(plan, base=0), req)

    def _restore_whole(self, slot: Slot, row: LoadedRow) -> int:
        """Restore a whole row into ``slot`` (emptied): its chunks, or its payload."""
        rt = self.rt
        chunks, payload = row.chunks, row.payload
        # A manifest's chunks are restored each from the buffer it was read into; chunks the
        # context cannot restore in place (an older chunk format) are joined (each byte
        # copied once) into the worker's reused buffer and restored from it in one call
        # (kv_unpack_joined), and so are those of a manifest with a rest, followed by it:
        # its payload (a hybrid's recurrent state), or its rest chunks joined after them (an
        # iSWA window). A whole-blob row is unpacked from its view directly.
        if not chunks:
            return rt.ctx.kv_unpack(slot.seq, payload)
        if row.rest_chunks:
            return rt.join_buf.restore(rt.ctx, slot.seq, chunks, rest_chunks=row.rest_chunks,
                                       rest_from=row.rest_from)  # fmt: skip
        n_restored = None if payload.nbytes else rt.ctx.kv_unpack_chunks(slot.seq, chunks)
        if n_restored is None:
            n_restored = rt.join_buf.restore(rt.ctx, slot.seq, chunks, payload)
        return n_restored

    def _restore_tail(
        self, slot: Slot, plan: Plan, start: int, chunks: Sequence[Buffer], keep: int
    ) -> tuple[int | None, int]:
        """Put the row's chunks from ``start`` (a boundary at or before the plan's ``base``)
        on live KV of its leading tokens: ``slot``'s own, trimmed to ``start``, or a copy of
        the plan's ``src_seq`` (the planner checked that either holds the prompt's tokens
        there). None where the context cannot (chunks of an older format): the caller then
        restores the whole row over whatever the slot holds. Also the live base's canonical
        prefix (``kvwarm.alignment``), read before the slot is changed."""
        rt = self.rt
        src = rt.slots[plan.src_seq]
        base_canonical = src.canonical
        if not rt.ctx.restores_tails or start > keep:
            return None, base_canonical
        if src is slot:
            rt.ctx.seq_rm(slot.seq, start, -1)
            del slot.kv_tokens[start:]
        else:
            rt.reset_seq(slot)
            rt.ctx.seq_cp(src.seq, slot.seq, 0, start)
            slot.kv_tokens[:] = src.kv_tokens[:start]
        return rt.ctx.kv_unpack_chunks(slot.seq, chunks, base=start), base_canonical
