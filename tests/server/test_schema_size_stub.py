"""A ~100-byte JSON schema expands into a grammar of unbounded size.

``{"type":"string","minLength":N}`` is converted (llama-cpp-python's converter, then
``check_grammar_cost``, then the sampler) into a rule of N literal ``char`` references: 5 bytes
of grammar per unit of N. ``N = 10**6`` costs ~4 s of CPU (holding the GIL, so the event loop
stalls too) and ~140 MB on the stub, ~400 MB RSS and 5 s on the real backend, and is then
*served* with a 200; ``N = 10**8`` from the same 100-byte body asks for ~500 MB of grammar text
and minutes of CPU before any limit applies. ``check_grammar_cost`` bounds a grammar's
ambiguity, never its size, and nothing bounds the schema's numbers. No output of at most
``max_tokens_limit`` tokens can satisfy such a schema anyway.

The request must be refused as a 4xx (the API's error shape), before the grammar is built.
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
