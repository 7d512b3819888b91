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

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvwarm.backends.grammar_factor import factor_literal_rules
from kvwarm.errors import GrammarError

__all__ = [
    "DEFAULT_MAX_GRAMMAR_WAYS",
    "LARGE_TEXT_CHARS",
    "LARGE_TURNS",
    "MAX_EMPTY_REPEATS",
    "MAX_GRAMMAR_BYTES",
    "MAX_GRAMMAR_DEPTH",
    "MAX_GRAMMAR_REPEATS",
    "MAX_GRAMMAR_WIDTH",
    "TextMemo",
    "check_grammar_cost",
    "cheap_grammar",
    "check_grammar_depth",
    "check_grammar_code_points",
    "check_grammar_elements",
    "check_grammar_repeats",
    "check_grammar_safe",
    "check_left_recursion",
    "grammar_depth",
    "grammar_ways",
    "grammar_widths",
]

DEFAULT_MAX_GRAMMAR_WAYS = 1_000_000
#: The most a grammar may repeat a part that can match nothing (``_empty_repeats``): 16 costs
#: ~7 ms a token on SmolLM2, 32 ~17 ms, 100 ~4 s.
MAX_EMPTY_REPEATS = 16
#: llama.cpp's grammar parser descends once per nested group, on the calling thread's stack:
#: 20,000 levels overflowed an 8 MB stack (a segfault that took the server down) and it
#: refuses 2,000 itself; 1,000 compile. A JSON schema's ``maxLength``/``maxItems`` nest one
#: group per optional repeat. Deeper grammars are refused before llama.cpp sees them.
MAX_GRAMMAR_DEPTH = 1000
#: The most alternatives a grammar may open at one point (``grammar_widths``). llama.cpp keeps
#: one parse stack per open alternative and checks each against every token of the vocabulary
#: at every step: on SmolLM2 (49k tokens) ~0.1-0.5 ms per stack a token, so 10,000 (a JSON
#: schema's 10,000-value ``enum``) took ~7 s a token and stalled every request of the model;
#: 128 costs at most ~60 ms (a vocabulary 5x larger, 5x that). A rule of many string literals
#: is factored into a prefix tree first (``grammar_factor``), which opens one per distinct
#: next character, so even a 100,000-value enum passes.
MAX_GRAMMAR_WIDTH = 128
#: The most a repetition ``{m,n}`` may count: llama.cpp's grammar parser
#: (``MAX_REPETITION_THRESHOLD``) refuses a least past it, and silently reads a most past it
#: as no most at all (``"a"{0,5000}`` as ``"a"*``: the compiled grammar took 6,000 letters,
#: and a JSON schema ``pattern`` ``^a{0,3000}$`` a string of 7,000; found by review). Refused
#: before llama.cpp sees it, with a message saying why.
MAX_GRAMMAR_REPEATS = 2000
#: The longest grammar text accepted: its parse and checks here are Python (~0.4 s a MiB) and
#: llama.cpp compiles it twice (once here, once on the worker).
MAX_GRAMMAR_BYTES = 2 << 20

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_RULE_START = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*::=", re.MULTILINE)
#: What ends a comment in llama.cpp's grammar parser: either line-end byte.
_LINE_END = re.compile(r"[\r\n]")

# An expression: list of alternatives; an alternative: list of items; an item: ("ref", name,
# repeat) or ("term", empty, repeat), ``empty`` true for the literal "". A group is a rule of
# its own (``_parse_expr``). ``repeat`` is the postfix operator's (min, max) count, max -1 for
# unbounded, (1, 1) without one; ``ways`` ignores it (it adds length, not ambiguity).
_Item = tuple[str, object, tuple[int, int]]
_ONCE = (1, 1)
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
            i = _comment_end(text, i)
        else:
            break
    return i


def _comment_end(text: str, i: int) -> int:
    """Where the comment starting at ``i`` ends: at the next CR or LF, as in llama.cpp's
    ``parse_space``, which resumes parsing after a CR (found by review: ending a comment at
    LF alone hid what follows a CR on that line from every check here, while llama.cpp
    compiled it: ``# \\r x ::= "a"{5,2}`` ran the process out of memory)."""
    m = _LINE_END.search(text, i)
    return len(text) if m is None else m.start()


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


