"""``/v1/messages`` against the stub backend: shapes, usage, event order, conversion, errors."""

from __future__ import annotations

import dataclasses
import json

import anthropic as sdk
import pytest
from fastapi.testclient import TestClient

from kvwarm.engine.types import Completion, CompletionStats, GenerationOptions
from kvwarm.server import convert, create_app
from kvwarm.server.anthropic import translate as anthropic
from kvwarm.server.anthropic.schemas import MessagesRequest
from kvwarm.server.chat import ChatReply
from kvwarm.server.errors import HTTPError
from kvwarm.server.tools import ToolCall

from .conftest import stub_settings, wait_ready

USER = {"role": "user", "content": "Tell me about the quick brown fox, please."}
BASE: dict[str, object] = {"model": "a", "max_tokens": 12, "temperature": 0, "messages": [USER]}


def named_events(text: str) -> list[tuple[str, dict[str, object]]]:
    """``event:``/``data:`` pairs of an SSE body (no ``[DONE]`` line in these APIs)."""
    out: list[tuple[str, dict[str, object]]] = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: "), block
        assert lines[1].startswith("data: "), block
        out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def assert_anthropic_error(response: object, status: int, kind: str) -> str:
    assert hasattr(response, "status_code") and hasattr(response, "json")
    assert response.status_code == status, response.json()
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    message = body["error"]["message"]
    assert isinstance(message, str) and message
    return message


def test_message_shape_and_usage_adds_up_to_the_prompt(client: TestClient) -> None:
    body = {**BASE, "system": "Be terse."}
    response = client.post("/v1/messages", json=body)
    assert response.status_code == 200, response.json()
    data = response.json()
    assert data["id"].startswith("msg_") and data["type"] == "message"
    assert data["role"] == "assistant" and data["model"] == "a"
    assert data["stop_reason"] in ("end_turn", "max_tokens") and data["stop_sequence"] is None
    (block,) = data["content"]
    assert block["type"] == "text" and isinstance(block["text"], str)
    usage = data["usage"]
    counted = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert sum(usage[p] for p in parts) == counted > 0
    assert 0 < usage["output_tokens"] <= 12
    again = client.post("/v1/messages", json=body).json()
    assert again["content"] == data["content"]  # greedy: the same reply
    assert again["usage"]["cache_read_input_tokens"] > 0  # the prompt came from the cache


