"""Tool calls: planning (native vs described), parsing every common format, streaming holdback."""

from __future__ import annotations

import json

import pytest

from kvwarm.backends.chat_template import render_chat
from kvwarm.server.schemas import ChatMessage, NamedToolChoice, Tool
from kvwarm.server.tools import (
    CALL_MARKERS,
    parse_tool_calls,
    plan_chat,
    template_id,
    template_messages,
)

NAMES = frozenset({"get_weather"})
WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '<function=get_weather>{"city": "Paris"}</function>',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',  # Mistral Small 3.2, Devstral
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS] {"city": "Paris"}',
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
    ],
)
def test_formats_parse_to_one_call(text: str) -> None:
    content, calls = parse_tool_calls(text, NAMES)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_")


def test_text_before_a_call_is_content_and_unknown_tools_are_not_calls() -> None:
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, NAMES)[0] == "Let me check."
    other = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tool_calls(other, NAMES) == (other, [])
    assert parse_tool_calls('{"name": "get_weather"}', frozenset()) == (
        '{"name": "get_weather"}',
        [],
    )


def test_plain_json_that_is_not_a_call_stays_content() -> None:
    text = '{"answer": 42}'
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_plan_without_native_support_describes_tools_in_the_system_message() -> None:
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    plan = plan_chat(msgs, [WEATHER], "auto", renders_tools=False)
    assert plan.tools is None and plan.json_schema is None and not plan.forced
    assert plan.messages[0]["role"] == "system"
    content = str(plan.messages[0]["content"])
    assert content.startswith("Be brief.") and "get_weather" in content
    native = plan_chat(msgs, [WEATHER], None, renders_tools=True)
    assert native.tools is not None and native.messages[0]["content"] == "Be brief."


def test_tool_choice_none_hides_tools_and_named_choice_forces_a_schema() -> None:
    msgs = [ChatMessage(role="user", content="Hi")]
    hidden = plan_chat(msgs, [WEATHER], "none", renders_tools=True)
    assert hidden.tools is None and hidden.names == frozenset()
    named = NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}
    )
    forced = plan_chat(msgs, [WEATHER], named, renders_tools=False)
    assert forced.forced and forced.json_schema is not None
    props = forced.json_schema["properties"]
    assert isinstance(props, dict) and props["name"] == {"const": "get_weather"}


def test_history_with_calls_round_trips_through_non_native_templates() -> None:
    msgs = [
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", content="rainy", tool_call_id="c1"),
    ]
    plain = template_messages(msgs, native=False)
    assert "<tool_call>" in str(plain[0]["content"]) and "Oslo" in str(plain[0]["content"])
    assert plain[1] == {"role": "user", "content": "<tool_response>\nrainy\n</tool_response>"}
    native = template_messages(msgs, native=True)
    calls = native[0]["tool_calls"]
    assert isinstance(calls, list) and calls[0]["function"]["arguments"] == {"city": "Oslo"}
    assert native[1]["tool_call_id"] == calls[0]["id"] == template_id("c1")


#: A plain template (the stub's): a turn's content as it is, so a prompt's text is the reply's.
PLAIN = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("city", ["Oslo", "Zürich", "東京"])
def test_a_described_call_sent_back_renders_as_the_model_wrote_it(city: str) -> None:
    # The next turn's prompt holds the reply as generated, so it shares the cached reply's
    # tokens. Before, a call's non-ASCII arguments came back as "Z\u00fcrich" (json.dumps),
    # and a tool's description reached the model as escapes too.
    tool = WEATHER.model_copy(
        update={"function": WEATHER.function.model_copy(update={"description": "Météo, 天気"})}
    )
    ask = [ChatMessage(role="user", content="Weather?")]
    first = plan_chat(ask, [tool], "auto", renders_tools=False)
    prompt = render_chat(PLAIN, first.messages, bos_token="", eos_token="")
    assert "Météo, 天気" in prompt
    reply = (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
    )
    content, calls = first.split(reply)
    assert json.loads(calls[0].arguments) == {"city": city}
    assert city in calls[0].arguments  # as written, as OpenAI's own arguments are
    turn = {"role": "assistant", "content": content or None, "tool_calls": [calls[0].to_openai()]}
    result = ChatMessage(role="tool", content="sunny", tool_call_id=calls[0].id)
    follow_up = [*ask, ChatMessage.model_validate(turn), result]
    second = plan_chat(follow_up, [tool], "auto", renders_tools=False)
    assert render_chat(PLAIN, second.messages, bos_token="", eos_token="").startswith(
        prompt + reply + "\n"
    )


def test_a_lone_surrogate_in_arguments_stays_escaped() -> None:
    # A model (or a client's arguments string) may write "\ud800": the text must still encode.
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800 Zürich"}}</tool_call>',
        NAMES,
    )
    assert calls[0].arguments.encode() == b'{"city": "\\ud800 Z\\u00fcrich"}'
    turn = ChatMessage.model_validate({"role": "assistant", "tool_calls": [calls[0].to_openai()]})
    str(template_messages([turn], native=False)[0]["content"]).encode()


# The check Gemma's and Mistral's templates make: user and assistant turns alternate.
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


