"""Server-side limits on generation length, against the stub backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready

LIMIT = 40


@pytest.fixture(scope="module")
def capped() -> Iterator[TestClient]:
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
    ],
)
def test_above_the_limit_is_400(
    capped: TestClient, path: str, body: dict[str, object], param: str
) -> None:
    response = capped.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value"
    assert str(LIMIT) in error["message"] and "max_tokens_limit" in error["message"]


def test_at_the_limit_is_served(capped: TestClient) -> None:
    done = capped.post("/v1/completions", json={**COMPLETION, "max_tokens": LIMIT})
    assert done.status_code == 200, done.text
    chat = capped.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": LIMIT})
    assert chat.status_code == 200, chat.text
