"""Two engines of the real embedded model sharing an s3 tier (a live moto server): what one
saved, the other restores, and its greedy output is the cold run's, token for token."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.engine.conftest import LOW_GATES
from tests.engine.test_engine_model import WORDS, model_config
from tests.s3kit import MotoServer

from kvwarm.cache.types import CacheConfig, S3Config, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.types import GenerationOptions

pytestmark = [pytest.mark.model, pytest.mark.slow]  # two engines load the model

GREEDY = GenerationOptions(max_tokens=6, temperature=0.0, logprobs=3, deterministic=True)


def _replica(s3: S3Config) -> Engine:
    tiers = (TierConfig("ram", 256 << 20), TierConfig("s3", 1 << 30, s3=s3))
    return Engine(EngineConfig(cache=CacheConfig(tiers=tiers), policy=LOW_GATES))


def test_replica_restores_what_another_saved_and_answers_the_same(
    moto_server: MotoServer,
) -> None:
    s3 = moto_server.config(moto_server.new_bucket())
    config = replace(model_config(), save_tier="s3")
    prompt = "Repeat these words: " + " ".join(WORDS * 2)
    a, b = _replica(s3), _replica(s3)
    try:
        cold = a.load_model(config=config).complete(prompt, GREEDY)
        assert cold.stats.cached_tokens == 0
        assert a.cache.flush()
        warm = b.load_model(config=config).complete(prompt, GREEDY)
        assert warm.stats.cached_tokens > 0  # B restored A's row from s3
        assert b.cache.counters()["hits_shared"] >= 1
        assert warm.completion_tokens == cold.completion_tokens
        assert warm.logprobs == cold.logprobs  # deterministic: bit-identical to A's cold run
        assert b.cache.flush() and b.cache.counters()["promotions"] >= 1
    finally:
        a.close()
        b.close()


def test_chat_follow_up_on_another_replica_restores_the_previous_reply(
    moto_server: MotoServer,
) -> None:
    """Turn two lands on a replica that never saw turn one: it finds turn one's finish row
    (prompt and reply, saved by the other replica) where that turn's <|im_end|> sits."""
    s3 = moto_server.config(moto_server.new_bucket())
    config = replace(model_config(), save_tier="s3", deterministic=False)
    options = GenerationOptions(max_tokens=8, temperature=0.0)
    a, b = _replica(s3), _replica(s3)
    try:
        messages: list[dict[str, object]] = [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three colours."},
        ]
        first = a.load_model(config=config).chat(messages, options=options)
        assert a.cache.flush()
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And three fruits?"},
        ]
        second = b.load_model(config=config).chat(messages, options=options)
        # Past turn one's prompt: only its finish row (prompt + reply) reaches that far.
        assert second.stats.cached_tokens > len(first.prompt_tokens)
        assert b.cache.counters()["hits_shared"] >= 1
    finally:
        a.close()
        b.close()
