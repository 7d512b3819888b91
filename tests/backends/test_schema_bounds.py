"""What a JSON schema's grammar lets the model write is what the schema allows (found by
review): llama-cpp-python's converter translated a ``pattern`` character for character (a raw
``"`` or newline, a lone backslash: invalid JSON), ignored an integer's bounds, dropped a
nullable type's keywords and an array's counts without ``items``, and crashed (or said
nothing) on badly typed counts. Each grammar is read here as a regular expression
(``gbnfkit``) and asked, text by text, what it accepts."""

from __future__ import annotations

import json
import re

import pytest
from tests.backends.gbnfkit import accepts

from kvwarm.backends.base import BackendContext, BackendModel, BatchToken, Sampler
from kvwarm.backends.grammar import schema_to_gbnf
from kvwarm.errors import GrammarError

SAMPLES = [
    "", "a", "ab", "abc", 'a"b', '"', "\\", "a\\b", "a\nb", "\t", "\x01", "\x7f", "é", "日本",
    "😀", "123", "12a", "a1", "--", "x-y", "{}", "[a]", "a.b", " ", "AbC_9", "\b", "\x0c",
]  # fmt: skip

PATTERNS = [
    "^a$", '^a"b$', "^.$", "^.*$", "^.+$", "^[^a]$", "^[^a]*$", '^["a]+$', "^[a-c]+$",
    "^\\d+$", "^\\D$", "^\\w+$", "^\\W$", "^\\s$", "^\\S+$", "^a\\\\b$", "^a\\nb$", "^\\x22$",
    "^\\u00e9$", "^(ab|c)+$", "^(?:a|)b$", "^a{2,3}$", "^[\\]a]$", "^a|b$", "b", "^a", "c$",
    "^[\\\\\"]$", "^[^\\s]*$", "^\\{x\\}$", "^\\.$", "^a?b*c+$", "^[-a]$", "^[a-]$",
    "^\\t$", "^[\\t\\n]+$", "^$",
]  # fmt: skip


def _python(pattern: str) -> str:
    """The pattern as Python's ``re`` reads it the way ECMA-262 does: ``.`` leaves out every
    line terminator, not only the newline."""
    return re.sub(r"(?<!\\)\.", lambda _: "[^\\n\\r\\u2028\\u2029]", pattern)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_accepts_exactly_the_json_of_the_strings_it_matches(pattern: str) -> None:
    grammar = schema_to_gbnf({"type": "string", "pattern": pattern})
    rx = re.compile(_python(pattern), re.ASCII)  # ECMA's \d, \w: ASCII (no Unicode space here)
    for value in SAMPLES:
        text = json.dumps(value, ensure_ascii=False)
        assert accepts(grammar, text) == bool(rx.search(value)), (pattern, value, grammar)


@pytest.mark.parametrize("pattern", ["^.*$", "^[^a]*$", '^a"b$', "^a\\\\b$", "^a\\nb$", "b"])
def test_a_pattern_never_accepts_text_that_is_not_its_json(pattern: str) -> None:
    """The texts the converter's grammars let through: a raw quote, a lone backslash, a raw
    control character."""
    grammar = schema_to_gbnf({"type": "string", "pattern": pattern})
    for text in ['"a"b"', '"a\\b"', '"a\nb"', '"\\"', '"\x01"', '"\\x"', '"b\\"']:
        if accepts(grammar, text):
            assert isinstance(json.loads(text), str), (pattern, text)


#: Schemas whose strings are the converter's ``char`` rule (no ``pattern``): a plain string, a
#: bounded one, a nullable one, an object's property, ``json_object``'s free object.
CHAR_SCHEMAS = {
    "string": ({"type": "string"}, "{}"),
    "bounded": ({"type": "string", "minLength": 1, "maxLength": 3}, "{}"),
    "nullable": ({"type": ["string", "null"]}, "{}"),
    "property": (
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        '{{"a": {}}}',
    ),
    "json_object": ({"type": "object"}, '{{"k": {}}}'),
}


