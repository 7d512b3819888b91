"""A crowd of concurrent connections against a model's ``max_queue``, over real sockets to a
server on 127.0.0.1: past the queue a request is a 429 ``queue_full`` at once (not held
open), a queued request whose client leaves gives its place back at once (not when a slot
frees), and those that waited are served once the slot is free. The stub's forward passes
are held at a gate, so the one slot stays busy while the test looks; every wait is a socket
read with a deadline or bounded polling of the model's state.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from kvwarm.backends.stub import StubBackend
from kvwarm.settings import ModelSpec

from ..engine.test_rerank_stub import RecordingBackend
from .conftest import LiveServer, gated_live, stub_settings

QUEUE = 3
CROWD = 10


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LiveServer, RecordingBackend]]:
    backend = RecordingBackend()
    monkeypatch.setattr(StubBackend, "from_env", classmethod(lambda cls: backend))
    settings = stub_settings(
        models=(ModelSpec(path="stub-a", id="a"),),
        allowed_hosts=(),
        n_parallel=1,
        max_queue=QUEUE,
        request_timeout_s=0,
    )
    with gated_live(settings, backend) as server:
        yield server, backend


def _post(server: LiveServer, prompt: str) -> socket.socket:
    raw = json.dumps({"model": "a", "prompt": prompt, "max_tokens": 2}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(head + raw)
    return sock


def _answer(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _until(ready: Callable[[], bool], deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not ready():
        assert time.monotonic() < end, "the server did not get there in time"
        time.sleep(0.02)


def test_a_crowd_past_max_queue_is_refused_at_once_and_the_queue_served(
    live: tuple[LiveServer, RecordingBackend],
) -> None:
    server, backend = live
    assert backend.gate is not None
    model = server.server.config.app.state.kvwarm.entries["a"].model
    first = _post(server, "the one in the slot")
    assert backend.entered.wait(60), "the first request never reached the model"
    crowd = [_post(server, f"waiting {i}") for i in range(CROWD)]
    refused: list[bytes] = []
    waiting = list(crowd)
    end = time.monotonic() + 30
    while len(refused) < CROWD - QUEUE:  # answered while the slot is still held
        assert time.monotonic() < end, f"only {len(refused)} refused: {refused[:1]!r}"
        ready, _, _ = select.select(waiting, [], [], end - time.monotonic())
        for sock in ready:
            refused.append(_answer(sock))
            waiting.remove(sock)
            sock.close()
    assert all(r.startswith(b"HTTP/1.1 429 ") and b'"queue_full"' in r for r in refused)
    assert len(waiting) == QUEUE and model.status().queued == QUEUE
    # Two queued clients leave: their places are free at once, the slot still held.
    for sock in waiting[:2]:
        sock.close()
    _until(lambda: model.status().queued == QUEUE - 2)
    late = [_post(server, f"late {i}") for i in range(2)]
    _until(lambda: model.status().queued == QUEUE)
    backend.gate.set()
    for sock in [first, *waiting[2:], *late]:
        with sock:
            answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
