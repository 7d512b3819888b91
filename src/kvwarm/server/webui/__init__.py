"""The web page: ``/`` and its static files under ``/ui/<name>``, read from the package.

Invariants:
- Only files shipped in ``kvwarm/server/static/`` (flat, with a known extension) are served,
  read once when the app is built. A request names a file by a key of that table, never by a
  path, so nothing outside the directory can be reached (``..``, ``%2F``, links: all a 404).
- Every page response carries a strict Content-Security-Policy (this origin only; no inline
  script or style, no frames, no plugins), ``nosniff`` and no referrer: the page runs only its
  own modules and talks only to this server (``docs/architecture.md``, "The web page"). It
  also requires Trusted Types and allows no policy, so no string can become markup or script
  (``innerHTML``, ``insertAdjacentHTML``, ``document.write``, ``eval``... throw): the page
  puts text in by ``textContent`` only (``format.js``), and a change that did otherwise, with
  a model's reply or a cached row's name, fails at once in the browser instead of being an
  XSS on the origin that drives the server.
- The page and its files need no key (they hold no data); the API calls it makes do.
  ``/ui/config.json`` says which keys the server wants (never the keys), so the page asks for
  one before its first call instead of learning it from a 401.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvwarm._version import __version__
from kvwarm.server.errors import HTTPError
from kvwarm.server.state import server_state

PREFIX = "/ui/"
INDEX = "index.html"

MEDIA_TYPES: dict[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}

CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        # No HTML or script from strings, whatever a later change to the page does.
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    )
)

HEADERS: dict[str, str] = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # Small files read at start-up: revalidate instead of caching a stale page after an upgrade.
    "Cache-Control": "no-cache",
}


def _suffix(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:] if dot > 0 else ""


def load_static(root: Traversable | None = None) -> dict[str, tuple[bytes, str]]:
    """Every servable file of ``root`` (default: the package's ``static``), by name."""
    folder = root if root is not None else files("kvwarm.server.webui").joinpath("static")
    table: dict[str, tuple[bytes, str]] = {}
    if not folder.is_dir():
        return table
    for entry in folder.iterdir():
        media = MEDIA_TYPES.get(_suffix(entry.name))
        if media is not None and entry.is_file() and not entry.name.startswith("."):
            table[entry.name] = (entry.read_bytes(), media)
    return table


def router(static: dict[str, tuple[bytes, str]] | None = None) -> APIRouter:
    """The routes serving ``static`` (default: the package's files)."""
    table = load_static() if static is None else static
    routes = APIRouter()

    def respond(name: str) -> Response:
        found = table.get(name)
        if found is None:
            raise HTTPError(404, f"no such file: {name!r}", code="not_found")
        body, media = found
        return Response(body, media_type=media, headers=HEADERS)

    @routes.get("/", include_in_schema=False)
    async def index(request: Request) -> Response:
        return respond(INDEX)

    @routes.get(PREFIX + "config.json", include_in_schema=False)
    async def config(request: Request) -> Response:
        state = server_state(request)
        settings = state.settings
        body = {
            "apiKey": bool(settings.api_key),
            "adminKey": bool(settings.admin_key),
            "version": __version__,
            "cluster": state.is_cluster,  # the page polls /cluster only behind kvwarm cluster
        }
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @routes.get(PREFIX + "{name}", include_in_schema=False)
    async def static_file(request: Request, name: str) -> Response:
        return respond(name)

    return routes
