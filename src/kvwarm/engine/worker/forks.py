"""Forks: the other choices of an ``n > 1`` request share its prompt KV instead of prefilling it.

The first choice is planned and prefilled as any request. Its forks are seated with it, each in
a slot of its own (phase ``fork``), and wait. The moment the first choice's prompt KV is
complete (its last prefill chunk, or a row restored with its final logits), ``fork`` shares
that KV with every waiting slot (``seq_cp``: cells are shared, not copied) and each choice
samples its first token from the same logits with its own sampler. From then on they are
independent requests.

Invariants: the prompt is prefilled once for the whole group; a fork's KV equals the first
choice's prompt KV token for token (so its canonical prefix is the same); a fork cancelled
while it waits is simply skipped (``docs/architecture.md``, "Engine").
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvwarm.backends.base import AdapterSet, Sampler
from kvwarm.cache.explain import MissReason, ReuseReport
from kvwarm.cache.types import Namespace
from kvwarm.engine.request import Prefilled, Request
from kvwarm.engine.text import TextAssembler
from kvwarm.engine.worker.outcomes import Outcomes, unexpected
from kvwarm.engine.worker.runtime import Runtime
from kvwarm.engine.worker.sampling import Sampling
from kvwarm.engine.worker.slots import Active, Slot


class Forks:
    def __init__(self, rt: Runtime, sampling: Sampling, outcomes: Outcomes) -> None:
        self.rt = rt
        self.sampling = sampling
        self.outcomes = outcomes

    def pick(self, first: Slot, free: Sequence[Slot], n: int) -> list[Slot]:
        """``n`` free slots other than ``first``: empty ones, then the least recently used
        (their live KV is what the group overwrites)."""
        others = [s for s in free if s is not first]
        others.sort(key=lambda s: (bool(s.kv_tokens), s.last_used))
        return others[:n]

    def seat(
        self,
        slots: Sequence[Slot],
        forks: Sequence[tuple[Request, Sampler]],
        ns: Namespace,
        adapters: AdapterSet = (),
    ) -> None:
        """Seat each fork in its slot, waiting for the first choice's prompt KV."""
        now = time.perf_counter()
        for slot, (req, sampler) in zip(slots, forks, strict=True):
            # Its KV goes now, before the first choice's prefill, which then fills the cells
            # it frees in position order: freed after it, they were free cells below the
            # prompt's, which every choice's next tokens took out of position order, and
            # attention adds cells in cell order (docs/internals.md, "Cell order is
            # numerics"): the choices' replies depended on what the slots held before, and
            # with speculation differed from plain decoding's (found by specrev's review).
            self.rt.reset_seq(slot)
            n = len(req.prompt_tokens)
            slot.active = Active(
                req=req,
                namespace=ns,
                sampler=sampler,
                assembler=TextAssembler(req.options.stop, n_indent=req.options.n_indent),
                prefill_pos=n,
                pauses=[],
                # Nothing reused yet: the whole prompt's KV comes from the first choice at
                # ``_share``, which says so then. Found by review: claimed here, a group
                # cancelled or failed before its prompt was complete reported every fork's
                # whole prompt as reused (an exact hit) in its stats and /metrics.
                cached_tokens=0,
                hit_kind="cold",
                admitted=now,
                last_continued=n,
                adapters=adapters,  # the first choice's: they share its prompt's KV
                fork=True,
            )
            slot.phase = "fork"

    def prefilled(self, slot: Slot, row: int | None, stored: bytes | None) -> None:
        """``slot``'s prompt KV is complete: announce its prompt logprobs, share the KV with
        its waiting forks, and let every choice of the group sample its first token."""
        act = slot.active
        assert act is not None
        forked = self._share(slot)
        group = [slot, *forked]
        if act.req.options.prompt_logprobs is not None:
            event = Prefilled(tuple(act.prompt_logprobs))
            for member in group:
                assert member.active is not None
                member.active.prompt_logprobs = list(act.prompt_logprobs)
                if member.active.req.fragments:
                    member.active.req.channel.put(event)
        # Forks first: the first choice may finish at once and would then save its slot.
        for member in [*forked, slot]:
            if member.active is None:
                continue
            try:
                self.sampling.on_logits(member, row, stored)
            except Exception as exc:  # one choice's failure is its own
                self.outcomes.fail(member, unexpected(exc, self.rt.name))

    def _share(self, slot: Slot) -> list[Slot]:
        act = slot.active
        assert act is not None
        n = len(act.req.prompt_tokens)
        ready: list[Slot] = []
        now = time.perf_counter()
        for fork in act.forks:
            fa = fork.active
            if fa is None or fa.req not in act.req.forks:
                continue  # cancelled while it waited
            self.rt.ctx.seq_cp(slot.seq, fork.seq, 0, n)
            fork.kv_tokens[:] = slot.kv_tokens[:n]
            fork.canonical = min(slot.canonical, n)
            fork.kv_namespace = slot.kv_namespace  # the same request's prompt, the same salt
            # The whole prompt's KV came from the first choice: none is prefilled here.
            fa.cached_tokens = n
            fa.hit_kind = "exact"
            # Why no more was reused: nothing was left (found by review: no report, so
            # kvwarm_cache_reasons_total counted one of n choices and the log said "-").
            fa.reuse = ReuseReport(MissReason.NONE, found_tokens=n, reused_tokens=n)
            fa.prefill_done = now
            fork.phase = "generate"
            ready.append(fork)
        act.forks = []
        return ready
