"""A JSON schema ``pattern`` as GBNF over the string's JSON text.

A ``pattern`` constrains a string's *value*; the model writes its JSON *text*, where ``"``,
``\\`` and the control characters are escaped. llama-cpp-python's converter (and llama-server's,
the same code in C++) translates the pattern character for character, so its grammar let the
model write a raw ``"`` (``.`` and every negated class matched one, a literal ``"`` became
one), a lone backslash or a raw newline: invalid JSON, or a string ended early (found by
review). Here every character set the pattern names becomes the JSON text of its characters:
the ones JSON writes as themselves as a class, and ``"``, ``\\`` and the control characters as
their escapes, spelt as ``json.dumps`` spells them.

Supported (ECMA-262, as JSON Schema reads a pattern): literals; the escapes ``\\d \\D \\w \\W \\s
\\S \\n \\r \\t \\f \\v \\0 \\xHH \\uHHHH`` and an escaped punctuation character; classes with
ranges, negation and those escapes; ``.`` (any character but a line terminator); groups ``( )``
and ``(?: )``; ``|``; the quantifiers ``* + ? {m} {m,} {m,n}`` (a lazy ``?`` after one changes
nothing here). A pattern is a search, as JSON Schema says: a side not anchored by ``^`` or
``$`` may have any text there (``"b"`` matches ``"abc"``); an anchor anywhere else is refused.
Everything else (lookarounds, backreferences, ``\\b``, named groups) is a ``GrammarError``
naming it: a 400, never a pattern accepted and not enforced.

Invariant: pure (imports only ``kvwarm.errors``); the rules it adds go through the caller's
``add_rule``, so their names never collide with the converter's.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from kvwarm.errors import GrammarError

__all__ = ["MAX_PATTERN_DEPTH", "pattern_rule"]

#: Groups nested deeper than this are refused (llama.cpp's converter stops at the same depth).
MAX_PATTERN_DEPTH = 100

Ranges = list[tuple[int, int]]
_MAX = 0x10FFFF
_SURROGATES: Ranges = [(0xD800, 0xDFFF)]  # no UTF-8 text holds one
#: What JSON text never holds as itself inside a string: control characters, ``"`` and ``\\``.
_ESCAPED: Ranges = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Ranges = [
    (0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
    (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF),
]  # fmt: skip
_LINE_ENDS: Ranges = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_SINGLE = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}
_SETS = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_QUANTIFIERS = "*+?{"


def _norm(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out: Ranges = []
    start = 0
    for lo, hi in _norm(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX:
        out.append((start, _MAX))
    return out


def _minus(ranges: Ranges, away: Ranges) -> Ranges:
    keep = _complement(away)
    out = [
        (max(lo, klo), min(hi, khi))
        for lo, hi in _norm(ranges)
        for klo, khi in keep
        if max(lo, klo) <= min(hi, khi)
    ]
    return _norm(out)


def _literal(text: str) -> str:
    """A GBNF string literal matching exactly ``text``."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02X}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _class_char(cp: int) -> str:
    if cp < 0x80 and chr(cp).isalnum():
        return chr(cp)
    if cp <= 0xFF:
        return f"\\x{cp:02X}"
    if cp <= 0xFFFF:
        return f"\\u{cp:04X}"
    return f"\\U{cp:08X}"


def _class(ranges: Ranges) -> str:
    body = "".join(
        _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}" for lo, hi in ranges
    )
    return f"[{body}]"


#: The escapes JSON spells with one letter after the backslash.
_SHORT = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}


def _escapes(cps: list[int]) -> str:
    """What follows the backslash in the JSON escapes of ``cps`` (each ``"``, ``\\`` or a control
    character), as ``json.dumps`` spells them: one letter, else ``u00`` and two hex digits."""
    parts = []
    short = [_SHORT[cp] for cp in cps if cp in _SHORT]
    if short:
        parts.append(_class(_norm([(ord(c), ord(c)) for c in short])))
    long = [cp for cp in cps if cp not in _SHORT]
    groups = []
    for high in (0, 1):
        lows = "".join("0123456789abcdef"[cp & 0xF] for cp in long if cp >> 4 == high)
        if lows:
            groups.append(f'"{high}" [{lows}]')
    if groups:
        parts.append('"u00" ' + (groups[0] if len(groups) == 1 else "(" + " | ".join(groups) + ")"))
    return parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"


def _json_text(cp: int) -> str:
    """The JSON text of one character inside a string (``json.dumps``'s spelling)."""
    return json.dumps(chr(cp))[1:-1] if cp < 0x80 else chr(cp)


