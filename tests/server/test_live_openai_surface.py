"""The OpenAI surface of issue 11 through the official ``openai`` client against a live server
on the embedded model: n choices, streamed logprobs, echo, streamed tool calls, suffix/infill.

Short prompts and few tokens: prefill is ~200 tok/s on 2 cores.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvwarm.embedded import EMBEDDED_MODEL_ID

from .conftest import LiveServer
from .test_live_openai import client_for, real_settings

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = EMBEDDED_MODEL_ID


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(real_settings(tmp_path_factory.mktemp("surface") / "cache")).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return client_for(server)


def _prefilled(server: LiveServer) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvwarm_prefilled_tokens_total":
                return sample.value
    raise AssertionError("no kvwarm_prefilled_tokens_total")


def test_n_choices_share_one_prefill(client: OpenAI, server: LiveServer) -> None:
    before = _prefilled(server)
    done = client.completions.create(
        model=MODEL,
        prompt="In a quiet valley there lived a baker who",
        max_tokens=4,
        n=3,
        temperature=1.0,
        seed=3,
    )
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert all(c.text for c in done.choices)
    usage = done.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    # The prompt ran through the model once, not three times.
    assert _prefilled(server) - before == usage.prompt_tokens - cached
    assert usage.completion_tokens > 4


def test_n_streamed_chat_interleaves_choices(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name a fruit."}],
            max_tokens=5,
            n=2,
            temperature=1.0,
            seed=5,
            stream=True,
        )
    )
    content = {0: "", 1: ""}
    finished: set[int] = set()
    for chunk in chunks:
        for choice in chunk.choices:
            content[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(content.values())
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, n=64)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "n"


def test_chat_logprobs_stream_with_their_text(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs is not None
        for t in c.choices[0].logprobs.content or []
    ]
    assert content and tokens
    assert "".join(t.token for t in tokens).startswith(content)  # plus an end token, if any
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    assert tokens[0].logprob >= tokens[0].top_logprobs[-1].logprob  # greedy: the best one


def test_completion_logprobs_stream(client: OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="One, two,", max_tokens=4, temperature=0, logprobs=1, stream=True
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs is not None
        for t in c.choices[0].logprobs.tokens or []
    ]
    assert text and "".join(tokens).startswith(text)


def test_echo_scores_the_prompt_without_restoring_it(client: OpenAI) -> None:
    prompt = "The cat sat on the"
    for _ in range(2):  # the second time the prompt is cached, and still prefilled
        done = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=2
        )
        choice = done.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(prompt)
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        assert "".join(lp.tokens) == choice.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
        # The best 2, and the token itself where it is not among them (OpenAI's logprobs+1).
        assert all(t is not None and len(t) <= 3 for t in lp.top_logprobs[1:])
        assert all(
            t is not None and tok in t
            for tok, t in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True)
        )
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        assert done.usage.prompt_tokens_details.cached_tokens == 0


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}


def test_required_tool_call_streams_once_it_parses(client: OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="required",
            max_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    deltas = [
        d
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
        for d in c.choices[0].delta.tool_calls
    ]
    # One delta, once the call is known to parse: a call never half sent (docs/server.md).
    (first,) = deltas
    assert first.id and first.type == "function" and first.function is not None
    assert first.function.name == "get_weather"
    arguments = json.loads(first.function.arguments or "")
    assert isinstance(arguments.get("city"), str)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_langchain_streams_tool_call_chunks(server: LiveServer) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server.base_url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        model=MODEL,
        temperature=0,
        max_completion_tokens=40,
    )
    bound = llm.bind_tools([WEATHER], tool_choice="required")
    chunks = list(bound.stream("What is the weather in Paris?"))
    pieces = [c for c in chunks if getattr(c, "tool_call_chunks", None)]
    assert len(pieces) == 1  # the call arrives whole, once it parses (docs/server.md)
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk  # type: ignore[operator]
    (call,) = total.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)


def test_max_completion_tokens_wins(client: OpenAI) -> None:
    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=20,
        max_completion_tokens=3,
        temperature=0,
    )
    assert done.usage is not None and done.usage.completion_tokens <= 3


def test_suffix_and_infill_need_fim_tokens(client: OpenAI, server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="def f(", suffix="):", max_tokens=2)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "fim_not_supported"
    response = httpx.post(
        server.base_url + "/infill",
        json={"input_prefix": "def f(", "input_suffix": "):", "n_predict": 2},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "fim_not_supported"


def test_llama_completion_writes_what_v1_completions_writes(
    client: OpenAI, server: LiveServer
) -> None:
    """llama-server's /completion runs the same generation as /v1/completions: at temperature
    0 the same text, its tokens that text, streamed or not."""
    prompt = "The capital of France is"
    want = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    body = {"model": MODEL, "prompt": prompt, "n_predict": 6, "temperature": 0}
    got = httpx.post(
        server.base_url + "/completion", json={**body, "return_tokens": True}, timeout=120
    ).json()
    assert got["content"] == want.choices[0].text and len(got["tokens"]) == 6
    assert got["prompt"].endswith(prompt)
    streamed = httpx.post(
        server.base_url + "/completion", json={**body, "stream": True}, timeout=120
    ).text
    events = [json.loads(x[6:]) for x in streamed.split("\n") if x.startswith("data: ")]
    assert "".join(e["content"] for e in events) == got["content"]
    assert [t for e in events[:-1] for t in e["tokens"]] == got["tokens"]
