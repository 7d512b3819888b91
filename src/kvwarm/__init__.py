"""kvwarm: local LLMs through llama.cpp with a token-exact, multi-tier, crash-safe KV cache.

The five-line example::

    import kvwarm
    model = kvwarm.load_model()            # the embedded SmolLM2-135M-Instruct
    print(model.complete("Once upon a time", max_tokens=32).text)

Everything a program needs is importable from here::

    from kvwarm import Engine, EngineConfig, CacheConfig, TierConfig, ModelConfig
    engine = Engine(EngineConfig(cache=CacheConfig(tiers=(TierConfig("ram", 1 << 30),))))
    model = engine.load_model("model.gguf", n_ctx=4096, n_gpu_layers=99, n_parallel=4)

Invariant: importing ``kvwarm`` imports neither llama.cpp nor the engine; engine-level names
are resolved on first use, so ``kvwarm.cache`` works without llama.cpp
(``docs/architecture.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvwarm import errors
from kvwarm._version import __version__
from kvwarm.errors import *  # noqa: F403

if TYPE_CHECKING:
    from kvwarm.backends.base import ContextParams, ModelParams
    from kvwarm.cache.explain import MissReason, ReuseReport
    from kvwarm.cache.types import CacheConfig, PolicyConfig, TierConfig, TtlClass
    from kvwarm.engine.api import (
        Engine,
        EngineConfig,
        LoraSpec,
        Model,
        ModelConfig,
        ModelOptions,
        default_engine,
        list_models,
        load_model,
        unload_model,
    )
    from kvwarm.engine.cancel import Cancellation
    from kvwarm.engine.options import GenerationOverrides
    from kvwarm.engine.prompts import MediaPrompt
    from kvwarm.engine.stream import CompletionStream
    from kvwarm.engine.types import Completion, CompletionStats, GenerationOptions
    from kvwarm.tokens import Prompt, Span

_LAZY = {
    "Engine": "kvwarm.engine.api",
    "EngineConfig": "kvwarm.engine.api",
    "LoraSpec": "kvwarm.engine.api",
    "MediaPrompt": "kvwarm.engine.prompts",
    "Model": "kvwarm.engine.api",
    "ModelConfig": "kvwarm.engine.api",
    "ModelOptions": "kvwarm.engine.api",
    "default_engine": "kvwarm.engine.api",
    "load_model": "kvwarm.engine.api",
    "unload_model": "kvwarm.engine.api",
    "list_models": "kvwarm.engine.api",
    "GenerationOptions": "kvwarm.engine.types",
    "GenerationOverrides": "kvwarm.engine.options",
    "Completion": "kvwarm.engine.types",
    "CompletionStats": "kvwarm.engine.types",
    "CompletionStream": "kvwarm.engine.stream",
    "Cancellation": "kvwarm.engine.cancel",
    "ContextParams": "kvwarm.backends.base",
    "ModelParams": "kvwarm.backends.base",
    "CacheConfig": "kvwarm.cache.types",
    "TierConfig": "kvwarm.cache.types",
    "PolicyConfig": "kvwarm.cache.types",
    "TtlClass": "kvwarm.cache.types",
    "MissReason": "kvwarm.cache.explain",
    "ReuseReport": "kvwarm.cache.explain",
    "Prompt": "kvwarm.tokens",
    "Span": "kvwarm.tokens",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvwarm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "CacheConfig",
    "Cancellation",
    "Completion",
    "CompletionStats",
    "CompletionStream",
    "ContextParams",
    "Engine",
    "EngineConfig",
    "GenerationOptions",
    "GenerationOverrides",
    "LoraSpec",
    "MediaPrompt",
    "MissReason",
    "Model",
    "ModelConfig",
    "ModelOptions",
    "ModelParams",
    "PolicyConfig",
    "Prompt",
    "ReuseReport",
    "Span",
    "TierConfig",
    "TtlClass",
    "__version__",
    "default_engine",
    "errors",
    "list_models",
    "load_model",
    "unload_model",
]
# Every error class, as ``from kvwarm.errors import *`` above brings them (found by review:
# ``from kvwarm import *`` gave KvwarmError alone, and the docs catch ConfigError,
# InvalidRequestError and EngineClosedError by these names).
__all__ += errors.__all__
