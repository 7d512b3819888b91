"""A client that goes away in the middle of its request body (slowloris-style, or a killed
``curl``) ends that request as a client error: no "unexpected error" traceback, no 500 in the
metrics, for every route that reads a JSON body."""

from __future__ import annotations

import logging

import pytest
from starlette.types import Message

from kvwarm.server import create_app

from .conftest import stub_settings

BODY_ROUTES = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/responses",
    "/tokenize",
    "/cache/evict",
    "/admin/models/unload",
]


@pytest.mark.parametrize("path", BODY_ROUTES)
async def test_a_body_cut_short_by_a_disconnect_is_a_client_error(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(stub_settings())  # no lifespan: the body is read before any model is
    incoming: list[Message] = [
        {"type": "http.request", "body": b'{"model": "a", "pro', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    with caplog.at_level(logging.ERROR):
        await app(scope, receive, send)  # used to raise ClientDisconnect out of the app
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 400
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    exposition = app.state.kvwarm.counters.exposition(None)[0].decode()
    assert 'status="500"' not in exposition
