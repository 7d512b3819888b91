"""Value types for ``kvwarm.settings``: how one raw value from a flag, an environment variable or
a TOML file becomes a typed setting.

Invariant: every parser accepts the string form (flags and environment variables are strings)
and the native TOML form, and raises ``ValueError`` with a message fit for a user; the loader
prefixes it with the source and the setting's name. Each public alias is an ``Annotated`` type:
the ``BeforeValidator`` does the lenient parsing, pydantic then checks the result's type.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import BeforeValidator
from pydantic_settings import NoDecode

from kvwarm.backends.base import (
    FLASH_ATTN_MODES,
    KV_TYPES,
    POOLING_TYPES,
    ROPE_SCALINGS,
    SPLIT_MODES,
    FlashAttn,
    KvType,
    PoolingType,
    RopeScaling,
    SplitMode,
    check_tensor_split,
)
from kvwarm.cache.types import PolicyConfig, TierName
from kvwarm.embedded import model_id_for
from kvwarm.engine.types import SPEC_TYPES, SpecType
from kvwarm.errors import ConfigError

log = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MAX_SIZE = (1 << 63) - 1  # what an int64 (a C size, a file offset) holds

PathKind = Literal["file", "dir", "other", "missing"]


def path_kind(path: Path, setting: str) -> PathKind:
    """What ``path`` (``~`` expanded) is, as the settings' checks ask it: ``missing`` where
    no such file is (a component not a directory included, as ``Path.exists`` says). A path
    no ``stat`` can answer is a ``ConfigError`` naming ``setting``: found by review,
    ``Path.exists``/``is_dir`` raise for a name too long, a directory not searchable or a NUL
    byte (a TOML string), and every command stopped with a traceback and exit status 1."""
    try:
        mode = Path(os.path.expanduser(path)).stat().st_mode
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return "missing"
        raise ConfigError(f"{setting} {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # a NUL byte
        raise ConfigError(f"{setting} {str(path)!r}: {exc}") from exc
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "other"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model to serve. ``path`` None means the default model (``$KVWARM_MODEL`` or the
    embedded SmolLM2); per-model fields left None take the global setting."""

    path: str | None = None
    id: str | None = None
    backend: str | None = None
    n_ctx: int | None = None
    n_parallel: int | None = None
    # Per-model values of the model settings (``settings_model.ModelSettings``), parsed,
    # sorted by name: ``n_gpu_layers = 99`` in a ``[[models]]`` table.
    options: tuple[tuple[str, object], ...] = ()

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


def _text(value: object, expected: str) -> str:
    """``value``, a string: the form of a setting of another type in a flag or variable.
    Found by review: these types said "expected a string, got float" of ``n_ctx = 4096.5`` in
    a TOML file, and Python's own "invalid literal for int() with base 10" of ``abc``; each
    now says what it takes and shows what it got."""
    if not isinstance(value, str):
        raise ValueError(f"expected {expected}, got {value!r}")
    return value


def as_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    text = _text(value, "an integer")
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None


def as_float(value: object) -> float:
    """A finite number: ``nan`` passes every ``< 0`` check (a deadline of nan seconds is no
    deadline, a wait of nan a busy loop) and ``inf`` overflows where seconds are converted."""
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    try:
        if isinstance(value, int | float):
            number = float(value)
        else:
            text = _text(value, "a number").strip()
            try:
                number = float(text)
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
    except OverflowError:  # an int past a float's range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _not_empty(text: str, hint: str) -> str:
    """``text`` stripped; ``ValueError`` if nothing is left. Found by review: an empty value
    (``KVWARM_CACHE_DIR=`` from a variable never filled in, ``--spec-exact ""``) read as
    false, or as not given: the disk tier was silently off, a boolean silently false, an s3
    endpoint silently AWS's. The words for those (``none``, ``false``) still say it."""
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"is empty; {hint}")
    return stripped