@pytest.mark.parametrize("case", sorted(CHAR_SCHEMAS))
def test_a_string_is_written_as_json_text(case: str) -> None:
    """The converter's ``char`` let the model write a raw newline or other control character
    inside a string: no JSON at all (found by review, SmolLM2 wrote one unprompted)."""
    schema, around = CHAR_SCHEMAS[case]
    grammar = schema_to_gbnf(schema)
    bounded = "maxLength" in schema
    for value in SAMPLES:
        if not bounded or 1 <= len(value) <= 3:
            text = around.format(json.dumps(value, ensure_ascii=False))
            assert accepts(grammar, text), (case, value, grammar)
    for raw in ["a\nb", "\n", "\t", "\r", "\x01", "\x1f", "\x00"]:
        assert not accepts(grammar, around.format(f'"{raw}"')), (case, raw, grammar)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("^(?=a)a$", "lookarounds"),
        ("^(a)\\1$", "escape \\1"),
        ("^\\bx$", "escape \\b"),
        ("^a^b$", "anchor"),
        ("^(a", "unbalanced"),
        ("^a)$", "unbalanced"),
        ("^*$", "nothing to repeat"),
        ("^a**$", "after a quantifier"),
        ("^[b-a]$", "out of order"),
        ("^a{3,2}$", "out of order"),
        ("^[^\\s\\S]$", "matches no character"),
        ("^\\x4$", "hex digits"),
        ("^[a$", "unterminated class"),
    ],
)
def test_a_pattern_the_grammar_cannot_hold_is_refused(pattern: str, why: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(why)) as info:
        schema_to_gbnf({"type": "string", "pattern": pattern})
    assert info.value.param == "json_schema"


BOUNDS = [
    ({"minimum": 0}, 0, None),
    ({"minimum": -17}, -17, None),
    ({"maximum": 42}, None, 42),
    ({"maximum": -3}, None, -3),
    ({"minimum": -120, "maximum": 7}, -120, 7),
    ({"minimum": 5, "maximum": 5}, 5, 5),
    ({"minimum": 9, "maximum": 101}, 9, 101),
    ({"exclusiveMinimum": 0, "exclusiveMaximum": 100}, 1, 99),
    ({"minimum": 0.5, "maximum": 9.5}, 1, 9),
    ({"exclusiveMinimum": 2.5, "maximum": 30}, 3, 30),
    ({"minimum": 3, "exclusiveMinimum": True, "maximum": 8, "exclusiveMaximum": True}, 4, 7),
    ({"minimum": 0, "exclusiveMinimum": 10}, 11, None),
]


@pytest.mark.parametrize(("bounds", "lo", "hi"), BOUNDS)
def test_an_integer_holds_to_its_bounds(
    bounds: dict[str, object], lo: int | None, hi: int | None
) -> None:
    grammar = schema_to_gbnf({"type": "integer", **bounds})
    for x in [*range(-150, 150), 999, 1000, 12345, -999, -1000, 10**15, -(10**15)]:
        inside = (lo is None or x >= lo) and (hi is None or x <= hi)
        assert accepts(grammar, str(x)) == inside, (bounds, x)
    for text in ["01", "-0", "+1", "1.0", "", "-"]:
        assert not accepts(grammar, text), (bounds, text)


NUMBER_BOUNDS = [
    {"minimum": 0, "maximum": 1},
    {"exclusiveMinimum": 0},
    {"minimum": -2.5, "maximum": 3.25},
    {"exclusiveMinimum": -1, "exclusiveMaximum": 1},
    {"maximum": -0.5},
    {"minimum": 10, "exclusiveMaximum": 12},
    {"minimum": 0.5, "exclusiveMinimum": True},
]
NUMBERS = [
    "0", "1", "-1", "0.5", "1.0", "1.5", "0.0", "-0.5", "2", "-2", "-2.5", "-3", "3.25", "3.3",
    "10", "11.99", "12", "12.0", "0.25", "-0.25", "100", "-100", "0.00001", "1.00",
]  # fmt: skip


