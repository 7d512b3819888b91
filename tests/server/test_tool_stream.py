"""Tool calls streamed as OpenAI streams them (server/tool_stream.py): pure, no server."""

from __future__ import annotations

import itertools
import json
import logging

import hypothesis
import pytest
from hypothesis import strategies as st

from kvwarm.server.tool_stream import ContentJoin, ToolStream, call_delta
from kvwarm.server.tools import Part, ToolCall, content_of, parse_tool_calls, reply_parts

NAMES = frozenset({"get_weather", "get_time"})


class Client:
    """What an OpenAI client sees of a stream: its content and its call deltas, in order."""

    def __init__(self) -> None:
        self.join = ContentJoin()
        self.content = ""
        self.deltas: list[dict[str, object]] = []

    def take(self, parts: list[Part]) -> tuple[str, list[dict[str, object]]]:
        text, deltas = "", []
        for part in parts:
            text += self.join(part)
            if isinstance(part, ToolCall):
                deltas.append(call_delta(len(self.deltas) + len(deltas), part))
        self.content += text
        self.deltas += deltas
        return text, deltas


def _run(
    fragments: list[str], *, forced: bool = False, single: bool = False
) -> tuple[str, list[dict[str, object]]]:
    """(all content shown, every call delta in order) for a reply fed in ``fragments``."""
    stream = ToolStream(NAMES, forced=forced, single=single)
    client = Client()
    for fragment in fragments:
        client.take(stream.feed(fragment))
    client.take(stream.finish()[0])
    return client.content, client.deltas


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
    client = Client()
    closed = reply.index("</tool_call>") + len("</tool_call>")  # the block is closed here
    early = [d for ch in reply[: closed - 1] for d in client.take(stream.feed(ch))[1]]
    assert early == []  # nothing of the call before it is known to parse
    (header,) = client.take(stream.feed(reply[closed - 1 : closed]))[1]
    assert header["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}
    rest, parts = stream.finish()
    assert rest == [] and stream.any_call
    assert client.content == "Sure."  # as it came, less the space the call's block strips
    assert isinstance(parts[1], ToolCall) and parts[1].id == header["id"]


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
    assert all(stream.feed(ch) == [] for ch in reply)
    client = Client()
    client.take(stream.finish()[0])
    assert client.content == "" and stream.any_call
    ((_, name, args),) = _assemble(client.deltas)
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
    assert content == "Sure."
    assert [n for _, n, _ in _assemble(deltas)] == ["get_weather"]


def test_releases_a_false_alarm_at_the_end() -> None:
    content, deltas = _run(["a < b and <tool", "s> are fine "])
    assert deltas == [] and content == "a < b and <tools> are fine "


def test_a_call_cut_off_before_its_arguments_close_is_not_a_call() -> None:
    # max_tokens ends the reply inside its call: no call, so nothing of one went out, and the
    # finish reason is the non-streamed one ("length"), not "tool_calls".
    stream = ToolStream(NAMES, forced=False)
    assert stream.feed('<tool_call>{"name": "get_weather", "arguments": {"ci') == []
    rest, parts = stream.finish()
    assert not stream.any_call
    assert rest == parts == ['<tool_call>{"name": "get_weather", "arguments": {"ci']


def test_single_reports_only_the_first_of_two_calls() -> None:
    # Parallel calls off: the second call is neither streamed nor reported by finish.
    reply = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, deltas = _run(_chars(reply), single=True)
    assert content == ""
    assert [(n, a) for _, n, a in _assemble(deltas)] == [("get_weather", {"city": "Oslo"})]


def test_without_tools_passes_everything_through() -> None:
    stream = ToolStream(frozenset(), forced=False)
    assert stream.feed("<tool_call> ") == ["<tool_call> "]
    assert stream.finish() == ([], ["<tool_call> "])


W = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
T = '{"name": "get_time", "arguments": {}}'
RM = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
#: Replies with text after (and between) calls, and their parts: texts, and calls by name.
AFTER_CALLS = {
    f"Sure.<tool_call>{W}</tool_call>Done.": ["Sure.", "get_weather", "Done."],
    f"Sure.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>{T}</tool_call>\nBoth asked. ": [
        "Sure.",
        "get_weather",
        "get_time",
        "Both asked.",
    ],
    f"<tool_call>{W}</tool_call>\n\nNow the time: <tool_call>{T}</tool_call> and wait.": [
        "get_weather",
        "Now the time:",
        "get_time",
        "and wait.",
    ],
    f"{RM} x <tool_call>{W}</tool_call>y": [f"{RM} x", "get_weather", "y"],
    f"[TOOL_CALLS][{W}, {T}] Asked both.": ["get_weather", "get_time", "Asked both."],
    f"<|python_tag|>{W}; {T}\nAsked.": ["get_weather", "get_time", "Asked."],
    "<function=get_weather>{}</function>\nthen <function=get_time>{}</function> end": [
        "get_weather",
        "then",
        "get_time",
        "end",
    ],
    f"{W}\nWaiting for it.": ["get_weather", "Waiting for it."],
    f"  Leading. <tool_call>{W}</tool_call>": ["  Leading.", "get_weather"],
    # Mistral's newer format (Small 3.2, Devstral): name[CALL_ID]id[ARGS]{...}, one by one.
    '[TOOL_CALLS]get_weather[CALL_ID]123456789[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time'
    "[ARGS]{}\nAsked.": ["get_weather", "get_time", "Asked."],
    # A block never closed: its call, then the text after it.
    f"<tool_call>\n{W}\nI will wait.": ["get_weather", "I will wait."],
    f"<tool_call>{W}</tool_call> x": ["get_weather", "x"],
    f"<tool_call>{W} x</tool_call>": [f"<tool_call>{W} x</tool_call>"],  # closed: all or none
    "no calls at all \n": ["no calls at all \n"],
}


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("reply", sorted(AFTER_CALLS))
def test_text_after_a_call_is_kept_and_the_stream_is_the_whole_reply(
    reply: str, single: bool
) -> None:
    # Before: everything after a reply's first call marker that was no call was dropped, in
    # every API ("Sure.<tool_call>…</tool_call>Done." came back as "Sure." and the call).
    parts = reply_parts(reply, NAMES, single=single)
    if not single:
        assert [p.name if isinstance(p, ToolCall) else p for p in parts] == AFTER_CALLS[reply]
    content, calls = content_of(parts), [p for p in parts if isinstance(p, ToolCall)]
    # Fed a character at a time or in one piece, the stream sends the same as the whole reply.
    for fragments in (_chars(reply), [reply]):
        stream = ToolStream(NAMES, forced=False, single=single)
        client = Client()
        for fragment in fragments:
            client.take(stream.feed(fragment))
        rest, whole = stream.finish()
        client.take(rest)
        assert client.content == content
        assert [(n, a) for _, n, a in _assemble(client.deltas)] == [
            (c.name, json.loads(c.arguments)) for c in calls
        ]
        # The whole reply as finish gives it: the same parts, the calls with the streamed ids.
        assert [p if isinstance(p, str) else p.name for p in whole] == [
            p if isinstance(p, str) else p.name for p in parts
        ]
        assert [p.id for p in whole if isinstance(p, ToolCall)] == [
            str(d["id"]) for d in client.deltas
        ]


def test_text_after_a_call_keeps_its_place() -> None:
    reply = f"Sure.\n<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>\nBoth asked."
    assert parse_tool_calls(reply, NAMES)[0] == "Sure.\n\nBoth asked."
    # Parallel calls off: the second call goes, the texts it stood between join as calls' do.
    text = f"A<tool_call>{W}</tool_call>B<tool_call>{T}</tool_call>C"
    single = reply_parts(text, NAMES, single=True)
    assert [p if isinstance(p, str) else p.name for p in single] == ["A", "get_weather", "B\n\nC"]


PIECES = [
    "Sure.",
    " ",
    "\n",
    "Done",
    "<tool_call>",
    "</tool_call>",
    W,
    T,
    '{"name": "rm_rf", "arguments": {}}',
    "[TOOL_CALLS]",
    "get_weather[ARGS]",
    "<|python_tag|>",
    "<function=get_time>",
    "</function>",
    "{",
    "}",
    "[",
    "<tool",
    ";",
]


@hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
@hypothesis.given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    single=st.booleans(),
)
def test_any_reply_streams_as_the_whole_reply(
    pieces: list[str], cuts: list[int], single: bool
) -> None:
    # The stream's invariant over replies made of markers, calls, JSON and text in any order,
    # cut into fragments anywhere: what goes out is the whole reply's content and calls.
    reply = "".join(pieces)
    bounds = sorted({0, len(reply), *(c for c in cuts if c < len(reply))})
    fragments = [reply[a:b] for a, b in itertools.pairwise(bounds)]
    parts = reply_parts(reply, NAMES, single=single)
    stream = ToolStream(NAMES, forced=False, single=single)
    client = Client()
    for fragment in fragments:
        client.take(stream.feed(fragment))
    rest, whole = stream.finish()
    client.take(rest)
    assert client.content == content_of(parts)
    assert [(n, a) for _, n, a in _assemble(client.deltas)] == [
        (p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)
    ]
    assert [p if isinstance(p, str) else p.name for p in whole] == [
        p if isinstance(p, str) else p.name for p in parts
    ]


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=24),
    single=st.booleans(),
    by_char=st.booleans(),
)
def test_the_parts_sent_are_the_whole_replys_parts(
    pieces: list[str], single: bool, by_char: bool
) -> None:
    # The stream parses a reply from its last call on and sends a text's new end as it is
    # (the work per fragment is the fragment's): the parts it sends, pieces of a text joined,
    # are the whole reply's, part for part, and it never finds them to differ (log.error).
    reply = "".join(pieces)
    stream = ToolStream(NAMES, forced=False, single=single)
    sent: list[Part] = []
    errors: list[str] = []
    handler = _Errors(errors)
    logging.getLogger("kvwarm.server.tool_stream").addHandler(handler)
    try:
        for fragment in _chars(reply) if by_char else pieces:
            for part in [*stream.feed(fragment)]:
                _join(sent, part)
        rest, whole = stream.finish()
    finally:
        logging.getLogger("kvwarm.server.tool_stream").removeHandler(handler)
    for part in rest:
        _join(sent, part)
    expected = reply_parts(reply, NAMES, single=single)
    assert [p if isinstance(p, str) else p.name for p in sent] == [
        p if isinstance(p, str) else p.name for p in expected
    ]
    assert sent == whole
    assert errors == []


