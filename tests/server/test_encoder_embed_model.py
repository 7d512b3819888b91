"""/v1/embeddings on an encoder embedding model (a BERT: attention not causal, a position
table of 512 rows), the tiny random-weight ``bert`` of ``tests/tinymodels.write_reranker``,
served at n_ctx 2048."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from tests.tinymodels import N_CTX, write_reranker

from kvwarm.settings import ModelSpec

from .conftest import serve_tiny_models

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = write_reranker(tmp_path_factory.mktemp("bert") / "bert.gguf", "encoder", pooling=1)
    yield from serve_tiny_models((ModelSpec(path=str(path), id="bert"),))


def test_an_encoder_serves_embeddings_and_refuses_to_chat(client: TestClient) -> None:
    """Found by review: a BERT embedding model failed its load, so every request to it was a
    503. It embeds now (floats and base64 the same vector), says so in /v1/models, and a chat
    is a 400 naming what it can do."""
    listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert listed["bert"]["capabilities"] == ["embed"]
    body = {"model": "bert", "input": ["cats purr", "ferries leave"]}
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    floats = [d["embedding"] for d in r.json()["data"]]
    assert [d["index"] for d in r.json()["data"]] == [0, 1]
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-6) for v in floats)
    b64 = client.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert struct.unpack(f"<{len(raw) // 4}f", raw) == pytest.approx(floats[0], abs=1e-7)
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "bert", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "unsupported_by_model", chat.text
    assert "only embed" in chat.json()["error"]["message"]


def test_an_input_past_the_position_table_is_a_400(client: TestClient) -> None:
    """Served at n_ctx 2048, the model has 512 positions: an input of 600 tokens reached
    ggml_get_rows' GGML_ASSERT (the process aborted); it is a 400 naming input, and one that
    fits is embedded."""
    r = client.post("/v1/embeddings", json={"model": "bert", "input": [[5] * (N_CTX + 88)]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "input"
    ok = client.post("/v1/embeddings", json={"model": "bert", "input": [[5] * N_CTX]})
    assert ok.status_code == 200, ok.text
