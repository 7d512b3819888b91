"""OpenAI-shaped error responses, chosen by exception *type*.

Invariant: the HTTP status, ``type`` and ``code`` of an error come from the exception's class
(walking its MRO to the nearest mapped class), never from its message text. Every error body is
``{"error": {"message", "type", "param", "code"}}``, declared once (``ErrorResponse``) for every
operation's 4XX and 5XX in ``/openapi.json`` (``ERROR_RESPONSES``), where the schema-driven tests
check each error against it. Under ``ANTHROPIC_PATHS`` the body is Anthropic's
``{"type": "error", "error": {"type", "message"}}`` instead, which the same schema admits, with
the same status but where Anthropic's differs (``anthropic_status``: a 503 is its 529
``overloaded_error``); and so it is under ``SHARED_PATHS`` (``/v1/models``) to a request with
an ``anthropic-version`` header (``speaks_anthropic``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from kvwarm import errors as e

log = logging.getLogger("kvwarm.server")


@dataclass(frozen=True, slots=True)
class ErrorKind:
    status: int
    type: str
    code: str | None


class ErrorDetail(BaseModel):
    message: str
    type: str
    # Optional in the schema: other wire formats' errors (Anthropic's) carry only the two above.
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error response (``error_body``)."""

    error: ErrorDetail


#: ``responses`` for every operation: ``create_app`` hands it to FastAPI, so routes added later
#: declare their errors too (and FastAPI's own 422, which this server never sends, is dropped).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "the request was refused"},
    "5XX": {"model": ErrorResponse, "description": "the server or a model failed"},
}


class HTTPError(Exception):
    """An error the server raises itself (bad body, unknown route parameters, auth)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers


_INVALID = "invalid_request_error"
_SERVER = "server_error"

# Most specific classes first is not required: lookup walks the MRO.
_KINDS: dict[type[BaseException], ErrorKind] = {
    e.ContextOverflowError: ErrorKind(400, _INVALID, "context_length_exceeded"),
    e.GrammarError: ErrorKind(400, _INVALID, "invalid_grammar"),
    e.NotAModelError: ErrorKind(400, _INVALID, "not_a_model"),
    # A file given as a model that llama.cpp cannot load (before ModelLoadError in the MRO).
    e.InvalidModelFileError: ErrorKind(400, _INVALID, "invalid_model_file"),
    e.RequestTimeoutError: ErrorKind(503, "service_unavailable", "request_timeout"),
    # nginx's "client closed request": the client that asked is gone; nobody reads it.
    e.RequestCancelledError: ErrorKind(499, _INVALID, "client_closed_request"),
    e.ServerShuttingDownError: ErrorKind(503, "service_unavailable", "shutting_down"),
    e.FimNotSupportedError: ErrorKind(400, _INVALID, "fim_not_supported"),
    e.MediaError: ErrorKind(400, _INVALID, "invalid_media"),
    e.CapabilityError: ErrorKind(400, _INVALID, "unsupported_by_model"),
    e.InvalidRequestError: ErrorKind(400, _INVALID, "invalid_value"),
    e.ConfigError: ErrorKind(400, _INVALID, "invalid_config"),
    e.UnknownModelError: ErrorKind(404, _INVALID, "model_not_found"),
    e.ModelNotFoundError: ErrorKind(404, _INVALID, "model_not_found"),
    e.ModelExistsError: ErrorKind(409, _INVALID, "model_exists"),
    e.ModelBusyError: ErrorKind(409, _INVALID, "model_busy"),
    e.ModelCapacityError: ErrorKind(503, "service_unavailable", "model_capacity"),
    e.MemoryBudgetError: ErrorKind(507, "service_unavailable", "memory_budget"),
    e.CacheKeyError: ErrorKind(404, _INVALID, "cache_key_not_found"),
    e.QueueFullError: ErrorKind(429, "rate_limit_error", "queue_full"),
    e.KeepAliveFullError: ErrorKind(409, _INVALID, "keepalive_full"),
    e.EngineClosedError: ErrorKind(503, "service_unavailable", "engine_closed"),
    e.ReplicaTimeoutError: ErrorKind(504, "service_unavailable", "replica_timeout"),
    e.ReplicaUnavailableError: ErrorKind(503, "service_unavailable", "replica_unavailable"),
    e.ModelLoadError: ErrorKind(500, _SERVER, "model_load_failed"),
    e.AdapterError: ErrorKind(400, _INVALID, "adapter_error"),
    e.BackendError: ErrorKind(500, _SERVER, "backend_error"),
    e.CacheFormatError: ErrorKind(500, _SERVER, "cache_corrupt"),
    e.CacheNetworkError: ErrorKind(503, _SERVER, "cache_store_unavailable"),
    e.CacheIOError: ErrorKind(507, _SERVER, "cache_io_error"),
    e.CacheError: ErrorKind(500, _SERVER, "cache_error"),
    e.KvwarmError: ErrorKind(500, _SERVER, "internal_error"),
}


def kind_of(exc: BaseException) -> ErrorKind:
    for cls in type(exc).__mro__:
        kind = _KINDS.get(cls)
        if kind is not None:
            return kind
    return ErrorKind(500, _SERVER, "internal_error")


def error_body(
    message: str,
    type: str,
    code: str | None = None,
    param: str | None = None,
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Paths answered in Anthropic's error shape (its clients parse only that one).
ANTHROPIC_PATHS: tuple[str, ...] = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",  # Anthropic's for a 504 (found by review: it said api_error)
    529: "overloaded_error",
}


def anthropic_status(status: int) -> int:
    """The status an Anthropic client is answered with for what others get as ``status``: a
    503 (busy, loading, shutting down: ``overloaded_error``) is Anthropic's 529, the status
    its API gives ``overloaded_error`` and its SDKs read as ``OverloadedError`` (the client
    code that waits out an overload catches that one; a 503 is ``ServiceUnavailableError``).
    Found by review: ``/v1/messages`` answered ``overloaded_error`` as a 503."""
    return 529 if status == 503 else status


def anthropic_body(status: int, message: str) -> dict[str, object]:
    """Anthropic's ``{"type": "error", "error": {"type", "message"}}``; its type follows the
    status, as Anthropic's own error types do."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


