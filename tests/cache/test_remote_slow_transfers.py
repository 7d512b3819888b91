"""Remote transfers that trickle (found by review): botocore, urllib3 and redis-py bound each
socket read or send by their timeout, not a whole body, so a store that sends (or takes) a
few bytes now and then held a GET or a PUT for as long as the body lasted -- a restore runs
on the engine's thread, so the whole model worker with it. A transfer slower than the floor
(``min_bytes_per_s``, averaged over a read timeout) is now abandoned as a network fault.

The stores here are servers on 127.0.0.1 that pace their writes (or reads): HTTP for s3,
RESP for redis. Each slow call runs on a thread and must end within a bound far shorter than
the trickle would last (over 8 minutes); the old code ran past it."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from kvwarm.cache.tiers.redis import RedisStore
from kvwarm.cache.tiers.s3 import S3Tier
from kvwarm.cache.types import S3Config
from kvwarm.errors import CacheNetworkError

_STEP_S = 0.05  # the trickle's pace: one piece a step
_PIECE = 100  # bytes a step: 2 KB/s, a thousandth of the default floor (1 MiB/s)
_BODY = 1 << 20  # a trickled body lasts 1 MiB / 2 KB/s: over 8 minutes
_BOUND_S = 6.0  # a slow call must have ended by then (the floor's window is 1 s here)


class _Conn:
    """One accepted connection: buffered reads, and the server's pace."""

    def __init__(self, sock: socket.socket, stop: threading.Event) -> None:
        self.sock = sock
        self._stop = stop
        self._buf = b""

    def step(self) -> bool:
        """Wait one step of the trickle; False once the server stops."""
        return not self._stop.wait(_STEP_S)

    def _fill(self, slow: bool) -> bool:
        if slow and not self.step():
            return False
        data = self.sock.recv(16 << 10 if slow else 1 << 16)
        self._buf += data
        return bool(data)

    def line(self) -> bytes | None:
        while b"\r\n" not in self._buf:
            if not self._fill(False):
                return None
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line

    def take(self, n: int, slow: bool = False) -> bytes | None:
        while len(self._buf) < n:
            if not self._fill(slow):
                return None
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def trickle(self, n: int) -> bool:
        """Send ``n`` bytes, ``_PIECE`` a step; False if stopped first."""
        sent = 0
        while sent < n:
            if not self.step():
                return False
            self.sock.sendall(b"x" * min(_PIECE, n - sent))
            sent += _PIECE
        return True


