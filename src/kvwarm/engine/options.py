"""Per-call option merging: ``GenerationOptions`` plus keyword overrides, validated once.

Invariant: an unknown or ill-typed override is an ``InvalidRequestError`` naming it, raised on
the caller's thread before anything is queued (``docs/architecture.md``, "Engine").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import InvalidRequestError


def merge_options(
    options: GenerationOptions | None, overrides: Mapping[str, object]
) -> GenerationOptions:
    opts = options or GenerationOptions()
    if overrides:
        fields = set(GenerationOptions.__dataclass_fields__)
        unknown = set(overrides) - fields
        if unknown:
            raise InvalidRequestError(
                f"unknown option(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0]
            )
        if "stop" in overrides and isinstance(overrides["stop"], list | str):
            stop = overrides["stop"]
            overrides = {**overrides, "stop": (stop,) if isinstance(stop, str) else tuple(stop)}
        try:
            opts = replace(opts, **overrides)  # type: ignore[arg-type]
        except TypeError as exc:
            raise InvalidRequestError(str(exc)) from exc
    opts.validate()
    return opts
