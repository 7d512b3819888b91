"""Per-slot state. A slot owns one sequence id of the model's context for its whole life.

Invariant: ``kv_tokens`` lists exactly the tokens whose KV the slot's sequence holds, at
positions ``0..len-1``; ``canonical`` of them (a prefix) came from aligned-chunk prefill
(``kvwarm.alignment``; ``docs/architecture.md``, "Exactness"); ``kv_namespace`` is the cache
namespace (model, adapters, salt) of the request that computed them, so live KV is shared only
within it, as rows are (``docs/architecture.md``, "Tenants").
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvwarm.backends.base import AdapterSet, Sampler
from kvwarm.cache.explain import ReuseReport
from kvwarm.cache.types import Namespace
from kvwarm.engine.request import Request
from kvwarm.engine.text import TextAssembler
from kvwarm.engine.types import CacheHitKind, LineStop, SlotPhase, SlotStatus, TokenLogprob
from kvwarm.engine.worker.draftmodel import ModelDrafter
from kvwarm.engine.worker.drafts import Drafter

Phase = SlotPhase


@dataclass(slots=True, eq=False)
class Active:
    """What a slot carries while it serves one request."""

    req: Request
    namespace: Namespace
    sampler: Sampler
    assembler: TextAssembler
    prefill_pos: int
    #: Save points inside the prompt, ascending: the cold save's and, for a model whose state
    #: cannot be trimmed, checkpoints where later prompts will resume (``CachePort.pauses``).
    pauses: list[int]
    cached_tokens: int
    hit_kind: CacheHitKind
    admitted: float
    prefill_done: float = 0.0
    #: Tokens sampled (an end-of-generation one included) and when the first and the latest
    #: were: the decode interval llama-server times (``CompletionStats.decode_ms``).
    sampled: int = 0
    first_sampled: float = 0.0
    last_sampled: float = 0.0
    generated: list[int] = field(default_factory=list)
    stopped_by: LineStop | None = None  # the line stop that ended the reply, if one did
    pending: int | None = None  # sampled, not yet decoded
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0  # how many of ``logprobs`` went out with a fragment
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    last_continued: int = 0  # live KV length at the last continued save
    forks: list[Slot] = field(default_factory=list)  # slots waiting for this prompt's KV
    reuse: ReuseReport | None = None  # why no more of the prompt was reused (worker/explain.py)
    #: Speculative decoding (``engine/worker/drafts.py``): the request's drafter (None: it
    #: decodes plainly; decided on its first generating tick, once ``spec_decided``), the
    #: draft going into this tick's pass after ``pending``, and the tokens drafted and accepted.
    drafter: Drafter | ModelDrafter | None = None
    spec_decided: bool = False
    draft: list[int] = field(default_factory=list)
    #: Filler rows after the draft in this tick's pass (``Tick._batch``, ``Cost.pad``): their
    #: cells are removed with the rejected draft's, their logits never sampled.
    pad: int = 0
    #: How many positions past the draft the pass may still fill (its window, its memory's
    #: lookahead, one ubatch): ``Tick._propose`` sets it with the draft.
    pad_room: int = 0
    drafted: int = 0
    accepted: int = 0
    #: The LoRA adapters its forward passes run under (``engine/adapters.py``): fixed at
    #: admission; slots of other sets never share its passes.
    adapters: AdapterSet = ()
    #: The embeddings of the prompt's spans it did not restore, being encoded (by span index).
    encodes: dict[int, Future[bytes]] = field(default_factory=dict)
    #: Ticks in a row it wanted prefill room and got none (``batching.PrefillWant.waited``).
    prefill_waited: int = 0
    #: Ticks in a row it had a token to decode and the plan left it out
    #: (``batching``'s ``decode_waited``).
    decode_waited: int = 0
    #: An ``n > 1`` request's other choice (``engine/worker/forks.py``): its prompt's KV is
    #: the first choice's, so it runs no prefill of its own. Its ``prefill_ms`` (the wait for
    #: the first choice's prefill) is its caller's latency, and adds nothing to the model's
    #: prefill time (``WorkerStats.account``).
    fork: bool = False

    def unsent_logprobs(self, upto: int | None = None) -> tuple[TokenLogprob, ...]:
        """The logprobs not yet sent with a fragment (of the first ``upto`` tokens: those
        whose text went out); marks them sent."""
        end = len(self.logprobs) if upto is None else min(upto, len(self.logprobs))
        out = tuple(self.logprobs[self.logprobs_sent : end])
        self.logprobs_sent = max(self.logprobs_sent, end)
        return out

    @property
    def deterministic(self) -> bool:
        return self.req.deterministic


@dataclass(slots=True, eq=False)
class Slot:
    seq: int
    kv_tokens: list[int] = field(default_factory=list)
    canonical: int = 0
    #: The shortest prefix of ``kv_tokens`` the live state resumes at (``kvwarm.memory``):
    #: 0 for full attention; set by admission before planning for other memory kinds.
    floor: int = 0
    #: The same for a copy of it into another slot's sequence: higher where a copy goes
    #: through a pack (``BackendContext.copies_by_pack``), which leaves out what a saved
    #: state does (a window's masked cells).
    copy_floor: int = 0
    kv_namespace: Namespace | None = None  # None while the slot holds no KV
    phase: Phase = "idle"
    active: Active | None = None
    last_used: float = field(default_factory=time.monotonic)

    def reset_kv(self) -> None:
        self.kv_tokens.clear()
        self.canonical = 0
        self.floor = 0
        self.copy_floor = 0
        self.kv_namespace = None

    def status(self, *, freed: bool = False) -> SlotStatus:
        """A frozen copy for other threads (worker thread only: it reads live fields).
        ``freed``: as it will be once its finishing request lets go of it (idle, used now)."""
        if freed:
            return SlotStatus(self.seq, "idle", len(self.kv_tokens), self.canonical, time.time())
        # last_used is monotonic (the planner compares it); readers want wall-clock time.
        last_used = time.time() - (time.monotonic() - self.last_used)
        act = self.active
        if act is None:
            return SlotStatus(self.seq, self.phase, len(self.kv_tokens), self.canonical, last_used)
        return SlotStatus(
            self.seq,
            self.phase,
            len(self.kv_tokens),
            self.canonical,
            last_used,
            prompt_tokens=len(act.req.prompt_tokens),
            cached_tokens=act.cached_tokens,
            generated=len(act.generated),
            cache_hit=act.hit_kind,
        )
