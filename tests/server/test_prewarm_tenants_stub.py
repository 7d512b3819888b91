"""Whose namespace ``/cache/prewarm`` and ``--prewarm-system`` fill when each API key is a
tenant (``cache_salt_from_auth``): the caller's scope by default, the tenant of ``tenant_key``,
or the key-less namespace (``shared``); startup prompts reach the ``--api-key`` tenant too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture
def admin() -> Iterator[TestClient]:
    settings = stub_settings(cache_salt_from_auth=True, admin_key="admin-secret")
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        yield client


def prompt_for(name: str) -> str:
    return f"{name}: the shared system prompt of every tenant, which is long enough to save"


def cached(client: TestClient, prompt: str, key: str | None = None) -> int:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    response = client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    tokens = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(tokens, int)
    return tokens


def prewarm(client: TestClient, **body: object) -> None:
    response = client.post("/cache/prewarm", json=body, headers=ADMIN)
    assert response.status_code == 200, response.text


def test_the_admin_key_prewarms_its_own_scope_by_default(admin: TestClient) -> None:
    p = prompt_for("default")
    prewarm(admin, prompt=p)
    assert cached(admin, p, key="tenant-one") == 0
    assert cached(admin, p) == 0


def test_tenant_key_prewarms_that_tenant_and_no_other(admin: TestClient) -> None:
    p = prompt_for("tenant")
    prewarm(admin, prompt=p, tenant_key="tenant-one")
    assert cached(admin, p, key="tenant-two") == 0
    assert cached(admin, p) == 0
    assert cached(admin, p, key="tenant-one") > 0
    salted = admin.get("/cache/keepalive", headers=ADMIN).json()["data"]
    assert [e["salted"] for e in salted] == [True]
    assert "tenant-one" not in str(salted)


def test_tenant_key_with_a_salt_is_that_tenants_salted_partition(admin: TestClient) -> None:
    p = prompt_for("salted")
    prewarm(admin, prompt=p, tenant_key="tenant-one", cache_salt="team")
    assert cached(admin, p, key="tenant-one") == 0  # the bare key is another partition
    body = {"prompt": p, "max_tokens": 2, "cache_salt": "team"}
    auth = {"Authorization": "Bearer tenant-one"}
    usage = admin.post("/v1/completions", json=body, headers=auth).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_tenant_key_reaches_a_tenant_whose_key_is_not_ascii(admin: TestClient) -> None:
    # The body's key is JSON text; the tenant's, header bytes read as UTF-8: the same tenant.
    p = prompt_for("utf8")
    prewarm(admin, prompt=p, tenant_key="clé-ünïcode")
    body = {"prompt": p, "max_tokens": 2, "temperature": 0}
    auth = {"Authorization": "Bearer clé-ünïcode".encode()}
    usage = admin.post("/v1/completions", json=body, headers=auth).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert cached(admin, p, key="cle-unicode") == 0


def test_shared_prewarms_the_namespace_of_requests_without_a_key(admin: TestClient) -> None:
    p = prompt_for("shared")
    prewarm(admin, prompt=p, shared=True)
    assert cached(admin, p, key="tenant-one") == 0
    assert cached(admin, p) > 0


@pytest.mark.parametrize(
    ("body", "param"),
    [({"tenant_key": "k", "shared": True}, "tenant_key"), ({"tenant_key": ""}, "tenant_key")],
)
def test_bad_targets_are_400s(admin: TestClient, body: dict[str, object], param: str) -> None:
    response = admin.post("/cache/prewarm", json={"prompt": "hi", **body}, headers=ADMIN)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("body", [{"tenant_key": "k"}, {"shared": True}])
def test_targets_need_keys_to_scope_the_cache(body: dict[str, object]) -> None:
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        response = client.post("/cache/prewarm", json={"prompt": "hi", **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] in body


def test_startup_prompts_reach_the_api_key_tenant() -> None:
    system = "You are the startup assistant of every tenant; keep answers short and friendly."
    settings = stub_settings(prewarm_system=(system,), cache_salt_from_auth=True, api_key="k1")
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        body = {"model": "a", "messages": messages, "max_tokens": 1}
        response = client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k1"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
