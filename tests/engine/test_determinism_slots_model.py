"""Deterministic mode on a four-slot model (issue 23): the same prompt, cold in every slot at
once, beside an unrelated request, after other requests have fragmented the context, copied
from a live slot and restored from a saved row, gives the tokens and logprobs of a one-slot
cold run, bit for bit. (With one KV buffer shared by the slots every one of these differed:
a slot's cells sat elsewhere than in a cold run, and an attention pass spanned the other
slots' cells too.) The prompt is long enough (> 256 tokens) that a decode step attends over
512 cells, llama.cpp's split-KV path, whose split depends on how many cells a pass spans.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.engine.conftest import LOW_GATES, make_engine
from tests.engine.memkit import same, together

from kvwarm.backends.base import ContextParams
from kvwarm.engine.api import ModelConfig
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import InvalidRequestError

pytestmark = pytest.mark.model

N_BATCH = 64
OPTS = GenerationOptions(max_tokens=8, temperature=0.0, logprobs=3)
WORDS = [
    "the",
    "harbour",
    "lighthouse",
    "keeper",
    "wrote",
    "in",
    "his",
    "log",
    "every",
    "night",
    "about",
    "ships",
    "and",
    "storms",
]
NEVER = replace(LOW_GATES, min_tokens=10**9, cold_min_tokens=10**9, cold_max_tokens=10**9)


def config(n_parallel: int, *, det: bool = True) -> ModelConfig:
    ctx = ContextParams(
        n_ctx=1024, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=2, n_threads_batch=2
    )
    return ModelConfig(context=ctx, n_parallel=n_parallel, deterministic=det)


def text(seed: int, n: int) -> str:
    return " ".join(WORDS[(i * seed + seed) % len(WORDS)] for i in range(n))


@pytest.mark.slow
def test_every_slot_at_once_is_bit_identical_to_a_one_slot_cold_run() -> None:
    ref_engine = make_engine(policy=NEVER)
    try:
        ref = ref_engine.load_model(config=config(1))
        prompt = ref.tokenize("Story: " + text(3, 300), add_special=True)
        assert len(prompt) > 256
        cold = ref.complete(prompt, OPTS)
        assert cold.stats.cached_tokens == 0
    finally:
        ref_engine.close()

    saving = replace(LOW_GATES, boundary_align_tokens=N_BATCH)
    eng = make_engine(policy=saving)
    try:
        model = eng.load_model(config=config(4))
        other = [model.tokenize(text(i + 5, 40 * (i + 1)), add_special=True) for i in range(4)]
        together(model, other, OPTS)  # the slots now hold cells of different lengths
        model.evict()  # rows only from here: the slots' live KV is dropped
        first = together(model, [prompt, prompt, prompt, other[1]], OPTS)
        for out in first[:3]:
            same(out, cold)
        eng.cache.flush()
        restored = together(model, [prompt] * 4, OPTS)  # live slots and rows, in every slot
        for out in restored:
            assert out.stats.cached_tokens > 0
            same(out, cold)
        model.evict()
        from_rows = together(model, [prompt] * 4, OPTS)
        for out in from_rows:
            assert out.stats.cached_tokens >= N_BATCH * (len(prompt) // N_BATCH)
            same(out, cold)
    finally:
        eng.close()


def test_a_deterministic_request_on_a_shared_buffer_is_refused() -> None:
    eng = make_engine(policy=NEVER)
    try:
        model = eng.load_model(config=config(2, det=False))
        with pytest.raises(InvalidRequestError, match="deterministic"):
            model.complete([1, 2, 3], replace(OPTS, deterministic=True))
        assert model.complete([1, 2, 3], OPTS).completion_tokens  # a plain request still runs
    finally:
        eng.close()