def _syntax(text: str) -> Iterator[tuple[int, str]]:
    """``text``'s characters outside literals, classes and comments, with their indices, up to
    an unterminated literal or class (llama.cpp's parser reports it); a linear scan that never
    recurses, whatever the input."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in '"[':
            try:
                i = _quoted(text, i, "]" if c == "[" else '"')
            except _UnparsableError:
                return
            continue
        if c == "#":
            i = _comment_end(text, i)
        else:
            yield i, c
        i += 1


def grammar_depth(text: str) -> int:
    """How deep ``text``'s parenthesised groups nest (literals, classes and comments
    skipped)."""
    depth = deepest = 0
    for _, c in _syntax(text):
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
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
            stack[-1][-1].append(("ref", name, _ONCE))
            i += 1
        elif c == "(":
            stack.append([[]])
            i += 1
        elif c == '"':
            end = _quoted(text, i, '"')
            alts[-1].append(("term", end == i + 2, _ONCE))
            i = end
        elif c == "[":
            i = _quoted(text, i, "]")
            alts[-1].append(("term", False, _ONCE))
        elif c == ".":
            i += 1
            alts[-1].append(("term", False, _ONCE))
        elif c in "*+?":
            _repeat(alts[-1], {"*": (0, -1), "+": (1, -1), "?": (0, 1)}[c], rules)
            i += 1
        elif c == "{":
            j = text.find("}", i)
            if j < 0:
                raise _UnparsableError
            _repeat(alts[-1], _counts(text[i + 1 : j]), rules)
            i = j + 1
        else:
            m = _NAME.match(text, i)
            if m is None:
                raise _UnparsableError
            rest = _skip(text, m.end())
            if text.startswith("::=", rest):
                i = m.start()  # the next rule begins
                break
            alts[-1].append(("ref", m.group(0), _ONCE))
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


def _repeat(alt: _Alt, counts: tuple[int, int], rules: dict[str, _Expr]) -> None:
    """Give the alternative's last item the postfix operator's counts (llama.cpp refuses an
    operator with nothing before it). An operator after another repeats what the first
    made, as llama.cpp reads it: ``x{1,}{2}`` is ``(x{1,}){2}``, a group of its own here."""
    if alt:
        kind, val, reps = alt[-1]
        if reps != _ONCE:
            name = f"({len(rules)}"
            rules[name] = [[(kind, val, reps)]]
            kind, val = "ref", name
        alt[-1] = (kind, val, counts)


def _counts(body: str) -> tuple[int, int]:
    """``(min, max)`` of a ``{m}``, ``{m,}``, ``{m,n}`` or ``{,n}`` body; max -1: unbounded."""
    lo, comma, hi = body.partition(",")
    try:
        low = int(lo.strip() or 0)
        high = (int(hi.strip()) if hi.strip() else -1) if comma else low
    except ValueError:
        raise _UnparsableError from None
    return low, high


def _refs(expr: _Expr, out: set[str]) -> None:
    for alt in expr:
        for kind, val, _ in alt:
            if kind == "ref":
                out.add(str(val))


def grammar_ways(
    text: str, limit: int = DEFAULT_MAX_GRAMMAR_WAYS
) -> tuple[dict[str, int], list[str]]:
    """Each rule's saturated ways and the order they were computed in (deepest first).

    ``_UnparsableError`` escapes only to ``check_grammar_cost``.
    """
    return _ways(_parse(text), limit)


def _ways(rules: dict[str, _Expr], limit: int) -> tuple[dict[str, int], list[str]]:
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
            for kind, val, _ in alt:
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


#: A text at least this long is prepared only in its turn (``TextMemo``'s ``turns``).
LARGE_TEXT_CHARS = 64 << 10
#: The turn of large preparations: one at a time. Their Python holds the GIL, so threads
#: never ran two at once anyway, and each one in the queue for the GIL slowed the model's
#: worker more (it waits for the GIL between native calls). Memory: a 100,000-value enum's
#: preparation allocates up to ~250 MB (tracemalloc); four distinct ones at once raised the
#: process's peak by 300-430 MiB, one at a time by 270-290 (``bench/hostile_schema.py
#: --crowd 4``), and Starlette runs up to 40 request threads. Waiting, a request holds no
#: more than its schema.
LARGE_TURNS = threading.Semaphore(1)


class TextMemo:
    """A text-to-text function's results, the most recently used first, within ``max_chars``
    of results: the same text is not prepared again. Keyed by a digest of the text (a 2 MB
    grammar is not kept twice) and a ``scope``: the request's cache salt, so that one tenant
    cannot learn by a reply's speed that another sent some schema (as salts keep cached
    prompts apart). Failures are not kept. Thread-safe; two threads preparing one short text
    at once both compute it. With ``turns``, a text of ``LARGE_TEXT_CHARS`` or more is made
    only holding one of them, and one made meanwhile (the same schema sent twice at once) is
    then found kept; ``make`` must not wait for a turn itself. Never give ``turns`` to a memo
    the model's worker reads: it must not wait behind requests' preparations.

    Agents send the same tools and response format every turn: their grammar's preparation
    is Python on the request's thread, and a large one (a 100,000-value enum: ~3 s) holds the
    GIL, slowing every other request's decode, each time it is sent."""

    def __init__(
        self, max_chars: int, max_entries: int = 4096, turns: threading.Semaphore | None = None
    ) -> None:
        self.max_chars = max_chars
        self.max_entries = max_entries
        self._turns = turns
        self._lock = threading.Lock()
        self._kept: OrderedDict[bytes, str] = OrderedDict()
        self._chars = 0
        self.hits = 0

    def get(self, text: str, make: Callable[[str], str], scope: bytes = b"") -> str:
        key = _digest(text, scope)
        kept = self._kept_as(key)
        if kept is not None:
            return kept
        if self._turns is None or len(text) < LARGE_TEXT_CHARS:
            made = make(text)
        else:
            with self._turns:
                kept = self._kept_as(key)  # made while this one waited for its turn
                if kept is not None:
                    return kept
                made = make(text)
        self._keep(key, made)
        return made

    def _kept_as(self, key: bytes) -> str | None:
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                self.hits += 1
            return kept

    def _keep(self, key: bytes, made: str) -> None:
        if len(made) > self.max_chars:
            return
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)  # kept again: the most recently used
            else:
                self._kept[key] = made
                self._chars += len(made)
            while self._chars > self.max_chars or len(self._kept) > self.max_entries:
                _, old = self._kept.popitem(last=False)
                self._chars -= len(old)


