"""tool_choice auto's lazy grammar (``tools.LazyCalls``): which plans get one, what its grammar
admits (read without a model, ``gbnfkit``), which templates' call formats it holds (the
``call_format`` probe), and how it reaches the engine's options (``convert.options``). The
grammar's effect on a real model: ``test_live_openai.py``; on the samplers:
``tests/backends/test_lazy_grammar.py``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence

import pytest
from fastapi.testclient import TestClient
from tests.backends.gbnfkit import accepts

from kvwarm.backends.chat_template import render_chat
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import GrammarError
from kvwarm.server import convert
from kvwarm.server.chat import call_format
from kvwarm.server.schemas import AllowedToolsChoice, ChatMessage, ChatRequest, Tool
from kvwarm.server.tools import (
    CallGrammar,
    LazyCalls,
    call_grammar,
    parse_tool_calls,
    plan_chat,
)

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
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
)
CLOCK = Tool.model_validate({"type": "function", "function": {"name": "now"}})
ASK = [ChatMessage(role="user", content="Weather in Paris?")]


def _block(name: str, arguments: object, *, around: str = "") -> str:
    call = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>{around}{call}{around}</tool_call>"


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (_block("get_weather", {"location": "Paris", "days": 3}, around="\n"), True),
        (_block("now", {}), True),
        (_block("get_weather", {"location": "Paris", "days": "3"}), False),
        (_block("get_weather", {"city": "Paris", "days": 3}), False),
        (_block("get_weather", {"location": "Paris"}), False),
        (_block("get_weather", {"location": "Paris", "days": 9}), False),
        (_block("rm_rf", {}), False),
        (_block("now", {}).removesuffix("</tool_call>"), False),  # the block is closed
        (_block("now", {}) + " more", False),  # then the reply is free: no more of the grammar
    ],
)
def test_the_hermes_grammar_admits_calls_of_the_tools_with_valid_arguments(
    text: str, ok: bool
) -> None:
    assert accepts(call_grammar("hermes", [WEATHER, CLOCK]), text) is ok


def _listed(*calls: tuple[str, object, str | None], space: str = "") -> str:
    items = [
        {"name": name, "arguments": args, **({"id": id_} if id_ else {})}
        for name, args, id_ in calls
    ]
    return "[TOOL_CALLS]" + space + json.dumps(items)


PARIS = {"location": "Paris", "days": 3}


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (_listed(("get_weather", PARIS, None)), True),
        (_listed(("get_weather", PARIS, "a1B2c3D4e"), ("now", {}, None), space=" "), True),
        (_listed(("get_weather", PARIS, "short")), False),  # an id is 9 letters and digits
        (_listed(("get_weather", {"location": "Paris"}, None)), False),
        (_listed(("rm_rf", {}, None)), False),
        ("[TOOL_CALLS][]", False),
    ],
)
def test_the_mistral_list_grammar(text: str, ok: bool) -> None:
    assert accepts(call_grammar("mistral-list", [WEATHER, CLOCK]), text) is ok


def test_the_mistral_list_grammar_holds_one_call_with_parallel_calls_off() -> None:
    grammar = call_grammar("mistral-list", [WEATHER, CLOCK], once=True)
    assert accepts(grammar, _listed(("now", {}, None)))
    assert not accepts(grammar, _listed(("now", {}, None), ("now", {}, None)))


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('[TOOL_CALLS]get_weather[ARGS]{"location": "Paris", "days": 3}', True),
        ("[TOOL_CALLS]now[CALL_ID]a1B2c3D4e[ARGS]{}", True),
        ('[TOOL_CALLS]get_weather[ARGS]{"location": "Paris", "days": 30}', False),
        ("[TOOL_CALLS]get_time[ARGS]{}", False),
        ("[TOOL_CALLS]now[CALL_ID]abc[ARGS]{}", False),
    ],
)
def test_the_mistral_args_grammar(text: str, ok: bool) -> None:
    assert accepts(call_grammar("mistral-args", [WEATHER, CLOCK]), text) is ok


def _llama(name: str, arguments: object, *, key: str = "parameters", tag: str = "") -> str:
    return tag + json.dumps({"name": name, key: arguments})


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (_llama("get_weather", PARIS), True),
        (_llama("now", {}, key="arguments"), True),
        (_llama("now", {}, tag="<|python_tag|>"), True),
        ('{"type": "function", "name": "now", "parameters": {}}', True),
        ('{\n    "name": "now",\n    "parameters": {}\n}', True),
        (_llama("get_weather", {"location": "Paris", "days": 30}), False),
        (_llama("get_weather", {"location": "Paris"}), False),
        (_llama("rm_rf", {}), False),
        ('{"parameters": {}, "name": "now"}', False),  # Llama's order: the name first
        (_llama("now", {}) + " more", False),  # then the reply is free
    ],
)
def test_the_llama3_json_grammar(text: str, ok: bool) -> None:
    assert accepts(call_grammar("llama3-json", [WEATHER, CLOCK]), text) is ok


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('<function=get_weather>{"location": "Paris", "days": 3}</function>', True),
        ("<function=now>\n{}\n</function>", True),
        ('<function=get_weather>{"location": "Paris", "days": 0}</function>', False),
        ("<function=rm_rf>{}</function>", False),
        ("<function=now>{}", False),  # closed
        ("<function=now>{}</function> more", False),
    ],
)
def test_the_function_tag_grammar(text: str, ok: bool) -> None:
    assert accepts(call_grammar("function-tag", [WEATHER, CLOCK]), text) is ok


def test_the_llama3_json_grammar_holds_a_name_as_the_model_writes_it() -> None:
    """A name beyond ASCII as itself (JSON's escape is no model's habit), one with a quote
    escaped as JSON must."""
    odd = [
        Tool.model_validate({"type": "function", "function": {"name": name}})
        for name in ("météo", 'say"hi')
    ]
    grammar = call_grammar("llama3-json", odd)
    assert accepts(grammar, '{"name": "météo", "parameters": {}}')
    assert accepts(grammar, '{"name": "say\\"hi", "parameters": {}}')
    assert not accepts(grammar, '{"name": "m\\u00e9t\\u00e9o", "parameters": {}}')


def test_the_llama3_json_calls_start_at_the_replys_start_or_the_python_tag() -> None:
    """The reply that begins as a call (llama.cpp's PATTERN_FULL trigger for Llama 3.x) is
    matched by the start pattern; one that begins otherwise, or a tool's JSON later, is not."""
    import re

    held = LazyCalls((WEATHER,), "llama3-json", once=False).grammar()
    assert held.triggers == ("<|python_tag|>",)
    (start,) = held.starts
    pattern = re.compile(start.encode())
    for reply in (b'{"name"', b' \n{ "name"', b'{"type": "function", "name"'):
        match = pattern.match(reply)
        assert match is not None and reply[match.start(1) :].startswith(b"{"), reply
    for reply in (b'{"answer": 1, "name"', b'Sure: {"name"', b"[{", b'{"nam'):
        assert pattern.match(reply) is None, reply
    tag = LazyCalls((WEATHER,), "function-tag", once=True).grammar()
    assert tag.triggers == ("<function=",) and tag.starts == () and tag.once


def test_each_held_format_parses_back_to_its_calls() -> None:
    """What a grammar admits, the reply parser reads as the same calls."""
    names = frozenset({"get_weather", "now"})
    for text in (
        _block("get_weather", PARIS),
        _listed(("get_weather", PARIS, "a1B2c3D4e")),
        '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris", "days": 3}',
        _llama("get_weather", PARIS),
        _llama("get_weather", PARIS, key="arguments", tag="<|python_tag|>"),
        '<function=get_weather>{"location": "Paris", "days": 3}</function>',
    ):
        content, calls = parse_tool_calls(text, names)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", PARIS)
        ], text


