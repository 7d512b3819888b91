"""Tool definitions a reply's calls could not honour are typed 400s on every chat-shaped API
(stub backend): two tools of one name (a call could not say which it is; Anthropic's API says
"Tool names must be unique") and parameters that are no object schema (OpenAI's and Anthropic's
rule: a call's arguments, a ``tool_use`` input, are an object). Before, both were served: the
duplicate silently, the string schema as a call whose Anthropic input had to be wrapped."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

HI = [{"role": "user", "content": "hi"}]
OBJECT = {"type": "object", "properties": {"city": {"type": "string"}}}


def _post(client: TestClient, api: str, defs: list[tuple[str, dict[str, object]]]) -> object:
    if api == "chat":
        tools: list[dict[str, object]] = [
            {"type": "function", "function": {"name": n, "parameters": p}} for n, p in defs
        ]
        body = {"model": "a", "messages": HI, "tools": tools, "max_tokens": 2}
        return client.post("/v1/chat/completions", json=body)
    if api == "messages":
        tools = [{"name": n, "input_schema": p} for n, p in defs]
        body = {"model": "a", "messages": HI, "tools": tools, "max_tokens": 2}
        return client.post("/v1/messages", json=body)
    tools = [{"type": "function", "name": n, "parameters": p} for n, p in defs]
    body = {"model": "a", "input": "hi", "tools": tools, "max_output_tokens": 2, "store": False}
    return client.post("/v1/responses", json=body)


def _error(response: object) -> str:
    status = getattr(response, "status_code", None)
    assert status == 400, getattr(response, "text", "")
    body = response.json()  # type: ignore[attr-defined]
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    return str(error["message"])


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_duplicate_tool_names_are_a_400(client: TestClient, api: str) -> None:
    message = _error(_post(client, api, [("f", OBJECT), ("g", OBJECT), ("f", OBJECT)]))
    assert "tools.2" in message and "unique" in message


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_parameters_that_are_no_object_schema_are_a_400(client: TestClient, api: str) -> None:
    message = _error(_post(client, api, [("f", {"type": "string"})]))
    assert "tools.0" in message and "'object'" in message


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_distinct_object_tools_are_served(client: TestClient, api: str) -> None:
    response = _post(client, api, [("f", OBJECT), ("g", {}), ("h", {"properties": {}})])
    assert getattr(response, "status_code", None) == 200


def test_duplicates_are_found_among_tools_allowed_tools_leaves_out(client: TestClient) -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": OBJECT}} for n in "ffg"]
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "auto",
            "tools": [{"type": "function", "function": {"name": "g"}}],
        },
    }
    body = {"model": "a", "messages": HI, "tools": tools, "tool_choice": choice, "max_tokens": 2}
    assert "unique" in _error(client.post("/v1/chat/completions", json=body))