def _digest(text: str, scope: bytes = b"") -> bytes:
    """``text``'s key in ``scope``: 256 bits, so that no one finds two texts sharing one (a
    safe grammar's and an unsafe one's, in ``_SAFE``) by brute force, as 128 might allow."""
    digest = hashlib.blake2b(len(scope).to_bytes(8, "big") + scope, digest_size=32)
    digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.digest()


#: ``cheap_grammar``'s results: 8 grammars of ``MAX_GRAMMAR_BYTES``, thousands of common ones.
_CHEAP = TextMemo(8 * MAX_GRAMMAR_BYTES, turns=LARGE_TURNS)


def cheap_grammar(text: str, scope: bytes | None = None) -> str:
    """``text`` as llama.cpp should get it: no longer than ``MAX_GRAMMAR_BYTES``, rules of
    many string literals factored into prefix trees (``grammar_factor``), and within every
    bound of ``check_grammar_cost`` (``GrammarError`` otherwise). A text prepared before in
    the same ``scope`` (a cache salt) is not prepared again (``TextMemo``)."""
    _check_length(text)
    return _CHEAP.get(text, _cheap, scope or b"")


class _Checked(str):
    """A grammar ``cheap_grammar`` returned: ``check_grammar_cost`` ran ``check_grammar_safe``'s
    checks on it, so its samplers do not run them again. Marked on the text itself, which the
    request carries to its worker, not in ``_SAFE``: others' grammars could push it out of
    that while the request is queued, and its worker would check it again or not as another
    tenant had just sent the same text, which its reply's speed would tell (found by review)."""

    __slots__ = ()


def _cheap(text: str) -> str:
    factored = factor_literal_rules(text)
    check_grammar_cost(factored)
    return _Checked(factored)


#: The grammars that passed ``check_grammar_safe``'s checks (their results: "").
_SAFE = TextMemo(0, max_entries=4096)


def check_grammar_safe(text: str) -> None:
    """``GrammarError`` for a grammar llama.cpp's compile cannot take safely: nesting past
    ``MAX_GRAMMAR_DEPTH`` (its parser overflows its stack), elements that abort the process,
    repeats past ``MAX_GRAMMAR_REPEATS`` (rules until out of memory), code points it writes as
    bytes, a left recursion through rules that can be empty (its compile loops for ever).
    Every backend's sampler checks it, whoever calls it. A text that passed here, or that
    ``cheap_grammar`` returned (``_Checked``: its ``check_grammar_cost`` ran the same checks),
    is not checked again: the request's thread prepared it, and on the model's worker a
    100,000-value enum's checks took ~1.4 s in which no other request decoded. ``_SAFE`` is
    not scoped by tenant: a request's grammar never depends on it."""
    if isinstance(text, _Checked):
        return
    _SAFE.get(text, _checked_safe)


