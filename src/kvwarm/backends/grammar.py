"""JSON schema → GBNF, through the converter llama-cpp-python ships.

Invariant: never loads ``libllama`` — ``llama_cpp/llama_grammar.py`` uses only the standard
library, so it is loaded from its file without executing ``llama_cpp/__init__`` (which would
dlopen the native library). Cache-only and stub processes can therefore convert schemas too.
Every failure, including malformed JSON and unsupported ``$ref``s, is a ``GrammarError``;
remote ``$ref``s are never fetched. The converter's visit of each node is extended
(``_fix_visits``): what it would let the model write against the schema, or drop unsaid, is
either enforced here (patterns over JSON text, numeric bounds) or refused with a 400.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import cast

from kvwarm.backends.grammar_cost import (
    LARGE_TURNS,
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_REPEATS,
    TextMemo,
)
from kvwarm.errors import GrammarError

_MODULE_NAME = "kvwarm.backends._llama_grammar"
#: The converter writes one grammar item per required repeat and one nested group per optional
#: one: ``{"type": "string", "minLength": 1000000}`` (100 bytes) became a 5 MB grammar after
#: seconds of CPU. No reply of a few thousand tokens needs more; nesting is bounded further by
#: ``grammar_cost.MAX_GRAMMAR_DEPTH``.
MAX_SCHEMA_REPEATS = 10_000
#: The most a ``pattern``'s quantifier may count: it is written as GBNF's ``{m,n}``, whose
#: counts llama.cpp's parser bounds (``grammar_cost.MAX_GRAMMAR_REPEATS``: a most past it was
#: read as no most at all, so ``^a{0,5000}$`` let the model write any number of ``a``).
MAX_PATTERN_REPEATS = MAX_GRAMMAR_REPEATS
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
                if bound.isascii() and bound.isdigit() and int(bound) > MAX_PATTERN_REPEATS:
                    return (
                        f"a quantifier of {bound} is more than the {MAX_PATTERN_REPEATS} "
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
            _fix_string_chars(module)
            _fix_visits(module)
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


def _fix_string_chars(module: ModuleType) -> None:
    """The converter's ``char``, a character of a JSON string (every ``string``, every
    property name of a free object, ``json_object``'s and each length-bounded string's), was
    ``[^"\\]``: it let the model write a raw newline, tab or other control character inside a
    string, which JSON forbids (RFC 8259: U+0000 to U+001F must be escaped), so the reply was
    no JSON at all (found by review: SmolLM2 under ``{"type": "string", "minLength": 60}``
    wrote ``".\\n\\nThe original..."``, a raw newline). Held to JSON's characters, as
    llama.cpp's own converter holds it; an escape (``\\n``, ``\\u0009``) still writes any of
    them."""
    rules = module.PRIMITIVE_RULES
    hexes = " ".join(["[0-9a-fA-F]"] * 4)
    rules["char"] = module.BuiltinRule(rf'[^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" {hexes})', [])


#: Every JSON type: the items of an array schema that names none (``{"minItems": 2}``).
_ANY_TYPE = ["object", "array", "string", "number", "boolean", "null"]
#: Keywords that make the converter read a node as something else than its ``type`` says.
_SHAPED = ("$ref", "oneOf", "anyOf", "const", "enum")
#: The bounds of a number (draft 6 on: ``exclusive*`` are numbers; draft 4: booleans).
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
#: Integers the converter's ``integral-part`` can write: 16 digits at most.
_MAX_DIGITS = 16


def _fail(message: str) -> GrammarError:
    return GrammarError(f"JSON schema {message}", param="json_schema")


def _fix_visits(module: ModuleType) -> None:
    """What kvwarm adds to the converter's ``visit`` of each schema node, where the converter
    would let the model write what the schema forbids, or dropped a constraint unsaid (found
    by review):

    - a ``pattern`` becomes a rule over the string's JSON text (``json_pattern``): the
      converter's let the model write a raw ``"``, a lone backslash or a raw newline;
    - an ``integer``'s and a ``number``'s ``minimum``/``maximum``/``exclusive*`` are
      enforced (the converter ignored them); a bounded number is written without an
      exponent, and near a fractional bound some values are left out (``_number_rule``);
    - ``"type": [a, b]`` keeps the node's other keywords for each type (the converter kept
      only the type: ``["string", "null"]`` lost its ``maxLength`` or ``pattern``);
    - ``minLength``/``maxLength``/``minItems``/``maxItems`` must be non-negative integers,
      an array's counts hold without ``items``, and a string's length beside a ``pattern``
      or a ``format`` (which the converter let win) is refused rather than dropped;
    - any other keyword the converter's reading of a node would drop (``required`` naming no
      listed property, bounds beside an ``enum``, keywords beside ``anyOf`` or ``$ref``,
      ``patternProperties``...) is refused (``_check_enforced``)."""
    from kvwarm.backends.json_pattern import pattern_rule

    converter = module.SchemaConverter
    visit = converter.visit
    reserved = module.RESERVED_NAMES

    def visit_node(self: object, schema: object, name: str) -> object:
        depth = getattr(self, "_kvwarm_depth", 0)
        if depth and not name:
            # Only a top-level property named "" is visited under no name below the root:
            # the converter named its rule "root", so the grammar's root was that property's
            # value, not the object (found by fuzzing).
            name = "empty-key"
        setattr(self, "_kvwarm_depth", depth + 1)  # noqa: B010
        try:
            return visit_checked(self, schema, name)
        finally:
            setattr(self, "_kvwarm_depth", depth)  # noqa: B010

    def visit_checked(self: object, schema: object, name: str) -> object:
        if schema is True:
            schema = {}  # a boolean schema: true admits any value ...
        elif schema is False:  # ... and false none (the converter failed on both, unsaid)
            raise _fail(f"subschema {name or 'root'!r} is false: no value can match it")
        if isinstance(schema, dict):
            schema = _checked_node(schema)
            kind = schema.get("type")
            shaped = any(k in schema for k in _SHAPED)
            if kind in ("integer", "number") and not shaped and any(k in schema for k in _BOUNDS):
                rule_name = name + "-" if name in reserved else name or "root"
                add_rule = cast(Callable[[str, str], str], self._add_rule)  # type: ignore[attr-defined]
                rule = _integer_rule(schema) if kind == "integer" else _number_rule(schema)
                return add_rule(rule_name, rule + " space")
        return visit(self, schema, name)

    def visit_pattern(self: object, pattern: object, name: str) -> str:
        if not isinstance(pattern, str):
            raise _fail("pattern must be a string")
        add_rule = cast(Callable[[str, str], str], self._add_rule)  # type: ignore[attr-defined]
        return pattern_rule(pattern, name, add_rule, MAX_PATTERN_REPEATS)

    setattr(converter, "visit", visit_node)  # noqa: B010
    setattr(converter, "_visit_pattern", visit_pattern)  # noqa: B010


def _checked_node(schema: dict[str, object]) -> dict[str, object]:
    """``schema`` as the converter should read it (see ``_fix_visits``), or ``GrammarError``."""
    node = _shaped_node(schema)
    _check_enforced(node)
    return node


def _shaped_node(schema: dict[str, object]) -> dict[str, object]:
    for key in _REPEAT_KEYS:
        if key in schema:
            value = schema[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _fail(f"{key} must be a non-negative integer, got {value!r}")
    kind = schema.get("type")
    for key in ("enum", "anyOf", "oneOf"):
        if key in schema and schema[key] == []:
            # The converter wrote "root ::= " for it: the model's reply was "", no JSON.
            raise _fail(f"{key} is empty: no value can match it")
    for low, high, of in (("minLength", "maxLength", "string"), ("minItems", "maxItems", "array")):
        least, most = schema.get(low), schema.get(high)
        if kind in (None, of) and isinstance(least, int) and isinstance(most, int) and most < least:
            # The converter wrote the least and dropped the most (found by fuzzing).
            raise _fail(f"{low} {least} is more than {high} {most}: no {of} can hold both")
    if ("enum" in schema or "const" in schema) and kind is not None:
        schema = _typed_values(schema, kind)
        kind = None
    if isinstance(kind, list) and not any(k in schema for k in ("$ref", "oneOf", "anyOf")):
        if not kind or not all(isinstance(t, str) for t in kind):
            raise _fail(f"type must be a string or a non-empty list of strings, got {kind!r}")
        rest = {k: v for k, v in schema.items() if k != "type"}
        return {"anyOf": [{**rest, "type": t} for t in kind]}
    if any(k in schema for k in _SHAPED):
        return schema
    stringy = kind == "string" or (
        kind is None
        and not any(
            k in schema
            for k in ("properties", "additionalProperties", "allOf", "items", "prefixItems")
        )
    )
    if stringy and ("pattern" in schema or "format" in schema):
        lengths = [k for k in ("minLength", "maxLength") if k in schema]
        if lengths and ("pattern" in schema or schema.get("format") in _SHAPED_FORMATS):
            shape = "pattern" if "pattern" in schema else f"format {schema['format']}"
            raise _fail(
                f"{' and '.join(lengths)} beside a {shape} are not enforced by the grammar: "
                "put the length in the pattern (e.g. ^.{2,5}$) or leave it out"
            )
    counted = "minItems" in schema or "maxItems" in schema
    if kind == "array" and counted and "items" not in schema and "prefixItems" not in schema:
        return {**schema, "items": {"type": _ANY_TYPE}}
    return schema


def _of_type(value: object, kind: object) -> bool:
    """Whether ``value`` (parsed JSON) is of the JSON Schema ``type`` named ``kind``."""
    if kind == "integer":
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and float(value).is_integer()  # type: ignore[arg-type]
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "array": list, "object": dict}
    return value is None if kind == "null" else isinstance(value, kinds.get(str(kind), ()))


def _typed_values(schema: dict[str, object], kind: object) -> dict[str, object]:
    """``schema`` with an ``enum`` kept to the values of its ``type`` (a value of another type
    is no valid instance) and the type then left out, which the values settle: the converter
    read the ``enum`` alone, so ``{"type": "string", "enum": ["a", 1]}`` let the model write
    ``1`` (found by fuzzing). A ``const`` of another type, or no value left, is a 400."""
    kinds = kind if isinstance(kind, list) else [kind]
    rest = {k: v for k, v in schema.items() if k != "type"}
    if "const" in schema and not any(_of_type(schema["const"], t) for t in kinds):
        raise _fail(f"const {schema['const']!r} is not of type {kind}: no value can match it")
    values = schema.get("enum")
    if isinstance(values, list):
        kept = [v for v in values if any(_of_type(v, t) for t in kinds)]
        if not kept:
            raise _fail(f"enum has no value of type {kind}: no value can match it")
        rest["enum"] = kept
    return rest


#: The JSON Schema keywords that constrain a value, by the type they apply to (a keyword of
#: another type's holds vacuously), except ``format`` (an annotation unless a validator is
#: told otherwise) and those docs/server.md lists as not enforced, as in llama-server:
#: ``multipleOf``, ``uniqueItems``, ``minProperties``, ``maxProperties``, ``not``,
#: ``if``/``then``/``else``, ``contains`` (and its ``minContains``/``maxContains``).
_OBJECT_KEYS = frozenset(
    {
        "properties", "required", "additionalProperties", "patternProperties",
        "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
        "unevaluatedProperties",
    }
)  # fmt: skip
_ARRAY_KEYS = frozenset(
    {"items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems", "maxItems"}
)
_STRING_KEYS = frozenset({"minLength", "maxLength", "pattern"})
_NUMBER_KEYS = frozenset(_BOUNDS)
_ANY_KEYS = frozenset({"type", "enum", "const", "allOf", "anyOf", "oneOf", "$ref"})
_KEYS_OF = {
    "object": _OBJECT_KEYS,
    "array": _ARRAY_KEYS,
    "string": _STRING_KEYS,
    "number": _NUMBER_KEYS,
    "integer": _NUMBER_KEYS,
    "boolean": frozenset(),
    "null": frozenset(),
}
_ALL_KEYS = _ANY_KEYS | _OBJECT_KEYS | _ARRAY_KEYS | _STRING_KEYS | _NUMBER_KEYS


def _check_enforced(schema: dict[str, object]) -> None:
    """``GrammarError`` naming the keywords of ``schema`` that the converter's reading of
    this node would drop unsaid (found by review): it reads a node one way, the first that
    applies of ``$ref``, ``anyOf``/``oneOf``, ``const``, ``enum``, an object's properties,
    ``allOf``, an array's items, a string's pattern, format or length, a bare type, and
    ignores every other keyword there (``{"type": "object", "required": ["a"]}`` was any
    object; ``{"enum": [1, 5], "minimum": 3}`` let the model write 1; ``{"type": "string",
    "allOf": [...]}`` any string)."""
    kind = schema.get("type")
    held: set[str] = {"type"}
    applies = _ALL_KEYS if not isinstance(kind, str) else _ANY_KEYS | _KEYS_OF.get(kind, _ALL_KEYS)
    reading = f"type {kind}"
    if "$ref" in schema:
        held, applies, reading = {"type", "$ref"}, _ALL_KEYS, "$ref"
    elif "oneOf" in schema or "anyOf" in schema:
        # The converter takes one of the two lists: with both, the other is dropped.
        reading = "oneOf" if schema.get("oneOf") else "anyOf"
        held.add(reading)
        applies = _ALL_KEYS - {"type"}
    elif "const" in schema or "enum" in schema:
        reading = "const" if "const" in schema else "enum"
        held.add(reading)
        applies = _ALL_KEYS - {"type"}
    elif kind in (None, "object") and (
        "properties" in schema
        or ("additionalProperties" in schema and schema["additionalProperties"] is not True)
    ):
        held |= {"properties", "required", "additionalProperties"}
        if schema.get("unevaluatedProperties") is False and not schema.get("additionalProperties"):
            held.add("unevaluatedProperties")  # the converter writes listed properties only
        applies, reading = _ANY_KEYS | _OBJECT_KEYS, "properties"
        _check_required(schema)
    elif kind in (None, "object") and "allOf" in schema:
        held.add("allOf")
        applies, reading = _ANY_KEYS | _OBJECT_KEYS, "allOf"
        _check_all_of(schema["allOf"])
    elif kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
        applies = _ANY_KEYS | _ARRAY_KEYS
        reading = "items" if schema.get("items") else "prefixItems"
        held |= _items_held(schema)
    elif kind in (None, "string") and ("pattern" in schema or "format" in schema):
        held |= {"pattern"}
        applies = _ANY_KEYS | _STRING_KEYS
        reading = "pattern" if "pattern" in schema else "format"
        if "pattern" not in schema and schema.get("format") not in _SHAPED_FORMATS:
            held |= {"minLength", "maxLength"}  # a plain string: the length branch
    elif kind == "string":
        held |= {"minLength", "maxLength"}
    elif kind in ("integer", "number"):
        held |= _NUMBER_KEYS
    elif kind is None:
        return  # no reading: the converter refuses the node itself (or reads {} as an object)
    dropped = sorted(k for k in schema if k in applies and k not in held)
    if dropped:
        raise _fail(
            f"{', '.join(dropped)} beside {reading}: not enforced by the grammar, which "
            "reads such a node by that alone (leave it out, or move it into the schemas it "
            "applies to)"
        )


def _check_required(schema: Mapping[str, object]) -> None:
    """An object's ``required`` names a property the grammar writes: one not under
    ``properties`` was never written (the converter writes only those as required)."""
    required = schema.get("required", [])
    properties = schema.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        return  # the converter says what is wrong with it
    missing = [name for name in required if name not in properties]
    if missing:
        raise _fail(
            f"required names {', '.join(map(repr, missing))}, not among the properties: "
            "the grammar writes only listed properties as required; give each a schema "
            "under properties"
        )


def _check_all_of(parts: object) -> None:
    """The converter merges ``allOf`` parts by their ``properties`` alone (each a required
    property of the object, unless under an ``anyOf``); any other keyword of a part is
    dropped."""
    if not isinstance(parts, list):
        return
    for part in parts:
        if not isinstance(part, dict):
            continue
        for one in part.get("anyOf", [part]) if isinstance(part.get("anyOf"), list) else [part]:
            if not isinstance(one, dict) or "$ref" in one:
                continue  # resolved by the converter; its own keywords are checked there
            dropped = sorted(
                k for k in one if k in _ALL_KEYS and k not in {"type", "properties", "required"}
            )
            if dropped or one.get("type", "object") != "object":
                what = ", ".join(dropped) or f"type {one.get('type')}"
                raise _fail(
                    f"allOf parts are merged by their properties only: {what} in a part "
                    "is not enforced by the grammar"
                )


def _items_held(schema: Mapping[str, object]) -> set[str]:
    """The array keywords the converter holds: ``items`` as one schema, with the counts; or
    a tuple (``prefixItems``, or draft 4's ``items`` list) of exactly its length, whose
    counts hold only if they admit that length and whose extra items are never written."""
    items = schema.get("items") or schema.get("prefixItems")
    if not isinstance(items, list):
        # One schema for every item; prefixItems beside it was dropped.
        one = {"items", "minItems", "maxItems"}
        return one if schema.get("items") else one | {"prefixItems"}
    held = {"items", "prefixItems"} if not schema.get("items") else {"items"}
    low, high = schema.get("minItems", 0), schema.get("maxItems")
    if isinstance(low, int) and low <= len(items):
        held.add("minItems")
    if high is None or (isinstance(high, int) and high >= len(items)):
        held.add("maxItems")
    if schema.get("additionalItems") is False:
        held.add("additionalItems")
    return held


#: The string formats the converter writes with a rule of their own (a fixed shape).
_SHAPED_FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")


def _bound(schema: Mapping[str, object], key: str) -> float | None:
    value = schema.get(key)
    if value is None or (key.startswith("exclusive") and isinstance(value, bool)):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(f"{key} must be a number, got {value!r}")
    return value


def _integer_rule(schema: Mapping[str, object]) -> str:
    """GBNF of the integers (as the converter writes them: no leading zeros, at most
    ``_MAX_DIGITS`` digits) within ``schema``'s bounds; ``GrammarError`` if there are none.
    A fractional bound is rounded inwards; draft 4's boolean ``exclusive*`` make their
    ``minimum``/``maximum`` exclusive; where both kinds are given, both hold."""
    top = 10**_MAX_DIGITS - 1
    lo, hi = -top, top
    low, high = _limits(schema)  # the tightest bound each side (an integer's is the same)
    if low is not None:
        lo = max(lo, math.ceil(low[0]) if low[1] else math.floor(low[0]) + 1)
    if high is not None:
        hi = min(hi, math.floor(high[0]) if high[1] else math.ceil(high[0]) - 1)
    if lo > hi:
        raise _fail(f"integer bounds admit no integer the grammar can write ({lo} > {hi})")
    alts = []
    if lo < 0:
        alts.append('"-" ' + _magnitudes(max(1, -hi), -lo))
    if hi >= 0:
        alts.append(_magnitudes(max(0, lo), hi))
    return "(" + " | ".join(alts) + ")"


def _limits(schema: Mapping[str, object]) -> tuple[tuple[float, bool] | None, ...]:
    """The tightest (bound, inclusive) below and above, or None where there is none."""
    lows: list[tuple[float, bool]] = []
    highs: list[tuple[float, bool]] = []
    if (minimum := _bound(schema, "minimum")) is not None:
        lows.append((minimum, schema.get("exclusiveMinimum") is not True))
    if (maximum := _bound(schema, "maximum")) is not None:
        highs.append((maximum, schema.get("exclusiveMaximum") is not True))
    if (above := _bound(schema, "exclusiveMinimum")) is not None:
        lows.append((above, False))
    if (below := _bound(schema, "exclusiveMaximum")) is not None:
        highs.append((below, False))
    # The larger low wins, exclusive on a tie; the smaller high, exclusive on a tie.
    low = max(lows, key=lambda b: (b[0], not b[1])) if lows else None
    high = min(highs, key=lambda b: (b[0], b[1])) if highs else None
    return low, high


def _number_rule(schema: Mapping[str, object]) -> str:
    """GBNF of numbers within ``schema``'s bounds, written as the converter writes a number
    but without an exponent. Exact, except near a fractional bound: of the values whose
    integer part is the bound's, only those the integer part alone settles are kept (with
    ``maximum`` 1.5, 1 and 1.0 but not 1.2; with ``minimum`` 0.5, from 1 up): never a value
    outside the bounds. ``GrammarError`` if nothing is left."""
    low, high = _limits(schema)
    alts = []
    # x >= 0, written without a sign: its magnitude is x.
    pos_low = (0.0, True) if low is None or low[0] < 0 else low
    reaches_zero = high is None or high[0] > 0 or (high[0] == 0 and high[1])
    if reaches_zero and (part := _magnitude_rule(pos_low, high)) is not None:
        alts.append(part)
    # x < 0, written "-" and its magnitude m = -x > 0: x >= low is m <= -low.
    if low is None or low[0] < 0:
        neg_low = (0.0, False) if high is None or high[0] >= 0 else (-high[0], high[1])
        neg_high = None if low is None else (-low[0], low[1])
        if (part := _magnitude_rule(neg_low, neg_high)) is not None:
            alts.append('"-" ' + part)
    if not alts:
        raise _fail("number bounds admit no number the grammar can write")
    return "(" + " | ".join(alts) + ")"


def _magnitude_rule(low: tuple[float, bool], high: tuple[float, bool] | None) -> str | None:
    """GBNF of unsigned decimals (``I`` or ``I.F``) between ``low`` and ``high`` (each
    (bound, inclusive), ``low`` >= 0), or None if it writes none of them."""
    top = 10**_MAX_DIGITS - 1
    frac = '("." [0-9]{1,16})?'
    zeros = '("." "0"{1,16})?'
    nonzero = '"." "0"{0,15} [1-9] [0-9]{0,15}'
    (lo, lo_in), (hi, hi_in) = low, (high if high is not None else (float(top) + 1, False))
    alts = []
    # Any fraction: lo <= I (I > lo if lo is excluded) and I + 1 <= hi.
    any_lo = math.ceil(lo) if lo_in else math.floor(lo) + 1
    any_hi = min(top, math.floor(hi) - 1)  # x < I + 1 <= floor(hi) <= hi
    if any_lo <= any_hi:
        alts.append(f"{_magnitudes(any_lo, any_hi)} {frac}")
    # The integers themselves (and I.0...): lo <= I <= hi, ends as their inclusivity says.
    int_lo = any_lo
    int_hi = min(top, math.floor(hi) if hi_in or hi != math.floor(hi) else math.floor(hi) - 1)
    if int_lo <= int_hi:
        alts.append(f"{_magnitudes(int_lo, int_hi)} {zeros}")
    # An excluded integer low with a fraction that is not all zeros: past low, below low + 1
    # (an included one is among the integer parts above already).
    if not lo_in and lo == math.floor(lo) and lo + 1 <= hi and lo <= top:
        alts.append(f'"{int(lo)}" {nonzero}')
    return None if not alts else "(" + " | ".join(alts) + ")"


def _magnitudes(lo: int, hi: int) -> str:
    """GBNF of the decimal numerals of ``lo`` to ``hi`` (0 <= lo <= hi), no leading zeros."""
    alts = []
    full: list[int] = []  # lengths of 2+ digits wholly inside: one alternative for them all
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        first = 0 if digits == 1 else 10 ** (digits - 1)
        if digits > 1 and lo <= first and 10**digits - 1 <= hi:
            full.append(digits)
            continue
        alts.extend(_same_length(str(max(lo, first)), str(min(hi, 10**digits - 1))))
    if full:
        low, high = full[0] - 1, full[-1] - 1
        alts.append(f"[1-9] [0-9]{{{low}}}" if low == high else f"[1-9] [0-9]{{{low},{high}}}")
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives matching the numerals ``lo`` to ``hi``, both of one length."""
    if lo == hi:
        return [f'"{lo}"']
    n = len(lo) - 1
    rest = "" if n == 0 else (" [0-9]" if n == 1 else f" [0-9]{{{n}}}")
    if lo[1:] == "0" * n and hi[1:] == "9" * n:
        return [_digit_class(lo[0], hi[0]) + rest]
    if lo[0] == hi[0]:
        tail = _same_length(lo[1:], hi[1:])
        inner = tail[0] if len(tail) == 1 else "(" + " | ".join(tail) + ")"
        return [f'"{lo[0]}" {inner}']
    out = _same_length(lo, lo[0] + "9" * n)
    if int(lo[0]) + 1 <= int(hi[0]) - 1:
        out.append(_digit_class(str(int(lo[0]) + 1), str(int(hi[0]) - 1)) + rest)
    out.extend(_same_length(hi[0] + "0" * n, hi))
    return out


