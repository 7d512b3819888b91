"""Issue 23: an explosively ambiguous GBNF grammar is a 400 naming the rule, before any backend
compiles it; ordinary grammars pass."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tests.server.conftest import LOW_POLICY, stub_settings, wait_ready

from kvwarm.backends.grammar import schema_to_gbnf
from kvwarm.backends.grammar_cost import (
    cheap_grammar,
    check_grammar_cost,
    grammar_ways,
    grammar_widths,
)
from kvwarm.errors import GrammarError
from kvwarm.server import create_app
from kvwarm.settings import ModelSpec, Settings


def doubling(depth: int) -> str:
    """The issue's reproducer: ``r{i} ::= r{i+1} r{i+1} | "a"``, ``depth + 1`` rules."""
    lines = ["root ::= r0"]
    lines += [f'r{i} ::= r{i + 1} r{i + 1} | "a"' for i in range(depth)]
    lines.append(f'r{depth} ::= "a"')
    return "\n".join(lines)


def test_the_41_rule_doubling_grammar_is_rejected_naming_a_rule() -> None:
    with pytest.raises(GrammarError) as info:
        check_grammar_cost(doubling(40))
    assert info.value.param == "grammar"
    assert "'r" in str(info.value)  # names the (deepest) rule that explodes


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "yes" | "no"',
        'root ::= [a-z]+ (" " [a-z]+)*',
        # Recursive JSON-like value: recursion counts once, not forever.
        'root ::= value\nvalue ::= "[" (value ("," value)*)? "]" | [0-9]+ # comment\n',
        "root ::= " + " | ".join(f'"w{i}"' for i in range(2000)),
        doubling(3),
    ],
)
def test_ordinary_grammars_pass(grammar: str) -> None:
    cheap_grammar(grammar)  # 2,000 literals pass factored (issue 41), not as 2,000 stacks


def test_a_schema_with_many_optional_fields_passes() -> None:
    props = {f"f{i}": {"type": "string"} for i in range(25)}
    check_grammar_cost(schema_to_gbnf({"type": "object", "properties": props}))


def test_ways_grow_as_expected() -> None:
    ways, order = grammar_ways(doubling(4))
    assert ways["r4"] == 1 and ways["r3"] == 2 and ways["r2"] == 5 and ways["r0"] == 677
    assert order.index("r4") < order.index("r0")


def test_an_unparsable_grammar_is_left_to_the_backend() -> None:
    check_grammar_cost("no root here ((")


def test_stub_server_answers_400_naming_the_rule() -> None:
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        body = {"model": "a", "prompt": "x", "max_tokens": 2, "grammar": doubling(40)}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400, response.json()
        error = response.json()["error"]
        assert error["code"] == "invalid_grammar" and "rule 'r" in error["message"]
        assert client.get("/health").status_code == 200


