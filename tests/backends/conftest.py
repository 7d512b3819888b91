"""Fixtures shared by the backend tests: one model per backend per module, fresh contexts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvwarm.backends import get_backend
from kvwarm.backends.base import BackendContext, BackendModel, ContextParams

#: Small everything: prefill is ~200 tok/s on the 2-core CI machine.
SMALL = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2, n_threads=2)

BACKENDS = ["stub", pytest.param("llama_cpp", marks=pytest.mark.model)]


def model_path(name: str) -> str:
    if name == "stub":
        return "stub-model"
    from kvwarm.embedded import default_model_path

    return str(default_model_path())


@pytest.fixture(scope="module", params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(backend_name: str) -> Iterator[BackendModel]:
    loaded = get_backend(backend_name).load_model(model_path(backend_name))
    yield loaded
    loaded.close()


def running(model: BackendModel) -> ContextParams:
    """``SMALL`` as the engine runs it on this backend (``context_params``: on a CPU, llama.cpp
    without flash attention, V transposed), so the contracts check the layout it serves."""
    return model.context_params(SMALL, deterministic=False)


@pytest.fixture
def ctx(model: BackendModel) -> Iterator[BackendContext]:
    context = model.new_context(running(model))
    yield context
    context.close()
