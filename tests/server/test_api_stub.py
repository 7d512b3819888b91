"""Shapes and errors of every endpoint, against the deterministic stub backend (fast)."""

from __future__ import annotations

import base64
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvwarm.errors import InvalidRequestError
from kvwarm.server import create_app
from kvwarm.settings import ModelSpec

from .conftest import sse_events, stub_settings, wait_ready

PROMPT = "The quick brown fox jumps over the lazy dog, again and again"


def assert_error(response: object, status: int, code: str | None, param: str | None = None) -> None:
    assert hasattr(response, "status_code") and hasattr(response, "json")
    assert response.status_code == status, response.json()
    body = response.json()
    assert set(body) >= {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == code
    if param is not None:
        assert err["param"] == param


# --- generation ------------------------------------------------------------------------------


def test_completion_shape_usage_and_cache_hit_on_repeat(client: TestClient) -> None:
    body = {"model": "a", "prompt": PROMPT + " one", "max_tokens": 8, "temperature": 0}
    first = client.post("/v1/completions", json=body)
    assert first.status_code == 200, first.json()
    data = first.json()
    assert data["object"] == "text_completion" and data["model"] == "a"
    (choice,) = data["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] <= 8
    second = client.post("/v1/completions", json={**body, "prompt": PROMPT + " two"}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_timings_name_the_finish_saves_row(client: TestClient) -> None:
    """``timings.cache_key``: the row the reply was saved under (what a caller waits for)."""
    keys = []
    for suffix in (" red", " blue"):
        messages = [{"role": "user", "content": PROMPT + suffix}]
        body = {"model": "a", "messages": messages, "max_tokens": 4, "temperature": 0}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        keys.append(response.json()["timings"]["cache_key"])
    assert all(isinstance(k, str) and len(bytes.fromhex(k)) == 32 for k in keys), keys
    assert keys[0] != keys[1]


def test_completion_stream_with_usage(client: TestClient) -> None:
    body = {
        "model": "a",
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.read().decode())
    *chunks, final = events
    assert isinstance(final, dict) and final["choices"] == []
    texts = [c["choices"][0]["text"] for c in chunks if isinstance(c, dict)]
    assert 0 < final["usage"]["completion_tokens"] <= 6
    assert sum(1 for t in texts if t) <= final["usage"]["completion_tokens"]
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    whole = client.post("/v1/completions", json=plain).json()
    assert "".join(texts) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")  # type: ignore[index]
    assert all(c["usage"] is None for c in chunks if isinstance(c, dict))


def test_chat_stream_and_non_stream_agree(client: TestClient) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}]
    body = {"model": "a", "messages": messages, "max_tokens": 10, "temperature": 0}
    plain = client.post("/v1/chat/completions", json=body)
    assert plain.status_code == 200, plain.json()
    data = plain.json()
    assert data["object"] == "chat.completion"
    message = data["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = sse_events(response.read().decode())
    assert all(isinstance(e, dict) and e["object"] == "chat.completion.chunk" for e in events)
    deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict)]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    last = events[-1]
    assert (
        isinstance(last, dict)
        and last["choices"][0]["finish_reason"] == (data["choices"][0]["finish_reason"])
    )


def test_stop_sequence_ends_the_text_before_it(client: TestClient) -> None:
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert len(text) >= 8, text
    stop = text[5:7]
    cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[: text.index(stop)]
    assert cut["finish_reason"] == "stop"


_MESSAGES = [{"role": "user", "content": "hi"}]
#: Every API that takes stop strings: (path, body without them, the field's name there).
_STOPPING = {
    "completions": ("/v1/completions", {"model": "a", "prompt": PROMPT}, "stop"),
    "chat": ("/v1/chat/completions", {"model": "a", "messages": _MESSAGES}, "stop"),
    "infill": ("/infill", {"model": "fim", "input_prefix": "def f(", "input_suffix": "):"}, "stop"),
    "messages": (
        "/v1/messages",
        {"model": "a", "max_tokens": 8, "messages": _MESSAGES},
        "stop_sequences",
    ),
}


