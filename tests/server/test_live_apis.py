"""The official ``anthropic`` and ``openai`` (Responses) clients against a live server running
the embedded model, with an API key set (the Anthropic client sends it as ``x-api-key``).

Short prompts and few tokens: prefill is ~200 tok/s on 2 cores.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anthropic
import openai
import pytest
from anthropic import Anthropic
from openai import OpenAI

from kvwarm.embedded import EMBEDDED_MODEL_ID

from .conftest import LiveServer
from .test_live_openai import real_settings

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = EMBEDDED_MODEL_ID
# anthropic>=2 no longer takes temperature/top_p/top_k as arguments; the API (and kvwarm) still
# reads them from the body.
GREEDY: dict[str, object] = {"temperature": 0}
KEY = "sesame"
WEATHER_SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = real_settings(tmp_path_factory.mktemp("apis") / "cache").replace(api_key=KEY)
    live = LiveServer(settings).start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> Anthropic:
    return Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=600)


# --- Anthropic Messages ----------------------------------------------------------------------


def test_messages_multi_turn_reads_the_cache(claude: Anthropic) -> None:
    turns: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Name a colour."}]
    first = claude.messages.create(
        model=MODEL, system="You are terse.", messages=turns, max_tokens=6, extra_body=GREEDY
    )
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in first.content if b.type == "text")
    assert text and 0 < first.usage.output_tokens <= 6
    u = first.usage
    prompt = (
        u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    )
    counted = claude.messages.count_tokens(model=MODEL, system="You are terse.", messages=turns)
    assert prompt == counted.input_tokens
    turns += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another."}]
    second = claude.messages.create(
        model=MODEL, system="You are terse.", messages=turns, max_tokens=6, extra_body=GREEDY
    )
    # The second turn re-sends the first: at least the first prompt is restored, not prefilled.
    assert (second.usage.cache_read_input_tokens or 0) >= prompt - 16


def test_messages_stream_events_and_final_message(claude: Anthropic) -> None:
    kinds: list[str] = []
    pieces: list[str] = []
    with claude.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Write one sentence about cats."}],
        max_tokens=8,
        extra_body=GREEDY,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                pieces.append(event.text)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.content[0].type == "text" and final.content[0].text == "".join(pieces)
    assert 0 < final.usage.output_tokens <= 8


def test_stop_sequences(claude: Anthropic) -> None:
    done = claude.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a sentence about the sea."}],
        max_tokens=24,
        extra_body=GREEDY,
        stop_sequences=[" "],
    )
    assert done.stop_reason == "stop_sequence" and done.stop_sequence == " "
    assert all(" " not in b.text for b in done.content if b.type == "text")
    # An empty one is the client's mistake, refused by its name (it was silently dropped).
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences must not hold an empty"):
        claude.messages.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            stop_sequences=[" ", ""],
        )


def test_forced_tool_use_streamed_then_answered(claude: Anthropic) -> None:
    tool: anthropic.types.ToolParam = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER_SCHEMA,
    }
    ask: anthropic.types.MessageParam = {
        "role": "user",
        "content": "What is the weather in Paris?",
    }
    with claude.messages.stream(
        model=MODEL,
        messages=[ask],
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=32,
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use", final
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert isinstance(use.input, dict) and use.input["city"] in ("Paris", "Oslo")
    answer = claude.messages.create(
        model=MODEL,
        messages=[
            ask,
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny."}],
            },
        ],
        tools=[tool],
        max_tokens=8,
        extra_body=GREEDY,
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.content and answer.usage.output_tokens > 0


def test_anthropic_errors(claude: Anthropic, server: LiveServer) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(
            model="claude-opus", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["error"]["type"] == "not_found_error"
    anon = Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        anon.messages.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)


# --- OpenAI Responses ------------------------------------------------------------------------


def test_responses_create_plain_and_streamed(oai: OpenAI) -> None:
    done = oai.responses.create(
        model=MODEL,
        instructions="You are terse.",
        input="Name a fruit.",
        max_output_tokens=16,
        temperature=0,
    )
    assert done.status in ("completed", "incomplete") and done.output_text
    assert done.usage is not None and 0 < done.usage.output_tokens <= 16
    kinds: list[str] = []
    deltas: list[str] = []
    completed = None
    for event in oai.responses.create(
        model=MODEL,
        instructions="You are terse.",
        input="Name a vegetable.",
        max_output_tokens=16,
        temperature=0,
        stream=True,
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert completed is not None and completed.output_text == "".join(deltas)
    assert oai.responses.retrieve(completed.id).output_text == completed.output_text


def test_previous_response_id_is_served_from_the_cache(oai: OpenAI) -> None:
    first = oai.responses.create(
        model=MODEL, input="Say hello to Ada.", max_output_tokens=8, temperature=0
    )
    second = oai.responses.create(
        model=MODEL,
        input="Now say goodbye.",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert first.usage is not None and second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > 0
    # The previous prompt was restored (its reply row was the parent), not prefilled again.
    assert cached >= first.usage.input_tokens
    streamed = None
    for event in oai.responses.create(
        model=MODEL,
        input="Once more.",
        previous_response_id=second.id,
        max_output_tokens=8,
        temperature=0,
        stream=True,
    ):
        if event.type in ("response.completed", "response.incomplete"):
            streamed = event.response
    assert streamed is not None and streamed.usage is not None
    assert streamed.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")


def _until_done(oai: OpenAI, response_id: str) -> openai.types.responses.Response:
    """Poll a background response as a client does, until it leaves queued/in_progress
    (bounded; a wait for readiness, not synchronisation by sleep)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        polled = oai.responses.retrieve(response_id)
        if polled.status not in ("queued", "in_progress"):
            return polled
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {polled.status}")


def test_responses_in_the_background_polled_and_cancelled(oai: OpenAI) -> None:
    """OpenAI's background mode on the real model: the create answers queued at once, the
    poll ends completed, a follow-up continues from its cached reply; a cancel ends one."""
    made = oai.responses.create(
        model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=0, background=True
    )
    assert made.status == "queued" and made.background is True and not made.output
    done = _until_done(oai, made.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    assert done.usage is not None and 0 < done.usage.output_tokens <= 8
    after = oai.responses.create(
        model=MODEL,
        input="Another.",
        previous_response_id=made.id,
        max_output_tokens=4,
        temperature=0,
    )
    assert after.usage is not None and after.usage.input_tokens_details.cached_tokens > 0
    long = oai.responses.create(
        model=MODEL,
        input="Count from 1 to 500, one number a line.",
        max_output_tokens=512,
        temperature=0,
        background=True,
    )
    cancelled = oai.responses.cancel(long.id)  # answered once its generation has ended
    assert cancelled.status == "cancelled", cancelled
    assert oai.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="store"):
        oai.responses.create(model=MODEL, input="x", background=True, store=False)


def test_responses_function_call_and_its_output(oai: OpenAI) -> None:
    tool: openai.types.responses.FunctionToolParam = {
        "type": "function",
        "name": "get_weather",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    }
    asked = oai.responses.create(
        model=MODEL,
        input="What is the weather in Oslo?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32,
        temperature=0,
    )
    (call,) = [item for item in asked.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    answered = oai.responses.create(
        model=MODEL,
        previous_response_id=asked.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Rain."}],
        tools=[tool],
        max_output_tokens=8,
        temperature=0,
    )
    assert answered.usage is not None and answered.usage.input_tokens_details.cached_tokens > 0
    assert answered.output