@pytest.fixture(scope="module")
def real_client() -> Iterator[TestClient]:
    settings = Settings(
        models=(ModelSpec(),),
        cache_dir=None,
        n_ctx=512,
        n_batch=64,
        policy=LOW_POLICY,
        keepalive_interval_s=0,
        default_max_tokens=4,
        allowed_hosts=("testserver",),
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        yield client


@pytest.mark.model
def test_real_model_rejects_the_41_rule_grammar_quickly(real_client: TestClient) -> None:
    body = {"prompt": "x", "max_tokens": 2, "grammar": doubling(40)}
    start = time.monotonic()
    response = real_client.post("/v1/completions", json=body)
    elapsed = time.monotonic() - start
    assert response.status_code == 400, response.json()
    assert response.json()["error"]["code"] == "invalid_grammar"
    assert elapsed < 2.0, elapsed
    ok = real_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200


def test_nesting_is_bounded_before_llama_cpp_parses_it() -> None:
    """llama.cpp's parser recurses once per group: 20,000 overflowed its thread's stack."""
    from kvwarm.backends.grammar_cost import MAX_GRAMMAR_DEPTH, grammar_depth

    def nested(depth: int) -> str:
        return "root ::= " + "(" * depth + '"a"' + ")?" * depth

    assert grammar_depth(nested(7)) == 7
    # Parentheses in literals, classes (escaped quotes and brackets too) and comments are text.
    assert grammar_depth('root ::= "((\\"((" [()\\]((] # (((\n x ::= ("b")') == 1
    check_grammar_cost(nested(MAX_GRAMMAR_DEPTH))
    with pytest.raises(GrammarError, match=f"nests groups {MAX_GRAMMAR_DEPTH + 1} deep"):
        check_grammar_cost(nested(MAX_GRAMMAR_DEPTH + 1))
    with pytest.raises(GrammarError, match="nests groups 50000 deep"):
        check_grammar_cost(nested(50_000))


def test_an_explosive_rule_beside_a_deep_group_is_still_weighed() -> None:
    """The ambiguity parser once gave up past 200 nested groups and let the whole grammar
    through: one deep group anywhere hid an explosive rule from the bound."""
    deep = "deep ::= " + "(" * 300 + '"a"' + ")?" * 300
    with pytest.raises(GrammarError, match="too ambiguous") as info:
        check_grammar_cost(doubling(40) + "\n" + deep)
    assert "'(" not in str(info.value)  # names a rule of the grammar, not a group
    # And groups weigh as before: a group inside an explosive rule, at depth 900.
    hidden = "root ::= " + "(" * 900 + "r0" + ")" * 900 + "\n" + doubling(40).split("\n", 1)[1]
    with pytest.raises(GrammarError, match="too ambiguous"):
        check_grammar_cost(hidden)
    check_grammar_cost(doubling(3) + "\n" + deep)


# Found by review: a repeated part that can match nothing leaves llama.cpp's grammar engine one
# stack per repetition for every byte, and its work per token grows with the fourth power of the
# count: ("a"?){0,100} ~4 s a token on SmolLM2, {0,300} minutes, from a 25-byte grammar (or a
# JSON-schema pattern, which the converter turns into nested optionals of the same part).
EMPTY_REPEATS = {
    "optional_repeated": 'root ::= ("a"?){0,300}',
    "repeat_of_a_repeat": 'root ::= x{0,300}\nx ::= "a"{0,300}',
    "inside_a_sequence": 'root ::= "{" (ws item?){0,100} "}"\nws ::= [ ]*\nitem ::= "x"',
    "nested_repeats": 'root ::= (("a"?){0,5}){0,5}',
    "schema_pattern": schema_to_gbnf({"type": "string", "pattern": "^(a?){0,300}$"}),
}


@pytest.mark.parametrize("case", sorted(EMPTY_REPEATS))
def test_repeating_what_can_be_empty_is_bounded(case: str) -> None:
    with pytest.raises(GrammarError, match="can match nothing") as info:
        check_grammar_cost(EMPTY_REPEATS[case])
    assert info.value.param == "grammar"
    assert "'(" not in str(info.value)  # names a rule of the grammar, not a group


# Found by review: an unbounded repeat of a part that is itself an unbounded repetition lets a
# token's bytes split among the repeats in many ways, and llama.cpp follows each for every token
# a broad class admits: ([^a]+)+ 0.2 s a token on SmolLM2, [^a]{1,}{1,}{2}* 33 s (one request
# stalled its model's every request). llama.cpp reads x{1,}{1,} as (x{1,}){1,}.
NESTED_REPEATS = {
    "group": 'root ::= ([^a]+)+ "b"',
    "stacked_operators": "root ::= [^a]{1,}{1,}",
    "fuzzed": "root ::= [^a] {1,} {1,} {2} * [a-c]",
    "through_a_rule": "root ::= x+\nx ::= [a]+",
    "written_as_recursion": "root ::= x+\nx ::= [a] x | [a]",
    "beside_optionals": 'root ::= (x* y?)*\nx ::= "a"\ny ::= "b"',
    "bounded_inside": "root ::= (([^a]+){2})*",
    # A part that can end with more of itself: minutes for one token, in one grammar step.
    "ending_with_itself": "root ::= [^a] root {1,} {0,2}",
    "schema_pattern": schema_to_gbnf({"type": "string", "pattern": "^(\\w+\\s?)+$"}),
}


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= y root "b" | "a"\ny ::= "x"?',  # llama.cpp's compile never returned
        'root ::= y root "\\xc3" "ab"?\ny ::= "\\n"{0,2}',  # the fuzz's
        'root ::= x | "a"\nx ::= ([ ]*) root "b"',
    ],
)
def test_left_recursion_through_what_can_be_empty_is_refused(grammar: str) -> None:
    with pytest.raises(GrammarError, match="can begin with itself") as info:
        check_grammar_cost(grammar)
    assert "'root'" in str(info.value) and info.value.param == "grammar"


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "a"{5,2}',  # the fuzz's: llama.cpp counted 2 - 5 optional repeats unsigned
        'root ::= ("a" | "b") { 3 , 0 } "c"',
        "root ::= x\nx ::= ( [a]{1500,1000} )",
        'root ::= ("a"{2}\n  # a comment } here\n  {9 ,\n 8})',  # spaces and comments between
    ],
)
def test_a_repetition_whose_most_is_below_its_least_is_refused(grammar: str) -> None:
    with pytest.raises(GrammarError, match="most below its least") as info:
        check_grammar_cost(grammar)
    assert info.value.param == "grammar"


@pytest.mark.parametrize(
    "grammar", ['root ::= "a"{2,2} "{5,2}" [{}] # {5,2}\n', 'root ::= "a"{0,} "b"{3} "c"{1,2}']
)
def test_repetitions_in_order_and_braces_in_text_pass(grammar: str) -> None:
    check_grammar_cost(grammar)


@pytest.mark.parametrize(
    "grammar",
    [
        "root ::= [\\U0011FFFF]",  # the fuzz's: SmolLM2 wrote 3 tokens of bytes, U+FFFD
        'root ::= "a\\uDFFF"',
        "root ::= [a\\uD800]",
        "root ::= [\\uD800-\\uDFFF]",
        "root ::= [a-\\U00110000]",
    ],
)
def test_an_escape_naming_no_text_is_refused(grammar: str) -> None:
    with pytest.raises(GrammarError, match="which no text holds") as info:
        check_grammar_cost(grammar)
    assert info.value.param == "grammar"


