"""Who may drive the server: Host and Origin checks (browser defence) and API/admin keys.

Invariants, checked in this order before any route runs (a WebSocket handshake's too, as a
GET: ``app._Observe``):

1. ``Host`` must be given once (two are a 400, as RFC 9112 requires: servers disagree on
   which one counts, so the check below must not see one and a route another) and name this
   server: a loopback name (``localhost``, ``*.localhost``,
   ``127.0.0.1``, ``::1``), the bound address, or a name in ``allowed_hosts`` (``*``: any). A
   DNS-rebinding page reaches us under *its* name, so its requests fail here. Bound to a
   wildcard address (``0.0.0.0``/``::``), any IP-literal Host is accepted as well (rebinding
   needs a DNS name; a LAN client typing the IP is legitimate), while DNS names still need
   ``allowed_hosts``. The port is not compared: the name is what a rebinding attacker controls.
2. A request with an ``Origin`` header (every cross-origin browser request except simple GETs,
   and every browser POST) must come from the server's own origin (``http://<Host>``) or one of
   ``allowed_origins`` (``*``: any). ``Origin: null`` (sandboxed frames, files) is refused.
3. A request body must be JSON (``application/json``, ``*+json``), or carry no content type, or
   ``application/x-www-form-urlencoded`` (what ``curl -d`` sends; parsed as JSON all the same).
   ``text/plain`` and ``multipart/form-data``, which a page may send cross-site without a CORS
   preflight, are a 415.
4. With ``admin_key`` set, admin paths (``ADMIN_PREFIXES``, ``ADMIN_ROUTES``) need it; with
   ``api_key`` set, every other path but the open ones needs the API key (or the admin key).
   A key is read from ``Authorization: Bearer <key>`` or, as Anthropic-style clients send it,
   ``x-api-key``, its bytes read as UTF-8 (``presented_key``).
   The open paths (GET and HEAD only) are ``/health``, the read-only API description
   (``/docs``, ``/openapi.json``) and the web page (``/``, ``/ui/*``, ``webui.py``): they hold
   no data, and a browser opening a page cannot send a header; the Swagger page's "Authorize"
   button and the web page's key dialog then send the key with every call they make.

Paths are compared as the routes match them (``route_path``): less the ``root_path`` the app
is served under (an ASGI mount, uvicorn's ``root_path``), where ``scope["path"]`` still holds
it. Found by review: under ``/kv`` the guard saw ``/kv/cache/evict``, no admin path, while
the router ran ``/cache/evict``: the admin endpoints answered with no key at all.

Refusals are OpenAI-shaped errors, answered by the app's outer middleware before any route.
Settings that switch a defence off are said at startup, as WARNINGs (``exposure_warnings``).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from starlette.types import Scope, Send

from kvwarm.settings import Settings

ADMIN_PREFIXES: tuple[str, ...] = ("/cache/", "/admin/", "/cluster")
#: Admin operations outside those prefixes, by (method, path): llama-server's routes that set
#: what every later request of a model runs under (``server/lora.py``; ``POST /props``, which
#: changes nothing but is llama-server's way to change global properties).
ADMIN_ROUTES = frozenset({("POST", "/lora-adapters"), ("POST", "/props")})
OPEN_PATHS = frozenset({"/health", "/docs", "/openapi.json", "/"})
OPEN_PREFIXES: tuple[str, ...] = ("/ui/",)  # the web page's static files (webui.py)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_FORM = "application/x-www-form-urlencoded"


def host_name(value: str) -> str:
    """The name part of a Host header value, lower-cased, without port or IPv6 brackets.
    A value that is not ``name``, ``name:port``, ``[ipv6]`` or ``[ipv6]:port`` (a port of
    digits) is returned whole, so it matches no allowed host: ``[::1]evil.com`` is not
    ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :] if end > 0 else ""
        if end > 0 and (not rest or (rest[0] == ":" and rest[1:].isdigit())):
            return value[1:end]
        return value
    if value.count(":") == 1:
        name, _, port = value.partition(":")
        return name if port.isdigit() else value
    return value


