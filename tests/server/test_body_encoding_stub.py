"""A body's bytes are text before they are JSON: a lone UTF-16 surrogate sent as raw bytes
(UTF-8's ``ED A0 80``, or a UTF-16/32 body) is refused at the door, as one sent as a
``\\ud800`` escape is, and a body that is not text of its encoding is a 400 ``invalid_json``.

Found by review: ``json.loads`` decodes bytes with ``surrogatepass``, while ``read_json``
looked for surrogates only where the raw bytes held a ``\\uD8..`` escape. A raw surrogate in
a Responses body's ``metadata`` ran the whole generation, stored the response, then failed to
serialise it: a 500, and a stored response whose body could never be rendered.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app
from kvwarm.server.state import ServerState

from .conftest import stub_settings, wait_ready
from .test_api_stub import assert_error

LONE = "\ud800"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings())) as test_client:
        wait_ready(test_client.get)
        yield test_client


def _state(client: TestClient) -> ServerState:
    state = client.app.state.kvwarm  # type: ignore[attr-defined]
    assert isinstance(state, ServerState)
    return state


def _post(client: TestClient, path: str, body: object, encoding: str) -> httpx.Response:
    """``body`` as JSON text whose non-ASCII characters are written out, in ``encoding``
    (``surrogatepass``: a lone surrogate becomes the bytes that encoding would give it)."""
    text = json.dumps(body, ensure_ascii=False)
    raw = text.encode(encoding, "surrogatepass")
    return client.post(path, content=raw, headers={"content-type": "application/json"})


RESPONSE = {"model": "a", "input": "hi", "max_output_tokens": 2}


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16-le", "utf-16", "utf-32"])
def test_a_raw_lone_surrogate_is_a_400_and_nothing_runs_or_is_stored(
    client: TestClient, encoding: str
) -> None:
    store = _state(client).responses
    before = len(store)
    response = _post(client, "/v1/responses", RESPONSE | {"metadata": {"k": LONE}}, encoding)
    assert_error(response, 400, "invalid_json")
    assert len(store) == before  # refused before it ran: no stored response to trip on


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-32"])
def test_an_escaped_surrogate_in_a_utf16_or_utf32_body_is_named(
    client: TestClient, encoding: str
) -> None:
    """The escape check ran on the raw bytes, where a UTF-16 body's ``\\ud800`` is not the
    bytes the check looked for."""
    raw = json.dumps(RESPONSE | {"metadata": {"k": LONE}}).encode(encoding)
    response = client.post("/v1/responses", content=raw)
    assert_error(response, 400, "invalid_value", "metadata.k")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 2, "user": LONE}),
        ("/v1/embeddings", {"model": "a", "input": LONE}),
        (
            "/v1/chat/completions",
            {"model": "a", "messages": [{"role": "user", "content": "x"}], "user": LONE},
        ),
    ],
)
def test_every_route_refuses_raw_surrogate_bytes_alike(
    client: TestClient, path: str, body: object
) -> None:
    assert_error(_post(client, path, body, "utf-8"), 400, "invalid_json")


def test_anthropic_route_refuses_them_in_its_own_shape(client: TestClient) -> None:
    body = {"model": "a", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    response = _post(client, "/v1/messages", body | {"metadata": {"user_id": LONE}}, "utf-8")
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
def test_valid_text_in_any_json_encoding_still_works(client: TestClient, encoding: str) -> None:
    """What ``json.loads`` took before (RFC 8259's UTF-8, and the UTF-16/32 it detects)
    still works, non-ASCII text included."""
    response = _post(client, "/v1/embeddings", {"model": "a", "input": "héllo 😺"}, encoding)
    assert response.status_code == 200, response.json()
