"""Where settings come from, besides flags: the TOML config file, the environment, the user's
XDG directories.

Invariant: each reader returns raw values keyed by setting name, for settings the class
declares; nothing is parsed here (``kvwarm.settings`` parses each value alone, so an error
names its source). An unknown key in the config file is a ``ConfigError``; so is a
``KVWARM_*`` variable that is a setting's name misspelled (``unknown_env``), and any other
``KVWARM_*`` variable kvwarm does not read is logged: a typo never silently does nothing.
Variables without the prefix are other programs'.
"""

from __future__ import annotations

import difflib
import logging
import os
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path

from pydantic_settings import BaseSettings, EnvSettingsSource

from kvwarm.errors import ConfigError

log = logging.getLogger(__name__)

#: ``KVWARM_*`` variables read elsewhere than the settings: the default model, the stub
#: backend's delays (``kvwarm.backends.stub``), the test suite's (``docs/operations.md``,
#: with every ``KVWARM_TEST_*``).
OTHER_ENV = frozenset(
    (
        "KVWARM_MODEL",
        "KVWARM_STUB_PREFILL_DELAY_S",
        "KVWARM_STUB_DECODE_DELAY_S",
        "KVWARM_GEMMA",
        "KVWARM_LLAMA_SERVER",
        "KVWARM_CHROMIUM",
    )
)


def user_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/kvwarm``, else ``~/.cache/kvwarm``."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.path.expanduser(base)) / "kvwarm"


def user_config_file(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/kvwarm/config.toml``, else ``~/.config/kvwarm/config.toml``."""
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(os.path.expanduser(base)) / "kvwarm" / "config.toml"


def read_toml(path: Path, known: set[str]) -> dict[str, object]:
    """The settings in a TOML file, at top level or under a ``[kvwarm]`` table."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        # tomllib decodes the whole file before parsing it, and lets this escape: a config
        # file saved as Latin-1, or a model given as --config by mistake, was a traceback
        # (found by review).
        raise ConfigError(
            f"config file {path} is not valid TOML: it is not UTF-8 text (byte 0x"
            f"{exc.object[exc.start]:02x} at offset {exc.start}); TOML files are UTF-8"
        ) from exc
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
    unknown = set(section) - known
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


def unknown_env(
    env: Mapping[str, str],
    known: Collection[str],
    prefix: str,
    meant: Mapping[str, str] | None = None,
) -> None:
    """Refuse a ``<PREFIX>*`` variable that names no setting but is close to one (a typo:
    ``KVWARM_N_CTXX``), or is in ``meant`` (another spelling of a setting's variable: a flag's
    name, ``KVWARM_CACHE_TYPE_K`` for ``KVWARM_TYPE_K``), and log any other that kvwarm does
    not read. ``known``: the settings' variables, upper case; ``<PREFIX>POLICY_<KEY>`` is
    checked with the policy."""
    names = set(known) | OTHER_ENV
    for var in sorted(env):
        name = var.upper()
        if not name.startswith(prefix) or name in names:
            continue
        if name.startswith((prefix + "POLICY_", prefix + "TEST_")):
            continue
        if name == prefix + "POLICY":
            # Found by review: logged as ignored, then read as the policy table it cannot be
            # ("expected a table of policy values"), with no word of the variables that are.
            raise ConfigError(
                f"environment variable {var} is not a kvwarm setting; give each policy value "
                f"as {prefix}POLICY_<KEY> ({prefix}POLICY_MIN_TOKENS=64)"
            )
        if meant and name in meant:
            raise ConfigError(
                f"environment variable {var} is not a kvwarm setting; did you mean {meant[name]}?"
            )
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.85)
        if close:
            raise ConfigError(
                f"environment variable {var} is not a kvwarm setting; did you mean {close[0]}?"
            )
        log.warning("environment variable %s is not a kvwarm setting; ignored", var)
