"""Cache salts through the HTTP API on the stub backend: where the salt comes from (body,
``X-Cache-Salt``, the API key), which wins, and that ``cached_tokens`` never crosses salts on
any route that fills the cache (completions, chat, prewarm and its keep-alive)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

from kvwarm.server import create_app
from kvwarm.server.errors import HTTPError
from kvwarm.server.tenancy import HEADER, MAX_SALT_CHARS, explicit_salt, tenant_id

from .conftest import stub_settings, wait_ready


# A fresh app per test: every namespace starts empty, so "cold" means 0 cached tokens (the
# stub's prompts all begin with BOS, which any earlier prompt of the namespace would share).
@pytest.fixture
def plain() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        yield client


@pytest.fixture
def keyed() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings(cache_salt_from_auth=True))) as client:
        wait_ready(client.get)
        yield client


def prompt_for(name: str) -> str:
    # Longer than the 16-token save gate; prompts of one test begin differently after BOS.
    return f"{name}: tenant isolation case, the quarterly numbers for the northern region are"


def cached(
    client: TestClient,
    prompt: str,
    salt: str | None = None,
    *,
    header: str | None = None,
    key: str | None = None,
) -> int:
    body: dict[str, object] = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {}
    if header is not None:
        headers["X-Cache-Salt"] = header
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    response = client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    tokens = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(tokens, int)
    return tokens


def test_body_salt_separates_tenants(plain: TestClient) -> None:
    p = prompt_for("body")
    assert cached(plain, p, "alice") == 0
    assert cached(plain, p, "bob") == 0
    assert cached(plain, p) == 0  # unsalted is a namespace of its own
    assert cached(plain, p, "alice") > 0
    assert cached(plain, p, "bob") > 0


def test_header_salt_is_the_same_salt_as_the_body_field(plain: TestClient) -> None:
    p = prompt_for("header")
    assert cached(plain, p, header="alice") == 0
    assert cached(plain, p, header="bob") == 0
    assert cached(plain, p, header="alice") > 0
    assert cached(plain, p, "alice") > 0  # body "alice" == header "alice"
    blank = prompt_for("blank")
    assert cached(plain, blank, header="") == 0  # an empty header is no salt: the request ...
    assert cached(plain, blank) > 0  # ... ran in the unsalted namespace


def test_the_body_salt_wins_over_the_header(plain: TestClient) -> None:
    p = prompt_for("precedence")
    assert cached(plain, p, "carol", header="dave") == 0
    assert cached(plain, p, header="dave") == 0  # the header was not used above
    assert cached(plain, p, header="carol") > 0


def test_chat_takes_the_salt(plain: TestClient) -> None:
    messages = [{"role": "user", "content": prompt_for("chat")}]

    def chat(salt: str) -> int:
        body = {"messages": messages, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
        response = plain.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        value = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert isinstance(value, int)
        return value

    assert chat("alice") == 0
    assert chat("bob") == 0
    assert chat("alice") > 0


def test_each_api_key_is_a_tenant(keyed: TestClient) -> None:
    p = prompt_for("keys")
    assert cached(keyed, p, key="key-one") == 0
    assert cached(keyed, p, key="key-two") == 0
    assert cached(keyed, p) == 0  # no key: the unsalted namespace
    assert cached(keyed, p, key="key-one") > 0
    assert cached(keyed, p, key="key-two") > 0


def test_an_explicit_salt_partitions_a_tenant_and_never_joins_another(keyed: TestClient) -> None:
    p = prompt_for("scoped")
    assert cached(keyed, p, "team", key="key-one") == 0
    assert cached(keyed, p, "team", key="key-two") == 0  # same salt, other key: still apart
    assert cached(keyed, p, header="team", key="key-one") > 0
    assert cached(keyed, p, key="key-one") == 0  # the bare key is another partition
    assert cached(keyed, p, "team") == 0  # no key: never a keyed tenant's namespace
    # Not even by sending the salt a key is known to map to.
    forged = "key:" + tenant_id("key-one")
    assert cached(keyed, p, forged) == 0
    assert cached(keyed, p, forged, key="key-two") == 0


def test_x_api_key_names_the_same_tenant_as_the_bearer_token(keyed: TestClient) -> None:
    p = prompt_for("x-api-key")
    assert cached(keyed, p, key="key-one") == 0
    response = keyed.post(
        "/v1/completions",
        json={"prompt": p, "max_tokens": 2, "temperature": 0},
        headers={"x-api-key": "key-one"},
    )
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cached(keyed, p, key="key-two") == 0


def test_without_the_setting_the_key_does_not_salt(plain: TestClient) -> None:
    p = prompt_for("unkeyed")
    assert cached(plain, p, key="key-one") == 0
    assert cached(plain, p, key="key-two") > 0


def test_tenant_id_is_a_one_way_digest() -> None:
    assert tenant_id("key-one") == tenant_id("key-one") != tenant_id("key-two")
    assert len(tenant_id("key-one")) == 64 and "key-one" not in tenant_id("key-one")


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"cache_salt": ""}, {}, "cache_salt"),
        ({"cache_salt": "x" * (MAX_SALT_CHARS + 1)}, {}, "cache_salt"),
        ({"cache_salt": 7}, {}, "cache_salt"),
        ({}, {"X-Cache-Salt": "x" * (MAX_SALT_CHARS + 1)}, "X-Cache-Salt"),
    ],
)
def test_bad_salts_are_400s_naming_the_field(
    plain: TestClient, body: dict[str, object], headers: dict[str, str], param: str
) -> None:
    for path, base in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/cache/prewarm", {"prompt": "hi", "keep_alive": False}),
    ):
        response = plain.post(path, json={**base, **body}, headers=headers)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == param


def test_a_lone_surrogate_salt_is_a_400(plain: TestClient) -> None:
    raw = '{"prompt":"hi","max_tokens":1,"cache_salt":"a\\ud800"}'
    response = plain.post(
        "/v1/completions", content=raw.encode(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"


def test_the_longest_salt_is_served(plain: TestClient) -> None:
    assert cached(plain, prompt_for("long"), "s" * MAX_SALT_CHARS) == 0
    assert cached(plain, prompt_for("long"), header="h" * MAX_SALT_CHARS) == 0


def test_prewarm_and_keepalive_carry_the_salt(plain: TestClient) -> None:
    p = prompt_for("prewarm")
    for salt in ("alice", "bob"):
        response = plain.post("/cache/prewarm", json={"prompt": p, "cache_salt": salt})
        assert response.status_code == 200, response.text
    assert cached(plain, p, "carol") == 0
    assert cached(plain, p, "alice") > 0
    listed = plain.get("/cache/keepalive").json()["data"]
    mine = [e for e in listed if e["salted"]]
    assert len(mine) == 2  # one entry per salt, the salt itself never listed
    assert "alice" not in str(listed) and "bob" not in str(listed)
    for entry in mine:
        assert plain.delete(f"/cache/keepalive/{entry['id']}").json() == {"deleted": 1}


def test_embeddings_ignore_the_salt(plain: TestClient) -> None:
    response = plain.post("/v1/embeddings", json={"input": "hi", "cache_salt": "alice"})
    assert response.status_code == 200, response.text


def test_cache_rows_list_rows_saved_without_prompt_text(plain: TestClient) -> None:
    cached(plain, prompt_for("rows"), "alice")
    assert plain.app.state.kvwarm.require_engine().cache.flush()  # its rows are written
    response = plain.get("/cache/rows")
    assert response.status_code == 200
    rows = response.json()["data"]
    assert rows and all(r["n_tokens"] > 0 for r in rows)
    assert "Tenant isolation" not in response.text


def test_openapi_declares_the_salt_field_and_header(plain: TestClient) -> None:
    paths = plain.get("/openapi.json").json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/cache/prewarm"):
        post = paths[path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert "cache_salt" in body["properties"], path
        headers = [p["name"] for p in post.get("parameters", []) if p["in"] == "header"]
        assert headers == ["X-Cache-Salt"], path
    assert "cache_salt" not in str(paths["/v1/embeddings"])


def test_a_non_ascii_header_salt_is_the_same_salt_as_the_body_field(plain: TestClient) -> None:
    # HTTP header bytes are read as UTF-8, so "café" in a header is "café" in the body.
    p = prompt_for("utf8")
    assert cached(plain, p, "café") == 0
    body = {"prompt": p, "max_tokens": 2, "temperature": 0}
    response = plain.post("/v1/completions", json=body, headers={"X-Cache-Salt": "café".encode()})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_header_salt_that_is_not_utf8_is_a_400() -> None:
    # Built as the ASGI server hands it over: TestClient would re-encode the bytes as UTF-8.
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [(HEADER.encode(), b"caf\xe9")],
    }
    with pytest.raises(HTTPError) as refused:
        explicit_salt(Request(scope), None)
    assert refused.value.status == 400
    assert refused.value.param == "X-Cache-Salt"
