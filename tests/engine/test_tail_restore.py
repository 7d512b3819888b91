"""A row restored onto live KV of its leading tokens (issue 24): a conversation's next turn,
after another conversation over the same system prompt took its slot, restores only its own
turns' chunks; the system prompt's KV stays where it is (the slot's own, or a ``seq_cp`` of
another slot's). The stub's cells chain through the whole prefix, so a tail on KV of other
tokens would be refused (``StubContext.kv_unpack_chunks``), and every output is compared
with a cold run's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from tests.engine.conftest import LOW_GATES, GatedBackend, stub_config

from kvwarm.backends.base import Buffer
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, Model, ModelConfig
from kvwarm.engine.types import Completion, GenerationOptions

OPTS = GenerationOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG = GenerationOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(chunk_tokens: int) -> Engine:
    tiers = (TierConfig("ram", 64 << 20),)
    cache = CacheConfig(tiers=tiers, chunk_tokens=chunk_tokens)
    return Engine(EngineConfig(cache=cache, policy=LOW_GATES))


def spy_bases(model: Model, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``base`` of every chunked restore the model's worker makes."""
    ctx = model._worker.rt.ctx
    unpack = ctx.kv_unpack_chunks
    bases: list[int] = []

    def spy(seq: int, chunks: Sequence[Buffer], *, base: int = 0) -> int | None:
        bases.append(base)
        return unpack(seq, chunks, base=base)

    monkeypatch.setattr(ctx, "kv_unpack_chunks", spy)
    return bases


def _conversations(model: Model, system: list[int], engine: Engine) -> Iterator[Completion]:
    """Conversation A, then B over the same system prompt, then A's next turn."""
    a = model.complete([*system, 240, 241], OPTS)
    engine.cache.flush()
    yield a
    yield model.complete([*system, 242, 243], OPTS)
    engine.cache.flush()
    a2 = model.complete([*system, 240, 241, *a.completion_tokens, 244, 245], OPTS)
    engine.cache.flush()  # its finish save is published: what comes next may restore it
    yield a2


def _cold(
    config: ModelConfig, prompt: Sequence[int], opts: GenerationOptions = OPTS
) -> tuple[int, ...]:
    engine = _engine(16)
    try:
        return engine.load_model(config=config).complete(list(prompt), opts).completion_tokens
    finally:
        engine.close()


def test_a_next_turn_restores_only_its_own_chunks_onto_the_slots_system_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    system = [1 + i % 200 for i in range(100)]
    engine = _engine(16)
    try:
        model = engine.load_model(config=stub_config())
        bases = spy_bases(model, monkeypatch)
        a, b, a2 = _conversations(model, system, engine)
    finally:
        engine.close()
    # A's row has 16-token chunks: its tail starts at the last boundary within the 100
    # system-prompt tokens that B left live in the slot.
    assert bases == [96]
    assert a2.stats.cache_hit == "partial"
    assert a2.stats.cached_tokens == len(system) + 2 + len(a.completion_tokens) - 1
    assert a2.completion_tokens == _cold(stub_config(), a2.prompt_tokens)
    assert b.completion_tokens == _cold(stub_config(), b.prompt_tokens)


def test_a_tail_restore_takes_its_base_from_another_slots_live_kv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Conversation D over the system prompt is mid-reply in slot 0 when A's next turn comes:
    # A's turn takes the empty slot 1, copies the system prompt's KV from D's slot and
    # restores only its own chunks after it.
    system = [1 + i % 200 for i in range(100)]
    backend = GatedBackend()
    config = stub_config(n_parallel=2, backend=backend)  # type: ignore[arg-type]
    engine = _engine(16)
    try:
        backend.gate.set()
        model = engine.load_model(config=config)
        bases = spy_bases(model, monkeypatch)
        a, _, _ = _conversations(model, system, engine)
        assert bases == [96]
        backend.gate.clear()
        d = model.stream([*system, 246, 247], LONG)
        a2 = model.stream([*system, 240, 241, *a.completion_tokens, 7], OPTS)
        backend.gate.step(1)  # D's prefill: then A's turn is seated beside it
        backend.gate.set()
        d_done, a2_done = d.result(), a2.result()
    finally:
        engine.close()
    assert bases == [96, 96]
    assert a2_done.stats.cached_tokens == len(system) + 2 + len(a.completion_tokens)
    cold = stub_config(n_parallel=2)
    assert d_done.completion_tokens == _cold(cold, d_done.prompt_tokens, LONG)
    assert a2_done.completion_tokens == _cold(cold, a2_done.prompt_tokens)
