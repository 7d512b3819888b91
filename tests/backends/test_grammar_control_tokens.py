"""A grammar holds the reply's text, control tokens included (found by review): llama.cpp's
grammar reads a control token as its special text (``<|im_start|>``), but a reply's text leaves
it out, so under ``root ::= "<|im_start|>" "x"`` the model wrote that token and the reply was
``x``, and a string's ``minLength`` could be met by text the reply never held. While a grammar
holds, the llama.cpp backend masks control tokens other than a request's preserved ones (a tool
call's markers, whose text the reply keeps). And where the chain's biases ban every token the
grammar allows (``ignore_eos`` once its text is complete), the error says that."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvwarm.backends.base import BackendContext, BackendModel, BatchToken, SamplingParams

pytestmark = pytest.mark.model

IM_START = 1  # SmolLM2's <|im_start|>: a control token, not an end of generation


@pytest.fixture(scope="module")
def model() -> Iterator[BackendModel]:
    from kvwarm.backends import get_backend
    from kvwarm.embedded import default_model_path

    loaded = get_backend("llama_cpp").load_model(str(default_model_path()))
    try:
        yield loaded
    finally:
        loaded.close()


@pytest.fixture
def ctx(model: BackendModel) -> Iterator[BackendContext]:
    from kvwarm.backends.base import ContextParams

    small = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=1, n_threads=2)
    context = model.new_context(model.context_params(small, deterministic=False))
    try:
        yield context
    finally:
        context.close()


def _generate(
    model: BackendModel, ctx: BackendContext, params: SamplingParams, n: int
) -> tuple[list[int], bool]:
    prompt = model.tokenize("Say something:")
    ctx.prefill(0, prompt, 0)
    sampler = model.new_sampler(params)
    out: list[int] = []
    try:
        for _ in range(n):
            token = sampler.sample(ctx, -1)
            if model.is_eog(token):
                return out, True
            out.append(token)
            ctx.decode([BatchToken(token, len(prompt) + len(out) - 1, 0, logits=True)])
    finally:
        sampler.close()
    return out, False


def test_the_special_tokens_text_is_the_grammars_and_the_control_tokens_are_known(
    model: BackendModel,
) -> None:
    assert model.token_to_piece(IM_START, special=True) == b"<|im_start|>"
    assert model.token_to_piece(IM_START) == b""  # what a reply's text holds of it
    assert IM_START in model.unspoken_tokens()  # type: ignore[attr-defined]
    assert not set(model.unspoken_tokens()) & model.vocabulary()[1]  # type: ignore[attr-defined]


def test_a_grammar_spelling_a_control_tokens_text_gets_that_text(
    model: BackendModel, ctx: BackendContext
) -> None:
    grammar = 'root ::= "<|im_start|>" "x"'
    params = SamplingParams(temperature=0.0, grammar=grammar, logit_bias=((IM_START, 50.0),))
    out, ended = _generate(model, ctx, params, 16)
    assert IM_START not in out
    assert ended and b"".join(model.token_to_piece(t) for t in out) == b"<|im_start|>x"


def test_a_control_token_the_model_wants_is_never_sampled_under_a_grammar(
    model: BackendModel, ctx: BackendContext
) -> None:
    unspoken: tuple[int, ...] = model.unspoken_tokens()  # type: ignore[attr-defined]
    bias = tuple((t, 30.0) for t in unspoken)
    params = SamplingParams(temperature=0.0, grammar="root ::= [^\\n]{1,24}", logit_bias=bias)
    out, _ = _generate(model, ctx, params, 8)
    assert out and not set(out) & set(unspoken)


def test_a_preserved_token_is_still_the_grammars_to_match(
    model: BackendModel, ctx: BackendContext
) -> None:
    grammar = 'root ::= "<|im_start|>" "x"'
    params = SamplingParams(
        temperature=0.0,
        grammar=grammar,
        logit_bias=((IM_START, 50.0),),
        preserved_tokens=(IM_START,),
    )
    out, _ = _generate(model, ctx, params, 4)
    assert out[0] == IM_START


def test_banning_every_token_the_grammar_allows_says_so(
    model: BackendModel, ctx: BackendContext
) -> None:
    """ignore_eos bans the end of generation, the only token a complete grammar admits: the
    error named the sampler as breaking the grammar."""
    from kvwarm.errors import GrammarError

    eog = sorted(model.vocabulary()[1])
    params = SamplingParams(
        temperature=0.0, grammar='root ::= ""', logit_bias=tuple((t, -np.inf) for t in eog)
    )
    with pytest.raises(GrammarError, match="ignore_eos where the grammar's text is complete"):
        _generate(model, ctx, params, 2)


class _Gated:
    """The model's native library, with ``name`` held (at ``inside``, until ``go``) on the
    call whose arguments ``when`` picks."""

    def __init__(self, lib: object, name: str, when: Callable[..., bool]) -> None:
        self._lib, self._name, self._when = lib, name, when
        self.inside, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> object:
        real = getattr(self._lib, name)
        if name != self._name:
            return real

        def held(*args: object) -> object:
            if self._when(*args):
                self.inside.set()
                assert self.go.wait(60), "the test never let the call go on"
            return real(*args)

        return held


def _served_beside(model: BackendModel, gated: _Gated, hold: Callable[[], object]) -> object:
    """``hold()``'s result, run where ``gated`` holds it midway, while another thread
    tokenizes and builds and frees a sampler of the same model: which must not wait."""
    done: list[object] = []
    holder = threading.Thread(target=lambda: done.append(hold()))
    holder.start()
    served = threading.Event()

    def other() -> None:
        assert model.tokenize("Say hi.")
        model.new_sampler(SamplingParams(temperature=0.0)).close()
        served.set()

    try:
        assert gated.inside.wait(60), "the held call was never reached"
        threading.Thread(target=other, daemon=True).start()
        assert served.wait(60), "tokenize or a sampler waited for the held call"
    finally:
        gated.go.set()
        holder.join(60)
    return done[0]


def test_a_pass_over_the_vocabulary_stops_no_one_else_using_the_model(
    model: BackendModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first grammar's sampler reads the whole vocabulary (``unspoken_tokens``): two
    ctypes calls a token, each waiting for the GIL again, so beside a thread preparing a
    large grammar SmolLM2's pass took 9 s. It held the model's lock all along, and every
    tokenize and sampler of the model, the worker's too, waited: a chat beside it took 9 s.
    Held midway here, the pass lets another thread tokenize and build and free a sampler."""
    gated = _Gated(model._lib, "llama_vocab_is_eog", lambda _vocab, token: token == 100)  # type: ignore[attr-defined]
    monkeypatch.setattr(model, "_lib", gated)
    pieces, _ = _served_beside(model, gated, model.vocabulary)  # type: ignore[misc]
    assert len(pieces) == model.facts.n_vocab


def test_a_grammar_compile_stops_no_one_else_using_the_model(
    model: BackendModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampler's grammar compiled under the model's lock: a large one took ~0.3 s on a
    request's thread, and the model's tokenizes and the worker's samplers waited for it."""
    gated = _Gated(model._lib, "llama_sampler_init_grammar", lambda *_: True)  # type: ignore[attr-defined]
    monkeypatch.setattr(model, "_lib", gated)
    params = SamplingParams(temperature=0.0, grammar='root ::= "yes" | "no"')
    sampler = _served_beside(model, gated, lambda: model.new_sampler(params))
    sampler.close()  # type: ignore[attr-defined]
