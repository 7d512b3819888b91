"""Command-line flags and environment variable names, derived from a settings class's fields.

Invariant: a setting's flag and environment variable are functions of its field alone (its
name and its ``json_schema_extra``: ``flag``, ``env``, ``aliases``, ``repeatable``,
``switch``, ``negatable``: a ``--no-<name>`` flag besides, setting it false), so a new field
gets both with no code here (``kvwarm.settings``, "Adding a setting"). Unset flags never
reach the parsed namespace, so they never override the environment or the config file.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from pydantic_settings import BaseSettings


def field_extra(cls: type[BaseSettings], name: str) -> dict[str, Any]:
    extra = cls.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


def flag_name(cls: type[BaseSettings], name: str) -> str:
    return str(field_extra(cls, name).get("flag", "--" + name.replace("_", "-")))


def env_name(cls: type[BaseSettings], name: str, prefix: str) -> str:
    return str(field_extra(cls, name).get("env", prefix + name.upper()))


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type[BaseSettings],
    names: Sequence[str],
    *,
    per_model: type[BaseSettings],
    env_prefix: str,
    config_env: str,
    default: Callable[[str], str] | None = None,
) -> None:
    """Add ``--config`` and the flags of ``names`` (fields of ``cls``); those declared by
    ``per_model`` get a group of their own in ``--help``, each with its default as
    ``default(name)`` tells it (found by review: ``--help`` showed no defaults)."""
    group = parser.add_argument_group("settings (flags > KVWARM_* env > config file)")
    group.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        metavar="PATH",
        help=f"TOML file (${config_env}; default: $XDG_CONFIG_HOME/kvwarm/config.toml, else "
        "~/.config/kvwarm/config.toml, if it exists)",
    )
    model_group = parser.add_argument_group(
        "model settings (also per model, as keys of a [[models]] table in the config file)"
    )
    for name in names:
        extra = field_extra(cls, name)
        shown = "" if default is None else f"; default: {default(name)}".replace("%", "%%")
        help_text = (
            f"{cls.model_fields[name].description} (${env_name(cls, name, env_prefix)}{shown})"
        )
        target = model_group if name in per_model.model_fields else group
        flags = (flag_name(cls, name), *extra.get("aliases", ()))
        if extra.get("switch"):  # presence means true
            target.add_argument(
                *flags,
                dest=name,
                action="store_const",
                const="true",
                default=argparse.SUPPRESS,
                help=help_text,
            )
            continue
        if extra.get("negatable"):  # --no-<name>: false, beside --<name> VALUE
            target.add_argument(
                "--no-" + flags[0].removeprefix("--"),
                dest=name,
                action="store_const",
                const="false",
                default=argparse.SUPPRESS,
                help=f"set {flags[0].removeprefix('--')} false",
            )
        target.add_argument(
            *flags,
            dest=name,
            action="append" if extra.get("repeatable") else "store",
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=help_text,
        )