def _checked_safe(text: str) -> str:
    check_grammar_depth(text)
    check_grammar_elements(text)
    check_grammar_repeats(text)
    check_grammar_code_points(text)
    check_left_recursion(text)
    return ""


def _check_length(text: str) -> None:
    if len(text) > MAX_GRAMMAR_BYTES:
        raise GrammarError(
            f"grammar is {len(text)} characters, more than the {MAX_GRAMMAR_BYTES} accepted",
            param="grammar",
        )


def check_grammar_depth(text: str) -> None:
    """``GrammarError`` for a grammar nesting deeper than ``MAX_GRAMMAR_DEPTH``: llama.cpp's
    parser recurses once per group on the calling thread's stack, and a grammar nesting
    200,000 deep overflowed it (a segfault). Every backend's sampler checks it, whoever
    calls it (found by review: only the engine's requests were checked)."""
    depth = grammar_depth(text)
    if depth > MAX_GRAMMAR_DEPTH:
        raise GrammarError(
            f"grammar nests groups {depth} deep, more than the {MAX_GRAMMAR_DEPTH} llama.cpp "
            "can parse (a JSON schema's maxLength or maxItems nests one per optional repeat)",
            param="grammar",
        )


def token_element_at(text: str) -> int | None:
    """Where ``text`` has its first token-level element (``<[id]>``, ``<name>``, negated
    ``!<...>``: the only GBNF syntax with a ``<`` outside literals, classes and comments), or
    None."""
    return next((i for i, c in _syntax(text) if c == "<"), None)


def check_grammar_elements(text: str) -> None:
    """``GrammarError`` for a grammar with token-level elements. llama.cpp's grammar lets a
    token through that spans a literal's end and a negated token (``root ::= "a" !<[28]>``
    admits the token ``anto``) and then throws on accepting it, a C++ exception that no C
    caller can catch: the process aborted (found by review; llama-server, in C++, answers
    500). Every backend's sampler refuses them, as it refuses a grammar too deep."""
    at = token_element_at(text)
    if at is not None:
        raise GrammarError(
            f"token-level grammar elements (<[id]>, <token>, !<...>; here at character {at}) "
            "are not supported: write the text as a literal",
            param="grammar",
        )


_DIGITS = re.compile(r"[0-9]+")


def _repeat_counts(text: str, i: int) -> tuple[int, int | None] | None:
    """The ``(min, max)`` of the ``{m}``, ``{m,}`` or ``{m,n}`` at ``i`` (max None: unbounded),
    read as llama.cpp's parser reads it (spaces and comments may come between its parts), or
    None where it is no such repetition (llama.cpp's parser reports that)."""
    j = _skip(text, i + 1)
    m = _DIGITS.match(text, j)
    if m is None:
        return None
    low = int(m.group(0))
    j = _skip(text, m.end())
    if text.startswith("}", j):
        return low, low
    if not text.startswith(",", j):
        return None
    m = _DIGITS.match(text, _skip(text, j + 1))
    return (low, None) if m is None else (low, int(m.group(0)))


def check_grammar_repeats(text: str) -> None:
    """``GrammarError`` for a repetition ``{m,n}`` whose most is below its least
    (``root ::= "a"{5,2}``): llama.cpp's parser counts the optional repeats as ``n - m``
    unsigned, so it wrapped to 2**64 and added rules until the process ran out of memory
    (found by fuzzing: 4 minutes, then the kernel killed the server). Every backend's sampler
    checks it, as it checks the depth. Also for a count past ``MAX_GRAMMAR_REPEATS`` (see
    there)."""
    for i, c in _syntax(text):
        if c != "{":
            continue
        counts = _repeat_counts(text, i)
        if counts is None:
            continue
        low, high = counts
        shown = f"{{{low}}}" if high == low else f"{{{low},{'' if high is None else high}}}"
        if high is not None and high < low:
            raise GrammarError(
                f"grammar repetition {{{low},{high}}} (at character {i}) has its "
                "most below its least",
                param="grammar",
            )
        if max(low, high or 0) > MAX_GRAMMAR_REPEATS:
            raise GrammarError(
                f"grammar repetition {shown} (at character {i}) counts more than "
                f"{MAX_GRAMMAR_REPEATS}: llama.cpp refuses such a least, and reads such a most "
                "as no most at all; repeat a repeated group instead ((x{1000}){5}), or use "
                "* or +",
                param="grammar",
            )


