"""Rendering a model's Jinja chat template, sandboxed.

Invariant: templates come from model files (untrusted), so they run in jinja2's
``ImmutableSandboxedEnvironment`` with the same globals HF/llama-cpp-python templates expect
(``raise_exception``, ``strftime_now``, ``bos_token``, ``eos_token``, ``tools``,
``add_generation_prompt``) and the same environment as Hugging Face's renderer, the reference
templates are written for: its ``tojson`` (``json.dumps``: keys in their order, no HTML
escaping; jinja2's own sorts keys and writes ``it's <b>`` as ``it\u0027s \u003cb\u003e``, and
its result, being ``Markup``, escaped what a template joined to it: found by review), loop
controls (``{% break %}``, ``{% continue %}``) and ``{% generation %}`` blocks (rendered as
their body). Every failure — syntax, ``raise_exception``, sandbox violation,
undefined access, arithmetic, recursion — becomes ``InvalidRequestError``; nothing else
escapes. The sandbox keeps a template from files, private attributes and code, and refuses
one ``range`` past 100,000 items; it bounds no render's time or memory (nested loops,
``'x' * 10**9``), so a model's template is trusted not to spend them.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.parser import Parser
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


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's ``tojson`` filter, option for option."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: Hugging Face marks the assistant's text with
    it (for training masks); a prompt is its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance attribute)

    def parse(self, parser: Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    # One shared immutable environment, built lazily on first use.
    global _ENV
    if _ENV is None:
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _Generation],
        )
        env.filters["tojson"] = _tojson
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
    except (ArithmeticError, RecursionError) as exc:
        # A division by zero, the sandbox's refusal of a range past MAX_RANGE (an
        # OverflowError), a macro recursing without end or source nested too deep to compile.
        raise InvalidRequestError(f"chat template failed: {exc!r}", param="messages") from exc


# --- Built-in templates: for a GGUF that carries none, or a user who names one -----------------
#
# llama-server falls back to chatml and takes ``--chat-template NAME|FILE``; so does kvwarm.
# Each renders every string content verbatim (no trim, no split), so the engine's sentinel
# tokenization (engine/prompts.py) keeps turn N's tokens a prefix of turn N+1's.

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's turn format; the system prompt opens the first user turn, as Gemma's own template.
GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content']"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content']"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] in ('user', 'system') %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML,
    "gemma": GEMMA,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
}
FALLBACK_TEMPLATE = "chatml"


def resolve_template(value: str) -> tuple[str, str]:
    """(name, Jinja source) of ``--chat-template``: a built-in name, or a Jinja file's path
    (named ``file:<first 12 hex of its sha256>``). ``ConfigError`` otherwise."""
    import hashlib
    from pathlib import Path

    from kvwarm.errors import ConfigError

    if value in BUILTIN_TEMPLATES:
        return value, BUILTIN_TEMPLATES[value]
    path = Path(os.path.expanduser(value))
    if not path.is_file():
        names = ", ".join(sorted(BUILTIN_TEMPLATES))
        raise ConfigError(
            f"chat_template {value!r} is neither a built-in template ({names}) nor a file"
        )
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"chat_template {value!r} cannot be read: {exc}") from exc
    try:
        _compile(source)
    except (jinja2.TemplateError, RecursionError) as exc:
        raise ConfigError(f"chat_template {value!r} is not a valid Jinja template: {exc}") from exc
    return f"file:{hashlib.sha256(source.encode()).hexdigest()[:12]}", source