def test_auto_plans_a_lazy_call_grammar_for_the_formats_it_holds() -> None:
    described = plan_chat(ASK, [WEATHER], "auto", renders_tools=False)
    assert described.lazy is not None and described.lazy.format == "hermes"
    assert not described.lazy.once and described.json_schema is None
    single = plan_chat(ASK, [WEATHER], None, renders_tools=False, parallel=False)
    assert single.lazy is not None and single.lazy.once  # parallel calls off: one, then the end
    native = plan_chat(ASK, [WEATHER], "auto", renders_tools=True, native_format="hermes")
    assert native.lazy is not None
    # A native format kvwarm has no grammar for: the calls are as the model writes them.
    assert plan_chat(ASK, [WEATHER], "auto", renders_tools=True).lazy is None
    # Mistral's name[ARGS] format with a name its parser could not read back: none either.
    odd = Tool.model_validate({"type": "function", "function": {"name": "get weather"}})
    args = plan_chat(ASK, [WEATHER], "auto", renders_tools=True, native_format="mistral-args")
    assert args.lazy is not None and args.lazy.grammar().triggers == ("[TOOL_CALLS]",)
    odd_plan = plan_chat(ASK, [odd], "auto", renders_tools=True, native_format="mistral-args")
    assert odd_plan.lazy is None
    tag = plan_chat(ASK, [odd], "auto", renders_tools=True, native_format="function-tag")
    assert tag.lazy is None  # <function=get weather> neither
    llama = plan_chat(ASK, [odd], "auto", renders_tools=True, native_format="llama3-json")
    assert llama.lazy is not None  # a JSON string holds any name
    # Forced calls have their whole-reply schema; none, no tools.
    assert plan_chat(ASK, [WEATHER], "required", renders_tools=False).lazy is None
    assert plan_chat(ASK, [WEATHER], "none", renders_tools=False).lazy is None
    assert plan_chat(ASK, None, "auto", renders_tools=False).lazy is None


