"""A static bound on what a GBNF grammar may cost, checked before llama.cpp sees it.

llama.cpp's grammar engine keeps one parse stack per way the text so far can be derived; an
ambiguous grammar such as ``r{i} ::= r{i+1} r{i+1} | "a"`` (41 rules) multiplies those stacks
doubly exponentially and pins the worker for minutes inside native code that cannot be
interrupted. This module estimates each rule's *ambiguity* and refuses a grammar whose estimate
passes a limit, naming the first rule (deepest first) that does.

The estimate (``ways``), per rule: alternatives led by a rule or group add, those led by a
terminal count as their largest one (a mismatched first byte ends them at once), a sequence
multiplies, a terminal (string or
character class) is 1, a postfix operator (``? * + {m,n}``) keeps its element's ways (it adds
length, not ambiguity), and a reference into a recursive cycle counts 1 (recursion consumes input,
so it is bounded per token). Values saturate at the limit. Ordinary grammars (JSON, enums of
hundreds of strings, schemas with many optional fields) stay far below it.

Invariants: never raises anything but ``GrammarError``; a grammar this module cannot parse is not
rejected here (llama.cpp's own parser reports it), unless it nests deeper than llama.cpp's parser
can descend (``MAX_GRAMMAR_DEPTH``).
"""

from __future__ import annotations

import re

from kvwarm.errors import GrammarError

__all__ = [
    "DEFAULT_MAX_GRAMMAR_WAYS",
    "MAX_GRAMMAR_DEPTH",
    "check_grammar_cost",
    "grammar_depth",
    "grammar_ways",
]

DEFAULT_MAX_GRAMMAR_WAYS = 1_000_000
#: llama.cpp's grammar parser descends once per nested group, on the calling thread's stack:
#: 20,000 levels overflowed an 8 MB stack (a segfault that took the server down) and it
#: refuses 2,000 itself; 1,000 compile. A JSON schema's ``maxLength``/``maxItems`` nest one
#: group per optional repeat. Deeper grammars are refused before llama.cpp sees them.
MAX_GRAMMAR_DEPTH = 1000

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_RULE_START = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*::=", re.MULTILINE)

# An expression: list of alternatives; an alternative: list of items; an item: ("ref", name) or
# ("term", None). A group is a rule of its own (``_parse_expr``). Postfix operators are dropped
# (they keep ways).
_Item = tuple[str, object]
_Alt = list[_Item]
_Expr = list[_Alt]


class _UnparsableError(Exception):
    pass


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        else:
            break
    return i


def _quoted(text: str, i: int, close: str) -> int:
    """Index after the closing ``close`` of a literal or class starting at ``i``."""
    i += 1
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == close:
            return i + 1
        i += 1
    raise _UnparsableError