class _Server:
    """A server on 127.0.0.1 running ``serve`` on each connection; a small receive buffer, so a
    body it reads slowly stalls its sender soon. ``stop`` closes every connection."""

    def __init__(self, serve: Callable[[_Conn], None]) -> None:
        self._serve = serve
        self._stop = threading.Event()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(sock)
            thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self, sock: socket.socket) -> None:
        try:
            self._serve(_Conn(sock, self._stop))
        except OSError:
            pass
        finally:
            sock.close()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):  # wakes the accept (a close alone does not)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in list(self._conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in list(self._threads):
            thread.join(timeout=10)


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[_Conn], None]], _Server]]:
    servers: list[_Server] = []

    def start(handler: Callable[[_Conn], None]) -> _Server:
        servers.append(_Server(handler))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _ends_in_time(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` on a thread; what it raised (None: it returned), failing the test if it has
    not ended within ``_BOUND_S``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(_BOUND_S)
    assert not thread.is_alive(), f"still transferring after {_BOUND_S}s"
    return outcome[0]


# ---- s3 --------------------------------------------------------------------------------------


def _http(conn: _Conn, answer: Callable[[str, str, dict[str, str], _Conn], bool]) -> None:
    """Requests on one keep-alive connection, each handed to ``answer`` with its head read
    (a False answer ends the connection)."""
    while True:
        first = conn.line()
        if not first:
            return
        method, path, _ = first.decode().split(" ", 2)
        headers: dict[str, str] = {}
        while (line := conn.line()) is not None and line:
            name, value = line.decode().split(":", 1)
            headers[name.strip().lower()] = value.strip()
        if not answer(method, path, headers, conn):
            return


def _ok(conn: _Conn, body: bytes = b"payload") -> bool:
    head = f'HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nETag: "e"\r\n\r\n'
    conn.sock.sendall(head.encode() + body)
    return True


def _trickled_gets(method: str, path: str, headers: dict[str, str], conn: _Conn) -> bool:
    """GETs of ``.../first.kvc`` answered at once (the tier learns its route), any other's
    body trickled."""
    if path.endswith("/first.kvc"):
        return _ok(conn)
    conn.sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {_BODY}\r\n\r\n".encode())
    return conn.trickle(_BODY)


def _slow_puts(method: str, path: str, headers: dict[str, str], conn: _Conn) -> bool:
    """A PUT's body taken 16 KiB a step (~330 KB/s), then answered: each of the client's
    block sends (128 KiB) waits ~0.4 s, none its timeout."""
    if headers.get("expect", "").lower() == "100-continue":
        conn.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if conn.take(int(headers.get("content-length", "0")), slow=True) is None:
        return False
    return _ok(conn, b"")


def _s3_config(port: int) -> S3Config:
    return S3Config(
        bucket="b",
        prefix="rows/",
        endpoint_url=f"http://127.0.0.1:{port}",
        region="us-east-1",
        connect_timeout_s=1.0,
        read_timeout_s=1.0,  # the floor's window
        max_attempts=1,
        down_for_s=30.0,
    )


@pytest.fixture
def aws_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSLOW")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "slow-secret")


@pytest.mark.parametrize("way", ["lean", "client"])
@pytest.mark.usefixtures("aws_keys")
def test_an_s3_get_that_trickles_is_abandoned_as_a_network_fault(
    serve: Callable[[Callable[[_Conn], None]], _Server], way: str
) -> None:
    """The lean way (a bucket's GETs after its first) and the client's (its first): the body
    comes 100 bytes a step, each piece well within the read timeout."""
    server = serve(lambda conn: _http(conn, _trickled_gets))
    tier = S3Tier(_s3_config(server.port), 1 << 30)
    if way == "lean":
        assert tier._s3.get("first.kvc").data == b"payload"
        assert tier.wire.lean is not None and tier.wire.lean.routed("b")
    err = _ends_in_time(lambda: tier._s3.get("slow.kvc"))
    assert isinstance(err, CacheNetworkError), err
    assert "bytes a second" in str(err)
    assert tier.wire.is_down()  # the breaker tripped, as for any network fault


@pytest.mark.usefixtures("aws_keys")
def test_an_s3_put_the_store_takes_slowly_is_abandoned_as_a_network_fault(
    serve: Callable[[Callable[[_Conn], None]], _Server],
) -> None:
    """The store reads the body 16 KiB a step. 8 MiB: more than the kernel's buffers take at
    once, and over 20 s at that pace."""
    server = serve(lambda conn: _http(conn, _slow_puts))
    tier = S3Tier(_s3_config(server.port), 1 << 30)
    err = _ends_in_time(lambda: tier._s3.put_if_absent("slow.kvc", b"y" * (8 << 20)))
    assert isinstance(err, CacheNetworkError), err
    assert "bytes a second" in str(err)
    assert tier.wire.is_down()


def _paced_gets(method: str, path: str, headers: dict[str, str], conn: _Conn) -> bool:
    """A 1.2 MiB body in 64 KiB pieces a step (~1.3 MB/s): it lasts a second, five of the
    floor's windows, each above the floor."""
    pieces = 20
    conn.sock.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {pieces << 16}\r\n\r\n".encode())
    for _ in range(pieces):
        if not conn.step():
            return False
        conn.sock.sendall(b"z" * (1 << 16))
    return True


@pytest.mark.parametrize("way", ["lean", "client"])
@pytest.mark.usefixtures("aws_keys")
def test_an_s3_get_slower_than_a_window_but_above_the_floor_completes(
    serve: Callable[[Callable[[_Conn], None]], _Server], way: str
) -> None:
    """A rate rule, not a deadline: a body that takes several windows comes whole."""

    def answer(method: str, path: str, headers: dict[str, str], conn: _Conn) -> bool:
        return (
            _ok(conn) if path.endswith("/first.kvc") else _paced_gets(method, path, headers, conn)
        )

    server = serve(lambda conn: _http(conn, answer))
    cfg = replace(_s3_config(server.port), read_timeout_s=0.2, min_bytes_per_s=256 << 10)
    tier = S3Tier(cfg, 1 << 30)
    if way == "lean":
        assert tier._s3.get("first.kvc").data == b"payload"
    assert tier._s3.get("paced.kvc").data == b"z" * (20 << 16)
    assert not tier.wire.is_down()


# ---- redis -----------------------------------------------------------------------------------


def _resp(conn: _Conn, answer: Callable[[list[bytes], _Conn], bool]) -> None:
    """RESP commands on one connection, each handed to ``answer`` (a bulk string over 64 KiB
    read 16 KiB a step)."""
    while True:
        head = conn.line()
        if not head:
            return
        assert head.startswith(b"*"), head
        args: list[bytes] = []
        for _ in range(int(head[1:])):
            size = conn.line()
            if size is None:
                return
            data = conn.take(int(size[1:]) + 2, slow=int(size[1:]) > 1 << 16)
            if data is None:
                return
            args.append(data[:-2])
        if not answer(args, conn):
            return


def _handshake(args: list[bytes], conn: _Conn) -> bool:
    """Answer what the client sends on connecting (HELLO, CLIENT SETINFO); False for any
    other command."""
    if args[0].upper() == b"HELLO":  # RESP3, redis-py 8's default
        conn.sock.sendall(b"%1\r\n+proto\r\n:" + args[1] + b"\r\n")
    elif args[0].upper() == b"CLIENT":
        conn.sock.sendall(b"+OK\r\n")
    else:
        return False
    return True


def _trickled_getrange(args: list[bytes], conn: _Conn) -> bool:
    if _handshake(args, conn):
        return True
    assert args[0].upper() == b"GETRANGE", args
    conn.sock.sendall(f"${_BODY}\r\n".encode())
    return conn.trickle(_BODY) and conn.sock.sendall(b"\r\n") is None


def test_a_redis_reply_that_trickles_is_abandoned_as_a_network_fault(
    serve: Callable[[Callable[[_Conn], None]], _Server],
) -> None:
    """redis-py's socket timeout bounds each read too: a reply 100 bytes a step held the
    caller for the whole reply."""
    server = serve(lambda conn: _resp(conn, _trickled_getrange))
    store = RedisStore(f"redis://127.0.0.1:{server.port}/0?timeout_s=1")
    err = _ends_in_time(lambda: store.get_range("slow", 0, _BODY))
    assert isinstance(err, CacheNetworkError), err
    assert "bytes a second" in str(err)
    assert store._breaker.is_down()


def _slow_put(args: list[bytes], conn: _Conn) -> bool:
    if not _handshake(args, conn):
        conn.sock.sendall(b":1\r\n")  # EVALSHA of the put script: put
    return True


def test_a_redis_put_the_server_takes_slowly_ends(
    serve: Callable[[Callable[[_Conn], None]], _Server],
) -> None:
    """The server reads the value 16 KiB a step: the value is one ``sendall``, which Python
    bounds as a whole by the socket timeout."""
    server = serve(lambda conn: _resp(conn, _slow_put))
    store = RedisStore(f"redis://127.0.0.1:{server.port}/0?timeout_s=1")
    err = _ends_in_time(lambda: store.put_if_absent("slow", b"y" * (8 << 20)))
    assert isinstance(err, CacheNetworkError), err
    assert store._breaker.is_down()


# ---- the setting -----------------------------------------------------------------------------


def test_the_floor_is_set_by_setting_and_url_and_a_negative_one_is_refused() -> None:
    from kvwarm.cache.tiers.s3 import s3_config_from_url
    from kvwarm.errors import ConfigError
    from kvwarm.settings import load_settings
    from kvwarm.settings.cache import s3_config

    assert S3Config(bucket="b").min_bytes_per_s == 1 << 20
    cfg = s3_config(load_settings({}, {"KVWARM_S3_BUCKET": "b", "KVWARM_S3_MIN_BYTES_PER_S": "2M"}))
    assert cfg is not None and cfg.min_bytes_per_s == 2 << 20
    assert s3_config_from_url("s3://b/p/?min_bytes_per_s=0").min_bytes_per_s == 0
    with pytest.raises(ConfigError, match="min_bytes_per_s must be >= 0"):
        s3_config_from_url("s3://b/p/?min_bytes_per_s=-1")
    with pytest.raises(ConfigError, match="min_bytes_per_s must be >= 0"):
        RedisStore("redis://127.0.0.1:1/0?min_bytes_per_s=-1")
