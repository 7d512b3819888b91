"""The OpenAI surface through the official ``openai`` client and plain HTTP against a live,
stub-backed server: the parts whose behaviour does not depend on a real model (the embedded
model's versions are in ``test_live_openai_surface.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from .conftest import LiveServer, stub_settings

ORIGIN = "http://app.example:3000"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = LiveServer(stub_settings(allowed_origins=(ORIGIN,), api_key=KEY)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> OpenAI:
    return OpenAI(base_url=live.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=60) as c:
        yield c


# --- max_completion_tokens, models -----------------------------------------------------------


def test_max_completion_tokens_wins_over_max_tokens(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Write a long story about caches"}]
    done = client.chat.completions.create(
        model="a",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert done.usage is not None and done.usage.completion_tokens == 3
    assert done.choices[0].finish_reason == "length"
    other = client.chat.completions.create(
        model="a",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert other.usage is not None and other.usage.completion_tokens == 5


def test_retrieve_model_and_unknown_is_openai_404(client: OpenAI) -> None:
    model = client.models.retrieve("b")
    assert model.id == "b" and model.object == "model" and model.owned_by == "kvwarm"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found" and body["param"] == "model"


# --- keys, CORS, docs ------------------------------------------------------------------------


def test_x_api_key_header_is_accepted(http: httpx.Client) -> None:
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
    assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
    bearer = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200


def test_cors_preflight_and_headers_for_an_allowed_origin(http: httpx.Client) -> None:
    preflight = http.options(
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-api-key",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert "x-api-key" in allowed and "authorization" in allowed
    ok = http.get("/v1/models", headers={"Origin": ORIGIN, "x-api-key": KEY})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    # A refusal is readable by the allowed page too: it carries the CORS header.
    refused = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN


def test_cors_refuses_other_origins(http: httpx.Client) -> None:
    evil = "http://evil.example"
    preflight = http.options(
        "/v1/chat/completions",
        headers={"Origin": evil, "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    response = http.get("/v1/models", headers={"Origin": evil, "x-api-key": KEY})
    assert response.status_code == 403
    assert "access-control-allow-origin" not in response.headers


def test_cors_is_off_by_default() -> None:
    from fastapi.testclient import TestClient

    from kvwarm.server import create_app

    with TestClient(create_app(stub_settings())) as plain:
        response = plain.options(
            "/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
        )
        assert "access-control-allow-origin" not in response.headers
        refused = plain.get("/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 403


def test_docs_and_openapi_served_without_a_key(http: httpx.Client) -> None:
    docs = http.get("/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text.lower()
    assert "/openapi.json" in docs.text
    schema = http.get("/openapi.json")
    assert schema.status_code == 200
    spec = schema.json()
    assert "/v1/chat/completions" in spec["paths"] and "/v1/models/{model_id}" in spec["paths"]
    schemes = spec["components"]["securitySchemes"]
    assert schemes["x-api-key"] == {"type": "apiKey", "in": "header", "name": "x-api-key"}
    assert schemes["bearer"]["scheme"] == "bearer"
    # Open for reading only: the guard's other rules still hold there.
    assert http.post("/openapi.json").status_code == 401
    assert http.get("/docs", headers={"Host": "evil.example"}).status_code == 421
