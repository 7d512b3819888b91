"""HTTP connections under uvicorn: no client can hold the server.

uvicorn starts no timer before a request's first response byte (its ``timeout_keep_alive``
runs only between requests, and is cancelled by the first byte of the next one), so a client
that sends half a header, or a body one byte at a time, held its connection and a file
descriptor for ever; 21,000 such clients took a server to its open-file limit, and new clients
got resets (issue 41). ``uvicorn_config`` serves the app with uvicorn's own HTTP protocol (h11
or httptools, as uvicorn picks) extended by ``_Limits``:

- **Header timeout** (``header_timeout_s``): from connecting, and from each response to the
  next request, a client has that long to send a whole request head; then it gets a 408 and
  the connection is closed. A head larger than ``MAX_HEADER_BYTES`` is a 431 (httptools has no
  bound of its own).
- **Body timeout** (``body_timeout_s``): once a request's head is in, its whole body must be in
  within that long; then a 408 (if no response began) and the connection is closed, which the
  route sees as a disconnect.
- **Send timeout** (``send_timeout_s``): bytes waiting on a client that takes none of them
  for that long (the connection's send buffers full: while the transport has paused
  writing, or once a response is complete with some of it unsent) get the connection
  aborted (its buffered bytes dropped: a close would wait on them for ever), which the
  route sees as a disconnect, so its generation is cancelled and its lease freed. Any
  progress (the buffer shrank) restarts the wait, so a slow reader is served. Found by
  review: a client that stopped reading held its connection, its reply's memory and its
  model's lease for ever (uvicorn has no write timer; ``request_timeout_s`` ends only a
  generation still running), and a reply too small to pause writing, left unread, kept
  its connection open for ever behind the close that followed it.
- **Not HTTP**: what uvicorn's parser refuses (a malformed chunk, two ``Content-Length``
  headers, a header name with a space) is a 400 ``invalid_http``, and the connection is closed.
- **Connection cap** (``max_connections``, kept below the open-file limit less
  ``FD_RESERVE``): a connection past it is answered 503 at once and closed, so the server never
  runs out of file descriptors to clients.

Timers only: a request being served (its head and body in) is never cut by the first two; generation
time is bounded by ``request_timeout_s`` instead (``server/generate.py``). The refusals are
OpenAI-shaped JSON errors. Invariants: every timer is cancelled when its connection is lost;
nothing here runs a route.

``Server`` is uvicorn's server telling the app when shutdown begins: when its graceful wait
(``timeout_graceful_shutdown``) ends, uvicorn cancels what still runs and a stream stopped
mid-reply with no error event. The app's ``drain`` ends those generations itself a moment
before (``drain_after``), with an error event in each API's shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn

from kvwarm.server.errors import error_body

if TYPE_CHECKING:
    from kvwarm.settings import Settings

log = logging.getLogger("kvwarm.server")

__all__ = [
    "FD_RESERVE",
    "MAX_HEADER_BYTES",
    "ConnectionLimits",
    "connection_cap",
    "drain_after",
    "Server",
    "uvicorn_config",
]

#: File descriptors kept for everything but client connections (the model, cache files, the
#: listening socket, logs): the connection cap stays this far below the open-file limit.
FD_RESERVE = 256
#: The largest request head accepted (request line and headers), in bytes.
MAX_HEADER_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float  # 0: none
    body_timeout_s: float  # 0: none
    max_connections: int
    send_timeout_s: float = 0.0  # 0: none


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to what the open-file limit allows less ``FD_RESERVE``
    (after raising the soft limit toward the hard one where that helps)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= want:
        return max_connections
    cap = max(1, soft - FD_RESERVE)
    log.warning(
        "max_connections %d lowered to %d: the open-file limit is %d (ulimit -n)",
        max_connections,
        cap,
        soft,
    )
    return cap


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with an OpenAI-shaped body."""
    kind = "service_unavailable" if status >= 500 else "invalid_request_error"
    body = json.dumps(error_body(message, kind, code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


_HEADER_TIMEOUT = (
    408,
    "Request Timeout",
    "the request's headers did not arrive in time",
    "header_timeout",
)
_BODY_TIMEOUT = (
    408,
    "Request Timeout",
    "the request's body did not arrive in time",
    "body_timeout",
)
_HEAD_TOO_LARGE = (
    431,
    "Request Header Fields Too Large",
    f"the request's headers are larger than {MAX_HEADER_BYTES} bytes",
    "headers_too_large",
)
_SEND_TIMEOUT = "its client took none of the response in time (send_timeout_s)"
_NOT_HTTP = (
    400,
    "Bad Request",
    "the request is not valid HTTP/1.1 (its request line, headers or body framing)",
    "invalid_http",
)
_TOO_MANY = (
    503,
    "Service Unavailable",
    "too many open connections to this server (max_connections); retry later",
    "too_many_connections",
)


def _base_protocol(http: str) -> Any:
    """uvicorn's HTTP protocol class for ``http`` ('auto': httptools if installed, else h11)."""
    if http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    if http == "auto":
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        return AutoHTTPProtocol
    raise ValueError(f"unknown HTTP implementation {http!r}")


def protocol_class(limits: ConnectionLimits, http: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol for ``http`` with ``limits`` (the module docstring)."""
    base = _base_protocol(http)

    class _Limits(base):  # type: ignore[misc, valid-type]
        """Reads only what uvicorn's protocols share: ``cycle`` (the request being served, its
        ``more_body`` and ``response_complete``), ``connections``, ``transport`` and ``loop``;
        the hooks are ``connection_made``, ``data_received``, ``on_response_complete``,
        ``connection_lost``, ``pause_writing``, ``resume_writing`` and
        ``send_400_response``, which both implementations have."""

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._kv_seen: object = None  # the last request whose head was in
            self._kv_head: asyncio.TimerHandle | None = None
            self._kv_body: asyncio.TimerHandle | None = None
            self._kv_head_bytes = 0
            self._kv_send: asyncio.TimerHandle | None = None
            self._kv_unsent = 0  # the send buffer's size when the send timer last started
            if len(self.connections) > limits.max_connections:
                self._kv_refuse(_TOO_MANY)
                return
            self._kv_wait_head()

        def data_received(self, data: bytes) -> None:
            if self._kv_head is not None:
                self._kv_head_bytes += len(data)
            super().data_received(data)
            self._kv_check()
            if self._kv_head is not None and self._kv_head_bytes > MAX_HEADER_BYTES:
                self._kv_refuse(_HEAD_TOO_LARGE)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Nothing more is written until the next request: what is left in the buffer
            # must drain, or the close that may follow (keep-alive's end, the header timer,
            # Connection: close) waits on it for ever.
            self._kv_wait_send()
            self._kv_check()  # a pipelined request may have begun
            cycle = self.cycle
            if self._kv_body is not None:  # answered before its body was read
                self._kv_body.cancel()
                self._kv_body = None
            if (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                self._kv_wait_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._kv_cancel()
            self._kv_stop_send()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            self._kv_wait_send()

        def resume_writing(self) -> None:
            self._kv_stop_send()
            super().resume_writing()
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # a close may wait on the rest
                self._kv_wait_send()

        def _kv_wait_send(self) -> None:
            """Start the send timer, unless it runs or nothing waits to be sent."""
            if limits.send_timeout_s <= 0 or self._kv_send is not None:
                return
            self._kv_unsent = self.transport.get_write_buffer_size()
            if self._kv_unsent > 0:
                self._kv_send = self.loop.call_later(limits.send_timeout_s, self._kv_late_send)

        def _kv_stop_send(self) -> None:
            if self._kv_send is not None:
                self._kv_send.cancel()
                self._kv_send = None

        def _kv_late_send(self) -> None:
            self._kv_send = None
            if self.transport.get_write_buffer_size() < self._kv_unsent:
                self._kv_wait_send()  # the client took some: a slow reader, not a stalled one
                return
            log.info("closing a connection from %s: %s", _peer(self.transport), _SEND_TIMEOUT)
            # Not close(): it waits until the buffered bytes are sent, which they never are.
            self.transport.abort()

        def send_400_response(self, msg: str) -> None:
            # What the parser refuses (a bad chunk, two lengths, a header name with a space):
            # found by review, uvicorn's own text/plain "Invalid HTTP request received.".
            self._kv_refuse(_NOT_HTTP)

        def _kv_check(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle is not self._kv_seen:  # a new request's head is in
                self._kv_seen = cycle
                if self._kv_head is not None:
                    self._kv_head.cancel()
                    self._kv_head = None
                self._kv_head_bytes = 0
                if not self.flow.write_paused:  # its reply's writes would look like no progress
                    self._kv_stop_send()
                if cycle.more_body and limits.body_timeout_s > 0 and self._kv_body is None:
                    self._kv_body = self.loop.call_later(limits.body_timeout_s, self._kv_late_body)
            if self._kv_body is not None and (cycle is None or not cycle.more_body):
                self._kv_body.cancel()
                self._kv_body = None

        def _kv_wait_head(self) -> None:
            if self._kv_head is not None:
                self._kv_head.cancel()
                self._kv_head = None
            self._kv_head_bytes = 0
            if limits.header_timeout_s > 0:
                self._kv_head = self.loop.call_later(limits.header_timeout_s, self._kv_late_head)

        def _kv_late_head(self) -> None:
            self._kv_head = None
            self._kv_refuse(_HEADER_TIMEOUT)

        def _kv_late_body(self) -> None:
            self._kv_body = None
            cycle = self.cycle
            if cycle is not None and cycle.more_body:
                if getattr(cycle, "response_started", False):
                    self.transport.close()  # the route answered already: just end it
                else:
                    self._kv_refuse(_BODY_TIMEOUT)

        def _kv_refuse(self, what: tuple[int, str, str, str]) -> None:
            self._kv_cancel()
            if self.transport.is_closing():
                return
            status, reason, message, code = what
            log.info("closing a connection from %s: %s", _peer(self.transport), message)
            self.transport.write(_response(status, reason, message, code))
            self.transport.close()
            self._kv_wait_send()  # the close waits for the client to take the rest

        def _kv_cancel(self) -> None:
            for timer in (self._kv_head, self._kv_body):
                if timer is not None:
                    timer.cancel()
            self._kv_head = self._kv_body = None

    _Limits.__name__ = _Limits.__qualname__ = f"Limited{base.__name__}"
    return _Limits


def _peer(transport: asyncio.Transport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"


def uvicorn_config(
    app: Any, settings: Settings, *, http: str = "auto", **options: Any
) -> uvicorn.Config:
    """The uvicorn configuration ``kvwarm serve`` runs ``app`` under: the settings' address,
    kvwarm's own logging, and the connection limits (``header_timeout_s``,
    ``body_timeout_s``, ``send_timeout_s``, ``max_connections``). ``options`` are passed on
    to uvicorn."""
    limits = ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_connections=connection_cap(settings.max_connections),
        send_timeout_s=settings.send_timeout_s,
    )
    defaults: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_config": None,  # keeps our logging setup; kvwarm logs each request itself
        "access_log": False,
        "timeout_graceful_shutdown": 10,
    }
    return uvicorn.Config(app, http=protocol_class(limits, http), **{**defaults, **options})


def drain_after(graceful_s: float | None) -> float | None:
    """When, into a graceful wait of ``graceful_s`` seconds, the app ends what still runs:
    a second before its end (half of a wait under two seconds); None: uvicorn waits for
    ever, so nothing is cut."""
    if graceful_s is None:
        return None
    return max(graceful_s - 1.0, graceful_s / 2)


class Server(uvicorn.Server):
    """``uvicorn.Server`` that calls ``drain(seconds)`` as its shutdown begins
    (``drain_after``)."""

    def __init__(
        self, config: uvicorn.Config, drain: Callable[[float], None] | None = None
    ) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: Any = None) -> None:
        after = drain_after(self.config.timeout_graceful_shutdown)
        if self._drain is not None and after is not None:
            self._drain(after)
        await super().shutdown(sockets)
