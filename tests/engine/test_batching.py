from __future__ import annotations

from kvwarm.engine.worker.batching import (
    Balanced,
    Chunk,
    DecodeFirst,
    PrefillFirst,
    PrefillWant,
    TickPlan,
    isolate,
    strategy,
)


def test_decode_first_fills_the_budget_with_aligned_chunks() -> None:
    plan = DecodeFirst().plan([0, 1], [PrefillWant(2, 10, 100, False)], n_batch=16, n_ubatch=16)
    assert plan.decode_slots == (0, 1)
    # 14 tokens of budget left, but the chunk stops at the absolute boundary 16.
    assert plan.shared_chunks == (Chunk(2, 10, 16),)


def test_deterministic_chunk_is_never_cut_by_the_budget() -> None:
    plan = DecodeFirst().plan([0], [PrefillWant(1, 0, 40, True)], n_batch=16, n_ubatch=16)
    assert plan.shared_chunks == ()
    assert plan.isolated_chunks == (Chunk(1, 0, 16),)


def test_prefill_first_holds_decoding_while_prompts_wait() -> None:
    plan = PrefillFirst().plan([0], [PrefillWant(1, 0, 8, False)], n_batch=16, n_ubatch=16)
    assert plan.decode_slots == ()
    assert plan.shared_chunks == (Chunk(1, 0, 8),)


def test_balanced_takes_one_chunk_per_tick() -> None:
    wants = [PrefillWant(1, 0, 4, False), PrefillWant(2, 0, 4, False)]
    plan = Balanced().plan([0], wants, n_batch=16, n_ubatch=16)
    assert plan.shared_chunks == (Chunk(1, 0, 4),)


def test_unknown_strategy_is_a_config_error() -> None:
    import pytest

    from kvwarm.errors import ConfigError

    with pytest.raises(ConfigError):
        strategy("fastest")  # type: ignore[arg-type]


def test_isolate_gives_each_deterministic_slot_a_call_of_its_own() -> None:
    # Per-sequence KV streams: a pass over several streams attends with another kernel than
    # a pass over one, so deterministic work never shares a call (issue 23).
    plan = TickPlan((0, 1, 2), (Chunk(3, 0, 8), Chunk(4, 8, 16)), (Chunk(5, 0, 8),))
    out, alone = isolate(plan, {1, 4})
    assert out.decode_slots == (0, 2)
    assert out.shared_chunks == (Chunk(3, 0, 8),)
    assert out.isolated_chunks == (Chunk(4, 8, 16), Chunk(5, 0, 8))
    assert alone == (1,)
    single = TickPlan((1,), (), ())
    assert isolate(single, {1}) == (single, ())  # alone already: nothing to split


def test_a_short_prompt_is_not_starved_by_a_long_one_beside_it() -> None:
    """In slot order, the long prompt of slot 1 took the whole budget every tick: the short
    prompt of slot 2 waited for all of its chunks before its first token."""
    wants = [PrefillWant(1, 0, 4000, False), PrefillWant(2, 0, 5, False)]
    for plan in (
        DecodeFirst().plan([0], wants, n_batch=16, n_ubatch=16),
        PrefillFirst().plan([0], wants, n_batch=16, n_ubatch=16),
    ):
        assert Chunk(2, 0, 5) in plan.shared_chunks
        assert Chunk(1, 0, 16 - 5 - len(plan.decode_slots)) in plan.shared_chunks
    assert Balanced().plan([0], wants, n_batch=16, n_ubatch=16).shared_chunks == (Chunk(2, 0, 5),)