def test_allowed_tools_in_auto_mode_hold_only_the_allowed_ones() -> None:
    from kvwarm.server.chat import allowed_tools

    allowed = {"mode": "auto", "tools": [{"type": "function", "function": {"name": "now"}}]}
    choice = AllowedToolsChoice.model_validate({"type": "allowed_tools", "allowed_tools": allowed})
    tools, mode = allowed_tools([WEATHER, CLOCK], choice)
    lazy = plan_chat(ASK, tools, mode, renders_tools=False).lazy
    assert lazy is not None
    grammar = lazy.grammar().grammar
    assert accepts(grammar, '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    weather = (
        '<tool_call>{"name": "get_weather", "arguments": {"location": "X", "days": 1}}</tool_call>'
    )
    assert not accepts(grammar, weather)


def _options(
    body: Mapping[str, object], lazy_tools: Sequence[Tool] = (WEATHER,), *, once: bool = False
) -> GenerationOptions:
    req = ChatRequest.model_validate({"model": "a", "messages": [{"role": "user"}], **body})
    plan = plan_chat(ASK, list(lazy_tools), "auto", renders_tools=False, parallel=not once)
    return convert.options(
        req,
        default_max_tokens=16,
        max_tokens_limit=64,
        over_limit="error",
        json_schema=convert.response_schema(req.response_format),
        calls=plan.lazy.grammar() if plan.lazy is not None else None,
    )


def test_the_lazy_grammar_reaches_the_options_unless_the_reply_is_constrained_whole() -> None:
    opts = _options({})
    assert opts.grammar_triggers == ("<tool_call>",) and not opts.grammar_once
    assert str(opts.grammar).startswith('root ::= "<tool_call>"')
    # The client's own grammar, or a response format, constrains the whole reply: it wins.
    own = _options({"grammar": 'root ::= "x"'})
    assert own.grammar == 'root ::= "x"' and own.grammar_triggers == ()
    # Parallel calls off: the reply ends after its call, unless it may not end (ignore_eos).
    assert _options({}, once=True).grammar_once
    assert not _options({"ignore_eos": True}, once=True).grammar_once
    fmt = _options({"response_format": {"type": "json_object"}})
    assert fmt.grammar is None and fmt.grammar_triggers == ()
    assert fmt.grammar_start_patterns == () and opts.grammar_start_patterns == ()
    req = ChatRequest.model_validate({"model": "a", "messages": [{"role": "user"}]})
    llama = LazyCalls((WEATHER,), "llama3-json", once=False).grammar()
    held = convert.options(
        req, default_max_tokens=16, max_tokens_limit=64, over_limit="error", calls=llama
    )
    assert held.grammar_start_patterns == llama.starts and held.grammar == llama.grammar


