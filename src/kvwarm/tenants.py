"""An API key's tenant scope: the cache salt its requests run under with
``cache_salt_from_auth`` (the rules: ``server/tenancy.py``). Pure functions, without the
server's dependencies, so ``kvwarm cache explain`` names a tenant's namespace as the server
does.

Invariant: the key itself is never stored or shown: only ``tenant_id``, a one-way,
domain-separated digest of it, goes into a salt (``key:<tenant id>[:<salt>]``); a request
presenting no key is ``anon:<salt>``, or unsalted with no salt.
"""

from __future__ import annotations

import hashlib
import re

_TENANT_DOMAIN = b"kvwarm-tenant-v1\x00"
_TENANT_ID = re.compile(r"[0-9a-f]{64}")


def tenant_id(token: str) -> str:
    """A stable, one-way id of an API key (hex sha256, domain-separated)."""
    return hashlib.sha256(_TENANT_DOMAIN + token.encode("utf-8", "surrogatepass")).hexdigest()


def is_tenant_id(value: str) -> bool:
    """Whether ``value`` is a ``tenant_id`` as written (64 lower-case hex digits)."""
    return _TENANT_ID.fullmatch(value) is not None


def tenant_of(salt: str | None) -> str | None:
    """The tenant whose scope a resolved salt is (``scoped``): the tenant id of a
    ``key:<tenant id>[:<salt>]`` salt, else None (no key presented: the one shared tenant).
    What per-tenant bounds count by (``engine/worker/drafts.py``, ``RowDrafts``)."""
    if salt is None or not salt.startswith("key:"):
        return None
    tenant = salt[4:].partition(":")[0]
    return tenant if is_tenant_id(tenant) else None


def scoped(salt: str | None, token: str | None) -> str | None:
    """``salt`` in the scope of the tenant ``token`` names (``cache_salt_from_auth`` on)."""
    return scoped_by_id(salt, tenant_id(token) if token else None)


def scoped_by_id(salt: str | None, tenant: str | None) -> str | None:
    """``salt`` in the scope of the tenant whose ``tenant_id`` is ``tenant`` (None: a request
    presenting no key)."""
    if tenant:
        scope = "key:" + tenant
        return scope if salt is None else f"{scope}:{salt}"
    return None if salt is None else f"anon:{salt}"
