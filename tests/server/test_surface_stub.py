"""The OpenAI surface through the official ``openai`` client and plain HTTP against a live,
stub-backed server: the parts whose behaviour does not depend on a real model (the embedded
model's versions are in ``test_live_openai_surface.py``)."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator

import httpx
import openai
import pydantic
import pytest
from anthropic import Anthropic
from anthropic.types import message_count_tokens_params as count_params
from anthropic.types import message_create_params as message_params
from openai import OpenAI
from openai.types.chat import ChatCompletionChunk
from openai.types.chat import completion_create_params as chat_params
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall
from openai.types.responses import response_create_params as response_params

from kvwarm.settings import ModelSpec

from .conftest import LiveServer, stub_settings

ORIGIN = "http://app.example:3000"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    models = (ModelSpec(path="stub-a", id="a"), ModelSpec(path="stub-fim", id="coder"))
    settings = stub_settings(allowed_origins=(ORIGIN,), api_key=KEY, models=models)
    server = LiveServer(settings).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> OpenAI:
    return OpenAI(base_url=live.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=60) as c:
        yield c


PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Tell me about caches"}]
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "seed": 11}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


# --- max_completion_tokens, models -----------------------------------------------------------


def test_max_completion_tokens_wins_over_max_tokens(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Write a long story about caches"}]
    done = client.chat.completions.create(
        model="a",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert done.usage is not None and done.usage.completion_tokens == 3
    assert done.choices[0].finish_reason == "length"
    other = client.chat.completions.create(
        model="a",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert other.usage is not None and other.usage.completion_tokens == 5


def test_retrieve_model_and_unknown_is_openai_404(client: OpenAI) -> None:
    model = client.models.retrieve("coder")
    assert model.id == "coder" and model.object == "model" and model.owned_by == "kvwarm"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found" and body["param"] == "model"


def test_null_optional_fields_mean_their_defaults(client: OpenAI, http: httpx.Client) -> None:
    # OpenAI's spec declares these nullable and the SDK sends null for a None argument: each
    # was a 400 ("n: Input should be a valid integer") before.
    chat = client.chat.completions.create(
        model="a",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=2,
        n=None,
        stream=None,
        extra_body={"parallel_tool_calls": None},
    )
    assert len(chat.choices) == 1 and chat.choices[0].message.content is not None
    text = client.completions.create(
        model="a", prompt=PROMPT, max_tokens=2, n=None, echo=None, stream=None
    )
    assert len(text.choices) == 1 and not text.choices[0].text.startswith(PROMPT)
    resp = client.responses.create(
        model="a",
        input="hi",
        max_output_tokens=2,
        store=None,
        stream=None,
        parallel_tool_calls=None,
    )
    assert resp.parallel_tool_calls is True
    typed_null = client.responses.create(
        model="a",
        input=[{"type": None, "role": "user", "content": "hi"}],  # type: ignore[list-item]
        max_output_tokens=2,
    )
    assert typed_null.status in ("incomplete", "completed")  # served: no 400
    assert client.responses.retrieve(resp.id).id == resp.id  # store's default: stored
    body = {"model": "a", "input": "hi", "encoding_format": None}
    embedded = http.post("/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert embedded.status_code == 200, embedded.text
    assert isinstance(embedded.json()["data"][0]["embedding"], list)  # the default: floats
    # A required field stays required.
    missing = http.post(
        "/v1/chat/completions",
        json={"model": "a", "messages": None},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"


def _nullable(params: type) -> list[str]:
    """The fields of an SDK's request TypedDict that its API declares nullable (``Optional``,
    or a union with ``None``: the SDKs are generated from each API's OpenAPI spec)."""
    hints = typing.get_type_hints(params)
    return sorted(name for name, hint in hints.items() if type(None) in _union_args(hint))


def _union_args(hint: object) -> tuple[object, ...]:
    while typing.get_origin(hint) in (typing.Required, typing.NotRequired):
        hint = typing.get_args(hint)[0]
    return (
        typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    )


@pytest.mark.parametrize(
    ("path", "params", "body"),
    [
        (
            "/v1/chat/completions",
            chat_params.CompletionCreateParamsNonStreaming,
            {"messages": MESSAGES},
        ),
        ("/v1/responses", response_params.ResponseCreateParamsNonStreaming, {"input": "hi"}),
        ("/v1/messages", message_params.MessageCreateParamsNonStreaming, {"messages": MESSAGES}),
        (
            "/v1/messages/count_tokens",
            count_params.MessageCountTokensParams,
            {"messages": MESSAGES},
        ),
    ],
)
def test_every_field_the_official_api_declares_nullable_takes_null(
    http: httpx.Client, path: str, params: type, body: dict[str, object]
) -> None:
    """``null`` is "not given" for each field the official SDK's types (OpenAI's, Anthropic's)
    mark nullable, read from those types rather than listed here. The legacy completions'
    ``prompt`` is left out: its null means OpenAI's ``<|endoftext|>`` document start, which
    kvwarm refuses as a missing prompt (server.md)."""
    nullable = _nullable(params)
    assert nullable  # the types were read
    headers = {"Authorization": f"Bearer {KEY}"}
    base = {"model": "a", "max_tokens": 2, "max_output_tokens": 2, **body}
    for name in nullable:
        response = http.post(path, json={**base, name: None}, headers=headers)
        assert response.status_code == 200, (name, response.text)