@pytest.fixture(scope="module")
def stopping() -> Iterator[TestClient]:
    models = (ModelSpec(path="stub-a", id="a"), ModelSpec(path="stub-fim", id="fim"))
    with TestClient(create_app(stub_settings(models=models))) as test_client:
        wait_ready(test_client.get)
        yield test_client


@pytest.mark.parametrize("api", sorted(_STOPPING))
@pytest.mark.parametrize("stop", [[""], ["ok", ""], ""], ids=["alone", "second", "string"])
def test_an_empty_stop_string_is_a_400_naming_the_field(
    stopping: TestClient, api: str, stop: object
) -> None:
    """An empty stop string was dropped silently (it matches everywhere: the client's
    mistake, never a stop); each API refuses it by its own field's name."""
    client = stopping
    path, body, field = _STOPPING[api]
    if api == "messages" and isinstance(stop, str):
        stop = [stop]  # Anthropic's is a list only
    response = client.post(path, json={**body, "max_tokens": 4, field: stop})
    assert response.status_code == 400, response.json()
    message = response.json()["error"]["message"]
    assert message.startswith(f"{field} must not hold an empty string"), message
    if api != "messages":  # Anthropic's error shape has no param
        assert_error(response, 400, "invalid_value", field)
    # No stop at all (null, an empty list) is still fine.
    for none in (None, []):
        assert client.post(path, json={**body, "max_tokens": 4, field: none}).status_code == 200


def test_seed_makes_sampling_repeatable(client: TestClient) -> None:
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    a = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert a == b


def test_logit_bias_and_ignore_eos(client: TestClient) -> None:
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    z = str(ord("z") + 3)  # the stub's token for the byte "z"
    biased = client.post("/v1/completions", json={**body, "logit_bias": {z: 100}}).json()
    assert biased["choices"][0]["text"] == "zzzz"
    forced = client.post(
        "/v1/completions", json={**body, "max_tokens": 64, "ignore_eos": True}
    ).json()
    assert forced["usage"]["completion_tokens"] == 64
    assert forced["choices"][0]["finish_reason"] == "length"


def test_token_prompts_and_multiple_prompts(client: TestClient) -> None:
    tokens = client.post("/tokenize", json={"model": "a", "content": PROMPT}).json()["tokens"]
    one = client.post("/v1/completions", json={"model": "a", "prompt": tokens, "max_tokens": 3})
    assert one.status_code == 200 and one.json()["usage"]["prompt_tokens"] == len(tokens)
    two = client.post("/v1/completions", json={"model": "a", "prompt": ["x y z", "a b c"]})
    assert [c["index"] for c in two.json()["choices"]] == [0, 1]


def test_forced_output_becomes_a_tool_call(client: TestClient) -> None:
    # The stub enforces literal grammars; that stands in for a model that answers with a call.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    grammar = "root ::= " + '"' + call.replace('"', '\\"') + '"'
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [tool],
        "grammar": grammar,
        "max_tokens": 200,
    }
    data = client.post("/v1/chat/completions", json=body).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls", data
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = sse_events(response.read().decode())
    deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict)]
    assert not "".join(d.get("content") or "" for d in deltas)  # the call is not shown as text
    streamed = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert streamed[0][0]["function"]["name"] == "get_weather"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"  # type: ignore[index]