def _digit_class(lo: str, hi: str) -> str:
    return f"[{lo}]" if lo == hi else f"[{lo}-{hi}]"


def _parsed(schema: Mapping[str, object] | str) -> tuple[str, object]:
    """``schema`` as JSON text and as a value (None where the text is no JSON: the converter
    says what is wrong with it), its repeats and patterns checked."""
    text = _schema_text(schema)
    try:
        parsed: object = json.loads(text)
    except (ValueError, RecursionError):
        parsed = None
    _check_repeats(parsed)
    _check_patterns(parsed)
    return text, parsed


def _schema_text(schema: Mapping[str, object] | str) -> str:
    """``schema`` as the JSON text the converter reads."""
    if isinstance(schema, str):
        return schema
    try:
        return json.dumps(dict(schema))
    except RecursionError as exc:
        raise GrammarError("JSON schema nests too deeply", param="json_schema") from exc
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"JSON schema is not serialisable: {exc}", param="json_schema") from exc


def _converting(convert: Callable[[], str]) -> str:
    """``convert()``'s grammar; the converter's failures as ``GrammarError``s."""
    try:
        grammar = convert()
    except GrammarError:
        raise  # kvwarm's own checks of a node (``_fix_visits``): already saying what is wrong
    except RecursionError as exc:
        raise GrammarError("JSON schema nests too deeply", param="json_schema") from exc
    except Exception as exc:  # the third-party converter raises assorted types
        raise GrammarError(f"unsupported JSON schema: {exc}", param="json_schema") from exc
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError("JSON schema produced an empty grammar", param="json_schema")
    return grammar