def test_a_null_anthropic_refuses_is_a_400(http: httpx.Client) -> None:
    """Anthropic's ``stream`` is no nullable field (``Literal[False]`` in its SDK's types, a
    boolean in its API's spec), so ``"stream": null`` is a 400 there as at Anthropic."""
    assert "stream" not in _nullable(message_params.MessageCreateParamsNonStreaming)
    body = {"model": "a", "max_tokens": 2, "messages": MESSAGES, "stream": None}
    response = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert response.status_code == 400, response.text
    assert "stream" in response.json()["error"]["message"]


def test_an_assistant_refusal_part_is_its_text(client: OpenAI) -> None:
    # OpenAI's assistant content holds text and refusal parts; a refusal part was a 400
    # ("content part of type 'refusal' is not supported").
    def reply_to(assistant: list[dict[str, str]]) -> str | None:
        done = client.chat.completions.create(
            model="a",
            messages=[
                {"role": "user", "content": "Tell me a secret"},
                {"role": "assistant", "content": assistant},  # type: ignore[typeddict-item]
                {"role": "user", "content": "Why not?"},
            ],
            max_tokens=4,
            temperature=0,
        )
        return done.choices[0].message.content

    refused = reply_to(
        [{"type": "text", "text": "No: "}, {"type": "refusal", "refusal": "I can't share that."}]
    )
    assert refused == reply_to([{"type": "text", "text": "No: I can't share that."}])


def test_an_assistant_messages_refusal_is_its_text(client: OpenAI) -> None:
    # OpenAI's reply to a refused request is {"content": null, "refusal": "..."}; a client
    # replaying it (the SDK's message, dumped) sent a history whose assistant turn was empty,
    # the refusal dropped as an unknown field.
    def prompt_and_reply(assistant: dict[str, object]) -> tuple[int, str | None]:
        done = client.chat.completions.create(
            model="a",
            messages=[
                {"role": "user", "content": "Tell me a secret"},
                {"role": "assistant", **assistant},  # type: ignore[list-item]
                {"role": "user", "content": "Why not?"},
            ],
            max_tokens=4,
            temperature=0,
        )
        assert done.usage is not None
        return done.usage.prompt_tokens, done.choices[0].message.content

    said = "I can't share that."
    refused = prompt_and_reply({"content": None, "refusal": said})
    assert refused == prompt_and_reply({"content": said})
    assert prompt_and_reply({"content": "No: ", "refusal": said}) == prompt_and_reply(
        {"content": "No: " + said}
    )


def test_a_text_part_without_text_is_named_as_such(client: OpenAI) -> None:
    # It was "content part of type 'text' is not supported (text, image_url or input_audio)".
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="a",
            messages=[{"role": "user", "content": [{"type": "text"}]}],  # type: ignore[list-item]
            max_tokens=1,
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "messages.0.content.0"
    assert error["code"] == "invalid_value"
    assert "needs text" in error["message"]


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/apply-template"])
def test_a_message_without_content_is_a_400(http: httpx.Client, role: str, path: str) -> None:
    # Found by review: a user message with content null, or none, was rendered as an empty
    # turn; OpenAI's API requires the content of every message but an assistant's.
    auth = {"Authorization": f"Bearer {KEY}"}
    extra = {"tool_call_id": "c1"} if role == "tool" else {}
    for message in ({"role": role, **extra}, {"role": role, "content": None, **extra}):
        messages = [*MESSAGES, message] if role == "tool" else [message, *MESSAGES]
        body = {"model": "a", "max_tokens": 1, "messages": messages}
        response = http.post(path, json=body, headers=auth)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == f"messages.{messages.index(message)}.content"
        assert error["code"] == "invalid_type" and role in error["message"]
    # An assistant's turn of calls alone, or of a refusal, has none.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calls = {"role": "assistant", "content": None, "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "done"}
    body = {"model": "a", "max_tokens": 1, "messages": [*MESSAGES, calls, result]}
    assert http.post(path, json=body, headers=auth).status_code == 200


def test_audio_output_is_refused_not_ignored(client: OpenAI) -> None:
    # kvwarm writes text only: a request for audio output (modalities "audio", the audio
    # parameter) got a text reply whose message.audio was null, without a word.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="a",
            messages=MESSAGES,  # type: ignore[arg-type]
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
            max_tokens=1,
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "modalities"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="a",
            messages=MESSAGES,  # type: ignore[arg-type]
            audio={"voice": "alloy", "format": "wav"},
            max_tokens=1,
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "audio"
    text = client.chat.completions.create(
        model="a",
        messages=MESSAGES,  # type: ignore[arg-type]
        modalities=["text"],
        max_tokens=1,
    )
    assert text.choices[0].message.audio is None


