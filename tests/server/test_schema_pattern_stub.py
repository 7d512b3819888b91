"""A JSON schema ``pattern`` the converter cannot read is a 400, never a hung or exhausted
worker. llama-cpp-python's converter looped for ever on a ``]`` or ``}`` outside a class or a
quantifier (``^a]$``; ``^[^]]$``, whose class it closes at the first ``]``): one ~100-byte
request pinned a core and a thread-pool thread for good, and a few dozen froze the server. A
quantifier was unbounded (``^a{1000000000}$`` builds a grammar of a billion characters), unlike
``minLength`` and the other repeat keywords (``MAX_SCHEMA_REPEATS``); it is written as GBNF's
``{m,n}``, whose counts llama.cpp bounds (``MAX_PATTERN_REPEATS``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.backends.grammar import MAX_PATTERN_REPEATS, schema_to_gbnf
from kvwarm.errors import GrammarError
from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready

LOOPING = ["^a]$", "^[^]]$", "^[]]$", "^}$", "^a{2}}$", "^(a])$"]
HUGE = [
    f"^a{{{MAX_PATTERN_REPEATS + 1}}}$",
    "^a{0,5000}$",
    f"^[ab]{{2,{10**9}}}$",
    "^(ab){99999999999999999999}$",
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("pattern", LOOPING)
def test_a_stray_closing_bracket_is_refused(pattern: str) -> None:
    with pytest.raises(GrammarError, match="unmatched") as info:
        schema_to_gbnf({"type": "string", "pattern": pattern})
    assert info.value.param == "json_schema"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("pattern", HUGE)
def test_a_huge_quantifier_is_refused(pattern: str) -> None:
    with pytest.raises(GrammarError, match=str(MAX_PATTERN_REPEATS)):
        schema_to_gbnf({"type": "string", "pattern": pattern})


@pytest.mark.parametrize(
    "pattern",
    ["^a\\]$", "^[\\]a]$", "^a{2,3}$", "^[a-z]{1,64}$", "^(ab|c)+$", "^\\{x\\}$", "^a{,5}$"],
)
def test_readable_patterns_still_convert(pattern: str) -> None:
    assert "root ::=" in schema_to_gbnf({"type": "string", "pattern": pattern})


@pytest.mark.timeout(20)
def test_a_property_named_const_is_checked_too() -> None:
    bad = {"type": "string", "pattern": "^a]$"}
    with pytest.raises(GrammarError, match="unmatched"):
        schema_to_gbnf({"type": "object", "properties": {"const": bad}, "required": ["const"]})


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings()), raise_server_exceptions=False) as test_client:
        wait_ready(test_client.get)
        yield test_client


@pytest.mark.timeout(30)
def test_the_server_answers_400_and_goes_on(client: TestClient) -> None:
    schema = {"type": "string", "pattern": "^[^]]$"}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"model": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    response = client.post("/v1/chat/completions", json={**body, "response_format": fmt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_grammar"
    assert client.post("/v1/chat/completions", json=body).status_code == 200
