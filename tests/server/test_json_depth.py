"""Deeply nested JSON is a 400 ``json_too_deep``, never a 500 (stub backend, fast)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from kvwarm.backends.grammar import schema_to_gbnf
from kvwarm.errors import GrammarError
from kvwarm.server.tools import parse_tool_calls

CHAT = {"model": "a", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


def _nested_schema(levels: int) -> str:
    head = '{"type":"object","properties":{"a":'
    return head * levels + '{"type":"string"}' + "}}" * levels


def _assert_too_deep(response: object) -> None:
    assert hasattr(response, "status_code") and hasattr(response, "json")
    assert response.status_code == 400, response.json()
    assert response.json()["error"]["code"] == "json_too_deep"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/cache/prewarm",
        "/cache/evict",
        "/v1/embeddings",
    ],
)
def test_thousand_deep_body_is_a_400_on_every_post(client: TestClient, path: str) -> None:
    deep = "[" * 1000 + "]" * 1000
    _assert_too_deep(client.post(path, content=f'{{"model":"a","x":{deep}}}'))


def test_deep_json_schema_and_tool_parameters_are_400(client: TestClient) -> None:
    fmt = f'{{"type":"json_schema","json_schema":{{"schema":{_nested_schema(1000)}}}}}'
    body = f'{{"model":"a","prompt":"x","max_tokens":1,"response_format":{fmt}}}'
    _assert_too_deep(client.post("/v1/completions", content=body))
    # 200 levels parse in C but overflowed pydantic's serializer (a 500) before the bound.
    tool = f'{{"type":"function","function":{{"name":"f","parameters":{_nested_schema(200)}}}}}'
    chat = json.dumps(CHAT)[:-1] + f',"tool_choice":"required","tools":[{tool}]}}'
    _assert_too_deep(client.post("/v1/chat/completions", content=chat))


def test_schema_within_the_bound_still_works(client: TestClient) -> None:
    schema = json.loads(_nested_schema(29))
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    body = {"model": "a", "prompt": "x", "max_tokens": 1, "response_format": fmt}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.json()


def test_library_paths_bound_depth_too() -> None:
    deep: dict[str, object] = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError):
        schema_to_gbnf(deep)
    text = '<tool_call>{"name":"f","arguments":' + "[" * 5000 + "]" * 5000 + "}</tool_call>"
    content, calls = parse_tool_calls(text, frozenset({"f"}))
    assert calls == [] and content
