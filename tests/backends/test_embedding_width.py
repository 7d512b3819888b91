"""An output embedding is as wide as the model's ``embedding_length_out`` (found by review).

llama.cpp stores ``n_embd_out`` floats per output (LFM2's embedding models project the hidden
state down with a dense layer: LFM2-ColBERT's 1024 to 128); the context read ``n_embd``, past
the end of what was stored, and answered vectors whose tail was whatever memory followed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.tinymodels import N_EMBD, _arch_keys, write_tiny_model

from kvwarm.backends.base import ContextParams, PoolingType
from kvwarm.backends.llama import LlamaBackend
from kvwarm.backends.llama.model import LlamaModel

pytestmark = pytest.mark.model

N_OUT = 16


def _keys(w: Any, arch: str) -> None:
    _arch_keys(w, arch)
    w.add_uint32(f"{arch}.embedding_length_out", N_OUT)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaModel]:
    path = write_tiny_model(tmp_path_factory.mktemp("lfm2out") / "lfm2.gguf", "lfm2", keys=_keys)
    loaded = LlamaBackend().load_model(str(Path(path)))
    assert loaded.facts.n_embd == N_EMBD != N_OUT
    yield loaded
    loaded.close()


@pytest.mark.parametrize("pooling", ["mean", "last", "none"])
def test_embeddings_are_n_embd_out_wide(model: LlamaModel, pooling: PoolingType) -> None:
    ctx = model.new_context(
        ContextParams(
            n_ctx=256, n_batch=64, n_ubatch=64, embeddings=True, pooling=pooling, n_threads=2
        )
    )
    try:
        first = ctx.embed([5, 6, 7, 8], normalize=False)
        assert len(first) == N_OUT
        assert all(math.isfinite(x) for x in first)
        assert ctx.embed([5, 6, 7, 8], normalize=False) == first  # the same floats, nothing else
        if pooling != "none":
            ctx.prefill(0, [5, 6, 7, 8], 0)
            assert list(ctx.pooled(0)) == first
    finally:
        ctx.close()
