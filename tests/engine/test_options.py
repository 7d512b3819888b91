"""GenerationOptions.validate: every float option must be finite and in its range."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvwarm.engine.submit import choice_options
from kvwarm.engine.types import RANDOM_SEED, GenerationOptions
from kvwarm.errors import InvalidRequestError
from kvwarm.unicode import find_lone_surrogate

FLOAT_OPTIONS = sorted(
    f.name
    for f in dataclasses.fields(GenerationOptions)
    if isinstance(getattr(GenerationOptions(), f.name), float)
)


def test_float_options_are_found() -> None:
    assert {"temperature", "repeat_penalty", "presence_penalty"} <= set(FLOAT_OPTIONS)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", FLOAT_OPTIONS)
def test_non_finite_floats_are_rejected(name: str, value: float) -> None:
    options = dataclasses.replace(GenerationOptions(), **{name: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as info:
        options.validate()
    assert info.value.param == name


# 1e-45: found by review (a repeated token's logit divided by it is inf in float32).
@pytest.mark.parametrize("value", [0.0, -1.0, 10.5, 1e-45, 1e-7])
def test_repeat_penalty_range(value: float) -> None:
    with pytest.raises(InvalidRequestError):
        GenerationOptions(repeat_penalty=value).validate()


@pytest.mark.parametrize(
    ("stop", "says"),
    [
        (("",), "stop must not hold an empty string (item 0)"),
        (("ok", ""), "stop must not hold an empty string (item 1)"),
        (tuple("abcdefghijklmnopq"), "stop must be at most 16 strings, not 17"),
        (("ok", 5), "stop must be strings: item 1 is int"),
    ],
)
def test_stop_strings_are_at_most_16_none_empty(stop: tuple[object, ...], says: str) -> None:
    options = dataclasses.replace(GenerationOptions(), stop=stop)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as info:
        options.validate()
    assert info.value.param == "stop"


def test_non_finite_logit_bias_is_rejected() -> None:
    with pytest.raises(InvalidRequestError):
        GenerationOptions(logit_bias={5: float("nan")}).validate()


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"stop": ("ok", "\ud800")}, "stop"),
        ({"grammar": 'root ::= "\udfff"'}, "grammar"),
        ({"json_schema": {"enum": ["\ud800"]}}, "json_schema"),
        ({"json_schema": {"\ud800": 1}}, "json_schema"),
    ],
)
def test_lone_surrogates_in_text_options_are_rejected(
    overrides: dict[str, object], param: str
) -> None:
    options = dataclasses.replace(GenerationOptions(), **overrides)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as info:
        options.validate()
    assert info.value.param == param


def test_find_lone_surrogate_names_the_path() -> None:
    body = {"a": [1, "ok", {"b": "x\udc00"}], "c": "fine"}
    assert find_lone_surrogate(body) == "a.2.b"
    assert find_lone_surrogate({"k": {"\ud800": 1}}) == "k"
    assert find_lone_surrogate({"k": ["\U0001f60a", "é"]}) is None
    deep: object = "\ud800"
    for _ in range(100_000):
        deep = [deep]
    assert find_lone_surrogate(deep) is not None  # iterative: no RecursionError


# Found by review: a value of the wrong type reached the sampler's ctypes calls (a float seed
# or top_k: ``BackendError: admission failed: ArgumentError``) or a comparison (a string
# temperature: ``TypeError``), and a top_k past int32 was silently its low 32 bits
# (2**32 + 1 sampled as top_k=1).
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("seed", 1.5),
        ("seed", "7"),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_k", 2**32 + 1),
        ("max_tokens", 2.5),
        ("logprobs", True),
        ("prompt_logprobs", 1.0),
        ("temperature", "1"),
        ("top_p", None),
        ("min_p", False),
        ("logit_bias", {5: "x"}),
        ("logit_bias", [(5, 1.0)]),
        # Switches were taken for their truth (found by review): "false" generated to
        # max_tokens, "no" added BOS or asked for a bit-identical request.
        ("ignore_eos", "false"),
        ("add_special", "no"),
        ("parse_special", None),
        ("deterministic", "no"),
        ("deterministic", 0),
        # A number or a list was a TypeError; a str of 32 characters was waited for as a key.
        ("parent_key", 5),
        ("parent_key", [0] * 32),
        ("parent_key", "0" * 32),
        # llama-server's line stops: counts, 0 off (the server maps its "0 or below" to 0).
        ("n_indent", -1),
        ("n_indent", "4"),
        ("t_max_predict_ms", -500),
        ("t_max_predict_ms", 1.5),
    ],
)
def test_ill_typed_options_are_rejected(name: str, value: object) -> None:
    options = dataclasses.replace(GenerationOptions(), **{name: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as info:
        options.validate()
    assert info.value.param == name


def test_well_typed_options_pass() -> None:
    GenerationOptions(
        top_k=(1 << 31) - 1, seed=2**64 - 1, temperature=1, top_p=1, logit_bias={5: -1}
    ).validate()
    GenerationOptions(deterministic=True, ignore_eos=True, parent_key=bytes(32)).validate()
    GenerationOptions(deterministic=None, add_special=False, parse_special=False).validate()


def test_seeds_are_32_bit_and_the_random_one_draws_on_every_backend() -> None:
    """llama.cpp's sampler draws a fresh seed for 0xFFFFFFFF (LLAMA_DEFAULT_SEED), the stub's
    did not: -1 (0xFFFFFFFF in 32 bits) was random on one backend and fixed on the other. Both
    now get None for it, and any other integer modulo 2**32."""
    assert GenerationOptions(seed=-1).sampling(None).seed is None
    assert GenerationOptions(seed=RANDOM_SEED).sampling(None).seed is None
    assert GenerationOptions(seed=(1 << 32) + 5).sampling(None).seed == 5
    assert GenerationOptions(seed=7).sampling(None).seed == 7


def test_no_choice_of_n_lands_on_the_random_seed() -> None:
    """Choice ``i`` samples with ``seed + i``: one landing on 0xFFFFFFFF would have drawn a
    random seed, so that choice alone was not reproducible."""
    near = GenerationOptions(seed=RANDOM_SEED - 1)
    seeds = [o.seed for o in choice_options(near, 3, 4)]
    assert seeds == [RANDOM_SEED - 1, 0, 1]
    assert all(o.seed == -1 for o in choice_options(GenerationOptions(seed=-1), 3, 4))
    assert [o.seed for o in choice_options(GenerationOptions(seed=5), 2, 4)] == [5, 6]


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"grammar_triggers": ("<tool_call>",)}, "grammar_triggers"),  # no grammar to start
        ({"json_schema": {"type": "object"}, "grammar_triggers": ("{",)}, "grammar_triggers"),
        ({"grammar": 'root ::= "x"', "grammar_triggers": ("",)}, "grammar_triggers"),
        ({"grammar": 'root ::= "x"', "grammar_triggers": "x"}, "grammar_triggers"),
        ({"grammar": 'root ::= "x"', "grammar_triggers": (5,)}, "grammar_triggers"),
        ({"grammar": 'root ::= "x"', "grammar_triggers": ("\udc00",)}, "grammar_triggers"),
        ({"grammar": 'root ::= "x"', "grammar_once": True}, "grammar_once"),
        ({"grammar_start_patterns": ("x",)}, "grammar_start_patterns"),  # no grammar
        ({"json_schema": {}, "grammar_start_patterns": ("{",)}, "grammar_start_patterns"),
        ({"grammar": 'root ::= "x"', "grammar_start_patterns": "x"}, "grammar_start_patterns"),
        ({"grammar": 'root ::= "x"', "grammar_start_patterns": (1,)}, "grammar_start_patterns"),
        ({"grammar": 'root ::= "x"', "grammar_start_patterns": ("[",)}, "grammar_start_patterns"),
        (
            {"grammar": 'root ::= "x"', "grammar_triggers": ("x",), "grammar_once": 1},
            "grammar_once",
        ),
    ],
)
def test_lazy_grammar_options_are_checked(overrides: dict[str, object], param: str) -> None:
    options = dataclasses.replace(GenerationOptions(), **overrides)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as info:
        options.validate()
    assert info.value.param == param


def test_lazy_grammar_options_reach_the_sampler() -> None:
    options = GenerationOptions(grammar='root ::= "x"', grammar_triggers=["x"], grammar_once=True)  # type: ignore[arg-type]
    options.validate()
    params = options.sampling(options.grammar)
    assert params.grammar_triggers == ("x",) and params.grammar_once
    starts = GenerationOptions(grammar='root ::= "x"', grammar_start_patterns=["x"])  # type: ignore[arg-type]
    starts.validate()
    assert starts.sampling(starts.grammar).grammar_start_patterns == ("x",)
