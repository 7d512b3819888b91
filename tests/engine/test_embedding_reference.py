"""kvwarm's embeddings of the embedded SmolLM2 against llama-server's (the reference peer, built
from the same pinned llama.cpp): ``bench/embedding_reference.py`` records its ``/v1/embeddings``
vectors (``--pooling mean -np 1 -fa off``) into ``embedding_reference.<vector set>.json``
(``tests/references.py``), as CI has no llama-server. kvwarm pools SmolLM2 by mean (its GGUF
declares no pooling) and runs flash attention off on the CPU, so its vectors are llama-server's
to float32 rounding, and the usage counts the same tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from tests import references

from kvwarm.backends.base import ContextParams
from kvwarm.embedded import default_model_path
from kvwarm.engine.api import ModelConfig

from .conftest import make_engine

pytestmark = pytest.mark.model

REFERENCE = references.load(Path(__file__).parent / "embedding_reference.json")


def test_vectors_are_llama_servers() -> None:
    model_path = default_model_path()
    assert hashlib.sha256(model_path.read_bytes()).hexdigest() == REFERENCE["sha256"], (
        "the embedded model is not the file the reference embedded: run "
        "bench/embedding_reference.py"
    )
    eng = make_engine()
    try:
        model = eng.load_model(
            config=ModelConfig(
                context=ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2)
            )
        )
        inputs = REFERENCE["inputs"]
        ours = np.array(model.embed(inputs))
        theirs = np.array(REFERENCE["vectors"])
        assert ours.shape == theirs.shape
        assert np.abs(ours - theirs).max() < 1e-6
        assert sum(len(model.tokenize(x)) for x in inputs) == REFERENCE["prompt_tokens"]
    finally:
        eng.close()