class _Item:
    """One parsed piece: its GBNF, and its JSON text where it is a fixed string (mergeable)."""

    __slots__ = ("gbnf", "text")

    def __init__(self, gbnf: str, text: str | None = None) -> None:
        self.gbnf = gbnf
        self.text = text


class _Pattern:
    def __init__(self, pattern: str, max_repeats: int) -> None:
        self.p = pattern
        self.i = 0
        self.max_repeats = max_repeats

    def fail(self, why: str) -> GrammarError:
        return GrammarError(
            f"JSON schema pattern {self.p[:80]!r}: {why} (at {self.i})", param="json_schema"
        )

    # ---- character sets ------------------------------------------------------------------

    def chars(self, ranges: Ranges) -> _Item:
        """Any one of the characters ``ranges`` as JSON text."""
        ranges = _minus(ranges, _SURROGATES)
        if not ranges:
            raise self.fail("a class that matches no character")
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            text = _json_text(ranges[0][0])
            return _Item(_literal(text), text)
        alts = []
        plain = _minus(ranges, _ESCAPED)
        if plain:
            alts.append(_class(plain))
        escaped = [
            cp for lo, hi in _minus(ranges, _complement(_ESCAPED)) for cp in range(lo, hi + 1)
        ]
        if escaped:
            alts.append('"\\\\" ' + _escapes(escaped))
        return _Item(alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")")

    def escape(self, in_class: bool) -> Ranges:
        """The characters the escape at ``self.i`` (after its backslash) names."""
        if self.i >= len(self.p):
            raise self.fail("a trailing backslash")
        c = self.p[self.i]
        self.i += 1
        if c.lower() in _SETS:
            ranges = _SETS[c.lower()]
            return _complement(ranges) if c.isupper() else ranges
        if c in _SINGLE:
            if c == "0" and self.i < len(self.p) and self.p[self.i].isdigit():
                raise self.fail("an octal escape")
            return [(_SINGLE[c], _SINGLE[c])]
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = self.p[self.i : self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"\\{c} needs {width} hex digits")
            self.i += width
            cp = int(digits, 16)
            return [(cp, cp)]
        if c == "b" and in_class:
            return [(0x08, 0x08)]
        if c.isascii() and not c.isalnum():
            return [(ord(c), ord(c))]
        raise self.fail(f"the escape \\{c} is not supported")

    def klass(self) -> Ranges:
        """A class after its ``[``, up to and past its ``]``."""
        negate = self.p.startswith("^", self.i)
        if negate:
            self.i += 1
        if self.p.startswith("]", self.i):
            raise self.fail("an empty class or a ']' first in one (write \\] for the character)")
        ranges: Ranges = []
        while True:
            if self.i >= len(self.p):
                raise self.fail("an unterminated class")
            c = self.p[self.i]
            if c == "]":
                self.i += 1
                break
            lo = self.class_atom()
            if self.p.startswith("-", self.i) and not self.p.startswith("-]", self.i):
                self.i += 1
                hi = self.class_atom()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise self.fail("a range whose end is a class")
                if lo[0][0] > hi[0][0]:
                    raise self.fail("a range out of order")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        return _complement(ranges) if negate else _norm(ranges)

    def class_atom(self) -> Ranges:
        c = self.p[self.i]
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        if c == "[":
            raise self.fail("a '[' inside a class (write \\[)")
        return [(ord(c), ord(c))]

    # ---- structure -----------------------------------------------------------------------

    def alternation(self, depth: int) -> list[list[_Item]]:
        if depth > MAX_PATTERN_DEPTH:
            raise self.fail(f"groups nested more than {MAX_PATTERN_DEPTH} deep")
        alts = [self.sequence(depth)]
        while self.p.startswith("|", self.i):
            self.i += 1
            alts.append(self.sequence(depth))
        return alts

    def sequence(self, depth: int, top: bool = False) -> list[_Item]:
        """Items up to a ``|`` or ``)`` (and, at the top, a ``$`` ending an alternative)."""
        items: list[_Item] = []
        while self.i < len(self.p) and self.p[self.i] not in "|)":
            if top and self.p[self.i] == "$" and self.p[self.i + 1 : self.i + 2] in ("", "|"):
                break
            atom = self.atom(depth)
            if atom is None:
                continue
            items.append(self.quantified(atom))
        return items

    def atom(self, depth: int) -> _Item | None:
        c = self.p[self.i]
        self.i += 1
        if c == "\\":
            return self.chars(self.escape(in_class=False))
        if c == "[":
            return self.chars(self.klass())
        if c == ".":
            return self.chars(_complement(_LINE_ENDS))
        if c == "(":
            if self.p.startswith("?", self.i):
                if not self.p.startswith("?:", self.i):
                    raise self.fail("lookarounds and named groups are not supported")
                self.i += 2
            alts = self.alternation(depth + 1)
            if not self.p.startswith(")", self.i):
                raise self.fail("an unbalanced '('")
            self.i += 1
            body = _join_alternatives(alts)
            return None if body is None else _Item(f"({body})")
        if c in "^$":
            raise self.fail(f"an anchor {c!r} inside the pattern")
        if c in _QUANTIFIERS:
            raise self.fail(f"{c!r} with nothing to repeat")
        if c in "]}":
            raise self.fail(f"an unmatched {c!r} (write \\{c} for the character)")
        return self.chars([(ord(c), ord(c))])

    def quantified(self, atom: _Item) -> _Item:
        if self.i >= len(self.p) or self.p[self.i] not in _QUANTIFIERS:
            return atom
        c = self.p[self.i]
        if c == "{":
            end = self.p.find("}", self.i)
            body = self.p[self.i + 1 : end] if end > 0 else ""
            lo, comma, hi = body.partition(",")
            if end < 0 or not (lo.strip().isdigit() or (comma and hi.strip().isdigit())):
                raise self.fail("a '{' that is not a quantifier (write \\{ for the character)")
            low = int(lo) if lo.strip() else 0
            high = (int(hi) if hi.strip() else None) if comma else low
            if max(low, high or 0) > self.max_repeats:
                raise self.fail(
                    f"a quantifier past the {self.max_repeats} repeats a grammar is built for"
                )
            if high is not None and high < low:
                raise self.fail("a quantifier out of order")
            self.i = end + 1
            suffix = f"{{{low}}}" if high == low else f"{{{low},{'' if high is None else high}}}"
        else:
            self.i += 1
            suffix = c
        if self.p.startswith("?", self.i):
            self.i += 1  # lazy: the same strings
        if self.i < len(self.p) and self.p[self.i] in "*+{":
            raise self.fail("a quantifier after a quantifier")
        gbnf = atom.gbnf if atom.text is None or len(atom.text) <= 1 else f"({atom.gbnf})"
        return _Item(gbnf + suffix)


