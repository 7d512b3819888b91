"""JSON integer literals of more than 4,300 digits in tool-call arguments.

Python's ``json`` refuses them with a plain ``ValueError`` ("Exceeds the limit (4300 digits)
for integer string conversion"), which is *not* a ``json.JSONDecodeError``. ``read_json``
catches ``ValueError`` for the body itself, but the arguments *strings* inside it are parsed
later by code that catches only ``(json.JSONDecodeError, RecursionError)``:

- ``tools._arguments_object`` (tools.py:86): an assistant message's ``tool_calls[].function
  .arguments`` string (chat completions, ``/cache/prewarm``) and a Responses ``function_call``
  item's ``arguments`` -> an unexpected error, 500 ``internal_error`` with a traceback logged.
- ``tools._as_call`` / ``tools._json_values`` (tools.py:216, 230) and ``ToolStream.finish``
  parse the *model's* reply the same way: a reply holding such a number makes a non-streamed
  response a 500 and, streamed, raises a ``ValueError`` out of the SSE generator, which
  ``generate.sse`` does not turn into an error event (it catches ``KvwarmError`` only): the
  connection drops after the call's deltas, with neither an error event nor ``[DONE]``.

A bad argument string must be a 4xx or be kept as opaque text (as malformed JSON already is);
a model reply must never crash the parser.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app
from kvwarm.server.tool_stream import ToolStream
from kvwarm.server.tools import parse_tool_calls

from .conftest import stub_settings, wait_ready

BIG = "9" * 5000  # a valid JSON number, over CPython's 4,300-digit int conversion limit

CALL_THEN_RESULT = [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": BIG}}
        ],
    },
    {"role": "tool", "tool_call_id": "c", "content": "r"},
    {"role": "user", "content": "x"},
]

REQUESTS = {
    "chat": ("/v1/chat/completions", {"model": "a", "max_tokens": 2, "messages": CALL_THEN_RESULT}),
    "chat-stream": (
        "/v1/chat/completions",
        {"model": "a", "max_tokens": 2, "messages": CALL_THEN_RESULT, "stream": True},
    ),
    "responses": (
        "/v1/responses",
        {
            "model": "a",
            "max_output_tokens": 2,
            "input": [
                {"type": "function_call", "call_id": "x", "name": "f", "arguments": BIG},
                {"type": "function_call_output", "call_id": "x", "output": "y"},
            ],
        },
    ),
    "prewarm": ("/cache/prewarm", {"model": "a", "messages": CALL_THEN_RESULT}),
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings()), raise_server_exceptions=False) as test_client:
        wait_ready(test_client.get)
        yield test_client


@pytest.mark.parametrize("case", sorted(REQUESTS))
def test_huge_integer_in_request_arguments_is_not_a_500(client: TestClient, case: str) -> None:
    path, body = REQUESTS[case]
    response = client.post(path, json=body)
    # Before the fix: 500 {"error": {"message": "internal server error", "code": "internal_error"}}
    assert response.status_code < 500, response.text


def test_model_reply_with_huge_integer_does_not_crash_the_parser() -> None:
    reply = '<tool_call>{"name": "f", "arguments": {"x": ' + BIG + "}}</tool_call>"
    parse_tool_calls(reply, frozenset({"f"}))  # before the fix: ValueError (4300 digits)


def test_streamed_reply_with_huge_integer_finishes() -> None:
    stream = ToolStream(frozenset({"f"}), forced=False)
    stream.feed('<tool_call>{"name": "f", "arguments": {"x": ' + BIG + "}}</tool_call>")
    # Before the fix: ValueError escaped, and generate.sse let it drop the connection.
    stream.finish()