def test_a_schema_the_grammar_cannot_hold_is_the_same_error_as_a_forced_calls() -> None:
    remote = Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"$ref": "https://example.com/x.json"}},
                },
            },
        }
    )
    with pytest.raises(GrammarError):
        _options({}, [remote])


QWEN_LIKE = (
    "{% for m in messages %}{% if m.tool_calls %}<|im_start|>assistant"
    "{% for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
)
# Mistral Nemo's way: the function as JSON, its last brace cut for the id.
MISTRAL_LIST = (
    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]["
    "{% for c in m.tool_calls %}{% set out = c.function | tojson %}"
    '{{ out[:-1] }}, "id": "{{ c.id }}"}{% endfor %}]</s>'
    "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}"
)
# Mistral Small 3.2's way.
MISTRAL_ARGS = (
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}"
    "</s>{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}"
)
LLAMA3_LIKE = (
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
)
# Llama 3.1's official template's way, or a functionary-style Llama 3.1 one's.
FUNCTION_TAG = (
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<function={{ c.function.name }}>{{ c.function.arguments | tojson }}</function>"
    "{% endfor %}<|eom_id|>{% else %}{{ m.content }}{% endif %}{% endfor %}"
)
# Functionary v3.1's way: the tag joined to tojson's Markup, which escapes it in the sandbox.
FUNCTIONARY = (
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '<function=' + c.function.name + '>' + c.function.arguments | tojson + '</function>' }}"
    "{% endfor %}<|eom_id|>{% else %}{{ m.content }}{% endif %}{% endfor %}"
)
# Tools as the sandbox's tojson writes them (sorted: "name" then "parameters", as a call's), no
# call: not Llama's format.
TOOLS_ONLY = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
REFUSES = "{{ raise_exception('no calls here') }}"


class _Template:
    """What ``call_format`` asks of a model: its template rendered."""

    def __init__(self, source: str) -> None:
        self.source = source

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return render_chat(
            self.source,
            messages,
            bos_token="",
            eos_token="",
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )


@pytest.mark.parametrize(
    ("source", "found"),
    [
        (QWEN_LIKE, "hermes"),
        (MISTRAL_LIST, "mistral-list"),
        (MISTRAL_ARGS, "mistral-args"),
        (LLAMA3_LIKE, "llama3-json"),
        (FUNCTION_TAG, "function-tag"),
        (FUNCTIONARY, "function-tag"),
        (TOOLS_ONLY, None),
        (REFUSES, None),
    ],
)
def test_a_native_templates_call_format_is_read_from_a_call_it_renders(
    source: str, found: str | None
) -> None:
    model = _Template(source)
    assert call_format(model) == found  # type: ignore[arg-type]
    assert call_format(model) == found  # type: ignore[arg-type]  # remembered


#: Schemas a call's grammar cannot hold: a remote ``$ref`` (the converter refuses it), a
#: ``required`` name with no property, and
#: arrays of arrays of alternatives, whose grammar converts but is past ``cheap_grammar``'s
#: ambiguity bound (more than 1,000,000 derivations: the 400 came from the engine's submit).
_UNHELD: dict[str, dict[str, object]] = {
    # A common slip in real tool definitions: a required property left undeclared (the
    # converter would drop it: refused since samplerev, and so every auto request was a 400).
    "required-undeclared": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city", "unit"],
    },
    "remote-ref": {"type": "object", "properties": {"x": {"$ref": "https://example.com/x.json"}}},
    "too-ambiguous": {
        "type": "object",
        "properties": {
            "x": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "array",
                            "items": {
                                "anyOf": [
                                    {"type": "string"},
                                    {"type": "number"},
                                    {"type": "object"},
                                ]
                            },
                        },
                    },
                },
            }
        },
    },
}