def test_moderation_is_refused_not_ignored(client: OpenAI) -> None:
    # OpenAI's moderation (chat and Responses): a moderation model's scores on the input and
    # output, a policy of "block" withholding what it flags. kvwarm runs none: the request
    # was served unmoderated, its policy ignored and the reply's moderation null, without a
    # word. null asks for none and passes.
    moderation = {"model": "omni-moderation-latest", "policy": {"output": {"mode": "block"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="a",
            messages=MESSAGES,  # type: ignore[arg-type]
            moderation=moderation,  # type: ignore[arg-type]
            max_tokens=1,
        )
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "moderation"
    assert caught.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="a",
            input="hi",
            moderation=moderation,  # type: ignore[arg-type]
            max_output_tokens=1,
            store=False,
        )
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "moderation"
    assert caught.value.body["code"] == "unsupported_parameter"
    unmoderated = client.chat.completions.create(
        model="a",
        messages=MESSAGES,  # type: ignore[arg-type]
        moderation=None,
        max_tokens=1,
    )
    assert unmoderated.moderation is None


def test_top_p_zero_is_in_range_and_keeps_the_likeliest_token(
    client: OpenAI, live: LiveServer
) -> None:
    # OpenAI's, Anthropic's and the Responses API's top_p range is [0, 1]; 0 was a 400
    # ("top_p must be in (0, 1]"). It keeps the likeliest token: the greedy reply.
    def chat(**sampling: float) -> str | None:
        done = client.chat.completions.create(
            model="a",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=5,
            seed=3,
            **sampling,  # type: ignore[arg-type]
        )
        return done.choices[0].message.content

    assert chat(temperature=1.0, top_p=0) == chat(temperature=0)
    resp = client.responses.create(model="a", input="hi", max_output_tokens=2, top_p=0)
    assert resp.status == "incomplete" and resp.top_p == 0
    claude = Anthropic(base_url=live.base_url, api_key=KEY, max_retries=0)
    message = claude.messages.create(
        model="a",
        max_tokens=2,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"top_p": 0},  # this SDK has no sampling arguments any more
    )
    assert message.stop_reason == "max_tokens"


# --- keys, CORS, docs ------------------------------------------------------------------------


def test_x_api_key_header_is_accepted(http: httpx.Client) -> None:
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
    assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
    bearer = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200


