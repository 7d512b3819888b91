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
