"""Server-side limits on generation length, against the stub backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready

LIMIT = 40


@pytest.fixture(scope="module")
def refusing() -> Iterator[TestClient]:
    settings = stub_settings(max_tokens_limit=LIMIT, max_tokens_over_limit="refuse")
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        yield client


@pytest.fixture(scope="module")
def capped() -> Iterator[TestClient]:
    """The default: a length above the limit is served up to it."""
    with TestClient(create_app(stub_settings(max_tokens_limit=LIMIT))) as client:
        wait_ready(client.get)
        yield client


CHAT = {"model": "a", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "a", "prompt": "hi"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMPLETION, "max_tokens": LIMIT + 1}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 10**9, "stream": True}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": LIMIT + 1}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**9}, "max_completion_tokens"),
        (
            "/v1/chat/completions",
            {**CHAT, "max_tokens": 2, "max_completion_tokens": LIMIT + 1},
            "max_completion_tokens",
        ),
        ("/v1/messages", {**CHAT, "max_tokens": 32000}, "max_tokens"),
        (
            "/v1/responses",
            {"model": "a", "input": "hi", "max_output_tokens": 10**6},
            "max_output_tokens",
        ),
        (
            "/infill",
            {"model": "a", "input_prefix": "a", "input_suffix": "b", "n_predict": 10**6},
            "n_predict",
        ),
    ],
)
def test_above_the_limit_is_400_when_refused(
    refusing: TestClient, path: str, body: dict[str, object], param: str
) -> None:
    response = refusing.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if path == "/v1/messages":  # Anthropic's error shape: the field named in the message
        assert error["type"] == "invalid_request_error" and error["message"].startswith(param)
    else:
        assert error["param"] == param and error["code"] == "invalid_value"
    assert str(LIMIT) in error["message"] and "max_tokens_limit" in error["message"]


def test_at_the_limit_is_served(capped: TestClient) -> None:
    done = capped.post("/v1/completions", json={**COMPLETION, "max_tokens": LIMIT})
    assert done.status_code == 200, done.text
    chat = capped.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": LIMIT})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {**COMPLETION, "max_tokens": 10**9, "ignore_eos": True}),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": LIMIT + 1, "ignore_eos": True}),
        ("/v1/messages", {**CHAT, "max_tokens": 32000}),  # what Claude Code sends
        ("/v1/responses", {"model": "a", "input": "hi", "max_output_tokens": 10**6}),
    ],
)
def test_above_the_limit_is_served_up_to_it_by_default(
    capped: TestClient, path: str, body: dict[str, object]
) -> None:
    response = capped.post(path, json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    generated = usage.get("completion_tokens", usage.get("output_tokens"))
    assert 0 < generated <= LIMIT
    if "ignore_eos" in body:  # it ran to the cap, and says so as at its own max_tokens
        assert generated == LIMIT
        assert response.json()["choices"][0]["finish_reason"] == "length"


def test_the_over_limit_setting_is_checked() -> None:
    from kvwarm.errors import ConfigError

    with pytest.raises(ConfigError, match="max_tokens_over_limit"):
        stub_settings(max_tokens_over_limit="clamp").check()
