"""``create_app(settings)``: the FastAPI application, its lifespan and its error handlers.

Invariants: everything the app owns hangs off ``app.state.kvwarm`` (no module globals), so two
apps in one process are independent. The lifespan starts model loading in the background and
returns at once, so the server listens (and ``/health`` says 503) while models load; shutdown
stops the loader and the keep-alive, then closes the engine, which flushes the cache.
Every error, including unknown routes and bad methods, has the OpenAI error shape (Anthropic's
under its paths, ``errors.ANTHROPIC_PATHS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvwarm._version import __version__
from kvwarm.errors import KvwarmError
from kvwarm.server import apidocs, webui
from kvwarm.server import rerank as rerank_routes
from kvwarm.server.admin import models as admin_models
from kvwarm.server.admin import routes as admin_routes
from kvwarm.server.anthropic import routes as anthropic_routes
from kvwarm.server.errors import (
    ERROR_RESPONSES,
    HTTPError,
    error_response,
    shaped_error,
    speaks_anthropic,
)
from kvwarm.server.guard import Guard, exposure_warnings, normal_origin, route_path, send_json
from kvwarm.server.openai import chat as openai_chat
from kvwarm.server.openai import completions as openai_completions
from kvwarm.server.openai import embeddings as openai_embeddings
from kvwarm.server.registry import request_leases
from kvwarm.server.responses import routes as responses_routes
from kvwarm.server.schemas import value_refused
from kvwarm.server.state import ServerState
from kvwarm.settings import Settings

log = logging.getLogger("kvwarm.server")

#: The status ``/metrics`` counts for a request whose client left before its answer began.
CLIENT_CLOSED = 499


def _anthropic(scope: Scope) -> bool:
    """Whether a request's errors are in Anthropic's shape (``errors.speaks_anthropic``)."""
    return speaks_anthropic(route_path(scope), scope["headers"])


class _Observe:
    """Pure ASGI (streaming- and disconnect-transparent): counts requests by route template and
    status, and refuses what the ``Guard`` refuses (Host, Origin, content type, keys), for
    WebSocket handshakes too (the app has no socket route; one added would be guarded)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.guard = Guard(state.settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # Found by review: a WebSocket handshake went by the guard untouched, so a socket
            # route added later would take any page's connection (browsers let every page
            # open one, and a rebinding page names its own Host). Its handshake is a GET.
            refused = self.guard.refusal({**scope, "method": "GET"})
            if refused is not None:
                # Closing before accepting: the server answers the handshake with a 403.
                await send({"type": "websocket.close", "code": 1008, "reason": refused[1]})
                self.state.counters.record("refused", refused[0])
                return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.guard.refusal(scope)
        if refused is not None:
            status, message, code = refused
            path, anthropic = route_path(scope), _anthropic(scope)
            status, body = shaped_error(
                path, status, message, "invalid_request_error", code, anthropic=anthropic
            )
            await send_json(send, status, body)
            self.state.counters.record("refused", status)
            return
        status = 500
        started = False
        # The client went away before its answer began: counted as 499 (nginx's "client
        # closed request", the API's ``client_closed_request``) whatever the route then sent
        # to nobody. Found by review: a non-streamed chat, message or response whose client
        # left counted a 200 (a whole answer, finish ``cancelled``, never read), a completion
        # a 499, and a stream cut before its headers a 200.
        left = False
        head = scope["method"] == "HEAD"
        if head:
            # HEAD wherever GET answers, as RFC 9110 requires: the GET's status and headers,
            # no body. Found by review: FastAPI's GET routes take no HEAD, so the web page,
            # /docs, /v1/models and /metrics answered curl -I and uptime checks with a 405.
            # The guard above saw the HEAD; the server's own scope still says HEAD.
            scope = {**scope, "method": "GET"}

        async def observed_receive() -> Message:
            nonlocal left
            message = await receive()
            if message["type"] == "http.disconnect" and not started:
                left = True
            return message

        async def observed_send(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = int(message["status"]), True
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        try:
            # Leases on models taken by the route are held until the response is fully sent.
            with request_leases():
                await self.app(scope, observed_receive, observed_send)
        except asyncio.CancelledError:
            # The server's shutdown gave up waiting for this request (found by review: it got
            # uvicorn's plain-text 500): a 503 in the API's own shape, then the cancellation.
            if not started:
                message = "the server is shutting down; retry on another instance or later"
                status, body = shaped_error(
                    route_path(scope),
                    503,
                    message,
                    "service_unavailable",
                    "shutting_down",
                    anthropic=_anthropic(scope),
                )
                with contextlib.suppress(Exception):
                    await send_json(send, status, body)
            raise
        finally:
            route = scope.get("route")
            self.state.counters.record(
                getattr(route, "path", "unmatched"), CLIENT_CLOSED if left else status
            )


#: The API's routers, in the order their routes are matched (the web page's comes last).
ROUTERS = (
    openai_chat.router,
    openai_completions.router,
    openai_embeddings.router,
    rerank_routes.router,
    admin_models.router,
    anthropic_routes.router,
    responses_routes.router,
    admin_routes.router,
)


def create_app(
    settings: Settings,
    state: ServerState | None = None,
    *,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """A new app serving ``settings.models`` (and ``settings.models_dir``); loading starts when
    the app starts (lifespan). ``state`` replaces the in-process one (the cluster ingress passes
    one whose models are proxies for engine replicas). ``on_fatal(reason)`` is called (from the
    loader thread) if no model can be served at all."""
    settings.check()
    for warning in exposure_warnings(settings):
        log.warning("%s", warning)
    state = state if state is not None else ServerState(settings, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            await run_in_threadpool(state.close)

    app = FastAPI(
        title="kvwarm",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,  # /docs is apidocs' (with a CSP), when api_docs is on
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
        openapi_url="/openapi.json",
        responses=ERROR_RESPONSES,
    )
    app.openapi = functools.partial(_openapi_with_keys, app)  # type: ignore[method-assign]
    app.state.kvwarm = state
    routers = [*ROUTERS]
    if settings.api_docs:
        routers.append(apidocs.router("/openapi.json", app.title))
    routers.append(webui.router())
    for router in routers:
        app.include_router(router)
    _add_error_handlers(app, [*app.router.routes, *(r for x in routers for r in x.routes)])
    _add_middleware(app, state, settings)
    return app


async def _on_error(request: Request, exc: Exception) -> Response:
    return error_response(exc, route_path(request.scope), anthropic=_anthropic(request.scope))


def _allow(routes: Sequence[BaseRoute], scope: Scope) -> str | None:
    """The methods the routes matching ``scope``'s path take, HEAD wherever GET is
    (``_Observe``): a 405's ``Allow``. Starlette's names the first matching route's alone (a
    path of two routes, as ``GET``/``DELETE /v1/responses/{id}``, said ``GET``)."""
    methods: set[str] = set()
    for route in routes:
        if isinstance(route, Route) and route.methods and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods)) if methods else None


def _on_http(routes: Sequence[BaseRoute]) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def handle(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        # Starlette's headers too: found by review, a 405 had no Allow (RFC 9110 15.5.6: it
        # names the methods the route takes), dropped as the error was put in the API's shape.
        headers = dict(exc.headers or {})
        allow = _allow(routes, request.scope) if exc.status_code == 405 else None
        if allow is not None:
            headers["Allow"] = allow
        error = HTTPError(exc.status_code, str(exc.detail), code=code, headers=headers or None)
        return error_response(error, route_path(request.scope), anthropic=_anthropic(request.scope))

    return handle


async def _on_validation(request: Request, exc: Exception) -> Response:
    # Query and path parameters (bodies are parsed by parse_body): name the parameter.
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body")]
    param = ".".join(loc) or None
    message = f"{param or 'request'}: {first.get('msg', 'invalid value')}"
    error = HTTPError(
        400,
        message,
        code="invalid_value" if value_refused(first) else "invalid_type",
        param=param,
    )
    return error_response(error, route_path(request.scope), anthropic=_anthropic(request.scope))


def _add_error_handlers(app: FastAPI, routes: Sequence[BaseRoute]) -> None:
    """Every error in the OpenAI shape (Anthropic's under its paths); ``routes``: every route
    the app serves (a 405 names their methods)."""
    app.add_exception_handler(HTTPError, _on_error)
    app.add_exception_handler(KvwarmError, _on_error)
    app.add_exception_handler(StarletteHTTPException, _on_http(routes))
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(Exception, _on_error)


class _Cors(CORSMiddleware):
    """Starlette's CORS for the allowed origins alone. A request of any other origin goes on
    to the guard untouched: a preflight is then refused in the API's own error shape (403
    ``origin_not_allowed``), not with Starlette's plain-text 400, as with no origins set.
    Origins are compared as the guard compares them (``guard.normal_origin``): found by
    review, an origin configured with a trailing slash or capitals was the guard's (its POSTs
    ran) but not Starlette's (no CORS headers, its preflights a 405)."""

    def is_allowed_origin(self, origin: str) -> bool:
        return super().is_allowed_origin(normal_origin(origin))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            origin = Headers(scope=scope).get("origin")
            if origin is not None and not self.is_allowed_origin(origin):
                await self.app(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _add_middleware(app: FastAPI, state: ServerState, settings: Settings) -> None:
    app.add_middleware(_Observe, state=state)
    if settings.allowed_origins:
        # Outermost, so the guard's own refusals (401, 403) carry CORS headers too and a page
        # of an allowed origin can read why it was refused. Preflights of other origins get
        # no CORS headers, and their real requests are refused by the guard.
        app.add_middleware(
            _Cors,
            allow_origins=[normal_origin(o) for o in settings.allowed_origins],
            allow_methods=["GET", "POST", "DELETE"],
            # Any header a page of an allowed origin asks for: the official JS clients send
            # their own on every request (x-stainless-*, anthropic-version, anthropic-beta,
            # anthropic-dangerous-direct-browser-access, openai-organization...), and a
            # preflight naming one header outside a fixed list was refused whole.
            allow_headers=["*"],
        )


def _openapi_with_keys(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the two ways to send a key (``guard``), so Swagger UI's
    "Authorize" button works on a server that has ``api_key`` set."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, routes=app.routes, description=app.description
        )
        components = schema.setdefault("components", {})
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        schema["security"] = [{"bearer": []}, {"x-api-key": []}, {}]
        app.openapi_schema = schema
    return app.openapi_schema
