"""Parallel tool calls turned off (OpenAI's ``parallel_tool_calls: false``, Anthropic's
``disable_parallel_tool_use``): a reply that makes two calls reports only its first, streamed or
not, in every API (stub backend). Before, the setting was ignored and both calls came back."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.engine.types import GenerationOptions
from kvwarm.server import convert

from .conftest import sse_events
from .test_anthropic_stub import named_events

TWO_CALLS = (
    'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
# The stub enforces literal grammars: that stands in for a model that makes two calls.
GRAMMAR = "root ::= " + json.dumps(TWO_CALLS)
HI = [{"role": "user", "content": "Weather and time in Oslo?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every generation's output is ``TWO_CALLS`` (the Anthropic and Responses bodies have no
    grammar field of their own)."""
    options = convert.options

    def with_grammar(*args: object, **kwargs: object) -> GenerationOptions:
        opts = options(*args, **kwargs)  # type: ignore[arg-type]
        # The whole reply, not a lazy grammar from a trigger on (tool_choice auto's).
        return dataclasses.replace(
            opts, grammar=GRAMMAR, grammar_triggers=(), grammar_once=False, max_tokens=200
        )

    monkeypatch.setattr(convert, "options", with_grammar)
    yield


def _chat_calls(client: TestClient, parallel: bool | None, stream: bool) -> list[str]:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
        {"type": "function", "function": {"name": "get_time", "parameters": {}}},
    ]
    body: dict[str, object] = {
        "model": "a",
        "messages": HI,
        "tools": tools,
        "grammar": GRAMMAR,
        "max_tokens": 200,
    }
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    if not stream:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
        return [c["function"]["name"] for c in calls]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = sse_events(r.read().decode())
    deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"  # type: ignore[index]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    headers = [c for d in deltas for c in d.get("tool_calls") or () if "id" in c]
    assert [c["index"] for c in headers] == list(range(len(headers)))
    return [c["function"]["name"] for c in headers]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_parallel_tool_calls_false_keeps_the_first_call(
    client: TestClient, stream: bool
) -> None:
    assert _chat_calls(client, None, stream) == ["get_weather", "get_time"]
    assert _chat_calls(client, True, stream) == ["get_weather", "get_time"]
    assert _chat_calls(client, False, stream) == ["get_weather"]


def _messages_calls(client: TestClient, disable: bool, stream: bool) -> list[str]:
    tools = [
        {"name": "get_weather", "input_schema": CITY},
        {"name": "get_time", "input_schema": {"type": "object"}},
    ]
    body = {
        "model": "a",
        "max_tokens": 200,
        "messages": HI,
        "tools": tools,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": disable},
        "stream": stream,
    }
    if not stream:
        data = client.post("/v1/messages", json=body).json()
        assert data["stop_reason"] == "tool_use", data
        blocks = data["content"]
    else:
        with client.stream("POST", "/v1/messages", json=body) as r:
            events = named_events(r.read().decode())
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"  # type: ignore[index]
        blocks = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert blocks[0]["type"] == "text"
    return [b["name"] for b in blocks if b["type"] == "tool_use"]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_disable_parallel_tool_use_keeps_the_first_call(
    client: TestClient, forced: None, stream: bool
) -> None:
    assert _messages_calls(client, False, stream) == ["get_weather", "get_time"]
    assert _messages_calls(client, True, stream) == ["get_weather"]


def _responses_calls(client: TestClient, parallel: bool, stream: bool) -> list[str]:
    tools = [
        {"type": "function", "name": "get_weather", "parameters": CITY},
        {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
    ]
    body = {
        "model": "a",
        "input": "Weather and time in Oslo?",
        "tools": tools,
        "parallel_tool_calls": parallel,
        "stream": stream,
        "store": False,
    }
    if not stream:
        output = client.post("/v1/responses", json=body).json()["output"]
    else:
        with client.stream("POST", "/v1/responses", json=body) as r:
            events = named_events(r.read().decode())
        final = events[-1][1]["response"]
        added = [d["item"] for n, d in events if n == "response.output_item.added"]
        assert [i["type"] for i in added] == [i["type"] for i in final["output"]]  # type: ignore[index]
        output = final["output"]  # type: ignore[index]
    return [i["name"] for i in output if i["type"] == "function_call"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_parallel_tool_calls_false_keeps_the_first_call(
    client: TestClient, forced: None, stream: bool
) -> None:
    assert _responses_calls(client, True, stream) == ["get_weather", "get_time"]
    assert _responses_calls(client, False, stream) == ["get_weather"]


# Issue 41: the reply cut off by max_tokens inside its second call reported tool_calls
# (tool_use, completed), as if it were whole; it says length (max_tokens, incomplete) now.
CUT = len(TWO_CALLS) - 12  # tokens (the stub's are bytes): inside the second call


@pytest.fixture
def cut_short(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    options = convert.options

    def with_grammar(*args: object, **kwargs: object) -> GenerationOptions:
        opts = options(*args, **kwargs)  # type: ignore[arg-type]
        return dataclasses.replace(
            opts, grammar=GRAMMAR, grammar_triggers=(), grammar_once=False, max_tokens=CUT
        )

    monkeypatch.setattr(convert, "options", with_grammar)
    yield


@pytest.mark.parametrize("stream", [False, True])
def test_a_second_call_cut_off_by_max_tokens_is_length_in_chat(
    client: TestClient, cut_short: None, stream: bool
) -> None:
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
        {"type": "function", "function": {"name": "get_time", "parameters": {}}},
    ]
    body = {"model": "a", "messages": HI, "tools": tools, "stream": stream}
    if not stream:
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "length", choice
        return
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r.read().decode())
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_a_second_call_cut_off_by_max_tokens_is_max_tokens_in_messages(
    client: TestClient, cut_short: None, stream: bool
) -> None:
    tools = [
        {"name": "get_weather", "input_schema": CITY},
        {"name": "get_time", "input_schema": {"type": "object"}},
    ]
    body = {"model": "a", "max_tokens": 200, "messages": HI, "tools": tools, "stream": stream}
    if not stream:
        data = client.post("/v1/messages", json=body).json()
        assert data["stop_reason"] == "max_tokens", data
        return
    with client.stream("POST", "/v1/messages", json=body) as r:
        events = named_events(r.read().decode())
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_a_second_call_cut_off_by_max_tokens_is_incomplete_in_responses(
    client: TestClient, cut_short: None, stream: bool
) -> None:
    tools = [
        {"type": "function", "name": "get_weather", "parameters": CITY},
        {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
    ]
    body = {"model": "a", "input": "Weather?", "tools": tools, "stream": stream, "store": False}
    if not stream:
        data = client.post("/v1/responses", json=body).json()
    else:
        with client.stream("POST", "/v1/responses", json=body) as r:
            events = named_events(r.read().decode())
        assert events[-1][0] == "response.incomplete", events[-1]
        data = events[-1][1]["response"]  # type: ignore[assignment]
    assert data["status"] == "incomplete", data
    assert data["incomplete_details"] == {"reason": "max_output_tokens"}
