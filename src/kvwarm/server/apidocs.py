"""``/docs``: FastAPI's Swagger UI page of the API, served under a Content-Security-Policy.

Invariants:

- The page is where a user types an API key (its "Authorize" button), and it runs a script
  from a CDN (FastAPI's choice: jsDelivr's ``swagger-ui-dist``). That script runs with this
  server's origin, so it could drive every endpoint: it is pinned to one release
  (``SWAGGER_UI_VERSION``) and to its bytes, by Subresource Integrity (``SCRIPT_SRI``,
  ``STYLE_SRI``: sha384 of the files of that release's npm package, which jsDelivr serves
  as they are), so a later release or a changed file never runs here (found by review: the
  page loaded ``swagger-ui-dist@5``, whatever 5.x its publisher released next). Its CSP lets
  the page run that one script file and its own bootstrap (by the hash of that inline script,
  computed from the page as served), load that one stylesheet, and talk to this origin alone:
  no other script, no key sent elsewhere, no framing, no Referer to the CDN.
- Swagger UI sets inline styles, so ``style-src`` allows them (styles run no code); its
  stylesheet's icons are data: images. Swagger's online validator (which would send the
  schema's URL to swagger.io) is off.
- ``api_docs = false`` (``--no-api-docs``) serves no page at all (404); ``/openapi.json``, the
  machine-readable description, stays.
- The OAuth2 redirect page FastAPI adds is not served: the API declares no OAuth2 scheme.
"""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

#: The Swagger UI release the page runs. To move to another: its npm package's
#: ``swagger-ui-bundle.js`` and ``swagger-ui.css`` give the new hashes below
#: (``npm pack swagger-ui-dist@VERSION``; ``openssl dgst -sha384 -binary FILE | base64``).
SWAGGER_UI_VERSION = "5.35.0"
_CDN = f"https://cdn.jsdelivr.net/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}"
#: The files FastAPI's page loads from jsDelivr (``get_swagger_ui_html``'s), named whole in
#: the CSP (a path, so no other package of the same CDN may run), and their bytes' digests,
#: which the browser checks before it runs or applies them.
SCRIPT_URL = f"{_CDN}/swagger-ui-bundle.js"
SCRIPT_SRI = "sha384-gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9"
STYLE_URL = f"{_CDN}/swagger-ui.css"
STYLE_SRI = "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I"
ICON_URL = "https://fastapi.tiangolo.com/img/favicon.png"
PATH = "/docs"

_INLINE = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def csp(html: str) -> str:
    """The Content-Security-Policy of ``html``, a page built by ``get_swagger_ui_html``."""
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"
        for body in _INLINE.findall(html)
    )
    return "; ".join(
        (
            "default-src 'none'",
            f"script-src 'self' {SCRIPT_URL} {hashes}",
            f"style-src 'self' {STYLE_URL} 'unsafe-inline'",
            f"img-src 'self' data: {ICON_URL}",
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        )
    )


def with_integrity(html: str) -> str:
    """``html`` (``get_swagger_ui_html``'s page) with the CDN's script and stylesheet tags
    carrying their ``integrity`` digests (and ``crossorigin``, which SRI needs). A page whose
    tags are not where FastAPI put them is an error, never a page served without them."""
    tags = (
        (f'<script src="{SCRIPT_URL}">', f'<script src="{SCRIPT_URL}"', SCRIPT_SRI),
        (
            f'rel="stylesheet" href="{STYLE_URL}">',
            f'rel="stylesheet" href="{STYLE_URL}"',
            STYLE_SRI,
        ),
    )
    for whole, start, digest in tags:
        if html.count(whole) != 1:
            raise RuntimeError(f"the Swagger UI page has no single {whole!r} to pin")
        html = html.replace(whole, f'{start} integrity="{digest}" crossorigin="anonymous">')
    return html


def router(openapi_url: str, title: str) -> APIRouter:
    routes = APIRouter()

    @routes.get(PATH, include_in_schema=False)
    async def swagger_ui(request: Request) -> Response:
        root = str(request.scope.get("root_path", "")).rstrip("/")
        page = get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{title} - Swagger UI",
            oauth2_redirect_url=None,
            swagger_js_url=SCRIPT_URL,
            swagger_css_url=STYLE_URL,
            swagger_favicon_url=ICON_URL,
            swagger_ui_parameters={"validatorUrl": None},
        )
        html = with_integrity(bytes(page.body).decode())
        headers = {
            "Content-Security-Policy": csp(html),
            "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        }
        return HTMLResponse(html, headers=headers)

    return routes
