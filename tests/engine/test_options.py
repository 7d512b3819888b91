"""GenerationOptions.validate: every float option must be finite and in its range."""

from __future__ import annotations

import dataclasses

import pytest

from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import InvalidRequestError

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


@pytest.mark.parametrize("value", [0.0, -1.0, 10.5])
def test_repeat_penalty_range(value: float) -> None:
    with pytest.raises(InvalidRequestError):
        GenerationOptions(repeat_penalty=value).validate()


def test_non_finite_logit_bias_is_rejected() -> None:
    with pytest.raises(InvalidRequestError):
        GenerationOptions(logit_bias={5: float("nan")}).validate()
