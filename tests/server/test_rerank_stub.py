"""``/v1/rerank`` (and ``/rerank``, ``/v2/rerank``) on the stub backend: shapes, the Jina and
Cohere request forms, what ``/v1/models`` says a model can do, and every refusal a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app
from kvwarm.settings import ModelSpec

from .conftest import stub_settings, wait_ready
from .test_api_stub import assert_error

QUERY = "which animal purrs?"
DOCS = ["cats purr when content", "dogs bark", "kittens purr too", "parrots talk"]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = stub_settings(
        models=(
            ModelSpec(path="stub-reranker.gguf", id="ranker"),
            ModelSpec(path="stub-cross-encoder.gguf", id="cross"),
            ModelSpec(path="stub-a", id="plain"),
        ),
        n_batch=256,
        rerank_max_documents=8,
    )
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


@pytest.mark.parametrize(
    "path", ["/v1/rerank", "/rerank", "/v2/rerank", "/reranking", "/v1/reranking"]
)
@pytest.mark.parametrize("model", ["ranker", "cross"])
def test_rerank_shape(client: TestClient, path: str, model: str) -> None:
    response = client.post(path, json={"model": model, "query": QUERY, "documents": DOCS})
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["object"] == "list" and body["model"] == model
    assert body["id"].startswith("rerank-")
    results = body["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert all(set(r) == {"index", "relevance_score"} for r in results)
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


def test_jina_documents_top_n_and_return_documents(client: TestClient) -> None:
    """Documents as ``{"text": ...}`` (Jina, Cohere v1) rank as the same texts do; ``top_n``
    keeps the best; ``return_documents`` puts each text in its result."""
    plain = client.post("/v1/rerank", json={"model": "ranker", "query": QUERY, "documents": DOCS})
    body = {
        "model": "ranker",
        "query": QUERY,
        "documents": [{"text": d} for d in DOCS],
        "top_n": 2,
        "return_documents": True,
    }
    objects = client.post("/v1/rerank", json=body)
    assert objects.status_code == 200, objects.json()
    best = plain.json()["results"][:2]
    got = objects.json()["results"]
    assert [(r["index"], r["relevance_score"]) for r in got] == [
        (r["index"], r["relevance_score"]) for r in best
    ]
    assert [r["document"] for r in got] == [{"text": DOCS[r["index"]]} for r in got]


def test_cohere_v2_request(client: TestClient) -> None:
    """Cohere v2's shape: texts and ``max_tokens_per_doc``, which cuts each document."""
    cut = client.post(
        "/v2/rerank",
        json={"model": "ranker", "query": QUERY, "documents": DOCS, "max_tokens_per_doc": 4},
    )
    assert cut.status_code == 200, cut.json()
    short = client.post(
        "/v2/rerank", json={"model": "ranker", "query": QUERY, "documents": [d[:4] for d in DOCS]}
    )
    assert cut.json()["results"] == short.json()["results"]


def test_models_say_what_each_can_do(client: TestClient) -> None:
    data = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert data["ranker"]["capabilities"] == ["rerank"]
    assert data["ranker"]["meta"]["pooling"] == "rank"
    assert data["cross"]["capabilities"] == ["rerank"]
    assert data["plain"]["capabilities"] == ["generate", "embed"]