#: ``schema_to_gbnf``'s results by the schema's JSON text (the same checks and converter run
#: on the same text give the same grammar): a 100,000-value enum converts in ~0.8 s.
_CONVERTED = TextMemo(8 * MAX_GRAMMAR_BYTES, turns=LARGE_TURNS)


def schema_to_gbnf(schema: Mapping[str, object] | str, scope: bytes | None = None) -> str:
    """GBNF whose language is the JSON documents valid under ``schema`` (converted once per
    ``scope``, a cache salt: ``TextMemo``)."""
    return _CONVERTED.get(_schema_text(schema), _schema_text_to_gbnf, scope or b"")


def _schema_text_to_gbnf(text: str) -> str:
    _parsed(text)
    convert = cast(Callable[[str], str], _converter_module().json_schema_to_gbnf)
    return _converting(lambda: convert(text))


def schemas_to_rules(schemas: Sequence[Mapping[str, object]], prefix: str) -> tuple[str, list[str]]:
    """GBNF rules (no ``root``) for several schemas, and the name of each one's rule (the
    JSON documents valid under it), each named from ``prefix`` and its index: a grammar
    that puts them in a larger one (a tool call's format around each tool's arguments).
    One converter writes them all, so the rules they share (``space``, ``string``) are
    written once and two different ones of one name told apart; each schema's ``$ref``s
    resolve within it."""
    module = _converter_module()
    converter = module.SchemaConverter(
        prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
    )
    names: list[str] = []

    def convert() -> str:
        for i, schema in enumerate(schemas):
            text, _ = _parsed(schema)
            resolved = converter.resolve_refs(json.loads(text), f"kvwarm-schema-{i}")
            names.append(str(converter.visit(resolved, f"{prefix}-{i}")))
        return str(converter.format_grammar())

    return _converting(convert), names