def test_emulated_tool_results_are_one_user_turn_with_the_text_after_them() -> None:
    # An agent's turn after two parallel calls: both results, then (Anthropic: the same user
    # turn) a line of text. Before, a template without tool support saw three user turns in
    # a row, and one that wants roles to alternate refused the request with a 400.
    msgs = [
        ChatMessage(role="user", content="Weather in Oslo and Rome?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "a", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                    {"id": "b", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
                ],
            }
        ),
        ChatMessage(role="tool", content="rainy", tool_call_id="a"),
        ChatMessage(role="tool", content="sunny", tool_call_id="b"),
        ChatMessage(role="user", content="Thanks. Which is warmer?"),
    ]
    plain = template_messages(msgs, native=False)
    assert [m["role"] for m in plain] == ["user", "assistant", "user"]
    assert plain[2]["content"] == (
        "<tool_response>\nrainy\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
        "\nThanks. Which is warmer?"
    )
    text = render_chat(ALTERNATING, plain, bos_token="", eos_token="")
    assert "rainy" in text and "sunny" in text and "warmer" in text
    # Native templates get the tool messages as they are.
    assert [m["role"] for m in template_messages(msgs, native=True)][2:] == ["tool", "tool", "user"]


def test_null_arguments_are_an_empty_object() -> None:
    # A model calling a tool of no parameters may write "arguments": null: that was the
    # call's arguments "null", and Anthropic's tool_use input {"arguments": null}.
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "get_weather", "arguments": null}</tool_call>', NAMES
    )
    assert [c.arguments for c in calls] == ["{}"]


# The check of Mistral's templates (Nemo, Small 3.2): a call's id is 9 letters and digits.
MISTRAL_IDS = (
    "{% for m in messages %}{% for c in m.get('tool_calls') or [] %}"
    "{% if c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{% endif %}[CALL_ID]{{ c.id }}{% endfor %}"
    "{% if m.role == 'tool' %}{% if m.tool_call_id|length != 9 %}{{ raise_exception('Tool "
    "call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "[TOOL_RESULTS]{{ m.tool_call_id }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("call_id", ["call_9f2c1d0e3b4a5f6e7d8c9b0a", "toolu_01AbC", "a1b2c3d4e"])
def test_native_templates_see_call_ids_mistral_templates_accept(call_id: str) -> None:
    # Before: our ids ("call_" and 24 hex digits) and Anthropic's reached the template as they
    # were, and Mistral's templates refused every agent turn after a call with a 400.
    msgs = [
        ChatMessage(role="user", content="Weather?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [{"id": call_id, "function": {"name": "get_weather"}}],
            }
        ),
        ChatMessage(role="tool", content="rainy", tool_call_id=call_id),
    ]
    native = template_messages(msgs, native=True)
    text = render_chat(MISTRAL_IDS, native, bos_token="", eos_token="")
    shown = template_id(call_id)
    assert text == f"[CALL_ID]{shown}[TOOL_RESULTS]{shown}"
    assert shown == call_id if len(call_id) == 9 else len(shown) == 9 and shown.isalnum()


def test_two_call_ids_are_never_shown_to_a_template_as_one() -> None:
    # Before: an id of 9 letters and digits went to the template as it was, any other as 9
    # hex digits of its hash, so "call_a" and an id that was those 9 digits (or two ids
    # whose hashes start alike) were one id to the model, and it could not tell whose result
    # was whose.
    clash = template_id("call_a")

    def call(call_id: str) -> ChatMessage:
        return ChatMessage.model_validate(
            {"role": "assistant", "tool_calls": [{"id": call_id, "function": {"name": "f"}}]}
        )

    msgs = [
        ChatMessage(role="user", content="go"),
        call("call_a"),
        ChatMessage(role="tool", content="first", tool_call_id="call_a"),
        call(clash),
        ChatMessage(role="tool", content="second", tool_call_id=clash),
    ]
    native = template_messages(msgs, native=True)
    shown = [m["tool_calls"][0]["id"] for m in native if "tool_calls" in m]  # type: ignore[index]
    assert shown[0] == clash and shown[1] != clash
    assert len(shown[1]) == 9 and shown[1].isalnum()
    assert [m["tool_call_id"] for m in native if m["role"] == "tool"] == shown
    # The start of a conversation is shown as before when it grows (the cache's prefix).
    assert template_messages(msgs[:3], native=True) == native[:3]


def test_calls_without_ids_are_told_apart() -> None:
    # Before: a call with no id was shown as "call_<its place in the turn>", so the first
    # call of every turn had one id, and the model saw each turn answer the same call.
    def call() -> ChatMessage:
        return ChatMessage.model_validate(
            {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}
        )

    msgs = [ChatMessage(role="user", content="go"), call(), call()]
    native = template_messages(msgs, native=True)
    first, second = (m["tool_calls"][0]["id"] for m in native[1:])  # type: ignore[index]
    assert first != second


@pytest.mark.parametrize("renders", [False, True])
def test_a_plan_that_parses_calls_preserves_their_markers(renders: bool) -> None:
    """Where calls are parsed, every marker the parser reads is kept in the reply's text (a
    control token's otherwise is not: ``tests/server/test_preserved_markers_model.py``);
    where nothing is parsed, none is."""
    from kvwarm.server import convert
    from kvwarm.server.schemas import SamplingFields

    ask = [ChatMessage(role="user", content="hi")]
    for choice, kept in [("auto", CALL_MARKERS), ("required", CALL_MARKERS), ("none", ())]:
        plan = plan_chat(ask, [WEATHER], choice, renders_tools=renders)
        assert plan.preserved == kept
    assert plan_chat(ask, None, None, renders_tools=renders).preserved == ()
    assert {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<tool_call>"} <= set(
        CALL_MARKERS
    )
    opts = convert.options(
        SamplingFields(),
        default_max_tokens=8,
        max_tokens_limit=8,
        over_limit="cap",
        preserved=CALL_MARKERS,
    )
    assert opts.preserved_tokens == CALL_MARKERS