def test_logprobs_in_chat_and_completions(client: TestClient) -> None:
    chat = {
        "model": "a",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    choice = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) >= 1 and all(c["logprob"] <= 0 for c in content)
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) >= 1
    assert lp["text_offset"][0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_an_echoed_special_token_has_its_text(client: TestClient, stream: bool) -> None:
    """Found by review: with echo and logprobs, a special token the prompt's text holds
    ("</s>" here) had the token text "", so the tokens no longer joined to the echoed text and
    each later text_offset fell short; the BOS the tokenizer adds stays "" (no text has it)."""
    prompt = "ab</s>cd"
    body = {"model": "a", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    body |= {"echo": True, "logprobs": 1, "stream": stream}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [c["choices"][0] for c in sse_events(response.text) if c.get("choices")]
        text = "".join(c["text"] for c in chunks)
        tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    else:
        choice = response.json()["choices"][0]
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
        offsets = choice["logprobs"]["text_offset"]
    assert text.startswith(prompt)
    assert tokens[:6] == ["", "a", "b", "</s>", "c", "d"]
    assert "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_response_formats_compile(client: TestClient) -> None:
    # The stub does not enforce JSON grammars; this checks the schema -> grammar plumbing.
    base = {"model": "a", "messages": [{"role": "user", "content": "JSON!"}], "max_tokens": 4}
    obj = client.post(
        "/v1/chat/completions", json={**base, "response_format": {"type": "json_object"}}
    )
    assert obj.status_code == 200, obj.json()
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert (
        client.post("/v1/chat/completions", json={**base, "response_format": fmt}).status_code
        == 200
    )
    missing = {"type": "json_schema", "json_schema": {"name": "x"}}
    response = client.post("/v1/chat/completions", json={**base, "response_format": missing})
    assert_error(response, 400, "invalid_value", "response_format.json_schema")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "http://x/y"}}}
    assert_error(
        client.post("/v1/chat/completions", json={**base, "response_format": bad}),
        400,
        "invalid_grammar",
    )


# --- other endpoints -------------------------------------------------------------------------


