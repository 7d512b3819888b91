"""Text that enters kvwarm must be encodable as UTF-8.

Invariant: a lone UTF-16 surrogate (JSON ``"\\ud800"`` parses to one) is an
``InvalidRequestError`` naming where it was found, raised wherever text enters: HTTP bodies
(every string, ``find_lone_surrogate``), prompts and chat content at tokenization, stop strings,
grammars and JSON schemas (``encode_utf8``). It is never passed on to become a
``UnicodeEncodeError`` (a 500) when a grammar is compiled or an echo is serialised, and never
silently rewritten: the caller learns which field is wrong.
"""

from __future__ import annotations

import json

from kvwarm.errors import InvalidRequestError


def encode_utf8(text: str, *, param: str | None) -> bytes:
    """``text`` as UTF-8; ``InvalidRequestError`` (naming ``param``) on a lone surrogate, or
    when it is not a ``str`` at all (found by review: ``tokenize(None)`` was AttributeError)."""
    if not isinstance(text, str):
        raise InvalidRequestError(
            f"{param or 'text'} must be a string, not {type(text).__name__}", param=param
        )
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise InvalidRequestError(
            f"{param or 'text'} contains a lone UTF-16 surrogate (U+{code:04X} at index "
            f"{exc.start}); text must be valid Unicode",
            param=param,
        ) from None


#: A path as a linked list (parent, key): building each child's dotted string up front would be
#: quadratic in the nesting depth.
_Path = tuple["_Path", str] | None


def find_lone_surrogate(value: object) -> str | None:
    """The dotted path of a string (key or value) in a JSON-like value that holds a lone
    surrogate (``"body"`` for the top level), or None. Iterative and linear in the size of
    ``value``, so a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[_Path, object]] = [(None, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return _dotted(path)
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not _encodable(key):
                    return _dotted(path)
                stack.append(((path, str(key)), child))
        elif isinstance(item, list | tuple):
            stack.extend(((path, str(i)), child) for i, child in enumerate(item))
    return None


def _dotted(path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(key)
    return ".".join(reversed(parts)) or "body"


def json_text(value: object) -> str:
    """``value`` as JSON text whose characters are written as they are, not as ``\\u``
    escapes (as a model writes them, and a template's ``tojson``), except where that text
    would hold a lone surrogate (a ``\\ud800`` a model or a client wrote in JSON): it stays
    escaped, so the text always encodes as UTF-8."""
    text = json.dumps(value, ensure_ascii=False)
    return text if _encodable(text) else json.dumps(value)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
