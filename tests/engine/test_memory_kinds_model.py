"""Sliding-window attention on a real model: Gemma 3 270M (n_swa 512).

Deterministic mode, prompts longer than the window: every kind of reuse (an exact hit, a
sibling prompt, a shorter prompt that is a prefix of a saved row, a restart from disk, four
slots at once) gives the tokens and logprobs of a cold run, bit for bit. A saved row longer
than the window holds only the window's cells, so these hits come from checkpoints (rows
saved at the lengths later prompts resume from), never from a trimmed window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine import memkit
from tests.engine.memkit import same

from kvwarm.engine.api import Engine
from kvwarm.engine.model import Model
from kvwarm.engine.types import Completion, GenerationOptions

pytestmark = [pytest.mark.model, pytest.mark.slow]

N_BATCH = 256
OPTS = GenerationOptions(max_tokens=8, temperature=0.0, logprobs=2)
POLICY = memkit.exact_policy(N_BATCH)
SYSTEM = memkit.GEMMA_SYSTEM


def engine(tmp: Path | None) -> Engine:
    return memkit.engine(tmp, POLICY, ram=512 << 20)


def load(eng: Engine, path: str, *, det: bool = True, n_parallel: int = 1) -> Model:
    return memkit.load(eng, path, n_ctx=1536, n_batch=N_BATCH, det=det, n_parallel=n_parallel)


def prompt_tokens(model: Model, tail: str, n_system: int) -> list[int]:
    """``n_system`` tokens of a long system text, then ``tail``: all longer than the window."""
    body = model.tokenize(SYSTEM * 40, add_special=True)[:n_system]
    return [*body, *model.tokenize(tail, add_special=False)]


@pytest.fixture(scope="module")
def cold(gemma_path: str) -> Iterator[dict[tuple[int, ...], Completion]]:
    """Cold answers, one fresh single-slot engine with no rows per prompt (memoised)."""
    memo: dict[tuple[int, ...], Completion] = {}
    yield memo


def cold_run(
    path: str, memo: dict[tuple[int, ...], Completion], tokens: Sequence[int]
) -> Completion:
    key = tuple(tokens)
    if key not in memo:
        eng = engine(None)
        try:
            out = load(eng, path).complete(list(tokens), OPTS)
            assert out.stats.cached_tokens == 0
            memo[key] = out
        finally:
            eng.close()
    return memo[key]


def test_gemma_is_a_sliding_window_model(gemma_path: str) -> None:
    eng = engine(None)
    try:
        info = load(eng, gemma_path).info()
        assert (info.memory, info.n_swa, info.swa_full) == ("swa", 512, False)
    finally:
        eng.close()


def test_every_reuse_of_a_window_longer_than_it_is_bit_identical_to_cold(
    gemma_path: str, cold: dict[tuple[int, ...], Completion], tmp_path: Path
) -> None:
    eng = engine(tmp_path)
    try:
        model = load(eng, gemma_path)
        a = prompt_tokens(model, " Who built the lighthouse?", 700)
        b = prompt_tokens(model, " When did the harbour flood?", 700)
        first = model.complete(a, OPTS)
        same(first, cold_run(gemma_path, cold, a))
        eng.cache.flush()
        rows = eng.cache.rows()
        saved = sorted(r.n_tokens for r in rows)
        assert N_BATCH * 2 in saved  # the aligned cold-save checkpoint (512 of 700+)
        # Each checkpoint keeps its window in the row and its full-attention cache as chunks
        # that the checkpoints share where their bits are the same (up to the aligned
        # canonical prefix, 512 here): no row holds all its chunks alone.
        assert all(r.logical_bytes > r.size for r in rows)
        assert all(r.exclusive_bytes < r.logical_bytes for r in rows)
        assert (
            sum(r.exclusive_bytes for r in rows)
            < sum(r.logical_bytes for r in rows)
            - (len(rows) - 1) * min(r.logical_bytes - r.size for r in rows) // 2
        )

        model.evict()  # live KV must not serve what follows: rows only
        again = model.complete(a, OPTS)
        assert again.stats.cached_tokens == len(a)  # the prompt-end checkpoint, with logits
        same(again, first)

        model.evict()
        sibling = model.complete(b, OPTS)
        assert sibling.stats.cached_tokens == N_BATCH * 2
        same(sibling, cold_run(gemma_path, cold, b))

        model.evict()
        shorter = a[:600]  # a prefix of every saved row of `a`, all longer than the window
        part = model.complete(shorter, OPTS)
        assert part.stats.cached_tokens == N_BATCH * 2
        same(part, cold_run(gemma_path, cold, shorter))
        eng.cache.flush()
    finally:
        eng.close()

    restarted = engine(tmp_path)
    try:
        model = load(restarted, gemma_path, n_parallel=4)
        after = model.complete(a, OPTS)
        assert after.stats.cached_tokens == len(a)
        same(after, first)
        # Four slots at once, each with its own KV stream (deterministic mode), after other
        # requests left cells of other lengths in them: every answer is a cold run's.
        model.complete(prompt_tokens(model, " What is the town called?", 300), OPTS)
        model.evict()
        answers = memkit.together(model, [b, shorter, a, a], OPTS)
        for tokens, out in zip((b, shorter, a, a), answers, strict=True):
            assert out.stats.cached_tokens > 0
            same(out, cold_run(gemma_path, cold, tokens))
    finally:
        restarted.close()


def test_a_sibling_resumed_from_a_live_window_leaves_a_checkpoint_where_they_meet(
    gemma_path: str,
) -> None:
    """The second of three sibling prompts (600 shared tokens, past the 512-token window)
    resumes from the first one's live slot, whose window still holds every position it
    needs; its prefill starts where they meet, so no pause saves that point, yet the state
    there is checkpointed before the prefill moves on. The third sibling, after the slot is
    gone, restores it instead of resuming at the cold save's 512 (default mode: deterministic
    requests checkpoint only where their prefill pauses)."""
    eng = engine(None)
    try:
        model = load(eng, gemma_path, det=False)
        shared = 600
        tails = ("Who built the lighthouse?", "When did the harbour flood?", "Name a keeper.")
        prompts = [prompt_tokens(model, tail, shared) for tail in tails]
        assert all(p[:shared] == prompts[0][:shared] for p in prompts)
        assert len({p[shared] for p in prompts}) == 3
        model.complete(prompts[0], OPTS)
        eng.cache.flush()
        second = model.complete(prompts[1], OPTS)
        eng.cache.flush()
        assert second.stats.cached_tokens == shared  # the live window, trimmed to the fork
        assert shared in {row.n_tokens for row in eng.cache.rows()}
        model.evict()
        eng.cache.flush()
        third = model.complete(prompts[2], OPTS)
        assert third.stats.cached_tokens == shared
    finally:
        eng.close()


def test_a_window_copied_from_a_slot_generating_past_it_is_never_cut_short(
    gemma_path: str, cold: dict[tuple[int, ...], Completion]
) -> None:
    """Deterministic, two slots (a KV stream each): B shares A's 500-token prompt while A
    generates past the 512-token window. A's live window still holds its masked cells, but a
    copy between streams is a pack, which leaves them out: the copy cut to B's aligned 256
    tokens lacked positions B attends to (found by review: max |dlogit| 0.28 beside a cold
    run). It is not used; nothing is saved, so B prefills cold, bit-identical."""
    eng = memkit.engine(None, replace(POLICY, min_tokens=100_000, cold_min_tokens=100_000))
    try:
        model = load(eng, gemma_path, n_parallel=2)
        a = prompt_tokens(model, "", 500)
        b = prompt_tokens(model, " Who built the lighthouse?", 500)
        assert a == b[:500]
        stream = model.stream(a, replace(OPTS, max_tokens=200, ignore_eos=True))
        for i, _ in enumerate(stream):  # each fragment is a token or more: A passes 512
            if i >= 30:
                break
        out = model.complete(b, OPTS)
        stream.cancel()
        stream.result()
        same(out, cold_run(gemma_path, cold, b))
        assert out.stats.cached_tokens == 0
    finally:
        eng.close()


def test_an_exact_hit_on_a_row_sharing_a_shorter_rows_last_pass_is_bit_identical_to_cold(
    gemma_path: str, cold: dict[tuple[int, ...], Completion], tmp_path: Path
) -> None:
    """Found by a randomised differential run: ``a[:513]`` computes position 512 in a pass of
    its own; its sibling (513 shared tokens, then more) computes 512 inside its last pass of
    41, and its row's chunk plan cuts at 513, where the shorter row's does. Chunks were keyed
    by tokens alone, so the sibling's row reused the shorter row's bits at 512, and an exact
    hit on it differed from a cold run after its first token. Past a row's aligned
    canonical prefix its chunks are now its own (``chunkfmt.chunk_chain``)."""
    eng = engine(tmp_path)
    try:
        model = load(eng, gemma_path)
        a = prompt_tokens(model, " Who built the lighthouse?", 700)
        cut = 2 * N_BATCH + 1
        sibling = [
            *a[:cut],
            *model.tokenize(" When did the harbour flood? Say it.", add_special=False),
        ]
        sibling = (sibling + a[cut:])[: cut + 40]
        assert sibling[cut] != a[cut]
        model.complete(a, OPTS)  # saves the aligned cold checkpoint at 512
        model.evict()
        short = model.complete(a[:cut], OPTS)
        assert short.stats.cached_tokens == 2 * N_BATCH  # then one token in a pass of its own
        model.evict()
        first = model.complete(sibling, OPTS)
        assert first.stats.cached_tokens == 2 * N_BATCH
        eng.cache.flush()
        model.evict()
        again = model.complete(sibling, OPTS)
        assert again.stats.cached_tokens == len(sibling)  # its own prompt-end checkpoint
        same(again, cold_run(gemma_path, cold, sibling))
    finally:
        eng.close()
