"""Two engines (two replicas) sharing an s3 tier on a live moto server, on the stub backend:
a prompt engine A saved is restored by engine B and promoted to B's local tier."""

from __future__ import annotations

from dataclasses import replace

from tests.engine.conftest import LOW_GATES, stub_config
from tests.s3kit import MotoServer

from kvwarm.cache.types import CacheConfig, S3Config, SaveReason, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.types import GenerationOptions

GREEDY = GenerationOptions(max_tokens=8, temperature=0.0)
PROMPT = "The system prompt says: be brief and kind. Question: what is a cache? " * 2


def _replica(s3: S3Config) -> Engine:
    tiers = (TierConfig("ram", 64 << 20), TierConfig("s3", 1 << 30, s3=s3))
    return Engine(EngineConfig(cache=CacheConfig(tiers=tiers), policy=LOW_GATES))


def test_prompt_saved_by_one_engine_is_restored_by_another(moto_server: MotoServer) -> None:
    s3 = moto_server.config(moto_server.new_bucket())
    config = replace(stub_config(), save_tier="s3")
    a, b = _replica(s3), _replica(s3)
    try:
        first = a.load_model(config=config).complete(PROMPT, GREEDY)
        assert first.stats.cached_tokens == 0
        assert a.cache.flush()
        assert a.cache.counters()["saves_cold"] >= 1
        model_b = b.load_model(config=config)
        second = model_b.complete(PROMPT, GREEDY)
        assert second.stats.cached_tokens > 0  # restored from what A saved, not prefilled
        assert second.text == first.text
        counters = b.cache.counters()
        assert counters["hits_shared"] >= 1
        assert b.cache.flush()
        assert counters["probe_rounds"] >= 1
        assert b.cache.counters()["promotions"] >= 1
        local = [r for r in b.cache.rows() if r.tier == "ram"]  # B saves to s3: only copies
        assert local and all(r.reason == SaveReason.COLD for r in local)  # A's row, now local
        assert max(r.n_tokens for r in local) == second.stats.cached_tokens
    finally:
        a.close()
        b.close()
