"""A ~100-byte JSON schema must not expand into a grammar of unbounded size.

``{"type":"string","minLength":N}`` converts into a rule of N ``char`` references, 5 bytes of
grammar per unit of N: ``N = 10**6`` cost ~4 s of CPU (holding the GIL, so the event loop
stalled too) and ~400 MB on the real backend, then was served with a 200. Bounds past
``grammar.MAX_SCHEMA_REPEATS`` are now a 4xx in the API's error shape, before any grammar is
built; no reply of at most ``max_tokens_limit`` tokens could satisfy such a schema anyway.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings()), raise_server_exceptions=False) as test_client:
        wait_ready(test_client.get)
        yield test_client


def test_huge_min_length_schema_is_refused(client: TestClient) -> None:
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "string", "minLength": 1_000_000}},
        },
    }
    response = client.post("/v1/chat/completions", json=body)
    # Before the fix: 200 after building (and compiling) a 5,000,138-character grammar.
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:200])
    assert response.json()["error"]["param"] in ("response_format", "json_schema", "grammar")
