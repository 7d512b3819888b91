"""Issue 41: limits a hostile request meets before it costs anything, and a model shared with
one: a chat beside a hostile request is answered while that request's work goes on (checked
by holding that work, or counting it, not by a clock).

On the stub backend (the behaviour does not depend on the model): embedding costs
``prefill_delay_s`` a token there, as a prefill does. The grammar's cost is weighed on the
real grammar code (``tests/backends/test_grammar_cost.py``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvwarm.backends.stub.context import StubContext
from kvwarm.server import create_app, schemas

from .conftest import LiveServer, stub_settings, wait_ready

CHAT = {"model": "a", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
X7 = [{"role": "user", "content": "x"}] * 7


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = stub_settings(max_embedding_inputs=8, max_completion_prompts=4, max_chat_messages=6)
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": ["x"] * 9}, "input"),
        ("/v1/embeddings", {"input": [[1, 2]] * 9}, "input"),
        ("/v1/completions", {"prompt": ["x"] * 5, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": X7}, "messages"),
        ("/v1/messages", {"max_tokens": 1, "messages": X7}, "messages"),
        ("/v1/messages/count_tokens", {"messages": X7}, "messages"),
        ("/v1/responses", {"input": X7}, "input"),
        ("/apply-template", {"messages": X7}, "messages"),
        # Found by review: a prewarm's chat was held to no count (its messages validated,
        # rendered and tokenized, however many).
        ("/cache/prewarm", {"messages": X7}, "messages"),
    ],
)
def test_too_many_items_are_a_400_naming_the_setting(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = client.post(path, json={"model": "a", **body})
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error.get("param", param) == param, error  # Anthropic's shape has no param
    assert "setting max_" in error["message"], error


def test_the_limits_are_inclusive_and_a_token_list_is_one_input(client: TestClient) -> None:
    assert client.post("/v1/embeddings", json={"model": "a", "input": ["x"] * 8}).status_code == 200
    # 20 token ids are one tokenized input, not 20 inputs.
    one = client.post("/v1/embeddings", json={"model": "a", "input": list(range(1, 21))})
    assert one.status_code == 200 and len(one.json()["data"]) == 1
    prompts = client.post(
        "/v1/completions", json={"model": "a", "prompt": ["x"] * 4, "max_tokens": 1}
    )
    assert prompts.status_code == 200 and len(prompts.json()["choices"]) == 4
    chat = {"model": "a", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}] * 6}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_a_chat_too_long_for_the_context_is_refused_before_its_template_renders(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rendering and tokenizing a huge chat took seconds only to be refused by the n_ctx
    check then: its contents alone prove it cannot fit (a token is at most the model's
    longest token in bytes)."""
    model = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
    renders: list[int] = []
    original = model._bmodel.apply_chat_template

    def counting(*args: object, **kwargs: object) -> str:
        renders.append(1)
        return str(original(*args, **kwargs))

    monkeypatch.setattr(model._bmodel, "apply_chat_template", counting)
    longest = model._longest_piece()
    n_ctx = model.config.context.n_ctx
    content = "x" * (n_ctx * longest + 1)
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}),
        ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": content}]}),
        ("/v1/responses", {"input": content}),
    ):
        response = client.post(path, json={"model": "a", **body})
        assert response.status_code == 400, response.json()
        assert "context" in str(response.json()), response.json()
    assert renders == []
    # Just under the bound is rendered (and then refused by the token count, as before).
    small = "x" * n_ctx
    response = client.post(
        "/v1/chat/completions",
        json={"model": "a", "messages": [{"role": "user", "content": small}]},
    )
    assert renders and response.status_code == 400


def _chat(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text


def test_a_chat_beside_a_big_embeddings_batch_is_answered_while_the_batch_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 41: /v1/embeddings with 20,000 inputs held a concurrent chat for 168 s (one job
    on the worker for the whole batch); now it is embedded in pieces between ticks, so a chat
    sent once the batch has started is answered before the batch's last input is embedded.
    Counted, not timed: with the batch one job, the chat's answer would come only after all
    400 inputs were embedded."""
    started = threading.Event()
    embedded = [0]
    original = StubContext.embed

    def embed(self: StubContext, tokens: Any, *, normalize: bool = True) -> list[float]:
        started.set()
        out = original(self, tokens, normalize=normalize)
        embedded[0] += 1
        return out

    monkeypatch.setattr(StubContext, "embed", embed)
    settings = stub_settings(models=stub_settings().models[:1], max_body_bytes=1 << 20)
    live = LiveServer(settings).start()
    try:
        model = live.server.config.app.state.kvwarm.entries["a"].model
        model._bmodel.backend.prefill_delay_s = 0.0002  # ~35 tokens an input: 400 inputs ~3 s
        with httpx.Client(base_url=live.base_url, timeout=120) as http:
            inputs = [f"input number {i} of a large batch" for i in range(400)]
            result: dict[str, Any] = {}

            def embed_all() -> None:
                with httpx.Client(base_url=live.base_url, timeout=300) as other:
                    response = other.post("/v1/embeddings", json={"model": "a", "input": inputs})
                    result["status"] = response.status_code
                    result["count"] = len(response.json().get("data", []))

            thread = threading.Thread(target=embed_all)
            thread.start()
            end = time.monotonic() + 60
            while not started.wait(0.05):  # bounded poll: the batch is being embedded
                assert thread.is_alive() and time.monotonic() < end, result
            _chat(http)
            at_answer = embedded[0]
            thread.join(300)
        assert result == {**result, "status": 200, "count": 400}, result
        assert embedded[0] == 400
        assert at_answer < 400, "the chat waited for the whole batch"
    finally:
        live.stop()


def test_a_chat_beside_a_huge_body_is_answered_while_the_body_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body's JSON was decoded and checked on the event loop: 8 MB (the default limit) held
    every other client for ~2 s before any limit could refuse it; now it is decoded and
    checked off the loop. The huge body's decoding is held here until a chat sent beside it
    has its answer: decoded on the loop, it would hold that chat, which then times out."""
    limit = 8 << 20
    entered, answered = threading.Event(), threading.Event()
    original = schemas._decoded

    def decoded(raw: bytes, settings: Any) -> Any:
        if len(raw) > 1 << 20:
            entered.set()
            answered.wait(60)
        return original(raw, settings)

    monkeypatch.setattr(schemas, "_decoded", decoded)
    settings = stub_settings(models=stub_settings().models[:1], max_body_bytes=limit)
    live = LiveServer(settings).start()
    try:
        huge = {"model": "a", "messages": [{"role": "user", "content": "x"}] * 300_000}
        raw = json.dumps(huge).encode()[: limit - 4096]  # as many messages as fit the limit
        raw = raw[: raw.rindex(b"},") + 1] + b"]}"
        with httpx.Client(base_url=live.base_url, timeout=30) as http:
            result: dict[str, Any] = {}

            def hostile() -> None:
                with httpx.Client(base_url=live.base_url, timeout=120) as other:
                    headers = {"content-type": "application/json"}
                    response = other.post("/v1/chat/completions", content=raw, headers=headers)
                    result["status"] = response.status_code

            thread = threading.Thread(target=hostile)
            thread.start()
            assert entered.wait(60), result
            try:
                _chat(http)  # raises ReadTimeout if the loop is held
            finally:
                answered.set()
            thread.join(120)
        assert result == {"status": 400}, result  # past max_chat_messages, once decoded
    finally:
        live.stop()
