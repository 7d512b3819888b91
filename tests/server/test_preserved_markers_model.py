"""Tool-call markers that are control tokens reach the parser (``GenerationOptions.
preserved_tokens``, set from ``ChatPlan.preserved``). In Mistral's GGUFs ``[TOOL_CALLS]``,
``[ARGS]`` and ``[CALL_ID]`` are control tokens, in Llama 3's ``<|python_tag|>``, in some
Hermes-style ones ``<tool_call>``: a reply's text left them out, so a call came back as text
(``get_weather{"q": "x"}``). Here tiny models whose vocabularies hold them as control tokens
and whose greedy choice is fixed (``tests.tinymodels.write_marker_model``) write calls through
the real backend, under every chat-shaped API, whole and streamed; the markers are the
parser's, never the client's content, and other special tokens stay out of the text.
Before, a reply that was only a call whose body is JSON (Hermes' block, Nemo's list, a
``<|python_tag|>`` call) was still found, as a bare JSON reply; Mistral's ``name[ARGS]{...}``
and any call after text were not."""

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
    data_events,
    responses_weather_call,
    serve_tiny_models,
    sse_events,
    streamed_call,
    tool_chat,
)

pytestmark = pytest.mark.model

#: Mistral Small 3.2's shape: tools before the last user turn, a call as name[ARGS]{...}.
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m['content'] }}[/INST]{% elif m['role'] == 'assistant' %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}"
    "[ARGS]{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m['content'] }}"
    "{% endif %}{{ eos_token }}{% endif %}{% endfor %}"
)
#: Mistral Nemo's: the calls as one JSON list after [TOOL_CALLS].
NEMO = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m['content'] }}[/INST]{% elif m['role'] == 'assistant' %}"
    "{% if m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
    '"id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]'
    "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endif %}{% endfor %}"
)
#: Hermes' shape: tools in the system turn, a call as a <tool_call> block of JSON.
HERMES = (
    "{% if tools %}[INST]{{ tools | tojson }}[/INST]{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{{ eos_token }}"
    "{% else %}[INST]{{ m['content'] }}[/INST]{% endif %}{% endfor %}"
)
#: No call format a grammar holds: Llama 3's ``<|python_tag|>`` calls are as written.
LLAMA = "{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"

MODELS = {
    "mistral": (MISTRAL, ("[TOOL_CALLS]", "[ARGS]")),
    "mistral-id": (MISTRAL, ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")),
    "nemo": (NEMO, ("[TOOL_CALLS]",)),
    "hermes": (HERMES, ("<tool_call>", "</tool_call>")),
    "llama": (LLAMA, ("<|python_tag|>",)),
}
MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<tool_call>", "</tool_call>")
SPECIALS = (*MARKERS, "[INST]", "[/INST]", "</s>", "<s>")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    directory = tmp_path_factory.mktemp("markers")
    specs = tuple(
        ModelSpec(path=str(write_marker_model(directory / f"{name}.gguf", *made)), id=name)
        for name, made in MODELS.items()
    )
    yield from serve_tiny_models(specs)


def _chat(model: str, **extra: object) -> dict[str, object]:
    return tool_chat(model, ASK_HI, WEATHER_TOOLS, 128, **extra)


#: The llama model has no call format a grammar holds: its request's own grammar writes the
#: call (an opener the grammar lets be the control token or its bytes: the model prefers the
#: token).
PYTHON_TAG = (
    'root ::= "<|python_tag|>{\\"name\\": \\"get_weather\\", \\"parameters\\": {\\"q\\": \\"x\\"}}"'
)


def _request(model: str) -> dict[str, object]:
    return _chat(model, grammar=PYTHON_TAG) if model == "llama" else _chat(model)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_chat_completion_reports_the_call(client: TestClient, model: str) -> None:
    response = client.post("/v1/chat/completions", json=_request(model))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    assert message["content"] in (None, ""), message
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"q": "x"}
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_streamed_chat_completion_sends_the_call_and_no_marker(
    client: TestClient, model: str
) -> None:
    response = client.post("/v1/chat/completions", json=_request(model) | {"stream": True})
    assert response.status_code == 200, response.text
    content, name, arguments = streamed_call(response.text)
    assert not any(marker in content for marker in SPECIALS), content
    assert content.strip() == ""
    assert name == "get_weather"
    assert json.loads(arguments) == {"q": "x"}


@pytest.mark.parametrize("model", ["mistral", "hermes"])
def test_an_anthropic_message_has_the_tool_use(client: TestClient, model: str) -> None:
    events = anthropic_weather_call(client, model, 64)
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert not any(marker in text for marker in SPECIALS), text
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["name"] for b in starts if b["type"] == "tool_use"] == ["get_weather"]


@pytest.mark.parametrize("model", ["mistral", "hermes"])
def test_a_response_has_the_function_call(client: TestClient, model: str) -> None:
    body, output = responses_weather_call(client, model, 64)
    for item in output:
        if item["type"] == "message":
            for part in item["content"]:
                assert not any(marker in part.get("text", "") for marker in SPECIALS), part
    streamed = client.post("/v1/responses", json=body | {"stream": True})
    assert streamed.status_code == 200, streamed.text
    events = data_events(streamed.text)
    text = "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")
    assert not any(marker in text for marker in SPECIALS), text
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(e["arguments"]) for e in done] == [{"q": "x"}]


#: A call after text, its opener a control token the grammar lets the model prefer to its
#: bytes: without the opener in the text the call is no bare JSON reply, it was text.
AFTER_TEXT = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"q": "x"}}\n</tool_call>',
    "llama": '<|python_tag|>{"name": "get_weather", "parameters": {"q": "x"}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"q": "x"}',
    "nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"q": "x"}}]',
}


@pytest.mark.parametrize("model", sorted(AFTER_TEXT))
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_after_text_is_found_by_its_marker(
    client: TestClient, model: str, stream: bool
) -> None:
    grammar = "root ::= " + json.dumps("Sure." + AFTER_TEXT[model])
    response = client.post(
        "/v1/chat/completions", json=_chat(model, grammar=grammar, stream=stream)
    )
    assert response.status_code == 200, response.text
    if not stream:
        message = response.json()["choices"][0]["message"]
        content = message["content"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    else:
        content, calls = "", []
        for event in sse_events(response.text):
            assert isinstance(event, dict)
            for choice in event["choices"]:
                content += choice["delta"].get("content") or ""
                for call in choice["delta"].get("tool_calls") or ():
                    if call["function"].get("name"):
                        calls.append((call["function"]["name"], ""))
                    name, args = calls[-1]
                    calls[-1] = (name, args + (call["function"].get("arguments") or ""))
    assert content == "Sure."
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", {"q": "x"})]


def test_without_tools_a_control_token_stays_out_of_the_text(client: TestClient) -> None:
    """No tools, nothing parsed: the model's favourite control token is no text (as before,
    and as llama-server's), nor is any other special token."""
    body = {"model": "mistral", "messages": ASK_HI, "temperature": 0, "max_tokens": 4}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == ""
    assert response.json()["usage"]["completion_tokens"] == 4
