"""The official ``openai`` client against a live uvicorn server running the embedded model.

Short prompts and few tokens: prefill is ~200 tok/s on 2 cores. Policy gates are low so that
these short prompts are cached.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvwarm.embedded import EMBEDDED_MODEL_ID
from kvwarm.settings import ModelSpec, Settings

from .conftest import LOW_POLICY, LiveServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = EMBEDDED_MODEL_ID
SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def real_settings(cache_dir: Path | None) -> Settings:
    return Settings(
        models=(ModelSpec(),),
        cache_dir=cache_dir,
        n_ctx=1024,
        n_batch=64,
        policy=LOW_POLICY,
        keepalive_interval_s=0,
        default_max_tokens=8,
    )


def client_for(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(real_settings(tmp_path_factory.mktemp("live") / "cache")).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return client_for(server)


def test_models_lists_the_embedded_model(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_plain_and_streamed(client: OpenAI) -> None:
    done = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0
    )
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage is not None and 0 < done.usage.completion_tokens <= 4
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == done.choices[0].text  # greedy: the same tokens either way
    # The same prompt again is restored from the cache.
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens > 0


def test_chat_multi_turn_cached_tokens_rise(client: OpenAI) -> None:
    messages: list[dict[str, str]] = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    reply = first.choices[0].message.content
    assert isinstance(reply, str) and first.choices[0].message.role == "assistant"
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another."}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    cached_first = first.usage.prompt_tokens_details.cached_tokens or 0
    assert usage.prompt_tokens_details is not None
    cached_second = usage.prompt_tokens_details.cached_tokens or 0
    # The second turn re-sends the first: at least the first turn's prompt comes from cache.
    assert cached_second > cached_first
    assert cached_second >= first.usage.prompt_tokens - 16
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content and chunks[-2].choices[0].finish_reason in ("length", "stop")


def test_json_schema_output_parses(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    done = client.chat.completions.create(
        model=MODEL,
        messages=[SYSTEM, {"role": "user", "content": "Is water wet? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        max_tokens=24,
        temperature=0,
    )
    assert done.choices[0].finish_reason == "stop"
    assert json.loads(done.choices[0].message.content or "") in (
        {"answer": "yes"},
        {"answer": "no"},
    )


def test_named_tool_choice_returns_a_tool_call(client: OpenAI) -> None:
    # SmolLM2's template ignores tools: they reach the model as a system prompt, and the named
    # tool_choice constrains decoding to a call of that tool.
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,  # accepted and honoured on the real model too
        max_tokens=32,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


WEATHER_DAYS = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["location", "days"],
            "additionalProperties": False,
        },
    },
}


def _valid_weather_call(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    days = args.get("days")
    return (
        name == "get_weather"
        and set(args) == {"location", "days"}
        and isinstance(args["location"], str)
        and type(days) is int
        and 1 <= days <= 7
    )


def test_auto_tool_calls_are_held_to_their_schema_once_started(client: OpenAI) -> None:
    """tool_choice auto: free text, until the model opens a ``<tool_call>``; from there the
    call is held to the tool's schema, then the reply is free again. Unconstrained, SmolLM2
    opens one here and writes Python in it (the reply was all content: ``<tool_call>``,
    then a fenced ``def get_weather_Paris3(city_name: str)``)."""
    ask = [{"role": "user", "content": "<tool_call> get_weather Paris 3 days"}]
    common: dict[str, object] = {"model": MODEL, "messages": ask, "tools": [WEATHER_DAYS]}
    done = client.chat.completions.create(**common, temperature=0, max_tokens=60)  # type: ignore[call-overload]
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert _valid_weather_call(call.function.name, call.function.arguments), call
    # Streamed: the call goes out whole, once its block closes.
    stream = client.chat.completions.create(**common, temperature=0, max_tokens=60, stream=True)  # type: ignore[call-overload]
    streamed = [tc for chunk in stream for tc in (chunk.choices[0].delta.tool_calls or [])]
    (first,) = streamed
    assert first.function is not None and first.function.name and first.function.arguments
    assert _valid_weather_call(first.function.name, first.function.arguments)
    # Parallel calls off: one call, and the reply ends with it (nothing after it).
    one = client.chat.completions.create(  # type: ignore[call-overload]
        **common, temperature=0, max_tokens=60, parallel_tool_calls=False
    )
    message = one.choices[0].message
    (only,) = message.tool_calls or []
    assert _valid_weather_call(only.function.name, only.function.arguments)
    assert not message.content and one.choices[0].finish_reason == "tool_calls"
    # The same prompt a third time: its KV came from the cache, the grammar changed nothing.
    details = one.usage.prompt_tokens_details if one.usage else None
    assert details is not None and details.cached_tokens
    # A stop string inside the held call ends the reply there, as any stop does: the block
    # is cut before its close, its JSON whole, so it is still the call.
    stopped = client.chat.completions.create(  # type: ignore[call-overload]
        **common, temperature=0, max_tokens=60, stop=["</tool_call>"]
    )
    (cut,) = stopped.choices[0].message.tool_calls or []
    assert _valid_weather_call(cut.function.name, cut.function.arguments)


def test_embeddings(client: OpenAI) -> None:
    # The client asks for base64 by default and decodes it; floats must arrive either way.
    result = client.embeddings.create(model=MODEL, input=["hello", "goodbye"])
    assert [d.index for d in result.data] == [0, 1]
    assert len(result.data[0].embedding) == 576
    assert result.data[0].embedding != result.data[1].embedding
    plain = client.embeddings.create(model=MODEL, input="hello", encoding_format="float")
    assert plain.data[0].embedding == pytest.approx(result.data[0].embedding, abs=1e-6)


def test_embeddings_inputs_through_the_sdk(client: OpenAI) -> None:
    """The four input forms OpenAI takes, through the SDK (base64 by default, decoded by it):
    a text, texts, token ids, lists of token ids; ``dimensions``; an empty input and one past
    the context are 400s naming ``input``."""
    text = client.embeddings.create(model=MODEL, input="hello world")
    assert text.usage.prompt_tokens == 2  # SmolLM2 adds no BOS
    tokens = [28120, 905]  # "hello world" in SmolLM2's vocabulary (no BOS)
    as_ids = client.embeddings.create(model=MODEL, input=tokens)
    assert as_ids.data[0].embedding == pytest.approx(text.data[0].embedding, abs=1e-6)
    lists = client.embeddings.create(model=MODEL, input=[tokens, tokens[:1]])
    assert len(lists.data) == 2 and lists.usage.prompt_tokens == 3
    short = client.embeddings.create(model=MODEL, input="hello world", dimensions=8)
    assert len(short.data[0].embedding) == 8
    assert sum(v * v for v in short.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
    for bad, code in (("", "invalid_value"), ("word " * 1100, "context_length_exceeded")):
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=MODEL, input=bad)
        body = info.value.body
        assert isinstance(body, dict) and body.get("param") == "input", body
        assert body.get("code") == code, body


def test_unknown_model_is_a_not_found_error(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 404
    body = info.value.body
    assert isinstance(body, dict) and body.get("code") == "model_not_found"


def _metric(server: LiveServer, name: str, **labels: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    return 0.0  # a labelled counter that has not happened yet is absent


def test_disconnect_mid_stream_frees_the_model(server: LiveServer, client: OpenAI) -> None:
    before = _metric(server, "kvwarm_completion_tokens_total")
    cancelled = _metric(server, "kvwarm_generations_total", reason="cancelled")
    disconnects = _metric(server, "kvwarm_client_disconnects_total")
    body = {
        "model": MODEL,
        "prompt": "List the numbers from one to a thousand:",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "text_completion"
    # Leaving the block closed the connection mid-stream. The generation must stop: the next
    # request runs on the (single) slot, and far fewer than 400 tokens were generated.
    done = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens >= 1
    spent = _metric(server, "kvwarm_completion_tokens_total") - before
    assert spent < 100, f"the abandoned stream kept generating ({spent} tokens)"
    assert _metric(server, "kvwarm_model_active") == 0
    # The engine reported the abandoned stream as cancelled (not as a natural stop).
    assert _metric(server, "kvwarm_generations_total", reason="cancelled") == cancelled + 1
    assert _metric(server, "kvwarm_client_disconnects_total") == disconnects + 1


def test_conversation_survives_a_restart(tmp_path: Path) -> None:
    """Stateless multi-turn chat, a restart on the same disk tier, then the next turn is warm."""
    settings = real_settings(tmp_path / "cache")
    messages: list[dict[str, str]] = [SYSTEM, {"role": "user", "content": "Say hello."}]
    live = LiveServer(settings).start()
    try:
        api = client_for(live)
        for follow_up in ("Say it again.",):
            reply = api.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=0
            )
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": follow_up},
            ]
        last = api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0
        )
        messages += [
            {"role": "assistant", "content": last.choices[0].message.content or ""},
            {"role": "user", "content": "Thanks."},
        ]
        assert last.usage is not None
        before_restart = last.usage.prompt_tokens
    finally:
        live.stop()  # closes the engine: pending saves are flushed to the disk tier
    assert list((tmp_path / "cache").rglob("*.kvc")), "nothing was saved to the disk tier"
    live = LiveServer(settings).start()
    try:
        after = client_for(live).chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            temperature=0,
        )
    finally:
        live.stop()
    assert after.usage is not None and after.usage.prompt_tokens_details is not None
    cached = after.usage.prompt_tokens_details.cached_tokens or 0
    # Everything up to the previous turn's prompt (and usually its reply) came from disk.
    assert cached >= before_restart, (cached, before_restart, after.usage.prompt_tokens)
