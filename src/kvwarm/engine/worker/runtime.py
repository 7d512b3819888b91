"""What the worker thread's rooms share: the model, its context, the cache and the slots.

Invariant: a ``Runtime`` is touched only on its worker thread. Admission, the tick, sampling,
the cache port and outcomes each hold the same ``Runtime`` and never a copy of any of its parts, so
``slot.kv_tokens`` always lists exactly what the context's sequence holds (see
``docs/architecture.md``, "Engine"). The one exception is ``view``: frozen slot statuses that
``publish`` replaces whole, which other threads read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwarm.backends.base import AdapterSet, BackendContext, BackendModel
from kvwarm.cache.api import CacheApi
from kvwarm.cache.types import FingerprintMode, Namespace, PolicyConfig, TierName
from kvwarm.engine.types import CompletionStats, SlotStatus, SpecType
from kvwarm.engine.worker.batching import BatchStrategy
from kvwarm.engine.worker.draftmodel import DraftModel
from kvwarm.engine.worker.drafts import CopyEnds, PassCost, RowDrafts, RowTrust, SentenceEnds
from kvwarm.engine.worker.encoder import Encoder
from kvwarm.engine.worker.joinbuf import JoinBuffer
from kvwarm.engine.worker.slots import Slot
from kvwarm.errors import KvwarmError, StateRestoreError
from kvwarm.memory import MemoryKind

log = logging.getLogger(__name__)

#: A request's own adapter set, as (handle, scale) pairs (``GenerationOptions.lora``).
LoraChoice = tuple[tuple[int, float], ...]
#: A request's choice (None: the model's set) to the set it runs under and its namespace
#: (the model's fingerprint folded with that set; unsalted).
Resolver = Callable[[LoraChoice | None], tuple[AdapterSet, Namespace]]


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
    #: Prompts run whole, one ubatch per call, and leave no KV to reuse: a model whose
    #: attention is not causal (a cross-encoder), each position depending on every other.
    whole: bool = False
    #: Speculative decoding (``engine/worker/drafts.py``): the draft source of requests that
    #: do not choose, the n-gram size its lookups match, the longest draft; ``speculates``
    #: False where the model cannot (deterministic mode: see ``ModelInfo.speculation``).
    spec_type: SpecType = "none"
    spec_ngram_n: int = 4
    spec_draft_max: int = 48
    speculates: bool = True
    #: Several slots' verify passes share one call only where this is True: the model need
    #: not keep speculation's replies plain decoding's (``spec_exact`` false, which a GPU
    #: needs to speculate at all) and its memory is full attention. Elsewhere, in one unified
    #: KV buffer, each further verify pass takes a call of its own, so that every sequence's
    #: cells stay in position order (``Tick._run_call``).
    verify_together: bool = False


@dataclass(slots=True)
class WorkerStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_ms: float = 0.0
    generation_ms: float = 0.0
    ticks: int = 0
    prefilled_tokens: int = 0  # prompt tokens run through the model (not restored or forked)
    drafted_tokens: int = 0  # speculative decoding: tokens drafted into verify passes
    accepted_tokens: int = 0  # ... and accepted by the model
    verify_passes: int = 0  # slots' passes that verified a draft
    filler_rows: int = 0  # rows that filled a verify pass up to a tile (``Cost.pad``)
    hits: dict[str, int] = field(default_factory=lambda: {"exact": 0, "partial": 0, "cold": 0})
    #: The cache's upkeep (``Request.upkeep``: ``Model.prewarm``), apart from the requests
    #: above: prewarms ended, their prompt tokens, those reused and those run through the
    #: model, and their prefill time.
    prewarms: int = 0
    prewarm_prompt_tokens: int = 0
    prewarm_cached_tokens: int = 0
    prewarm_prefilled_tokens: int = 0
    prewarm_ms: float = 0.0
    #: ``account`` runs on the worker's thread, and on a caller's for a request it cancels
    #: while still queued (``Worker.cancel``): its sums are taken under this lock.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def account(self, st: CompletionStats, *, upkeep: bool = False, fork: bool = False) -> None:
        """Count one request that ended (``upkeep``: a prewarm, counted apart). ``prefill_ms``
        sums the prefills run: a ``fork`` (``n > 1``) ran none, so its ``prefill_ms``, the
        wait for its first choice's, adds nothing (found by review: one prefill counted n
        times, and the dashboard's time saved, cached x prefill_ms / prefilled, n times too
        high)."""
        with self._lock:
            self._account(st, upkeep=upkeep, fork=fork)

    def _account(self, st: CompletionStats, *, upkeep: bool, fork: bool) -> None:
        if upkeep:
            self.prewarms += 1
            self.prewarm_prompt_tokens += st.prompt_tokens
            self.prewarm_cached_tokens += st.cached_tokens
            self.prewarm_ms += st.prefill_ms
            return
        self.requests += 1
        self.prompt_tokens += st.prompt_tokens
        self.cached_tokens += st.cached_tokens
        self.completion_tokens += st.completion_tokens
        if not fork:
            self.prefill_ms += st.prefill_ms
        self.generation_ms += st.generation_ms
        self.drafted_tokens += st.drafted_tokens
        self.accepted_tokens += st.accepted_tokens
        self.hits[st.cache_hit] += 1


@dataclass(slots=True, eq=False)
class Runtime:
    name: str
    model: BackendModel
    ctx: BackendContext
    cache: CacheApi
    cfg: WorkerConfig
    namespace: Callable[[], Namespace]
    slots: list[Slot]
    #: A request's adapter choice to its set and namespace (None: the model's set and
    #: ``namespace()``, for a model without adapters).
    resolve: Resolver | None = None
    stats: WorkerStats = field(default_factory=WorkerStats)
    #: The adapters the context has attached now: the set of the last forward pass.
    adapters_now: AdapterSet = ()
    view: tuple[SlotStatus, ...] = ()
    join_buf: JoinBuffer = field(default_factory=JoinBuffer)  # chunked restores join here
    #: Encodes media spans off this thread (None: the model has no projector).
    encoder: Encoder | None = None
    pass_cost: PassCost = field(default_factory=PassCost)  # what a draft token costs a pass
    row_drafts: RowDrafts | None = None  # drafts from cached rows (made on first use)
    #: Where n-gram drafts cross sentence ends (``learn_vocabulary``; a model that does not
    #: speculate as it loads: on first use), and
    #: how often this model's copies went on past one.
    sentence_ends: SentenceEnds | None = None
    copy_ends: CopyEnds = field(default_factory=CopyEnds)
    row_trust: RowTrust = field(default_factory=RowTrust)  # trusted row drafts held?
    draft: DraftModel | None = None  # the draft model (``draft_model``), if any
    #: Whether a verify pass under an adapter set is exact (``Adapters.exact_set``; None:
    #: every set is, or the model may speculate inexactly).
    adapters_exact: Callable[[AdapterSet], bool] | None = None
    #: When a token is sampled (``Active.first_sampled``, ``last_sampled``): the decode
    #: timings and ``t_max_predict_ms`` read it. Tests replace it to step time as they wish.
    clock: Callable[[], float] = time.perf_counter
    _eog: tuple[int, ...] | None = None

    def adapter_set(self, choice: LoraChoice | None) -> tuple[AdapterSet, Namespace]:
        """The set a request with ``choice`` runs under, and its (unsalted) namespace."""
        if self.resolve is None:
            return (), self.namespace()
        return self.resolve(choice)

    def use_adapters(self, adapters: AdapterSet) -> None:
        """Attach exactly ``adapters`` to the context unless it has them already (llama.cpp
        then re-plans its compute graph on the next pass: a pass of another set than the
        last costs that once)."""
        if adapters == self.adapters_now:
            return
        self.ctx.set_adapters(adapters)
        self.adapters_now = adapters

    @property
    def memory(self) -> MemoryKind:
        """What the context's per-sequence state can resume from (``kvwarm.memory``)."""
        return self.ctx.memory

    def refresh_floors(self) -> None:
        """Each slot's live floor, from where its state now begins, and its copy floor
        (planning needs them only for a memory that cannot be trimmed; full attention keeps
        0). A copy that goes through a pack holds what a saved state holds: it resumes no
        lower than a saved state of the slot's length would."""
        mem = self.ctx.memory
        if mem.trimmable:
            return
        by_pack = self.ctx.copies_by_pack
        for slot in self.slots:
            n = len(slot.kv_tokens)
            slot.floor = mem.live_floor(n, self.ctx.seq_pos_min(slot.seq)) if n else 0
            slot.copy_floor = max(slot.floor, mem.saved_floor(n)) if by_pack else slot.floor

    def settle_layout(self, slot: Slot) -> bytes:
        """Give ``slot``'s sequence the cell layout a restore of its state would give it.

        A saved sliding-window state leaves out the cells the window no longer sees, which a
        live sequence keeps until their room is needed; the number and places of cells
        change how llama.cpp splits attention across threads, hence the last bits of every
        later logit. Round-tripping the state after each prefill chunk (deterministic mode,
        a memory that cannot be trimmed) makes a cold run and a run restored at any chunk
        boundary hold the same cells in the same places: bit-identical from there on. Costs
        one pack and unpack of the state per chunk (milliseconds beside the chunk's decode).
        Measured on Gemma 3 270M: without it a restore past the window gave max |dlogit| 0.65.
        Returns the packed state, which is also what a save at this point would pack."""
        blob = self.ctx.kv_pack(slot.seq)
        self.ctx.kv_unpack(slot.seq, blob)
        return blob

    def publish(self, freed: Slot | None = None) -> None:
        """Refresh ``view`` from the live slots: after each round, and before a request's
        answer goes out (so a caller who got it sees its slot free). ``freed``: a slot whose
        request is answered next and which then only packs its finish save on this thread
        (no request can take it before that ends anyway): shown idle already."""
        self.view = tuple(slot.status(freed=slot is freed) for slot in self.slots)

    def reset_seq(self, slot: Slot) -> None:
        """Drop the slot's KV from the context and forget its tokens."""
        if slot.kv_tokens:
            self.ctx.seq_rm(slot.seq, 0, -1)
        slot.reset_kv()

    def eog_tokens(self) -> tuple[int, ...]:
        """Every end-of-generation token id (``learn_vocabulary``, once)."""
        if self._eog is None:
            self.learn_vocabulary()
        assert self._eog is not None
        return self._eog

    def learn_vocabulary(self) -> None:
        """What the worker needs of the vocabulary, from one pass over it
        (``BackendModel.vocabulary``), made as the model loads, not by its first request:
        the end-of-generation tokens, and for a model that drafts n-grams, where its drafts
        cross sentence ends (a model whose requests choose to: on the first that does).
        One ``is_eog`` call a token took 1.6 s for Gemma 3's 262,144 (a check and the
        lifetime lock each; ~0.3 s for the whole pass), and the sentence ends, made on the
        first speculating request, put ~0.1 s (SmolLM2) into its reply."""
        pieces, eog = self.model.vocabulary()
        self._eog = tuple(sorted(eog))
        if self.cfg.speculates and self.cfg.spec_type not in ("none", "draft-simple"):
            self.sentence_ends = SentenceEnds(pieces)

    def reserve_verify_rows(self) -> None:
        """Make room for the logits of a speculating model's longest verify pass (its
        pending token, ``spec_draft_max`` drafted, a tile's filler: ``Cost.pad``) while the
        model loads (``BackendContext.reserve_outputs``). llama.cpp grows its logits buffer
        when a pass wants more rows than any before (a new allocation, its pages faulted in
        as the logits land), so each verify pass longer than any before paid for it: Gemma 3
        270M's 262,144 logits are 50 MB for 48 rows, and its first 48-row pass took 324 ms
        against 288-292 for the next (traced in the server, 2026-11-30; the first request
        grew it at 8, 16, 34 and 38 rows). A longer draft asked for per request still grows
        it. Nothing is lost where the pass fails (the model serves, its first long passes slower),
        but a context that keeps cells after it is emptied fails the load. Where slots verify
        together (``verify_together``), the longest call holds every slot's pass, within
        ``n_batch`` (found by review: 4 slots' 49 rows of Gemma 3's logits are ~200 MB, grown
        mid-serving, pinned host memory on a GPU)."""
        cfg = self.cfg
        if not cfg.speculates or cfg.spec_type == "none":
            return
        rows = cfg.spec_draft_max + self.pass_cost.tile
        if cfg.verify_together:
            rows = min(cfg.n_batch, rows + (cfg.n_parallel - 1) * (cfg.spec_draft_max + 1))
        try:
            self.ctx.reserve_outputs(rows)
        except StateRestoreError:
            raise  # cells left in the context: no slot may start on them
        except KvwarmError as exc:
            log.warning("%s: no room made for %d rows of logits: %s", self.name, rows, exc)
