"""A lazy grammar (``backends/lazy_grammar.py``) on both backends: free until its trigger, held
from it, free again once complete (or ended, ``grammar_once``); a trigger whose token carries
text the grammar refuses leaves the reply free, where llama.cpp's own lazy sampler aborts.

The samplers are driven through ``sample_logits`` with rows that make one token the clear
choice, so each step says whether the grammar held (it picks another) or not."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvwarm.backends.base import (
    BackendContext,
    BackendModel,
    BatchToken,
    Sampler,
    SamplingParams,
)
from kvwarm.backends.lazy_grammar import TriggerWatch, trigger_watch
from kvwarm.errors import InvalidRequestError

GRAMMAR = 'root ::= "<tc>{1}</tc>" | "<tc>{2}</tc>"'


def test_a_trigger_is_found_across_pieces_and_returns_its_text_on() -> None:
    watch = TriggerWatch((b"<tc>", b"[X]"))
    assert watch.feed(b"Hi <") is None
    assert watch.feed(b"t") is None
    assert watch.feed(b"c>{1") == b"<tc>{1"
    assert watch.feed(b"<t") is None  # cleared after a match: searched afresh
    watch.clear()
    assert watch.feed(b"c>") is None  # a cleared watch forgot the "<t"
    assert watch.feed(b"a[X]b<tc>") == b"[X]b<tc>"  # the earliest of two


def test_a_refused_start_leaves_the_rest_of_its_text_searched() -> None:
    """Found by review: after a start the grammar refused, the rest of that piece was not
    searched, for a later trigger or for the start of one the next piece completes."""
    watch = TriggerWatch((b"<tc>", b"[X]"))
    start = watch.feed(b"Hi <tc>.[X]{")
    assert start == b"<tc>.[X]{"
    assert watch.refused(start) == b"[X]{"  # the next one, in the same piece
    assert watch.refused(b"[X]{") is None
    assert watch.feed(b"<tc>") == b"<tc>"
    assert watch.refused(b"<tc>.<t") is None  # a trigger's start at the end is kept
    assert watch.feed(b"c>{") == b"<tc>{"
    assert watch.refused(b"<tc>{") is None
    assert watch.feed(b"c>") is None  # nothing kept from a start with no trigger after it


def assert_invalid(model: BackendModel, params: SamplingParams, param: str) -> None:
    """``params`` are refused, naming ``param``, by the trigger watch and by the sampler."""
    with pytest.raises(InvalidRequestError) as info:
        trigger_watch(params)
    assert info.value.param == param
    with pytest.raises(InvalidRequestError):
        model.new_sampler(params).close()


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(grammar_triggers=("<tc>",)), "grammar_triggers"),
        (SamplingParams(grammar=GRAMMAR, grammar_triggers=("",)), "grammar_triggers"),
        (SamplingParams(grammar=GRAMMAR, grammar_triggers=("a\0",)), "grammar_triggers"),
        (SamplingParams(grammar=GRAMMAR, grammar_triggers=("x" * 129,)), "grammar_triggers"),
        (SamplingParams(grammar=GRAMMAR, grammar_triggers=("a",) * 17), "grammar_triggers"),
        (SamplingParams(grammar=GRAMMAR, grammar_triggers=("\udc00",)), "grammar_triggers"),
        (SamplingParams(grammar=GRAMMAR, grammar_once=True), "grammar_once"),
    ],
)
def test_bad_triggers_are_invalid_requests(
    model: BackendModel, params: SamplingParams, param: str
) -> None:
    assert_invalid(model, params, param)


class Driver:
    """A sampler fed rows that each make one token the clear choice."""

    def __init__(self, model: BackendModel, sampler: Sampler) -> None:
        self.model, self.sampler = model, sampler
        self.text = b""

    def want(self, token: int, others: float = 0.0) -> int:
        row = np.full(self.model.facts.n_vocab, others, dtype=np.float32)
        row[token] = 20.0
        got = self.sampler.sample_logits(row.tobytes())
        if not self.model.is_eog(got):
            self.text += self.model.token_to_piece(got, special=True)
        return got

    def say(self, text: str) -> None:
        """Each token of ``text`` wanted, and each one picked (the reply is free)."""
        for token in self.model.tokenize(text, add_special=False):
            assert self.want(token) == token, self.text

    def tokens(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=False)


def _driver(
    model: BackendModel,
    temperature: float,
    once: bool = False,
    grammar: str = GRAMMAR,
    triggers: tuple[str, ...] = ("<tc>",),
) -> Iterator[Driver]:
    params = SamplingParams(
        temperature=temperature,
        seed=5,
        grammar=grammar,
        grammar_triggers=triggers,
        grammar_once=once,
    )
    sampler = model.new_sampler(params)
    yield Driver(model, sampler)
    sampler.close()


# Greedy free text is an argmax (llama.cpp's backend), sampled text goes through the chain.
@pytest.fixture(params=[0.0, 0.7], ids=["greedy", "sampled"])
def driver(model: BackendModel, request: pytest.FixtureRequest) -> Iterator[Driver]:
    yield from _driver(model, request.param)


@pytest.fixture(params=[0.0, 0.7], ids=["greedy", "sampled"])
def once(model: BackendModel, request: pytest.FixtureRequest) -> Iterator[Driver]:
    yield from _driver(model, request.param, once=True)


def _hold_to_the_end(d: Driver) -> None:
    """With the grammar held: a token it refuses is wanted and not picked, then the grammar's
    own choices run until it is complete."""
    (refused,) = d.tokens("x")
    assert d.want(refused) != refused
    for _ in range(16):
        if d.text.endswith(b"</tc>"):
            break
        d.want(refused, others=1.0)
    assert d.text.rsplit(b"<tc>", 1)[1] in (b"{1}</tc>", b"{2}</tc>"), d.text


def test_free_until_the_trigger_then_held_then_free_again(driver: Driver) -> None:
    driver.say("Hi x")  # the grammar would refuse every one of these: it does not hold yet
    driver.say(" <tc>")
    _hold_to_the_end(driver)
    driver.say(" bye x")  # complete: free again
    driver.say("<tc>")  # a second call starts it again
    _hold_to_the_end(driver)


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_a_grammar_that_could_go_on_lets_go_where_it_could_end(
    model: BackendModel, temperature: float
) -> None:
    """A call's grammar may end in optional space (a JSON value's ``space``): it is complete
    where it admits end-of-generation, so the next call's opener can follow at once."""
    tail = 'root ::= "<tc>{1}</tc>" | "<tc>{1}</tc> " | "<tc>{2}</tc>" | "<tc>{2}</tc> "'
    for d in _driver(model, temperature, grammar=tail):
        d.say("Hi <tc>")
        _hold_to_the_end(d)
        d.say("<tc>")  # not a space: free, and the opener of the next call
        _hold_to_the_end(d)


