"""What a loaded model reports about itself: ``ModelInfo`` (what it is, fixed at load but for
its adapters) and ``ModelStatus`` (its live counters), built from the parts ``Model`` holds.

Invariant: pure reads. Nothing here changes the model or waits on its worker; the counters are
read without a lock, so a status is a snapshot that may be one request out of date.

What a model load reports: one progress fraction over its phases, and whether the context
it is given fits what the model was trained on.

Invariant: the fraction handed to a load-progress callback never goes backwards and reaches 1.0
only when the weights are in memory. A ``safe`` fingerprint reads the whole file before
llama.cpp reads it again, so hashing gets its share of the bar (by bytes, the same work as
reading the weights); without it the bar would sit at 0% through the hash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from kvwarm.backends.base import EXACT_AT_ANY_LENGTH, ContextMemory, ModelFacts, ProjectorFacts
from kvwarm.cache.types import FingerprintMode, TierName
from kvwarm.engine.config import ModelConfig
from kvwarm.engine.types import AdapterInfo, Capability, ModelInfo, ModelStatus
from kvwarm.engine.worker.loop import Worker
from kvwarm.memory import MemoryKind

ModelState = Literal["loading", "ready", "unloading", "closed"]


def model_info(
    model_id: str,
    path: Path,
    backend_name: str,
    cfg: ModelConfig,
    facts: ModelFacts,
    *,
    fingerprint: bytes,
    mode: FingerprintMode,
    save_tier: TierName,
    adapters: Sequence[AdapterInfo],
    chat_template_name: str = "gguf",
    context_memory: ContextMemory | None = None,
    projector: ProjectorFacts | None = None,
    capabilities: tuple[Capability, ...] = ("generate", "embed"),
    pooling: str = "mean",
    draft_model: str | None = None,
    draft_bytes: int = 0,
    verify_exactness: str | None = None,
) -> ModelInfo:
    """The model's description; ``fingerprint`` is the effective one (adapters folded in).
    ``draft_model``: the draft model loaded, None where none is (a configured one is not
    loaded where speculation is off, and ``speculation`` says so). ``verify_exactness``: the
    backend's ``verify_exactness`` of the model's context (None: not asked, speculation being
    off for another reason)."""
    memory = MemoryKind(facts.memory_kind, facts.n_swa, cfg.context.swa_full)
    spec = speculation(cfg, memory, verify_exactness, not_generating(facts, capabilities))
    spec_exact = None if spec.startswith("off") else verify_exactness
    if cfg.draft_model is not None and draft_model is None:
        spec += f"; the draft model {Path(cfg.draft_model).name} was not loaded"
    return ModelInfo(
        id=model_id,
        path=str(path),
        backend=backend_name,
        n_ctx=cfg.context.n_ctx,
        n_batch=cfg.context.n_batch,
        n_parallel=cfg.n_parallel,
        n_vocab=facts.n_vocab,
        n_ctx_train=facts.n_ctx_train,
        n_embd=facts.n_embd,
        size_bytes=facts.size_bytes,
        description=facts.description,
        fingerprint=fingerprint.hex(),
        fingerprint_mode=mode.name.lower(),
        save_tier=save_tier,
        chat_template=True,  # every model chats: its own template, a chosen one, or chatml
        chat_template_name=chat_template_name,
        adapters=tuple(adapters),
        metadata=dict(facts.metadata),
        n_gpu_layers=cfg.model_params.n_gpu_layers,
        flash_attn=cfg.context.flash_attn,
        type_k=cfg.context.type_k,
        type_v=cfg.context.type_v,
        memory=facts.memory_kind,
        n_swa=facts.n_swa,
        swa_full=cfg.context.swa_full,
        kv_bytes=context_memory.kv_bytes if context_memory else 0,
        context_bytes=context_memory.total_bytes if context_memory else 0,
        mmproj=projector.path if projector else None,
        media=projector.kinds if projector else (),
        projector_bytes=projector.memory_bytes if projector else 0,
        adapter_bytes=sum(a.size_bytes for a in adapters),
        capabilities=capabilities,
        pooling=pooling,
        spec_type=cfg.default_spec_type,
        draft_model=draft_model,
        draft_bytes=draft_bytes,
        speculation=spec,
        speculation_exact=spec_exact,
    )


def not_generating(facts: ModelFacts, capabilities: Sequence[Capability]) -> str | None:
    """What a model that never generates is ("a reranker", "an encoder"), None for one that
    generates: such a model never verifies a draft (``engine/speculating.py``)."""
    if "rerank" in capabilities:
        return "a reranker"
    if not facts.causal:
        return "an encoder: its attention is not causal"
    return None


def speculation(
    cfg: ModelConfig, memory: MemoryKind, exactness: str | None, never_generates: str | None
) -> str:
    """Whether requests of this model can speculate (``ModelInfo.speculation``): "on", "on
    while a sequence is shorter than its window", or "off: " and why. ``exactness``: where a
    verify pass's rows are one-token passes (``BackendModel.verify_exactness``; None: not
    known yet, so not a reason); short of "at any length", speculation is off unless
    ``cfg.spec_exact`` is false. ``never_generates``: what the model is where it never
    generates (``not_generating``), the first reason of all (found by review: a reranker
    said "on", or with its flash attention left off was told to turn it on, and loaded a
    draft model, which failed its load where the draft model's vocabulary was another).
    The configuration's reasons come before the measurement's: they need none."""
    if never_generates is not None:
        return (
            f"off: this model does not generate ({never_generates}), so it never verifies a draft"
        )
    if cfg.deterministic:
        return (
            "off: deterministic mode (a verify pass is a batch of another shape than a "
            "one-token decode, which this mode keeps bit for bit only where kernels allow)"
        )
    if cfg.context.flash_attn == "off":
        return (
            "off: flash attention is off (a verify pass's logits would differ from one-token "
            "decoding's; set spec_type, or flash_attn on)"
        )
    ahead = memory.lookahead(0)
    if ahead == 0:
        return f"off: a {memory.kind} memory cannot roll a rejected draft back"
    if cfg.spec_exact and exactness not in (None, EXACT_AT_ANY_LENGTH):
        remedy = _KV_REMEDY if exactness.startswith("while") else _REMEDY
        return f"off: a verify pass's rows {_where(exactness)}, so a greedy {remedy}"
    if ahead is None:
        return "on"
    return f"on while a sequence is shorter than its {memory.n_swa}-token sliding window"


_REMEDY = "reply could differ from plain decoding's (set spec_exact = false to speculate anyway)"
_KV_REMEDY = (
    "reply could differ from plain decoding's (with llama.cpp on the CPU: q8_0 or bf16 KV "
    "cells, which a model with a spec_type gets by leaving type_k and type_v at auto; or set "
    "spec_exact = false)"
)


def _where(exactness: str) -> str:
    """``verify_exactness``' answer short of "at any length", as what a verify pass's rows
    are: "are one-token passes' only while ...", "are not known to be ... (not measured ...)"."""
    if exactness.startswith("while"):
        return f"are one-token passes' only {exactness}"
    if exactness.startswith("no: "):
        return f"differ from one-token passes ({exactness[4:]})"
    return f"are not known to be one-token passes' ({exactness})"


def model_status(model_id: str, state: ModelState, cfg: ModelConfig, worker: Worker) -> ModelStatus:
    """The model's live counters, read from its worker; ``failed`` for a ready model whose
    worker died (found by review: it said "ready" for good, so ``/cache/slots`` and the
    page's Cache view did, and a cluster replica's health check, which reads it, passed)."""
    s = worker.stats
    return ModelStatus(
        id=model_id,
        state="failed" if state == "ready" and worker.failure is not None else state,
        queued=worker.queued,
        active=worker.active,
        n_parallel=cfg.n_parallel,
        requests=s.requests,
        prompt_tokens=s.prompt_tokens,
        cached_tokens=s.cached_tokens,
        completion_tokens=s.completion_tokens,
        prefill_ms=s.prefill_ms,
        generation_ms=s.generation_ms,
        kv_cells_used=worker.kv_cells_used,
        # The context's cells: n_ctx for each slot (``Model._start_worker``). Found by review:
        # one slot's n_ctx, so the slots together used up to n_parallel times "all" of them.
        kv_cells=cfg.context.n_ctx * cfg.n_parallel,
        slots=worker.slot_statuses(),
        prefilled_tokens=s.prefilled_tokens,
        drafted_tokens=s.drafted_tokens,
        accepted_tokens=s.accepted_tokens,
        verify_passes=s.verify_passes,
        filler_rows=s.filler_rows,
        prewarms=s.prewarms,
        prewarm_prompt_tokens=s.prewarm_prompt_tokens,
        prewarm_cached_tokens=s.prewarm_cached_tokens,
        prewarm_prefilled_tokens=s.prewarm_prefilled_tokens,
        prewarm_ms=s.prewarm_ms,
    )


# --- What a model load reports: one progress fraction over its phases, and whether the context

log = logging.getLogger("kvwarm.engine")

Progress = Callable[[float], bool]

_HASH_SHARE = 0.5


class LoadProgress:
    """Splits one user callback into the hashing phase and the weights phase."""

    def __init__(self, progress: Progress | None, mode: FingerprintMode, has_file: bool) -> None:
        self._progress = progress
        self._hash_share = _HASH_SHARE if mode is FingerprintMode.SAFE and has_file else 0.0
        self._last = 0.0

    def _report(self, fraction: float) -> bool:
        assert self._progress is not None
        self._last = max(self._last, min(1.0, fraction))
        return self._progress(self._last)

    def hashing(self) -> Callable[[int, int], None] | None:
        """The fingerprint's ``(done, total)`` callback, or None if nothing listens."""
        if self._progress is None or self._hash_share == 0.0:
            return None
        share = self._hash_share

        def on_bytes(done: int, total: int) -> None:
            # Hashing cannot be cancelled half-way; a cancel is honoured by the weights phase.
            self._report(share * done / total if total else share)

        return on_bytes

    def weights(self) -> Progress | None:
        """The backend's load callback (fraction of the weights read), or None."""
        if self._progress is None:
            return None
        share = self._hash_share
        return lambda fraction: self._report(share + (1.0 - share) * fraction)


def warn_if_past_training(model_id: str, n_ctx_slot: int, n_ctx_train: int) -> None:
    """One accurate warning when a request may run past the model's training context.

    (llama.cpp's own warning compares the whole unified KV buffer, all slots together, with
    ``n_ctx_train``, so kvwarm demotes it: see ``backends._native``.)
    """
    if n_ctx_train > 0 and n_ctx_slot > n_ctx_train:
        log.warning(
            "model %s: n_ctx %d per request is more than the %d tokens it was trained on; "
            "output past %d tokens may degrade unless RoPE scaling extends it "
            "(--rope-scaling, --rope-freq-scale)",
            model_id,
            n_ctx_slot,
            n_ctx_train,
            n_ctx_train,
        )
