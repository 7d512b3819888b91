"""llama-server's line stops (``GenerationOptions.n_indent``, ``t_max_predict_ms``) in the
engine, on the stub: the reply's text, tokens, logprobs and stats agree, and its finish row
holds exactly the tokens that were decoded (the one that ended the reply never is), plain or
speculating. A literal grammar makes the stub write the text a test needs, one byte a token."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
from tests.engine.conftest import make_engine, stub_config

from kvwarm.backends.stub import StubBackend
from kvwarm.engine.api import Engine
from kvwarm.engine.model import Model
from kvwarm.engine.types import Completion, GenerationOptions

MIDDLE = "    a\n    b\n  c\nd\n"
KEPT = "    a\n    b\n  "
OPTS = GenerationOptions(
    max_tokens=64, temperature=0.0, grammar="root ::= " + json.dumps(MIDDLE), logprobs=0
)


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = make_engine()
    yield eng
    eng.close()


def _saved_is_decoded(engine: Engine, out: Completion) -> None:
    """The finish row holds the prompt and every generated token but the last (sampled, the
    reply ended with it, never decoded)."""
    engine.cache.flush()
    assert out.stats.key is not None
    saved = engine.cache.row_tokens(out.stats.key)
    assert saved == out.prompt_tokens + out.completion_tokens[:-1]


def test_n_indent_cuts_the_text_and_saves_what_was_decoded(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    out = model.complete("def f():\n", replace(OPTS, n_indent=4))
    assert out.text == KEPT
    assert out.stats.finish_reason == "length" and out.stats.stopped_by == "n_indent"
    assert out.stats.stop_sequence is None
    assert model.detokenize(list(out.completion_tokens)) == KEPT + "c"
    # The logprobs are those of the returned text's tokens, as after a stop sequence.
    assert out.logprobs is not None
    assert [t.token for t in out.logprobs] == list(out.completion_tokens[:-1])
    _saved_is_decoded(engine, out)
    streamed = list(model.stream("def f():\n", replace(OPTS, n_indent=4)))
    assert "".join(streamed) == KEPT
    plain = model.complete("def f():\n", OPTS)
    assert plain.text == MIDDLE and plain.stats.stopped_by is None


def test_t_max_predict_ms_ends_at_a_newline_past_the_limit(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    rt = model._worker.rt
    seconds = itertools.count()
    rt.clock = lambda: float(next(seconds))  # each sampled token a second after the last
    out = model.complete("def f():\n", replace(OPTS, t_max_predict_ms=1500))
    assert out.text == "    a\n"  # the newline at 5 s, past 1.5 s after the first token
    assert out.stats.finish_reason == "length" and out.stats.stopped_by == "t_max_predict_ms"
    assert out.stats.decode_ms == 5000.0 and len(out.completion_tokens) == 6
    _saved_is_decoded(engine, out)


def test_a_speculating_request_stops_alike_and_saves_what_was_decoded(engine: Engine) -> None:
    config = replace(
        stub_config(backend=StubBackend(copy_bias=8.0), n_batch=64), spec_type="ngram-simple"
    )
    model: Model = engine.load_model(config=config)
    prompt = f"Copy this:\n{MIDDLE}{MIDDLE}Again:\n    a\n"
    opts = GenerationOptions(max_tokens=40, temperature=0.0, n_indent=4)
    plain = model.complete(prompt, opts, spec_type="none", cache_salt="plain")
    model.evict()
    spec = model.complete(prompt, opts)
    assert spec.stats.drafted_tokens > 0
    assert spec.text == plain.text and spec.completion_tokens == plain.completion_tokens
    assert spec.stats.stopped_by == "n_indent" and spec.text.endswith("\n  ")
    _saved_is_decoded(engine, spec)
