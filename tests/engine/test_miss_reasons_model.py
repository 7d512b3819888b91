"""Miss reasons on the real embedded model (issue 25): the deterministic-mode trim, an
eviction, and a restart (rows survive it; the memory of evictions does not), with
``kvwarm cache explain`` reading the same directory through the tokenizer alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import LOW_GATES

from kvwarm.backends.base import ContextParams
from kvwarm.cache.explain import MissReason, ReuseReport
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
from kvwarm.engine.types import Completion, GenerationOptions

pytestmark = pytest.mark.model

N_BATCH = 16
GREEDY = GenerationOptions(max_tokens=4, temperature=0.0)
OTHER = "A different prompt about the weather today, in short."
PROMPT = "Kvwarm keeps prompt caches on disk. Explain in one line why a cache may miss."


def config(*, det: bool) -> ModelConfig:
    ctx = ContextParams(n_ctx=512, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=2,
                        n_threads_batch=2)  # fmt: skip
    return ModelConfig(context=ctx, deterministic=det, save_tier="disk")


def make(tmp: Path) -> Engine:
    # The layout the settings give ``--cache-dir tmp/c`` (rows under ``rows/``).
    tiers = (TierConfig("ram", 64 << 20), TierConfig("disk", 256 << 20, tmp / "c" / "rows"))
    return Engine(EngineConfig(cache=CacheConfig(tiers=tiers), policy=LOW_GATES))


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    eng = make(tmp_path)
    yield eng
    eng.close()


def reuse(out: Completion) -> ReuseReport:
    assert out.stats.reuse is not None
    assert out.stats.reuse.reused_tokens == out.stats.cached_tokens
    return out.stats.reuse


def test_deterministic_mode_trims_to_n_batch(engine: Engine) -> None:
    model = engine.load_model(config=config(det=True))
    first = model.complete(PROMPT, GREEDY)
    engine.cache.flush()
    assert reuse(first).reason is MissReason.NO_PREFIX
    n = first.stats.prompt_tokens
    assert n % N_BATCH, n
    model.evict()
    engine.cache.flush()
    out = model.complete(PROMPT + " The row was evicted.", GREEDY)
    r = reuse(out)
    assert r.reason is MissReason.ALIGNED_TRIM
    assert r.found_tokens >= n > r.reused_tokens > 0 and r.reused_tokens % N_BATCH == 0


def test_an_eviction_is_named(engine: Engine) -> None:
    model = engine.load_model(config=config(det=False))
    first = model.complete(PROMPT, GREEDY)
    model.evict()
    engine.cache.flush()
    assert engine.cache.evict_bytes(1 << 40, ["disk"]).rows > 0
    out = model.complete(PROMPT + " The row was evicted.", GREEDY)
    r = reuse(out)
    assert (r.reason, r.tier, r.detail) == (MissReason.EVICTED, "disk", "lru")
    assert r.found_tokens >= first.stats.prompt_tokens and r.reused_tokens == 0


def test_a_restart_keeps_rows_but_not_the_memory_of_evictions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    eng = make(tmp_path)
    try:
        model = eng.load_model(config=config(det=False))
        first = model.complete(PROMPT, GREEDY)
        other = model.complete(OTHER, GREEDY)
        model.evict()  # its save now, not at shutdown after the deletes
        eng.cache.flush()
        n_other = other.stats.prompt_tokens
        for row in eng.cache.rows():
            with eng.cache.open_row(row.key) as loaded:
                mine = loaded.tokens[:n_other] == other.prompt_tokens
            if mine:
                assert eng.cache.delete(row.key)
        said = eng.cache.explain_miss(model.namespace(), other.prompt_tokens, 1)
        assert said is not None and (said.reason, said.detail) == (MissReason.EVICTED, "deleted")
    finally:
        eng.close()
    eng = make(tmp_path)  # the same directory, a new process's memory
    try:
        model = eng.load_model(config=config(det=False))
        r = reuse(model.complete(PROMPT + " A restart.", GREEDY))
        assert r.reason is MissReason.NEW_TOKENS
        assert r.found_tokens >= first.stats.prompt_tokens
        # The deleted rows were forgotten with the process that deleted them.
        gone = reuse(model.complete(OTHER, replace(GREEDY, max_tokens=1)))
        assert gone.reason in (MissReason.NO_PREFIX, MissReason.NEW_TOKENS)
        assert gone.found_tokens < n_other
    finally:
        eng.close()
    # The operator's tool reads the same directory with the tokenizer alone, derives the same
    # namespace from the settings, and says the same.
    from kvwarm.cli import main

    argv = ["cache", "explain", "--cache-dir", str(tmp_path / "c"), "--n-ctx", "512"]
    argv += ["--n-batch", str(N_BATCH), "--json", PROMPT + " A restart, again."]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reason"] == "new_tokens", out
    assert out["found_tokens"] >= first.stats.prompt_tokens
    assert out["rows_in_namespace"] > 0
