"""Non-finite numbers (``NaN``, ``Infinity``), which Python's decoder accepts, are not JSON: a
body holding one is a 400 in the API's error shape. Before, the Responses API echoed them back
inside schema objects: a 500 from ``JSONResponse`` (it refuses non-finite floats), streamed
events that were not JSON (``data: {..."minimum":NaN...}``), and a stored response that could
never be read back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready

NAN_SCHEMA = (
    '{"model":"a","input":"x","max_output_tokens":4,'
    '"text":{"format":{"type":"json_schema","name":"x",'
    '"schema":{"type":"integer","minimum":NaN}}}}'
)
INF_TOOL = (
    '{"model":"a","input":"x","max_output_tokens":4,'
    '"tools":[{"type":"function","name":"f","parameters":{"type":"object",'
    '"properties":{"a":{"type":"number","maximum":Infinity}}}}]}'
)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = create_app(stub_settings())
    with TestClient(app, raise_server_exceptions=False) as test_client:
        wait_ready(test_client.get)
        yield test_client


def _post(client: TestClient, raw: str) -> object:
    return client.post(
        "/v1/responses", content=raw.encode(), headers={"content-type": "application/json"}
    )


def _strict(text: str) -> object:
    """JSON as the spec (and every browser's JSON.parse) reads it: no NaN or Infinity."""

    def refuse(name: str) -> object:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("raw", [NAN_SCHEMA, INF_TOOL], ids=["nan-schema", "inf-tool"])
def test_non_finite_number_is_not_a_500(client: TestClient, raw: str) -> None:
    response = _post(client, raw)
    assert response.status_code < 500, response.text  # before the fix: 500 internal_error
    _strict(response.text)


@pytest.mark.parametrize("raw", [NAN_SCHEMA, INF_TOOL], ids=["nan-schema", "inf-tool"])
def test_streamed_events_are_valid_json(client: TestClient, raw: str) -> None:
    response = _post(client, raw[:-1] + ',"stream":true}')
    if response.status_code != 200:  # a 400 before the stream is a fine answer too
        assert 400 <= response.status_code < 500, response.text
        return
    for line in response.text.split("\n"):
        if line.startswith("data: "):
            _strict(line[6:])  # before the fix: ValueError: not JSON: NaN / Infinity


def test_stored_response_can_be_read_back(client: TestClient) -> None:
    response = _post(client, NAN_SCHEMA[:-1] + ',"stream":true}')
    if response.status_code != 200:
        return  # refused up front: nothing was stored
    first = next(line for line in response.text.split("\n") if line.startswith("data: "))
    response_id = json.loads(first[6:])["response"]["id"]
    again = client.get(f"/v1/responses/{response_id}")
    assert again.status_code == 200, again.text  # before the fix: 500 on every read
