"""/v1/embeddings with token-id input: the ids are embedded as given (stub backend)."""

from __future__ import annotations

from fastapi.testclient import TestClient


def _tokens(client: TestClient, add_special: bool) -> list[int]:
    body = {"model": "a", "content": "hey", "add_special": add_special}
    tokens: list[int] = client.post("/tokenize", json=body).json()["tokens"]
    return tokens


def test_token_ids_are_embedded_and_counted_as_given(client: TestClient) -> None:
    bare, with_bos = _tokens(client, False), _tokens(client, True)
    assert len(with_bos) == len(bare) + 1
    one = client.post("/v1/embeddings", json={"model": "a", "input": bare}).json()
    # Before: the ids were detokenized and tokenized again, which added a BOS.
    assert one["usage"]["prompt_tokens"] == len(bare)
    both = client.post("/v1/embeddings", json={"model": "a", "input": [bare, with_bos]}).json()
    assert both["usage"]["prompt_tokens"] == len(bare) + len(with_bos)
    assert both["data"][0]["embedding"] == one["data"][0]["embedding"]
    assert both["data"][0]["embedding"] != both["data"][1]["embedding"]
    text = client.post("/v1/embeddings", json={"model": "a", "input": "hey"}).json()
    assert text["data"][0]["embedding"] == both["data"][1]["embedding"]
