"""A JSON schema's string literals (``const``, ``enum``, property names; a forced tool call's
name) reach the grammar as GBNF literals of their JSON text. llama-cpp-python's converter
escaped ``"``, CR and LF but not the backslash, so a literal whose JSON has a backslash (any
``"``, ``\\`` or control character in the value) was wrong: ``say "hi"`` became a grammar
that ended the literal early (a 400 "grammar uses undefined rules: hi" for a valid schema, or
a different grammar altogether for a crafted value), and ``C:\\dir`` one that forced the
invalid JSON ``"C:\\dir"`` with a lone backslash, silently. ``backends/grammar.py`` now escapes
the backslash too and writes non-ASCII characters as themselves (as llama-server's converter
does), so each literal matches exactly the value's JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.backends.grammar import schema_to_gbnf
from kvwarm.server import create_app
from kvwarm.settings import ModelSpec

from .conftest import stub_settings, wait_ready

VALUES = ['say "hi"', "C:\\dir", "two\nlines", "tab\there", "café", 'a\\"b', "plain"]
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\", "[": "[", "]": "]"}
_GBNF_LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _gbnf_text(literal: str) -> str:
    """What a GBNF string literal's body matches (llama.cpp's ``parse_char`` escapes)."""
    out: list[str] = []
    i = 0
    while i < len(literal):
        c = literal[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = literal[i + 1]
        if e in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[e]
            out.append(chr(int(literal[i + 2 : i + 2 + width], 16)))
            i += 2 + width
        else:
            out.append(_ESCAPES[e])
            i += 2
    return "".join(out)


def _root_literals(grammar: str) -> list[str]:
    root = next(line for line in grammar.splitlines() if line.startswith("root ::="))
    return [_gbnf_text(m) for m in _GBNF_LITERAL.findall(root.removeprefix("root ::="))]


@pytest.mark.parametrize("value", VALUES)
def test_a_const_matches_exactly_its_json(value: str) -> None:
    literals = _root_literals(schema_to_gbnf({"const": value}))
    assert literals == [json.dumps(value, ensure_ascii=False)]
    assert json.loads(literals[0]) == value


def test_an_enum_matches_exactly_its_values() -> None:
    literals = _root_literals(schema_to_gbnf({"enum": VALUES}))
    assert [json.loads(lit) for lit in literals] == VALUES


@pytest.mark.parametrize("name", VALUES)
def test_a_property_name_matches_exactly_its_json(name: str) -> None:
    schema = {"type": "object", "properties": {name: {"const": 1}}, "required": [name]}
    grammar = schema_to_gbnf(schema)
    kv = next(line for line in grammar.splitlines() if "-kv ::=" in line)
    first = _GBNF_LITERAL.search(kv.split("::=", 1)[1])
    assert first is not None
    assert _gbnf_text(first.group(1)) == json.dumps(name, ensure_ascii=False)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings()), raise_server_exceptions=False) as test_client:
        wait_ready(test_client.get)
        yield test_client


CHAT = {"model": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def test_a_schema_whose_enum_has_a_quote_is_served(client: TestClient) -> None:
    schema = {"enum": ['say "hi"', "C:\\dir"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    response = client.post("/v1/chat/completions", json={**CHAT, "response_format": fmt})
    assert response.status_code == 200, response.text


def test_a_forced_tool_whose_property_has_a_quote_is_served(client: TestClient) -> None:
    params = {"type": "object", "properties": {'say "hi"': {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    body = {**CHAT, "tools": [tool], "tool_choice": "required"}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def real_client() -> Iterator[TestClient]:
    settings = stub_settings(
        backend="llama_cpp", models=(ModelSpec(),), n_ctx=512, default_max_tokens=16
    )
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


@pytest.mark.model
def test_llama_cpp_writes_one_of_the_tricky_values(real_client: TestClient) -> None:
    values = ['say "hi"', "C:\\dir", "two\nlines"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": values}}}
    body = {**CHAT, "model": None, "max_tokens": 16, "response_format": fmt, "temperature": 0}
    response = real_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    assert json.loads(content) in values, content