@pytest.mark.parametrize(
    "grammar",
    [
        "root ::= [^\\uD800-\\uDFFF]",  # a negated class may leave out anything
        "root ::= [\\u0000-\\uFFFF] [a-\\U0010FFFF]",  # a range with text at one end
        'root ::= "\\\\uD800" # \\uD800\n',  # an escaped backslash, a comment
        'root ::= "\\x41\\u00e9\\U0001F600" [\\]\\-]',
    ],
)
def test_escapes_naming_text_pass(grammar: str) -> None:
    check_grammar_cost(grammar)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "a"{0,5000}',  # llama.cpp read it as "a"*: any number of letters
        'root ::= "a"{0,2001} "b"',
        "root ::= [a-z]{3,100000}",
        'root ::= "a"{2001}',  # llama.cpp refuses these itself, unsaid ("does not compile")
        'root ::= ("ab"){2001,}',
        'root ::= "a"{ 2500 }',
    ],
)
def test_a_repetition_count_llama_cpp_bounds_is_refused(grammar: str) -> None:
    with pytest.raises(GrammarError, match="more than 2000") as info:
        cheap_grammar(grammar)
    assert info.value.param == "grammar"


@pytest.mark.parametrize(
    "grammar", ['root ::= "a"{0,2000}', "root ::= [a]{2000,}", 'root ::= ("a"{2000}){3}']
)
def test_a_repetition_count_within_llama_cpps_bound_passes(grammar: str) -> None:
    cheap_grammar(grammar)


#: What each check refuses, after a comment that a CR ends: llama.cpp's parser ends a comment
#: at CR or LF and compiles what follows a CR (a rule of its own at the top level; more of the
#: group inside one), so the checks must read it too (found by review: they ended a comment at
#: LF alone, and each of these passed them all).
_AFTER_A_CR = {
    "most below its least": 'root ::= "a" # a comment\rx ::= "a"{5,2}\n',
    "token-level": 'root ::= "a" # a comment\rx ::= "a" !<[28]>\n',
    "nests groups": 'root ::= "a" # a comment\rx ::= ' + "(" * 5000 + '"a"' + ")" * 5000,
    "which no text holds": 'root ::= "a" # a comment\rx ::= [\\uD800]\n',
    "itself an unbounded": 'root ::= ("a" # a comment\r ([^a]+)+ )\n',
    "left recursion": 'root ::= y root | "a" # a comment\ry ::= "x"?\n',
    "opens more than": "root ::= (\n  # a comment\r"
    + " | ".join(f'"{i}" x' for i in range(200))
    + ')\nx ::= "b"\n',
}


@pytest.mark.parametrize("what", sorted(_AFTER_A_CR))
def test_a_comment_ends_at_a_carriage_return_as_in_llama_cpp(what: str) -> None:
    grammar = _AFTER_A_CR[what]
    with pytest.raises(GrammarError, match=what) as info:
        cheap_grammar(grammar)
    assert info.value.param == "grammar"


def test_a_comment_still_hides_what_follows_it_on_its_line() -> None:
    check_grammar_cost('root ::= "a" # "b"{5,2} <[28]> (((( [\\uD800]\r\n')


def test_stub_server_answers_400_for_a_repeat_below_its_least() -> None:
    """The server's answer to the fuzz's request (on llama.cpp it ran the process out of
    memory: ``backend_danger_cases.case_repeat_below_its_least``), plain and streamed."""
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        body = {"model": "a", "prompt": "x", "max_tokens": 2, "grammar": 'root ::= "a"{5,2}'}
        for extra in ({}, {"stream": True}):
            response = client.post("/v1/completions", json=body | extra)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_grammar", "grammar")


@pytest.mark.parametrize(
    "grammar",
    [
        "root ::= | [\\x00-\\x7f] root {2} [a-c]",  # the fuzz's: past a minute, one token
        'root ::= x "b"\nx ::= | "a" x x',
        'root ::= x\nx ::= | "a" (x "," x)',
    ],
)
def test_an_empty_rule_using_itself_twice_is_refused(grammar: str) -> None:
    with pytest.raises(GrammarError, match="uses itself more than once") as info:
        check_grammar_cost(grammar)
    assert info.value.param == "grammar" and "'(" not in str(info.value)


@pytest.mark.parametrize("case", sorted(NESTED_REPEATS))
def test_an_unbounded_repeat_of_a_repetition_is_refused(case: str) -> None:
    with pytest.raises(GrammarError, match="itself an unbounded repetition") as info:
        check_grammar_cost(NESTED_REPEATS[case])
    assert info.value.param == "grammar"
    assert "'(" not in str(info.value)  # names a rule of the grammar, not a group


