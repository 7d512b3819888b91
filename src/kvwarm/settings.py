"""Server and CLI settings: one ``Settings`` dataclass and one loader.

Invariant: every setting is declared once, in ``_FIELDS``; the command-line flags, the
``KVWARM_*`` environment variables and the TOML config file are all derived from that table, and
``load_settings`` merges them with the precedence flags > environment > file > defaults. Values
are validated here, so a bad setting is a ``ConfigError`` naming its source before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvwarm.backends.base import ContextParams
from kvwarm.cache.types import (
    TIER_NAMES,
    CacheConfig,
    PolicyConfig,
    TierConfig,
    TierName,
)
from kvwarm.embedded import EMBEDDED_MODEL_ID
from kvwarm.engine.fingerprint import MODE_NAMES
from kvwarm.errors import ConfigError

if TYPE_CHECKING:
    from kvwarm.engine.api import ModelConfig

ENV_PREFIX = "KVWARM_"
CONFIG_ENV = "KVWARM_CONFIG"
_GIB = 1 << 30


def user_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/kvwarm``, else ``~/.cache/kvwarm``."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "kvwarm"


def user_config_file(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/kvwarm/config.toml``, else ``~/.config/kvwarm/config.toml``."""
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "kvwarm" / "config.toml"


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
        if self.id:
            return self.id
        if self.path is None:
            return EMBEDDED_MODEL_ID
        name = Path(self.path).name
        return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name

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


