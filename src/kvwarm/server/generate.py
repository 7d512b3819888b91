"""Driving one engine stream from one HTTP request: disconnects, priming, SSE, the log line.

Invariants:

- A generation never outlives interest in it: a watcher task listens for the client's
  ``http.disconnect`` and cancels the engine stream at once (even mid-prefill, when no token is
  being sent that could fail), and leaving a ``Generation`` by any path cancels a stream that
  has not finished, so its slot is free for the next request.
- A streamed response is *primed* before any header is sent: errors the engine raises before the
  first fragment (context overflow, a bad grammar) become proper 4xx responses, not a 200 stream
  carrying an error.
- A rerank or an embedding (a blocking call, ``run_cancellable``) is cancelled the same way
  when its client leaves: the model drops its work not yet done. Shutdown's end of the
  graceful wait cancels it too, and it raises ``ServerShuttingDownError`` as a generation
  does.
- Every finished generation logs exactly one line on ``kvwarm.server.requests``, naming the end
  user the request said it came for (OpenAI's ``user``, Anthropic's ``metadata.user_id``), if
  it said one.
- A generation the server ends (its deadline, ``request_timeout_s``; the end of shutdown's
  graceful wait, ``ServerState.drain``) raises that error from ``fragments()``/``result()``,
  so a stream ends with an error event in its API's shape (``sse``, ``named_sse``), never
  silently; a worker that dies fails its streams the same way (``EngineClosedError``).

The ``n`` choices of one request are ``Generation``s gathered by ``choices.Choices``, which
watches for the disconnect once for all of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from kvwarm.engine.cancel import Cancellation
from kvwarm.engine.request import Fragment
from kvwarm.engine.types import Completion
from kvwarm.errors import (
    InvalidRequestError,
    KvwarmError,
    RequestCancelledError,
    RequestTimeoutError,
)
from kvwarm.server.errors import error_body, kind_of, rename_param

if TYPE_CHECKING:
    from kvwarm.server.served import ServedStream
    from kvwarm.server.state import ServerState

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
request_log = logging.getLogger("kvwarm.server.requests")
log = logging.getLogger(__name__)

Event = tuple[str, dict[str, object]]  # (SSE event name, its JSON data)

_DONE = object()


_S = TypeVar("_S", "ServedStream", "Sequence[ServedStream]")


async def start_stream(submit: Callable[[], _S], names: Mapping[str, str] | None = None) -> _S:
    """Run ``submit`` (tokenizing, maybe waiting on the cache) off the event loop. If this
    handler is cancelled meanwhile (the client went away), the request may still have been
    queued: cancel it as soon as it exists, so it never runs unobserved to max_tokens.
    ``names``: the fields the client sent under another name (``JsonBody.sent_as``), which a
    check of the model's at submit names as sent (``rename_param``; found by review: a
    client's ``speculative.type`` was called ``spec_type``)."""
    fut = asyncio.ensure_future(run_in_threadpool(submit))
    try:
        return await asyncio.shield(fut)
    except InvalidRequestError as exc:
        rename_param(exc, names or {})
        raise
    except asyncio.CancelledError:
        fut.add_done_callback(_cancel_orphan)
        raise


def _cancel_orphan(
    fut: asyncio.Future[_S],
) -> None:
    if not fut.cancelled() and fut.exception() is None:
        result = fut.result()
        for stream in result if isinstance(result, Sequence) else [result]:
            stream.cancel()