@pytest.mark.parametrize(
    "grammar",
    [
        # Bounded on one side, or delimited by a fixed text: a few ms a token.
        "root ::= ([a]{1,3})+",
        "root ::= ([^a]+){2}",
        "root ::= [a]{0,3}{2}",
        'root ::= ("," [^a]+)*',
        'root ::= (line "\\n")*\nline ::= [^\\n]*',
        schema_to_gbnf({"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$"}),
        schema_to_gbnf({"type": "string", "pattern": "^(\\d{1,3}\\.){3}\\d{1,3}$"}),
    ],
)
def test_bounded_or_delimited_repeats_pass(grammar: str) -> None:
    check_grammar_cost(grammar)


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= ("a"?){0,16}',
        'root ::= x{0,16}\nx ::= "a"{0,300}',
        'root ::= ("a"?)*',  # one recursive rule: no stack per repetition
        'root ::= "a"{0,2000} [a-z]{0,999}',  # parts that cannot be empty
        'root ::= (ws item){0,100}\nws ::= [ ]*\nitem ::= "x"',
        "deep ::= " + "(" * 300 + '"a"' + ")?" * 300,
        schema_to_gbnf({"type": "string", "pattern": "^(a?){0,16}$"}),
        schema_to_gbnf({"type": "string", "maxLength": 900}),
        schema_to_gbnf({"type": "array", "items": {"type": "integer"}, "maxItems": 200}),
        schema_to_gbnf(
            {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(25)}}
        ),
    ],
)
def test_repeats_of_what_cannot_be_empty_pass(grammar: str) -> None:
    check_grammar_cost(grammar)


@pytest.mark.model
def test_real_model_refuses_an_empty_repeat_quickly(real_client: TestClient) -> None:
    for body in (
        {"prompt": "x", "max_tokens": 2, "grammar": EMPTY_REPEATS["optional_repeated"]},
        {
            "prompt": "x",
            "max_tokens": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "pattern": "^(a?){0,300}$"}},
            },
        },
    ):
        start = time.monotonic()
        response = real_client.post("/v1/completions", json=body)
        assert response.status_code == 400, response.json()
        assert response.json()["error"]["code"] == "invalid_grammar"
        assert time.monotonic() - start < 2.0


# --- issue 41: alternatives open at once (width), prefix trees of literals, size -------------

_HELPER_ALT = re.compile(r'"((?:[^"\\]|\\.)*)"(?: ([A-Za-z0-9_-]+))?')


def _gbnf_string(body: str) -> str:
    """A literal's body as llama.cpp reads it (an independent decoder: the test's own)."""
    out, i = [], 0
    while i < len(body):
        if body[i] != "\\":
            out.append(body[i])
            i += 1
            continue
        kind = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(kind)
        if width:
            out.append(chr(int(body[i + 2 : i + 2 + width], 16)))
            i += 2 + width
        else:
            out.append({"n": "\n", "r": "\r", "t": "\t"}.get(kind, kind))
            i += 2
    return "".join(out)


def _language(grammar: str, rule: str = "root") -> set[str]:
    """Every string ``rule`` derives, for the shape ``factor_literal_rules`` writes (rules
    of ``"lit" [helper]`` alternatives, maybe wrapped in ``( ... )?``, or ``""``)."""
    rules = {}
    for line in grammar.splitlines():
        name, _, body = line.partition(" ::= ")
        rules[name] = body
    body = rules[rule]
    out: set[str] = set()
    if body.startswith("( ") and body.endswith(" )?"):
        out.add("")
        body = body[2:-3]
    if body == '""':
        return {""}
    for match in _HELPER_ALT.finditer(body):
        head = _gbnf_string(match.group(1))
        tails = _language(grammar, match.group(2)) if match.group(2) else {""}
        out |= {head + tail for tail in tails}
    return out


@pytest.mark.parametrize(
    "values",
    [
        [f"v{i}" for i in range(300)],
        ["", "a", "ab", "abc", "abd", "b", "ba", "bab", "c"],
        ['q"', "q\\", "q[", "q]", "q\n", "q\t", "q\x7f", "q\u00e9", "q\U0001f600", "q\x00", "r"],
        ["same"] * 9 + ["samf", "s"],
        [chr(0x4E00 + i) * 3 for i in range(40)] + [chr(0x4E00) + "x"],
    ],
)
def test_a_rule_of_literals_becomes_a_prefix_tree_of_the_same_strings(values: list[str]) -> None:
    from kvwarm.backends.grammar_factor import _encode, factor_literal_rules

    grammar = "root ::= " + " | ".join(_encode(v) for v in values)
    factored = factor_literal_rules(grammar)
    assert factored != grammar
    assert _language(factored) == set(values)
    widths = grammar_widths(factored, 10_000)
    assert max(widths.values()) < len(set(values))


