"""Tool calls end to end through the official SDKs and their stream accumulators (openai's
``chat.completions.stream`` and ``responses.stream``, anthropic's ``messages.stream``): every
reply and stream parses, and a streamed reply is the non-streamed one (stub backend; the stub
enforces literal grammars, which stand in for a model's reply)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from kvwarm.engine.types import GenerationOptions
from kvwarm.server import convert

W = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
T = '{"name": "get_time", "arguments": {}}'
#: Text before, between and after two calls.
REPLY = f"Sure.\n<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>\nI asked both."
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
ASK = "Weather and time in Oslo?"


@pytest.fixture
def reply(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every generation's output is ``REPLY`` (the Anthropic and Responses bodies have no
    grammar field of their own)."""
    options = convert.options
    grammar = "root ::= " + json.dumps(REPLY)

    def with_grammar(*args: object, **kwargs: object) -> GenerationOptions:
        opts = options(*args, **kwargs)  # type: ignore[arg-type]
        return dataclasses.replace(
            opts, grammar=grammar, grammar_triggers=(), grammar_once=False, max_tokens=400
        )

    monkeypatch.setattr(convert, "options", with_grammar)
    yield REPLY


def _openai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="k", http_client=client, max_retries=0
    )


def _claude(client: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key="k", http_client=client, max_retries=0
    )


def test_chat_keeps_text_after_calls_streamed_or_not(client: TestClient, reply: str) -> None:
    # Before: "I asked both." was dropped, streamed or not.
    oai = _openai(client)
    tools: list[openai.types.chat.ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
        {"type": "function", "function": {"name": "get_time", "parameters": {}}},
    ]
    ask: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": ASK}]
    whole = oai.chat.completions.create(model="a", messages=ask, tools=tools)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure.\n\nI asked both."
    calls = choice.message.tool_calls or []
    names = [(c.function.name, json.loads(c.function.arguments)) for c in calls]  # type: ignore[union-attr]
    assert names == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2
    with oai.chat.completions.stream(model="a", messages=ask, tools=tools) as stream:
        chunks = list(stream)
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == choice.message.content
    got = [
        (c.function.name, json.loads(c.function.arguments))
        for c in streamed.message.tool_calls or []
    ]
    assert got == names
    sent = [
        c.id
        for e in chunks
        if e.type == "chunk"
        for ch in e.chunk.choices
        for c in ch.delta.tool_calls or ()
        if c.id
    ]
    assert sent == [c.id for c in streamed.message.tool_calls or []]
    # Text after a call went out after it, as the model wrote it.
    kinds = [
        "call" if ch.delta.tool_calls else "text"
        for e in chunks
        if e.type == "chunk"
        for ch in e.chunk.choices
        if ch.delta.content or ch.delta.tool_calls
    ]
    assert kinds[0] == "text" and kinds[-1] == "text" and kinds.count("call") == 2


def test_messages_keep_text_blocks_and_tool_use_in_order(client: TestClient, reply: str) -> None:
    claude = _claude(client)
    tools: list[anthropic.types.ToolParam] = [
        {"name": "get_weather", "input_schema": CITY},
        {"name": "get_time", "input_schema": {"type": "object"}},
    ]
    ask: list[anthropic.types.MessageParam] = [{"role": "user", "content": ASK}]
    whole = claude.messages.create(model="a", max_tokens=400, messages=ask, tools=tools)
    assert whole.stop_reason == "tool_use"

    def shape(blocks: list[anthropic.types.ContentBlock]) -> list[object]:
        return [
            b.text if b.type == "text" else (b.name, b.input)  # type: ignore[union-attr]
            for b in blocks
        ]

    expected = ["Sure.", ("get_weather", {"city": "Oslo"}), ("get_time", {}), "I asked both."]
    assert shape(whole.content) == expected
    with claude.messages.stream(model="a", max_tokens=400, messages=ask, tools=tools) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and shape(final.content) == expected
    started = [
        e.content_block.id
        for e in events
        if e.type == "content_block_start" and e.content_block.type == "tool_use"
    ]
    ids = [b.id for b in final.content if b.type == "tool_use"]
    assert started == ids and len(set(ids)) == 2
    assert final.usage.output_tokens > 0