def test_cors_preflight_and_headers_for_an_allowed_origin(http: httpx.Client) -> None:
    preflight = http.options(
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-api-key,authorization",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert "x-api-key" in allowed and "authorization" in allowed
    ok = http.get("/v1/models", headers={"Origin": ORIGIN, "x-api-key": KEY})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    # A refusal is readable by the allowed page too: it carries the CORS header.
    refused = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN


# What the official JS clients send from a browser (openai-node's and anthropic-sdk-typescript's
# platform headers, and Anthropic's browser opt-in): a preflight naming them was a 400.
JS_CLIENT_HEADERS = (
    "authorization,content-type,x-api-key,anthropic-version,anthropic-beta,"
    "anthropic-dangerous-direct-browser-access,openai-organization,openai-project,"
    "x-stainless-arch,x-stainless-lang,x-stainless-os,x-stainless-package-version,"
    "x-stainless-retry-count,x-stainless-runtime,x-stainless-runtime-version,x-stainless-timeout"
)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_cors_preflight_of_the_js_clients_headers_is_allowed(http: httpx.Client, path: str) -> None:
    preflight = http.options(
        path,
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": JS_CLIENT_HEADERS,
        },
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    allowed = {h.strip() for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert set(JS_CLIENT_HEADERS.split(",")) <= {h.lower() for h in allowed}


def test_cors_refuses_other_origins(http: httpx.Client) -> None:
    evil = "http://evil.example"
    preflight = http.options(
        "/v1/chat/completions",
        headers={"Origin": evil, "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    response = http.get("/v1/models", headers={"Origin": evil, "x-api-key": KEY})
    assert response.status_code == 403
    assert "access-control-allow-origin" not in response.headers


def test_cors_is_off_by_default() -> None:
    from fastapi.testclient import TestClient

    from kvwarm.server import create_app

    with TestClient(create_app(stub_settings())) as plain:
        response = plain.options(
            "/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
        )
        assert "access-control-allow-origin" not in response.headers
        refused = plain.get("/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 403


def test_docs_and_openapi_served_without_a_key(http: httpx.Client) -> None:
    docs = http.get("/docs")
    assert docs.status_code == 200 and "swagger-ui" in docs.text.lower()
    assert "/openapi.json" in docs.text
    schema = http.get("/openapi.json")
    assert schema.status_code == 200
    spec = schema.json()
    assert "/v1/chat/completions" in spec["paths"] and "/v1/models/{model_id}" in spec["paths"]
    schemes = spec["components"]["securitySchemes"]
    assert schemes["x-api-key"] == {"type": "apiKey", "in": "header", "name": "x-api-key"}
    assert schemes["bearer"]["scheme"] == "bearer"
    # Open for reading only: the guard's other rules still hold there.
    assert http.post("/openapi.json").status_code == 401
    assert http.get("/docs", headers={"Host": "evil.example"}).status_code == 421


def test_models_in_the_shape_of_each_sdk(client: OpenAI, live: LiveServer) -> None:
    """Anthropic's ``models.list()``/``retrieve()`` got OpenAI's items: ``display_name``,
    ``created_at`` and ``type`` were None (found by review). A request carrying
    ``anthropic-version`` (every Anthropic SDK sends it) gets Anthropic's shape and paging;
    OpenAI's clients keep theirs."""
    import anthropic

    claude = Anthropic(base_url=live.base_url, api_key=KEY, max_retries=0)
    openai_ids = [m.id for m in client.models.list()]
    assert openai_ids[:2] == ["a", "coder"]
    listed = claude.models.list()
    assert [m.id for m in listed.data] == openai_ids and listed.has_more is False
    for info in listed.data:
        assert info.type == "model" and info.display_name == info.id
        assert info.lifecycle == "active" and info.capabilities is None
        assert info.created_at.tzinfo is not None and info.created_at.year >= 2024
    loaded = {m.id: m for m in listed.data}["a"]
    assert loaded.max_input_tokens == 1024 and loaded.max_tokens == 1024  # n_ctx; the cap 4096
    # Anthropic's paging, which the SDK follows by itself: limit, after_id, before_id.
    assert [m.id for m in claude.models.list(limit=1)] == openai_ids
    first = claude.models.list(limit=1)
    assert [m.id for m in first.data] == ["a"] and first.has_more and first.last_id == "a"
    before = claude.models.list(before_id="coder", limit=5)
    assert [m.id for m in before.data] == ["a"] and before.has_more is False
    with pytest.raises(anthropic.BadRequestError):
        claude.models.list(after_id="no-such-model")
    retrieved = claude.models.retrieve("coder")
    assert retrieved.id == "coder" and retrieved.display_name == "coder"
    assert retrieved.type == "model" and retrieved.created_at == loaded.created_at
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("no-such-model")
    # OpenAI's shape is unchanged: its fields, and kvwarm's capabilities list.
    model = client.models.retrieve("a")
    assert model.object == "model" and model.owned_by == "kvwarm"
    assert (model.model_extra or {})["capabilities"] == ["generate", "embed"]


# --- n > 1 -----------------------------------------------------------------------------------


def test_n_completions_and_chat(client: OpenAI) -> None:
    done = client.completions.create(model="a", prompt=PROMPT, max_tokens=6, n=3, **SAMPLED)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert len({c.text for c in done.choices}) > 1
    assert done.usage is not None
    assert done.usage.prompt_tokens == len(PROMPT) + 1  # once (byte-level stub + BOS)
    assert done.usage.completion_tokens > 6  # every choice's tokens
    chat = client.chat.completions.create(
        model="a",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=5,
        n=2,
        **SAMPLED,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in chat.choices)


def test_best_of_returns_the_candidates_with_the_best_mean_logprob(client: OpenAI) -> None:
    """``best_of`` was accepted and ignored: one candidate was made and returned. Its
    candidates are the choices ``n=best_of`` makes (choice ``i`` seeded ``seed + i``)."""
    common = {"model": "a", "prompt": PROMPT, "max_tokens": 6, **SAMPLED}
    every = client.completions.create(**common, n=4, logprobs=0)  # type: ignore[call-overload]

    def mean(choice: object) -> float:
        lp = getattr(choice, "logprobs", None)
        assert lp is not None and lp.token_logprobs
        return sum(lp.token_logprobs) / len(lp.token_logprobs)

    ranked = sorted(every.choices, key=lambda c: (-mean(c), c.index))
    assert ranked[0].index != 0  # else the old code's lone candidate would pass by chance
    best = client.completions.create(**common, best_of=4)  # type: ignore[call-overload]
    (choice,) = best.choices
    assert choice.index == 0 and choice.text == ranked[0].text
    assert choice.logprobs is None  # ranking needed them; the client did not ask
    # Usage counts every candidate, as OpenAI's does; the prompt once.
    assert best.usage is not None and every.usage is not None
    assert best.usage.completion_tokens == every.usage.completion_tokens
    assert best.usage.prompt_tokens == every.usage.prompt_tokens
    two = client.completions.create(**common, n=2, best_of=4, logprobs=1)  # type: ignore[call-overload]
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs and c.logprobs.top_logprobs for c in two.choices)
    # best_of equal to n is n: streamed too.
    chunks = list(client.completions.create(**common, n=2, best_of=2, stream=True))  # type: ignore[call-overload]
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_n_streamed_interleaves_choices_by_index(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="a",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=6,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            **SAMPLED,
        )
    )
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.add(choice.index)
    assert finished == {0, 1, 2} and all(texts.values())
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    plain = client.chat.completions.create(
        model="a",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=6,
        n=3,
        **SAMPLED,
    )
    # seed + i per choice: the same texts, streamed or not.
    assert [texts[i] for i in range(3)] == [c.message.content for c in plain.choices]
    assert plain.usage is not None and plain.usage.prompt_tokens == usage.prompt_tokens


def test_a_list_of_prompts_streams_every_choice(client: OpenAI) -> None:
    # OpenAI streams a list of prompts (choice j of prompt i: index i * n + j); this was a
    # 400 ("streaming supports one prompt per request").
    body = {"model": "a", "prompt": [PROMPT, "Other words"], "max_tokens": 4, "n": 2, **SAMPLED}
    whole = client.completions.create(**body)  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(**body, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    )
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert set(texts) == {0, 1, 2, 3} and finished == {
        c.index: c.finish_reason for c in whole.choices
    }
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens == len(PROMPT) + len("Other words") + 2
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_later_prompt_that_fails_ends_the_stream_with_an_error(client: OpenAI) -> None:
    stream = client.completions.create(
        model="a", prompt=[PROMPT, "x" * 3000], max_tokens=2, stream=True
    )
    seen: list[int] = []
    with pytest.raises(openai.APIError, match="context"):
        for chunk in stream:
            seen += [c.index for c in chunk.choices]
    assert seen and set(seen) == {0}  # the first prompt's choice came whole, then the error


def test_n_above_n_parallel_is_a_clear_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="a", prompt=PROMPT, max_tokens=2, n=5)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "n" and "n_parallel" in body["message"]


# --- logprobs --------------------------------------------------------------------------------


def test_chat_logprobs_streamed_equal_the_plain_ones(client: OpenAI) -> None:
    common = {"model": "a", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    plain = client.chat.completions.create(**common, logprobs=True, top_logprobs=2)  # type: ignore[call-overload]
    expected = plain.choices[0].logprobs.content
    assert expected and all(len(t.top_logprobs) == 2 for t in expected)
    chunks = list(
        client.chat.completions.create(**common, logprobs=True, top_logprobs=2, stream=True)  # type: ignore[call-overload]
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in expected]
    with_text = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert all(c.choices[0].logprobs is not None for c in with_text)


def test_logprobs_are_the_replys_tokens_without_its_end(client: OpenAI) -> None:
    # The end-of-generation token is no part of the reply (nor of completion_tokens), but its
    # logprob was: a last entry with empty text and no bytes.
    grammar = {"grammar": "root ::= " + json.dumps("hé!")}  # the stub then ends: EOS
    chat = client.chat.completions.create(
        model="a",
        messages=MESSAGES,
        max_tokens=20,
        logprobs=True,
        extra_body=grammar,  # type: ignore[arg-type]
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and choice.logprobs and choice.logprobs.content
    entries = choice.logprobs.content
    assert chat.usage is not None and len(entries) == chat.usage.completion_tokens
    assert bytes(b for e in entries for b in e.bytes or []).decode() == choice.message.content
    streamed = list(
        client.chat.completions.create(
            model="a",
            messages=MESSAGES,
            max_tokens=20,
            logprobs=True,
            stream=True,
            extra_body=grammar,  # type: ignore[arg-type]
        )
    )
    tokens = [
        e.token
        for c in streamed
        if c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert tokens == [e.token for e in entries]
    text = client.completions.create(
        model="a", prompt=PROMPT, max_tokens=20, logprobs=1, extra_body=grammar
    )
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and text.usage is not None
    assert len(lp.tokens) == text.usage.completion_tokens and "" not in lp.tokens


def test_logprobs_hold_no_stop_sequence(client: OpenAI) -> None:
    # The stop sequence is not in the returned text (OpenAI's docs) and so not in its
    # logprobs: content "aaa" came with the logprobs of "a a a b c" (a stream sent "b" while
    # its text was held back as a possible stop). completion_tokens still counts the stop's
    # tokens: they were generated (docs/server.md).
    common = {
        "model": "a",
        "max_tokens": 20,
        "stop": ["bc"],
        "extra_body": {"grammar": 'root ::= "aaabcd"'},
    }
    chat = client.chat.completions.create(messages=MESSAGES, logprobs=True, **common)  # type: ignore[call-overload]
    choice = chat.choices[0]
    assert choice.message.content == "aaa" and choice.finish_reason == "stop"
    assert choice.logprobs and [e.token for e in choice.logprobs.content or []] == ["a"] * 3
    assert chat.usage is not None and chat.usage.completion_tokens == 5  # "aaabc" generated
    streamed = list(
        client.chat.completions.create(messages=MESSAGES, logprobs=True, stream=True, **common)  # type: ignore[call-overload]
    )
    tokens = [
        e.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert tokens == ["a"] * 3
    text = client.completions.create(prompt=PROMPT, logprobs=1, **common)  # type: ignore[call-overload]
    lp = text.choices[0].logprobs
    assert text.choices[0].text == "aaa" and lp is not None
    assert lp.tokens == ["a"] * 3 and lp.text_offset == [0, 1, 2]
    chunks = list(client.completions.create(prompt=PROMPT, logprobs=1, stream=True, **common))  # type: ignore[call-overload]
    assert [
        t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []
    ] == ["a"] * 3


def test_completion_logprobs_streamed(client: OpenAI) -> None:
    common = {"model": "a", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    plain = client.completions.create(**common)  # type: ignore[call-overload]
    lp = plain.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.text_offset is not None
    chunks = list(client.completions.create(**common, stream=True))  # type: ignore[call-overload]
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens or []
            offsets += chunk.choices[0].logprobs.text_offset or []
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_completion_top_logprobs_hold_the_sampled_token(client: OpenAI) -> None:
    # OpenAI's completions logprobs always hold the sampled token's ("up to logprobs+1
    # elements"): logprobs 0 gave every token {}, and a token sampled outside the best one
    # had no entry of its own, streamed or not.
    common = {"model": "a", "prompt": PROMPT, "max_tokens": 8, **SAMPLED}
    for logprobs in (0, 1):
        plain = client.completions.create(**common, logprobs=logprobs)  # type: ignore[call-overload]
        lp = plain.choices[0].logprobs
        assert lp is not None and lp.tokens and lp.top_logprobs and lp.token_logprobs
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top is not None and top.get(token) == value and len(top) <= logprobs + 1
        chunks = list(client.completions.create(**common, logprobs=logprobs, stream=True))  # type: ignore[call-overload]
        tops = [
            t
            for c in chunks
            if c.choices[0].logprobs
            for t in c.choices[0].logprobs.top_logprobs or []
        ]
        assert tops == lp.top_logprobs


def test_echo_with_prompt_logprobs(client: OpenAI) -> None:
    common = {"model": "a", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    done = client.completions.create(**common, echo=True, logprobs=1)  # type: ignore[call-overload]
    choice = done.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    n_prompt = len(PROMPT) + 1  # BOS + one token per byte
    assert len(lp.tokens) == n_prompt + done.usage.completion_tokens  # type: ignore[union-attr]
    assert (
        lp.token_logprobs[0] is None and lp.top_logprobs is not None and lp.top_logprobs[0] is None
    )
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert (
        lp.text_offset is not None
        and lp.text_offset[1] == 0
        and lp.text_offset[-1] < len(choice.text)
    )
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 0  # prefilled: no restored logits
    chunks = list(client.completions.create(**common, echo=True, logprobs=1, stream=True))  # type: ignore[call-overload]
    streamed: list[str] = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.tokens or []
    assert streamed == lp.tokens
    assert chunks[0].choices[0].text == PROMPT


# --- tool calls streamed ---------------------------------------------------------------------


def _tool_deltas(chunks: list[ChatCompletionChunk]) -> list[ChoiceDeltaToolCall]:
    return [
        call
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
        for call in c.choices[0].delta.tool_calls
    ]


def test_tool_call_streams_once_it_parses(client: OpenAI) -> None:
    # The stub enforces literal grammars: that stands in for a model that answers with a call.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    grammar = "root ::= " + '"' + call.replace('"', '\\"') + '"'
    chunks = list(
        client.chat.completions.create(
            model="a",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],  # type: ignore[list-item]
            max_tokens=100,
            temperature=0,
            stream=True,
            extra_body={"grammar": grammar},
        )
    )
    (first,) = _tool_deltas(chunks)
    assert first.id and first.type == "function" and first.function is not None
    assert first.function.name == "get_weather"
    assert json.loads(first.function.arguments or "") == {"city": "Oslo"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "call",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo",}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": Oslo}}</tool_call>',
    ],
)
def test_a_call_that_does_not_parse_is_content_streamed_or_not(client: OpenAI, call: str) -> None:
    # Before: the stream sent the call's header and argument deltas, then finished "stop" with
    # the text as content, while the plain reply had no call: a client held half a call.
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER],
        "max_tokens": 100,
        "temperature": 0,
        "extra_body": {"grammar": "root ::= " + json.dumps(call)},
    }
    whole = client.chat.completions.create(**body).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "stop" and not whole.message.tool_calls
    chunks = list(client.chat.completions.create(**body, stream=True))  # type: ignore[call-overload]
    assert _tool_deltas(chunks) == []
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.message.content == call
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_forced_call_to_a_tool_with_nested_models_is_served(
    client: OpenAI, live: LiveServer
) -> None:
    # pydantic (openai.pydantic_function_tool, Anthropic input schemas from models) writes
    # nested models as "$ref": "#/$defs/...": relative to the parameters, which the forced
    # call's schema wraps; those refs stopped resolving and the request was a 400.
    class Place(pydantic.BaseModel):
        city: str

    class Trip(pydantic.BaseModel):
        start: Place
        stops: list[Place]

    tool = openai.pydantic_function_tool(Trip)
    assert "$defs" in tool["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "Trip"}}):
        done = client.chat.completions.create(
            model="a",
            messages=[{"role": "user", "content": "Plan a trip"}],
            tools=[tool, WEATHER],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
        )
        assert done.choices[0].finish_reason in ("length", "stop")  # served: no 400
    claude = Anthropic(base_url=live.base_url, api_key=KEY, max_retries=0)
    message = claude.messages.create(
        model="a",
        max_tokens=4,
        messages=[{"role": "user", "content": "Plan a trip"}],
        tools=[{"name": "Trip", "input_schema": Trip.model_json_schema()}],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert message.stop_reason in ("max_tokens", "end_turn")


def test_allowed_tools_limit_which_tools_a_reply_may_call(client: OpenAI) -> None:
    # OpenAI's allowed_tools tool_choice (chat and Responses) was a 400 ("tool_choice: Input
    # should be 'none', 'auto' or 'required'"). A call to a tool outside the allowed set is
    # not a call (it stays text); one inside it is.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    grammar = "root ::= " + json.dumps(call)
    other = {"type": "function", "function": {"name": "get_time", "parameters": {}}}

    def reply(allowed: str) -> openai.types.chat.ChatCompletionMessage:
        choice = {
            "type": "allowed_tools",
            "allowed_tools": {
                "mode": "auto",
                "tools": [{"type": "function", "function": {"name": allowed}}],
            },
        }
        done = client.chat.completions.create(
            model="a",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER, other],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=100,
            extra_body={"grammar": grammar},
        )
        return done.choices[0].message

    allowed = reply("get_weather")
    assert allowed.tool_calls and allowed.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    refused = reply("get_time")
    assert not refused.tool_calls and refused.content == call
    with pytest.raises(openai.BadRequestError) as caught:
        reply("no_such_tool")
    assert caught.value.param == "tool_choice.allowed_tools.tools.0"
    resp = client.responses.create(
        model="a",
        input="What time is it?",
        tools=[{"type": "function", "name": "get_time", "parameters": {}, "strict": False}],
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "get_time"}],
        },
        max_output_tokens=4,
    )
    assert resp.tool_choice.type == "allowed_tools"  # type: ignore[union-attr]