def test_other_rules_and_unreadable_grammars_are_left_as_they_are() -> None:
    from kvwarm.backends.grammar_factor import factor_literal_rules

    enum = " | ".join(f'"k{i}"' for i in range(20))
    grammar = f'root ::= item ("," item)*\nitem ::= {enum}\n# a comment ::= "x"\nws ::= [ ]*\n'
    factored = factor_literal_rules(grammar)
    assert factored.startswith('root ::= item ("," item)*\n')
    assert "ws ::= [ ]*" in factored and 'item ::= "k" item-f1' in factored
    few = 'root ::= "a1" | "a2"'  # fewer than MIN_ALTERNATIVES
    assert factor_literal_rules(few) == few
    distinct = "root ::= " + " | ".join(f'"{c}x"' for c in "abcdefghij")  # nothing shared
    assert factor_literal_rules(distinct) == distinct
    for unreadable in ('root ::= "a\\q" | ' + enum, 'root ::= "open', "no rule here"):
        assert factor_literal_rules(unreadable) == unreadable
    # A helper's name never collides with a rule (or a name) the grammar has.
    taken = f'root ::= {enum.replace("k", "r")}\nroot-f1 ::= "z"\n'
    assert 'root-f1 ::= "z"' in factor_literal_rules(taken)
    assert factor_literal_rules(taken).count("root-f1 ::=") == 1


def test_widths_count_the_alternatives_llama_cpp_opens() -> None:
    assert grammar_widths('root ::= a? a? a? "x"\na ::= "p" | "q"')["root"] == 7
    assert grammar_widths('root ::= [a-z]+ (" " [a-z]+)*')["root"] == 2
    many = "root ::= " + " | ".join(f"r{i}" for i in range(200))
    many += "\n" + "\n".join(f'r{i} ::= "{i}"' for i in range(200))
    with pytest.raises(GrammarError, match="'root' opens more than 128 alternatives") as info:
        check_grammar_cost(many)
    assert info.value.param == "grammar"
    with pytest.raises(GrammarError, match="opens more than"):
        cheap_grammar(many)  # not literals: nothing to factor


def test_a_schema_with_a_100k_value_enum_is_factored_quickly() -> None:
    schema = {"type": "string", "enum": [f"value-{i}" for i in range(100_000)]}
    start = time.monotonic()
    grammar = cheap_grammar(schema_to_gbnf(schema))
    elapsed = time.monotonic() - start
    assert max(grammar_widths(grammar).values()) <= 11
    # ~0.8 s alone; the bound only catches a return of the old blow-up (92 s for a 100k enum)
    # on a loaded machine, the point being that it is Python on the caller, off the worker.
    assert elapsed < 30.0, elapsed


def test_a_grammar_past_the_size_bound_is_refused() -> None:
    from kvwarm.backends.grammar_cost import MAX_GRAMMAR_BYTES

    huge = 'root ::= "' + "a" * MAX_GRAMMAR_BYTES + '"'
    with pytest.raises(GrammarError, match="more than the"):
        cheap_grammar(huge)


@pytest.mark.model
@pytest.mark.slow
def test_llama_cpp_follows_a_factored_100k_enum_at_a_few_ms_a_token() -> None:
    """Issue 41: a 10,000-value enum cost ~7 s a token in llama.cpp's grammar engine (every
    value a parse stack), 100,000 minutes; factored, a token costs milliseconds, and the
    grammar still admits exactly the enum's values (driven token by token through it)."""
    import numpy as np

    from kvwarm.backends import get_backend
    from kvwarm.backends.base import SamplingParams
    from kvwarm.embedded import default_model_path

    values = [f"v{i}" for i in range(100_000)]
    grammar = cheap_grammar(schema_to_gbnf({"type": "string", "enum": values}))
    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    try:
        n_vocab = model.facts.n_vocab
        eos = next(t for t in range(n_vocab) if model.is_eog(t))

        def drive(text: str) -> tuple[bool, float]:
            """Whether the grammar takes ``text``'s tokens then the end, and the seconds."""
            sampler = model.new_sampler(SamplingParams(temperature=0, grammar=grammar))
            start = time.monotonic()
            try:
                for token in [*model.tokenize(text, add_special=False), eos]:
                    row = np.zeros(n_vocab, dtype=np.float32)
                    row[token] = 100.0  # the grammar's choice unless it forbids this one
                    if sampler.sample_logits(row.tobytes()) != token:
                        return False, time.monotonic() - start
                return True, time.monotonic() - start
            finally:
                sampler.close()

        for value in ("v0", "v5", "v12345", "v99999"):
            taken, seconds = drive(f'"{value}"')
            assert taken, value
            assert seconds < 1.0, seconds  # unfactored, the first token alone: minutes
        assert not drive('"v100000"')[0]  # not a value
        assert not drive('"v1234')[0]  # a prefix: the grammar does not let it end
    finally:
        model.close()


