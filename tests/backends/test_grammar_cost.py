"""Issue 23: an explosively ambiguous GBNF grammar is a 400 naming the rule, before any backend
compiles it; ordinary grammars pass."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from tests.server.conftest import LOW_POLICY, stub_settings, wait_ready

from kvwarm.backends.grammar import schema_to_gbnf
from kvwarm.backends.grammar_cost import check_grammar_cost, grammar_ways
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
    check_grammar_cost(grammar)


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


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= ("a"?){0,16}',
        'root ::= x{0,16}\nx ::= "a"{0,300}',
        'root ::= ("a"?)*',  # one recursive rule: no stack per repetition
        'root ::= "a"{0,100000} [a-z]{0,999}',  # parts that cannot be empty
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
