"""Issue 41: a stream cut by the server's deadline, by a worker that died, or by the end of
shutdown's graceful wait ends with an error event in its API's shape (then ``[DONE]`` where
the API has one), never silently; a reply whose second tool call is cut off by max_tokens
says so (``length``, ``max_tokens``, ``incomplete``), streamed and plain."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvwarm.errors import GrammarError
from kvwarm.server import create_app
from kvwarm.server.generate import sse

from .conftest import LiveServer, stub_settings, wait_ready

MESSAGES = [{"role": "user", "content": "tell me a very long story"}]
# Each API's streaming request for a long reply: greedy, whose stub reply (a function of the
# prompt) runs past its 150 tokens before a "!" would end it (checked below).
GREEDY = {"temperature": 0}
STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 150, **GREEDY}),
    "completions": ("/v1/completions", {"prompt": "once upon a time", "max_tokens": 150, **GREEDY}),
    "anthropic": ("/v1/messages", {"messages": MESSAGES, "max_tokens": 150, **GREEDY}),
    "responses": ("/v1/responses", {"input": MESSAGES, "max_output_tokens": 150, **GREEDY}),
}


def events(text: str) -> list[tuple[str | None, str]]:
    """An SSE body as (event name or None, data) pairs."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            out.append((name, "\n".join(data)))
    return out


def assert_ends_with_error(api: str, text: str, code: str) -> None:
    """The stream's end is its API's error shape, carrying ``code`` (OpenAI, Responses) or a
    message (Anthropic's error has no code)."""
    got = events(text)
    assert got, text
    if api in ("chat", "completions"):
        assert got[-1] == (None, "[DONE]"), got[-3:]
        error = json.loads(got[-2][1])["error"]
        assert error["code"] == code, error
    elif api == "anthropic":
        name, data = got[-1]
        assert name == "error", got[-3:]
        body = json.loads(data)
        assert body["type"] == "error" and body["error"]["message"], body
    else:
        names = [n for n, _ in got]
        assert names[-2:] == ["error", "response.failed"], text[-3000:]
        assert json.loads(got[-2][1])["code"] == code
        failed = json.loads(got[-1][1])["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == code, failed


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_each_reply_runs_to_its_limit_unless_cut(api: str) -> None:
    """What the tests below cut is a reply that would run its whole length."""
    with TestClient(create_app(stub_settings(models=stub_settings().models[:1]))) as client:
        wait_ready(client.get)
        path, body = STREAMS[api]
        text = client.post(path, json={"model": "a", "stream": True, **body}).text
    assert '"length"' in text or '"max_tokens"' in text or '"incomplete"' in text, text[-500:]


@pytest.fixture
def slow_client() -> Iterator[TestClient]:
    settings = stub_settings(models=stub_settings().models[:1], request_timeout_s=0.5)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        model = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
        model._bmodel.backend.decode_delay_s = 0.02  # 150 tokens: 3 s, past the deadline
        yield client


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_stream_past_the_deadline_ends_with_an_error(slow_client: TestClient, api: str) -> None:
    """... and is counted as a cancelled generation (found by review: its end was read by
    ``Generation.fragments``, which raised the deadline's error before ``result`` counted
    it, and ``close`` counted only a stream not yet done: it was counted nowhere)."""
    path, body = STREAMS[api]
    before = _cancelled(slow_client)
    response = slow_client.post(path, json={"model": "a", "stream": True, **body})
    assert response.status_code == 200
    assert_ends_with_error(api, response.text, "request_timeout")
    assert _cancelled(slow_client) == before + 1


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_stream_past_the_deadline_before_its_first_token_is_an_error_status(
    slow_client: TestClient, api: str
) -> None:
    """Nothing sent yet: the deadline is the response's status, as for a reply not streamed
    (found by review: a 200 stream of one error event), and the generation is counted."""
    model = slow_client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
    model._bmodel.backend.decode_delay_s = 2.0  # the prompt's pass outlasts the 0.5 s
    path, body = STREAMS[api]
    before = _cancelled(slow_client)
    response = slow_client.post(path, json={"model": "a", "stream": True, **body})
    error = response.json()["error"]
    if api == "anthropic":  # Anthropic's shape of a 503: its overloaded_error
        assert (response.status_code, error["type"]) == (529, "overloaded_error"), error
        assert "request_timeout_s" in error["message"]
    else:
        assert (response.status_code, error["code"]) == (503, "request_timeout"), error
    assert _cancelled(slow_client) == before + 1


def _cancelled(client: TestClient) -> float:
    """``kvwarm_generations_total`` of model a's cancelled generations."""
    registry = client.app.state.kvwarm.counters.registry  # type: ignore[attr-defined]
    labels = {"model": "a", "reason": "cancelled"}
    return float(registry.get_sample_value("kvwarm_generations_total", labels) or 0.0)


class _Died(BaseException):
    pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_stream_whose_worker_dies_ends_with_an_error(api: str) -> None:
    settings = stub_settings(models=stub_settings().models[:1])
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        model = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
        tick = model._worker.tick
        real = tick.run
        ticks = [0]

        def dying() -> None:  # some tokens out, then the thread dies
            ticks[0] += 1
            if ticks[0] > 6:
                raise _Died()
            real()

        tick.run = dying
        path, body = STREAMS[api]
        response = client.post(path, json={"model": "a", "stream": True, **body})
        assert response.status_code == 200
        assert_ends_with_error(api, response.text, "engine_closed")


@pytest.mark.parametrize("api", sorted(STREAMS))
def test_a_stream_cut_by_the_shutdown_ends_with_an_error(api: str) -> None:
    """uvicorn cancels what is still running when its graceful wait ends; the stream had then
    ended with no error event. The server now ends its streams just before."""
    settings = stub_settings(models=stub_settings().models[:1])
    live = LiveServer(settings, timeout_graceful_shutdown=1).start()
    stopped = False
    try:
        model = live.server.config.app.state.kvwarm.entries["a"].model
        model._bmodel.backend.decode_delay_s = 0.05  # 150 tokens: 7.5 s
        path, body = STREAMS[api]
        request = {"model": "a", "stream": True, **body}
        with (
            httpx.Client(base_url=live.base_url, timeout=30) as http,
            http.stream("POST", path, json=request) as resp,
        ):
            assert resp.status_code == 200
            lines = resp.iter_lines()
            text = next(lines) + "\n"  # the stream is running
            stopper = threading.Thread(target=live.stop)
            start = time.monotonic()
            stopper.start()
            stopped = True
            for line in lines:
                text += line + "\n"
            took = time.monotonic() - start
        stopper.join(60)
    finally:
        if not stopped:
            live.stop()
    assert took < 5, took
    assert_ends_with_error(api, text, "shutting_down")


def test_an_error_mid_stream_names_its_field_as_before_the_stream() -> None:
    """Found by fuzzing: a grammar that admits no further token after the stream began ended
    it with ``param`` null, where the same error before the first token is a 400 naming
    ``grammar``."""

    async def events() -> AsyncIterator[dict[str, object]]:
        yield {"choices": []}
        raise GrammarError("the grammar admits no further token", param="grammar")

    async def lines() -> list[bytes]:
        return [line async for line in sse(events(), lambda: None)]

    got = asyncio.run(lines())
    assert got[-1] == b"data: [DONE]\n\n"
    error = json.loads(got[-2].decode()[len("data: ") :])["error"]
    assert (error["code"], error["param"]) == ("invalid_grammar", "grammar")
