"""Two engines (two replicas) sharing an s3 tier on a live moto server, on the stub backend:
a prompt engine A saved is restored by engine B and promoted to B's local tier."""

from __future__ import annotations

from dataclasses import replace

from tests.engine.conftest import LOW_GATES, stub_config
from tests.s3kit import MotoServer

from kvwarm.backends.stub.vocab import EOS
from kvwarm.cache.types import CacheConfig, S3Config, SaveReason, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.types import GenerationOptions

GREEDY = GenerationOptions(max_tokens=8, temperature=0.0)
PROMPT = "The system prompt says: be brief and kind. Question: what is a cache? " * 2


def _cache(s3: S3Config) -> CacheConfig:
    return CacheConfig(tiers=(TierConfig("ram", 64 << 20), TierConfig("s3", 1 << 30, s3=s3)))


def _replica(s3: S3Config) -> Engine:
    return Engine(EngineConfig(cache=_cache(s3), policy=LOW_GATES))


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


def test_follow_up_turn_on_another_replica_restores_the_previous_turn(
    moto_server: MotoServer,
) -> None:
    """A replica that never saw a conversation restores its previous turn, prompt and reply
    (the finish save another replica wrote), found by probing where that turn ended. The stub
    has no chat markup, so the turn is built as a chat template would: the reply, then the
    end-of-turn token, then the next message."""
    s3 = moto_server.config(moto_server.new_bucket())
    config = replace(stub_config(), save_tier="s3")
    # Cold rows only every 64 tokens: the finish row is the only one reaching into the reply.
    policy = replace(LOW_GATES, boundary_align_tokens=64)
    a = Engine(EngineConfig(cache=_cache(s3), policy=policy))
    b = Engine(EngineConfig(cache=_cache(s3), policy=policy))
    try:
        model_a, model_b = a.load_model(config=config), b.load_model(config=config)
        first = model_a.complete(PROMPT, GREEDY)
        assert first.stats.finish_reason == "length"  # its last token was never decoded
        assert a.cache.flush()
        follow_up = model_b.tokenize(" And what is a tier?", add_special=False)
        turn_two = (*first.prompt_tokens, *first.completion_tokens, EOS, *follow_up)
        second = model_b.complete(turn_two, GREEDY)
        turn_one = len(first.prompt_tokens) + len(first.completion_tokens) - 1
        assert turn_one % 64  # not a cold-save length: only the turn's end can find it
        assert second.stats.cached_tokens == turn_one
        assert b.cache.counters()["hits_shared"] >= 1
    finally:
        a.close()
        b.close()