def normal_origin(origin: str) -> str:
    """An origin as it is compared: trimmed, lower-cased, without a trailing slash (a browser's
    ``Origin`` header is already so; a configured one may be written as an address bar shows
    it). The guard and the CORS middleware (``app._Cors``) both compare by it."""
    return origin.strip().rstrip("/").lower()


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def route_path(scope: Scope) -> str:
    """The path the app's routes match for ``scope``: its ``path`` less the ``root_path``
    the app is served under, by the rule Starlette's router applies (``get_route_path``),
    so what the guard classifies is what runs."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIXES)


def is_open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class Guard:
    """The rules of the module docstring, derived once from ``Settings``."""

    def __init__(self, settings: Settings) -> None:
        bound = host_name(settings.host)
        self.any_host = "*" in settings.allowed_hosts
        self.wildcard_bind = bound in ("0.0.0.0", "::", "")
        self.hosts = LOOPBACK_NAMES | {bound} | {host_name(h) for h in settings.allowed_hosts}
        self.any_origin = "*" in settings.allowed_origins
        self.origins = frozenset(normal_origin(o) for o in settings.allowed_origins)
        self.api_key = settings.api_key or None
        self.admin_key = settings.admin_key or None

    def host_ok(self, host: str) -> bool:
        name = host_name(host)
        if self.any_host or name in self.hosts or name.endswith(".localhost"):
            return True
        return self.wildcard_bind and _is_ip(name)

    def origin_ok(self, origin: str, host: str) -> bool:
        origin = normal_origin(origin)
        if origin == "null":
            return False
        if self.any_origin or origin in self.origins:
            return True
        parts = urlsplit(origin)
        # Our own origin (a web UI served from /): same host[:port] as the request names.
        return parts.scheme in ("http", "https") and parts.netloc == host.strip().lower()

    def refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """(status, message, code) of the first rule ``scope`` breaks, or None."""
        if sum(1 for name, _ in scope["headers"] if name.lower() == b"host") > 1:
            return 400, "the request has more than one Host header", "duplicate_host"
        headers = _headers(scope["headers"])
        host = headers.get("host", "")
        if not self.host_ok(host):
            return 421, f"Host {host!r} is not served here (see allowed_hosts)", "host_not_allowed"
        origin = headers.get("origin")
        if origin is not None and not self.origin_ok(origin, host):
            return 403, f"Origin {origin!r} may not call this server", "origin_not_allowed"
        if scope["method"] in _BODY_METHODS and not _content_type_ok(headers.get("content-type")):
            return 415, "the request body must be application/json", "unsupported_media_type"
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            return None  # a CORS preflight from an allowed origin never carries credentials
        return self._auth(scope["method"], route_path(scope), presented_key(headers))

    def _auth(self, method: str, path: str, token: str | None) -> tuple[int, str, str] | None:
        if (is_admin_path(path) or (method, path) in ADMIN_ROUTES) and self.admin_key:
            if not _same(token, self.admin_key):
                return 401, "this endpoint needs the admin key", "invalid_admin_key"
            return None
        keyed = _same(token, self.api_key) or _same(token, self.admin_key)
        open_path = is_open_path(path) and method in ("GET", "HEAD")
        if self.api_key and not open_path and not keyed:
            return 401, "invalid or missing API key", "invalid_api_key"
        return None


def exposure_warnings(settings: Settings) -> list[str]:
    """What ``settings`` leave open that a default server does not, one sentence each: said
    at startup as WARNINGs (``create_app``), so an operator who switched a defence off by a
    flag copied from elsewhere hears of it."""
    out: list[str] = []
    if "*" in settings.allowed_hosts:
        out.append(
            "allowed_hosts '*' accepts any Host header: the DNS-rebinding defence is off, so a "
            "web page can drive this server through a name it points at this address; list "
            "the names clients use (--allowed-host) instead"
        )
    if "*" in settings.allowed_origins:
        # Found by review: as open as allowed_hosts '*' (every page, not only a rebinding one),
        # and said nothing.
        out.append(
            "allowed_origins '*' lets every web page the user's browser opens call this server "
            "and read its answers (the Origin check and CORS let any origin through)"
            + ("" if settings.api_key else ", with no api_key to stop it")
            + "; list the origins of the pages that need it (--allowed-origin) instead"
        )
    if settings.cache_salt_from_auth and not settings.admin_key:
        # Found by review: documented (docs/cache.md), never said. Every key is a tenant, and
        # with no admin key the admin paths take any key (or none) as the admin's.
        out.append(
            "cache_salt_from_auth makes each API key a tenant, but with no admin_key every "
            "tenant may call the admin endpoints: list every tenant's cached rows and slots, "
            "evict them, drop their keep-alive, unload models and set the LoRA scales all "
            "tenants run under; set --admin-key"
        )
    if not settings.api_key and not _is_loopback(settings.host):
        out.append(
            f"listening on {settings.host}, not a loopback address, with no api_key: anyone "
            "who can reach it may use every model"
            + ("" if settings.admin_key else " and the admin endpoints (/cache/*, /admin/*)")
            + "; set --api-key (and --admin-key), or listen on 127.0.0.1"
        )
    return out


def _is_loopback(host: str) -> bool:
    name = host_name(host)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a name: whatever it resolves to, it is not known to be loopback


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents (``headers`` by lower-case name): ``Authorization: Bearer``,
    else ``x-api-key``. One rule for the guard and for the tenant it names (``tenancy``).

    Servers hand header bytes over as latin-1; a key is UTF-8 text where it is configured
    (``api_key``, ``admin_key``) or named in a body (``/cache/prewarm``'s ``tenant_key``), so
    the bytes are read as UTF-8, any that are not kept apart as surrogate escapes (no UTF-8
    text reads as them)."""
    key = bearer(headers.get("authorization")) or headers.get("x-api-key")
    if key is None:
        return None
    try:
        return key.encode("latin-1").decode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # not header bytes as a server decodes them: already text
        return key


def bearer(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    return authorization[7:] if authorization.lower().startswith("bearer ") else authorization


def _same(token: str | None, key: str | None) -> bool:
    if token is None or key is None:
        return False
    # Surrogate escapes (bytes of a header that are not UTF-8) encode back to those bytes.
    return hmac.compare_digest(
        token.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape")
    )


def _headers(raw: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in raw:
        out.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return out


def _content_type_ok(value: str | None) -> bool:
    if value is None:
        return True
    media = value.split(";", 1)[0].strip().lower()
    return media in ("", "application/json", _FORM) or media.endswith("+json")


async def send_json(send: Send, status: int, body: object) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
