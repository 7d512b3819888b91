"""Fixtures: a stub-backed app under Starlette's TestClient, and a live uvicorn server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from fastapi.testclient import TestClient

from kvwarm.cache.types import PolicyConfig
from kvwarm.engine.request import Request
from kvwarm.engine.worker.admission import Admission, Planned, Restored
from kvwarm.server import create_app
from kvwarm.server.connections import Server, uvicorn_config
from kvwarm.server.state import ServerState
from kvwarm.settings import ModelSpec, Settings

# Low gates so that short test prompts are cached.
LOW_POLICY = PolicyConfig(
    min_tokens=16,
    cold_min_tokens=16,
    boundary_align_tokens=16,
    boundary_trim_tokens=0,
    continued_interval=64,
)


def stub_settings(**overrides: object) -> Settings:
    base = Settings(
        backend="stub",
        models=(ModelSpec(path="stub-a", id="a"), ModelSpec(path="stub-b", id="b", n_ctx=256)),
        cache_dir=None,
        n_ctx=1024,
        n_batch=64,
        policy=LOW_POLICY,
        keepalive_interval_s=0,
        max_body_bytes=64 << 10,
        default_max_tokens=32,
        allowed_hosts=("testserver",),  # the Host header of Starlette's TestClient
    )
    return base.replace(**overrides)


def wait_ready(get: object, deadline_s: float = 120.0) -> None:
    """Poll /health until 200 (bounded): readiness waiting, not synchronisation by sleep."""
    assert callable(get)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        response = get("/health")
        if response.status_code == 200:
            return
        body = response.json()
        if body.get("status") == "error":
            raise AssertionError(f"model failed to load: {body}")
        time.sleep(0.05)
    raise AssertionError("server did not become ready in time")


def serve_tiny_models(specs: tuple[ModelSpec, ...]) -> Iterator[TestClient]:
    """A TestClient over real tiny GGUFs (``tests.tinymodels``), one slot each, ready: a
    prompt of these is a token a byte, so a tools' JSON needs a context of 2,048."""
    settings = Settings(
        models=specs,
        cache_dir=None,
        n_ctx=2048,
        n_batch=512,
        n_parallel=1,
        policy=LOW_POLICY,
        keepalive_interval_s=0,
        default_max_tokens=64,
        allowed_hosts=("testserver",),
    )
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


#: A tool whose one valid call is ``get_weather({"q": "x"})``, and a prompt that asks nothing:
#: tiny random-weight models are held to it by the tool-call grammar alone.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"q": {"const": "x"}},
    "required": ["q"],
    "additionalProperties": False,
}
WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}
]
ASK_HI = [{"role": "user", "content": "hi"}]


def data_events(text: str) -> list[dict[str, Any]]:
    """The JSON of each ``data:`` line of a streamed Anthropic or Responses reply."""
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]


def streamed_call(text: str) -> tuple[str, str, str]:
    """A streamed chat completion's content, and its one tool call's name and arguments, each
    joined from their deltas."""
    content, name, arguments = "", "", ""
    for event in sse_events(text):
        assert isinstance(event, dict)
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                name += call["function"].get("name") or ""
                arguments += call["function"].get("arguments") or ""
    return content, name, arguments


def anthropic_weather_call(client: TestClient, model: str, max_tokens: int) -> list[dict[str, Any]]:
    """Ask ``model`` for the weather over ``/v1/messages`` with ``tool_choice`` auto, whole
    and streamed: the whole message is exactly the call ``get_weather({"q": "x"})`` (text
    blocks of whitespace aside) and stops for ``tool_use``, and the streamed call's input is
    ``{"q": "x"}``. Returns the streamed events, for what a test checks beyond."""
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": ASK_HI,
        "tools": [{"name": "get_weather", "input_schema": WEATHER_PARAMETERS}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    }
    response = client.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    message = response.json()
    blocks = [b for b in message["content"] if b["type"] != "text" or b["text"].strip()]
    assert [(b["type"], b.get("name"), b.get("input")) for b in blocks] == [
        ("tool_use", "get_weather", {"q": "x"})
    ]
    assert message["stop_reason"] == "tool_use"
    streamed = client.post("/v1/messages", json=body | {"stream": True})
    assert streamed.status_code == 200, streamed.text
    events = data_events(streamed.text)
    given = "".join(
        e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta"
    )
    assert json.loads(given) == {"q": "x"}
    return events


