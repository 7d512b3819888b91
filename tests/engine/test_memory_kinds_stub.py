"""Memory kinds on the stub (``kvwarm.memory``): a sliding-window or recurrent state is reused
only where it is exactly the prefix it claims, and checkpoints make such states reusable at
the lengths later prompts resume from.

The stub models each kind the way llama.cpp keeps it: a window keeps its last ``n_swa``
cells, a recurrent (or hybrid) state its last cell and refuses trims; a token decoded without
the cells it attends to gets a poisoned hash, so a wrong reuse changes the output exactly as it
would on a real model. Every answer here is compared with a cold run's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import LOW_GATES, make_engine, stub_config

from kvwarm.backends.base import BatchToken, ContextParams
from kvwarm.backends.stub import StubBackend
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import Completion, GenerationOptions
from kvwarm.errors import StateRestoreError
from kvwarm.memory import MemoryKind

GREEDY = GenerationOptions(max_tokens=6, temperature=0.0)
KINDS = [("swa", 24), ("recurrent", 0), ("hybrid", 0)]
SYSTEM = "You are a terse assistant. Answer with care, cite nothing, and keep it short. " * 2
N_BATCH = 16


def backend(kind: str, n_swa: int) -> StubBackend:
    return StubBackend(memory_kind=kind, n_swa=n_swa)  # type: ignore[arg-type]


def load(engine: Engine, kind: str, n_swa: int, *, det: bool = False, n_parallel: int = 1) -> Model:
    cfg = stub_config(n_parallel, backend=backend(kind, n_swa), deterministic=det, n_batch=N_BATCH)
    if "disk" in engine.cache.tier_names():
        cfg = replace(cfg, save_tier="disk")
    return engine.load_model(config=cfg)


def cold(kind: str, n_swa: int, prompt: str, *, det: bool = False) -> Completion:
    """The answer with nothing to reuse: a fresh engine, one request."""
    eng = make_engine()
    try:
        out = load(eng, kind, n_swa, det=det).complete(prompt, GREEDY)
        assert out.stats.cached_tokens == 0
        return out
    finally:
        eng.close()


def run(engine: Engine, model: Model, prompt: str) -> Completion:
    out = model.complete(prompt, GREEDY)
    engine.cache.flush()
    return out


def row_lengths(engine: Engine) -> set[int]:
    return {row.n_tokens for row in engine.cache.rows()}


@pytest.mark.parametrize(("kind", "n_swa"), KINDS)
def test_the_same_prompt_after_a_restart_restores_its_checkpoint_exactly(
    tmp_path: Path, kind: str, n_swa: int
) -> None:
    prompt = SYSTEM + "Q: what is a cache?"
    ref = cold(kind, n_swa, prompt)
    first = make_engine(tmp_path)
    run(first, load(first, kind, n_swa), prompt)
    first.close()
    second = make_engine(tmp_path)
    try:
        again = run(second, load(second, kind, n_swa), prompt)
        # The prompt-end checkpoint holds the whole prompt and its logits: nothing prefilled.
        assert again.stats.cached_tokens == len(again.prompt_tokens)
        assert again.text == ref.text
    finally:
        second.close()


@pytest.mark.parametrize(("kind", "n_swa"), KINDS)
def test_a_follow_up_turn_resumes_from_the_previous_turn(
    tmp_path: Path, kind: str, n_swa: int
) -> None:
    eng = make_engine(tmp_path)
    try:
        model = load(eng, kind, n_swa)
        turn1 = run(eng, model, SYSTEM + "Q: one?")
        model.evict()  # only rows can serve the next turn
        follow = SYSTEM + "Q: one?" + turn1.text + " Q: two?"
        turn2 = run(eng, model, follow)
        assert turn2.stats.cached_tokens >= len(turn1.prompt_tokens)
        assert turn2.stats.cached_tokens in row_lengths(eng)
        assert turn2.text == cold(kind, n_swa, follow).text
    finally:
        eng.close()


@pytest.mark.parametrize(("kind", "n_swa"), KINDS)
def test_a_longer_row_is_never_trimmed_and_siblings_meet_at_a_checkpoint(
    kind: str, n_swa: int
) -> None:
    """Rows longer than the shared prefix cannot serve it (their state is not the prefix's);
    the second sibling checkpoints where it diverges, and the third resumes there."""
    eng = make_engine()
    try:
        model = load(eng, kind, n_swa)
        answers = []
        for tail in ("Q: alpha?", "Q: beta?", "Q: gamma?"):
            model.evict()
            eng.cache.flush()
            out = run(eng, model, SYSTEM + tail)
            assert out.text == cold(kind, n_swa, SYSTEM + tail).text, tail
            if out.stats.cached_tokens:
                assert out.stats.cached_tokens in row_lengths(eng), tail
            answers.append(out)
        shared = len(SYSTEM) + len("Q: ")  # byte-level stub: one token per byte, plus BOS
        assert answers[2].stats.cached_tokens >= shared
    finally:
        eng.close()


@pytest.mark.parametrize(("kind", "n_swa"), KINDS)
def test_live_slots_are_reused_only_where_their_state_is_exact(kind: str, n_swa: int) -> None:
    """Two slots, no saves that could help: only live KV (``self``, ``copy``) is a source."""
    eng = make_engine()
    try:
        model = load(eng, kind, n_swa, n_parallel=2)
        for tail in ("Q: alpha?", "Q: beta?", "Q: alpha? And more."):
            for row in eng.cache.rows():
                eng.cache.delete(row.key)
            out = model.complete(SYSTEM + tail, GREEDY)
            eng.cache.flush()
            assert out.text == cold(kind, n_swa, SYSTEM + tail).text, tail
    finally:
        eng.close()


@pytest.mark.parametrize(("kind", "n_swa"), KINDS)
def test_deterministic_reuse_is_aligned_and_equals_cold(
    tmp_path: Path, kind: str, n_swa: int
) -> None:
    eng = make_engine(tmp_path)
    try:
        model = load(eng, kind, n_swa, det=True)
        outs = []
        for tail in ("Q: alpha?", "Q: beta?", "Q: gamma?", "Q: alpha?"):
            model.evict()
            eng.cache.flush()
            out = run(eng, model, SYSTEM + tail)
            assert out.text == cold(kind, n_swa, SYSTEM + tail, det=True).text
            assert out.stats.cached_tokens % N_BATCH == 0 or out.stats.cached_tokens == len(
                out.prompt_tokens
            )
            outs.append(out)
        assert max(o.stats.cached_tokens for o in outs[1:]) > 0
    finally:
        eng.close()


# -- the stub itself: what makes the tests above able to fail ----------------------------------


def _greedy_after(ctx_tokens: list[int], trim_to: int | None, kind: str, n_swa: int) -> bytes:
    be = backend(kind, n_swa)
    model = be.load_model("stub.gguf")
    ctx = model.new_context(ContextParams(n_ctx=256, n_batch=N_BATCH, n_ubatch=N_BATCH))
    ctx.prefill(0, ctx_tokens, 0)
    if trim_to is not None:
        ctx.seq_rm(0, trim_to, -1)
    pos = ctx.seq_pos_max(0) + 1
    ctx.decode([BatchToken(ctx_tokens[0], pos, 0, logits=True)])
    return bytes(ctx.logits())


def test_the_stub_gets_a_window_trimmed_past_its_floor_wrong() -> None:
    tokens = list(range(100, 200))
    right = _greedy_after(tokens[:50], None, "swa", 24)
    assert _greedy_after(tokens, 50, "swa", 24) != right  # cells 26..49 were dropped
    assert _greedy_after(tokens, 99, "full", 0) == _greedy_after(tokens[:99], None, "full", 0)


def test_the_stub_refuses_to_roll_a_recurrent_state_back() -> None:
    model = backend("recurrent", 0).load_model("stub.gguf")
    ctx = model.new_context(ContextParams(n_ctx=256, n_batch=N_BATCH, n_ubatch=N_BATCH))
    ctx.prefill(0, list(range(100, 140)), 0)
    assert ctx.seq_pos_min(0) == ctx.seq_pos_max(0) == 39
    with pytest.raises(StateRestoreError):
        ctx.seq_rm(0, 20, -1)
    assert ctx.seq_pos_max(0) == 39  # refused: unchanged
    ctx.seq_rm(0, 0, -1)
    assert ctx.seq_pos_max(0) == -1


def test_floors() -> None:
    swa = MemoryKind("swa", 512)
    assert swa.saved_floor(400) == 0 and swa.saved_floor(863) == 863
    assert swa.live_floor(863, 0) == 0 and swa.live_floor(1500, 476) == 988
    assert swa.live_floor(900, 600) == 900
    assert swa.live_floor(100, -1) == 100  # llama.cpp reports only the (emptied) SWA cache
    assert MemoryKind("swa", 512, swa_full=True).saved_floor(863) == 863  # masked cells unsaved
    assert MemoryKind("swa", 512, swa_full=True).live_floor(863, 0) == 0
    assert MemoryKind("recurrent").saved_floor(10) == 10
    assert MemoryKind("hybrid").live_floor(10, 9) == 10
    assert MemoryKind().saved_floor(10) == 0 and MemoryKind().chunkable
    assert not MemoryKind("swa", 512, swa_full=True).chunkable


@pytest.mark.parametrize(("kind", "n_swa"), KINDS)
def test_a_new_conversation_resumes_after_the_system_turn_of_an_earlier_one(
    kind: str, n_swa: int
) -> None:
    """The first prefill of a chat checkpoints after its first end-of-turn token, so the
    second conversation over the same system message resumes there (not only the third)."""
    from kvwarm.backends.stub.vocab import EOS, OFFSET

    system = [OFFSET + b for b in SYSTEM.encode()] + [EOS]
    eng = make_engine()
    try:
        model = load(eng, kind, n_swa)
        for question in (b"alpha?", b"beta?"):
            prompt = [*system, *(OFFSET + b for b in question)]
            model.evict()
            eng.cache.flush()
            out = model.complete(prompt, GREEDY)
            if question.endswith(b"beta?"):
                assert out.stats.cached_tokens == len(system)  # through the system's EOS
            ref_eng = make_engine()
            try:
                ref = load(ref_eng, kind, n_swa).complete(prompt, GREEDY)
            finally:
                ref_eng.close()
            assert out.text == ref.text
    finally:
        eng.close()


def test_where_a_live_slot_resumes_a_sibling_a_checkpoint_is_saved_for_the_next() -> None:
    """A window kept whole while live (``swa_full``) trims like full attention, but a saved
    state still resumes only at its own length. The second sibling resumes from the first's
    live slot where they diverge, so its prefill never passes that point; it is checkpointed
    there all the same, and the third sibling, after the slot is gone, resumes there too
    rather than at an earlier checkpoint or cold."""
    kind, n_swa = "swa", 24

    def swa_full(engine: Engine) -> Model:
        cfg = stub_config(1, backend=backend(kind, n_swa), n_batch=N_BATCH)
        return engine.load_model(config=replace(cfg, context=replace(cfg.context, swa_full=True)))

    shared = 1 + len(SYSTEM) + len("Question: ")  # BOS, then one token per byte
    assert shared % N_BATCH  # not where the cold save's aligned boundary puts a row anyway
    eng = make_engine()
    try:
        model = swa_full(eng)
        outs = [run(eng, model, SYSTEM + f"Question: {q}?") for q in ("alpha", "beta")]
        assert outs[1].stats.cached_tokens == shared  # the live slot, trimmed
        assert shared in row_lengths(eng)
        model.evict()
        eng.cache.flush()
        outs.append(run(eng, model, SYSTEM + "Question: gamma?"))
        assert outs[2].stats.cached_tokens == shared
        for out in outs:
            ref_eng = make_engine()
            try:
                ref = swa_full(ref_eng).complete(out.prompt_tokens, GREEDY)
            finally:
                ref_eng.close()
            assert ref.stats.cached_tokens == 0 and out.text == ref.text
    finally:
        eng.close()


@pytest.mark.parametrize(("kind", "n_swa"), KINDS)
@pytest.mark.parametrize("gap", [0, 32])
def test_a_checkpoint_is_made_only_a_gap_past_the_saved_state_below_it(
    kind: str, n_swa: int, gap: int
) -> None:
    """A follow-up turn that restored its previous turn's row and adds fewer tokens than
    ``checkpoint_gap_tokens`` saves only its reply: the prompt-end checkpoint would spare a
    later prompt less prefill than it costs. One adding more checkpoints its prompt's end,
    and so does every turn with a gap of 0."""
    # No cold saves: their aligned boundary would be a saved state just below the end.
    policy = replace(LOW_GATES, cold_min_tokens=10**6, cold_max_tokens=10**6)
    eng = make_engine(policy=replace(policy, checkpoint_gap_tokens=gap))
    try:
        model = load(eng, kind, n_swa)
        first = run(eng, model, SYSTEM + "Q: one?")
        history = SYSTEM + "Q: one?" + first.text
        for question, new in ((" Q: two?", "short"), (" Q: " + "and what else? " * 4, "long")):
            model.evict()  # only rows can serve the next turn
            before = row_lengths(eng)
            out = run(eng, model, history + question)
            n = len(out.prompt_tokens)
            added = n - out.stats.cached_tokens
            assert out.stats.cached_tokens in before, new  # restored a row
            assert (added < 32) == (new == "short")
            made = row_lengths(eng) - before
            assert n + out.stats.completion_tokens - 1 in made, new  # the finish save
            assert (n in made) == (added >= gap), new
            assert out.text == cold(kind, n_swa, history + question).text, new
            history += question + out.text
    finally:
        eng.close()


@pytest.mark.parametrize(("kind", "n_swa"), KINDS)
def test_the_prompt_end_is_checkpointed_whatever_checkpoint_lies_just_before_it(
    kind: str, n_swa: int
) -> None:
    """A chat prompt's last end-of-turn token sits a few tokens before its end (the template's
    generation prompt follows), so a checkpoint there and the prompt-end one are within the
    gap of each other; the end keeps its checkpoint (with its logits, the same prompt again
    needs no decode), measured from the saved state below the prompt alone."""
    from kvwarm.backends.stub.vocab import EOS, OFFSET

    def text(s: str) -> list[int]:
        return [OFFSET + b for b in s.encode()]

    prompt = [*text(SYSTEM), EOS, *text("Q: what?"), EOS, *text("A:")]
    policy = replace(LOW_GATES, cold_min_tokens=10**6, cold_max_tokens=10**6)
    eng = make_engine(policy=replace(policy, checkpoint_gap_tokens=32))
    try:
        model = load(eng, kind, n_swa)
        first = model.complete(prompt, GREEDY)
        eng.cache.flush()
        assert len(prompt) in row_lengths(eng)
        model.evict()
        again = model.complete(prompt, GREEDY)
        assert again.stats.cached_tokens == len(prompt)
        assert again.text == first.text
    finally:
        eng.close()


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_a_conversation_keeps_its_latest_states_and_those_another_shares(
    tmp_path: Path, kind: str
) -> None:
    """A recurrent state is whole: of one conversation's saved states the cache keeps the
    newest and the ``state_history`` (2) below it, dropping the older ones as turns go on,
    but never one another conversation also extends (where a second conversation over the
    same system prompt diverged), so a third still resumes there."""

    def chat(model: Model, opening: str, turns: int) -> list[Completion]:
        history, outs = SYSTEM + opening, []
        for turn in range(turns):
            out = run(eng, model, history)
            assert out.text == cold(kind, 0, history).text, turn
            outs.append(out)
            history += out.text + f" Q: and then {turn}?"
            model.evict()  # only rows can serve the next turn
        return outs

    eng = make_engine(tmp_path)
    try:
        model = load(eng, kind, 0)
        first = chat(model, "Q: one?", 6)
        assert all(o.stats.cached_tokens > 0 for o in first[1:])  # each turn resumed
        assert len(eng.cache.rows()) <= 3  # the newest state and the two below it
        assert eng.cache.counters()["retention_drops"] > 0
        chat(model, "Q: two?", 4)
        shared = len(model.tokenize(SYSTEM + "Q: ", add_special=True))
        boundary = [r for r in eng.cache.rows() if r.n_tokens == shared]
        assert boundary, "the checkpoint both conversations extend was dropped"
        third = run(eng, model, SYSTEM + "Q: three?")
        assert third.stats.cached_tokens == shared
        assert {r.memory for r in eng.cache.rows()} == {kind}
    finally:
        eng.close()


def test_every_state_is_kept_with_no_history_limit(tmp_path: Path) -> None:
    eng = Engine(
        EngineConfig(
            cache=CacheConfig(
                tiers=(TierConfig("ram", 64 << 20), TierConfig("disk", 256 << 20, tmp_path)),
                state_history=-1,
            ),
            policy=LOW_GATES,
        )
    )
    try:
        model = load(eng, "recurrent", 0)
        history = SYSTEM + "Q: one?"
        for turn in range(4):
            out = run(eng, model, history)
            history += out.text + f" Q: and then {turn}?"
            model.evict()
        assert len(eng.cache.rows()) > 3 and eng.cache.counters()["retention_drops"] == 0
    finally:
        eng.close()