class Generation:
    """An engine stream bound to the request that asked for it (``async with``)."""

    def __init__(
        self,
        request: Request,
        stream: ServedStream,
        endpoint: str,
        model_id: str,
        state: ServerState,
        *,
        watch: bool = True,
        user: str | None = None,
    ) -> None:
        """``watch=False``: the caller watches for the disconnect (one watcher per request).
        ``user``: the end user the request names (its log line says it)."""
        self.stream = stream
        self.user = user
        self._watch_disconnect = watch
        self.endpoint = endpoint
        self.model_id = model_id
        self._state = state
        self.started = time.perf_counter()
        self.disconnected = False
        self._request = request
        self._iter = stream.afragments().__aiter__()
        self._watcher: asyncio.Task[None] | None = None
        self._finished = False
        self._first: Fragment | object | None = None
        self._done: Completion | None = None
        self._recorded = False  # its finish counted and logged (``_record``: once)
        self._cut: KvwarmError | None = None  # why the server ended it, if it did
        self._deadline: asyncio.TimerHandle | None = None
        limit = float(state.settings.request_timeout_s)
        if limit > 0:  # from submission: the deadline covers queueing too
            self._deadline = asyncio.get_running_loop().call_later(limit, self._expire)
        state.streams.add(self)
        if state.draining is not None:  # started after shutdown ended the others
            self.cut(state.draining)

    async def __aenter__(self) -> Generation:
        if self._watch_disconnect:
            self._watcher = asyncio.create_task(self._watch())
        return self

    def _expire(self) -> None:
        """The server-side deadline: end the stream; result()/fragments() raise."""
        self.cut(
            RequestTimeoutError(
                f"the request ran past the server's deadline of "
                f"{self._state.settings.request_timeout_s:g} s (request_timeout_s)"
            )
        )

    def cut(self, error: KvwarmError) -> None:
        """End the stream for the server's own reason: result()/fragments() raise ``error``
        (a stream already done keeps its result)."""
        if not self.stream.done and self._cut is None:
            self._cut = error
            self.stream.cancel()

    @property
    def timed_out(self) -> bool:
        return isinstance(self._cut, RequestTimeoutError)

    def _check_cut(self, done: Completion) -> None:
        """Raise why the server ended the stream, if it did: only a reply it cut short. Found
        by review: a reply the worker had answered whole, its answer not yet read when the
        deadline or the shutdown's cut came (``stream.done`` is set by the reader), was
        thrown away for that error (a background response stored ``failed``)."""
        if self._cut is not None and done.stats.finish_reason == "cancelled":
            raise self._cut

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._state.streams.discard(self)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if not self._finished and not self.stream.done:
            self._finished = True
            self.stream.cancel()
            # Nobody awaits the result any more; collect it so the request is still counted
            # and logged (finish=cancelled) once the worker has let go of the slot.
            task = asyncio.ensure_future(self._collect())
            self._state.background.add(task)
            task.add_done_callback(self._state.background.discard)

    async def _collect(self) -> None:
        try:
            done = await self.stream.aresult()
        except Exception as exc:  # nobody is left to tell: just log it
            request_log.info(
                "%s model=%s failed after its client left: %s", self.endpoint, self.model_id, exc
            )
            return
        self._record(done)

    async def _watch(self) -> None:
        await wait_disconnect(self._request)
        self.disconnected = True
        self.stream.cancel()

    async def prime(self) -> None:
        """Wait for the first fragment (or the end), so early errors raise here: a stream the
        server cut before its first fragment (its deadline while it queued or prefilled, the
        end of shutdown) raises why, counted as it ends (found by review: nothing had been
        sent, yet the client got a 200 stream of one error event)."""
        try:
            self._first = await self._iter.__anext__()
        except StopAsyncIteration:
            self._first = _DONE
        if self._cut is not None:
            # Cut before anything was sent: the worker may have given a token it had under
            # way (a prompt's pass outlasting the deadline) before it saw the cut.
            await self.result()  # counts it; raises the cut where it ended the reply

    async def open_streaming(self) -> None:
        """Start watching for a disconnect and prime; on failure release everything, so the
        caller can turn the error into a plain 4xx/5xx response."""
        await self.__aenter__()
        try:
            await self.prime()
        except BaseException:
            self.close()
            raise

    async def fragments(self) -> AsyncIterator[Fragment]:
        first, self._first = self._first, None
        if first is not _DONE:
            if isinstance(first, Fragment):
                yield first
            async for fragment in self._iter:
                yield fragment
        done = await self.stream.aresult()  # the stream is done: at once
        # Counted as its end is read, not only by ``result`` (found by review: a stream cut
        # by the server raised below uncounted, and a choice that ``Choices.merged`` read to
        # its end ahead of a response its client then left was counted nowhere, ``close``
        # collecting only a stream not yet done).
        self._record(done)
        self._check_cut(done)

    async def result(self) -> Completion:
        """Wait for the completion (``Completion.stats.finish_reason`` 'cancelled' if the
        client went away); the first call logs its line."""
        if self._done is not None:
            return self._done
        done = await self.stream.aresult()
        self._finished = True
        self._done = done
        self._record(done)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._check_cut(done)
        return done

    def _record(self, done: Completion) -> None:
        if self._recorded:
            return
        self._recorded = True
        self._state.counters.record_finish(
            self.model_id, done.stats.finish_reason, self.disconnected
        )
        if done.stats.reuse is not None:
            self._state.counters.record_cache_reason(self.model_id, done.stats.reuse.reason.value)
        log_request(self.endpoint, self.model_id, done, self.started, self.disconnected, self.user)


_T = TypeVar("_T")


class BlockingCall:
    """A rerank's or an embedding's ``Cancellation``, as ``ServerState.blocking_calls``
    holds it: the server's own reason to end it (``cut``) is what it then raises, not the
    disconnect's."""

    def __init__(self, cancel: Cancellation) -> None:
        self.cancel = cancel
        self.reason: KvwarmError | None = None

    def cut(self, error: KvwarmError) -> None:
        if self.reason is None and not self.cancel.cancelled:
            self.reason = error
            self.cancel.cancel()