def test_system_blocks_and_string_render_the_same_prompt(client: TestClient) -> None:
    as_text = {**BASE, "system": "Be terse.Be kind."}
    as_blocks = {
        **BASE,
        "system": [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Be kind."}],
    }
    one = client.post("/v1/messages/count_tokens", json=as_text).json()["input_tokens"]
    two = client.post("/v1/messages/count_tokens", json=as_blocks).json()["input_tokens"]
    assert two == one + 1  # the blocks are joined by one newline


def test_stream_has_anthropic_event_order_and_matches_the_whole_reply(client: TestClient) -> None:
    whole = client.post("/v1/messages", json=BASE).json()
    with client.stream("POST", "/v1/messages", json={**BASE, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = named_events(response.read().decode())
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert isinstance(start, dict) and start["content"] == [] and start["stop_reason"] is None
    counted = client.post("/v1/messages/count_tokens", json=BASE).json()["input_tokens"]
    assert start["usage"]["input_tokens"] == counted  # the prompt's size, before any output
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(isinstance(d, dict) and d["type"] == "text_delta" for d in deltas)
    text = "".join(str(d["text"]) for d in deltas if isinstance(d, dict))
    assert text == whole["content"][0]["text"]
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    usage = final["usage"]
    assert isinstance(usage, dict) and usage["output_tokens"] == whole["usage"]["output_tokens"]
    # The whole usage comes with message_delta (cumulative), adding up to the prompt.
    parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert sum(int(usage[p]) for p in parts) == counted  # type: ignore[call-overload]


def test_stop_sequences_report_which_one_stopped(client: TestClient) -> None:
    body = {**BASE, "max_tokens": 24}
    text = client.post("/v1/messages", json=body).json()["content"][0]["text"]
    assert len(text) >= 8, text
    stop = text[5:7]
    data = client.post("/v1/messages", json={**body, "stop_sequences": ["\x00never", stop]}).json()
    assert data["stop_reason"] == "stop_sequence" and data["stop_sequence"] == stop
    assert data["content"][0]["text"] == text[: text.index(stop)]
    with client.stream(
        "POST", "/v1/messages", json={**body, "stop_sequences": [stop], "stream": True}
    ) as response:
        events = named_events(response.read().decode())
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_prefill_is_continued_not_repeated(client: TestClient) -> None:
    prefill = {"role": "assistant", "content": "The fox"}
    body = {**BASE, "messages": [USER, prefill]}
    plain = client.post("/v1/messages/count_tokens", json=BASE).json()["input_tokens"]
    counted = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    assert counted == plain + len("The fox")  # the stub's tokens are bytes
    data = client.post("/v1/messages", json=body).json()
    usage = data["usage"]
    assert (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
        == counted
    )
    assert not data["content"] or not data["content"][0]["text"].startswith("The fox")


def test_a_lone_assistant_message_is_a_prefill(client: TestClient) -> None:
    # Anthropic's API continues a trailing assistant message also where it is the only one
    # (found by review: kvwarm kept it as a history turn, and the model answered it with a
    # turn of its own instead of continuing it).
    for extra in ({}, {"system": "Be brief."}):
        lone = {**BASE, **extra, "messages": [{"role": "assistant", "content": "The fox"}]}
        turns, prefill = anthropic.to_chat(MessagesRequest.model_validate(lone))
        assert prefill == "The fox"
        assert [(t.role, t.content) for t in turns] == [("system", s) for s in extra.values()]
        counted = client.post("/v1/messages/count_tokens", json=lone).json()["input_tokens"]
        done = client.post("/v1/messages", json=lone)
        assert done.status_code == 200, done.text
        usage = done.json()["usage"]
        kinds = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        assert sum(usage[k] for k in kinds) == counted


def test_a_prefill_ending_in_whitespace_is_refused(client: TestClient) -> None:
    # Anthropic's API refuses it; kvwarm took it and the reply continued after a lone space
    # token (SmolLM2 answered the prefill "The sea " with "\nis a vast...").
    for prefill in ("The fox ", "The fox\n", [{"type": "text", "text": "The fox\t"}]):
        body = {**BASE, "messages": [USER, {"role": "assistant", "content": prefill}]}
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            message = assert_anthropic_error(
                client.post(path, json=body), 400, "invalid_request_error"
            )
            assert message.startswith("messages.1: ") and "trailing whitespace" in message
    # Whitespace inside it, an empty one, and history turns are fine.
    for content in ("The  fox", ""):
        body = {**BASE, "messages": [USER, {"role": "assistant", "content": content}]}
        assert client.post("/v1/messages/count_tokens", json=body).status_code == 200
    history = [USER, {"role": "assistant", "content": "Sure. "}, USER]
    assert (
        client.post("/v1/messages/count_tokens", json={**BASE, "messages": history}).status_code
        == 200
    )


def test_tool_use_history_becomes_chat_turns() -> None:
    req = MessagesRequest.model_validate(
        {
            "max_tokens": 5,
            "system": [{"type": "text", "text": "sys"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "x"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "is_error": True,
                            "content": [{"type": "text", "text": "boom"}],
                        },
                        {"type": "text", "text": "thanks"},
                    ],
                },
            ],
        }
    )
    turns, prefill = anthropic.to_chat(req)
    assert prefill == ""
    assert [(t.role, t.content) for t in turns] == [
        ("system", "sys"),
        ("user", "weather?"),
        ("assistant", "Checking."),
        ("tool", "sunny"),
        ("tool", "Error: boom"),
        ("user", "thanks"),
    ]
    calls = turns[2].tool_calls
    assert calls is not None and calls[0].id == "toolu_1"
    assert calls[0].function.name == "w" and calls[0].function.arguments == {"c": 1}
    assert [t.tool_call_id for t in turns[3:5]] == ["toolu_1", "toolu_2"]


def _reply(text: str, calls: list[ToolCall], finish: str = "stop") -> ChatReply:
    stats = CompletionStats(
        prompt_tokens=10,
        cached_tokens=4,
        completion_tokens=3,
        prefill_ms=1.0,
        generation_ms=1.0,
        queue_ms=0.0,
        cache_hit="partial",
        finish_reason=finish,  # type: ignore[arg-type]
        key=b"k" * 32,
    )
    parts: list[str | ToolCall] = [text] if text else []
    return ChatReply(Completion(text, (1,) * 10, (2,) * 3, stats), [*parts, *calls])


def test_tool_use_reply_blocks_and_stream_events() -> None:
    call = ToolCall("call_abc", "get_weather", '{"city": "Oslo"}')
    reply = _reply("Let me look.", [call])
    body = anthropic.message("msg_1", "a", reply, 3)
    assert body["stop_reason"] == "tool_use"
    assert body["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
    # Usage: 4 restored, the other 6 written to the cache with the finish row.
    assert body["usage"] == {
        "input_tokens": 0,
        "output_tokens": 3,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 6,
    }
    events = anthropic.MessageEvents("msg_1", "a", 3)
    seq = [events.start(), *events.text("Let me"), *events.text(" look."), *events.call(call)]
    seq += events.finish(_reply("Let me look.", [call]))
    names = [n for n, _ in seq]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    tool_start = seq[6][1]
    assert tool_start["index"] == 1
    assert tool_start["content_block"] == {
        "type": "tool_use",
        "id": "toolu_abc",
        "name": "get_weather",
        "input": {},
    }
    delta = seq[7][1]["delta"]
    assert isinstance(delta, dict) and delta["type"] == "input_json_delta"
    assert json.loads(str(delta["partial_json"])) == {"city": "Oslo"}
    assert seq[9][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_forced_call_stream_has_no_text_block_and_max_tokens_maps() -> None:
    events = anthropic.MessageEvents("m", "a", 3)
    call = ToolCall("call_x", "f", "{}")
    names = [n for n, _ in [*events.call(call), *events.finish(_reply("", [call]))]]
    assert names[:3] == ["content_block_start", "ping", "content_block_delta"]
    cut = anthropic.message("m", "a", _reply("abc", [], finish="length"), 3)
    assert cut["stop_reason"] == "max_tokens"


def test_a_reply_the_context_cut_short_is_model_context_window_exceeded(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: a reply that filled the model's context before its max_tokens said
    # "max_tokens", as if the client's budget ran out (and asking again with more would help);
    # Anthropic's API says "model_context_window_exceeded" there, its SDKs' StopReason.
    options = convert.options

    def without_eos(*args: object, **kwargs: object) -> GenerationOptions:
        opts = options(*args, **kwargs)  # type: ignore[arg-type]
        return dataclasses.replace(opts, ignore_eos=True)

    monkeypatch.setattr(convert, "options", without_eos)
    body = {**BASE, "model": "b", "max_tokens": 1000}  # b's context: 256 tokens
    whole = client.post("/v1/messages", json=body).json()
    assert whole["stop_reason"] == "model_context_window_exceeded", whole
    assert whole["stop_sequence"] is None
    usage = whole["usage"]
    prompt = sum(usage[p] for p in ("input_tokens", "cache_read_input_tokens"))
    assert prompt + usage["cache_creation_input_tokens"] + usage["output_tokens"] == 256
    claude = sdk.Anthropic(
        base_url="http://testserver", api_key="k", http_client=client, max_retries=0
    )
    with claude.messages.stream(model="b", max_tokens=1000, messages=[USER]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "model_context_window_exceeded"
    # A reply its own max_tokens ended is still "max_tokens".
    cut = client.post("/v1/messages", json={**body, "max_tokens": 5}).json()
    assert cut["stop_reason"] == "max_tokens" and cut["usage"]["output_tokens"] == 5


def test_structured_output_format_reaches_the_grammar(client: TestClient) -> None:
    # Anthropic's structured outputs (output_config.format; the beta's output_format) were
    # ignored: a reply asked to be JSON of a schema came back as free text. A pattern the
    # grammar cannot hold is a 400 naming it, which shows the schema is applied.
    claude = sdk.Anthropic(
        base_url="http://testserver", api_key="k", http_client=client, max_retries=0
    )
    ask: list[sdk.types.MessageParam] = [{"role": "user", "content": "A word?"}]
    unholdable = {"type": "json_schema", "schema": {"type": "string", "pattern": "(?=a)b"}}
    with pytest.raises(sdk.BadRequestError) as caught:
        claude.messages.create(
            model="a",
            max_tokens=8,
            messages=ask,
            output_config={"format": unholdable},  # type: ignore[typeddict-item]
        )
    assert "lookarounds" in caught.value.message
    with pytest.raises(sdk.BadRequestError):
        claude.messages.create(
            model="a", max_tokens=8, messages=ask, extra_body={"output_format": unholdable}
        )
    fine = {"type": "json_schema", "schema": {"type": "object"}}
    done = claude.messages.create(
        model="a",
        max_tokens=8,
        messages=ask,
        output_config={"format": fine},  # type: ignore[typeddict-item]
    )
    assert done.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(sdk.BadRequestError):  # a forced call and a JSON reply: not both
        claude.messages.create(
            model="a",
            max_tokens=8,
            messages=ask,
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any"},
            output_config={"format": fine},  # type: ignore[typeddict-item]
        )


def test_structured_output_with_a_prefill_is_refused(client: TestClient) -> None:
    # The client reads prefill + reply as one text, but the grammar held the reply alone to
    # the schema: SmolLM2 answered the prefill '{"name": "' with '{"name": "Marija"} ', a
    # 200 whose JSON was invalid (found by review). Now a 400 naming the messages.
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    prefill = {"role": "assistant", "content": '{"name": "'}
    body = {**BASE, "messages": [USER, prefill]}
    for format_field in (
        {"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        {"output_format": {"type": "json_schema", "schema": schema}},
    ):
        response = client.post("/v1/messages", json={**body, **format_field})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert "prefill" in response.json()["error"]["message"]
    assert client.post("/v1/messages", json=body).status_code == 200  # a prefill alone is fine


def test_errors_are_anthropic_shaped(client: TestClient) -> None:
    no_max = {k: v for k, v in BASE.items() if k != "max_tokens"}
    message = assert_anthropic_error(
        client.post("/v1/messages", json=no_max), 400, "invalid_request_error"
    )
    assert "max_tokens" in message
    assert_anthropic_error(
        client.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"}),
        400,
        "invalid_request_error",
    )
    assert_anthropic_error(
        client.post("/v1/messages", json={**BASE, "model": "nope"}), 404, "not_found_error"
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    bad = {**BASE, "messages": [{"role": "user", "content": [image]}]}
    assert "image" in assert_anthropic_error(
        client.post("/v1/messages", json=bad), 400, "invalid_request_error"
    )
    server_tool = {**BASE, "tools": [{"type": "bash_20250124", "name": "bash"}]}
    assert_anthropic_error(
        client.post("/v1/messages", json=server_tool), 400, "invalid_request_error"
    )
    forced = {**BASE, "tool_choice": {"type": "any"}}
    assert_anthropic_error(client.post("/v1/messages", json=forced), 400, "invalid_request_error")
    # A max_tokens above the server's limit is capped by default, and Anthropic-shaped when
    # refused (tests/server/test_limits_stub.py).
    for field, value in (("temperature", 1.5), ("top_p", 2)):  # Anthropic's ranges are [0, 1]
        assert field in assert_anthropic_error(
            client.post("/v1/messages", json={**BASE, field: value}), 400, "invalid_request_error"
        )
    assert_anthropic_error(client.get("/v1/messages"), 405, "invalid_request_error")
    huge = {**BASE, "system": "x" * (100 << 10)}  # past the stub app's 64 KiB body limit
    assert_anthropic_error(client.post("/v1/messages", json=huge), 413, "request_too_large")
    # Other paths keep the OpenAI shape.
    other = client.post("/v1/chat/completions", json={"model": "nope", "messages": [USER]})
    assert other.status_code == 404 and "type" not in other.json()


def test_stop_sequence_errors_name_stop_sequences(client: TestClient) -> None:
    # They named "stop", OpenAI's field, which an Anthropic request does not have.
    claude = sdk.Anthropic(base_url="http://testserver", api_key="-", http_client=client)
    with pytest.raises(sdk.BadRequestError) as caught:
        claude.messages.create(model="a", max_tokens=2, messages=[USER], stop_sequences=["s"] * 17)  # type: ignore[list-item]
    body = caught.value.body
    assert isinstance(body, dict)
    message = body["error"]["message"]
    assert message.startswith("stop_sequences ") and "at most 16" in message, message


def test_x_api_key_authenticates() -> None:
    with TestClient(create_app(stub_settings(api_key="sesame"))) as secured:
        wait_ready(secured.get)
        assert_anthropic_error(secured.post("/v1/messages", json=BASE), 401, "authentication_error")
        wrong = secured.post("/v1/messages", json=BASE, headers={"x-api-key": "nope"})
        assert_anthropic_error(wrong, 401, "authentication_error")
        ok = secured.post("/v1/messages", json=BASE, headers={"x-api-key": "sesame"})
        assert ok.status_code == 200, ok.json()
        bearer = secured.get("/v1/models", headers={"authorization": "Bearer sesame"})
        assert bearer.status_code == 200


def test_cache_salt_separates_namespaces(client: TestClient) -> None:
    body = {**BASE, "system": "Salted and terse, please."}
    salted = client.post("/v1/messages", json=body, headers={"x-cache-salt": "tenant-a"}).json()
    again = client.post("/v1/messages", json={**body, "cache_salt": "tenant-a"}).json()
    assert again["usage"]["cache_read_input_tokens"] > 0  # header and body name one namespace
    other = client.post("/v1/messages", json={**body, "cache_salt": "tenant-b"}).json()
    assert other["usage"]["cache_read_input_tokens"] == 0
    assert salted["usage"]["cache_read_input_tokens"] == 0


def test_thinking_is_ignored_and_unknown_blocks_are_400s(client: TestClient) -> None:
    # As docs/server.md says: extended thinking (Claude Code sends it) is accepted, its reply
    # has no thinking blocks; a block of a type kvwarm does not read is a 400 naming it.
    thinking = {"type": "enabled", "budget_tokens": 1024}
    done = client.post("/v1/messages", json={**BASE, "thinking": thinking})
    assert done.status_code == 200, done.text
    assert {block["type"] for block in done.json()["content"]} <= {"text"}
    counted = client.post("/v1/messages/count_tokens", json={**BASE, "thinking": thinking})
    assert counted.status_code == 200
    for block in ({"type": "search_result", "source": "s", "title": "t", "content": []},
                  {"type": "bogus"}):  # fmt: skip
        bad = {**BASE, "messages": [{"role": "user", "content": [block]}]}
        message = assert_anthropic_error(
            client.post("/v1/messages", json=bad), 400, "invalid_request_error"
        )
        assert message.startswith("messages.0.content.0: ") and repr(block["type"]) in message


def test_fields_asking_for_what_kvwarm_cannot_run_are_400s(client: TestClient) -> None:
    # Found by review: mcp_servers (Anthropic's MCP connector) and a container's skills were
    # ignored silently, so a client asking for MCP tools or skills got a model without them.
    mcp = [{"type": "url", "url": "https://mcp.example/sse", "name": "search"}]
    skills = {"skills": [{"type": "anthropic", "skill_id": "pptx", "version": "latest"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for field, value in (("mcp_servers", mcp), ("container", skills)):
            message = assert_anthropic_error(
                client.post(path, json={**BASE, field: value}), 400, "invalid_request_error"
            )
            assert message.startswith(f"{field}: ") and "not supported" in message
        # Empty, they ask nothing; Claude Code's context_management (its thinking cleared,
        # which kvwarm does anyway) and effort pass, as they always have.
        passing = {
            "mcp_servers": [],
            "container": {"skills": []},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
        }
        assert client.post(path, json={**BASE, **passing}).status_code == 200


# Gemma 2's template (tests/server/test_tool_templates_stub.py): user and model turns must
# alternate, as Gemma's and Mistral's templates demand.
ALTERNATING = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_consecutive_same_role_messages_are_one_turn(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # Anthropic's API combines consecutive user (or assistant) messages into one turn. They
    # reached the template as turns of their own: a 400 on a template that wants the roles
    # to alternate (found by review), and a prefill split over two messages lost its start.
    template = tmp_path_factory.mktemp("alternating") / "alternating.jinja"
    template.write_text(ALTERNATING)
    hi = {"role": "user", "content": "Hi."}
    hello = {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}
    asks = [hi, {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}]
    with TestClient(create_app(stub_settings(chat_template=str(template)))) as alternating:
        wait_ready(alternating.get)
        for messages in (asks, [hi, hello, hello, *asks]):
            body = {**BASE, "messages": messages}
            done = alternating.post("/v1/messages", json=body)
            assert done.status_code == 200, done.text
        merged = {**BASE, "messages": [{"role": "user", "content": "Hi.\nHow are you?"}]}
        counted = alternating.post("/v1/messages/count_tokens", json={**BASE, "messages": asks})
        assert counted.status_code == 200, counted.text
        one = alternating.post("/v1/messages/count_tokens", json=merged).json()["input_tokens"]
        assert counted.json()["input_tokens"] == one  # one turn, the texts a line apart
    turns, prefill = anthropic.to_chat(
        MessagesRequest.model_validate(
            {
                "max_tokens": 5,
                "messages": [
                    hi,
                    {"role": "assistant", "content": "The fox"},
                    {"role": "assistant", "content": [{"type": "text", "text": " jumps"}]},
                ],
            }
        )
    )
    assert [(t.role, t.content) for t in turns] == [("user", "Hi.")]
    assert prefill == "The fox\n jumps"  # the whole trailing turn is continued
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    ends_in_a_call = [hi, {"role": "assistant", "content": [call]}, hello]
    with pytest.raises(HTTPError) as caught:
        anthropic.to_chat(
            MessagesRequest.model_validate({"max_tokens": 5, "messages": ends_in_a_call})
        )
    assert caught.value.param == "messages.1"


def test_a_busy_server_is_anthropics_529_overloaded() -> None:
    # Found by review: "server busy" (here a model still loading) was a 503 on /v1/messages,
    # typed overloaded_error, which Anthropic's API answers as a 529: its SDK raised
    # ServiceUnavailableError, not the OverloadedError that code waiting out an overload
    # catches. The Retry-After stays; OpenAI's routes stay 503.
    client = TestClient(create_app(stub_settings()))  # no lifespan: the models never load
    claude = sdk.Anthropic(
        base_url="http://testserver", api_key="k", http_client=client, max_retries=0
    )
    ask: list[sdk.types.MessageParam] = [{"role": "user", "content": "hi"}]
    with pytest.raises(sdk.OverloadedError) as caught:
        claude.messages.create(model="a", max_tokens=1, messages=ask)
    assert caught.value.status_code == 529
    assert caught.value.response.headers["retry-after"] == "1"
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the model 'a' is still loading"},
    }
    with pytest.raises(sdk.OverloadedError):
        claude.messages.count_tokens(model="a", messages=ask)
    openai = client.post("/v1/chat/completions", json={"model": "a", "messages": ask})
    assert openai.status_code == 503 and openai.headers["retry-after"] == "1"
    assert openai.json()["error"]["code"] == "model_loading"