# erllama's gates (min_tokens 512, align 2048) suit big models on GPUs. A local CPU server
# pays ~0.3 s to prefill 64 tokens and ~1 ms to restore them, so every chat turn over 64
# tokens is worth a row; cold saves align to the default n_batch so their rows stay canonical.
SERVER_POLICY = PolicyConfig(
    min_tokens=64,
    cold_min_tokens=512,
    continued_interval=512,
    boundary_trim_tokens=32,
    boundary_align_tokens=512,
)


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    models: tuple[ModelSpec, ...] = (ModelSpec(),)
    backend: str = "llama_cpp"
    n_ctx: int = 4096
    n_batch: int = 512
    # Concurrent requests share one context (continuous batching), as llama.cpp's server does.
    n_parallel: int = 4
    n_threads: int | None = None
    deterministic: bool = False
    fingerprint_mode: str = "safe"
    max_queue: int = 256
    # None disables the disk tier (RAM only; nothing survives a restart).
    cache_dir: Path | None = field(default_factory=user_cache_dir)
    disk_quota_bytes: int = 20 * _GIB
    ram_quota_bytes: int = 1 * _GIB
    shm_dir: Path | None = None  # a ram_file tier (e.g. /dev/shm/kvwarm); None: off
    shm_quota_bytes: int = 2 * _GIB
    save_tier: TierName | None = None  # None: disk if enabled, else ram
    policy: PolicyConfig = field(default_factory=lambda: SERVER_POLICY)
    max_body_bytes: int = 8 << 20
    default_max_tokens: int = 512
    # A request asking for more is a 400: one request must not hold a slot for a whole window.
    max_tokens_limit: int = 4096
    keepalive_interval_s: float = 60.0  # 0 disables the keep-alive re-warm
    keepalive_stale_fraction: float = 0.8
    prewarm_system: tuple[str, ...] = ()
    api_key: str | None = None
    log_level: str = "info"

    def effective_save_tier(self) -> TierName:
        if self.save_tier is not None:
            return self.save_tier
        return "disk" if self.cache_dir is not None else "ram"

    def cache_config(self) -> CacheConfig:
        tiers = [TierConfig("ram", self.ram_quota_bytes)]
        if self.shm_dir is not None:
            tiers.append(TierConfig("ram_file", self.shm_quota_bytes, self.shm_dir))
        if self.cache_dir is not None:
            tiers.append(TierConfig("disk", self.disk_quota_bytes, self.cache_dir / "rows"))
        return CacheConfig(tiers=tuple(tiers))

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not self.models:
            raise ConfigError("at least one model is required")
        ids = [m.model_id for m in self.models]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ConfigError(f"duplicate model ids: {', '.join(dupes)} (give each an id)")
        for name in ("n_ctx", "n_batch", "n_parallel", "max_queue", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.default_max_tokens < 0:
            raise ConfigError("default_max_tokens must be >= 0")
        if self.max_tokens_limit < max(1, self.default_max_tokens):
            raise ConfigError("max_tokens_limit must be >= 1 and >= default_max_tokens")
        if self.keepalive_interval_s < 0:
            raise ConfigError("keepalive_interval_s must be >= 0")
        if not 0.0 < self.keepalive_stale_fraction <= 1.0:
            raise ConfigError("keepalive_stale_fraction must be in (0, 1]")
        if self.fingerprint_mode not in MODE_NAMES:
            raise ConfigError(f"fingerprint_mode must be one of {', '.join(MODE_NAMES)}")
        tier = self.effective_save_tier()
        if tier == "disk" and self.cache_dir is None:
            raise ConfigError("save_tier is disk but the disk tier is off (cache_dir none)")
        if tier == "ram_file" and self.shm_dir is None:
            raise ConfigError("save_tier is ram_file but no shm_dir is set")


def model_config(settings: Settings, spec: ModelSpec) -> ModelConfig:
    """The engine's per-model config for ``spec`` under these settings."""
    from kvwarm.engine.api import ModelConfig

    n_parallel = spec.n_parallel or settings.n_parallel
    context = ContextParams(
        n_ctx=spec.n_ctx or settings.n_ctx,
        n_batch=settings.n_batch,
        n_ubatch=min(settings.n_batch, 512),
        n_threads=settings.n_threads,
        n_threads_batch=settings.n_threads,
        n_seq_max=n_parallel,
    )
    return ModelConfig(
        backend=spec.backend,
        context=context,
        n_parallel=n_parallel,
        policy=settings.policy,
        save_tier=settings.effective_save_tier(),
        fingerprint_mode=settings.fingerprint_mode,
        deterministic=settings.deterministic,
        max_queue=settings.max_queue,
    )


# --- value parsers: each takes the raw value from one source and returns the typed value -------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def _as_str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _as_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    return int(_as_str(value).strip())


def _as_float(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    if isinstance(value, int | float):
        return float(value)
    return float(_as_str(value).strip())


def _as_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = _as_str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def _as_size(value: object) -> int:
    """Bytes; strings may carry a K/M/G/T suffix (binary multiples)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("must be >= 0")
        return value
    match = _SIZE.match(_as_str(value))
    if match is None:
        raise ValueError(f"expected a size like 512M or 20G, got {value!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    return int(float(match.group(1)) * scale[match.group(2).lower()])


def _as_opt_int(value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    return _as_int(value)


def _as_opt_str(value: object) -> str | None:
    if value is None:
        return None
    text = _as_str(value)
    return text or None


def _as_opt_path(value: object) -> Path | None:
    if value is None:
        return None
    text = _as_str(value).strip()
    if text.lower() in ("", "none", "off"):
        return None
    return Path(text).expanduser()


def _as_tier(value: object) -> TierName | None:
    text = _as_opt_str(value)
    if text is None:
        return None
    for tier in TIER_NAMES:
        if text == tier:
            return tier
    raise ValueError(f"expected one of {', '.join(TIER_NAMES)}, got {text!r}")


def _as_str_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list | tuple):
        return tuple(_as_str(v) for v in value)
    raise ValueError("expected a string or a list of strings")


def _as_models(value: object) -> tuple[ModelSpec, ...]:
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
            unknown = set(item) - {"path", "id", "backend", "n_ctx", "n_parallel"}
            if unknown:
                raise ValueError(f"unknown model keys: {', '.join(sorted(unknown))}")
            specs.append(
                ModelSpec(
                    path=_as_opt_str(item.get("path")),
                    id=_as_opt_str(item.get("id")),
                    backend=_as_opt_str(item.get("backend")),
                    n_ctx=_as_opt_int(item.get("n_ctx")),
                    n_parallel=_as_opt_int(item.get("n_parallel")),
                )
            )
        elif isinstance(item, ModelSpec):
            specs.append(item)
        else:
            raise ValueError("each model is a string or a table")
    return tuple(specs)


_POLICY_FIELDS = {f.name for f in dataclasses.fields(PolicyConfig)}


def _policy_items(value: object) -> dict[str, int]:
    """A TOML table, or ``KEY=VALUE`` strings (flags)."""
    pairs: dict[str, object]
    if isinstance(value, Mapping):
        pairs = {str(k): v for k, v in value.items()}
    elif isinstance(value, list | tuple):
        pairs = {}
        for item in value:
            name, sep, text = _as_str(item).partition("=")
            if not sep:
                raise ValueError(f"expected KEY=VALUE, got {item!r}")
            pairs[name.strip()] = text.strip()
    else:
        raise ValueError("expected a table of policy values")
    out: dict[str, int] = {}
    for key, raw in pairs.items():
        if key not in _POLICY_FIELDS:
            raise ValueError(f"unknown policy key {key!r} ({', '.join(sorted(_POLICY_FIELDS))})")
        out[key] = _as_int(raw)
    return out


_Parser = Callable[[object], object]

# name -> (parser, help). Flags are ``--name-with-dashes``; env vars ``KVWARM_NAME_UPPER``.
_FIELDS: dict[str, tuple[_Parser, str]] = {
    "host": (_as_str, "address to listen on"),
    "port": (_as_int, "port to listen on (0: any free port)"),
    "models": (_as_models, "a model to serve, [ID=]PATH (repeatable; PATH 'default' = embedded)"),
    "backend": (_as_str, "default backend: llama_cpp or stub"),
    "n_ctx": (_as_int, "context window per model"),
    "n_batch": (_as_int, "prefill batch size (cache rows align to it)"),
    "n_parallel": (_as_int, "concurrent sequences (slots) per model"),
    "n_threads": (_as_opt_int, "CPU threads (default: llama.cpp's choice)"),
    "deterministic": (_as_bool, "restores bit-identical to a cold prefill (slower)"),
    "fingerprint_mode": (_as_str, f"model fingerprint: {', '.join(MODE_NAMES)}"),
    "max_queue": (_as_int, "queued requests per model before 429"),
    "cache_dir": (_as_opt_path, "disk tier directory ('none' disables the disk tier)"),
    "disk_quota_bytes": (_as_size, "disk tier quota, e.g. 20G"),
    "ram_quota_bytes": (_as_size, "RAM tier quota, e.g. 1G"),
    "shm_dir": (_as_opt_path, "ram_file tier directory, e.g. /dev/shm/kvwarm (default off)"),
    "shm_quota_bytes": (_as_size, "ram_file tier quota"),
    "save_tier": (_as_tier, "tier new rows are written to (default: disk if enabled)"),
    "policy": (_policy_items, "cache policy override KEY=VALUE (repeatable), e.g. min_tokens=64"),
    "max_body_bytes": (_as_size, "largest accepted request body"),
    "default_max_tokens": (_as_int, "max_tokens when a request gives none"),
    "max_tokens_limit": (_as_int, "largest max_tokens a request may ask for (more: 400)"),
    "keepalive_interval_s": (_as_float, "seconds between keep-alive re-warms (0: off)"),
    "keepalive_stale_fraction": (_as_float, "re-warm a prewarmed prefix at this share of TTL"),
    "prewarm_system": (_as_str_tuple, "system prompt to prewarm at startup (repeatable)"),
    "api_key": (_as_opt_str, "require this bearer token on every API request"),
    "log_level": (_as_str, "logging level: debug, info, warning, error"),
}
_REPEATABLE = {"models", "policy", "prewarm_system"}
_FLAG_NAMES = {"models": "--model", "policy": "--policy", "prewarm_system": "--prewarm-system"}


def _flag(name: str) -> str:
    return _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def add_settings_arguments(parser: argparse.ArgumentParser, names: Sequence[str] = ()) -> None:
    """Add the flags of ``names`` (all settings if empty). Unset flags stay absent from the
    namespace (``SUPPRESS``) so they never override the environment or the file."""
    group = parser.add_argument_group("settings (flags > KVWARM_* env > config file)")
    group.add_argument(
        "--config", default=argparse.SUPPRESS, metavar="PATH", help=f"TOML file (${CONFIG_ENV})"
    )
    for name in names or _FIELDS:
        _, help_text = _FIELDS[name]
        env = ENV_PREFIX + name.upper()
        if name == "deterministic":
            group.add_argument(
                _flag(name),
                dest=name,
                action="store_const",
                const="true",
                default=argparse.SUPPRESS,
                help=f"{help_text} (${env})",
            )
            continue
        group.add_argument(
            _flag(name),
            dest=name,
            action="append" if name in _REPEATABLE else "store",
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=f"{help_text} (${env})",
        )


def settings_flags(namespace: argparse.Namespace) -> dict[str, object]:
    """The settings given on the command line, as raw values for ``load_settings``."""
    return {k: v for k, v in vars(namespace).items() if k in _FIELDS or k == "config"}


def _read_file(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    # A [kvwarm] table is accepted so the settings can live in a shared file.
    section = data.get("kvwarm", data)
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [kvwarm] must be a table")
    unknown = set(section) - set(_FIELDS) - {"kvwarm"}
    if unknown:
        raise ConfigError(f"config file {path}: unknown settings {', '.join(sorted(unknown))}")
    return {k: v for k, v in section.items() if k in _FIELDS}


def _read_env(env: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    policy: dict[str, object] = {}
    for name in _FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in env:
            out[name] = env[key]
    for key, value in env.items():
        if key.startswith(ENV_PREFIX + "POLICY_"):
            policy[key[len(ENV_PREFIX + "POLICY_") :].lower()] = value
    if policy:
        out["policy"] = policy
    return out


def load_settings(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    base: Settings | None = None,
) -> Settings:
    """Merge flags > environment > config file > ``base`` (default: ``Settings()``).

    The config file is ``flags['config']``, else ``$KVWARM_CONFIG``, else the user config file
    if it exists. Policy values merge key by key across sources.
    """
    flags = dict(flags or {})
    env = os.environ if env is None else env
    explicit = flags.pop("config", None) or env.get(CONFIG_ENV)
    file_values: dict[str, object] = {}
    if explicit:
        file_values = _read_file(Path(str(explicit)).expanduser())
    elif (default_file := user_config_file(env)).is_file():
        file_values = _read_file(default_file)
    defaults = base or Settings(cache_dir=user_cache_dir(env))
    values: dict[str, object] = {}
    policy: dict[str, int] = {}
    sources = (("config file", file_values), ("environment", _read_env(env)), ("flag", flags))
    for source, raw in sources:
        for name, value in raw.items():
            parser, _ = _FIELDS[name]
            label = _flag(name) if source == "flag" else name
            try:
                parsed = parser(value)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{source} setting {label}: {exc}") from exc
            if name == "policy":
                assert isinstance(parsed, dict)
                policy.update(parsed)
            else:
                values[name] = parsed
    if policy:
        values["policy"] = dataclasses.replace(defaults.policy, **policy)
    settings = dataclasses.replace(defaults, **values)  # type: ignore[arg-type]
    settings.validate()
    return settings
