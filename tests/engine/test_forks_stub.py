"""n > 1 (engine/worker/forks.py), streamed and prompt logprobs, infill prompts, on the stub."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.engine.api import Engine
from kvwarm.engine.prompts import ExtraFile
from kvwarm.engine.request import Fragment
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import FimNotSupportedError, InvalidRequestError

PROMPT = "The system prompt says: be brief and kind. Question: what is a cache?"
SAMPLED = GenerationOptions(max_tokens=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)


def test_n_choices_prefill_the_prompt_once(engine: Engine) -> None:
    model = engine.load_model(config=stub_config(n_parallel=4))
    n_prompt = len(model.tokenize(PROMPT))
    before = model.status().prefilled_tokens
    results = [s.result() for s in model.streams(PROMPT, SAMPLED, n=3)]
    assert model.status().prefilled_tokens - before == n_prompt  # once, not three times
    first, *forks = results
    assert first.stats.cached_tokens == 0 and first.stats.cache_hit == "cold"
    assert all(f.stats.cached_tokens == n_prompt for f in forks)
    assert all(r.prompt_tokens == first.prompt_tokens for r in results)
    assert len({r.text for r in results}) > 1  # sampled independently


def test_choice_i_samples_with_seed_plus_i(engine: Engine) -> None:
    model = engine.load_model(config=stub_config(n_parallel=3))
    group = [s.result().text for s in model.streams(PROMPT, SAMPLED, n=3)]
    alone = [model.complete(PROMPT, SAMPLED, seed=7 + i).text for i in range(3)]
    assert group == alone


def test_n_forks_from_an_exact_cache_hit(engine: Engine) -> None:
    model = engine.load_model(config=stub_config(n_parallel=2))
    greedy = GenerationOptions(max_tokens=6, temperature=0.0)
    model.prewarm(PROMPT)
    model.evict()
    a, b = (s.result() for s in model.streams(PROMPT, greedy, n=2))
    assert a.stats.cache_hit == "exact" and a.text == b.text  # greedy: same logits, same text


def test_n_above_n_parallel_is_refused(engine: Engine) -> None:
    model = engine.load_model(config=stub_config(n_parallel=2))
    with pytest.raises(InvalidRequestError) as caught:
        model.streams(PROMPT, SAMPLED, n=3)
    assert caught.value.param == "n" and "n_parallel" in str(caught.value)


def test_n_waits_for_enough_free_slots() -> None:
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        busy = model.stream("another prompt", GenerationOptions(max_tokens=3, temperature=0))
        group = model.streams(PROMPT, SAMPLED, n=2)
        backend.gate.step(1)  # the first request's prefill; the group still waits for 2 slots
        assert model.status().queued == 1
        backend.gate.set()
        busy.result()
        assert all(s.result().stats.finish_reason in ("stop", "length") for s in group)


def test_cancelling_the_first_choice_before_its_prefill_cancels_the_group() -> None:
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=3, backend=backend))  # type: ignore[arg-type]
        first, *forks = model.streams(PROMPT, SAMPLED, n=3)
        first.cancel()
        backend.gate.set()
        assert first.result().stats.finish_reason == "cancelled"
        assert [f.result().stats.finish_reason for f in forks] == ["cancelled", "cancelled"]
        assert model.status().active == 0


def test_a_group_cancelled_mid_prefill_reports_no_fork_prompt_as_reused() -> None:
    """Found by review: each fork was seated claiming the whole prompt reused (an exact hit),
    so a group cancelled before its prompt was complete, which shared nothing, added every
    fork's prompt to ``cached_tokens`` (``kvwarm_cached_tokens_total``, the dashboard's
    tokens served from the cache) and its ``cache_hit`` said exact. A fork reports its prompt
    reused once it has it."""
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=3, backend=backend))  # type: ignore[arg-type]
        before = model.status()
        first, *forks = model.streams(PROMPT, SAMPLED, n=3)
        backend.gate.step(1)  # the prompt's first chunk (n_batch 16): the forks wait for more
        first.cancel()
        backend.gate.set()
        results = [s.result() for s in (first, *forks)]
        assert [r.stats.finish_reason for r in results] == ["cancelled"] * 3
        assert [(r.stats.cached_tokens, r.stats.cache_hit) for r in results] == [(0, "cold")] * 3
        assert all(r.stats.reuse is None for r in results[1:])
        after = model.status()
        assert after.cached_tokens == before.cached_tokens
        assert after.prompt_tokens - before.prompt_tokens == 3 * len(results[0].prompt_tokens)


def test_streamed_logprobs_add_up_to_the_completions() -> None:
    with make_engine() as eng:
        model = eng.load_model(config=stub_config())
        opts = GenerationOptions(max_tokens=12, temperature=0.0, logprobs=2, stop=("xyz",))
        stream = model.stream(PROMPT, opts)

        async def collect() -> list[Fragment]:
            return [f async for f in stream.afragments()]

        fragments = asyncio.run(collect())
        done = stream.completion
        assert done is not None and done.logprobs is not None
        streamed = [lp for f in fragments for lp in f.logprobs]
        assert streamed == list(done.logprobs)
        assert "".join(f.text for f in fragments) == done.text


def test_prompt_logprobs_score_every_prompt_token_without_reuse(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    greedy = GenerationOptions(max_tokens=4, temperature=0.0)
    plain = model.complete(PROMPT, greedy)
    echo = model.complete(PROMPT, greedy, prompt_logprobs=1)
    assert echo.stats.cached_tokens == 0  # the live slot held the prompt: not reused
    assert echo.text == plain.text
    lps = echo.prompt_logprobs
    assert lps is not None and len(lps) == len(echo.prompt_tokens) - 1
    assert [t.token for t in lps] == list(echo.prompt_tokens[1:])
    assert all(t.logprob <= 0 and len(t.top) == 1 for t in lps)
    # The last prompt position's logits predict the first generated token, as sampling saw.
    with_lp = model.complete(PROMPT, greedy, logprobs=0, prompt_logprobs=0)
    assert with_lp.logprobs is not None and with_lp.logprobs[0].token == plain.completion_tokens[0]


def test_infill_tokens_on_a_model_with_fim_tokens(engine: Engine) -> None:
    model = engine.load_model("stub-fim", model_id="coder", config=stub_config(n_batch=64))
    fim = model.facts.fim
    assert fim is not None
    toks = model.infill_tokens("def f(", "):\n", prompt="x")
    text = lambda s: model.tokenize(s, add_special=False)  # noqa: E731
    bos = [model.facts.bos] if model.facts.add_bos else []
    assert toks == [*bos, fim.pre, *text("def f("), *text("x"), fim.suf, *text("):\n"), fim.mid]
    # llama-server's /infill prompt (n_predict): its repository header and last file
    # separator even without extra files (they came only with extra files before).
    header = [fim.rep, *text("myproject\n"), fim.sep, *text("filename\n")]
    assert model.infill_tokens("def f(", "):\n", prompt="x", n_predict=4) == header + toks
    extra = model.infill_tokens("a", "b", extra=[ExtraFile("import os", "util.py")])
    assert fim.rep is not None and fim.sep is not None
    assert extra[0] == fim.rep and extra.count(fim.sep) == 2
    assert extra[-1] == fim.mid and extra.index(fim.pre) > extra.index(fim.sep)
    # Special-token text in the code stays text.
    assert fim.mid not in model.infill_tokens("<fim_middle>", "")[:-1]
    out = model.complete(toks, GenerationOptions(max_tokens=4, temperature=0.0))
    assert out.stats.prompt_tokens == len(toks)


def test_infill_cuts_as_llama_server_for_a_reply(engine: Engine) -> None:
    # llama-server's format_prompt_infill: the prefix's last 3/4 of a batch, the suffix's
    # first quarter less the prompt and 2, the extra files' last n_ctx - n_batch - 2 n_predict.
    # Uncut, extra context past the context was a 400 where llama-server keeps its latest.
    # The batch is llama-server's default (2048), not the model's n_batch (64 here): the cut
    # followed n_batch, so kvwarm kept 48 tokens of this prefix where llama-server keeps 1536.
    config = stub_config(n_batch=64)
    config = replace(config, context=replace(config.context, n_ctx=4096))
    model = engine.load_model("stub-fim", model_id="coder", config=config)
    fim = model.facts.fim
    assert fim is not None and fim.rep is not None and fim.sep is not None
    text = lambda s: model.tokenize(s, add_special=False)  # noqa: E731
    bos = [model.facts.bos] if model.facts.add_bos else []
    prefix, suffix, prompt = "p" * 100 + "P" * 1536, "S" * 508 + "s" * 100, "mm"
    files = [ExtraFile("x" * 1200, "a.py"), ExtraFile("y" * 1200, "b.py")]
    whole = model.infill_tokens(prefix, suffix, prompt=prompt, extra=files)
    assert len(whole) > model.info().n_ctx  # uncut, it could not be served
    cut = model.infill_tokens(prefix, suffix, prompt=prompt, extra=files, n_predict=10)
    extra_tokens = whole[: whole.index(fim.pre) - len(bos)]
    kept = 4096 - 2048 - 2 * 10
    assert cut == [
        *extra_tokens[-kept:],
        *bos,
        *[fim.pre, *text("P" * 1536), *text(prompt), fim.suf, *text("S" * 508), fim.mid],
    ]
    out = model.complete(cut, GenerationOptions(max_tokens=10, temperature=0.0))
    assert out.stats.completion_tokens == 10
    with pytest.raises(InvalidRequestError) as caught:
        model.infill_tokens("a", "b", n_predict=-1)
    assert caught.value.param == "n_predict"


def test_infill_cut_does_not_depend_on_n_batch_and_leaves_a_small_context_room(
    engine: Engine,
) -> None:
    # The same request reads the same prompt whatever the model's prefill batch; a context
    # below twice llama-server's batch (512 here) sizes the cut by half of it (256), so the
    # prefix and suffix leave the reply room (llama-server's 2048 would overflow it).
    cuts = []
    for n_batch in (16, 64, 256):
        model = engine.load_model(
            "stub-fim", model_id=f"coder-{n_batch}", config=stub_config(n_batch=n_batch)
        )
        assert model.info().n_ctx == 512
        cuts.append(model.infill_tokens("p" * 300, "s" * 300, prompt="m", n_predict=8))
    fim = model.facts.fim
    assert fim is not None
    assert cuts[0] == cuts[1] == cuts[2]
    cut = cuts[0]
    assert cut[cut.index(fim.pre) + 1 : cut.index(fim.suf)] == model.tokenize(
        "p" * 192 + "m", add_special=False
    )
    assert len(cut) - cut.index(fim.suf) - 2 == 64 - 2 - 1  # the suffix's share
    assert len(cut) + 2 * 8 <= 512  # the reply fits


def test_infill_without_fim_tokens_is_refused(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    assert model.facts.fim is None
    with pytest.raises(FimNotSupportedError) as caught:
        model.infill_tokens("a", "b")
    assert caught.value.param == "suffix"
