"""Rendering a model's Jinja chat template, sandboxed.

Invariant: templates come from model files (untrusted), so they run in jinja2's
``ImmutableSandboxedEnvironment`` with the same globals HF/llama-cpp-python templates expect
(``raise_exception``, ``strftime_now``, ``bos_token``, ``eos_token``, ``tools``,
``add_generation_prompt``). Every failure — syntax, ``raise_exception``, sandbox violation,
undefined access — becomes ``InvalidRequestError``; nothing else escapes.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Mapping, Sequence
from typing import NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvwarm.errors import InvalidRequestError

_ENV_LOCK = threading.Lock()
_ENV: ImmutableSandboxedEnvironment | None = None
# Compiled templates keyed by source; a model has one or two, so this stays tiny.
_COMPILED: dict[str, jinja2.Template] = {}
_MAX_COMPILED = 64


class TemplateRaisedError(Exception):
    """``raise_exception(...)`` was called by the template."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaisedError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    # One shared immutable environment, built lazily on first use.
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENV = env
    return _ENV


def _compile(source: str) -> jinja2.Template:
    with _ENV_LOCK:
        template = _COMPILED.get(source)
        if template is None:
            template = _environment().from_string(source)
            if len(_COMPILED) >= _MAX_COMPILED:
                _COMPILED.clear()
            _COMPILED[source] = template
        return template


def render_chat(
    source: str,
    messages: Sequence[Mapping[str, object]],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, object]] | None = None,
) -> str:
    """Render ``messages`` with the Jinja template ``source``."""
    try:
        template = _compile(source)
        return template.render(
            messages=[dict(m) for m in messages],
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            tools=[dict(t) for t in tools] if tools else None,
        )
    except TemplateRaisedError as exc:
        raise InvalidRequestError(
            f"chat template refused the messages: {exc}", param="messages"
        ) from exc
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        # Templates index into messages freely; malformed messages surface as these.
        raise InvalidRequestError(
            f"chat template failed on these messages: {exc!r}", param="messages"
        ) from exc
