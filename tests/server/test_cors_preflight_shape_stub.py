"""With ``allowed_origins`` set, a CORS preflight from any other origin is refused by the
guard in the API's own error shape (403 ``origin_not_allowed``; Anthropic's under
``/v1/messages``), as with no origins set. Starlette's ``CORSMiddleware`` used to answer it
itself with a plain-text 400. No CORS header is granted either way.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.server import create_app

PREFLIGHT = {
    "Origin": "http://evil.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type",
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = stub_settings(allowed_origins=("http://ok.example",))
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        wait_ready(test_client.get)
        yield test_client


def test_allowed_origin_preflight_still_works(client: TestClient) -> None:
    ok = client.options("/cache/gc", headers={**PREFLIGHT, "Origin": "http://ok.example"})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://ok.example"


@pytest.mark.parametrize("path", ["/cache/gc", "/v1/chat/completions"])
def test_foreign_preflight_is_the_guards_openai_shaped_403(client: TestClient, path: str) -> None:
    response = client.options(path, headers=PREFLIGHT)
    assert "access-control-allow-origin" not in response.headers
    # Before the fix: 400, text/plain, body "Disallowed CORS origin".
    assert response.status_code == 403, (response.status_code, response.text)
    assert response.json()["error"]["code"] == "origin_not_allowed"


def test_foreign_preflight_is_anthropic_shaped_under_v1_messages(client: TestClient) -> None:
    response = client.options("/v1/messages", headers=PREFLIGHT)
    assert response.status_code == 403, (response.status_code, response.text)
    assert response.json()["type"] == "error"


@pytest.mark.parametrize("configured", ["http://app.example:3000/", "HTTP://App.Example:3000"])
def test_an_origin_configured_as_the_guard_reads_it_gets_cors_too(configured: str) -> None:
    """Found by review: the guard read ``allowed_origins`` lower-cased and without a trailing
    slash, Starlette's CORS as written: with ``http://app.example:3000/`` (the address bar's
    form) the page's POSTs ran but it could read no answer, and its preflights were a 405."""
    origin = "http://app.example:3000"
    with TestClient(create_app(stub_settings(allowed_origins=(configured,)))) as client:
        wait_ready(client.get)
        preflight = client.options(
            "/v1/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
        )
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == origin
        real = client.post("/cache/gc", headers={"Origin": origin})
        assert real.status_code == 200
        assert real.headers["access-control-allow-origin"] == origin
        other = client.post("/cache/gc", headers={"Origin": "http://app.example:3001"})
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
