"""A GBNF grammar as a Python regular expression, to ask which texts it
accepts without a model: its rules inlined, its literals and classes read as llama.cpp's
parser reads them (``parse_char``'s escapes). A recursive rule is unrolled twice: what needs it
deeper is not accepted."""

from __future__ import annotations

import re

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\", "[": "[", "]": "]", "-": "-"}
_NAME = re.compile(r"[a-zA-Z0-9-]+")


def _char(body: str, i: int) -> tuple[str, int]:
    """The character at ``body[i]`` (an escape read whole) and the index after it."""
    c = body[i]
    if c != "\\":
        return c, i + 1
    e = body[i + 1]
    if e in "xuU":
        width = {"x": 2, "u": 4, "U": 8}[e]
        return chr(int(body[i + 2 : i + 2 + width], 16)), i + 2 + width
    return _ESCAPES[e], i + 2


def _rules(grammar: str) -> dict[str, str]:
    rules: dict[str, str] = {}
    for line in grammar.splitlines():
        if "::=" in line:
            name, body = line.split("::=", 1)
            rules[name.strip()] = body.strip()
    return rules


def _regex(body: str, rules: dict[str, str], seen: tuple[str, ...]) -> str:
    out: list[str] = []
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c.isspace():
            i += 1
        elif c == '"':
            i += 1
            text = []
            while body[i] != '"':
                ch, i = _char(body, i)
                text.append(ch)
            i += 1
            out.append("(?:" + re.escape("".join(text)) + ")")
        elif c == "[":
            i += 1
            negate = body[i] == "^"
            i += negate
            parts = []
            while body[i] != "]":
                lo, i = _char(body, i)
                if body[i] == "-" and body[i + 1] != "]":
                    hi, i = _char(body, i + 1)
                    parts.append(f"\\U{ord(lo):08x}-\\U{ord(hi):08x}")
                else:
                    parts.append(f"\\U{ord(lo):08x}")
            i += 1
            out.append("[" + ("^" if negate else "") + "".join(parts) + "]")
        elif c in "()|*+?":
            out.append("(?:" if c == "(" else c)
            i += 1
        elif c == "{":
            j = body.index("}", i)
            out.append(body[i : j + 1])
            i = j + 1
        else:
            m = _NAME.match(body, i)
            assert m is not None, body[i:]
            name = m.group(0)
            if seen.count(name) >= 2:  # recursive: unrolled twice, then nothing
                out.append("(?!)")
            else:
                out.append("(?:" + _regex(rules[name], rules, (*seen, name)) + ")")
            i = m.end()
    return "".join(out)


def grammar_regex(grammar: str, root: str = "root") -> re.Pattern[str]:
    rules = _rules(grammar)
    return re.compile(_regex(rules[root], rules, (root,)), re.DOTALL)


def accepts(grammar: str, text: str) -> bool:
    return grammar_regex(grammar).fullmatch(text) is not None