def test_refusals_are_400s(client: TestClient) -> None:
    def rerank(**body: object) -> object:
        return client.post("/v1/rerank", json={"model": "ranker", "query": QUERY, **body})

    assert_error(rerank(documents=[]), 400, "invalid_value", "documents")
    assert_error(rerank(documents=["d"] * 9), 400, "invalid_value", "documents")
    # Found by review: both named "prompt", a field a rerank does not have.
    assert_error(rerank(documents=["x" * 5000]), 400, "context_length_exceeded", "documents")
    long_query = client.post(
        "/v1/rerank", json={"model": "ranker", "query": "x" * 5000, "documents": DOCS}
    )
    assert_error(long_query, 400, "context_length_exceeded", "query")
    assert rerank(documents=DOCS, top_n=0).status_code == 400
    # JSON integers only (found by review: true was top_n 1, "2" was 2).
    for field in ("top_n", "max_tokens_per_doc"):
        for bad in (True, "2", 2.5):
            refused = rerank(documents=DOCS, **{field: bad})
            assert refused.status_code == 400, (field, bad, refused.json())
            assert refused.json()["error"]["param"] == field
    missing = client.post("/v1/rerank", json={"model": "ranker", "documents": DOCS})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "query"
    assert_error(
        client.post("/v1/rerank", json={"model": "plain", "query": QUERY, "documents": DOCS}),
        400,
        "unsupported_by_model",
        "model",
    )
    chat = {"model": "ranker", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(client.post("/v1/chat/completions", json=chat), 400, "unsupported_by_model")
    streamed = client.post("/v1/chat/completions", json={**chat, "stream": True})
    assert_error(streamed, 400, "unsupported_by_model")
    completion = {"model": "ranker", "prompt": "hi"}
    assert_error(client.post("/v1/completions", json=completion), 400, "unsupported_by_model")
    embedding = {"model": "ranker", "input": "hi"}
    assert_error(client.post("/v1/embeddings", json=embedding), 400, "unsupported_by_model")
    # The server still serves: a refusal leaves nothing behind.
    assert rerank(documents=DOCS).status_code == 200


def test_documents_are_counted_before_validation_against_each_models_limit() -> None:
    """More documents than any model may take is a 400 before the body is validated; a
    ``[[models]]`` table's larger limit is its model's own (the global one bounds the rest)."""
    settings = stub_settings(
        models=(
            ModelSpec(path="stub-reranker.gguf", id="small"),
            ModelSpec(
                path="stub-reranker.gguf", id="large", options=(("rerank_max_documents", 20),)
            ),
        ),
        rerank_max_documents=8,
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)

        def rerank(model: str, n: int) -> object:
            docs = [f"doc {i}" for i in range(n)]
            body = {"model": model, "query": QUERY, "documents": docs, "keep_alive": "5m"}
            return client.post("/v1/rerank", json=body)

        assert rerank("large", 12).status_code == 200
        assert_error(rerank("small", 12), 400, "invalid_value", "documents")
        refused = rerank("large", 21)
        assert_error(refused, 400, "invalid_value", "documents")
        assert "rerank_max_documents" in refused.json()["error"]["message"]


def test_a_reranker_is_not_prewarmed_with_system_prompts(caplog: pytest.LogCaptureFixture) -> None:
    """``--prewarm-system`` warms the models that chat; a reranker never does (no warning)."""
    settings = stub_settings(
        models=(
            ModelSpec(path="stub-reranker.gguf", id="ranker"),
            ModelSpec(path="stub-a", id="a"),
        ),
        prewarm_system=("You are the harbour's archivist.",),
    )
    with caplog.at_level("WARNING"), TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        body = {"model": "ranker", "query": QUERY, "documents": DOCS}
        assert client.post("/v1/rerank", json=body).status_code == 200
    assert not [r for r in caplog.records if "prewarm of a system prompt" in r.getMessage()]


@pytest.mark.parametrize(("setting", "passed"), [(7.5, 7.5), (0.0, None)])
def test_a_rerank_runs_under_request_timeout_s(
    monkeypatch: pytest.MonkeyPatch, setting: float, passed: float | None
) -> None:
    """Found by review: a rerank had no deadline, so a long one held its model's queue for
    as long as it took, its client long gone. It runs under ``request_timeout_s`` (0: none),
    past which its documents are cancelled (``tests/engine/test_rerank_stub.py``)."""
    from kvwarm.engine.model import Model

    seen: list[object] = []
    original = Model.rerank

    def recording(self: Model, *args: object, **kwargs: object) -> object:
        seen.append(kwargs.get("timeout_s"))
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Model, "rerank", recording)
    settings = stub_settings(
        models=(ModelSpec(path="stub-reranker.gguf", id="ranker"),), request_timeout_s=setting
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        body = {"model": "ranker", "query": QUERY, "documents": DOCS}
        assert client.post("/v1/rerank", json=body).status_code == 200
    assert seen == [passed]


def test_a_rerank_runs_under_the_global_lora_scales(tmp_path: Path) -> None:
    """llama-server runs a rerank's documents under its adapters' global scales
    (``POST /lora-adapters``), as it embeds; found by review: kvwarm dropped them for a
    rerank (not for an embedding), so a reranker with an adapter on scored with the base
    model alone. (The stub's scores are salted by the adapters a pass runs under.)"""
    adapter = tmp_path / "domain.gguf"
    adapter.write_bytes(b"stub adapter: domain")
    settings = stub_settings(
        models=(ModelSpec(path="stub-reranker.gguf", id="ranker"),),
        lora=(("domain", str(adapter)),),
        n_batch=256,
    )
    body: dict[str, object] = {"model": "ranker", "query": QUERY, "documents": DOCS}

    def scores(client: TestClient) -> list[float]:
        response = client.post("/v1/rerank", json=body)
        assert response.status_code == 200, response.json()
        return [r["relevance_score"] for r in sorted(response.json()["results"], key=_index)]

    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        base = scores(client)
        assert client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}]).status_code == 200
        under = scores(client)
        assert under != base
        assert client.post("/lora-adapters", json=[]).status_code == 200
        assert scores(client) == base
        assert client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}]).status_code == 200
        assert scores(client) == under  # its own namespace: the same scores again
        assert client.post("/lora-adapters", json=[]).status_code == 200
        # A rerank's own lora list (as a completion's; it was ignored): that set alone.
        body["lora"] = [{"id": 0, "scale": 1.0}]
        assert scores(client) == under
        body["lora"] = [{"id": 3, "scale": 1.0}]
        bad = client.post("/v1/rerank", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora", bad.text


def _index(result: dict[str, object]) -> int:
    index = result["index"]
    assert isinstance(index, int)
    return index