def test_a_call_cut_by_max_tokens_finishes_with_length_streamed_or_not(client: OpenAI) -> None:
    # The reply stops (max_tokens) after the call's name, inside its arguments: no call was
    # made, and a stream says so as the plain response does ("length"), not "tool_calls".
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    grammar = "root ::= " + '"' + call.replace('"', '\\"') + '"'
    cut = len('<tool_call>{"name": "get_weather", "arguments": {"ci')  # one token per byte
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER],
        "max_tokens": cut,
        "temperature": 0,
        "extra_body": {"grammar": grammar},
    }
    whole = client.chat.completions.create(**body).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "length" and not whole.message.tool_calls
    chunks = list(client.chat.completions.create(**body, stream=True))  # type: ignore[call-overload]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.message.content == call[:cut]
    assert _tool_deltas(chunks) == []  # nothing of a call that was never made
    assert chunks[-1].choices[0].finish_reason == "length"


# --- Responses input items ------------------------------------------------------------------


def test_input_items_list_a_stored_responses_input(client: OpenAI) -> None:
    # responses.input_items.list was a 404: the route did not exist.
    resp = client.responses.create(
        model="a",
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
        ],
        max_output_tokens=2,
    )
    listed = client.responses.input_items.list(resp.id, order="asc")
    kinds = [item.type for item in listed.data]
    assert kinds == ["message", "function_call", "function_call_output", "message"]
    first = listed.data[0]
    assert first.type == "message" and first.role == "user"
    assert first.content[0].type == "input_text" and first.content[0].text == "Weather in Oslo?"
    assert listed.data[1].type == "function_call" and listed.data[1].call_id == "c1"
    ids = [item.id for item in listed.data]
    assert all(ids) and len(set(ids)) == 4
    assert listed.first_id == ids[0] and listed.last_id == ids[-1] and not listed.has_more
    newest = client.responses.input_items.list(resp.id, limit=3)  # desc by default, as OpenAI's
    assert [item.id for item in newest.data] == ids[::-1][:3] and newest.has_more
    rest = client.responses.input_items.list(resp.id, limit=3, after=newest.last_id)
    assert [item.id for item in rest.data] == ids[:1] and not rest.has_more
    paged = [item.id for item in client.responses.input_items.list(resp.id, limit=1, order="asc")]
    assert paged == ids  # the SDK's auto-paging follows has_more / after
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(resp.id, limit=0)
    assert caught.value.param == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_no_such_response")


