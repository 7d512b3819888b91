"""Clients that stop reading their response, over real sockets against a server on 127.0.0.1
as ``kvwarm serve`` runs it (``server/connections.py``), under both of uvicorn's parsers.

Found by review: a client that stopped reading (its TCP window full) held its connection, its
response's memory and its model's lease (no unload, by the cap or idle) for ever: uvicorn
waits on a full send buffer with no timer, and ``request_timeout_s`` ends only a generation
still running. Now ``send_timeout_s`` closes a connection whose client took nothing of its
response for that long. Both ends' socket buffers are made small (the listening socket's
size is inherited by the connections it accepts) so that a reply of some hundred KiB fills
them. Every wait is bounded polling of the server's state or a socket read with a deadline.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from .conftest import LiveServer, stub_settings

SEND_S = 0.5
BUFFER = 4096


@pytest.fixture(scope="module", params=["h11", "httptools"])
def live(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    settings = stub_settings(
        models=stub_settings().models[:1],
        allowed_hosts=(),
        request_timeout_s=0,  # only the send timeout can end what follows
        send_timeout_s=SEND_S,
        max_tokens_limit=4096,
    )
    server = LiveServer(settings, http=request.param)
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
    yield server.start()
    server.stop()


def _until(what: str, ready: Callable[[], bool], deadline_s: float = 15.0) -> float:
    """Poll the server's state (bounded) until ``ready``; the seconds it took."""
    start = time.monotonic()
    while not ready():
        assert time.monotonic() - start < deadline_s, what
        time.sleep(0.02)
    return time.monotonic() - start


def _stalled(live: LiveServer, body: dict[str, object]) -> socket.socket:
    """A client that sends ``body`` to /v1/completions and then reads nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", live.port))
    raw = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    sock.sendall(head.encode() + raw)
    return sock


def _drained(sock: socket.socket) -> bytes:
    """What is left to read on a connection the server ended (it was aborted: maybe a reset)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


BIG = {
    "model": "a",
    "prompt": "hello",
    "max_tokens": 900,
    "logprobs": 5,
    "ignore_eos": True,
    "temperature": 1,
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_stops_reading_is_disconnected_and_its_lease_freed(
    live: LiveServer, stream: bool
) -> None:
    state = live.server.config.app.state.kvwarm
    entry = state.entries["a"]
    with _stalled(live, {**BIG, "stream": stream}) as sock:
        _until("the request never began", lambda: entry.leases > 0)
        # The engine is not held by the stalled reader: another client is served meanwhile.
        with httpx.Client(base_url=live.base_url, timeout=30) as http:
            small = {"model": "a", "prompt": "x", "max_tokens": 4}
            other = http.post("/v1/completions", json=small)
        assert other.status_code == 200, other.text
        # Used to hold for ever: the lease, the generation's buffered fragments, the socket.
        connections = live.server.server_state.connections
        took = _until(
            "a client reading nothing kept its request (and its model's lease)",
            lambda: entry.leases == 0 and not state.streams and not connections,
        )
        assert took < SEND_S + 10, took
        sock.settimeout(10)
        left = _drained(sock)
    # The client got part of the reply at most: it was cut, not served whole.
    assert len(left) < 200_000, len(left)


def test_a_slow_reader_that_keeps_reading_is_served_whole(live: LiveServer) -> None:
    """The timer is for a client that takes nothing: one reading slowly (each read within
    the timeout) gets its whole reply."""
    with _stalled(live, {**BIG, "max_tokens": 300, "stream": True}) as sock:
        data = b""
        sock.settimeout(10)
        while not data.endswith(b"\r\n0\r\n\r\n"):  # the last chunk
            chunk = sock.recv(BUFFER)
            assert chunk, data[-200:]
            data += chunk
            time.sleep(SEND_S / 10)  # a slow reader, not synchronisation
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    assert b"data: [DONE]" in data[-100:] and b'"finish_reason":"length"' in data


def test_an_unread_reply_below_the_high_water_mark_does_not_hold_its_connection(
    live: LiveServer,
) -> None:
    """A whole reply the socket buffers cannot take but whose rest is under the transport's
    high-water mark (64 KiB) never pauses writing: its handler is done, and the close that
    follows (keep-alive's end, the header timer) waits for bytes the client never reads.
    The connection must still end within the send timeout."""
    connections = live.server.server_state.connections
    body = {**BIG, "max_tokens": 300, "stream": False}  # some 45 KB
    with _stalled(live, body) as sock:
        _until("the request never began", lambda: bool(connections))
        took = _until("an unread reply kept its connection open", lambda: not connections)
        assert took < SEND_S + 15, took
        sock.settimeout(10)
        left = _drained(sock)
    assert len(left) < 40_000, len(left)  # not its whole reply
