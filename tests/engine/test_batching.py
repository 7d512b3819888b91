from __future__ import annotations

from collections.abc import Callable

from kvwarm.engine.worker.batching import (
    AGING_TICKS,
    Balanced,
    Chunk,
    DecodeFirst,
    PrefillFirst,
    PrefillWant,
    TickPlan,
    isolate,
    strategy,
    waited_after,
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


def test_prefill_first_decodes_a_slot_held_aging_ticks_beside_prefill() -> None:
    want = [PrefillWant(1, 0, 40, False)]
    held = PrefillFirst().plan([0], want, 16, 16, decode_waited=AGING_TICKS - 1)
    assert held.decode_slots == ()
    aged = PrefillFirst().plan([0, 2], want, 16, 16, 3, decode_waited=AGING_TICKS)
    assert aged.decode_slots == (0, 2)  # with their drafts, the budget's first claim
    assert aged.shared_chunks == (Chunk(1, 0, 16 - 2 - 3),)


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


def _starve(
    plan: Callable[[list[PrefillWant]], TickPlan],
    long: int,
    short: int,
    *,
    whole: bool = False,
    ticks: int = 2000,
) -> int | None:
    """A pure simulation: slot 0 prefills a ``long``-token prompt while slots 1-3 are refilled
    with ``short``-token prompts that end with their prefill (1 token generated from its
    last logits). The tick at which the long prompt is prefilled, or None."""
    pos = [0, 0, 0, 0]
    size = [long, short, short, short]
    waited = [0, 0, 0, 0]
    for tick in range(1, ticks + 1):
        wants = [
            PrefillWant(i, pos[i], size[i], False, whole=whole, waited=waited[i])
            for i in range(4)
            if pos[i] < size[i]
        ]
        p = plan(wants)
        for i, w in waited_after(p, wants).items():
            waited[i] = w
        for c in (*p.shared_chunks, *p.isolated_chunks):
            assert c.start == pos[c.slot]
            pos[c.slot] = c.end
        if pos[0] >= long:
            return tick
        for i in (1, 2, 3):
            if pos[i] >= size[i]:
                pos[i], waited[i] = 0, 0  # the next short prompt is seated
    return None


def test_a_long_prompt_is_not_starved_by_short_prompts_arriving_beside_it() -> None:
    """Fewest tokens left first alone starved a seated long prompt while shorter ones kept
    arriving in the other slots: under balanced it got nothing in 2,000 ticks, under
    decode_first it stalled at 1,612 of 4,096, and a whole prompt never fit. Now one passed
    over for AGING_TICKS ticks goes first: at most about AGING_TICKS ticks per chunk (plus,
    under balanced, a turn for each other slot that has waited as long)."""
    chunks = 4096 // 512
    bound = chunks * (AGING_TICKS + 4)
    cases: list[tuple[str, Callable[[list[PrefillWant]], TickPlan], int, bool]] = [
        ("balanced", lambda w: Balanced().plan([], w, 512, 512), 100, False),
        ("decode_first", lambda w: DecodeFirst().plan([], w, 512, 512), 1000, False),
        ("prefill_first", lambda w: PrefillFirst().plan([], w, 512, 512), 1000, False),
    ]
    for name, plan, short, whole in cases:
        done = _starve(plan, 4096, short, whole=whole)
        assert done is not None and done <= bound, (name, done)
    # An encoder's prompt runs whole in one ubatch: 400 tokens never fit beside two of 200.
    whole_plan = lambda w: DecodeFirst().plan([], w, 512, 512)  # noqa: E731
    done = _starve(whole_plan, 400, 200, whole=True)
    assert done is not None and done <= AGING_TICKS + 4, done


def test_aging_keeps_fewest_left_first_until_a_prompt_has_waited() -> None:
    wants = [PrefillWant(1, 0, 4000, False, waited=AGING_TICKS - 1), PrefillWant(2, 0, 5, False)]
    assert Balanced().plan([], wants, 16, 16).shared_chunks == (Chunk(2, 0, 5),)
    aged = [PrefillWant(1, 0, 4000, False, waited=AGING_TICKS), PrefillWant(2, 0, 5, False)]
    assert Balanced().plan([], aged, 16, 16).shared_chunks == (Chunk(1, 0, 16),)
    p = Balanced().plan([], wants, 16, 16)
    assert waited_after(p, wants) == {1: AGING_TICKS, 2: 0}
    # A whole prompt that has waited keeps the room: nothing smaller is placed after it.
    whole = [
        PrefillWant(1, 0, 12, False, whole=True, waited=AGING_TICKS),
        PrefillWant(2, 0, 3, False, whole=True),
    ]
    assert DecodeFirst().plan([0, 3, 4, 5, 6, 7], whole, 16, 16).shared_chunks == ()