class _Errors(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def _join(sent: list[Part], part: Part) -> None:
    """A part sent, as a client puts the stream together: a text piece goes on the text sent
    last (a text after a call starts a new one)."""
    if isinstance(part, str) and sent and isinstance(sent[-1], str):
        sent[-1] += part
    else:
        sent.append(part)


def _count(monkeypatch: pytest.MonkeyPatch, module: object, name: str, calls: list[str]) -> None:
    real = getattr(module, name, None)
    if real is None:
        return

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_a_long_reply_is_not_parsed_again_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, every token re-parsed the whole reply so far (every call in it again, with
    # fresh ids): a 5,000-token reply with a call every 100 tokens took ~100 µs a token,
    # growing with the reply. Now a reply is parsed again only where a block closes or a
    # text starts, and from its last call on.
    import kvwarm.server.tool_stream as tool_stream
    import kvwarm.server.tools as tools

    parses: list[str] = []
    for name in ("reply_parts", "parts_of_spans"):
        _count(monkeypatch, tool_stream, name, parses)
    made: list[str] = []
    _count(monkeypatch, tools, "_as_call", made)
    stream = ToolStream(NAMES, forced=False)
    for _ in range(2000):  # plain text with tools declared
        stream.feed(" word")
    assert len(parses) <= 3, len(parses)
    parses.clear()
    for _ in range(20):  # twenty calls, each followed by a hundred tokens of text
        stream.feed(f"<tool_call>{W}</tool_call>")
        for _ in range(100):
            stream.feed(" and")
    _, whole = stream.finish()
    assert sum(isinstance(p, ToolCall) for p in whole) == 20
    assert len(made) <= 2 * 20, len(made)  # each call parsed once as it closes (+ finish)
    assert len(parses) <= 4 * 20, len(parses)


def test_a_broken_invariant_logs_no_reply_text_at_error(caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: a streamed reply that differed from the whole reply was logged whole,
    a user's text, at ERROR; the text is now logged at DEBUG alone."""
    stream = ToolStream(frozenset(), forced=False)
    secret = "my card number is 4111"
    stream.feed(secret)
    stream._sent = ["something else"]  # what a broken parser would have sent before
    with caplog.at_level(logging.ERROR, logger="kvwarm.server.tool_stream"):
        stream._extend(["entirely different"], 0)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all(secret not in r.getMessage() for r in errors)