def as_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = _not_empty(_text(value, "a boolean"), "give true or false").lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def as_size(value: object) -> int:
    """Bytes; strings may carry a K/M/G/T suffix (binary multiples)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("must be >= 0")
        if value > MAX_SIZE:
            raise ValueError(f"must be at most {MAX_SIZE} bytes (8E), got {value}")
        return value
    match = _SIZE.match(_text(value, "a size like 512M or 20G"))
    if match is None:
        raise ValueError(f"expected a size like 512M or 20G, got {value!r}")
    size = float(match.group(1)) * _SCALE[match.group(2).lower()]
    if not size <= MAX_SIZE:  # inf too: int(inf) raised OverflowError, a traceback
        raise ValueError(f"must be at most {MAX_SIZE} bytes (8E), got {value!r}")
    return int(size)


def as_opt_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and _not_empty(value, "give a number, or none").lower() == "none":
        return None
    return as_int(value)


def as_opt_str(value: object) -> str | None:
    if value is None:
        return None
    text = as_str(value)
    _not_empty(text, "give a value, or leave the setting out for its default")
    return text


def as_key(value: object) -> str | None:
    """A secret the server checks (``api_key``, ``admin_key``): unset (None), or a string of
    something. Found by review: an empty value (``KVWARM_API_KEY=`` from a secret that was
    not filled in) read as unset like any other optional string, and the server then served
    every model with no key at all, silently."""
    if value is None:
        return None
    if not as_str(value).strip():
        raise ValueError(
            "is empty: a key of no characters would let anyone in; give the key, or leave "
            "the setting out to serve without one"
        )
    return str(value)


def as_opt_path(value: object) -> Path | None:
    if value is None:
        return None
    if isinstance(value, Path):
        return value
    text = _not_empty(as_str(value), "give a path, or none to turn it off")
    if text.lower() in ("none", "off"):
        return None
    return Path(os.path.expanduser(text))


def as_tier(value: object) -> TierName | None:
    """A tier's name (``[A-Za-z0-9_]+``); whether such a tier is configured is checked with
    the tiers themselves (``settings/cache.py``)."""
    text = as_opt_str(value)
    if text is None:
        return None
    if not text.isascii() or not text.replace("_", "").isalnum():
        raise ValueError(f"expected a tier name like ram, disk or s3, got {text!r}")
    return text


#: What an empty list value is told (``_not_empty``): a list setting has no word for "none".
_LIST_HINT = "give an entry (a flag each), or leave the setting out"


def as_str_tuple(value: object) -> tuple[str, ...]:
    """One entry (a string: a flag, a variable), or a list of them (repeated flags, TOML). An
    empty string is refused (found by review: ``KVWARM_MEDIA_FORMATS=`` loaded as no format
    at all, every image then refused; the other lists dropped what the config file listed);
    an explicit empty TOML list still says "none"."""
    if isinstance(value, str):
        _not_empty(value, _LIST_HINT)
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(as_str(v) for v in value)
    raise ValueError("expected a string or a list of strings")


_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelSpec)} - {"options"}


_T = TypeVar("_T")


def _table_key(
    item: Mapping[str, object], name: str, number: int, parse: Callable[[object], _T]
) -> _T:
    """Key ``name`` of the ``number``th ``[[models]]`` table, parsed; the error names both."""
    try:
        return parse(item.get(name))
    except ValueError as exc:
        raise ValueError(f"model {number}: {name}: {exc}") from None


def as_models(value: object) -> tuple[ModelSpec, ...]:
    """A comma-separated string of ``[ID=]PATH`` (env), a list of those (flags), or a list of
    tables with path/id/backend/n_ctx/n_parallel and any model setting (TOML)."""
    if isinstance(value, str):
        _not_empty(value, "give [ID=]PATH, or leave the setting out for the default model")
        return tuple(ModelSpec.parse(part) for part in value.split(",") if part.strip())
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of models")
    specs: list[ModelSpec] = []
    for item in value:
        if isinstance(item, str):
            specs.append(ModelSpec.parse(item))
        elif isinstance(item, Mapping):
            # Imported here: settings_model builds on this module's types.
            from kvwarm.settings.model import model_options

            number = len(specs) + 1
            model_id = _table_key(item, "id", number, as_opt_str)
            path = _table_key(item, "path", number, as_opt_str)
            if path is not None and path.strip() == "default":
                # The embedded model, as in ``[ID=]PATH`` (found by review: a file named so).
                path = None
            elif path is None and model_id is not None:
                # Found by review: a table whose path was forgotten served the default model
                # under the id it gave, without a word.
                log.warning(
                    "models[%d] (id %r) names no path: it serves the default model "
                    '($KVWARM_MODEL or the embedded one); write path = "default" to say so',
                    number,
                    model_id,
                )
            extra = {str(k): v for k, v in item.items() if k not in _MODEL_KEYS}
            specs.append(
                ModelSpec(
                    path=path,
                    id=model_id,
                    backend=_table_key(item, "backend", number, as_opt_str),
                    n_ctx=_table_key(item, "n_ctx", number, as_opt_int),
                    n_parallel=_table_key(item, "n_parallel", number, as_opt_int),
                    options=model_options(extra, str(model_id or path or number)),
                )
            )
        elif isinstance(item, ModelSpec):
            specs.append(item)
        else:
            raise ValueError("each model is a string or a table")
    return tuple(specs)


def as_gpu_layers(value: object) -> int:
    """Layers to offload: an integer >= 0, or ``all`` (also -1, llama-cpp-python's spelling)."""
    if isinstance(value, str) and value.strip().lower() in ("all", "max"):
        return -1
    try:
        layers = as_int(value)
    except ValueError:
        layers = -2
    if layers < -1:
        raise ValueError(f"expected a number of layers >= 0 or 'all', got {value!r}")
    return layers


def choice(
    allowed: tuple[str, ...], synonyms: Mapping[str, str] | None = None
) -> Callable[[object], str]:
    """A parser accepting one of ``allowed`` (case-insensitive), or a synonym of one."""

    def parse(value: object) -> str:
        if isinstance(value, bool) and synonyms is not None:
            value = "true" if value else "false"
        text = _text(value, f"one of {', '.join(allowed)}").strip().lower()
        text = (synonyms or {}).get(text, text)
        if text not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {value!r}")
        return text

    return parse


def or_none(parse: Callable[[object], str]) -> Callable[[object], str | None]:
    """``parse``, with None (a default not given) passed through."""

    def parse_or_none(value: object) -> str | None:
        return None if value is None else parse(value)

    return parse_or_none


def opt_choice(allowed: tuple[str, ...]) -> Callable[[object], str | None]:
    """Like ``choice``; ``model`` means None: the model's own value."""
    strict = choice(allowed)

    def parse(value: object) -> str | None:
        if value is None:
            return None
        hint = "give one, or model for the model's own"
        if isinstance(value, str) and _not_empty(value, hint).lower() == "model":
            return None
        return strict(value)

    return parse


def as_float_tuple(value: object) -> tuple[float, ...]:
    """Numbers: ``3,1`` (flags, env) or a TOML list."""
    if isinstance(value, str):
        _not_empty(value, "give shares like 3,1, or leave the setting out")
        parts: list[object] = [p for p in value.replace("/", ",").split(",") if p.strip()]
    elif isinstance(value, list | tuple):
        parts = list(value)
    else:
        raise ValueError("expected numbers separated by commas, e.g. 3,1")
    return tuple(as_float(p) for p in parts)


def as_tensor_split(value: object) -> tuple[float, ...]:
    shares = as_float_tuple(value)
    check_tensor_split(shares)  # a ConfigError is a ValueError: the loader names the source
    return shares


def _split_one(items: tuple[str, ...]) -> tuple[str, ...]:
    """A list setting's one value (a variable, a flag given once) split on commas; refused
    if that leaves nothing (found by review: ``--lora ""`` loaded as no adapter, silently)."""
    if len(items) != 1:
        return items
    split = tuple(i for i in items[0].split(",") if i.strip())
    if not split:
        raise ValueError(f"is empty; {_LIST_HINT}")
    return split


def as_loras(value: object) -> tuple[tuple[str, str], ...]:
    """LoRA adapters as (name, path): ``NAME=PATH`` strings (a flag each, or comma-separated
    in the environment), a list of those, or a TOML table ``{NAME = "PATH"}``. A bare
    ``PATH`` is named after its file (``my-lora.gguf``: ``my-lora``)."""
    if isinstance(value, Mapping):
        pairs = [(as_str(k).strip(), as_str(v).strip()) for k, v in value.items()]
    elif isinstance(value, list | tuple) and all(isinstance(v, list | tuple) for v in value):
        if any(len(v) != 2 for v in value):
            raise ValueError("expected NAME=PATH pairs")
        pairs = [(as_str(v[0]).strip(), as_str(v[1]).strip()) for v in value]
    else:
        items = _split_one(as_str_tuple(value))
        pairs = []
        for item in items:
            name, sep, path = item.partition("=")
            if not sep:
                name, path = Path(item.strip()).stem, item
            pairs.append((name.strip(), path.strip()))
    names = [name for name, _ in pairs]
    for name, path in pairs:
        if not name or not path:
            raise ValueError(f"expected NAME=PATH, got {name!r}={path!r}")
        if names.count(name) > 1:
            raise ValueError(f"LoRA adapter name {name!r} is given twice")
    return tuple(pairs)


def as_aliases(value: object) -> tuple[tuple[str, str], ...]:
    """``ALIAS=MODEL`` pairs: a comma-separated string (env), a list of those (flags), or a
    TOML table ``{ALIAS = "MODEL"}``."""
    pairs: list[tuple[object, object]]
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list | tuple) and all(isinstance(v, list | tuple) for v in value):
        pairs = [tuple(v) for v in value if len(v) == 2]  # already parsed (Settings.replace)
        if len(pairs) != len(value):
            raise ValueError("expected ALIAS=MODEL pairs")
    else:
        items = _split_one(as_str_tuple(value))
        pairs = []
        for item in items:
            alias, sep, target = item.partition("=")
            if not sep:
                raise ValueError(f"expected ALIAS=MODEL, got {item!r}")
            pairs.append((alias, target))
    out: dict[str, str] = {}
    for raw_alias, raw_target in pairs:
        alias, target = as_str(raw_alias).strip(), as_str(raw_target).strip()
        if not alias or not target:
            raise ValueError(f"expected ALIAS=MODEL, got {raw_alias!r}={raw_target!r}")
        if out.get(alias, target) != target:
            raise ValueError(f"alias {alias!r} names two models")
        out[alias] = target
    return tuple(out.items())


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
Key = Annotated[str | None, BeforeValidator(as_key)]
OptPath = Annotated[Path | None, BeforeValidator(as_opt_path)]
OptTier = Annotated[TierName | None, BeforeValidator(as_tier)]
StrTuple = Annotated[tuple[str, ...], BeforeValidator(as_str_tuple), NoDecode]
Models = Annotated[tuple[ModelSpec, ...], BeforeValidator(as_models), NoDecode]
GpuLayers = Annotated[int, BeforeValidator(as_gpu_layers)]
KvTypeName = Annotated[KvType, BeforeValidator(choice(KV_TYPES))]
SplitModeName = Annotated[SplitMode, BeforeValidator(choice(SPLIT_MODES))]
# Booleans too: "flash_attn = true" in TOML, "-fa 1" on the command line.
FlashAttnMode = Annotated[
    FlashAttn,
    BeforeValidator(
        choice(
            FLASH_ATTN_MODES,
            {"true": "on", "1": "on", "yes": "on", "false": "off", "0": "off", "no": "off"},
        )
    ),
]
#: None: not given (``ModelConfig.spec_type``: draft-simple with a draft model, else none).
OptSpecType = Annotated[SpecType | None, BeforeValidator(or_none(choice(SPEC_TYPES)))]
OptRopeScaling = Annotated[RopeScaling | None, BeforeValidator(opt_choice(ROPE_SCALINGS))]
OptPooling = Annotated[PoolingType | None, BeforeValidator(opt_choice(POOLING_TYPES))]
TensorSplit = Annotated[tuple[float, ...], BeforeValidator(as_tensor_split), NoDecode]
Aliases = Annotated[tuple[tuple[str, str], ...], BeforeValidator(as_aliases), NoDecode]
Loras = Annotated[tuple[tuple[str, str], ...], BeforeValidator(as_loras), NoDecode]
Policy = Annotated[PolicyConfig, BeforeValidator(as_policy), NoDecode]
