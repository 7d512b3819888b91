"""tool_choice auto holds Llama 3.x's calls to the tools' schemas (``tools.LazyCalls``,
formats "llama3-json" and "function-tag"): a reply that begins as a bare-JSON call (no opener:
the grammar's start pattern), a ``<|python_tag|>`` call, a ``<function=name>`` call, through
the real backend under every chat-shaped API, whole and streamed.

The models (``tests.tinymodels.write_marker_model``) write a fixed reply: a call's start, then
arguments the schema refuses (``"q": "y"``, where it admits only ``"x"``), then the end. Before
(no grammar for these formats), that call came back with ``{"q": "y"}``; held, the model's
next choice is refused and it writes the first text the grammar admits, ``"x"``. A reply of
ordinary text, a JSON object that is no call included, stays free."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from tests.tinymodels import write_marker_model

from kvwarm.settings import ModelSpec

from .conftest import (
    ASK_HI,
    WEATHER_TOOLS,
    anthropic_weather_call,
    responses_weather_call,
    serve_tiny_models,
    sse_events,
    streamed_call,
    tool_chat,
)

pytestmark = pytest.mark.model


def _template(call: str) -> str:
    """A Llama-3-style template: tools shown as JSON, a call as ``call`` writes it."""
    return (
        "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
        + call
        + "{% endfor %}\n{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )


LLAMA3 = _template(
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
)
FUNCTION = _template(
    "<function={{ c.function.name }}>{{ c.function.arguments | tojson }}</function>"
)
BARE_START = '{"name": "get_weather", "parameters": '
BAD_ARGS = '{"q": "y"}}'
BAD_CALL = '{"name": "get_weather", "parameters": {"q": "y"}}'
NOT_A_CALL = '{"answer": 42}'
#: name: (template, favourites, extra tokens, what follows what)
MODELS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], dict[str, str]]] = {
    "bare": (
        LLAMA3,
        (BARE_START,),
        (BARE_START, BAD_ARGS),
        {BARE_START: BAD_ARGS, BAD_ARGS: "</s>"},
    ),
    "python-tag": (
        LLAMA3,
        ("<|python_tag|>",),
        (BAD_CALL,),
        {"<|python_tag|>": BAD_CALL, BAD_CALL: "</s>"},
    ),
    "function": (
        FUNCTION,
        ("<function=get_weather>",),
        ("<function=get_weather>", '{"q": "y"}</function>'),
        {"<function=get_weather>": '{"q": "y"}</function>', '{"q": "y"}</function>': "</s>"},
    ),
    "text": (LLAMA3, (NOT_A_CALL,), (NOT_A_CALL,), {NOT_A_CALL: "</s>"}),
}
CALLS = sorted(set(MODELS) - {"text"})


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    directory = tmp_path_factory.mktemp("lazyllama")
    specs = tuple(
        ModelSpec(
            path=str(
                write_marker_model(
                    directory / f"{name}.gguf", template, favourites, extra=extra, after=after
                )
            ),
            id=name,
        )
        for name, (template, favourites, extra, after) in MODELS.items()
    )
    yield from serve_tiny_models(specs)


def _chat(model: str, **extra: object) -> dict[str, object]:
    return tool_chat(model, ASK_HI, WEATHER_TOOLS, 96, **extra)


@pytest.mark.parametrize("model", CALLS)
def test_a_chat_completions_call_is_held_to_the_schema(client: TestClient, model: str) -> None:
    response = client.post("/v1/chat/completions", json=_chat(model))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    assert message["content"] in (None, ""), message
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"q": "x"}  # before: {"q": "y"}
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("model", CALLS)
def test_a_streamed_call_is_held_to_the_schema(client: TestClient, model: str) -> None:
    response = client.post("/v1/chat/completions", json=_chat(model, stream=True))
    assert response.status_code == 200, response.text
    content, name, arguments = streamed_call(response.text)
    assert content.strip() == ""
    assert name == "get_weather"
    assert json.loads(arguments) == {"q": "x"}


def test_a_reply_of_text_stays_free(client: TestClient) -> None:
    """A JSON object that is no call, at the reply's start: the start pattern never matched,
    the reply is the model's own."""
    for stream in (False, True):
        response = client.post("/v1/chat/completions", json=_chat("text", stream=stream))
        assert response.status_code == 200, response.text
        if stream:
            events = [e for e in sse_events(response.text) if isinstance(e, dict)]
            text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            assert not any(c["delta"].get("tool_calls") for e in events for c in e["choices"])
        else:
            message = response.json()["choices"][0]["message"]
            text = message["content"]
            assert not message.get("tool_calls")
        assert text == NOT_A_CALL


@pytest.mark.parametrize("model", ["bare", "function"])
def test_an_anthropic_tool_use_is_held_to_the_schema(client: TestClient, model: str) -> None:
    anthropic_weather_call(client, model, 96)


@pytest.mark.parametrize("model", ["bare", "python-tag"])
def test_a_response_function_call_is_held_to_the_schema(client: TestClient, model: str) -> None:
    responses_weather_call(client, model, 96)