def recorded_options(monkeypatch: pytest.MonkeyPatch) -> list[GenerationOptions]:
    """The engine options each request is converted to from now on, in order."""
    seen: list[GenerationOptions] = []
    options = convert.options

    def recorded(*args: object, **kwargs: object) -> GenerationOptions:
        opts = options(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(opts)
        return opts

    monkeypatch.setattr(convert, "options", recorded)
    return seen


@pytest.mark.parametrize("unheld", sorted(_UNHELD))
def test_a_schema_the_grammar_cannot_hold_is_a_400_when_forced_and_free_calls_under_auto(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, unheld: str
) -> None:
    """A forced call must be held: its schema's grammar failing is the 400. Under auto
    nothing must be: found by review, such a request was the same 400 on every chat API,
    where OpenAI and llama-server answer it and kvwarm did before auto's calls were held;
    now its calls are as the model writes them (no grammar), as in a format without one."""
    seen = recorded_options(monkeypatch)
    params = _UNHELD[unheld]
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    ask = [{"role": "user", "content": "hi"}]
    body = {"model": "a", "messages": ask, "tools": [tool]}
    forced = client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert forced.status_code == 400, forced.json()
    assert forced.json()["error"]["code"] == "invalid_grammar"
    seen.clear()
    bodies = {
        "/v1/chat/completions": {**body, "tool_choice": "auto"},
        "/v1/messages": {
            "model": "a",
            "messages": ask,
            "tools": [{"name": "f", "input_schema": params}],
            "max_tokens": 4,
        },
        "/v1/responses": {
            "model": "a",
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": params}],
        },
    }
    for route, auto in bodies.items():
        response = client.post(route, json=auto)
        assert response.status_code == 200, (route, response.json())
    assert len(seen) == 3
    assert all(o.grammar is None and o.grammar_triggers == () for o in seen)
    # Counting a request's tokens decodes nothing: no grammar is built for it.
    assert client.post("/v1/messages/count_tokens", json=bodies["/v1/messages"]).status_code == 200


def test_every_chat_api_decodes_auto_calls_under_the_lazy_grammar(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenAI chat, Anthropic messages, OpenAI responses: each request's engine options carry
    the call grammar, started by ``<tool_call>`` (the stub's template describes tools)."""
    seen = recorded_options(monkeypatch)
    params = WEATHER.function.parameters
    ask = [{"role": "user", "content": "Weather?"}]
    bodies = {
        "/v1/chat/completions": {"messages": ask, "tools": [WEATHER.model_dump()]},
        "/v1/messages": {
            "messages": ask,
            "tools": [{"name": "get_weather", "input_schema": params}],
            "max_tokens": 4,
        },
        "/v1/responses": {
            "input": "Weather?",
            "tools": [{"type": "function", "name": "get_weather", "parameters": params}],
        },
    }
    for route, body in bodies.items():
        response = client.post(route, json={"model": "a", **body})
        assert response.status_code == 200, (route, response.json())
    assert [o.grammar_triggers for o in seen] == [("<tool_call>",)] * 3
    assert all(accepts(str(o.grammar), _block("get_weather", PARIS)) for o in seen)


def test_the_call_grammar_is_built_off_the_event_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool's 100,000-value ``enum`` takes ~0.2 s to convert: never on the event loop,
    where it would hold every other client."""
    built: list[bool] = []
    grammar = LazyCalls.grammar

    def where(self: LazyCalls) -> CallGrammar:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            built.append(False)  # a worker thread: no loop runs here
        else:
            built.append(True)
        return grammar(self)

    monkeypatch.setattr(LazyCalls, "grammar", where)
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER.model_dump()],
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert built == [False]