async def run_cancellable(
    request: Request, state: ServerState, work: Callable[[Cancellation], _T]
) -> _T:
    """``work`` (a blocking model call: a rerank, an embedding) on the thread pool, given a
    ``Cancellation`` that the client's disconnect cancels meanwhile, as a generation's stream
    is cancelled: the model stops on it (found by review: a rerank or an embedding went on
    for a client long gone; llama-server stops). Shutdown (``ServerState.drain``) cancels it
    as it ends the generations, and its ``RequestCancelledError`` is then that error,
    ``ServerShuttingDownError`` (found by review: it ran on until uvicorn cancelled its
    handler at the end of the graceful wait, its thread still in the model as the engine
    closed)."""
    cancel = Cancellation()
    call = BlockingCall(cancel)

    async def watch() -> None:
        await wait_disconnect(request)
        cancel.cancel()
        log.info("%s: the client left; its work was cancelled", request.url.path)

    watcher = asyncio.create_task(watch())
    state.blocking_calls.add(call)
    if state.draining is not None:  # started after shutdown ended the others
        call.cut(state.draining)
    try:
        return await run_in_threadpool(work, cancel)
    except RequestCancelledError:
        if call.reason is not None:
            raise call.reason from None
        raise
    except asyncio.CancelledError:  # the handler itself is cancelled: nobody waits either
        cancel.cancel()
        raise
    finally:
        state.blocking_calls.discard(call)
        watcher.cancel()


async def wait_disconnect(request: Request) -> None:
    """Return when the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


#: The most characters of a request's ``user`` its log line shows.
USER_LOG_CHARS = 64


def log_request(
    endpoint: str,
    model_id: str,
    done: Completion,
    started: float,
    disconnected: bool = False,
    user: str | None = None,
) -> None:
    s = done.stats
    # As JSON: quoted, a newline or a quote in it escaped, so it can never forge a line or a
    # field of its own; cut to USER_LOG_CHARS.
    who = "" if user is None else f" user={json.dumps(user[:USER_LOG_CHARS])}"
    request_log.info(
        "%s model=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d finish=%s "
        "cache=%s reason=%s found=%d prefill_ms=%.1f ms=%.1f%s%s",
        endpoint,
        model_id,
        s.prompt_tokens,
        s.cached_tokens,
        s.completion_tokens,
        s.finish_reason,
        s.cache_hit,
        "-" if s.reuse is None else s.reuse.reason.value,
        0 if s.reuse is None else s.reuse.found_tokens,
        s.prefill_ms,
        (time.perf_counter() - started) * 1000,
        " client_disconnected" if disconnected else "",
        who,
    )


def as_kvwarm(exc: Exception) -> KvwarmError:
    """A stream's error as the ``KvwarmError`` its error event reports: itself, or for any
    other exception (a bug, logged with its traceback here) an internal error, so a client
    gets an error event rather than a stream cut off mid-reply."""
    if isinstance(exc, KvwarmError):
        return exc
    log.exception("stream failed", exc_info=exc)
    return KvwarmError("internal server error")


def sse_line(event: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


async def sse(
    events: AsyncIterator[dict[str, object]],
    on_close: Callable[[], None],
    *,
    done_line: bool = True,
) -> AsyncIterator[bytes]:
    """``data: {chunk}`` lines, then ``data: [DONE]`` (OpenAI's end; llama-server's own
    endpoints send none: ``done_line=False``). An error after the headers were sent becomes
    one OpenAI-shaped error event at the end (any other exception, a bug: ``internal_error``)."""
    try:
        try:
            async for event in events:
                yield sse_line(event)
        except Exception as exc:
            err = as_kvwarm(exc)
            kind = kind_of(err)
            # The field at fault, as the same error before the stream began names it.
            param = err.param if isinstance(err, InvalidRequestError) else None
            yield sse_line(dict(error_body(str(err), kind.type, kind.code, param)))
        if done_line:
            yield b"data: [DONE]\n\n"
    finally:
        on_close()


def named_line(name: str, data: dict[str, object]) -> bytes:
    payload = json.dumps(data, separators=(",", ":")).encode()
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


async def named_sse(
    events: AsyncIterator[Event],
    on_close: Callable[[], None],
    on_error: Callable[[KvwarmError], Sequence[Event]],
) -> AsyncIterator[bytes]:
    """``event: name`` / ``data: {json}`` pairs with no terminator line (Anthropic's and the
    Responses API's streams). A ``KvwarmError`` after the headers were sent becomes the events
    ``on_error`` makes of it, in the stream's own dialect (any other exception, a bug, as an
    internal error)."""
    try:
        try:
            async for name, data in events:
                yield named_line(name, data)
        except Exception as exc:
            for name, data in on_error(as_kvwarm(exc)):
                yield named_line(name, data)
    finally:
        on_close()
