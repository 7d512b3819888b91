"""/v1/embeddings with token-id input: the ids are embedded as given (stub backend)."""

from __future__ import annotations

import math

import pytest
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


def test_dimensions_shorten_to_a_unit_vector_and_out_of_range_is_a_400(client: TestClient) -> None:
    body = {"model": "a", "input": "hey"}
    full = client.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    short = client.post("/v1/embeddings", json={**body, "dimensions": 4}).json()
    vector = short["data"][0]["embedding"]
    # OpenAI's shortened embeddings: the leading values, renormalized (they were not).
    assert len(vector) == 4 and math.isclose(sum(v * v for v in vector), 1.0, rel_tol=1e-9)
    scale = vector[0] / full[0]
    assert vector == pytest.approx([v * scale for v in full[:4]], rel=1e-9)
    same = client.post("/v1/embeddings", json={**body, "dimensions": len(full)}).json()
    assert same["data"][0]["embedding"] == pytest.approx(full, rel=1e-9)
    # Sizes the model cannot give were silently ignored (the full vector came back).
    for bad in (0, -1, len(full) + 1):
        response = client.post("/v1/embeddings", json={**body, "dimensions": bad})
        assert response.status_code == 400, response.json()
        assert response.json()["error"]["param"] == "dimensions"


@pytest.mark.parametrize("ids", [[True], [[True, 2]], [2.0], [[1.0, 2]]])
def test_token_ids_are_json_integers_only(client: TestClient, ids: list[object]) -> None:
    """Found by review: pydantic's lax ``int`` took ``true`` as token 1 and ``2.0`` as token 2,
    so ``"input": [true]`` embedded token 1 (and a completion's prompt ran it): a 400 now, as
    OpenAI answers, naming the field."""
    for path, field in (("/v1/embeddings", "input"), ("/v1/completions", "prompt")):
        r = client.post(path, json={"model": "a", field: ids, "max_tokens": 1})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"].startswith(field), r.text
    r = client.post("/detokenize", json={"model": "a", "tokens": ids})
    assert r.status_code == 400, r.text


def test_an_input_over_the_context_is_a_400_naming_input(client: TestClient) -> None:
    """An input longer than the context is refused whole (not cut), as
    ``context_length_exceeded``; found by review: its ``param`` was ``prompt``, a field
    embeddings do not have."""
    r = client.post("/v1/embeddings", json={"model": "b", "input": [[1, 2], [1] * 300]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input", error


@pytest.mark.parametrize("empty", ["", [""], ["hey", ""], [[]], [[1, 2], []]])
def test_an_empty_input_is_a_400_whatever_the_tokenizer_adds(
    client: TestClient, empty: object
) -> None:
    """Found by review: on a model that adds a BOS (the stub does, as Gemma), ``""`` embedded
    that BOS alone, a vector of nothing, where a model without one (SmolLM2) answered 400;
    OpenAI refuses an empty input."""
    r = client.post("/v1/embeddings", json={"model": "a", "input": empty})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input", r.text


@pytest.mark.parametrize(("setting", "passed"), [(7.5, 7.5), (0.0, None)])
def test_an_embedding_runs_under_request_timeout_s(
    monkeypatch: pytest.MonkeyPatch, setting: float, passed: float | None
) -> None:
    """Found by review: an embedding had no deadline, so one request of many long inputs held
    its model's queue for as long as it took. It runs under ``request_timeout_s`` (0: none),
    past which its inputs not yet embedded are dropped (``tests/engine/
    test_embed_deadline_stub.py``), with a ``Cancellation`` its client's disconnect cancels
    (``tests/server/test_disconnect_cancels_stub.py``)."""
    from kvwarm.engine.cancel import Cancellation
    from kvwarm.engine.model import Model
    from kvwarm.server import create_app

    from .conftest import stub_settings, wait_ready

    seen: list[object] = []
    original = Model.embed

    def recording(self: Model, *args: object, **kwargs: object) -> object:
        seen.append(kwargs.get("timeout_s"))
        assert isinstance(kwargs.get("cancel"), Cancellation)
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Model, "embed", recording)
    with TestClient(create_app(stub_settings(request_timeout_s=setting))) as client:
        wait_ready(client.get)
        assert client.post("/v1/embeddings", json={"model": "a", "input": "hey"}).is_success
    assert seen == [passed]


def test_an_embedding_that_is_not_finite_is_a_typed_error(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: weights or adapters that overflow (a LoRA scale of 1e4 on SmolLM2, an
    adapter whose alpha is NaN) gave NaN vectors, returned as they were: a 200 of NaN under
    base64, an untyped 500 ``internal_error`` as JSON floats. Now a typed 500 saying why,
    as a generation's NaN logits are, and the model goes on embedding."""
    from kvwarm.backends.stub.context import StubContext

    body = {"model": "a", "input": ["hey", "you"]}
    good = client.post("/v1/embeddings", json=body).json()["data"]
    real = StubContext._embed

    def overflowing(self: StubContext, tokens: object, *, normalize: bool) -> list[float]:
        vector = real(self, tokens, normalize=normalize)  # type: ignore[arg-type]
        return [math.nan, *vector[1:]]

    monkeypatch.setattr(StubContext, "_embed", overflowing)
    for encoding in ("float", "base64"):
        bad = client.post("/v1/embeddings", json={**body, "encoding_format": encoding})
        assert bad.status_code == 500, (encoding, bad.text)
        error = bad.json()["error"]
        assert error["code"] == "backend_error" and "not all finite" in error["message"], error
    monkeypatch.undo()
    assert client.post("/v1/embeddings", json=body).json()["data"] == good
