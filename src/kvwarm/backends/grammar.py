"""JSON schema → GBNF, through the converter llama-cpp-python ships.

Invariant: never loads ``libllama`` — ``llama_cpp/llama_grammar.py`` uses only the standard
library, so it is loaded from its file without executing ``llama_cpp/__init__`` (which would
dlopen the native library). Cache-only and stub processes can therefore convert schemas too.
Every failure, including malformed JSON and unsupported ``$ref``s, is a ``GrammarError``;
remote ``$ref``s are never fetched.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import cast

from kvwarm.errors import GrammarError

_MODULE_NAME = "kvwarm.backends._llama_grammar"
#: The converter writes one grammar item per required repeat and one nested group per optional
#: one: ``{"type": "string", "minLength": 1000000}`` (100 bytes) became a 5 MB grammar after
#: seconds of CPU. No reply of a few thousand tokens needs more; nesting is bounded further by
#: ``grammar_cost.MAX_GRAMMAR_DEPTH``.
MAX_SCHEMA_REPEATS = 10_000
_REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems")


def _check_repeats(schema: object) -> None:
    """``GrammarError`` for a repeat bound past ``MAX_SCHEMA_REPEATS`` anywhere in
    ``schema`` (walked without recursion)."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key in _REPEAT_KEYS:
                bound = node.get(key)
                if isinstance(bound, int | float) and bound > MAX_SCHEMA_REPEATS:
                    raise GrammarError(
                        f"JSON schema {key} {bound} is more than the {MAX_SCHEMA_REPEATS} "
                        "repeats a grammar is built for",
                        param="json_schema",
                    )
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)


def _check_patterns(schema: object) -> None:
    """``GrammarError`` for a ``pattern`` the converter cannot read (walked without
    recursion). It tokenizes a pattern as ``_pattern_problem`` does, and looped for ever on a
    ``]`` or ``}`` outside a class or a quantifier (``^a]$``; ``^[^]]$``, whose class it closes
    at the first ``]``), pinning a thread and a core per request (found by review); a
    quantifier builds one grammar item per repeat, so it is bounded as ``minLength`` is.
    Every ``pattern`` string is checked, even one inside a ``const`` value: a map of
    properties may name one ``const``, so data cannot be told from schemas by key here."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str) and (problem := _pattern_problem(pattern)) is not None:
                raise GrammarError(
                    f"JSON schema pattern {pattern[:80]!r}: {problem}", param="json_schema"
                )
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)


def _pattern_problem(pattern: str) -> str | None:
    """Why the converter cannot read ``pattern`` (its own tokenizing: an escape is two
    characters, a class runs to the first unescaped ``]``, a quantifier to the first ``}``),
    or None; what it refuses itself (unbalanced groups, ...) is left to it."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
        elif c == "[":
            i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif c == "{":
            end = pattern.find("}", i)
            if end < 0:
                return None
            for part in pattern[i + 1 : end].split(","):
                bound = part.strip()
                if bound.isascii() and bound.isdigit() and int(bound) > MAX_SCHEMA_REPEATS:
                    return (
                        f"a quantifier of {bound} is more than the {MAX_SCHEMA_REPEATS} "
                        "repeats a grammar is built for"
                    )
            i = end + 1
        elif c in "]}":
            return f"an unmatched {c!r} at {i} (write \\{c} for the character itself)"
        else:
            i += 1
    return None


@functools.cache
def _converter_module() -> ModuleType:
    spec = importlib.util.find_spec("llama_cpp")
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise GrammarError("llama-cpp-python is not installed; cannot convert JSON schemas")
    for location in locations:
        path = Path(location) / "llama_grammar.py"
        if path.is_file():
            file_spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
            if file_spec is None or file_spec.loader is None:
                break
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[_MODULE_NAME] = module
            file_spec.loader.exec_module(module)
            _fix_literal_escapes(module)
            return module
    raise GrammarError("llama-cpp-python ships no llama_grammar.py; cannot convert JSON schemas")


def _dumps_unicode(value: object, **kwargs: object) -> str:
    return json.dumps(value, ensure_ascii=False, **kwargs)  # type: ignore[arg-type]


def _fix_literal_escapes(module: ModuleType) -> None:
    """The converter writes a ``const``/``enum`` value or a property name as the GBNF literal
    of its JSON text, escaping ``"``, CR and LF but not the backslash that JSON text holds
    for every ``"``, ``\\`` and control character: ``say "hi"`` ended the literal early (a
    grammar refused, or a crafted value's own grammar), ``C:\\dir`` forced invalid JSON with
    a lone backslash (found by review). Escape the backslash too, as llama.cpp's own
    converters do, and write non-ASCII characters as themselves rather than ``\\u`` escapes
    a model would have to spell out (llama-server's converter does the same)."""
    setattr(module, "GRAMMAR_LITERAL_ESCAPE_RE", re.compile(r'[\r\n"\\]'))  # noqa: B010
    escapes = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
    setattr(module, "GRAMMAR_LITERAL_ESCAPES", escapes)  # noqa: B010
    # Only the converter's own ``json.dumps`` calls (values and property names) see this.
    setattr(module, "json", SimpleNamespace(loads=json.loads, dumps=_dumps_unicode))  # noqa: B010


def schema_to_gbnf(schema: Mapping[str, object] | str) -> str:
    """GBNF whose language is the JSON documents valid under ``schema``."""
    try:
        text = schema if isinstance(schema, str) else json.dumps(dict(schema))
    except RecursionError as exc:
        raise GrammarError("JSON schema nests too deeply", param="json_schema") from exc
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"JSON schema is not serialisable: {exc}", param="json_schema") from exc
    try:
        parsed: object = json.loads(text) if isinstance(schema, str) else schema
    except (ValueError, RecursionError):
        parsed = None  # the converter says what is wrong with it
    _check_repeats(parsed)
    _check_patterns(parsed)
    convert = cast(Callable[[str], object], _converter_module().json_schema_to_gbnf)
    try:
        grammar = convert(text)
    except RecursionError as exc:
        raise GrammarError("JSON schema nests too deeply", param="json_schema") from exc
    except Exception as exc:  # the third-party converter raises assorted types
        raise GrammarError(f"unsupported JSON schema: {exc}", param="json_schema") from exc
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError("JSON schema produced an empty grammar", param="json_schema")
    return grammar
