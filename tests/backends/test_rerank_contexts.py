"""The backend contract of rank-pooling contexts, on both backends: a decoder reranker's
(``qwen3``, causal, a KV cache) and a cross-encoder's (``bert``: attention not causal, no KV
cache: a *stateless* context). The llama.cpp models are ``tests/tinymodels.write_reranker``'s;
the stub's are named by their paths (``reranker``, ``cross-encoder``).

What must hold on both: a score read by ``pooled`` after a sequence's decode; an error, never
a stale number, for a sequence the last decode did not hold; an encoder's call that would not
fit one ubatch refused before llama.cpp asserts on it; nothing packed or restored from a
stateless context, whose sequence operations do nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from tests.tinymodels import write_reranker

from kvwarm.backends import get_backend
from kvwarm.backends.base import BackendModel, BatchToken, ContextParams
from kvwarm.errors import InvalidRequestError, ModelLoadError, NoLogitsError, StateRestoreError

POOLED = ContextParams(
    n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2, n_threads=2, embeddings=True, pooling="rank"
)
PLAIN = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_threads=2)
BACKENDS = ["stub", pytest.param("llama_cpp", marks=pytest.mark.model)]


def load(backend: str, kind: str, factory: pytest.TempPathFactory) -> BackendModel:
    if backend == "stub":
        path = f"stub-{'reranker' if kind == 'decoder' else 'cross-encoder'}.gguf"
    else:
        path = str(write_reranker(factory.mktemp(kind) / f"{kind}.gguf", kind))
    return get_backend(backend).load_model(path)


@pytest.fixture(scope="module", params=BACKENDS)
def decoder(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackendModel]:
    model = load(request.param, "decoder", tmp_path_factory)
    yield model
    model.close()


@pytest.fixture(scope="module", params=BACKENDS)
def encoder(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackendModel]:
    model = load(request.param, "encoder", tmp_path_factory)
    yield model
    model.close()


@pytest.fixture(
    scope="module",
    params=[
        ("stub", "decoder"),
        ("stub", "encoder"),
        pytest.param(("llama_cpp", "decoder"), marks=pytest.mark.model),
        pytest.param(("llama_cpp", "encoder"), marks=pytest.mark.model),
    ],
    ids=["stub-decoder", "stub-encoder", "llama_cpp-decoder", "llama_cpp-encoder"],
)
def reranker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, BackendModel]]:
    backend, kind = request.param
    model = load(backend, kind, tmp_path_factory)
    yield kind, model
    model.close()


def tokens(model: BackendModel, text: str) -> list[int]:
    return model.tokenize(text, add_special=False, parse_special=False)


def whole(seq: int, toks: list[int]) -> list[BatchToken]:
    return [BatchToken(t, i, seq) for i, t in enumerate(toks)]


def test_facts(decoder: BackendModel, encoder: BackendModel) -> None:
    d, e = decoder.facts, encoder.facts
    assert (d.pooling, d.causal, d.n_cls_out) == ("rank", True, 2)
    assert d.rerank_template is not None and "{document}" in d.rerank_template
    assert (e.pooling, e.causal, e.n_cls_out, e.rerank_template) == ("rank", False, 1, None)
    assert e.add_eos


def test_each_sequence_is_scored_and_only_from_the_last_decode(
    reranker: tuple[str, BackendModel],
) -> None:
    kind, model = reranker
    ctx = model.new_context(POOLED)
    try:
        a, b = tokens(model, "cats eat fish"), tokens(model, "a lighthouse")
        ctx.decode(whole(0, a) + whole(1, b))
        first, second = ctx.pooled(0), ctx.pooled(1)
        assert len(first) == model.facts.n_cls_out and first != second
        if kind == "decoder":
            assert abs(sum(first) - 1.0) < 1e-5  # [p(yes), p(no)]: a softmax
        # Sequence 0 again (an encoder's from position 0, a decoder's one more token).
        ctx.decode(whole(0, a) if kind == "encoder" else [BatchToken(a[0], len(a), 0)])
        with pytest.raises(NoLogitsError):
            ctx.pooled(1)  # not in the last decode: an error, never its old score
        with pytest.raises(InvalidRequestError):
            ctx.pooled(2)
    finally:
        ctx.close()


def test_a_decoders_pooling_context_keeps_its_kv(decoder: BackendModel) -> None:
    ctx = decoder.new_context(POOLED)
    try:
        a = tokens(decoder, "cats eat fish")
        ctx.decode(whole(0, a))
        assert not ctx.stateless and ctx.seq_pos_max(0) == len(a) - 1
        blob = ctx.kv_pack(0)
        assert ctx.kv_unpack(1, blob) == len(a)
    finally:
        ctx.close()


def test_an_encoders_context_keeps_nothing(encoder: BackendModel) -> None:
    ctx = encoder.new_context(POOLED)
    try:
        a = tokens(encoder, "cats eat fish")
        ctx.decode(whole(0, a))
        assert ctx.stateless and not ctx.restores_tails
        assert ctx.seq_pos_max(0) == -1 and ctx.seq_pos_min(0) == -1
        ctx.seq_rm(0)
        ctx.seq_cp(0, 1)
        ctx.clear()
        with pytest.raises(StateRestoreError):
            ctx.kv_pack(0)
        with pytest.raises(StateRestoreError):
            ctx.kv_unpack(0, b"\0" * 64)
        with pytest.raises(InvalidRequestError):
            ctx.decode([BatchToken(a[0], 1, 0)])  # a sequence starts at 0, every call
        ctx.decode(whole(0, a))  # and is scored again, whole
        assert len(ctx.pooled(0)) == 1
    finally:
        ctx.close()


def test_an_encoders_call_must_fit_one_ubatch(encoder: BackendModel) -> None:
    """llama.cpp asserts that a non-causal call fits one ubatch: refused here first."""
    ctx = encoder.new_context(replace(POOLED, n_batch=64))
    try:
        long = (tokens(encoder, "the sea and the harbour, the boats and the fish") * 8)[:40]
        with pytest.raises(InvalidRequestError, match="ubatch"):
            ctx.decode(whole(0, long))
        with pytest.raises(InvalidRequestError):
            ctx.prefill(0, long, 0)
        ctx.decode(whole(0, long[:32]))  # one ubatch: fine, and the context still serves
        assert len(ctx.pooled(0)) == 1
    finally:
        ctx.close()


def test_an_encoder_runs_only_pooled(encoder: BackendModel) -> None:
    with pytest.raises(ModelLoadError, match="no KV cache"):
        encoder.new_context(PLAIN)


def test_a_context_that_does_not_pool_has_no_scores(decoder: BackendModel) -> None:
    ctx = decoder.new_context(PLAIN)
    try:
        ctx.decode(whole(0, tokens(decoder, "cats")))
        with pytest.raises(InvalidRequestError):
            ctx.pooled(0)
    finally:
        ctx.close()