def responses_weather_call(
    client: TestClient, model: str, max_output_tokens: int
) -> tuple[dict[str, Any], list[object]]:
    """Ask ``model`` for the weather over ``/v1/responses``, one call at most: its output's
    function calls are exactly ``get_weather({"q": "x"})``. Returns the request's body and
    the output, for what a test checks beyond."""
    body: dict[str, Any] = {
        "model": model,
        "input": "hi",
        "temperature": 0,
        "max_output_tokens": max_output_tokens,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMETERS}],
        "parallel_tool_calls": False,
    }
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    output = response.json()["output"]
    calls = [item for item in output if item["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"q": "x"})]
    return body, output


def tool_chat(
    model: str, messages: object, tools: object, max_tokens: int, **extra: object
) -> dict[str, object]:
    """A greedy chat completion's body with ``tools``, one call at most."""
    body: dict[str, object] = {
        "model": model,
        "messages": messages,
        "tools": tools,
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    return body | extra


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings())) as test_client:
        wait_ready(test_client.get)
        yield test_client


def sse_events(text: str) -> list[object]:
    """Parse an SSE body into JSON events; asserts the [DONE] terminator comes last."""
    lines = [line for line in text.split("\n") if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


class LiveServer:
    """uvicorn on 127.0.0.1 and a free port, in a thread; ``stop()`` shuts it down cleanly."""

    def __init__(self, settings: Settings, *, http: str = "auto", **options: object) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        # As ``kvwarm serve`` runs it: with its connection limits (server/connections.py).
        app = create_app(settings)
        config = uvicorn_config(app, settings, http=http, lifespan="on", **options)
        self.server = Server(config, drain=app.state.kvwarm.drain)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self, deadline_s: float = 180.0) -> LiveServer:
        self.thread.start()
        with httpx.Client(base_url=self.base_url, timeout=10) as http:
            end = time.monotonic() + deadline_s
            while not self.server.started:  # bounded wait for the socket to serve
                assert time.monotonic() < end and self.thread.is_alive(), "uvicorn did not start"
                time.sleep(0.02)
            wait_ready(http.get, deadline_s)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "server thread did not stop"
        self.sock.close()


class GateHolder(Protocol):
    """A stub backend whose forward passes wait at ``gate`` (``RecordingBackend``'s)."""

    entered: threading.Event
    gate: threading.Event | None


@contextmanager
def gated_live(settings: Settings, backend: GateHolder) -> Iterator[LiveServer]:
    """A live server on ``settings`` whose stub's forward passes wait at a fresh gate until
    the test opens it (opened at the end, so the server can stop)."""
    server = LiveServer(settings).start()
    backend.entered.clear()
    backend.gate = threading.Event()
    try:
        yield server
    finally:
        backend.gate.set()
        server.stop()


@pytest.fixture
def tmp_cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def server_state(client: TestClient) -> ServerState:
    """The app's ``ServerState`` (its registry, its stored and running responses)."""
    state = client.app.state.kvwarm  # type: ignore[attr-defined]
    assert isinstance(state, ServerState)
    return state


def background_ended(client: TestClient, response_id: str) -> None:
    """Wait (on the app's loop, bounded) until the background response has ended."""
    pending = server_state(client).responses.running(response_id)
    if pending is None:
        return
    assert client.portal is not None

    async def wait() -> None:
        await asyncio.wait_for(pending.ended.wait(), 60)

    client.portal.call(wait)


def hold_restores(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Hold each request the worker admits in its restore: ``entered`` is set once one is
    there (out of the queue, not yet in a slot), and it goes on once ``release`` is set."""
    entered, release = threading.Event(), threading.Event()
    real = Admission.restore

    def held(admission: Admission, planned: Planned, req: Request) -> Restored:
        entered.set()
        assert release.wait(60)
        return real(admission, planned, req)

    monkeypatch.setattr(Admission, "restore", held)
    return entered, release