@pytest.mark.parametrize("bounds", NUMBER_BOUNDS)
def test_a_number_holds_to_its_bounds(bounds: dict[str, object]) -> None:
    """Never a value outside them (the converter ignored them: llama-server wrote
    5000000000000198.9999999999999999E+0 for minimum 0, maximum 1); every integer inside,
    and the decimals whose integer part settles it."""
    grammar = schema_to_gbnf({"type": "number", **bounds})

    def inside(x: float) -> bool:
        checks = {
            "minimum": lambda b: x > b if bounds.get("exclusiveMinimum") is True else x >= b,
            "maximum": lambda b: x < b if bounds.get("exclusiveMaximum") is True else x <= b,
            "exclusiveMinimum": lambda b: isinstance(b, bool) or x > b,
            "exclusiveMaximum": lambda b: isinstance(b, bool) or x < b,
        }
        return all(checks[k](v) for k, v in bounds.items())

    for text in NUMBERS:
        if accepts(grammar, text):
            assert inside(float(text)), (bounds, text)
        elif inside(float(text)) and float(text) == int(float(text)):
            raise AssertionError(f"{bounds}: an integer inside refused: {text}")
    assert not accepts(grammar, "1e0") and not accepts(grammar, "")


def test_a_unit_interval_and_a_positive_number_keep_their_fractions() -> None:
    unit = schema_to_gbnf({"type": "number", "minimum": 0, "maximum": 1})
    assert [accepts(unit, t) for t in ["0.7", "1", "1.0", "1.5", "-0.1"]] == [1, 1, 1, 0, 0]
    positive = schema_to_gbnf({"type": "number", "exclusiveMinimum": 0})
    assert [accepts(positive, t) for t in ["0.001", "7.5", "0", "0.0", "-1"]] == [1, 1, 0, 0, 0]


def test_an_integer_within_a_nullable_type_keeps_its_bounds_and_a_string_its_length() -> None:
    grammar = schema_to_gbnf({"type": ["integer", "null"], "minimum": 1, "maximum": 3})
    assert [accepts(grammar, t) for t in ["0", "1", "3", "4", "null"]] == [0, 1, 1, 0, 1]
    grammar = schema_to_gbnf({"type": ["string", "null"], "maxLength": 2})
    assert [accepts(grammar, t) for t in ['"ab"', '"abc"', "null"]] == [1, 0, 1]
    grammar = schema_to_gbnf({"type": ["string", "null"], "pattern": "^x+$"})
    assert [accepts(grammar, t) for t in ['"xx"', '"y"', "null"]] == [1, 0, 1]


def test_an_array_holds_to_its_counts_without_items() -> None:
    grammar = schema_to_gbnf({"type": "array", "minItems": 2, "maxItems": 3})
    accepted = [accepts(grammar, t) for t in ["[]", "[1]", "[1,2]", "[1,2,3]", "[1,2,3,4]"]]
    assert accepted == [False, False, True, True, False]


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"type": "string", "minLength": "3"}, "minLength must be a non-negative integer"),
        ({"type": "string", "maxLength": 2.5}, "maxLength must be a non-negative integer"),
        ({"type": "string", "minLength": -1}, "minLength must be a non-negative integer"),
        ({"type": "array", "minItems": True}, "minItems must be a non-negative integer"),
        ({"type": "string", "pattern": "^a+$", "minLength": 2}, "beside a pattern"),
        ({"type": "string", "format": "date", "maxLength": 4}, "beside a format date"),
        ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "admit no number"),
        ({"type": "number", "maximum": float("nan")}, "maximum must be a number"),
        ({"type": "integer", "minimum": "0"}, "minimum must be a number"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "admit no integer"),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "admit no integer"),
        ({"type": "string", "pattern": 5}, "pattern must be a string"),
        # Found by fuzzing: the converter wrote the least and dropped the most, and an empty
        # list became "root ::= ", a reply of no JSON at all.
        ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is more than"),
        ({"type": "array", "minItems": 3, "maxItems": 1, "items": {}}, "minItems 3 is more"),
        ({"type": ["string", "null"], "minLength": 2, "maxLength": 1}, "no string can hold"),
        ({"enum": []}, "enum is empty"),
        ({"type": "null", "enum": [1]}, "enum has no value of type null"),
        ({"type": "string", "const": 3}, "const 3 is not of type string"),
        ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "'a' is false"),
        ({"anyOf": []}, "anyOf is empty"),
        ({"type": "object", "properties": {"a": {"oneOf": []}}}, "oneOf is empty"),
        # Keywords the converter's reading of the node dropped unsaid (found by review).
        ({"type": "object", "required": ["a"]}, "required beside type object"),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
            "required names 'b', not among the properties",
        ),
        ({"type": "integer", "enum": [1, 5, 10], "minimum": 3}, "minimum beside enum"),
        ({"const": "abc", "pattern": "^x$"}, "pattern beside const"),
        ({"type": "string", "allOf": [{"minLength": 3}]}, "allOf beside type string"),
        ({"anyOf": [{"type": "string"}, {"type": "null"}], "maxLength": 3}, "maxLength beside"),
        (
            {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
            "patternProperties beside properties",
        ),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames beside type"),
        (
            {"properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
            "dependentRequired beside properties",
        ),
        (
            {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}},
            "prefixItems beside items",
        ),
        ({"type": "array", "prefixItems": [{"type": "string"}], "minItems": 2}, "minItems"),
        (
            {"allOf": [{"properties": {"a": {}}, "additionalProperties": False}]},
            "allOf parts are merged by their properties only: additionalProperties",
        ),
    ],
)
def test_a_constraint_the_grammar_would_not_hold_is_refused(
    schema: dict[str, object], why: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(why)) as info:
        schema_to_gbnf(schema)
    assert info.value.param == "json_schema"