@pytest.mark.model
def test_a_grammar_step_past_its_budget_fails_the_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``check_grammar_cost`` does not weigh (a grammar fuzz found ``x ::= [^a]{1,} root
    .+`` under ``root ::= x{1,} ...``: 0.9, 2.1, 4.7 s a token, growing) is bounded at run
    time: a token whose grammar step takes longer than the budget fails the request. With a
    budget of 0 any grammar step passes it; the sampler still closes cleanly."""
    from kvwarm.backends import get_backend
    from kvwarm.backends.base import SamplingParams
    from kvwarm.backends.llama import sampler as llama_sampler
    from kvwarm.embedded import default_model_path

    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    try:
        row = bytes(4 * model.facts.n_vocab)
        params = SamplingParams(temperature=0, grammar='root ::= "yes" | "no"')
        fine = model.new_sampler(params)
        try:
            piece = model.token_to_piece(fine.sample_logits(row))
            assert piece and (b"yes".startswith(piece) or b"no".startswith(piece))
        finally:
            fine.close()
        monkeypatch.setattr(llama_sampler, "GRAMMAR_TOKEN_BUDGET_S", 0.0)
        slow = model.new_sampler(params)
        try:
            with pytest.raises(GrammarError, match="to weigh one token") as info:
                slow.sample_logits(row)
            assert info.value.param == "grammar"
        finally:
            slow.close()
    finally:
        model.close()


def _calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """The texts ``grammar_cost.<name>`` is called with from here on (it still runs)."""
    import kvwarm.backends.grammar_cost as grammar_cost

    texts: list[str] = []
    original = getattr(grammar_cost, name)

    def recorded(text: str) -> Any:
        texts.append(text)
        return original(text)

    monkeypatch.setattr(grammar_cost, name, recorded)
    return texts


def test_a_grammar_prepared_before_is_not_prepared_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents send the same tools and response format every turn: a 100,000-value enum's
    preparation (seconds of Python, holding the GIL) runs once, not at every turn."""
    import kvwarm.backends.grammar_cost as grammar_cost

    factored = _calls(monkeypatch, "factor_literal_rules")
    monkeypatch.setattr(grammar_cost, "_CHEAP", grammar_cost.TextMemo(1 << 20))
    values = " | ".join(f'"v{i}"' for i in range(300))
    first = cheap_grammar(f"root ::= {values}")
    assert cheap_grammar(f"root ::= {values}") == first
    assert len(factored) == 1
    assert cheap_grammar(f'root ::= {values} | "w"') != first  # another text: prepared
    assert len(factored) == 2
    for _ in range(2):  # a refusal is not kept: said again, the checks run again
        with pytest.raises(GrammarError, match="too ambiguous"):
            cheap_grammar(doubling(40))
    assert len(factored) == 4


def test_a_text_memo_keeps_the_most_recently_used_within_its_bound() -> None:
    from kvwarm.backends.grammar_cost import TextMemo

    made: list[str] = []

    def make(text: str) -> str:
        made.append(text)
        return text.upper()

    memo = TextMemo(max_chars=8)
    assert [memo.get(t, make) for t in ("aaaa", "bbbb", "aaaa")] == ["AAAA", "BBBB", "AAAA"]
    assert made == ["aaaa", "bbbb"] and memo.hits == 1
    memo.get("cccc", make)  # past 8 characters: the least recently used (bbbb) goes
    memo.get("aaaa", make)
    memo.get("bbbb", make)
    assert made == ["aaaa", "bbbb", "cccc", "bbbb"]
    assert memo.get("x" * 9, make) == "X" * 9  # larger than the whole bound: made, not kept
    assert memo.get("x" * 9, make) == "X" * 9 and made[-2:] == ["x" * 9, "x" * 9]


def test_a_schema_converted_before_is_not_converted_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvwarm.backends.grammar as grammar
    from kvwarm.backends.grammar_cost import TextMemo

    monkeypatch.setattr(grammar, "_CONVERTED", TextMemo(1 << 20))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = schema_to_gbnf(schema)
    assert schema_to_gbnf(dict(schema)) == first
    assert grammar._CONVERTED.hits == 1
    with pytest.raises(GrammarError):  # refused each time it is sent
        schema_to_gbnf({"type": "string", "minLength": 10**9})
    with pytest.raises(GrammarError):
        schema_to_gbnf({"type": "string", "minLength": 10**9})
    assert grammar._CONVERTED.hits == 1