_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
_HEX = frozenset("0123456789abcdefABCDEF")


def _escaped_at(text: str, i: int) -> tuple[int | None, int]:
    """The code point a ``\\x``, ``\\u`` or ``\\U`` escape at ``i`` names (None for any
    other character, or an escape llama.cpp's parser reports itself), and where the next
    character starts."""
    if text[i] != "\\" or i + 1 >= len(text):
        return None, i + 1
    width = _HEX_WIDTH.get(text[i + 1])
    digits = text[i + 2 : i + 2 + width] if width else ""
    if width and len(digits) == width and set(digits) <= _HEX:
        return int(digits, 16), i + 2 + width
    return None, i + 2


def _no_text(point: int | None) -> bool:
    """Whether no UTF-8 text holds code point ``point``: a surrogate or one past U+10FFFF."""
    return point is not None and (point > 0x10FFFF or 0xD800 <= point <= 0xDFFF)


def _bad_code_point(text: str) -> tuple[int, int] | None:
    """(where, which) of the first escape in a literal or class naming a code point no text
    holds (a class's range needs one end that is text), or None."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            i = _comment_end(text, i)
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                at = i
                point, i = _escaped_at(text, i)
                if _no_text(point):
                    return at, point  # type: ignore[return-value]
        elif c == "[":
            negated = text.startswith("[^", i)  # what it leaves out may be anything
            i += 2 if negated else 1
            while i < n and text[i] != "]":
                at = i
                point, i = _escaped_at(text, i)
                if negated:
                    continue
                if text.startswith("-", i) and i + 1 < n and text[i + 1] != "]":
                    last, i = _escaped_at(text, i + 1)
                    ends = [p for p in (point, last) if p is not None]
                    if any(p > 0x10FFFF for p in ends) or (
                        len(ends) == 2 and all(_no_text(p) for p in ends)
                    ):
                        return at, max(ends)
                elif _no_text(point):
                    return at, point  # type: ignore[return-value]
        i += 1
    return None


def check_grammar_code_points(text: str) -> None:
    """``GrammarError`` for an escape in a literal or class naming a code point no UTF-8 text
    holds (``"\\uD800"``, ``[\\U0011FFFF]``): llama.cpp compiled such a grammar and then let
    the model write the bytes of that non-character, a reply of U+FFFD (found by fuzzing)."""
    bad = _bad_code_point(text)
    if bad is not None:
        raise GrammarError(
            f"grammar escape at character {bad[0]} names U+{bad[1]:04X}, which no text holds "
            "(a surrogate, or past U+10FFFF)",
            param="grammar",
        )


def check_left_recursion(text: str) -> None:
    """``GrammarError`` for a rule that can begin with itself after parts that can all be
    empty (``root ::= y root "b" | "a"`` with ``y ::= "x"?``): llama.cpp refuses a
    left recursion it sees (``y? root``) but not one through a rule that can match
    nothing, and its grammar compile then never returned, taking its model's worker with it
    (found by a grammar fuzz in review). Every backend's sampler checks it; a grammar this
    parser cannot read is left to llama.cpp's."""
    try:
        rules = _parse(text)
    except (_UnparsableError, RecursionError):
        return
    _check_left_recursion(rules, _nullable(rules))


def _check_left_recursion(rules: dict[str, _Expr], nullable: set[str]) -> None:
    """``check_left_recursion`` of parsed rules (``nullable``: ``_nullable(rules)``)."""
    heads: dict[str, set[str]] = {name: set() for name in rules}
    for name, expr in rules.items():
        for alt in expr:
            for kind, val, (low, _) in alt:
                if kind == "ref":
                    heads[name].add(str(val))
                if low > 0 and not _empty(kind, val, nullable):
                    break
    named = _rule_of(rules)
    for name in rules:
        todo, seen = list(heads[name]), set[str]()
        while todo:
            here = todo.pop()
            if here == name:
                raise GrammarError(
                    f"grammar rule {named(name)!r} can begin with itself (left recursion, here "
                    "after parts that can match nothing): write the repetition with * or +",
                    param="grammar",
                )
            if here not in seen:
                seen.add(here)
                todo.extend(heads.get(here, ()))


