"""A rule of many string literals, rewritten as a prefix tree: same language, few parse stacks.

llama.cpp's grammar engine keeps one parse stack per alternative it may be in, and checks every
stack against every token of the vocabulary at each step: a JSON schema ``enum`` of 10,000
strings (``root ::= "\\"v0\\"" | "\\"v1\\"" | ...``) is 10,000 stacks that all survive the
leading quote, ~7 s a token on SmolLM2 (100,000 values: minutes). The same strings as a prefix
tree (``root ::= "\\"v" root-1``, ``root-1 ::= "0" root-2 | "1" root-3 | ...``) leave at most
one stack per distinct next character.

Invariants: the rewritten grammar derives exactly the strings the original did (a rule is
rewritten only if its whole body is alternatives of one plain literal each, all of which this
module can decode); new rules take names no rule of the grammar has (``<rule>-f<N>``); a
grammar this module cannot read is returned unchanged (llama.cpp's parser reports it); the work
is linear in the grammar's length and never recurses.
"""

from __future__ import annotations

import bisect
import re

__all__ = ["factor_literal_rules"]

#: Rules with fewer alternatives are left as they are (nothing to gain).
MIN_ALTERNATIVES = 8

_LIT = r'"(?:[^"\\\r\n]|\\.)*"'
# One lexical token of GBNF: a run of literal alternatives ("a" | "b" | ..., one token however
# long, so an enum's body is matched in C), a character class, a comment, a rule head, a name,
# blanks, or any other single character (operators, parentheses).
_TOKEN = re.compile(
    rf"({_LIT}(?:\s*\|\s*{_LIT})*)"  # group 1: literals, one or more, joined by "|"
    r"|\[(?:[^\]\\]|\\.)*\]"  # a character class
    r"|#[^\r\n]*"  # a comment: to the next CR or LF, as llama.cpp's parser reads one
    r"|([A-Za-z0-9_-]+)[ \t]*::="  # a rule head (group 2: its name)
    r"|([A-Za-z0-9_-]+)"  # a name (group 3)
    r"|\s+"
    r"|.",
    re.DOTALL,
)
_LITERAL = re.compile(_LIT, re.DOTALL)
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|(.))", re.DOTALL)
# What a literal cannot hold as itself: quotes, backslashes, brackets, control characters
# (C0, DEL, C1) and lone surrogates (not UTF-8).
_SPECIAL = re.compile(r'["\\\[\]\x00-\x1f\x7f-\x9f\ud800-\udfff]')
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]"}


class _UnreadableError(Exception):
    pass


def _unescape(match: re.Match[str]) -> str:
    hexa = match.group(1) or match.group(2) or match.group(3)
    if hexa is not None:
        code = int(hexa, 16)
        if code > 0x10FFFF:
            raise _UnreadableError
        return chr(code)
    simple = _SIMPLE_ESCAPES.get(match.group(4))
    if simple is None:
        raise _UnreadableError  # llama.cpp refuses an unknown escape
    return simple


def _decode(run: str) -> list[str]:
    """The strings of a run of literal alternatives, as llama.cpp reads them."""
    values = []
    for token in _LITERAL.findall(run):
        body = token[1:-1]
        if "\\" in body:
            if body.count("\\") == body.count('\\"'):
                body = body.replace('\\"', '"')  # only quotes escaped (a JSON enum's strings)
            else:
                body = _ESCAPE.sub(_unescape, body)
        values.append(body)
    return values


def _encode(value: str) -> str:
    """``value`` as a GBNF literal llama.cpp decodes back to the same code points."""
    if _SPECIAL.search(value) is None:
        return '"' + value + '"'
    parts = ['"']
    for ch in value:
        code = ord(ch)
        if ch in '"\\[]':
            parts.append("\\" + ch)
        elif code < 0x20 or 0x7F <= code < 0xA0 or 0xD800 <= code < 0xE000:
            parts.append(f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}")
        else:
            parts.append(ch)
    parts.append('"')
    return "".join(parts)