def test_models_health_tokenize_detokenize(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["a", "b"]
    assert all(m["object"] == "model" and m["status"] == "ready" for m in models["data"])
    assert client.get("/health").json()["status"] == "ok"
    head = client.head("/health")  # a load balancer's health check
    assert head.status_code == 200 and head.content == b""
    tokens = client.post("/tokenize", json={"model": "b", "content": "hey"}).json()["tokens"]
    assert client.post("/detokenize", json={"model": "b", "tokens": tokens}).json()["content"] == (
        "hey"
    )
    pieces = client.post("/tokenize", json={"content": "hey", "with_pieces": True}).json()
    assert [p["piece"] for p in pieces["tokens"]][-3:] == ["h", "e", "y"]
    # As llama-server: a special token's piece is its text, and a piece that is not UTF-8
    # alone is its bytes' values (found by review: "" and U+FFFD, each token detokenized).
    pieces = client.post("/tokenize", json={"content": "é", "with_pieces": True}).json()
    assert pieces["tokens"][1:] == [{"id": 198, "piece": [0xC3]}, {"id": 172, "piece": [0xA9]}]
    assert pieces["tokens"][0]["piece"] == "<s>"


def test_tokenize_answers_at_most_the_models_context(client: TestClient) -> None:
    """Found by review: ``/tokenize`` had no bound, so an 8 MB body answered millions of
    tokens (hundreds of MB of RSS). It answers at most the model's context, as a prompt."""
    (meta,) = [m["meta"] for m in client.get("/v1/models").json()["data"] if m["id"] == "a"]
    n_ctx = meta["n_ctx"]
    fits = client.post("/tokenize", json={"model": "a", "content": "x" * (n_ctx - 1)})
    assert len(fits.json()["tokens"]) == n_ctx  # BOS and one token a byte
    for pieces in (False, True):
        body = {"model": "a", "content": "x" * n_ctx, "with_pieces": pieces}
        over = client.post("/tokenize", json=body)
        assert_error(over, 400, "context_length_exceeded", "content")
        assert f"content has {n_ctx + 1} tokens" in over.json()["error"]["message"]


def test_embeddings_float_and_base64(client: TestClient) -> None:
    body = {"model": "a", "input": ["first", "second"]}
    data = client.post("/v1/embeddings", json=body).json()
    assert [d["index"] for d in data["data"]] == [0, 1]
    vector = data["data"][0]["embedding"]
    assert len(vector) == 16 and all(isinstance(x, float) for x in vector)
    assert data["usage"]["prompt_tokens"] > 0
    b64 = client.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert struct.unpack(f"<{len(raw) // 4}f", raw) == pytest.approx(vector, rel=1e-6)


def test_metrics_parse_and_count(client: TestClient) -> None:
    client.post("/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 2})
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    names = {s.name for f in text_string_to_metric_families(response.text) for s in f.samples}
    for expected in (
        "kvwarm_model_queue_depth",
        "kvwarm_requests_total",
        "kvwarm_prompt_tokens_total",
        "kvwarm_cached_tokens_total",
        "kvwarm_completion_tokens_total",
        "kvwarm_prefill_seconds_total",
        "kvwarm_decode_seconds_total",
        "kvwarm_http_requests_total",
        "kvwarm_cache_tier_bytes",
        "kvwarm_cache_tier_rows",
        "kvwarm_model_free_slots",
        "kvwarm_model_kv_cells",
        "kvwarm_model_kv_cache_usage_ratio",
    ):
        assert expected in names, expected
    # The finished request's slot keeps its KV (for the next turn): cells in use, a slot free.
    values = {
        (s.name, s.labels.get("model")): s.value
        for f in text_string_to_metric_families(response.text)
        for s in f.samples
    }
    assert values[("kvwarm_model_kv_cells_used", "a")] > 0
    # n_ctx for each slot: the context's cells (found by review: one slot's n_ctx).
    assert values[("kvwarm_model_kv_cells", "a")] == 1024 * values[("kvwarm_model_slots", "a")]
    assert values[("kvwarm_model_free_slots", "a")] == values[("kvwarm_model_slots", "a")]


def test_cache_admin(client: TestClient) -> None:
    system = "You are a careful assistant who answers in one short sentence."
    warm = client.post(
        "/cache/prewarm",
        json={"model": "a", "messages": [{"role": "system", "content": system}]},
    )
    assert warm.status_code == 200, warm.json()
    assert warm.json()["prompt_tokens"] > 16 and warm.json()["keep_alive"] is True
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]
    body = {"model": "a", "messages": messages, "max_tokens": 2}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= warm.json()["prompt_tokens"] - 16
    stats = client.get("/cache/stats").json()
    assert stats["rows"] > 0 and stats["keep_alive"][0]["model"] == "a"
    rows = client.get("/cache/rows?limit=2").json()["data"]
    assert 0 < len(rows) <= 2 and {"key", "tier", "n_tokens", "bytes"} <= set(rows[0])
    assert client.post("/cache/verify").json()["bad"] == []
    assert set(client.post("/cache/gc").json()) == {"rows", "bytes"}
    evicted = client.post("/cache/evict", json={"bytes": 1 << 40}).json()
    assert evicted["rows"] >= 1
    assert client.get("/cache/stats").json()["rows"] == 0


# --- errors ----------------------------------------------------------------------------------


def test_a_request_without_model_uses_the_first_configured_one(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert response.status_code == 200 and response.json()["model"] == "a"


def test_unknown_model_is_404(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert_error(response, 404, "model_not_found", "model")


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": "a", "prompt": "x", "max_tokens": "many"}, "invalid_type", "max_tokens"),
        ({"model": "a", "prompt": 12.5}, "invalid_type", "prompt"),
        ({"model": "a"}, "invalid_type", "prompt"),
        ({"model": "a", "prompt": "x", "temperature": -1}, "invalid_value", "temperature"),
        ({"model": "a", "prompt": "x", "n": 9}, "invalid_value", "n"),  # > n_parallel
        # Out of range, as 9 is (server.md's errors: invalid_type is a wrong JSON type; these
        # were invalid_type, found by the docs run).
        ({"model": "a", "prompt": "x", "n": 0}, "invalid_value", "n"),
        # best_of: candidates the n are chosen from (OpenAI's rules), bounded as n is.
        ({"model": "a", "prompt": "x", "n": 3, "best_of": 2}, "invalid_value", "best_of"),
        ({"model": "a", "prompt": "x", "best_of": 2, "stream": True}, "invalid_value", "best_of"),
        ({"model": "a", "prompt": "x", "best_of": 9}, "invalid_value", "best_of"),  # n_parallel
        ({"model": "a", "prompt": "x", "best_of": 65}, "invalid_value", "best_of"),
        ({"model": "a", "prompt": "x", "best_of": 0}, "invalid_value", "best_of"),
        ({"model": "a", "prompt": "x", "grammar": "no root here"}, "invalid_grammar", None),
        ({"model": "a", "prompt": []}, None, "prompt"),
        ({"model": "a", "prompt": "x", "typical_p": 1.5}, "invalid_value", "typical_p"),
        ({"model": "a", "prompt": "x", "logit_bias": {"abc": 1}}, None, "logit_bias"),
        ({"model": "a", "prompt": "x", "logit_bias": {"5": 500}}, None, "logit_bias"),
        ({"model": "a", "prompt": "x", "logit_bias": {"99999999": 1}}, None, "logit_bias"),
        # Python's int() read these as token ids 10, 7 and 3 (found by review).
        ({"model": "a", "prompt": "x", "logit_bias": {"1_0": 1}}, None, "logit_bias"),
        ({"model": "a", "prompt": "x", "logit_bias": {" 7 ": 1}}, None, "logit_bias"),
        ({"model": "a", "prompt": "x", "logit_bias": {"\u0663": 1}}, None, "logit_bias"),
        ({"model": "a", "prompt": "x", "logit_bias": {"-1": 1}}, None, "logit_bias"),
        (
            {"model": "a", "prompt": "x", "logit_bias": {"99999999999999999999": 1}},
            None,
            "logit_bias",
        ),
    ],
)
def test_bad_completion_requests_are_400(
    client: TestClient, body: dict[str, object], code: str | None, param: str | None
) -> None:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.json()
    if code is not None:
        assert_error(response, 400, code, param)


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "temperature", True),
        ("/v1/completions", "temperature", "0.5"),
        ("/v1/completions", "top_p", "1"),
        ("/v1/completions", "top_k", True),
        ("/v1/completions", "max_tokens", True),
        ("/v1/completions", "max_tokens", "3"),
        ("/v1/completions", "seed", "7"),
        ("/v1/completions", "n", True),
        ("/v1/completions", "logprobs", True),
        ("/v1/completions", "presence_penalty", False),
        ("/v1/completions", "typical_p", "0.5"),
        ("/v1/completions", "logit_bias", {"5": True}),
        ("/v1/chat/completions", "top_logprobs", True),
        ("/v1/chat/completions", "max_completion_tokens", "4"),
        ("/v1/chat/completions", "frequency_penalty", "0.5"),
        ("/v1/messages", "temperature", True),
        ("/v1/messages", "top_k", "5"),
        ("/v1/messages", "max_tokens", True),
        ("/v1/responses", "temperature", "1"),
        ("/v1/responses", "max_output_tokens", True),
    ],
)
def test_sampling_numbers_are_json_numbers(
    client: TestClient, path: str, field: str, value: object
) -> None:
    # pydantic's lax types read "temperature": true as 1.0, "0.5" as 0.5, "top_k": true as
    # 1, "max_tokens": "3" as 3: a known field of the wrong type is a 400 naming it (this
    # module's invariant; found by review).
    text = {"model": "a", "max_tokens": 2, "temperature": 0}
    bodies: dict[str, dict[str, object]] = {
        "/v1/completions": {**text, "prompt": "x"},
        "/v1/chat/completions": {**text, "messages": [{"role": "user", "content": "x"}]},
        "/v1/messages": {**text, "messages": [{"role": "user", "content": "x"}]},
        "/v1/responses": {"model": "a", "input": "x", "max_output_tokens": 2, "temperature": 0},
    }
    body = bodies[path]
    if field == "top_logprobs":
        body = {**body, "logprobs": True}
    assert client.post(path, json=body).status_code == 200
    response = client.post(path, json={**body, field: value})
    assert response.status_code == 400, response.json()
    assert field in str(response.json())
    if field in ("max_tokens", "top_k", "n", "seed"):  # an integral float is still taken
        assert client.post(path, json={**body, field: 2.0}).status_code == 200