def test_once_ends_the_reply_after_the_grammar(once: Driver) -> None:
    once.say("Hi <tc>")
    _hold_to_the_end(once)
    (wanted,) = once.tokens("x")
    assert once.model.is_eog(once.want(wanted))


def test_rows_are_sampled_one_by_one(model: BackendModel, ctx: BackendContext) -> None:
    """A verify pass's rows go through the sampler in order (its state moves with each),
    never as one batch of argmaxes, even where the grammar would not be enforced."""
    tokens = model.tokenize("Hi there, how are you today?")
    ctx.prefill(0, tokens[:-3], 0)
    n = len(tokens) - 3
    ctx.decode([BatchToken(t, n + i, 0, logits=True) for i, t in enumerate(tokens[-3:])])
    for grammar in (GRAMMAR, 'root ::= "<tc>" [a-z]+'):
        words = SamplingParams(temperature=0.0, grammar=grammar, grammar_triggers=("<tc>",))
        at_start = SamplingParams(temperature=0.0, grammar=grammar, grammar_start_patterns=("<",))
        for params in (words, at_start):
            sampler = model.new_sampler(params)
            try:
                assert sampler.argmax_rows(ctx, 0, 3) is None
            finally:
                sampler.close()


def test_reset_lets_go(driver: Driver) -> None:
    driver.say("<tc>")
    driver.sampler.reset()
    driver.say("x <t")  # free again
    driver.sampler.reset()
    driver.say("c> x")  # and the trigger's start was forgotten
    driver.say("<tc>")
    _hold_to_the_end(driver)


