"""The embedding context is sized to the inputs it has embedded, and counted in the model's
memory (found by review: it was created at the model's full ``n_ctx`` as its ``n_ubatch``,
~0.9 GiB of llama.cpp buffers at n_ctx 4096 for one short input, and counted nowhere)."""

from __future__ import annotations

import pytest
from tests.engine.conftest import make_engine

from kvwarm.backends.base import ContextParams
from kvwarm.engine.api import Engine, ModelConfig
from kvwarm.engine.embeddings import context_tokens


def _config(n_ctx: int, n_batch: int = 16, threads: int | None = None) -> ModelConfig:
    return ModelConfig(
        context=ContextParams(
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
        )
    )


def _embedding_ctx_tokens(model: object) -> int:
    ctx = model._embedder._ctx  # type: ignore[attr-defined]
    assert ctx is not None
    return int(ctx.params.n_ubatch)


def test_context_tokens_bounds() -> None:
    assert context_tokens(1, 8192) == 512
    assert context_tokens(512, 8192) == 512
    assert context_tokens(513, 8192) == 1024
    assert context_tokens(5000, 8192) == 8192
    assert context_tokens(300, 256) == 256  # never past the model's n_ctx


def test_a_short_input_makes_a_small_context_and_it_is_counted() -> None:
    engine = make_engine()
    try:
        model = engine.load_model(config=ModelConfig(backend="stub", context=_config(4096).context))
        before = model.info()
        model.embed(["hello"])
        assert _embedding_ctx_tokens(model) == 512  # not 4096
        after = model.info()
        emb = model._embedder.memory_bytes()  # type: ignore[attr-defined]
        assert emb.total_bytes > 0
        assert after.context_bytes == before.context_bytes + emb.total_bytes
        assert after.kv_bytes == before.kv_bytes + emb.kv_bytes
        # A longer input grows it (one ubatch must hold it); a short one after does not shrink it.
        model.embed([[1 + i % 200 for i in range(700)]])
        assert _embedding_ctx_tokens(model) == 1024
        model.embed(["hi"])
        assert _embedding_ctx_tokens(model) == 1024
        assert model.info().context_bytes == before.context_bytes + (
            model._embedder.memory_bytes().total_bytes  # type: ignore[attr-defined]
        )
        engine.unload_model(model.id)  # the embedding context is freed and no longer counted
        assert model.info().context_bytes == before.context_bytes
    finally:
        engine.close()


@pytest.mark.model
@pytest.mark.slow
def test_vectors_do_not_depend_on_the_embedding_context_size() -> None:
    """Real model: a vector is the same from a small context, a grown one, and one created
    at the full n_ctx (the old sizing)."""
    from kvwarm.embedded import default_model_path

    long_input = [1 + (i % 900) for i in range(600)]
    engine: Engine = make_engine()
    try:
        model = engine.load_model(default_model_path(), config=_config(1024, 64, threads=2))
        small = model.embed(["hello world", [5, 6, 7]])
        assert _embedding_ctx_tokens(model) == 512
        grown_long = model.embed([long_input])
        assert _embedding_ctx_tokens(model) == 1024
        assert model.embed(["hello world", [5, 6, 7]]) == small
        full = engine.load_model(
            default_model_path(), model_id="full", config=_config(1024, 1024, threads=2)
        )
        assert full.embed(["hello world", [5, 6, 7]]) == small
        assert full.embed([long_input]) == grown_long
    finally:
        engine.close()