def test_input_items_of_a_follow_up_hold_the_earlier_turns(client: OpenAI) -> None:
    """As OpenAI's: the items used to generate a response, which after ``previous_response_id``
    are the earlier turns' inputs and outputs, then its own (they listed its own alone)."""
    first = client.responses.create(model="a", input="Weather in Oslo?", max_output_tokens=2)
    second = client.responses.create(
        model="a", input="And tomorrow?", previous_response_id=first.id, max_output_tokens=2
    )
    third = client.responses.create(
        model="a", input="And Bergen?", previous_response_id=second.id, max_output_tokens=2
    )
    listed = list(client.responses.input_items.list(third.id, order="asc"))
    assert [(i.type, getattr(i, "role", None)) for i in listed] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert [listed[1].id, listed[3].id] == [first.output[0].id, second.output[0].id]
    texts = [i.content[0].text for i in listed if i.type == "message"]
    assert texts[0::2] == ["Weather in Oslo?", "And tomorrow?", "And Bergen?"]
    assert texts[1::2] == [first.output_text, second.output_text]
    own = client.responses.input_items.list(first.id)
    assert [i.id for i in own] == [listed[0].id]  # the first turn lists its own input alone


# --- suffix and /infill ----------------------------------------------------------------------


def test_suffix_fills_in_the_middle_on_a_model_with_fim_tokens(client: OpenAI) -> None:
    prefix = "def add(a, b):\n    return "
    done = client.completions.create(
        model="coder",
        prompt=prefix,
        suffix="\n",
        max_tokens=4,
        temperature=0,
    )
    assert done.usage is not None
    # BOS, FIM_PRE, the prefix's bytes, FIM_SUF, the suffix's bytes, FIM_MID.
    assert done.usage.prompt_tokens == 1 + 1 + len(prefix) + 1 + 1 + 1
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="a", prompt="x", suffix="y", max_tokens=2)
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "fim_not_supported"