def test_a_token_that_completes_a_refused_trigger_and_another_holds_from_the_other(
    model: BackendModel,
) -> None:
    """``a`` after ``b`` completes two triggers: ``ba``, which the grammar refuses, and ``a``,
    which it takes. The sampler tries the second (it left the reply free: found by review)."""
    grammar = 'root ::= "a{1}" | "a{2}"'
    for temperature in (0.0, 0.7):
        for d in _driver(model, temperature, grammar=grammar, triggers=("ba", "a")):
            d.say("Hi b")
            (a,) = d.tokens("a")
            assert d.want(a) == a
            (x,) = d.tokens("x")
            assert d.want(x) != x  # held
            for _ in range(8):
                if d.text.endswith(b"}"):
                    break
                d.want(x, others=1.0)
            assert d.text.endswith((b"a{1}", b"a{2}")), d.text


@pytest.mark.model
def test_a_trigger_begun_after_a_refused_one_in_the_same_token_is_found() -> None:
    """SmolLM2 writes ``><`` as one token: after ``<tc``, it completes ``<tc>`` (refused: the
    grammar wants ``{`` next) and begins the next ``<tc>``, which ``tc>`` then completes."""
    from kvwarm.backends import get_backend
    from kvwarm.embedded import default_model_path

    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    try:
        pieces, _ = model.vocabulary()
        both = pieces.index(b"><")
        for temperature in (0.0, 0.7):
            for d in _driver(model, temperature):
                d.say("Hi <tc")
                assert d.want(both) == both
                d.say("tc>")  # completes the trigger begun in "><"
                _hold_to_the_end(d)
    finally:
        model.close()


@pytest.mark.model
def test_a_trigger_whose_token_carries_refused_text_leaves_the_reply_free() -> None:
    """SmolLM2 writes ``>.`` as one token: the trigger ``<tc>`` completes with a ``.`` the
    grammar refuses. llama.cpp's lazy sampler would replay it and abort the process."""
    from kvwarm.backends import get_backend
    from kvwarm.embedded import default_model_path

    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    try:
        pieces, _ = model.vocabulary()
        dot = pieces.index(b">.")
        for temperature in (0.0, 0.7):
            for d in _driver(model, temperature):
                d.say("Hi <tc")
                assert d.want(dot) == dot
                d.say(" x")  # free: the grammar did not start
                d.say(" <tc>")  # the next trigger starts it
                _hold_to_the_end(d)
    finally:
        model.close()


@pytest.mark.model
def test_a_sentencepiece_vocabulary_holds_and_lets_go_too(gemma_path: str) -> None:
    """Gemma's vocabulary spells single bytes with its byte-fallback tokens (``<0x3C>``): the
    trigger's text reaches the grammar through them as through SmolLM2's byte-level ones."""
    from kvwarm.backends import get_backend

    model = get_backend("llama_cpp").load_model(gemma_path)
    try:
        single, eog = model.grammar_tokens()  # type: ignore[attr-defined]
        assert all(token is not None for token in single) and eog
        for temperature in (0.0, 0.7):
            for d in _driver(model, temperature):
                d.say("Hi x <tc>")
                _hold_to_the_end(d)
                d.say(" bye x<tc>")
                _hold_to_the_end(d)
    finally:
        model.close()


# -- start patterns (a format without an opener: Llama 3.x's bare-JSON call) ----------------