def check_grammar_cost(
    text: str, limit: int = DEFAULT_MAX_GRAMMAR_WAYS, width_limit: int = MAX_GRAMMAR_WIDTH
) -> None:
    """``GrammarError`` (a 400) for a grammar longer than ``MAX_GRAMMAR_BYTES`` or nesting
    deeper than ``MAX_GRAMMAR_DEPTH``, or naming the first rule whose ambiguity passes
    ``limit`` or that opens more than ``width_limit`` alternatives at once."""
    _check_length(text)
    check_grammar_depth(text)
    check_grammar_elements(text)
    check_grammar_repeats(text)
    check_grammar_code_points(text)
    try:
        rules = _parse(text)
    except (_UnparsableError, RecursionError):
        return
    nullable = _nullable(rules)  # found once, for every check below
    _check_left_recursion(rules, nullable)  # on the rules parsed once, not its own parse
    try:
        ways, order = _ways(rules, limit)
    except (_UnparsableError, RecursionError):
        return
    repeats = _empty_repeats(rules, nullable, order, MAX_EMPTY_REPEATS)
    for name in order:
        if repeats[name] > MAX_EMPTY_REPEATS and not name.startswith("("):
            raise GrammarError(
                f"grammar rule {name!r} repeats a part that can match nothing more than "
                f"{MAX_EMPTY_REPEATS} times (as in (x?){{0,n}}), which would stall the model; "
                "make the repeated part non-empty (x{0,n})",
                param="grammar",
            )
    twice = _empty_twice(rules, nullable)
    if twice is not None:
        raise GrammarError(
            f"grammar rule {twice!r} can match nothing and uses itself more than once in a "
            'sequence (as in x ::= | "a" x x): a text parses in exponentially many ways, '
            "which would stall the model; make the rule non-empty or use it once",
            param="grammar",
        )
    nested = _nested_repeat(rules, nullable)
    if nested is not None:
        raise GrammarError(
            f"grammar rule {nested!r} repeats without bound a part that is itself an "
            "unbounded repetition (as in (x+)+ or x{1,}{1,}): a text splits among the "
            "repeats in many ways, which would stall the model; repeat the inner part once "
            "(x+)",
            param="grammar",
        )
    for name in order:
        if ways[name] > limit and not name.startswith("("):  # a group: its rule is named
            raise GrammarError(
                f"grammar rule {name!r} is too ambiguous: it can be derived in more than "
                f"{limit} ways, which would stall the model; simplify the rule",
                param="grammar",
            )
    widths = _widths(rules, nullable, order, width_limit)
    for name in order:
        if widths[name] > width_limit and not name.startswith("("):
            raise GrammarError(
                f"grammar rule {name!r} opens more than {width_limit} alternatives at once "
                "(each is checked against the whole vocabulary for every token, which would "
                "stall the model); factor common prefixes out of its alternatives or split it",
                param="grammar",
            )


