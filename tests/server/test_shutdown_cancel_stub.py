"""A request the server's shutdown cancels before its response started gets a 503 in the
API's shape (found by review: uvicorn answered it with a plain-text 500); Anthropic's is its
529 ``overloaded_error``."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvwarm.server.app import _Observe
from kvwarm.server.state import ServerState

from .conftest import stub_settings


@pytest.mark.parametrize(("path", "status"), [("/v1/chat/completions", 503), ("/v1/messages", 529)])
def test_a_request_cancelled_by_the_shutdown_is_answered_in_its_apis_shape(
    path: str, status: int
) -> None:
    sent: list[dict[str, object]] = []

    async def run() -> None:
        entered = asyncio.Event()

        async def waiting_route(scope: object, receive: object, send: object) -> None:
            entered.set()
            await asyncio.Event().wait()  # a generation that has not produced its answer

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        app = _Observe(waiting_route, ServerState(stub_settings()))
        scope = {
            "type": "http",
            "method": "POST",
            "path": path,
            "headers": [(b"host", b"testserver"), (b"content-type", b"application/json")],
        }
        task = asyncio.ensure_future(app(scope, receive, send))  # type: ignore[arg-type]
        await entered.wait()
        task.cancel()  # what uvicorn does once its graceful shutdown times out
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert sent and sent[0]["type"] == "http.response.start"
    assert sent[0]["status"] == status
    body = json.loads(sent[1]["body"])  # type: ignore[arg-type]
    if status == 529:
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
    else:
        assert body["error"]["code"] == "shutting_down", body
