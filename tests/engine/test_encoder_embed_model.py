"""An encoder embedding model (a BERT: attention not causal, pooling mean), on the real
backend with the tiny random-weight ``bert`` of ``tests/tinymodels.write_reranker``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from tests.tinymodels import write_reranker

from kvwarm.backends.base import ContextParams
from kvwarm.engine.api import Engine, ModelConfig
from kvwarm.errors import CapabilityError

pytestmark = pytest.mark.model


def test_an_encoder_embedding_model_loads_and_only_embeds(engine: Engine, tmp_path: Path) -> None:
    """Found by review: a BERT embedding model (nomic-embed, bge, MiniLM: what llama-server's
    ``--embeddings`` mostly serves) failed its load ("this model keeps no KV cache"), as the
    model's generation context was made for it like a generator's. It loads now, says it only
    embeds, embeds (unit vectors, an input's vector whatever its batch), and refuses to
    generate or rerank with a typed error."""
    path = write_reranker(tmp_path / "bert-embed.gguf", "encoder", pooling=1)
    context = ContextParams(n_ctx=512, n_batch=512, n_ubatch=512)
    model = engine.load_model(path, model_id="bert", config=ModelConfig(context=context))
    assert model.info().capabilities == ("embed",)
    assert model.info().speculation.startswith("off: this model does not generate (an encoder")
    one, two = model.embed(["cats purr", "the ferry leaves at noon"])
    assert len(one) == model.facts.n_embd
    assert math.isclose(math.sqrt(sum(v * v for v in one)), 1.0, rel_tol=1e-6)
    assert one != two
    assert model.embed("cats purr")[0] == pytest.approx(one, abs=1e-6)
    with pytest.raises(CapabilityError, match="only embed"):
        model.complete("hi", max_tokens=1)
    with pytest.raises(CapabilityError):
        model.rerank("q", ["d"])