def test_infill_endpoint(http: httpx.Client) -> None:
    headers = {"x-api-key": KEY}
    body = {
        "model": "coder",
        "input_prefix": "def add(a, b):\n    return ",
        "input_suffix": "\n",
        "input_extra": [{"filename": "util.py", "text": "import os\n"}],
        "n_predict": 4,
        "temperature": 0,
    }
    response = http.post("/infill", json=body, headers=headers)
    assert response.status_code == 200, response.text
    data = response.json()
    assert isinstance(data["content"], str) and data["stop"] is True
    assert data["tokens_predicted"] <= 4 and data["tokens_evaluated"] > len(body["input_prefix"])
    streamed = http.post("/infill", json={**body, "stream": True}, headers=headers)
    lines = [json.loads(x[6:]) for x in streamed.text.split("\n") if x.startswith("data: ")]
    assert lines[-1]["stop"] is True
    assert "".join(x["content"] for x in lines) == data["content"]
    refused = http.post("/infill", json={**body, "model": "a"}, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "fim_not_supported"
    # The field as /infill's client spelled it (found by the docs run: it said OpenAI's `suffix`,
    # a field /infill does not have; server.md: `param` names it "as the client spelled it").
    assert refused.json()["error"]["param"] == "input_suffix"


def _sse(text: str) -> list[dict[str, object]]:
    return [json.loads(x[6:]) for x in text.split("\n") if x.startswith("data: ")]


def test_infill_says_which_stop_ended_it_as_llama_server(http: httpx.Client) -> None:
    # A stop string's end said stop_type "eos" and named no word; llama-server says "word"
    # and names it in stopping_word ("limit" at n_predict, "" without a word).
    headers = {"x-api-key": KEY}
    body = {"model": "coder", "input_prefix": "def f(", "input_suffix": ")\n", "temperature": 0}
    plain = http.post("/infill", json={**body, "n_predict": 8}, headers=headers).json()
    assert plain["stop_type"] == "limit" and plain["stopping_word"] == ""
    assert plain["tokens_predicted"] == 8 and plain["truncated"] is False
    assert plain["index"] == 0 and plain["tokens"] == []  # return_tokens off
    word = plain["content"][2:4]
    assert len(word) == 2 and word not in plain["content"][:3]
    stopped = http.post("/infill", json={**body, "n_predict": 8, "stop": [word]}, headers=headers)
    data = stopped.json()
    assert data["content"] == plain["content"][:2]
    assert data["stop_type"] == "word" and data["stopping_word"] == word
    streamed = http.post(
        "/infill", json={**body, "n_predict": 8, "stop": [word], "stream": True}, headers=headers
    )
    events = _sse(streamed.text)
    assert "".join(str(e["content"]) for e in events) == data["content"]
    last = events[-1]
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == []
    assert last["stop_type"] == "word" and last["stopping_word"] == word


def test_infill_timings_tokens_probs_and_response_fields(http: httpx.Client) -> None:
    headers = {"x-api-key": KEY}
    body = {
        "model": "coder",
        "input_prefix": "def g(",
        "input_suffix": ")\n",
        "temperature": 0,
        "n_predict": 4,
    }
    data = http.post("/infill", json={**body, "return_tokens": True}, headers=headers).json()
    # llama-server's timings, under its names (a client reading timings.prompt_n found none).
    t = data["timings"]
    assert t["cache_n"] + t["prompt_n"] == data["tokens_evaluated"]
    for name in ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_per_token_ms"):
        assert isinstance(t[name], float | int) and t[name] >= 0
    assert len(data["tokens"]) == data["tokens_predicted"] == 4
    assert (
        http.post(
            "/detokenize", json={"model": "coder", "tokens": data["tokens"]}, headers=headers
        ).json()["content"]
        == data["content"]
    )
    # n_probs: llama-server's completion_probabilities, each token with its top n_probs.
    probs = http.post("/infill", json={**body, "n_probs": 2}, headers=headers).json()
    rows = probs["completion_probabilities"]
    assert [r["id"] for r in rows] == data["tokens"]
    assert "".join(r["token"] for r in rows) == data["content"]
    for r in rows:
        assert r["logprob"] <= 0 and isinstance(r["bytes"], list)
        assert len(r["top_logprobs"]) == 2
        assert {"id", "token", "bytes", "logprob"} <= set(r["top_logprobs"][0])
    streamed = _sse(
        http.post("/infill", json={**body, "n_probs": 2, "stream": True}, headers=headers).text
    )
    ids = [r["id"] for e in streamed[:-1] for r in e["completion_probabilities"]]  # type: ignore[attr-defined]
    assert ids == data["tokens"] and "completion_probabilities" not in streamed[-1]
    # response_fields: only those fields, "a/b" unnested under its path (llama.vim's request).
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "tokens_cached", "nope/x"]
    cut = http.post("/infill", json={**body, "response_fields": fields}, headers=headers).json()
    assert set(cut) == {"content", "timings/prompt_n", "timings/predicted_n", "tokens_cached"}
    assert cut["content"] == data["content"] and isinstance(cut["timings/prompt_n"], int)


