"""The engine's public names, and the process-wide default engine behind ``kvwarm.load_model``.

Five lines::

    import kvwarm
    model = kvwarm.load_model()          # the embedded default model
    print(model.complete("Once upon a time").text)

Invariant: every public call either returns or raises a ``KvwarmError`` subclass; the default
engine is created once, on first use (``docs/architecture.md``, "Engine").
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Unpack

from kvwarm.engine.config import EngineConfig, LoraSpec, ModelConfig, ModelOptions, with_options
from kvwarm.engine.engine import Engine
from kvwarm.engine.model import Model, PromptInput
from kvwarm.engine.ops import Message
from kvwarm.engine.speculating import untile_at_start
from kvwarm.engine.types import ModelInfo
from kvwarm.errors import KvwarmError
from kvwarm.tokens import Prompt, Span

__all__ = [
    "Engine",
    "EngineConfig",
    "LoraSpec",
    "Message",
    "Model",
    "ModelConfig",
    "ModelOptions",
    "Prompt",
    "PromptInput",
    "Span",
    "default_engine",
    "list_models",
    "load_model",
    "unload_model",
    "untile_at_start",
]

_default: Engine | None = None
_default_lock = threading.Lock()


def default_engine() -> Engine:
    """The process-wide engine used by ``kvwarm.load_model``; created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Engine()
        return _default


def load_model(
    path: str | os.PathLike[str] | None = None,
    *,
    model_id: str | None = None,
    config: ModelConfig | None = None,
    **options: Unpack[ModelOptions],
) -> Model:
    """Load a model into the default engine: ``kvwarm.load_model("m.gguf", n_ctx=4096,
    n_gpu_layers=99, n_parallel=4)``. Flat ``options`` override ``config`` (``ModelOptions``).
    The first call, before the default engine (and its threads) exists, decides the process's
    kernels for this model (``untile_at_start``)."""
    with _default_lock:
        first = _default is None
    if first:
        with contextlib.suppress(KvwarmError):  # a bad argument: the load below says so
            untile_at_start([(path, with_options(config or ModelConfig(), options))])
    return default_engine().load_model(path, model_id=model_id, config=config, **options)


def unload_model(model_id: str) -> None:
    default_engine().unload_model(model_id)


def list_models() -> list[ModelInfo]:
    return default_engine().list_models()
