"""Tool calls streamed as OpenAI streams them (server/tool_stream.py): pure, no server."""

from __future__ import annotations

import json

import pytest

from kvwarm.server.tool_stream import ToolStream

NAMES = frozenset({"get_weather", "get_time"})


def _run(fragments: list[str], *, forced: bool = False) -> tuple[str, list[dict[str, object]]]:
    """(all content shown, every call delta in order) for a reply fed in ``fragments``."""
    stream = ToolStream(NAMES, forced=forced)
    shown, deltas = "", []
    for fragment in fragments:
        text, calls = stream.feed(fragment)
        shown += text
        deltas += calls
    rest, calls, _ = stream.finish()
    return shown + rest, deltas + calls


def _assemble(deltas: list[dict[str, object]]) -> list[tuple[str, str, object]]:
    """What an OpenAI client builds from the deltas: (id, name, parsed arguments) per call."""
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        index = delta["index"]
        assert isinstance(index, int)
        fn = delta["function"]
        assert isinstance(fn, dict)
        if "id" in delta:
            assert index not in calls and delta["type"] == "function"
            calls[index] = {"id": str(delta["id"]), "name": fn["name"], "args": ""}
        calls[index]["args"] += fn["arguments"]
    return [(c["id"], c["name"], json.loads(c["args"])) for _, c in sorted(calls.items())]


def _chars(text: str) -> list[str]:
    return list(text)


def test_hermes_call_goes_out_whole_once_it_parses() -> None:
    reply = (
        "Sure. <tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    )
    stream = ToolStream(NAMES, forced=False)
    closed = reply.index("}}") + 2  # the call's JSON is complete here
    early = [d for ch in reply[: closed - 1] for d in stream.feed(ch)[1]]
    assert early == []  # nothing of the call before it is known to parse
    (header,) = stream.feed(reply[closed - 1 : closed])[1]
    assert header["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}
    assert [d for ch in reply[closed:] for d in stream.feed(ch)[1]] == []
    rest, calls, any_call = stream.finish()
    assert rest == ""  # "Sure. " went out as it came
    assert calls == [] and any_call


@pytest.mark.parametrize(
    "reply",
    [
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # forced / bare JSON
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        '<function=get_weather>{"city": "Oslo"}</function>',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    ],
)
def test_other_formats_are_sent_by_finish(reply: str) -> None:
    # A later marker or value could still make these content: only the whole reply decides.
    stream = ToolStream(NAMES, forced=reply.startswith("{"))
    assert all(stream.feed(ch) == ("", []) for ch in reply)
    rest, calls, any_call = stream.finish()
    assert rest == "" and any_call
    ((_, name, args),) = _assemble(calls)
    assert name == "get_weather" and args == {"city": "Oslo"}


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo",}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": NaN}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": "{city}"}</tool_call>',
        '{"name": "get_weather", "arguments": {"city": "Oslo"}} {"not": "a call"}',
    ],
)
def test_a_call_that_never_parses_is_content_and_no_delta(reply: str) -> None:
    # Before: the header and argument fragments went out, then the reply finished as content.
    content, deltas = _run(_chars(reply))
    assert deltas == [] and content == reply


def test_two_calls_keep_their_indexes() -> None:
    reply = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    )
    _, deltas = _run(_chars(reply))
    assert [(n, a) for _, n, a in _assemble(deltas)] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert {d["index"] for d in deltas} == {0, 1}


def test_string_arguments_are_sent_parsed() -> None:
    reply = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    )
    _, deltas = _run(_chars(reply))
    ((_, name, args),) = _assemble(deltas)
    assert name == "get_weather" and args == {"city": "Oslo"}


def test_undeclared_tool_is_content_and_never_streamed() -> None:
    reply = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    content, deltas = _run(_chars(reply))
    assert deltas == [] and content == reply


def test_shows_text_but_holds_back_a_call() -> None:
    content, deltas = _run(
        ["Sure", ". <tool", '_call>{"name": "get_weather"', ', "arguments": {}}</tool_call>']
    )
    assert content == "Sure. "
    assert [n for _, n, _ in _assemble(deltas)] == ["get_weather"]


def test_releases_a_false_alarm_at_the_end() -> None:
    stream = ToolStream(NAMES, forced=False)
    shown = stream.feed("a < b and <tool")[0] + stream.feed("s> are fine")[0]
    rest, calls, any_call = stream.finish()
    assert calls == [] and not any_call and shown + rest == "a < b and <tools> are fine"


def test_a_call_cut_off_before_its_arguments_close_is_not_a_call() -> None:
    # max_tokens ends the reply inside its call: no call, so nothing of one went out, and the
    # finish reason is the non-streamed one ("length"), not "tool_calls".
    stream = ToolStream(NAMES, forced=False)
    _, deltas = stream.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert deltas == []
    rest, calls, any_call = stream.finish()
    assert calls == [] and not any_call
    assert rest == '<tool_call>{"name": "get_weather", "arguments": {"ci'


def test_single_reports_only_the_first_of_two_calls() -> None:
    # Parallel calls off: the second call is neither streamed nor reported by finish.
    reply = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    stream = ToolStream(NAMES, forced=False, single=True)
    deltas = [d for ch in reply for d in stream.feed(ch)[1]]
    rest, calls, any_call = stream.finish()
    assert rest == "" and any_call
    assert [(n, a) for _, n, a in _assemble(deltas + calls)] == [("get_weather", {"city": "Oslo"})]


def test_without_tools_passes_everything_through() -> None:
    stream = ToolStream(frozenset(), forced=False)
    assert stream.feed("<tool_call>") == ("<tool_call>", [])
    assert stream.finish() == ("", [], False)
