"""Per-call option merging: ``GenerationOptions`` plus keyword overrides, validated once.

Invariant: an unknown or ill-typed override is an ``InvalidRequestError`` naming it, raised on
the caller's thread before anything is queued (``docs/architecture.md``, "Engine").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TypedDict

from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import InvalidRequestError


class GenerationOverrides(TypedDict, total=False):
    """Keyword overrides of ``GenerationOptions`` for ``Model.complete`` and friends: the same
    names and types, except that ``stop`` may also be one string or a list."""

    max_tokens: int
    stop: str | Sequence[str]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repeat_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int | None
    grammar: str | None
    json_schema: Mapping[str, object] | None
    grammar_triggers: tuple[str, ...]
    grammar_start_patterns: tuple[str, ...]
    grammar_once: bool
    parent_key: bytes | None
    deterministic: bool | None
    add_special: bool
    parse_special: bool
    logprobs: int | None
    prompt_logprobs: int | None
    logit_bias: Mapping[int, float] | None
    ignore_eos: bool
    preserved_tokens: tuple[str, ...]
    cache_salt: str | None
    spec_type: str | None
    spec_draft_max: int | None
    prediction: str | None
    lora: tuple[tuple[int, float], ...] | None
    n_indent: int
    t_max_predict_ms: int


def merge_options(
    options: GenerationOptions | None, overrides: Mapping[str, object]
) -> GenerationOptions:
    if options is not None and not isinstance(options, GenerationOptions):
        # Found by review: an AttributeError ('str' object has no attribute 'validate').
        raise InvalidRequestError(
            f"options must be a GenerationOptions, not {type(options).__name__} (or pass "
            "each option as a keyword: max_tokens=64)",
            param="options",
        )
    opts = options or GenerationOptions()
    if overrides:
        fields = set(GenerationOptions.__dataclass_fields__)
        unknown = set(overrides) - fields
        if unknown:
            raise InvalidRequestError(
                f"unknown option(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0]
            )
        if "stop" in overrides and isinstance(overrides["stop"], list | str):
            # One string is one stop sequence, not a sequence of one-character stops.
            stop = overrides["stop"]
            overrides = {**overrides, "stop": (stop,) if isinstance(stop, str) else tuple(stop)}
        try:
            opts = replace(opts, **overrides)  # type: ignore[arg-type]
        except TypeError as exc:
            raise InvalidRequestError(str(exc)) from exc
    opts.validate()
    return opts