@pytest.mark.parametrize(
    "schema",
    [
        # What the grammar holds beside each reading, and pydantic's shapes, stay accepted.
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
         "minItems": 2, "maxItems": 2},
        {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
         "unevaluatedProperties": False},
        {"$defs": {"A": {"type": "integer"}}, "type": "object",
         "properties": {"a": {"$ref": "#/$defs/A", "type": "integer", "description": "x"}}},
        {"enum": ["a", "b"], "type": "string", "title": "E", "default": "a"},
        {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}], "default": None},
        {"type": "string", "format": "email", "maxLength": 30},
        # Documented as not enforced, as in llama-server (docs/server.md): still served.
        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        {"type": "integer", "multipleOf": 5},
        # Boolean schemas: true is any value (the converter failed on it, found by fuzzing).
        {"type": "object", "properties": {"a": True}, "required": ["a"]},
        {"type": "array", "items": True},
    ],
)  # fmt: skip
def test_keywords_the_grammar_holds_beside_a_reading_are_accepted(
    schema: dict[str, object],
) -> None:
    assert schema_to_gbnf(schema)


def test_a_property_named_by_the_empty_string_keeps_the_root_an_object() -> None:
    """Found by fuzzing: the converter named a top-level property "" by its parent's name,
    which is "root" at the top, so the grammar's root was that property's value (a string)
    and never the object the schema asks for."""
    grammar = schema_to_gbnf(
        {"type": "object", "properties": {"": {"type": "string"}}, "required": [""]}
    )
    assert [accepts(grammar, t) for t in ['{"": "x"}', '"x"', "{}"]] == [1, 0, 0]
    nested = schema_to_gbnf(
        {"type": "object", "properties": {"": {"type": "object", "properties": {"": {}}}}}
    )
    assert [accepts(nested, t) for t in ['{"": {"": {}}}', "{}", '"x"', '{"": 1}']] == [1, 1, 0, 0]
    # A $defs entry named "" is visited under that name too (its $ref ends in "/").
    ref = schema_to_gbnf(
        {
            "$defs": {"": {"type": "integer"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/"}},
            "required": ["a"],
        }
    )
    assert [accepts(ref, t) for t in ['{"a": 1}', "1", '{"a": "x"}']] == [1, 0, 0]


def test_an_enum_holds_only_the_values_of_its_type() -> None:
    """Found by fuzzing: the converter read an ``enum`` alone, so a value of another type than
    the node's (no valid instance) was one the model could write."""
    grammar = schema_to_gbnf({"type": "string", "enum": ["a", 1, None, {"x": 1}]})
    assert [accepts(grammar, t) for t in ['"a"', "1", "null", '{"x": 1}']] == [1, 0, 0, 0]
    nullable = schema_to_gbnf({"type": ["integer", "null"], "enum": [1, 1.5, None, True, "1"]})
    assert [accepts(nullable, t) for t in ["1", "null", "1.5", "true", '"1"']] == [1, 1, 0, 0, 0]


def test_a_tuple_holds_to_its_length() -> None:
    grammar = schema_to_gbnf(
        {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 1, "maxItems": 1}
    )
    assert [accepts(grammar, t) for t in ["[]", "[1]", "[1,2]"]] == [0, 1, 0]


LLAMA_SCHEMAS = [
    {"type": "string", "pattern": '^[^a]{1,6}"x$'},
    {"type": "string", "pattern": "^.+$"},
    {"type": "string", "pattern": "^\\u00e9\\\\[\\d\\s]*$"},
    {"type": "string", "pattern": "b"},
    {"type": "integer", "minimum": -120, "maximum": 7},
    {"type": ["integer", "null"], "exclusiveMinimum": 10},
    {"type": "number", "minimum": -2.5, "maximum": 3.25},
    {"type": "array", "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"": {"type": "string"}}, "required": [""]},  # rule -kv
]


@pytest.mark.model
def test_llama_cpp_reads_these_grammars_and_holds_the_model_to_them() -> None:
    """The grammars parse in llama.cpp (its classes' ``\\U`` escapes, ``{m,n}``), and what
    the real model writes under a pattern's is a JSON string the pattern matches."""
    from kvwarm.backends import get_backend
    from kvwarm.backends.base import ContextParams, SamplingParams
    from kvwarm.embedded import default_model_path

    small = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=1, n_threads=2)

    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    try:
        for schema in LLAMA_SCHEMAS:
            model.new_sampler(SamplingParams(grammar=schema_to_gbnf(schema))).close()
        ctx = model.new_context(model.context_params(small, deterministic=False))
        try:
            pattern = '^[^a]{1,6}"x$'
            grammar = schema_to_gbnf({"type": "string", "pattern": pattern})
            prompt = model.tokenize('Write a quote: "')
            ctx.prefill(0, prompt, 0)
            sampler = model.new_sampler(SamplingParams(temperature=0.9, seed=3, grammar=grammar))
            out = _sample_reply(model, ctx, sampler, len(prompt), 64)
            text = model.detokenize(out).strip()
            assert re.search(pattern, json.loads(text)), text
        finally:
            ctx.close()
    finally:
        model.close()


def _sample_reply(
    model: BackendModel, ctx: BackendContext, sampler: Sampler, n_prompt: int, limit: int
) -> list[int]:
    """Up to ``limit`` tokens sampled after a prompt of ``n_prompt`` tokens (prefilled in
    sequence 0), each decoded after it, until an end-of-generation token; closes ``sampler``."""
    out: list[int] = []
    try:
        for _ in range(limit):
            token = sampler.sample(ctx, -1)
            if model.is_eog(token):
                break
            out.append(token)
            ctx.decode([BatchToken(token, n_prompt + len(out) - 1, 0, logits=True)])
    finally:
        sampler.close()
    return out


@pytest.mark.model
def test_llama_cpp_holds_a_string_to_json_text_when_the_model_wants_a_newline() -> None:
    """On the real model, a string's grammar masks a raw newline however much the model wants
    one (its tokens biased up): the converter's ``char`` let it through, and the reply was
    no JSON (found by review)."""
    from kvwarm.backends import get_backend
    from kvwarm.backends.base import ContextParams, SamplingParams
    from kvwarm.embedded import default_model_path

    small = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=1, n_threads=2)
    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    try:
        pieces, _ = model.vocabulary()
        raw = [t for t, piece in enumerate(pieces) if piece and piece.strip(b"\n\t") == b""]
        assert raw  # "\n", "\n\n", "\t"...: the tokens a string must not hold
        ctx = model.new_context(model.context_params(small, deterministic=False))
        try:
            prompt = model.tokenize("A poem in two lines:")
            ctx.prefill(0, prompt, 0)
            params = SamplingParams(
                temperature=0.0,
                grammar=schema_to_gbnf({"type": "string", "maxLength": 8}),
                logit_bias=tuple((t, 50.0) for t in raw),
            )
            out = _sample_reply(model, ctx, model.new_sampler(params), len(prompt), 16)
            text = model.detokenize(out)
            assert not set(text) & {"\n", "\t"}, text
            assert isinstance(json.loads(text), str), text
        finally:
            ctx.close()
    finally:
        model.close()
