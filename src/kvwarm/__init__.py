"""kvwarm: local LLMs through llama.cpp with a token-exact, multi-tier, crash-safe KV cache.

The five-line example::

    import kvwarm
    model = kvwarm.load_model()            # the embedded SmolLM2-135M-Instruct
    print(model.complete("Once upon a time", max_tokens=32).text)

Engine-level names are imported lazily so that ``kvwarm.cache`` works without llama.cpp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvwarm._version import __version__
from kvwarm.errors import *  # noqa: F403
from kvwarm.errors import KvwarmError

if TYPE_CHECKING:
    from kvwarm.engine.api import (
        Engine,
        EngineConfig,
        Model,
        default_engine,
        list_models,
        load_model,
        unload_model,
    )

_LAZY = {
    "Engine": "kvwarm.engine.api",
    "EngineConfig": "kvwarm.engine.api",
    "Model": "kvwarm.engine.api",
    "default_engine": "kvwarm.engine.api",
    "load_model": "kvwarm.engine.api",
    "unload_model": "kvwarm.engine.api",
    "list_models": "kvwarm.engine.api",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvwarm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "Engine",
    "EngineConfig",
    "KvwarmError",
    "Model",
    "__version__",
    "default_engine",
    "list_models",
    "load_model",
    "unload_model",
]
