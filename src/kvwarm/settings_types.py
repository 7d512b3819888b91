"""Value types for ``kvwarm.settings``: how one raw value from a flag, an environment variable or
a TOML file becomes a typed setting.

Invariant: every parser accepts the string form (flags and environment variables are strings)
and the native TOML form, and raises ``ValueError`` with a message fit for a user; the loader
prefixes it with the source and the setting's name. Each public alias is an ``Annotated`` type:
the ``BeforeValidator`` does the lenient parsing, pydantic then checks the result's type.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator
from pydantic_settings import NoDecode

from kvwarm.cache.types import TIER_NAMES, PolicyConfig, TierName
from kvwarm.embedded import model_id_for

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model to serve. ``path`` None means the default model (``$KVWARM_MODEL`` or the
    embedded SmolLM2); per-model fields left None take the global setting."""

    path: str | None = None
    id: str | None = None
    backend: str | None = None
    n_ctx: int | None = None
    n_parallel: int | None = None

    @property
    def model_id(self) -> str:
        return self.id or model_id_for(self.path)

    @staticmethod
    def parse(text: str) -> ModelSpec:
        """``[ID=]PATH``; PATH ``default`` (or empty) is the default model."""
        model_id, sep, path = text.partition("=")
        if not sep:
            model_id, path = "", text
        path = path.strip()
        return ModelSpec(
            path=None if path in ("", "default") else path, id=model_id.strip() or None
        )


def as_str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def as_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    return int(as_str(value).strip())


def as_float(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, int | float):
        return float(value)
    return float(as_str(value).strip())


def as_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = as_str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def as_size(value: object) -> int:
    """Bytes; strings may carry a K/M/G/T suffix (binary multiples)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("must be >= 0")
        return value
    match = _SIZE.match(as_str(value))
    if match is None:
        raise ValueError(f"expected a size like 512M or 20G, got {value!r}")
    return int(float(match.group(1)) * _SCALE[match.group(2).lower()])


def as_opt_int(value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    return as_int(value)


def as_opt_str(value: object) -> str | None:
    if value is None:
        return None
    text = as_str(value)
    return text or None


def as_opt_path(value: object) -> Path | None:
    if value is None:
        return None
    if isinstance(value, Path):
        return value
    text = as_str(value).strip()
    if text.lower() in ("", "none", "off"):
        return None
    return Path(text).expanduser()


def as_tier(value: object) -> TierName | None:
    text = as_opt_str(value)
    if text is None:
        return None
    for tier in TIER_NAMES:
        if text == tier:
            return tier
    raise ValueError(f"expected one of {', '.join(TIER_NAMES)}, got {text!r}")


def as_str_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list | tuple):
        return tuple(as_str(v) for v in value)
    raise ValueError("expected a string or a list of strings")


_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelSpec)}


def as_models(value: object) -> tuple[ModelSpec, ...]:
    """A comma-separated string of ``[ID=]PATH`` (env), a list of those (flags), or a list of
    tables with path/id/backend/n_ctx/n_parallel (TOML)."""
    if isinstance(value, str):
        return tuple(ModelSpec.parse(part) for part in value.split(",") if part.strip())
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of models")
    specs: list[ModelSpec] = []
    for item in value:
        if isinstance(item, str):
            specs.append(ModelSpec.parse(item))
        elif isinstance(item, Mapping):
            unknown = set(item) - _MODEL_KEYS
            if unknown:
                raise ValueError(f"unknown model keys: {', '.join(sorted(unknown))}")
            specs.append(
                ModelSpec(
                    path=as_opt_str(item.get("path")),
                    id=as_opt_str(item.get("id")),
                    backend=as_opt_str(item.get("backend")),
                    n_ctx=as_opt_int(item.get("n_ctx")),
                    n_parallel=as_opt_int(item.get("n_parallel")),
                )
            )
        elif isinstance(item, ModelSpec):
            specs.append(item)
        else:
            raise ValueError("each model is a string or a table")
    return tuple(specs)


POLICY_KEYS = frozenset(f.name for f in dataclasses.fields(PolicyConfig))


def policy_items(value: object) -> dict[str, int]:
    """Policy overrides: a TOML table, or ``KEY=VALUE`` strings (flags). Sources merge these
    key by key, so a flag can change one gate without restating the others."""
    pairs: dict[str, object]
    if isinstance(value, Mapping):
        pairs = {str(k): v for k, v in value.items()}
    elif isinstance(value, list | tuple):
        pairs = {}
        for item in value:
            name, sep, text = as_str(item).partition("=")
            if not sep:
                raise ValueError(f"expected KEY=VALUE, got {item!r}")
            pairs[name.strip()] = text.strip()
    else:
        raise ValueError("expected a table of policy values")
    out: dict[str, int] = {}
    for key, raw in pairs.items():
        if key not in POLICY_KEYS:
            raise ValueError(f"unknown policy key {key!r} ({', '.join(sorted(POLICY_KEYS))})")
        out[key] = as_int(raw)
    return out


def as_policy(value: object) -> PolicyConfig:
    if isinstance(value, PolicyConfig):
        return value
    return PolicyConfig(**policy_items(value))


# NoDecode: pydantic-settings would JSON-decode complex values from the environment; these
# have their own string syntax instead.
Str = Annotated[str, BeforeValidator(as_str)]
Int = Annotated[int, BeforeValidator(as_int)]
Float = Annotated[float, BeforeValidator(as_float)]
Bool = Annotated[bool, BeforeValidator(as_bool)]
Size = Annotated[int, BeforeValidator(as_size)]
OptInt = Annotated[int | None, BeforeValidator(as_opt_int)]
OptStr = Annotated[str | None, BeforeValidator(as_opt_str)]
OptPath = Annotated[Path | None, BeforeValidator(as_opt_path)]
OptTier = Annotated[TierName | None, BeforeValidator(as_tier)]
StrTuple = Annotated[tuple[str, ...], BeforeValidator(as_str_tuple), NoDecode]
Models = Annotated[tuple[ModelSpec, ...], BeforeValidator(as_models), NoDecode]
Policy = Annotated[PolicyConfig, BeforeValidator(as_policy), NoDecode]
