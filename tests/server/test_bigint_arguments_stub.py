"""JSON integer literals of more than 4,300 digits in tool-call arguments.

Python's ``json`` refuses them with a plain ``ValueError`` ("Exceeds the limit (4300 digits)
for integer string conversion"), not a ``json.JSONDecodeError``. An argument string holding
one is kept as opaque text, as malformed JSON is; a model reply holding one never crashes the
parser. Before, the parsers caught ``JSONDecodeError`` alone: an assistant message's
``tool_calls[].function.arguments`` (chat completions, ``/cache/prewarm``) or a Responses
``function_call`` item's ``arguments`` gave a 500, and a streamed reply holding such a number
raised out of the SSE generator, which ended the connection with neither an error event nor
``[DONE]``.
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
