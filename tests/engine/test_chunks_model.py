"""Restores from chunked rows on the real model: bit-identical to cold runs in deterministic
mode, with chunk boundaries that are (8) and are not (12) multiples of n_batch (8)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
from tests.engine.conftest import LOW_GATES, make_engine
from tests.engine.test_engine_model import (
    DET,
    N_BATCH,
    STEPS,
    assert_same,
    cold_run,
    model_config,
    prompt_of,
)
from tests.engine.test_tail_restore import spy_bases

from kvwarm.cache.types import CacheConfig, PolicyConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, Model
from kvwarm.engine.types import Completion, GenerationOptions

pytestmark = pytest.mark.model

POLICY = PolicyConfig(
    min_tokens=4,
    cold_min_tokens=N_BATCH,
    boundary_trim_tokens=0,
    boundary_align_tokens=N_BATCH,
    continued_interval=10_000,
    session_resume_wait_ms=2000,
)


@pytest.fixture(scope="module")
def cold_model() -> Iterator[Model]:
    """Saves nothing: every request is a cold prefill (the reference)."""
    never = replace(LOW_GATES, min_tokens=10**9, cold_min_tokens=10**9, cold_max_tokens=10**9)
    eng = make_engine(policy=never)
    yield eng.load_model(config=model_config())
    eng.close()


@pytest.fixture(scope="module", params=[8, 12])
def chunked(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Model]]:
    root = tmp_path_factory.mktemp("chunks")
    tiers = (TierConfig("disk", 1 << 30, root),)  # every restore reads chunk files
    cfg = CacheConfig(tiers=tiers, chunk_tokens=request.param)
    eng = Engine(EngineConfig(cache=cfg, policy=POLICY))
    yield eng, eng.load_model(config=model_config())
    eng.close()


@pytest.mark.parametrize("n_words", [13, 29, 41])
def test_restores_from_chunks_equal_cold(
    n_words: int, chunked: tuple[Engine, Model], cold_model: Model
) -> None:
    engine, model = chunked
    prompt = prompt_of(n_words)
    cold = cold_run(cold_model, prompt)
    model.complete(prompt, DET)
    engine.cache.flush()
    written = engine.cache.counters()["chunks_written"]
    assert written >= 2  # the row is a manifest over chunks
    model.evict()
    exact = model.complete(prompt, DET)
    assert exact.stats.cache_hit == "exact"
    assert_same(exact, cold)
    # Restored in place from the chunks' buffers: the worker never needed a join buffer.
    assert model._worker.rt.join_buf.capacity == 0

    # A longer prompt restores the row's chunks (trimmed where deterministic mode says).
    longer = prompt + " " + prompt_of(5)
    cold_longer = cold_run(cold_model, longer)
    engine.cache.flush()
    model.evict()
    warm = model.complete(longer, DET)
    assert warm.stats.cache_hit in ("partial", "exact")
    assert_same(warm, cold_longer)
    engine.cache.flush()  # its saves are written off the request's path
    assert engine.cache.counters()["chunks_reused"] >= 1  # its save reused the shared chunks


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_quantised_cells_restore_from_chunks_equal_cold(
    kv_type: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Quantised K and V cells (flash attention on, as ``auto`` picks on CPU) split into
    chunks and join back into a restore bit-identical to a cold run of the same cell type."""
    base = model_config()
    context = replace(base.context, type_k=kv_type, type_v=kv_type)  # type: ignore[arg-type]
    config = replace(base, context=context)
    never = replace(LOW_GATES, min_tokens=10**9, cold_min_tokens=10**9, cold_max_tokens=10**9)
    root = tmp_path_factory.mktemp(f"chunks-{kv_type}")
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root),), chunk_tokens=8)
    with (
        make_engine(policy=never) as cold_eng,
        Engine(EngineConfig(cache=cfg, policy=POLICY)) as eng,
    ):
        cold_model = cold_eng.load_model(config=config)
        model = eng.load_model(config=config)
        prompt = prompt_of(29)
        cold = cold_run(cold_model, prompt)
        model.complete(prompt, DET)
        eng.cache.flush()
        assert eng.cache.counters()["chunks_written"] >= 2
        model.evict()
        exact = model.complete(prompt, DET)
        assert exact.stats.cache_hit == "exact"
        assert_same(exact, cold)


def test_a_next_turn_restores_its_tail_onto_the_system_prompt_left_live(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24: conversation A, then B over the same system prompt in the one slot, then
    A's next turn. A's row is restored only from the chunk boundary within the system prompt
    that B left live, and its reply equals a whole-row restore's (tails refused)."""
    from kvwarm.backends.llama.context import LlamaContext

    config = replace(model_config(), deterministic=False)
    opts = GenerationOptions(max_tokens=STEPS, temperature=0.0, logprobs=5)
    system = prompt_of(41)

    def turns(tails: bool) -> tuple[Completion, list[int], int]:
        if not tails:
            monkeypatch.setattr(LlamaContext, "restores_tails", property(lambda _: False))
        root = tmp_path_factory.mktemp("tails")
        cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root),), chunk_tokens=16)
        with Engine(EngineConfig(cache=cfg, policy=POLICY)) as eng:
            model = eng.load_model(config=config)
            bases = spy_bases(model, monkeypatch)
            a = model.complete(system + " Who is alpha?", opts)
            eng.cache.flush()
            model.complete(system + " Who is bravo?", opts)
            eng.cache.flush()
            a_text = system + " Who is alpha?" + a.text
            n_system = len(model.tokenize(system))
            return model.complete(a_text + " And golf?", opts), bases, n_system

    tail, tail_bases, n_system = turns(tails=True)
    whole, whole_bases, _ = turns(tails=False)
    # A chunk boundary inside the system prompt (the chunks line up with A's cold row's).
    assert tail_bases and n_system - 16 < tail_bases[-1] <= n_system
    assert whole_bases[-1] == 0
    assert tail.stats.cached_tokens == whole.stats.cached_tokens > tail_bases[-1]
    assert tail.completion_tokens == whole.completion_tokens
    assert tail.logprobs is not None and whole.logprobs is not None
    for t, w in zip(tail.logprobs, whole.logprobs, strict=True):
        assert abs(t.logprob - w.logprob) < 1e-3
