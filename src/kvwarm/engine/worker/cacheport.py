"""The worker's one port to the cache: what a request can reuse, and when to save.

The worker asks the port what a prompt can reuse (``lookup``) and tells it where each slot's
life has got to: ``prefilled`` (a prompt chunk is in), ``decoded`` (a token is in),
``finishing`` / ``finished`` (the reply is about to go out / has gone), ``evicting`` (live KV
is about to be dropped). The port alone decides what those events save: the cold-save and
checkpoint pauses a prefill makes (``pauses``), the checkpoint at a prompt's end, continued
saves, the finish save and the sync saves of eviction; the save gates (``savegates``) are read
here and nowhere else in the worker. (vLLM's ``get_computed_blocks``/``allocate``/``free`` and
sglang's ``match_prefix``/``cache_unfinished_req``/``cache_finished_req`` draw the same line.)

Invariants: bytes are packed on the worker thread, between decode calls, and handed to the
cache's writer pool with the backend's chunk codec, which cuts them into the chunks the tier
lacks on a writer thread (``cache/store/chunking.py``); an async save never blocks a tick. A row's
``canonical_tokens`` is the slot's canonical prefix, so a deterministic restore trusts only
KV an aligned prefill produced (``kvwarm.alignment``; ``docs/architecture.md``, "Engine").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from kvwarm.alignment import align_down
from kvwarm.cache.api import LoadedRow
from kvwarm.cache.explain import ReuseReport
from kvwarm.cache.formats.key import salted_namespace
from kvwarm.cache.types import Namespace, PrefixMatch, SaveReason, SaveRequest, TtlClass
from kvwarm.engine.request import RequestKind
from kvwarm.engine.worker.drafts import RowDrafts
from kvwarm.engine.worker.explain import Found, explain, prefix_rows, same_tenant
from kvwarm.engine.worker.planner import SourceKind
from kvwarm.engine.worker.runtime import Runtime
from kvwarm.engine.worker.savegates import (
    cold_save_length,
    probe_lengths,
    should_continued_save,
    should_finish_save,
)
from kvwarm.engine.worker.slots import Slot
from kvwarm.tokens import Span, resume_point

log = logging.getLogger(__name__)


class CachePort:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    # -- what a request can reuse ----------------------------------------------------------

    def namespace(self, base: Namespace, salt: bytes | None) -> Namespace:
        """The namespace a request's KV lives in: ``base`` (the model's, with the request's
        adapter set folded in: ``Runtime.adapter_set``), salted by its cache salt."""
        return salted_namespace(base, salt)

    def lookup(
        self,
        ns: Namespace,
        prompt: Sequence[int],
        turn_ends: Sequence[int],
    ) -> tuple[PrefixMatch | None, list[PrefixMatch]]:
        """The row sharing the most with ``prompt`` and, for a memory that cannot be trimmed
        (of use only whole), the rows that are all a prefix of it. Shared tiers (s3, a shared
        directory) are probed for the prefixes another process could have saved: the cold
        save's and the turn ends' (``savegates.probe_lengths``), bounded by the cache. Counts
        nothing: what the request then reuses is counted once it is in its slot
        (``counted``)."""
        rt = self.rt
        t0 = time.perf_counter()
        probes = probe_lengths(len(prompt), rt.cfg.policy, rt.cfg.n_batch, turn_ends=turn_ends)
        # The rows the planner chooses among: one function with ``kvwarm cache explain``,
        # which explained a prewarmed prompt as its last token decoded again (found by review).
        match, whole = prefix_rows(rt.cache, ns, prompt, rt.memory, probes)
        rt.cache.record_latency("lookup", time.perf_counter() - t0)
        return match, whole

    def note_model(self, base: Namespace) -> None:
        """This model serves under ``base`` (its namespace with a request's adapter set): the
        cache may name its rows when explaining another model's or set's miss to a request of
        the same salt."""
        self.rt.cache.note_namespace(base)

    def chunk_lens(self, key: bytes) -> tuple[int, ...]:
        """Row ``key``'s chunk lengths: where a restore onto live KV of its leading tokens
        can start."""
        return self.rt.cache.chunk_lens(key)

    def open_row(
        self, key: bytes, *, chunks: bool = True, payload: bool = True, from_token: int = 0
    ) -> AbstractContextManager[LoadedRow]:
        """Row ``key``, leased while the context is open (``CacheApi.open_row``)."""
        return self.rt.cache.open_row(key, chunks=chunks, payload=payload, from_token=from_token)

    def counted(self, source: SourceKind, keep: int, *, whole: bool, resumed: bool) -> None:
        """Count a seated request's one outcome (``counters.REQUEST_OUTCOMES``): what served
        its prompt's first ``keep`` tokens, ``source`` being the plan's kind. A row restored
        is ``hits_resume`` for a request that named its previous turn (``resumed``: a
        ``parent_key``), else ``hits_exact`` when it holds the ``whole`` prompt (the request's
        ``cache_hit`` "exact") and ``hits_longest_prefix`` when it holds part of it; a slot's
        live KV kept or copied (its stored logits read from a row or not) is ``hits_live``;
        ``keep`` 0 is ``misses``, whatever was planned (a restore or copy refused, a row gone
        or unreadable). The lookup counted nothing, so a row found and left unused is no
        hit."""
        cache = self.rt.cache
        if keep == 0:
            cache.record_miss()
        elif source in ("self", "copy"):
            cache.record_hit("hits_live")
        elif resumed:
            cache.record_hit("hits_resume")
        else:
            cache.record_hit("hits_exact" if whole else "hits_longest_prefix")

    def admission_failed(self) -> None:
        """Count the one outcome of a request that failed before it was seated (before
        ``counted``): ``admission_failures``, neither a hit nor a miss: it was never served."""
        self.rt.cache.record_admission_failure()

    def restored(self, row: LoadedRow, seconds: float, whole_s: float) -> None:
        """``row``'s KV went into a slot in ``seconds`` (the ``unpack`` latency: joined and
        unpacked), ``whole_s`` from opening the row (the ``restore`` latency, per tier too:
        its file and the chunks read, verified and restored)."""
        cache = self.rt.cache
        cache.record_latency("unpack", seconds)
        nbytes = row.payload.nbytes + sum(c.nbytes for c in (*row.chunks, *row.rest_chunks))
        cache.record_restore(row.info.tier, nbytes, whole_s)

    def explain(
        self,
        prompt: Sequence[int],
        found: Found,
        keep: int,
        *,
        namespace: Namespace,
        base: Namespace,
        salt: bytes | None,
        deterministic: bool,
        spans: Sequence[Span] = (),
    ) -> ReuseReport:
        """Why a request kept ``keep`` prompt tokens and no more (``worker/explain.py``): it
        may learn of its own namespace (``base`` salted) and its salt's others, never
        another salt's."""
        return explain(
            self.rt.cache,
            prompt,
            found,
            keep,
            namespace=namespace,
            others=same_tenant(self.rt.cache, base, salt),
            n_batch=self.rt.cfg.n_batch,
            deterministic=deterministic,
            spans=spans,
        )

    def explain_gone(self, namespace: Namespace, prompt: Sequence[int]) -> ReuseReport | None:
        """Why a row of ``namespace`` that held part of ``prompt`` is gone, if the cache
        remembers (evicted, expired, unreadable)."""
        return self.rt.cache.explain_miss(namespace, prompt, 0)

    # -- the slot's lifecycle ----------------------------------------------------------------

    def prefilled(
        self,
        slot: Slot,
        end: int,
        *,
        paused: bool,
        logits: Callable[[], bytes],
        packed: bytes | None,
    ) -> None:
        """The slot's prompt is in up to ``end``: save where its prefill ``paused`` (the cold
        save, a checkpoint; at the prompt's end, a checkpoint with its logits for a state that
        cannot be trimmed, before the reply moves the state on: ``kvwarm.memory``).
        ``packed``: the state as packed since this chunk, if it was."""
        act = slot.active
        assert act is not None
        if paused:
            # At the prompt's end: reusable only at the length it was saved at, so a
            # regenerated or edited-reply turn resumes here, with no decode.
            last = logits() if end == len(act.req.prompt_tokens) else None
            self.save(slot, SaveReason.COLD, last, act.namespace, sync=False, packed=packed)

    def decoded(self, slot: Slot) -> None:
        """A generated token is in the slot's KV: a continued save when the policy says."""
        act = slot.active
        assert act is not None
        live = len(slot.kv_tokens)
        if should_continued_save(live, act.last_continued, self.rt.cfg.policy):
            act.last_continued = live
            self.save(slot, SaveReason.CONTINUED, None, act.namespace, sync=False)

    def finishing(self, slot: Slot) -> tuple[bytes | None, bool]:
        """The reply is about to go out: the key its finish save will have (None: no save)
        and whether that save is still to be made (then the key is held in flight until
        ``finished``, so a client told it may wait for it). A cancelled prefill leaves a
        partial, unaligned prompt: not worth a row."""
        act = slot.active
        assert act is not None
        if (
            slot.phase != "generate"
            or act.req.kind == "score"  # one of many documents: a row of it serves no other
            or not should_finish_save(len(slot.kv_tokens), self.rt.cfg.policy)
        ):
            return None, False
        return self.hold(slot, act.namespace)

    @staticmethod
    def finish_keeps_logits(slot: Slot) -> bool:
        """Whether the finish save stores its final logits: only when its row is the prompt
        itself (a prewarm, ``max_tokens`` 0, a one-token reply), which the same prompt sent
        again restores with no decode at all. A row that holds reply tokens too serves a
        prompt equal to prompt + reply with its logits, which no chat turn sends (the next
        turn adds the template's tokens after the reply); without them such a prompt keeps
        all but its last token and decodes that one. Final logits are 4 bytes a vocabulary
        entry (1 MiB a row on a 262k vocabulary, more than a 1,000-token Gemma 3 270M row's
        KV), so storing them on every finish save multiplied a chat's cache size
        (``docs/internals.md``, "What a row stores")."""
        act = slot.active
        return act is not None and len(slot.kv_tokens) <= len(act.req.prompt_tokens)

    def finished(self, slot: Slot, held: bool, logits: bytes | None) -> None:
        """The reply has gone out: pack and hand over the finish save ``finishing`` held."""
        act = slot.active
        assert act is not None
        if held:
            reason = SaveReason.PREWARM if act.req.kind == "prewarm" else SaveReason.FINISH
            self.save(slot, reason, logits, act.namespace, sync=False, held=True)
            if self.rt.row_drafts is not None:
                # The reply is in a row now: later requests of its namespace may draft from it.
                self.rt.row_drafts.saved(act.namespace, slot.kv_tokens)

    def drafts(self, n: int) -> RowDrafts:
        """Speculative decoding's drafts from the cache: the worker's index of the n-grams of
        each namespace's rows (``engine/worker/drafts.py``), made on first use. It lists a
        namespace's rows and reads their tokens from the index, no tier."""
        if self.rt.row_drafts is None:
            cache = self.rt.cache
            self.rt.row_drafts = RowDrafts(cache.rows, cache.row_tokens, n)
        return self.rt.row_drafts

    # ---- the draft model's rows (``draftmodel``: its own namespace, whole blobs) ----------

    def draft_prefix(
        self, ns: Namespace, tokens: Sequence[int], min_shared: int
    ) -> PrefixMatch | None:
        """The draft context's cached row sharing the longest prefix with ``tokens``. Counts
        nothing: a restore of it counts (``draft_restored``)."""
        return self.rt.cache.longest_prefix(ns, tokens, min_shared=min_shared)

    def draft_whole_rows(self, ns: Namespace, tokens: Sequence[int]) -> list[PrefixMatch]:
        """The draft context's cached rows all of whose tokens begin ``tokens``, longest
        first: the rows a sliding-window draft model can resume from (``kvwarm.memory``)."""
        return self.rt.cache.whole_prefixes(ns, tokens)

    def draft_restored(self) -> None:
        """The draft context restored a row's KV: ``hits_draft_prefix``, not a request's
        outcome (that is its main context's, ``counted``)."""
        self.rt.cache.record_hit("hits_draft_prefix")

    def open_draft_row(self, key: bytes) -> AbstractContextManager[LoadedRow]:
        return self.rt.cache.open_row(key)

    def save_draft(
        self, ns: Namespace, tokens: Sequence[int], payload: bytes, n_ctx_slot: int, quant_bits: int
    ) -> None:
        """Save the draft context's KV of a prompt, whole (async; a full writer pool drops
        it, as any async save)."""
        cfg = self.rt.cfg
        self.rt.cache.save(
            SaveRequest(
                namespace=ns,
                tokens=tuple(tokens),
                payload=payload,
                reason=SaveReason.COLD,
                tier=cfg.save_tier,
                ttl_class=TtlClass.SHORT,
                context_size=n_ctx_slot,
                quant_bits=quant_bits,
                fingerprint_mode=cfg.fingerprint_mode,
            )
        )

    def evicting(self, reason: SaveReason, *, release: bool) -> int:
        """Live KV is about to go (evict, shutdown): sync-save every idle slot's."""
        return self.save_idle_slots(reason, release=release)

    def save(
        self,
        slot: Slot,
        reason: SaveReason,
        logits: bytes | None,
        ns: Namespace,
        *,
        sync: bool,
        packed: bytes | None = None,
        held: bool = False,
    ) -> bytes | None:
        """Hand the slot's sequence to the cache, which packs what its tier lacks (or take
        ``packed``, its state packed since its last change). Returns the row key if the save
        was accepted (async) or published (sync). ``held``: the caller holds the key
        (``hold``); it is released here, whatever happens."""
        rt = self.rt
        cfg = rt.cfg
        tokens = tuple(slot.kv_tokens)
        key = rt.cache.key_for(ns, tokens)
        try:
            if len(tokens) < cfg.policy.min_tokens or not tokens:
                return None
            if not held and rt.cache.has(key):
                return key  # published or in flight: never pack the same tokens twice
            seq = slot.seq

            def pack(start: int) -> tuple[bytes, int]:
                # Called by the cache on this thread, once it knows which leading chunks its
                # tier holds: a conversation's next turn copies out only its new tokens' KV.
                t0 = time.perf_counter()
                out = rt.ctx.kv_pack_tail(seq, start) if start else (rt.ctx.kv_pack(seq), 0)
                rt.cache.record_latency("pack", time.perf_counter() - t0)
                return out

            act = slot.active
            codec = rt.ctx.kv_codec
            canonical = slot.canonical if slot.canonical < len(tokens) else None
            request = SaveRequest(
                namespace=ns,
                tokens=tokens,
                payload=b"" if packed is None else packed,
                pack=pack if packed is None else None,
                reason=reason,
                tier=cfg.save_tier,
                logits=logits,
                prompt_text=act.req.prompt_text[:4096] if act is not None else "",
                ttl_class=act.req.ttl_class if act is not None else TtlClass.SHORT,
                context_size=cfg.n_ctx_slot,
                quant_bits=cfg.quant_bits,
                fingerprint_mode=cfg.fingerprint_mode,
                canonical_tokens=canonical,
                memory=rt.memory.kind,
                # Past its aligned canonical prefix a row's KV bits are its own (a last
                # partial pass, an unaligned restore, decoding): its chunks there are never
                # shared with a row whose bits are canonical (kvwarm.alignment).
                plain_to=align_down(min(slot.canonical, len(tokens)), cfg.n_batch),
                # Packed by the cache through ``pack`` (only what its tier lacks); it cuts the
                # chunks on a writer thread (the codec is pure). A memory of two parts
                # (kvwarm.memory: an iSWA window, a hybrid's recurrent state) is chunked in its
                # full-attention cache and keeps the rest: a window in chunks of its own,
                # keyed like the first cache's, a recurrent state in the row; a pure recurrent
                # state is stored whole. Such rows are checkpoints, restorable only where
                # their floor allows.
                split=codec.split if rt.memory.chunkable or rt.memory.has_rest else None,
                rest=codec.rest if rt.memory.has_rest else None,
                rest_span=codec.rest_span if rt.memory.rest_chunkable else None,
                split_rest=codec.split_rest if rt.memory.rest_chunkable else None,
            )
            timeout = cfg.policy.evict_save_timeout_ms / 1e3
            return rt.cache.save(request, sync=sync, timeout_s=timeout)
        finally:
            if held:
                rt.cache.release(key)

    def hold(self, slot: Slot, ns: Namespace) -> tuple[bytes | None, bool]:
        """The key ``save`` would give the slot's sequence now (None: too short to save),
        and whether a save is still to be made: then the key is held in flight, so a client
        told it may wait for it (``save(held=True)`` releases it)."""
        tokens = slot.kv_tokens
        if len(tokens) < self.rt.cfg.policy.min_tokens or not tokens:
            return None, False
        key = self.rt.cache.key_for(ns, tokens)
        if self.rt.cache.has(key):
            return key, False  # published or in flight already: nothing to pack
        self.rt.cache.hold(key)
        return key, True

    def save_idle_slots(self, reason: SaveReason, *, release: bool) -> int:
        """Sync-save every idle slot's live KV (evict / shutdown) and, with ``release``, drop
        the KV that a row now holds; KV whose save failed stays live (its only copy). Worker
        thread only. The waits for saves already in flight share one ``evict_save_timeout_ms``
        (the bound ``Model.unload`` gives the whole shutdown save)."""
        rt = self.rt
        saved = 0
        deadline = time.monotonic() + rt.cfg.policy.evict_save_timeout_ms / 1e3
        for slot in rt.slots:
            # The slot's own namespace, not the model's: a salted request's KV must land in
            # its salt's namespace, or evict would publish it to every other tenant.
            ns = slot.kv_namespace
            if slot.active is not None or not slot.kv_tokens or ns is None:
                continue
            if len(slot.kv_tokens) < rt.cfg.policy.min_tokens:
                if release:
                    rt.reset_seq(slot)  # too short for any row (the policy's min_tokens)
                continue
            key = rt.cache.key_for(ns, slot.kv_tokens)
            left = max(0.0, deadline - time.monotonic())
            # A row holds exactly this KV (its finish save, maybe in flight until now: the KV
            # goes only once the row is published), or the save here makes one.
            held = rt.cache.settled(key, left)
            if held or self.save(slot, reason, None, ns, sync=True) is not None:
                saved += 1
                if release:
                    rt.reset_seq(slot)
            else:
                # The live KV is the only copy: kept, so a prompt it serves still reuses it
                # (an idle slot's cells are reused by the next request either way).
                log.warning(
                    "%s: slot %d's KV (%d tokens) could not be saved; kept live",
                    reason.name.lower(), slot.seq, len(slot.kv_tokens),
                )  # fmt: skip
        return saved

    def resumed(self, slot: Slot, keep: int, *, resume_points: Sequence[int]) -> None:
        """The slot's prompt resumes at ``keep`` from KV the slot holds (its own, a copy of
        another slot's, a row's). A state that cannot be trimmed serves a later prompt at
        ``keep`` only from a row of exactly that length, and a live state can be trimmed a
        little where a saved one cannot: when ``keep`` is one of ``resume_points`` (see
        ``pauses``) and no row holds it, it is saved before the prefill moves the state on.
        Without it, a sibling prompt that meets this one at ``keep`` after the slot moved on
        resumes at the last checkpoint before it (a prompt ending in a space, resent with a
        question appended, shares one token less than its own row). Deterministic requests
        keep their checkpoints to the prefill's pauses (their rows stay canonical)."""
        act = slot.active
        assert act is not None
        n = len(act.req.prompt_tokens)
        if act.req.kind == "score":
            return  # a rerank document saves nothing (``pauses``)
        if not self._checkpoints_resume(keep, n, resume_points, act.deterministic):
            return
        if self.rt.cache.has(self.rt.cache.key_for(act.namespace, slot.kv_tokens)):
            return
        self.save(slot, SaveReason.COLD, None, act.namespace, sync=False)

    def _checkpoints_resume(
        self, keep: int, n: int, resume_points: Sequence[int], deterministic: bool
    ) -> bool:
        """Whether ``resumed`` checkpoints a prompt of ``n`` tokens resuming at ``keep``
        (unless a row holds that state already)."""
        return (
            not self.rt.memory.trimmable
            and not deterministic
            and keep in resume_points
            and keep >= self.rt.cfg.policy.min_tokens
            and 0 < keep < n
        )

    def saved_below(
        self,
        ns: Namespace,
        prompt: Sequence[int],
        keep: int,
        *,
        restored: bool,
        resume_points: Sequence[int],
        deterministic: bool,
    ) -> int:
        """The saved state a prompt resuming at ``keep`` starts from, for ``pauses``:
        ``keep`` when a row holds its first ``keep`` tokens (the row ``restored``, a row
        holding the live KV kept, or the checkpoint ``resumed`` is to make of it), else 0.
        Full attention's pauses do not ask (0, with no key hashed)."""
        if keep == 0 or restored:
            return keep
        if self.rt.memory.trimmable:
            return 0
        if self._checkpoints_resume(keep, len(prompt), resume_points, deterministic):
            return keep
        return keep if self.rt.cache.has(self.rt.cache.key_for(ns, prompt[:keep])) else 0

    def pauses(
        self,
        keep: int,
        n: int,
        *,
        resume_points: Sequence[int] = (),
        saved: int = 0,
        kind: RequestKind = "generate",
        spans: Sequence[Span] = (),
    ) -> list[int]:
        """Where a prefill of prompt tokens ``[keep, n)`` pauses to save, ascending (``n``
        itself: the checkpoint at the prompt's end). A rerank document (``kind`` score)
        saves nothing: its shared prefix was prefilled (and saved) by a request of its own,
        and a row of one document serves no other. Never inside one of the prompt's
        ``spans``: a point that falls in one moves to its start (KV ending inside a span is
        no prompt's state).

        The cold save's boundary (trimmed, aligned: the row stays canonical), and for a model
        whose state cannot be trimmed (``kvwarm.memory``) each of ``resume_points`` (where
        another row's tokens diverge from this prompt: the next prompt that shares that much
        resumes there, which a longer row's untrimmable state cannot offer) and, but for a
        prewarm, the prompt's end. Such a checkpoint is made only ``checkpoint_gap_tokens``
        or more past the saved state below it (``saved``: the longest prefix of the prompt a
        row holds at or below ``keep``, 0 for none; or the checkpoint before it): a prompt
        resuming from that state instead prefills fewer tokens than the checkpoint costs to
        pack and write. A follow-up chat turn that restored its previous turn's row thus
        saves only its reply. The end is measured from ``saved`` and the cold save alone:
        its logits serve the same prompt again with no decode at all, which a checkpoint a
        few tokens before it (a chat template's generation prompt) cannot."""
        if kind == "score":
            return []
        end = kind != "prewarm"
        policy = self.rt.cfg.policy
        boundary = cold_save_length(n, policy)
        # Pausing between aligned chunks keeps the cold row canonical.
        boundary = resume_point(spans, align_down(boundary, self.rt.cfg.n_batch))
        cold = boundary if keep < boundary < n and boundary >= policy.min_tokens else 0
        if self.rt.memory.trimmable:
            return [cold] if cold else []
        gap = policy.checkpoint_gap_tokens
        wanted = {resume_point(spans, p) for p in resume_points}
        wanted = {p for p in wanted if keep < p < n and p >= policy.min_tokens}
        points: list[int] = []
        below = saved
        for point in sorted(wanted | {cold} - {0}):
            if point == cold or point - below >= gap:
                points.append(point)
                below = point
        if end and keep < n and n - max(saved, cold) >= gap:
            points.append(n)
        return points