def test_infill_keeps_the_latest_extra_context_that_fits(http: httpx.Client) -> None:
    # An editor's ring of extra chunks (llama.vim's) past the context was a 400
    # context_length_exceeded; llama-server cuts it to its latest tokens and answers.
    headers = {"x-api-key": KEY}
    chunks = [{"filename": f"f{i}.py", "text": f"# file {i}\n" + "x = 1\n" * 60} for i in range(8)]
    body = {
        "model": "coder",
        "input_prefix": "def h(",
        "input_suffix": ")\n",
        "input_extra": chunks,
        "n_predict": 4,
        "temperature": 0,
    }
    response = http.post("/infill", json=body, headers=headers)
    assert response.status_code == 200, response.text
    # n_ctx 1024: the cut's batch is half of it (llama-server's 2048 would not fit; the
    # model's n_batch, 64, plays no part), so the extra files' last 1024 - 512 - 2 * 4
    # tokens, then the FIM part.
    assert 1024 - 512 - 8 < response.json()["tokens_evaluated"] <= 1024 - 512 + 32


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/apply-template", "/cache/prewarm"])
def test_a_tool_kvwarm_cannot_run_is_unsupported_tool(http: httpx.Client, path: str) -> None:
    # Found by review: OpenAI's custom tools (free-text input) were a 400 with code
    # invalid_value, where docs/server.md (and the Responses and Anthropic routes) answer
    # unsupported_tool for a tool type kvwarm does not serve.
    custom = {"type": "custom", "custom": {"name": "shell", "description": "run it"}}
    for tools in ([custom], [WEATHER, {"type": "web_search"}]):
        body = {"model": "a", "max_tokens": 1, "messages": MESSAGES, "tools": tools}
        response = http.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_tool"
        assert error["param"] == f"tools.{len(tools) - 1}.type"
        assert repr(tools[-1]["type"]) in error["message"]
