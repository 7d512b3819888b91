"""n choices and prompt logprobs on the real embedded model (engine/worker/forks.py): the forks'
shared KV (seq_cp in llama.cpp's unified cache) and every-position logits, checked where a
stub cannot check them. Short prompts: prefill is ~200 tokens/s on 2 cores."""

from __future__ import annotations

import numpy as np
import pytest
from tests.engine.conftest import make_engine
from tests.engine.test_engine_model import model_config

from kvwarm.engine.types import GenerationOptions

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"


def test_forks_share_the_prompt_kv_on_llama_cpp() -> None:
    with make_engine() as engine:
        model = engine.load_model(config=model_config(n_parallel=3))
        before = model.status().prefilled_tokens
        greedy = GenerationOptions(max_tokens=6, temperature=0.0, logprobs=0)
        results = [s.result() for s in model.streams(PROMPT, greedy, n=3)]
        n_prompt = len(results[0].prompt_tokens)
        assert model.status().prefilled_tokens - before == n_prompt
        # Greedy from the same logits over the same (shared) KV: one text, three times; a fork
        # whose KV were wrong or missing would continue differently.
        assert len({r.text for r in results}) == 1 and results[0].text
        firsts = {r.logprobs[0].logprob for r in results if r.logprobs}
        assert len(firsts) == 1
        alone = model.complete(PROMPT, greedy, deterministic=True)
        assert alone.completion_tokens[0] == results[0].completion_tokens[0]


def test_prompt_logprobs_on_llama_cpp() -> None:
    with make_engine() as engine:
        model = engine.load_model(config=model_config())
        opts = GenerationOptions(max_tokens=1, temperature=0.0, logprobs=0, prompt_logprobs=3)
        first = model.complete(PROMPT, opts)
        again = model.complete(PROMPT, opts)  # the live slot holds the prompt: still prefilled
        assert again.stats.cached_tokens == 0
        lps = first.prompt_logprobs
        assert lps is not None and [t.token for t in lps] == list(first.prompt_tokens[1:])
        assert all(t.logprob <= 0 and len(t.top) == 3 for t in lps)
        assert all(t.logprob <= t.top[0][2] + 1e-4 for t in lps)  # the best is the top one
        # deterministic mode: the same aligned prefill, the same numbers
        assert again.prompt_logprobs is not None
        assert np.allclose([t.logprob for t in lps], [t.logprob for t in again.prompt_logprobs])
