"""Which cache salt a request runs under: who may share cached prompts with whom.

``cached_tokens`` tells a client how much of its prompt was already cached, so a client that
shared a namespace with another could probe that other's prompts token by token. Requests share
rows and live KV only when they share a salt (``kvwarm.cache.formats.key.salted_namespace``).

Rules, in order (``docs/architecture.md``, "Tenants"):

1. The explicit salt is the body's ``cache_salt`` if present, else the ``X-Cache-Salt`` header
   (an empty header counts as absent). Both are 1 to ``MAX_SALT_CHARS`` characters. The
   header's bytes are read as UTF-8 (not HTTP's default latin-1), so a non-ASCII salt is the
   same salt in the header as in the JSON body; bytes that are not UTF-8 are a 400.
2. Without ``cache_salt_from_auth`` the explicit salt is used as given (vLLM's ``cache_salt``):
   clients that know one salt share one namespace; no salt is the shared, unsalted namespace.
3. With ``cache_salt_from_auth`` the key presented (``Authorization: Bearer`` or
   ``x-api-key``, as the guard reads it) names the tenant: a one-way digest of it (the key
   itself is never stored or logged) scopes the request, and an explicit salt only
   partitions that tenant further. A client can therefore never join another key's
   namespace, whatever salt it sends. A request without a token uses its explicit salt in a
   scope of its own, or, with none, the unsalted namespace.
4. ``/cache/prewarm`` (``prewarm_salt``) resolves like a request, so with the setting on it
   fills the scope of the key that called it: with ``--admin-key`` set that is the admin's
   own, which no tenant reaches. So its body may name the tenant instead: ``tenant_key`` runs
   it as a request presenting that key would run (knowing a key is being that tenant, so this
   grants nothing), ``shared`` as a request presenting no key. ``--prewarm-system`` warms the
   unsalted namespace and, with the setting and ``--api-key`` on, that key's scope too
   (``system_salts``).

The tenant's id and scope are ``kvwarm.tenants`` (``kvwarm cache explain`` uses them too).

Invariant: the salt returned is a pure function of (body salt, header, token, setting), and
distinct (tenant, explicit salt) pairs give distinct salts (the digest has a fixed length and
each scope its own prefix).
"""

from __future__ import annotations

from starlette.requests import Request

from kvwarm.server.errors import HTTPError
from kvwarm.server.guard import presented_key
from kvwarm.settings import Settings
from kvwarm.tenants import scoped, tenant_id

__all__ = [
    "HEADER",
    "MAX_SALT_CHARS",
    "cache_salt",
    "explicit_salt",
    "openapi_header",
    "prewarm_salt",
    "scoped",
    "system_salts",
    "tenant_id",
]

HEADER = "x-cache-salt"
#: Longest explicit salt a client may send; the engine's own bound is larger, leaving room for
#: the tenant scope prepended here.
MAX_SALT_CHARS = 256


def openapi_header() -> dict[str, object]:
    """``openapi_extra`` declaring the ``X-Cache-Salt`` header of a route (its body is declared
    by ``schemas.json_body``; FastAPI merges the two)."""
    header = {
        "name": "X-Cache-Salt",
        "in": "header",
        "required": False,
        "description": "cache salt, used when the body has no cache_salt (empty: none)",
        "schema": {"type": "string", "maxLength": MAX_SALT_CHARS},
    }
    return {"parameters": [header]}


def explicit_salt(request: Request, body_salt: str | None) -> str | None:
    """The salt the client asked for: the body's, else the header's."""
    if body_salt is not None:
        return body_salt
    value = request.headers.get(HEADER)
    if value is None or not value.strip():
        return None
    try:  # Starlette decodes header bytes as latin-1: undo that and read them as UTF-8
        value = value.strip().encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise HTTPError(
            400,
            "the X-Cache-Salt header is not valid UTF-8",
            code="invalid_value",
            param="X-Cache-Salt",
        ) from None
    if len(value) > MAX_SALT_CHARS:
        raise HTTPError(
            400,
            f"the X-Cache-Salt header is longer than {MAX_SALT_CHARS} characters",
            code="invalid_value",
            param="X-Cache-Salt",
        )
    return value


def cache_salt(request: Request, body_salt: str | None, settings: Settings) -> str | None:
    """The salt ``request`` runs under (None: unsalted), by the rules of the module docstring."""
    salt = explicit_salt(request, body_salt)
    if not settings.cache_salt_from_auth:
        return salt
    return scoped(salt, presented_key(request.headers))


def prewarm_salt(
    request: Request,
    body_salt: str | None,
    settings: Settings,
    *,
    tenant_key: str | None = None,
    shared: bool = False,
) -> str | None:
    """The salt ``/cache/prewarm`` fills: the caller's (``cache_salt``), or with
    ``cache_salt_from_auth`` the scope of ``tenant_key`` or, ``shared``, of no key (rule 4)."""
    if tenant_key is None and not shared:
        return cache_salt(request, body_salt, settings)
    if tenant_key is not None and shared:
        raise HTTPError(
            400,
            "give at most one of tenant_key and shared",
            code="invalid_value",
            param="tenant_key",
        )
    param = "tenant_key" if tenant_key is not None else "shared"
    if not settings.cache_salt_from_auth:
        raise HTTPError(
            400,
            f"{param} needs cache_salt_from_auth: without it keys do not scope the cache",
            code="invalid_value",
            param=param,
        )
    return scoped(explicit_salt(request, body_salt), tenant_key)


def system_salts(settings: Settings) -> tuple[str | None, ...]:
    """The salts ``--prewarm-system`` warms: the unsalted namespace, and with
    ``cache_salt_from_auth`` the one tenant of ``--api-key`` (the only key the server knows)."""
    if settings.cache_salt_from_auth and settings.api_key:
        return (None, scoped(None, settings.api_key))
    return (None,)
