"""Where settings come from, besides flags: the TOML config file, the environment, the user's
XDG directories.

Invariant: each reader returns raw values keyed by setting name, for settings the class
declares; nothing is parsed here (``kvwarm.settings`` parses each value alone, so an error
names its source). An unknown key in the config file is a ``ConfigError``; unrelated
environment variables are ignored.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

from pydantic_settings import BaseSettings, EnvSettingsSource

from kvwarm.errors import ConfigError


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


def read_toml(path: Path, known: set[str]) -> dict[str, object]:
    """The settings in a TOML file, at top level or under a ``[kvwarm]`` table."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    # A [kvwarm] table is accepted so the settings can live in a shared file; other tools' keys
    # beside it are theirs. A kvwarm setting beside it would be silently ignored: TOML puts a
    # [[models]] written after [kvwarm] at the top level ([[kvwarm.models]] is inside it).
    section = data.get("kvwarm", data)
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [kvwarm] must be a table")
    if section is not data:
        outside = sorted(set(data) & known)
        if outside:
            raise ConfigError(
                f"config file {path}: {', '.join(outside)} outside the [kvwarm] table would be "
                "ignored; move them into it (models as [[kvwarm.models]])"
            )
    unknown = set(section) - known - {"kvwarm"}
    if unknown:
        raise ConfigError(f"config file {path}: unknown settings {', '.join(sorted(unknown))}")
    return {k: v for k, v in section.items() if k in known}


class _MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source (the class's ``env_prefix``, case-insensitive
    names) over a given mapping instead of ``os.environ``, so callers and tests can pass one."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._env = env
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k.lower(): v for k, v in self._env.items()}


def read_env(
    env: Mapping[str, str], settings_cls: type[BaseSettings], prefix: str
) -> dict[str, object]:
    """``<PREFIX><NAME>`` for every setting, plus ``<PREFIX>POLICY_<KEY>`` (one policy value
    each, gathered as a table under ``policy``)."""
    out: dict[str, object] = dict(_MappingEnvSource(settings_cls, env)())
    policy_prefix = prefix + "POLICY_"
    policy = {
        k[len(policy_prefix) :].lower(): v for k, v in env.items() if k.startswith(policy_prefix)
    }
    if policy:
        out["policy"] = policy
    return out