def test_a_prepared_grammar_is_not_checked_again_on_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The samplers' safety checks (``check_grammar_safe``) ran again on the model's worker
    for a grammar the request's thread had checked: ~1.4 s of a 100,000-value enum in which
    no other request decoded. A text that passed is not checked again; one that fails is
    refused every time, and a text never prepared is checked."""
    import kvwarm.backends.grammar_cost as grammar_cost
    from kvwarm.backends.grammar_cost import TextMemo, check_grammar_safe

    checked = _calls(monkeypatch, "check_left_recursion")
    monkeypatch.setattr(grammar_cost, "_SAFE", TextMemo(0))
    prepared = cheap_grammar('root ::= "a" | "b"')
    check_grammar_safe(prepared)
    assert checked == []  # cheap_grammar's own checks stand
    other = 'root ::= "c"'
    check_grammar_safe(other)
    check_grammar_safe(other)
    assert checked == [other]
    looping = 'root ::= y root "b" | "a"\ny ::= "x"?'
    for _ in range(2):
        with pytest.raises(GrammarError, match="left recursion"):
            check_grammar_safe(looping)
    assert checked == [other, looping, looping]
    deep = "root ::= " + "(" * 1200 + '"a"' + ")" * 1200
    for _ in range(2):
        with pytest.raises(GrammarError):
            check_grammar_safe(deep)


def test_a_schema_is_prepared_once_per_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo of prepared grammars is scoped by the request's cache salt, as cached prompts
    are: one tenant cannot tell by a reply's speed that another sent a schema. Through the
    OpenAI, Anthropic and Responses routes, the format's schema and the tools' call grammar
    alike."""
    import kvwarm.backends.grammar as grammar
    import kvwarm.backends.grammar_cost as grammar_cost
    from kvwarm.backends.grammar_cost import TextMemo

    prepared = _calls(monkeypatch, "factor_literal_rules")
    schema = {"type": "string", "enum": [f"v{i}" for i in range(50)]}
    chat = {
        "model": "a",
        "messages": [{"role": "user", "content": "pick"}],
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    }
    params = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    tool = {"type": "function", "function": {"name": "pick", "parameters": params}}
    tools = {**chat, "response_format": None, "tools": [tool], "tool_choice": "auto"}
    anthropic = {
        "model": "a",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "pick"}],
        "tools": [{"name": "pick", "input_schema": params}],
    }
    # Found by review: the Responses API's call grammar was remembered unscoped.
    responses = {
        "model": "a",
        "input": "pick",
        "max_output_tokens": 2,
        "tools": [{"type": "function", "name": "pick", "parameters": params}],
        "tool_choice": "auto",
    }
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        for path, body in (
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", tools),
            ("/v1/messages", anthropic),
            ("/v1/responses", responses),
        ):
            monkeypatch.setattr(grammar_cost, "_CHEAP", TextMemo(1 << 20))  # each path afresh
            monkeypatch.setattr(grammar, "_CONVERTED", TextMemo(1 << 20))
            counts = []
            for salt in ("tenant-a", "tenant-a", "tenant-b", None, None):
                before = len(prepared)
                sent = body if salt is None else {**body, "cache_salt": salt}
                response = client.post(path, json=sent)
                assert response.status_code == 200, response.json()
                counts.append(len(prepared) - before)
            first = counts[0]  # the tools' call grammar, and with it the free text's
            assert first > 0 and counts == [first, 0, first, first, 0], (path, counts)


def test_a_kept_grammar_is_not_checked_again_whatever_other_tenants_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The memo of grammars that passed the samplers' checks is one for every tenant. Found
    by review: once others' grammars had pushed a tenant's out of it while its prepared
    grammar was still kept, that tenant's sampler ran the checks again (~1.4 s of a
    100,000-value enum), unless another tenant had just sent the same text: a reply's speed
    told whether another tenant sent it. A kept grammar counts as checked again when used."""
    import kvwarm.backends.grammar_cost as grammar_cost
    from kvwarm.backends.grammar_cost import TextMemo, check_grammar_safe

    checked = _calls(monkeypatch, "check_left_recursion")
    monkeypatch.setattr(grammar_cost, "_CHEAP", TextMemo(1 << 20))
    monkeypatch.setattr(grammar_cost, "_SAFE", TextMemo(0, max_entries=2))
    mine = 'root ::= "a" | "b"'
    prepared = cheap_grammar(mine, b"tenant-a")
    for i in range(2):  # other tenants' grammars take the checked memo's room
        cheap_grammar(f'root ::= "c{i}"', b"tenant-b")
    for other in (None, b"tenant-c"):  # whether or not another tenant sends it meanwhile
        if other is not None:
            cheap_grammar(mine, other)
        assert cheap_grammar(mine, b"tenant-a") == prepared  # kept
        check_grammar_safe(prepared)  # its sampler, on the request's thread and the worker
        check_grammar_safe(prepared)
        assert checked == [], other
        for i in range(2):
            cheap_grammar(f'root ::= "d{i}"', b"tenant-b")


def test_a_prepared_grammar_pushed_out_meanwhile_is_not_checked_again_on_its_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a request's grammar waits in the queue between its preparation and
    its worker's sampler; once others' grammars had pushed it out of the checked memo
    meanwhile, its worker ran the checks again (~1.4 s of a 100,000-value enum, in which no
    one decoded), unless another tenant had just sent the same text: its reply's speed told
    whether one had. What ``cheap_grammar`` returns is checked, wherever the memo stands."""
    import kvwarm.backends.grammar_cost as grammar_cost
    from kvwarm.backends.grammar_cost import TextMemo, check_grammar_safe

    checked = _calls(monkeypatch, "check_left_recursion")
    monkeypatch.setattr(grammar_cost, "_CHEAP", TextMemo(1 << 20))
    monkeypatch.setattr(grammar_cost, "_SAFE", TextMemo(0, max_entries=2))
    mine = 'root ::= "a" | "b"'
    for other in (None, b"tenant-c"):
        prepared = cheap_grammar(mine, b"tenant-a")  # the request's thread
        for i in range(2):  # queued meanwhile: other tenants' grammars take the memo's room
            cheap_grammar(f'root ::= "c{i}-{other!r}"', b"tenant-b")
        if other is not None:
            cheap_grammar(mine, other)
        check_grammar_safe(prepared)  # its worker's sampler
        assert checked == [], other
    check_grammar_safe(str(mine))  # a text no preparation returned is still checked
    assert checked == [mine]