def _nested_repeat(rules: dict[str, _Expr], nullable: set[str]) -> str | None:
    """The first rule (a group reported as the rule it stands in) that repeats without bound
    a part made of nothing but an unbounded repetition: ``(x+)+``, ``x{1,}{1,}``,
    ``(x* y?)*``, ``x+`` where ``x ::= [a]+`` or ``x ::= [a] x | [a]``. llama.cpp's grammar
    engine follows every way a token's bytes split among the repeats, for each token of the
    vocabulary a broad class lets through: ``([^a]+)+`` cost 0.2 s a token on SmolLM2,
    ``[^a]{1,}{1,}{2}*`` 33 s, stalling every request of the model (found by review). So is
    an unbounded repeat of a part that can end with more of itself (``x+`` where ``x ::= [^a]
    x{1,}{0,2}``: minutes for one token).
    Bounded repeats (``(x{1,3})+``, ``([^a]+){2}``: a few ms) and a repeat whose part has a
    fixed text besides (``("," item)*``) pass."""
    memo: dict[str, bool] = {}

    def unbounded(kind: str, val: object, reps: tuple[int, int], seen: frozenset[str]) -> bool:
        return reps[1] < 0 or (kind == "ref" and bare(str(val), seen))

    def bare(name: str, seen: frozenset[str]) -> bool:
        """Whether some alternative of ``name`` is an unbounded repetition among parts that
        can all be empty (or ends referring back: a repetition written as recursion)."""
        if name in memo:
            return memo[name]
        expr = rules.get(name)
        if expr is None or name in seen:
            return name in seen
        seen = seen | {name}
        found = False
        for alt in expr:
            solid = [
                item for item in alt if not (item[2][0] == 0 or _empty(item[0], item[1], nullable))
            ]
            # One part that cannot be empty, or none (x* y?): an unbounded one repeats.
            if len(solid) <= 1 and any(unbounded(*item, seen) for item in solid or alt):
                found = True
                break
            if alt and alt[-1][0] == "ref" and str(alt[-1][1]) in seen:
                found = True
                break
        memo[name] = found
        return found

    # The rules each rule can end with (its alternatives' last parts, and those before them
    # while they can be empty): a rule reaching itself so ends with more of itself, as
    # ``root ::= [^a] root{1,}{0,2}``, whose unbounded repeat took minutes for one token.
    tails: dict[str, set[str]] = {name: set() for name in rules}
    for name, expr in rules.items():
        for alt in expr:
            for kind, val, (low, _) in reversed(alt):
                if kind == "ref":
                    tails[name].add(str(val))
                if low > 0 and not _empty(kind, val, nullable):
                    break

    def ends_with_itself(name: str) -> bool:
        todo, seen = list(tails.get(name, ())), set[str]()
        while todo:
            here = todo.pop()
            if here == name:
                return True
            if here not in seen:
                seen.add(here)
                todo.extend(tails.get(here, ()))
        return False

    owner: dict[str, str] = {}  # a group's rule: the named rule it stands in
    for name, expr in rules.items():
        for alt in expr:
            for kind, val, _ in alt:
                if kind == "ref" and str(val).startswith("("):
                    owner.setdefault(str(val), name)
    for name, expr in rules.items():
        for alt in expr:
            for kind, val, (_, high) in alt:
                if (
                    kind == "ref"
                    and high < 0
                    and (bare(str(val), frozenset()) or ends_with_itself(str(val)))
                ):
                    named = name
                    while named.startswith("(") and named in owner:
                        named = owner[named]
                    return named
    return None


def _empty_twice(rules: dict[str, _Expr], nullable: set[str]) -> str | None:
    """A rule that can match nothing and refers to itself more than once in one of its
    alternatives (``root ::= | [a] root{2} "b"``): llama.cpp's first grammar step on one ran
    past a minute (found by a grammar fuzz in review). Groups count as the rule they stand
    in."""
    named = _rule_of(rules)
    for name, expr in rules.items():
        rule = named(name)
        if rule not in nullable:
            continue
        for alt in expr:
            uses = 0
            for kind, val, (_, high) in alt:
                if kind == "ref" and named(str(val)) == rule and not str(val).startswith("("):
                    uses += 2 if high < 0 or high > 1 else 1
            if uses > 1:
                return rule
    return None


def _rule_of(rules: dict[str, _Expr]) -> Callable[[str], str]:
    """The named rule a group (``(...)``, parsed as a rule of its own) stands in, for
    messages and for counting a group's uses as its rule's; a named rule is itself."""
    owner: dict[str, str] = {}
    for name, expr in rules.items():
        for alt in expr:
            for kind, val, _ in alt:
                if kind == "ref" and str(val).startswith("("):
                    owner.setdefault(str(val), name)

    def named(name: str) -> str:
        while name.startswith("(") and name in owner:
            name = owner[name]
        return name

    return named


def _nullable(rules: dict[str, _Expr]) -> set[str]:
    """The rules that can match the empty string (a fixpoint: recursion included), in time
    linear in the grammar: each alternative waits on the rules it needs empty, and a rule
    found empty wakes the alternatives waiting on it (a 100,000-value enum's prefix tree
    took 5 sweeps of all its rules before, ~0.5 s a sweep)."""
    found: set[str] = set()
    waiting: dict[str, list[int]] = {}  # a rule: the alternatives that need it empty
    alts: list[tuple[str, int]] = []  # an alternative: its rule and the rules it still needs
    todo: list[str] = []
    for name, expr in rules.items():
        for alt in expr:
            needs: set[str] = set()
            for kind, val, rep in alt:
                if rep[0] == 0:
                    continue
                if kind == "term":
                    if val is not True:
                        break  # a part that always reads something: never empty
                else:
                    needs.add(str(val))
            else:
                alts.append((name, len(needs)))
                for need in needs:
                    waiting.setdefault(need, []).append(len(alts) - 1)
                if not needs and name not in found:
                    found.add(name)
                    todo.append(name)
    while todo:
        for index in waiting.get(todo.pop(), ()):
            name, left = alts[index]
            alts[index] = (name, left - 1)
            if left == 1 and name not in found:
                found.add(name)
                todo.append(name)
    return found