def _literal_rules(text: str, names: set[str]) -> list[tuple[str, int, int, str]] | None:
    """Every rule whose whole body is one run of literal alternatives, as (name, head start,
    body end, the run); every name ``text`` uses added to ``names``. None if ``text`` does not
    start with a rule head."""
    found: list[tuple[str, int, int, str]] = []
    name: str | None = None
    start = 0
    run: str | None = None
    plain = False  # the rule at hand has had nothing but one run so far
    for match in _TOKEN.finditer(text):
        if match.group(2) is not None:
            if name is not None and plain and run is not None:
                found.append((name, start, match.start(), run))
            name, start, run, plain = match.group(2), match.start(), None, True
            names.add(name)
            continue
        token = match.group(0)
        if token[0] in " \t\r\n#":
            continue
        if name is None:
            return None
        if match.group(1) is not None and run is None:
            run = token
            continue
        if match.group(3) is not None:
            names.add(token)
        plain = False
    if name is not None and plain and run is not None:
        found.append((name, start, len(text), run))
    return found


def _prefix_tree(name: str, values: list[str], taken: set[str]) -> tuple[list[str], int]:
    """GBNF rules deriving exactly ``values``, as a prefix tree (``name`` first, then helper
    rules of fresh names), and the most alternatives any of them opens at once. Built over
    the sorted values: a node is a range of them sharing a prefix, its children found by
    bisection, never by recursion."""
    values = sorted(set(values))
    counter = 0

    def fresh() -> str:
        nonlocal counter
        while True:
            counter += 1
            candidate = f"{name}-f{counter}"
            if candidate not in taken:
                taken.add(candidate)
                return candidate

    lines: list[str] = []
    widest = 0
    todo: list[tuple[str, int, int, int]] = [(name, 0, len(values), 0)]  # rule, lo, hi, depth
    while todo:
        rule, lo, hi, depth = todo.pop()
        final = len(values[lo]) == depth  # sorted: the string ending here comes first
        if final:
            lo += 1
        alternatives: list[str] = []
        i = lo
        while i < hi:
            head = values[i][: depth + 1]
            last = head[-1]
            if ord(last) < 0x10FFFF:
                j = bisect.bisect_left(values, head[:-1] + chr(ord(last) + 1), i, hi)
            else:
                j = hi
            first, end = values[i], depth + 1
            if j - i == 1:
                end = len(first)  # one string: the rest of it
            else:
                other = values[j - 1]
                while end < len(first) and end < len(other) and first[end] == other[end]:
                    end += 1
            piece = _encode(first[depth:end])
            if j - i > 1:
                helper = fresh()
                todo.append((helper, i, j, end))
                piece += " " + helper
            alternatives.append(piece)
            i = j
        widest = max(widest, len(alternatives) + (1 if final and alternatives else 0))
        body = " | ".join(alternatives)
        if final:
            body = f"( {body} )?" if alternatives else '""'
        lines.append(f"{rule} ::= {body}")
    return lines, widest


def factor_literal_rules(text: str, min_alternatives: int = MIN_ALTERNATIVES) -> str:
    """``text`` with each rule made of at least ``min_alternatives`` plain string literals
    (and nothing else) rewritten as a prefix tree of rules, where that lowers the number of
    alternatives llama.cpp opens at once; every other rule, comments and order kept."""
    taken: set[str] = set()
    try:
        rules = _literal_rules(text, taken)
        if not rules:
            return text
        out: list[str] = []
        last = 0
        for name, start, end, run in rules:
            values = _decode(run)
            if len(values) < min_alternatives:
                continue
            lines, widest = _prefix_tree(name, values, taken)
            if widest >= len(values):
                continue  # no two share a first character: nothing to gain
            out.append(text[last:start])
            out.append("\n".join(lines) + "\n")
            last = end
    except _UnreadableError:
        return text
    if not out:
        return text
    out.append(text[last:])
    return "".join(out)