def test_a_text_found_kept_again_is_the_last_pushed_out() -> None:
    """A text found kept again is the most recently used: the next texts push out older
    ones first."""
    from kvwarm.backends.grammar_cost import TextMemo

    memo = TextMemo(0, max_entries=2)
    for text in ("a", "b", "a", "c"):  # "c" pushes out "b", not "a"
        memo.get(text, lambda _: "")
    made: list[str] = []

    def make(text: str) -> str:
        made.append(text)
        return ""

    memo.get("a", make)
    memo.get("b", make)
    assert made == ["b"]


def _nullable_by_sweeps(
    rules: dict[str, list[list[tuple[str, object, tuple[int, int]]]]],
) -> set[str]:
    """The rules that can match nothing, as found before ``_nullable`` was a worklist: sweeps
    of every rule until one adds nothing."""
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            if name not in found and any(
                all(
                    rep[0] == 0 or (val is True if kind == "term" else str(val) in found)
                    for kind, val, rep in alt
                )
                for alt in expr
            ):
                found.add(name)
                changed = True
    return found


def test_the_nullable_worklist_finds_what_the_sweeps_found() -> None:
    """``_nullable`` (a worklist, linear in the grammar) against the fixpoint of sweeps it
    replaced, on random grammars: recursion, repeats, the literal "", undefined rules."""
    import random

    from kvwarm.backends.grammar_cost import _nullable

    rng = random.Random(41)
    reps = [(1, 1), (1, 1), (0, 1), (0, -1), (1, -1), (2, 3), (0, 0)]
    differ = []
    for _ in range(5000):
        names = [f"r{i}" for i in range(rng.randint(1, 7))] + ["(9"]
        rules = {
            name: [
                [
                    ("term", rng.random() < 0.3, rng.choice(reps))
                    if rng.random() < 0.3
                    else ("ref", rng.choice([*names, "undefined"]), rng.choice(reps))
                    for _ in range(rng.randint(0, 3))
                ]
                for _ in range(rng.randint(1, 3))
            ]
            for name in names
            if rng.random() < 0.9
        }
        if _nullable(rules) != _nullable_by_sweeps(rules):
            differ.append(rules)
    assert differ == []


def test_a_request_s_grammar_is_parsed_once_not_again_by_its_samplers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the engine: the request's thread prepares and checks its grammar, and neither
    the sampler built there nor the worker's checks it again (the test beside the
    100,000-value enum holds its preparation, so it cannot see the worker's ~1.4 s), even with
    a checked memo that keeps nothing (as if others' grammars pushed each out at once, while
    the request queued: the mark travels with the prepared text)."""
    from tests.engine.conftest import make_engine, stub_config

    import kvwarm.backends.grammar_cost as grammar_cost
    from kvwarm.backends.grammar_cost import TextMemo
    from kvwarm.engine.types import GenerationOptions

    parsed = _calls(monkeypatch, "_parse")
    monkeypatch.setattr(grammar_cost, "_CHEAP", TextMemo(1 << 20))
    monkeypatch.setattr(grammar_cost, "_SAFE", TextMemo(0, max_entries=0))
    engine = make_engine()
    try:
        model = engine.load_model(config=stub_config())
        opts = GenerationOptions(max_tokens=8, temperature=0.0, grammar='root ::= "yes" | "no"')
        assert model.complete("Say yes or no:", opts).text in ("yes", "no")
        assert len(parsed) == 1, parsed
        model.complete("Say yes or no:", opts)  # sent again: kept, not parsed at all
        assert len(parsed) == 1, parsed
    finally:
        engine.close()


class _RecordedTurns(threading.Semaphore):
    """A semaphore that says when its second taker asks for it."""

    def __init__(self) -> None:
        super().__init__(1)
        self.asked = 0
        self.second = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        self.asked += 1
        if self.asked == 2:
            self.second.set()
        return super().acquire(blocking, timeout)

    def __enter__(self) -> bool:
        return self.acquire()


def test_large_preparations_take_turns_and_one_made_meanwhile_is_found() -> None:
    """A large text is prepared only in its turn (one at a time: their Python holds the GIL,
    and a 100,000-value enum's peaks at ~250 MB), and the same schema sent twice at once is
    prepared once: the second finds it kept when its turn comes. A short one takes no turn."""
    from kvwarm.backends.grammar_cost import LARGE_TEXT_CHARS, TextMemo

    turns = _RecordedTurns()
    memo = TextMemo(1 << 24, turns=turns)
    inside, go = threading.Event(), threading.Event()
    made: list[str] = []

    def make(text: str) -> str:
        made.append(text)
        inside.set()
        assert go.wait(30)
        return text.upper()

    large = "x" * LARGE_TEXT_CHARS
    got: list[str] = []
    first = threading.Thread(target=lambda: got.append(memo.get(large, make)))
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=lambda: got.append(memo.get(large, make)))
    second.start()
    try:
        assert turns.second.wait(30), "the second request never asked for a turn"
    finally:
        go.set()
        first.join(30)
        second.join(30)
    assert got == [large.upper()] * 2 and made == [large]
    memo.get("y" * (LARGE_TEXT_CHARS - 1), str.upper)
    assert turns.asked == 2  # short: no turn taken
