"""What a loaded model reports about itself: ``ModelInfo`` (what it is, fixed at load but for
its adapters) and ``ModelStatus`` (its live counters), built from the parts ``Model`` holds.

Invariant: pure reads. Nothing here changes the model or waits on its worker; the counters are
read without a lock, so a status is a snapshot that may be one request out of date.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from kvwarm.backends.base import ModelFacts
from kvwarm.cache.types import FingerprintMode, TierName
from kvwarm.engine.config import ModelConfig
from kvwarm.engine.types import AdapterInfo, ModelInfo, ModelStatus
from kvwarm.engine.worker import Worker

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
) -> ModelInfo:
    """The model's description; ``fingerprint`` is the effective one (adapters folded in)."""
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
        chat_template=facts.chat_template is not None,
        adapters=tuple(adapters),
        metadata=dict(facts.metadata),
        n_gpu_layers=cfg.model_params.n_gpu_layers,
        flash_attn=cfg.context.flash_attn,
        type_k=cfg.context.type_k,
        type_v=cfg.context.type_v,
    )


def model_status(model_id: str, state: ModelState, cfg: ModelConfig, worker: Worker) -> ModelStatus:
    """The model's live counters, read from its worker."""
    s = worker.stats
    return ModelStatus(
        id=model_id,
        state=state,
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
        kv_cells=cfg.context.n_ctx,
        slots=worker.slot_statuses(),
        prefilled_tokens=s.prefilled_tokens,
    )