#: Paths both APIs share, answered in the client's dialect: Anthropic's to a request with an
#: ``anthropic-version`` header, which every Anthropic SDK sends (``admin/models.py``).
SHARED_PATHS: tuple[str, ...] = ("/v1/models",)


def speaks_anthropic(path: str, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request's errors are Anthropic's: under ``ANTHROPIC_PATHS``, or under
    ``SHARED_PATHS`` with an ``anthropic-version`` header. Found by review: ``/v1/models``
    answered an Anthropic client in Anthropic's shape, and its errors (a 404, a bad
    ``limit``, a missing key) in OpenAI's."""
    if path.startswith(ANTHROPIC_PATHS):
        return True
    shared = any(path == p or path.startswith(p + "/") for p in SHARED_PATHS)
    return shared and any(name.lower() == b"anthropic-version" for name, _ in headers)


def shaped_error(
    path: str,
    status: int,
    message: str,
    type: str,
    code: str | None,
    param: str | None = None,
    *,
    anthropic: bool | None = None,
) -> tuple[int, dict[str, object]]:
    """The status and error body in the dialect of the API that ``path`` belongs to
    (``anthropic``: the dialect ``speaks_anthropic`` chose, where the request's headers are
    known): Anthropic's status (``anthropic_status``) and body, or ``status`` and OpenAI's."""
    if path.startswith(ANTHROPIC_PATHS) if anthropic is None else anthropic:
        status = anthropic_status(status)
        return status, anthropic_body(status, message)
    return status, dict(error_body(message, type, code, param))


def rename_param(exc: e.InvalidRequestError, names: Mapping[str, str]) -> None:
    """Make ``exc`` name its field as the client spelled it (``names``: the engine's name of a
    field to the client's; its message starts with it): Anthropic's ``stop_sequences`` for
    ``stop``, llama-server's ``speculative.type`` for ``spec_type``."""
    sent = names.get(exc.param or "")
    if sent is None or exc.param is None:
        return
    message = str(exc)
    if message.startswith(exc.param + " "):
        exc.args = (sent + message[len(exc.param) :],)
    exc.param = sent


def error_response(
    exc: BaseException, path: str = "", *, anthropic: bool | None = None
) -> JSONResponse:
    """The response for any exception, shaped for the API of ``path`` (``anthropic``: as
    ``shaped_body``); unexpected ones are logged with their traceback and answered without
    internals."""
    shaped = functools.partial(shaped_error, anthropic=anthropic)
    if isinstance(exc, HTTPError):
        status, body = shaped(path, exc.status, exc.message, exc.type, exc.code, exc.param)
        return JSONResponse(body, status_code=status, headers=exc.headers)
    kind = kind_of(exc)
    if isinstance(exc, e.KvwarmError):
        param = exc.param if isinstance(exc, e.InvalidRequestError) else None
        if kind.status >= 500:
            log.error("request failed: %s: %s", type(exc).__name__, exc)
        # Worth asking again in a moment: a full queue, or (a cluster) a replica lost, whose
        # replacement Serve starts; a replica past its deadline (504) is stuck, not gone.
        retry = isinstance(
            exc, e.QueueFullError | e.ModelCapacityError | e.ReplicaUnavailableError
        ) and not isinstance(exc, e.ReplicaTimeoutError)
        headers = {"Retry-After": "1"} if retry else None
        message = str(exc) or type(exc).__name__
        status, body = shaped(path, kind.status, message, kind.type, kind.code, param)
        return JSONResponse(body, status_code=status, headers=headers)
    log.exception("unexpected error", exc_info=exc)
    status, body = shaped(path, 500, "internal server error", _SERVER, "internal_error")
    return JSONResponse(body, status_code=status)