BARE = 'root ::= "<tc>{1}</tc>" | "<tc>{2}</tc>" | "{1}" | "{2}"'
START = r"\s*(\{)"


def test_a_start_pattern_matches_only_the_replys_start() -> None:
    import re

    watch = TriggerWatch((b"<tc>",), (re.compile(START.encode()),))
    assert watch.feed(b" \n") is None
    assert watch.feed(b"{1") == b"{1"  # from the pattern's group on
    watch.clear()  # held, then let go: the reply's start is past
    assert watch.feed(b"{") is None
    assert watch.feed(b"<tc>") == b"<tc>"  # the words are still looked for
    watch.restart()  # a new reply
    assert watch.feed(b"Hi {") is None  # ordinary text: free, and the start is past
    assert watch.feed(b"{") is None
    watch.restart()
    assert watch.feed(b" " * 200) is None  # looked for in the first 128 bytes only
    assert watch.feed(b"{") is None
    only = TriggerWatch((), (re.compile(rb'(\{"a")'),))
    assert only.feed(b'{"') is None
    assert only.feed(b'a"}') == b'{"a"}'
    assert only.feed(b'{"a"') is None


def _starts(*patterns: str, grammar: str | None = BARE, words: int = 0) -> SamplingParams:
    return SamplingParams(
        grammar=grammar, grammar_triggers=("a",) * words, grammar_start_patterns=patterns
    )


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (_starts(START, grammar=None), "grammar_start_patterns"),
        (_starts(""), "grammar_start_patterns"),
        (_starts("("), "grammar_start_patterns"),  # no regular expression
        (_starts("x" * 129), "grammar_start_patterns"),
        (_starts(*("a",) * 9, words=8), "grammar_triggers"),  # 17 in all
        (_starts("\udc00"), "grammar_start_patterns"),
    ],
)
def test_bad_start_patterns_are_invalid_requests(
    model: BackendModel, params: SamplingParams, param: str
) -> None:
    assert_invalid(model, params, param)


def _bare(model: BackendModel, temperature: float) -> Iterator[Driver]:
    params = SamplingParams(
        temperature=temperature,
        seed=5,
        grammar=BARE,
        grammar_triggers=("<tc>",),
        grammar_start_patterns=(START,),
    )
    sampler = model.new_sampler(params)
    yield Driver(model, sampler)
    sampler.close()


def _hold_bare(d: Driver) -> None:
    (refused,) = d.tokens("x")
    assert d.want(refused) != refused
    for _ in range(16):
        if d.text.endswith(b"}"):
            break
        d.want(refused, others=1.0)
    assert d.text.lstrip().startswith((b"{1}", b"{2}")), d.text


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_a_reply_that_begins_as_a_call_is_held_one_of_text_stays_free(
    model: BackendModel, temperature: float
) -> None:
    for d in _bare(model, temperature):
        d.say(" {")
        _hold_bare(d)
        d.say(" then {x} free")  # complete: free, and no longer at the reply's start
        d.say(" <tc>")  # a word trigger still starts it
        assert d.want(d.tokens("x")[0]) != d.tokens("x")[0]
    for d in _bare(model, temperature):
        d.say("Hi {x}")  # a reply of text: free, a brace later in it too
        d.sampler.reset()  # a new reply: its start is looked at again
        d.text = b""
        d.say("{")
        _hold_bare(d)


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_a_start_the_grammar_refuses_leaves_the_reply_free(
    model: BackendModel, temperature: float
) -> None:
    """The pattern matches text the grammar refuses (``{3``): the reply goes on free, never
    aborts, and its start is past (a call that begins later is the model's own)."""
    params = SamplingParams(
        temperature=temperature, seed=5, grammar=BARE, grammar_start_patterns=(r"(\{\d)",)
    )
    sampler = model.new_sampler(params)
    try:
        d = Driver(model, sampler)
        d.say("{3")
        d.say("} then {1}x")  # all free
    finally:
        sampler.close()
