"""Tenant isolation through HTTP on the real model: a prompt cached for one salt reports
``cached_tokens`` 0 to every other salt and > 0 to its own, whether the salt comes from the
body, the ``X-Cache-Salt`` header or the API key (``cache_salt_from_auth``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from .conftest import LiveServer
from .test_live_openai import real_settings

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    settings = real_settings(None).replace(
        n_ctx=512, default_max_tokens=2, cache_salt_from_auth=True
    )
    live = LiveServer(settings).start()
    try:
        with httpx.Client(base_url=live.base_url, timeout=300) as client:
            yield client
    finally:
        live.stop()


def cached(http: httpx.Client, prompt: str, body: dict[str, str], headers: dict[str, str]) -> int:
    payload = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **body}
    response = http.post("/v1/completions", json=payload, headers=headers)
    assert response.status_code == 200, response.text
    value = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(value, int)
    return value


FORMS = {
    "body": lambda salt: ({"cache_salt": salt}, {}),
    "header": lambda salt: ({}, {"X-Cache-Salt": salt}),
    "api_key": lambda salt: ({}, {"Authorization": f"Bearer sk-{salt}"}),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_another_salt_is_cold_and_the_same_salt_is_warm(http: httpx.Client, form: str) -> None:
    # Salts of their own per form: a body and a header salt of one value are one namespace.
    prompt = f"Tenant {form} asks: summarise the meeting notes from Tuesday about the budget."
    as_salt = FORMS[form]
    tenant_a, tenant_b = as_salt(f"{form}-a"), as_salt(f"{form}-b")
    assert cached(http, prompt, *tenant_a) == 0
    assert cached(http, prompt, *tenant_b) == 0
    assert cached(http, prompt, *tenant_a) > 0
    assert cached(http, prompt, *tenant_b) > 0


def test_chat_is_isolated_the_same_way(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Tenant chat: what did we decide on Tuesday?"}]

    def chat(key: str) -> int:
        body = {"messages": messages, "max_tokens": 2, "temperature": 0}
        response = http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200, response.text
        value = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert isinstance(value, int)
        return value

    assert chat("sk-one") == 0
    assert chat("sk-two") == 0
    assert chat("sk-one") > 0


def test_a_utf8_header_salt_over_real_http(http: httpx.Client) -> None:
    # uvicorn hands the header's raw bytes over: UTF-8 "café" is the body's "café"; other
    # bytes are a 400.
    prompt = "Tenant utf8 asks: list the open action items from the Friday review."
    assert cached(http, prompt, {"cache_salt": "café"}, {"Authorization": "Bearer sk-utf8"}) == 0

    def post(salt: bytes, text: str) -> httpx.Response:
        headers = {b"authorization": b"Bearer sk-utf8", b"x-cache-salt": salt}
        body = {"prompt": text, "max_tokens": 2, "temperature": 0}
        return http.post("/v1/completions", json=body, headers=headers)

    warm = post("café".encode(), prompt)
    assert warm.status_code == 200, warm.text
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    bad = post(b"caf\xe9", "hi")
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "X-Cache-Salt"


def test_prewarm_for_a_tenant_key_on_the_real_model(http: httpx.Client) -> None:
    prompt = "Tenant prewarm asks: draft a reply to the supplier about the late delivery."
    body = {"prompt": prompt, "tenant_key": "sk-target", "keep_alive": False}
    response = http.post("/cache/prewarm", json=body, headers={"Authorization": "Bearer sk-op"})
    assert response.status_code == 200, response.text
    assert response.json()["cached_tokens"] == 0
    assert cached(http, prompt, {}, {"Authorization": "Bearer sk-op"}) == 0
    assert cached(http, prompt, {}, {"Authorization": "Bearer sk-target"}) > 0