def _empty(kind: str, val: object, nullable: set[str]) -> bool:
    """Whether an item's element (its repetition aside) can match the empty string."""
    return val is True if kind == "term" else str(val) in nullable


def _empty_repeats(
    rules: dict[str, _Expr], nullable: set[str], order: list[str], cap: int
) -> dict[str, int]:
    """Per rule, the most places inside it that the next byte may come from after parts that
    can match nothing (saturating past ``cap``).

    A repeated part that can be empty, ``(x?){0,n}``, or the nested optionals a JSON-schema
    pattern ``(a?){0,n}`` becomes, leaves llama.cpp's grammar engine ``n`` stacks for every
    byte, and its work per token grows with the fourth power of ``n`` (100: ~4 s a token on
    SmolLM2, 300: minutes; found by review). Counted: a part whose element can be empty, at
    least 1 and multiplied by its repeat count (``*`` and ``+`` recurse into one rule and
    multiply nothing), summed along a sequence while the parts before can be empty. A part
    made optional only by its own ``?`` counts 0: alternatives that start differently die on
    the next byte (a schema's optional properties)."""
    first: dict[str, int] = {}  # places from the rule's start
    worst: dict[str, int] = {}  # places from any point inside it
    for name in order:  # deepest first: a rule not weighed yet is a cycle back, and counts 1
        best = most = 0
        for alt in rules[name]:
            suffix = 0  # places from the item at hand to the end of the alternative
            for kind, val, (low, high) in reversed(alt):
                if _empty(kind, val, nullable):
                    count = high if high >= 0 else low
                    places = max(1, first.get(str(val), 1) if kind == "ref" else 0)
                    places *= max(1, count)
                    suffix = min(places + suffix, cap + 1)
                elif low == 0:
                    suffix = min(suffix, cap + 1)  # an optional part: the next may follow
                else:
                    suffix = 0
                most = max(most, suffix)
            best = max(best, suffix)
        first[name] = best
        worst[name] = most
    return worst


def grammar_widths(text: str, cap: int = MAX_GRAMMAR_WIDTH) -> dict[str, int]:
    """Per rule, the most alternatives open at once at any point inside it or the rules it
    reaches (saturating past ``cap``); groups are included under their ``(N`` names.

    ``_UnparsableError`` escapes only to ``check_grammar_cost``.
    """
    rules = _parse(text)
    _, order = _ways(rules, cap)
    return _widths(rules, _nullable(rules), order, cap)


def _widths(
    rules: dict[str, _Expr], nullable: set[str], order: list[str], cap: int
) -> dict[str, int]:
    """The number of parse stacks llama.cpp's grammar engine holds at a point is the number of
    alternatives open there: a rule reference expands into every alternative of the rule,
    each led by a reference expanding in turn, and an element that can match nothing
    (``x?``, ``x*``, a nullable rule) opens what follows it too. Counted per rule (deepest
    first; a reference back into a cycle counts 1): ``first``, what its start opens;
    ``worst``, the most open at any point inside it, the rules it reaches included."""
    first: dict[str, int] = {}  # alternatives a rule's start opens (not counting what follows)
    worst: dict[str, int] = {}

    def opens(kind: str, val: object) -> int:
        if kind == "ref":
            return first.get(str(val), 1)
        return 0 if val is True else 1  # the literal "" opens nothing

    for name in order:
        own = 0
        most = 0
        for alt in rules[name]:
            inner = 0  # what the items from here on open
            through = True  # and whether all of them can match nothing (the caller goes on)
            for kind, val, rep in reversed(alt):
                skippable = rep[0] == 0 or _empty(kind, val, nullable)
                inner = min(opens(kind, val) + (inner if skippable else 0), cap + 1)
                through = through and skippable
                most = max(most, inner + through)
                if kind == "ref":
                    most = max(most, worst.get(str(val), 0))
            own = min(own + inner, cap + 1)
        first[name] = own
        worst[name] = min(max(most, own + (name in nullable)), cap + 1)
    return worst
