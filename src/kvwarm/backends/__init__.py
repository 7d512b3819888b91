"""Model runtimes: the llama.cpp backend and a deterministic stub (see ``base``).

Invariant: importing this package never imports ``llama_cpp``; ``get_backend('llama_cpp')``
does, so cache-only and stub-only processes never load the native library
(``docs/architecture.md``, "Layers").
"""

from __future__ import annotations

from kvwarm.backends.base import Backend
from kvwarm.errors import ConfigError

BACKEND_NAMES = ("llama_cpp", "stub")


def get_backend(name: str) -> Backend:
    """The backend called ``name`` ('llama_cpp' or 'stub'), with default options (the stub's
    simulated latency from the environment: ``StubBackend.from_env``)."""
    if name == "stub":
        from kvwarm.backends.stub import StubBackend

        return StubBackend.from_env()
    if name == "llama_cpp":
        from kvwarm.backends.llama import LlamaBackend

        return LlamaBackend()
    raise ConfigError(f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
