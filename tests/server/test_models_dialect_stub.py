"""``/v1/models`` answers an Anthropic client (a request with ``anthropic-version``, which every
Anthropic SDK sends) in Anthropic's shape: its errors too, whoever raises them (the route, the
query's validation, the router's 405, the guard's 401), while OpenAI's clients keep theirs.

Found by review: the models came in Anthropic's shape and their errors in OpenAI's, so an
Anthropic client read no ``type: "error"`` and no error type it knows.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready
from .test_api_stub import assert_error

ANTHROPIC = {"anthropic-version": "2023-06-01", "x-api-key": "k"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings(api_key="k"))) as test_client:
        wait_ready(test_client.get)
        yield test_client


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error", body
    assert body["error"]["type"] == kind and body["error"]["message"]


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "kind"),
    [
        ("GET", "/v1/models/nosuch", ANTHROPIC, 404, "not_found_error"),
        ("GET", "/v1/models?limit=0", ANTHROPIC, 400, "invalid_request_error"),
        ("GET", "/v1/models?after_id=nosuch", ANTHROPIC, 400, "invalid_request_error"),
        ("POST", "/v1/models", ANTHROPIC, 405, "invalid_request_error"),
        ("GET", "/v1/models", {"anthropic-version": "2023-06-01"}, 401, "authentication_error"),
        (
            "GET",
            "/v1/models",
            {**ANTHROPIC, "Origin": "http://evil.example"},
            403,
            "permission_error",
        ),
    ],
)
def test_an_anthropic_clients_models_errors_are_anthropics(
    client: TestClient, method: str, path: str, headers: dict[str, str], status: int, kind: str
) -> None:
    _anthropic_error(client.request(method, path, headers=headers), status, kind)


def test_openai_clients_and_other_paths_keep_openais_shape(client: TestClient) -> None:
    key = {"Authorization": "Bearer k"}
    assert_error(client.get("/v1/models/nosuch", headers=key), 404, "model_not_found")
    assert_error(client.get("/v1/models"), 401, "invalid_api_key")
    # anthropic-version on an OpenAI-only path changes nothing.
    response = client.post("/v1/embeddings", json={"input": []}, headers=ANTHROPIC)
    assert_error(response, 400, "invalid_value")
    assert_error(client.get("/v1/modelsx", headers=ANTHROPIC), 404, "not_found")