def test_responses_keep_text_after_calls(client: TestClient, reply: str) -> None:
    oai = _openai(client)
    tools: list[openai.types.responses.FunctionToolParam] = [
        {"type": "function", "name": "get_weather", "parameters": CITY, "strict": False},
        {"type": "function", "name": "get_time", "parameters": {}, "strict": False},
    ]
    whole = oai.responses.create(model="a", input=ASK, tools=tools, store=False)
    assert whole.output_text == "Sure.\n\nI asked both."
    calls = [(i.name, json.loads(i.arguments)) for i in whole.output if i.type == "function_call"]
    assert calls == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    with oai.responses.stream(model="a", input=ASK, tools=tools, store=False) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    got = [(i.name, json.loads(i.arguments)) for i in final.output if i.type == "function_call"]
    assert got == calls


def test_a_reply_sent_back_is_the_same_turn_on_every_api() -> None:
    # Anthropic's text and tool_use blocks of a reply, sent back as the assistant turn, join
    # their texts as chat's content does: both APIs render one prompt for one conversation.
    from kvwarm.server.anthropic.schemas import CountTokensRequest
    from kvwarm.server.anthropic.translate import to_chat
    from kvwarm.server.tools import parse_tool_calls

    content, _ = parse_tool_calls(REPLY, frozenset({"get_weather", "get_time"}))
    blocks = [
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "t2", "name": "get_time", "input": {}},
        {"type": "text", "text": "I asked"},
        {"type": "text", "text": " both."},
    ]
    req = CountTokensRequest.model_validate(
        {
            "model": "a",
            "messages": [
                {"role": "user", "content": ASK},
                {"role": "assistant", "content": blocks},
                {"role": "user", "content": "And?"},
            ],
        }
    )
    turns, _ = to_chat(req)
    assert turns[1].content == content == "Sure.\n\nI asked both."


@pytest.fixture
def bare_call(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every generation's output is one bare JSON call, as a forced call's grammar makes it."""
    options = convert.options
    grammar = "root ::= " + json.dumps(W)

    def with_grammar(*args: object, **kwargs: object) -> GenerationOptions:
        opts = options(*args, **kwargs)  # type: ignore[arg-type]
        return dataclasses.replace(
            opts,
            grammar=grammar,
            grammar_triggers=(),
            grammar_once=False,
            json_schema=None,
            max_tokens=400,
        )

    monkeypatch.setattr(convert, "options", with_grammar)
    yield W


def test_forced_calls_stream_through_every_sdk_helper(client: TestClient, bare_call: str) -> None:
    oai, claude = _openai(client), _claude(client)
    chat_tools: list[openai.types.chat.ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    ]
    ask: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": ASK}]
    with oai.chat.completions.stream(
        model="a", messages=ask, tools=chat_tools, tool_choice="required"
    ) as stream:
        done = stream.get_final_completion().choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content is None
    (call,) = done.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    with claude.messages.stream(
        model="a",
        max_tokens=400,
        messages=[{"role": "user", "content": ASK}],
        tools=[{"name": "get_weather", "input_schema": CITY}],
        tool_choice={"type": "any"},
    ) as claude_stream:
        message = claude_stream.get_final_message()
    assert message.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in message.content] == [
        ("tool_use", {"city": "Oslo"})
    ]
    with oai.responses.stream(
        model="a",
        input=ASK,
        tools=[{"type": "function", "name": "get_weather", "parameters": CITY, "strict": False}],
        tool_choice="required",
        store=False,
    ) as responses_stream:
        response = responses_stream.get_final_response()
    assert [(i.type, getattr(i, "name", None)) for i in response.output] == [
        ("function_call", "get_weather")
    ]
    assert response.output_text == ""
