"""``HEAD`` answers wherever ``GET`` does, as RFC 9110 (section 9.1) requires of a server: the
GET's status and headers, no body (``app._Observe``).

Found by review: only ``/health`` (a route of its own) and ``/openapi.json`` answered ``HEAD``;
the web page (``/``, ``/ui/*``: open paths, "GET and HEAD only" by ``guard``), ``/docs``,
``/v1/models``, ``/metrics`` and the cache's GETs were a 405, so ``curl -I`` and uptime checks
of the page said the server refused them.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import LiveServer, stub_settings, wait_ready

GETS = [
    "/",
    "/ui/app.css",
    "/ui/config.json",
    "/docs",
    "/openapi.json",
    "/health",
    "/v1/models",
    "/v1/models/a",
    "/metrics",
    "/cache/stats",
    "/cache/rows",
    "/cache/slots",
    "/lora-adapters",
]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings(api_docs=True))) as test_client:
        wait_ready(test_client.get)
        yield test_client


@pytest.mark.parametrize("path", GETS)
def test_head_is_the_gets_status_and_headers_without_a_body(client: TestClient, path: str) -> None:
    get = client.get(path)
    assert get.status_code == 200, get.text
    head = client.head(path)
    assert head.status_code == 200, head.headers
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    if path.startswith(("/ui/", "/docs")) or path == "/":  # fixed files: the same length
        assert head.headers["content-length"] == get.headers["content-length"]
        assert head.headers.get("content-security-policy") == get.headers.get(
            "content-security-policy"
        )


def test_a_heads_error_is_the_gets_error_without_a_body(client: TestClient) -> None:
    assert client.get("/v1/models/nosuch").status_code == 404
    head = client.head("/v1/models/nosuch")
    assert head.status_code == 404 and head.content == b""
    # A route without GET has no HEAD either: 405.
    post_only = client.head("/v1/chat/completions")
    assert post_only.status_code == 405 and post_only.content == b""


def test_head_is_guarded_as_get_is() -> None:
    settings = stub_settings(api_key="k", admin_key="admin")
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        assert client.head("/", headers={"Host": "attacker.example"}).status_code == 421
        assert client.head("/").status_code == 200  # an open path
        assert client.head("/v1/models").status_code == 401
        assert client.head("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert client.head("/cache/stats", headers={"x-api-key": "k"}).status_code == 401
        assert client.head("/cache/stats", headers={"x-api-key": "admin"}).status_code == 200


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_a_live_server_answers_head_and_keeps_the_connection(http: str) -> None:
    """Under uvicorn, which frames a HEAD's answer itself: the GET's length, no body, and the
    next request on the same connection is read as a request, not as a stray body."""
    server = LiveServer(stub_settings(allowed_hosts=()), http=http).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            get = client.get("/")
            head = client.head("/")
            assert head.status_code == 200 and head.content == b""
            assert head.headers["content-length"] == get.headers["content-length"]
            after = client.get("/v1/models")  # the same connection, read in step
            assert after.status_code == 200 and after.json()["object"] == "list"
    finally:
        server.stop()
