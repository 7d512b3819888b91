"""Issue 41: no client can hold the server. Real sockets against a server on 127.0.0.1 port 0,
as ``kvwarm serve`` runs it (``server/connections.py``), under both of uvicorn's HTTP parsers.

A client that sends half a header, or a body slowly, was never dropped (uvicorn starts no
timer before the first response byte), and enough of them took the server to its open-file
limit. Every wait here is a socket read with a deadline, never a sleep.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from kvwarm.server.connections import MAX_HEADER_BYTES

from .conftest import LiveServer, stub_settings

HEADER_S = 0.5
BODY_S = 0.5
CAP = 6


@pytest.fixture(scope="module", params=["h11", "httptools"])
def live(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    settings = stub_settings(
        models=stub_settings().models[:1],
        allowed_hosts=(),
        header_timeout_s=HEADER_S,
        body_timeout_s=BODY_S,
        max_connections=CAP,
    )
    server = LiveServer(settings, http=request.param).start()
    yield server
    server.stop()


def _connect(live: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live.port), timeout=10)


def _until_eof(sock: socket.socket, deadline_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took; fails if it is
    still open after ``deadline_s``."""
    start = time.monotonic()
    data = b""
    while True:
        left = deadline_s - (time.monotonic() - start)
        assert left > 0, f"the server kept the connection open: {data[:200]!r}"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, time.monotonic() - start
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def _request(path: str = "/health", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode()


def test_half_a_header_is_a_408_within_the_timeout(live: LiveServer) -> None:
    with _connect(live) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        data, took = _until_eof(sock, 10)
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b'"code": "header_timeout"' in data
    assert HEADER_S * 0.9 <= took < HEADER_S + 3, took


def test_a_silent_connection_is_closed(live: LiveServer) -> None:
    with _connect(live) as sock:
        data, took = _until_eof(sock, 10)
    assert data == b"" or data.startswith(b"HTTP/1.1 408 "), data
    assert took < HEADER_S + 3, took


def test_a_slow_body_is_closed_within_the_timeout(live: LiveServer) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with _connect(live) as sock:
        sock.sendall(head.encode() + b'{"prompt": "')
        data, took = _until_eof(sock, 10)
    assert data == b"" or data.startswith(b"HTTP/1.1 408 "), data
    assert took < BODY_S + 3, took


def test_a_second_request_that_stalls_is_closed_too(live: LiveServer) -> None:
    """uvicorn's keep-alive timer stops at the next request's first byte."""
    with _connect(live) as sock:
        sock.sendall(_request())
        sock.settimeout(10)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        data, took = _until_eof(sock, 10)
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert took < HEADER_S + 3, took


def test_an_idle_keep_alive_connection_is_closed(live: LiveServer) -> None:
    """A client that keeps its connection open after a response, sending nothing, holds it
    no longer than the header timeout (uvicorn's own keep-alive timeout may close it first):
    idle keep-alive connections are bounded in time, as well as by the cap."""
    with _connect(live) as sock:
        sock.sendall(_request())
        sock.settimeout(10)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        data, took = _until_eof(sock, 10)
    assert data == b"" or data.startswith(b"HTTP/1.1 408 "), data
    assert took < HEADER_S + 3, took


def test_a_huge_head_is_a_431(live: LiveServer) -> None:
    with _connect(live) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        filler = b"X-Filler: " + b"a" * 1000 + b"\r\n"
        try:
            for _ in range(MAX_HEADER_BYTES // len(filler) + 8):
                sock.sendall(filler)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while sending
        data, _ = _until_eof(sock, 10)
    # h11 refuses a head past its own bound (16 KiB) with a 400 first; httptools has none.
    assert data.startswith((b"HTTP/1.1 431 ", b"HTTP/1.1 400 ")), data[:200]


def test_a_request_slower_to_answer_than_the_timeouts_is_not_cut(live: LiveServer) -> None:
    """The timers cover reading a request, not serving it."""
    model = live.server.config.app.state.kvwarm.entries["a"].model
    backend = model._bmodel.backend
    backend.decode_delay_s = 0.1
    try:
        with httpx.Client(base_url=live.base_url, timeout=30) as http:
            body = {"model": "a", "prompt": "x", "max_tokens": 12, "temperature": 0}
            start = time.monotonic()
            response = http.post("/v1/completions", json=body)
            took = time.monotonic() - start
    finally:
        backend.decode_delay_s = 0.0
    assert response.status_code == 200, response.text
    assert took > HEADER_S + BODY_S, took  # it did outlast both timers


def test_connections_past_the_cap_are_a_503_then_served_again(live: LiveServer) -> None:
    held = [_connect(live) for _ in range(CAP)]
    try:
        # Accepted in order: the held ones count before this one arrives.
        with _connect(live) as extra:
            data, _ = _until_eof(extra, 10)
        assert data.startswith(b"HTTP/1.1 503 "), data
        assert b'"code": "too_many_connections"' in data
    finally:
        for sock in held:
            sock.close()
    end = time.monotonic() + 10
    with httpx.Client(base_url=live.base_url, timeout=10) as http:
        while True:  # the server sees the closes on its next loop turns: poll, bounded
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "the server did not serve again"


def test_two_host_headers_are_a_400(live: LiveServer) -> None:
    with _connect(live) as sock:
        sock.sendall(_request(extra="Host: evil.example\r\nConnection: close\r\n"))
        data, _ = _until_eof(sock, 10)
    assert data.startswith(b"HTTP/1.1 400 "), (
        data
    )  # h11 refuses it itself; httptools took the first
    with _connect(live) as sock:  # one Host: served
        sock.sendall(_request(extra="Connection: close\r\n"))
        data, _ = _until_eof(sock, 10)
    assert data.startswith(b"HTTP/1.1 200 "), data


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        b"\r\nzz\r\n{}\r\n0\r\n\r\n",  # a chunk size that is no number
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
        b"Content-Length: 3\r\n\r\n{}",  # two lengths
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["bad-chunk", "two-lengths", "bad-header-name", "garbage"],
)
def test_a_request_that_is_not_http_is_a_400_in_the_apis_shape(
    live: LiveServer, raw: bytes
) -> None:
    """Found by review: what the parser refuses got uvicorn's own text/plain "Invalid HTTP
    request received.", where every other refusal is the API's JSON error."""
    with _connect(live) as sock:
        sock.sendall(raw)
        data, _ = _until_eof(sock, 10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), data
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_http" and error["type"] == "invalid_request_error"
    assert error["message"]


def test_the_cap_stays_below_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from kvwarm.server import connections

    limits = {"soft": 300, "hard": 300}

    def getrlimit(which: int) -> tuple[int, int]:
        return limits["soft"], limits["hard"]

    def setrlimit(which: int, value: tuple[int, int]) -> None:
        if value[0] > limits["hard"]:
            raise ValueError("above the hard limit")
        limits["soft"] = value[0]

    monkeypatch.setattr(resource, "getrlimit", getrlimit)
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert connections.connection_cap(1000) == 300 - connections.FD_RESERVE
    limits.update(soft=1024, hard=4096)  # raised as far as needed
    assert connections.connection_cap(1000) == 1000
    assert limits["soft"] == 1000 + connections.FD_RESERVE