def _join_sequence(items: list[_Item]) -> str:
    """The items in order, runs of fixed text merged into one literal."""
    out: list[str] = []
    run: list[str] = []
    for item in items:
        if item.text is not None:
            run.append(item.text)
            continue
        if run:
            out.append(_literal("".join(run)))
            run = []
        out.append(item.gbnf)
    if run:
        out.append(_literal("".join(run)))
    return " ".join(out)


def _join_alternatives(alts: list[list[_Item]]) -> str | None:
    """GBNF of the alternatives; an empty one makes the rest optional; None: all empty."""
    bodies = [_join_sequence(a) for a in alts if a]
    if not bodies:
        return None
    body = " | ".join(bodies)
    if len(bodies) < len(alts):
        return f"({body})?"
    return body


def pattern_rule(
    pattern: str, name: str, add_rule: Callable[[str, str], str], max_repeats: int
) -> str:
    """The name of a rule (added through ``add_rule(name, body)``) matching exactly the JSON
    strings (quotes included, then the converter's ``space``) whose value ``pattern``
    matches; ``GrammarError`` for a pattern it cannot translate."""
    parser = _Pattern(pattern, max_repeats)
    any_text = parser.chars(_complement([])).gbnf
    bodies: list[str] = []
    while True:
        start = parser.p.startswith("^", parser.i)
        parser.i += start
        items = parser.sequence(0, top=True)
        end = parser.p.startswith("$", parser.i)
        parser.i += end
        parts = [] if start else [f"{any_text}*"]
        parts += [_join_sequence(items)] if items else []
        parts += [] if end else [f"{any_text}*"]
        bodies.append(" ".join(parts))
        if parser.i >= len(parser.p):
            break
        if parser.p[parser.i] == ")":
            raise parser.fail("an unbalanced ')'")
        parser.i += 1  # the "|" the sequence stopped at
    body = _join_alternatives_text(bodies)
    return add_rule(name, '"\\"" ' + (f"{body} " if body else "") + '"\\"" space')


def _join_alternatives_text(bodies: list[str]) -> str:
    nonempty = [b for b in bodies if b]
    if not nonempty:
        return ""
    body = " | ".join(nonempty)
    if len(nonempty) < len(bodies):
        return f"({body})?"
    return body if len(nonempty) == 1 else f"({body})"
