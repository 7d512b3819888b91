"""Emulated tools under templates that refuse a system message (Gemma 2's, Mistral's first
ones raise "System role not supported"): the tools' description opens the first user message
instead of a system message kvwarm added itself. Before, every request with tools was a 400
on such a model (stub backend, the template given by ``chat_template``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready

# Gemma 2's checks: no system role, user and model turns alternating.
NO_SYSTEM = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    template = tmp_path_factory.mktemp("template") / "gemma2.jinja"
    template.write_text(NO_SYSTEM)
    with TestClient(create_app(stub_settings(chat_template=str(template)))) as test_client:
        wait_ready(test_client.get)
        yield test_client


def _prompt_tokens(client: TestClient, body: dict[str, object]) -> int:
    response = client.post("/v1/chat/completions", json={"model": "a", "max_tokens": 1, **body})
    assert response.status_code == 200, response.json()
    usage = response.json()["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens"])


def test_tools_are_described_in_the_first_user_turn(client: TestClient) -> None:
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    plain = _prompt_tokens(client, {"messages": ask})
    described = _prompt_tokens(client, {"messages": ask, "tools": [WEATHER]})
    assert described > plain + 20  # the description is in the prompt
    # An agent's next turn: the call and its result, still user and model alternating.
    history = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rainy"},
    ]
    assert _prompt_tokens(client, {"messages": history, "tools": [WEATHER]}) > described


# A template that renders user and assistant turns and drops any other without a word.
DROPS_SYSTEM = (
    "{% for message in messages %}{% if message['role'] in ('user', 'assistant') %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("own_system", [False, True])
def test_tools_reach_a_template_that_drops_system_messages(
    tmp_path: Path, own_system: bool
) -> None:
    # Before: the probe asked only whether the template raised on a system message; one that
    # drops it was told it takes one, and the tools' description went where the model never
    # saw it (the reply's calls were parsed, but the model did not know the tools).
    template = tmp_path / "drops.jinja"
    template.write_text(DROPS_SYSTEM)
    ask: list[dict[str, object]] = [{"role": "user", "content": "Weather in Oslo?"}]
    if own_system:
        ask.insert(0, {"role": "system", "content": "Be brief."})
    with TestClient(create_app(stub_settings(chat_template=str(template)))) as client:
        wait_ready(client.get)
        plain = _prompt_tokens(client, {"messages": ask})
        described = _prompt_tokens(client, {"messages": ask, "tools": [WEATHER]})
    assert described > plain + 20  # the description is in the prompt


def _prompt(client: TestClient, body: dict[str, object]) -> str:
    response = client.post("/apply-template", json=body)
    assert response.status_code == 200, response.json()
    prompt = response.json()["prompt"]
    assert isinstance(prompt, str)
    return prompt


def test_a_system_prompt_opens_the_first_user_turn(client: TestClient) -> None:
    # Before: a system prompt was a 400 on every API under a template that refuses the system
    # role ("System role not supported"), so Claude Code and most agents, which always send
    # one, could not use such a model. As llama.cpp's server does (common/chat.cpp), its text
    # now opens the first user turn, a line before the user's.
    system = {"role": "system", "content": "Be brief."}
    ask = {"role": "user", "content": "Weather in Oslo?"}
    folded = "<start_of_turn>user\nBe brief.\nWeather in Oslo?<end_of_turn>\n"
    assert folded in _prompt(client, {"messages": [system, ask]})
    developer = {"role": "developer", "content": "Be brief."}
    assert folded in _prompt(client, {"messages": [developer, ask]})
    # Alone, it is the user turn; two leading ones are one turn.
    alone = _prompt(client, {"messages": [system]})
    assert "<start_of_turn>user\nBe brief.<end_of_turn>\n" in alone
    two = _prompt(client, {"messages": [system, {**system, "content": "Be kind."}, ask]})
    assert "<start_of_turn>user\nBe brief.\nBe kind.\nWeather in Oslo?<end_of_turn>" in two
    # With described tools: the system text, then the tools' description, then the user's.
    described = _prompt(client, {"messages": [system, ask], "tools": [WEATHER]})
    assert described.index("Be brief.") < described.index("<tools>")
    assert described.index("</tools>") < described.index("Weather in Oslo?")
    assert described.count("<start_of_turn>user") == 1
    assert _prompt_tokens(client, {"messages": [system, ask]}) > 0
    # The Anthropic API: its ``system`` field, counted as the message renders it.
    anthropic = {"model": "a", "max_tokens": 1, "system": "Be brief.", "messages": [ask]}
    done = client.post("/v1/messages", json=anthropic)
    assert done.status_code == 200, done.json()
    counted = client.post("/v1/messages/count_tokens", json=anthropic)
    assert counted.status_code == 200, counted.json()
    one = {
        **anthropic,
        "system": None,
        "messages": [{**ask, "content": "Be brief.\nWeather in Oslo?"}],
    }
    merged = client.post("/v1/messages/count_tokens", json=one).json()["input_tokens"]
    assert counted.json()["input_tokens"] == merged
    usage = done.json()["usage"]
    assert (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
        == merged
    )
    # The Responses API's instructions.
    response = client.post(
        "/v1/responses",
        json={"model": "a", "max_output_tokens": 1, "instructions": "Be brief.", "input": "Hi"},
    )
    assert response.status_code == 200, response.json()


@pytest.mark.parametrize("source", [NO_SYSTEM, DROPS_SYSTEM], ids=["refuses", "drops"])
def test_a_prewarmed_system_prompt_is_the_prefix_its_requests_render(
    tmp_path: Path, source: str
) -> None:
    # Before: --prewarm-system rendered the prompt as a system message whatever the template:
    # one that refuses it failed the prewarm (a warning, nothing warmed), one that drops it
    # warmed a prompt without the text; the chats that open with that system prompt (folded
    # into their first user turn) never hit it. Now the prewarm is folded by the same
    # function, so it is their prefix but for the turn's closing markup.
    template = tmp_path / "template.jinja"
    template.write_text(source)
    system = "You are the startup assistant; keep every answer short and friendly."
    settings = stub_settings(chat_template=str(template), prewarm_system=(system,))
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        assert client.app.state.kvwarm.require_engine().cache.flush()
        assert sorted(e["model"] for e in client.get("/cache/stats").json()["keep_alive"]) == [
            "a",
            "b",
        ]
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        body = {"model": "a", "messages": messages, "max_tokens": 1}
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    # The stub's tokens are about a byte each: the whole system text came from the cache.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(system)