def grammar_depth(text: str) -> int:
    """How deep ``text``'s parenthesised groups nest (literals, classes and comments
    skipped); a linear scan that never recurses, whatever the input."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in '"[':
            try:
                i = _quoted(text, i, "]" if c == "[" else '"')
            except _UnparsableError:
                break  # unterminated: llama.cpp's parser reports it
            continue
        if c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def _parse_expr(text: str, i: int, rules: dict[str, _Expr]) -> tuple[_Expr, int]:
    """One rule's body from ``i``: its expression and the index where it ends (the next rule's
    name, or the text's end). Each parenthesised group becomes a rule of its own in ``rules``
    (named ``(N``, which no GBNF rule can be), referenced where it stood, as llama.cpp's
    parser does: no recursion, so a group nesting ``MAX_GRAMMAR_DEPTH`` deep is weighed like
    any other."""
    stack: list[_Expr] = [[[]]]  # the rule's expression, then each group still open
    n = len(text)
    while True:
        i = _skip(text, i)
        if i >= n:
            break
        c = text[i]
        alts = stack[-1]
        if c == "|":
            alts.append([])
            i += 1
        elif c == ")":
            if len(stack) == 1:
                break  # unbalanced: the caller refuses to weigh it
            name = f"({len(rules)}"
            rules[name] = stack.pop()
            stack[-1][-1].append(("ref", name))
            i += 1
        elif c == "(":
            stack.append([[]])
            i += 1
        elif c == '"':
            i = _quoted(text, i, '"')
            alts[-1].append(("term", None))
        elif c == "[":
            i = _quoted(text, i, "]")
            alts[-1].append(("term", None))
        elif c == ".":
            i += 1
            alts[-1].append(("term", None))
        elif c in "*+?":
            i += 1
        elif c == "{":
            j = text.find("}", i)
            if j < 0:
                raise _UnparsableError
            i = j + 1
        else:
            m = _NAME.match(text, i)
            if m is None:
                raise _UnparsableError
            rest = _skip(text, m.end())
            if text.startswith("::=", rest):
                i = m.start()  # the next rule begins
                break
            alts[-1].append(("ref", m.group(0)))
            i = m.end()
    if len(stack) > 1:
        raise _UnparsableError  # a group left open
    return stack[0], i


def _parse(text: str) -> dict[str, _Expr]:
    rules: dict[str, _Expr] = {}
    i = _skip(text, 0)
    while i < len(text):
        m = _NAME.match(text, i)
        if m is None:
            raise _UnparsableError
        j = _skip(text, m.end())
        if not text.startswith("::=", j):
            raise _UnparsableError
        expr, i = _parse_expr(text, j + 3, rules)
        if i < len(text) and text[i] == ")":
            raise _UnparsableError
        name = m.group(0)
        if name in rules:
            rules[name] = rules[name] + expr
        else:
            rules[name] = expr
        i = _skip(text, i)
    return rules


def _refs(expr: _Expr, out: set[str]) -> None:
    for alt in expr:
        for kind, val in alt:
            if kind == "ref":
                out.add(str(val))


def grammar_ways(
    text: str, limit: int = DEFAULT_MAX_GRAMMAR_WAYS
) -> tuple[dict[str, int], list[str]]:
    """Each rule's saturated ways and the order they were computed in (deepest first).

    ``_UnparsableError`` escapes only to ``check_grammar_cost``.
    """
    rules = _parse(text)
    deps = {name: set[str]() for name in rules}
    for name, expr in rules.items():
        _refs(expr, deps[name])
    ways: dict[str, int] = {}
    order: list[str] = []
    # Iterative DFS; a reference to a rule still on the stack is a cycle and counts 1.
    state: dict[str, int] = {}  # 1 = on stack, 2 = done

    def value(expr: _Expr) -> int:
        total = 0
        lexical = 0  # alternatives led by a terminal: their stacks die on a mismatched byte
        for alt in expr:
            prod = 1
            for kind, val in alt:
                if kind == "ref":
                    name = str(val)
                    w = ways.get(name, 1) if state.get(name) == 2 else 1
                else:
                    w = 1
                prod = min(prod * w, limit + 1)
            if not alt or alt[0][0] == "term":
                lexical = max(lexical, prod)
            else:
                total = min(total + prod, limit + 1)
        return min(total + lexical, limit + 1)

    for root in rules:
        if state.get(root):
            continue
        stack: list[tuple[str, list[str]]] = [(root, sorted(deps[root]))]
        state[root] = 1
        while stack:
            name, todo = stack[-1]
            while todo and (todo[-1] not in rules or state.get(todo[-1])):
                todo.pop()
            if todo:
                child = todo.pop()
                state[child] = 1
                stack.append((child, sorted(deps[child])))
                continue
            stack.pop()
            ways[name] = value(rules[name])
            state[name] = 2
            order.append(name)
    return ways, order


def check_grammar_cost(text: str, limit: int = DEFAULT_MAX_GRAMMAR_WAYS) -> None:
    """``GrammarError`` (a 400) for a grammar nesting deeper than ``MAX_GRAMMAR_DEPTH``, or
    naming the first rule whose ambiguity passes ``limit``."""
    depth = grammar_depth(text)
    if depth > MAX_GRAMMAR_DEPTH:
        raise GrammarError(
            f"grammar nests groups {depth} deep, more than the {MAX_GRAMMAR_DEPTH} llama.cpp "
            "can parse (a JSON schema's maxLength or maxItems nests one per optional repeat)",
            param="grammar",
        )
    try:
        ways, order = grammar_ways(text, limit)
    except (_UnparsableError, RecursionError):
        return
    for name in order:
        if ways[name] > limit and not name.startswith("("):  # a group: its rule is named
            raise GrammarError(
                f"grammar rule {name!r} is too ambiguous: it can be derived in more than "
                f"{limit} ways, which would stall the model; simplify the rule",
                param="grammar",
            )