def test_bad_chat_requests_are_400(client: TestClient) -> None:
    assert_error(
        client.post("/v1/chat/completions", json={"model": "a", "messages": []}),
        400,
        "invalid_value",
        "messages",
    )
    bad_role = {"model": "a", "messages": [{"role": "wizard", "content": "x"}]}
    assert_error(client.post("/v1/chat/completions", json=bad_role), 400, "invalid_value")
    number_role = {"model": "a", "messages": [{"role": 7, "content": "x"}]}
    assert_error(client.post("/v1/chat/completions", json=number_role), 400, "invalid_type")
    image = {"model": "a", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert_error(client.post("/v1/chat/completions", json=image), 400, "invalid_value")
    video = {"model": "a", "messages": [{"role": "user", "content": [{"type": "video_url"}]}]}
    assert_error(client.post("/v1/chat/completions", json=video), 400, "unsupported_content")
    # A forced call with no tools could not be honoured: refused, as OpenAI does, not ignored.
    hi = [{"role": "user", "content": "hi"}]
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", named):
        forced = {"model": "a", "messages": hi, "tool_choice": choice}
        forced_reply = client.post("/v1/chat/completions", json=forced)
        assert_error(forced_reply, 400, "invalid_value", "tool_choice")
    no_logprobs = {"model": "a", "messages": hi, "top_logprobs": 2}  # top_logprobs needs them
    no_top = client.post("/v1/chat/completions", json=no_logprobs)
    assert_error(no_top, 400, "invalid_value", "top_logprobs")
    for choice in ("none", "auto"):  # these need no tools
        free = {"model": "a", "messages": hi, "tool_choice": choice, "max_tokens": 1}
        assert client.post("/v1/chat/completions", json=free).status_code == 200
    # OpenAI's deprecated function calling is refused by name, not ignored (no call came).
    function = {"name": "f", "parameters": {"type": "object"}}
    for legacy, value in (("functions", [function]), ("function_call", {"name": "f"})):
        old_style = {"model": "a", "messages": hi, legacy: value}
        old_reply = client.post("/v1/chat/completions", json=old_style)
        assert_error(old_reply, 400, "unsupported_parameter", legacy)
    # best_of belongs to the legacy completions API (as at OpenAI): refused, not ignored.
    best = {"model": "a", "messages": hi, "n": 1, "best_of": 3}
    best_reply = client.post("/v1/chat/completions", json=best)
    assert_error(best_reply, 400, "unsupported_parameter", "best_of")


def test_the_end_user_a_request_names_is_in_its_log_line(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """OpenAI's ``user`` (and Anthropic's ``metadata.user_id``) was accepted and went nowhere;
    it is what lets an operator tell whose requests these were. Quoted as JSON, cut to 64
    characters: a newline in it cannot forge a log line."""
    hi = [{"role": "user", "content": "hi"}]
    bodies = [
        ("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 1, "user": "ann\nfake"}),
        ("/v1/chat/completions", {"model": "a", "messages": hi, "max_tokens": 1, "user": "bo"}),
        (
            "/v1/messages",
            {"model": "a", "messages": hi, "max_tokens": 1, "metadata": {"user_id": "cy"}},
        ),
        ("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 1, "user": "d" * 100}),
    ]
    for path, body in bodies:
        with caplog.at_level(logging.INFO, logger="kvwarm.server.requests"):
            caplog.clear()
            assert client.post(path, json=body).status_code == 200
        (line,) = [r.getMessage() for r in caplog.records if r.name == "kvwarm.server.requests"]
        assert "\n" not in line
        said = body.get("user") or "cy"
        assert isinstance(said, str)
        assert line.endswith(' user="' + said[:64].replace("\n", "\\n") + '"'), line
    with caplog.at_level(logging.INFO, logger="kvwarm.server.requests"):
        caplog.clear()
        client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
    assert "user=" not in caplog.records[-1].getMessage()


def test_stream_options_need_a_stream(client: TestClient) -> None:
    """As OpenAI: without ``stream`` the usage chunk they ask for would never come."""
    options = {"include_usage": True}
    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    plain = {"model": "a", "prompt": "x", "max_tokens": 1}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", plain)):
        refused = client.post(path, json={**body, "stream_options": options})
        assert_error(refused, 400, "invalid_value", "stream_options")
        with client.stream(
            "POST", path, json={**body, "stream": True, "stream_options": options}
        ) as r:
            assert r.status_code == 200 and '"usage"' in "".join(r.iter_text())


def test_malformed_json_and_non_objects(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    assert_error(
        client.post("/v1/completions", content=b"{nope", headers=headers), 400, "invalid_json"
    )
    assert_error(client.post("/v1/completions", content=b"", headers=headers), 400, "invalid_json")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400, "invalid_json")
    assert_error(
        client.post("/v1/completions", content=b"\xff\xfe", headers=headers), 400, "invalid_json"
    )


def test_unknown_fields_are_ignored(client: TestClient) -> None:
    body = {
        "model": "a",
        "prompt": "x",
        "max_tokens": 1,
        "frobnicate": {"deep": [1]},
        "logit_bias": {"1": 2},
        "user": "u",
    }
    assert client.post("/v1/completions", json=body).status_code == 200


def test_over_long_prompt_is_context_length_exceeded(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "b", "prompt": "x" * 400})
    assert_error(response, 400, "context_length_exceeded", "prompt")
    # Each API names the field that holds its prompt (found by review: chat and Responses
    # named "prompt", a field neither request has; OpenAI's names "messages" there).
    chat = {"model": "b", "messages": [{"role": "user", "content": "y" * 400}]}
    for streamed in (False, True):
        over = client.post("/v1/chat/completions", json=chat | {"stream": streamed})
        assert_error(over, 400, "context_length_exceeded", "messages")
    over = client.post("/v1/responses", json={"model": "b", "input": "y" * 400, "stream": True})
    assert_error(over, 400, "context_length_exceeded", "input")


def test_oversized_bodies_are_413(client: TestClient) -> None:
    big = {"model": "a", "prompt": "x" * (70 << 10)}
    assert_error(client.post("/v1/completions", json=big), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no content-length: the limit applies while reading
        yield b'{"model": "a", "prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    response = client.post("/v1/completions", content=chunks())
    assert_error(response, 413, "request_too_large")


def test_unknown_routes_and_methods_have_the_error_shape(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404, "not_found")
    assert_error(client.get("/v1/completions"), 405, "method_not_allowed")


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/completions", "POST"),
        ("PUT", "/v1/messages", "POST"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("POST", "/v1/responses/resp_x", "GET, HEAD, DELETE"),
        ("PATCH", "/cache/keepalive", "GET, HEAD, DELETE"),
        ("GET", "/v1/responses/resp_x/cancel", "POST"),
    ],
)
def test_a_405_says_which_methods_the_route_takes(
    client: TestClient, method: str, path: str, allow: str
) -> None:
    """RFC 9110 (15.5.6): a 405 names the methods the resource takes in ``Allow``. Found by
    review: the error handler rebuilt Starlette's 405 in the API's shape and dropped its
    headers, ``Allow`` with them. Every route of the path counts (``GET`` and ``DELETE
    /v1/responses/{id}`` are two), and HEAD is named wherever GET is (``test_head_stub``)."""
    response = client.request(method, path)
    assert response.status_code == 405
    assert sorted(response.headers["allow"].split(", ")) == sorted(allow.split(", "))


def test_health_is_503_while_loading_and_when_a_load_failed() -> None:
    # Without entering the client the lifespan never runs: every model is still "loading".
    loading = TestClient(create_app(stub_settings()))
    response = loading.get("/health")
    assert_error(response, 503, "model_loading")
    assert response.json()["status"] == "loading"
    assert_error(
        loading.post("/v1/completions", json={"model": "a", "prompt": "x"}), 503, "model_loading"
    )
    settings = stub_settings(
        backend="llama_cpp", models=(ModelSpec(path="/nonexistent/model.gguf", id="gone"),)
    )
    with TestClient(create_app(settings)) as broken:
        with pytest.raises(AssertionError, match="failed to load"):
            wait_ready(broken.get)
        assert_error(broken.get("/health"), 503, "model_load_failed")
        assert_error(
            broken.post("/v1/completions", json={"model": "gone", "prompt": "x"}),
            503,
            "model_load_failed",
        )


def test_system_prompts_are_prewarmed_at_startup_and_kept_alive() -> None:
    system = "You are the startup assistant; keep every answer short and friendly."
    with TestClient(create_app(stub_settings(prewarm_system=(system,)))) as warm:
        wait_ready(warm.get)
        # Ready once every prompt is prewarmed; their rows may still be being written.
        assert warm.app.state.kvwarm.require_engine().cache.flush()
        stats = warm.get("/cache/stats").json()
        assert sorted(e["model"] for e in stats["keep_alive"]) == ["a", "b"]
        assert stats["rows"] >= 2
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        body = {"model": "a", "messages": messages, "max_tokens": 1}
        usage = warm.post("/v1/chat/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 32


def test_api_key_is_required_when_configured() -> None:
    with TestClient(create_app(stub_settings(api_key="sesame"))) as secured:
        wait_ready(secured.get)  # /health stays open for probes
        assert_error(secured.get("/v1/models"), 401, "invalid_api_key")
        ok = secured.get("/v1/models", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200


def test_evict_with_a_repeated_tier_forgets_no_file(tmp_path: Path) -> None:
    settings = stub_settings(cache_dir=tmp_path, save_tier="disk")
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        assert c.post("/v1/completions", json=body).status_code == 200
        c.app.state.kvwarm.require_engine().cache.flush()
        rows = c.get("/cache/stats").json()["rows"]
        assert rows >= 1 and len(list(tmp_path.rglob("*.kvc"))) == rows
        evicted = c.post("/cache/evict", json={"bytes": 1 << 40, "tiers": ["disk", "disk"]})
        assert evicted.status_code == 200, evicted.json()
        assert evicted.json()["rows"] == rows
        assert c.get("/cache/stats").json()["rows"] == 0
        assert not list(tmp_path.rglob("*.kvc"))


def test_evict_from_a_tier_not_configured_is_a_400(client: TestClient) -> None:
    """A typo'd tier freed nothing and answered 200 with 0 rows (found by review)."""
    response = client.post("/cache/evict", json={"bytes": 1 << 40, "tiers": ["ram", "dsik"]})
    assert_error(response, 400, "invalid_value", "tiers")
    assert "'dsik'" in response.json()["error"]["message"]


def test_evict_from_an_empty_list_of_tiers_is_a_400(client: TestClient) -> None:
    """An empty ``tiers`` evicted nothing and answered 200 with 0 rows (found by review), as
    a typo'd tier did; the library's ``evict_bytes`` refuses it too."""
    response = client.post("/cache/evict", json={"bytes": 1 << 40, "tiers": []})
    assert_error(response, 400, "invalid_value", "tiers")  # as a typo'd tier's
    cache = client.app.state.kvwarm.require_engine().cache
    with pytest.raises(InvalidRequestError, match="tiers is empty"):
        cache.evict_bytes(1 << 40, [])


# 0 too: it meant "no rows" here and "all rows" in `kvwarm cache ls`; both refuse it now.
@pytest.mark.parametrize(
    ("limit", "code"),
    [
        ("\u00b2", "invalid_type"),
        ("9" * 5000, "invalid_type"),
        ("abc", "invalid_type"),
        ("-1", "invalid_value"),
        ("0", "invalid_value"),
    ],
)
def test_cache_rows_bad_limit_is_a_400_naming_it(client: TestClient, limit: str, code: str) -> None:
    assert_error(client.get("/cache/rows", params={"limit": limit}), 400, code, "limit")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "hi", "max_tokens": 2, "seed": ' + "9" * 5000 + "}", None),
        ('{"prompt": "hi", "max_tokens": 2, "top_k": ' + str(10**30) + "}", "top_k"),
        ('{"prompt": "hi", "max_tokens": 2, "seed": ' + str(10**30) + "}", "seed"),
        (
            '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"' + str(10**30) + '": 1}}',
            "logit_bias",
        ),
    ],
)
def test_huge_integers_in_bodies_are_400s(client: TestClient, body: str, param: str | None) -> None:
    response = client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_negative_seed_is_accepted(client: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "seed": -1}
    assert client.post("/v1/completions", json=body).status_code == 200
