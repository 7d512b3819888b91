"""Every known field of every JSON body is strictly typed (``schemas.JsonBody``): a boolean is a
JSON boolean, an integer a JSON integer (a count also an integral float, as llama-server
reads it), a number a JSON number, a string a JSON string; anything else is a 400 naming the
field. Found by review: pydantic's lax mode read ``"n": true`` as 1, ``"best_of": "2"`` as 2,
``"echo": "yes"`` and ``"stream": 1`` as true, ``"dimensions": "2"`` as 2.

Each route has valid bodies that between them set every field it declares (checked against
its schema, so a field added later without one here fails); each scalar in them, at any
depth, is then sent with values of the wrong JSON type, one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from kvwarm.server import create_app
from kvwarm.server.admin.models import LoadRequest, LoraScale, UnloadRequest
from kvwarm.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from kvwarm.server.responses.schemas import ResponsesRequest
from kvwarm.server.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    EvictRequest,
    InfillRequest,
    JsonBody,
    LlamaCompletionRequest,
    LlamaEmbeddingRequest,
    PrewarmRequest,
    RerankRequest,
    TokenizeRequest,
)
from kvwarm.settings import ModelSpec

from .conftest import stub_settings, wait_ready

# "fim": the first model (the global lora's adapters are its), with fill-in-the-middle tokens.
SAMPLING: dict[str, object] = {
    "model": "fim",
    "max_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "typical_p": 1.0,
    "repeat_penalty": 1.1,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.1,
    "seed": 7,
    "stop": ["\n\n"],
    "logit_bias": {"5": 1.5},
    "ignore_eos": False,
    "cache_salt": "s",
    "spec_type": "none",
    "spec_draft_max": 4,
    "keep_alive": 300,
    "user": "u",
    "lora": [{"id": 0, "scale": 0.5}],
}
STREAMED: dict[str, object] = {"stream": True, "stream_options": {"include_usage": True}}
JSON_SCHEMA: dict[str, object] = {"type": "object"}
PREWARMED = "a system prompt long enough to be kept: " * 3
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
CHAT_MESSAGES: list[object] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "u"},
    {"role": "assistant", "content": "", "refusal": "no", "tool_calls": [CALL]},
    {"role": "tool", "content": "42", "tool_call_id": "c1"},
]
TOOLS = [
    {"type": "function", "function": {"name": "f", "description": "d", "parameters": JSON_SCHEMA}}
]
ANTHROPIC_MESSAGES: list[object] = [
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "4", "is_error": False}
        ],
    },
]
ANTHROPIC_TOOLS = [{"name": "f", "description": "d", "input_schema": JSON_SCHEMA}]
ANTHROPIC_CHOICE = {"type": "auto", "disable_parallel_tool_use": True}
RESPONSES_INPUT: list[object] = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc_1"},
    {"type": "function_call_output", "call_id": "c", "output": "4"},
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "f",
        "description": "d",
        "parameters": JSON_SCHEMA,
        "strict": False,
    }
]

#: llama-server's samplers and controls kvwarm lacks, at their "off" values (llama-server's
#: defaults), which /completion and /infill take.
LLAMA_OFF: dict[str, object] = {
    "id_slot": -1,
    "cache_prompt": True,
    "mirostat": 0,
    "dry_multiplier": 0.0,
    "xtc_probability": 0.0,
    "top_n_sigma": -1.0,
    "dynatemp_range": 0.0,
    "repeat_last_n": 64,
    "min_keep": 0,
    "timings_per_token": False,
    "return_progress": False,
    "post_sampling_probs": False,
}

#: Per route: its body model, and valid bodies that between them set every field it declares.
BODIES: dict[str, tuple[type[BaseModel], list[Any]]] = {
    "/v1/completions": (
        CompletionRequest,
        [
            {**SAMPLING, "prompt": "x", "n": 2, "best_of": 2, "logprobs": 1, "echo": True},
            {**SAMPLING, **STREAMED, "prompt": [1, 2], "grammar": 'root ::= "a"'},
            {
                "model": "a",
                "prompt": ["x"],
                "max_tokens": 2,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": JSON_SCHEMA, "strict": True},
                },
            },
            {"model": "fim", "prompt": "x", "suffix": "y", "max_tokens": 2},
            {"model": "a", "prompt": "x", "max_tokens": 2, "n_indent": 4, "t_max_predict_ms": 9},
        ],
    ),
    "/v1/chat/completions": (
        ChatRequest,
        [
            {
                **SAMPLING,
                "messages": CHAT_MESSAGES,
                "tools": TOOLS,
                "tool_choice": "auto",
                "parallel_tool_calls": True,
                "logprobs": True,
                "top_logprobs": 2,
                "max_completion_tokens": 3,
                "n": 2,
                "modalities": ["text"],
                "prediction": {"type": "content", "content": [{"type": "text", "text": "a"}]},
            },
            {
                **SAMPLING,
                **STREAMED,
                "messages": CHAT_MESSAGES,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            {
                "model": "a",
                "max_tokens": 2,
                "messages": CHAT_MESSAGES,
                "tools": TOOLS,
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "name": "f"}]},
                },
            },
            {
                "model": "a",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}],
                "grammar": 'root ::= "a"',
            },
            {
                "model": "a",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": JSON_SCHEMA, "strict": True},
                },
            },
        ],
    ),
    "/infill": (
        InfillRequest,
        [
            {
                **SAMPLING,
                "input_prefix": "def f(",
                "input_suffix": "):",
                "input_extra": [{"text": "x = 1", "filename": "a.py"}],
                "prompt": "a",
                "n_predict": 2,
                "n": 1,  # /infill makes one completion
                "n_probs": 1,
                "return_tokens": True,
                "response_fields": ["content", "timings/prompt_n"],
                # llama.vim's line stops: a reply's lines indented 2 at least, and 1 s.
                "n_indent": 2,
                "t_max_predict_ms": 1000,
                # llama.vim's samplers, ignored; the rest taken at their "off" values only.
                "samplers": ["top_k", "top_p", "infill"],
                **LLAMA_OFF,
            },
            {
                **STREAMED,
                "model": "fim",
                "input_prefix": "def f(",
                "input_suffix": "):",
                "grammar": 'root ::= "a"',
            },
            {"model": "fim", "input_prefix": "def f(", "json_schema": JSON_SCHEMA},
        ],
    ),
    "/completion": (
        LlamaCompletionRequest,
        [
            {
                **SAMPLING,
                "prompt": ["x", [1, 2]],
                "n_predict": 2,
                "n": 1,
                "n_probs": 1,
                "return_tokens": True,
                "response_fields": ["content"],
                # llama-server's fields kvwarm takes at their "off" values only (but the
                # line stops, which it runs).
                **LLAMA_OFF,
                "n_indent": 4,
                "t_max_predict_ms": 500,
            },
            {**STREAMED, "model": "a", "prompt": "x", "json_schema": JSON_SCHEMA},
            {"model": "a", "prompt": [1, 2], "grammar": 'root ::= "a"'},
        ],
    ),
    "/embedding": (
        LlamaEmbeddingRequest,
        [
            {"model": "a", "keep_alive": 300, "content": ["x", [1, 2]], "embd_normalize": 2},
            {"model": "fim", "input": "x", "lora": [{"id": 0, "scale": 0.5}]},
        ],
    ),
    "/v1/embeddings": (
        EmbeddingRequest,
        [
            {
                "model": "a",
                "keep_alive": 300,
                "input": ["x"],
                "encoding_format": "float",
                "dimensions": 2,
            },
            {"model": "a", "input": [[1, 2]]},
            {"model": "fim", "input": "x", "lora": [{"id": 0, "scale": 0.5}]},
        ],
    ),
    "/v1/rerank": (
        RerankRequest,
        [
            {
                "model": "ranker",
                "keep_alive": 300,
                "query": "q",
                "documents": ["a", {"text": "b"}],
                "top_n": 1,
                "return_documents": True,
                "max_tokens_per_doc": 8,
                "cache_salt": "s",
                "lora": [],  # the reranker has no adapters: none, explicitly
            }
        ],
    ),
    "/tokenize": (
        TokenizeRequest,
        [
            {
                "model": "a",
                "content": "x",
                "add_special": True,
                "parse_special": False,
                "with_pieces": True,
            }
        ],
    ),
    "/detokenize": (DetokenizeRequest, [{"model": "a", "tokens": [1, 2]}]),
    "/cache/prewarm": (
        PrewarmRequest,
        [
            {
                "model": "a",
                "prompt": PREWARMED,
                "ttl_class": "long",
                "keep_alive": True,
                "cache_salt": "s",
                "shared": False,
            },
            {"model": "a", "messages": CHAT_MESSAGES, "tools": TOOLS},
        ],
    ),
    "/cache/evict": (EvictRequest, [{"bytes": 0, "tiers": ["disk"]}]),
    "/lora-adapters": (LoraScale, [[{"id": 0, "scale": 0.5}, {"id": 1}]]),
    "/admin/models/load": (LoadRequest, [{"name": "a"}]),
    "/admin/models/unload": (UnloadRequest, [{"model": "b"}]),
    "/v1/messages": (
        MessagesRequest,
        [
            {
                "model": "a",
                "max_tokens": 2,
                "messages": ANTHROPIC_MESSAGES,
                "system": "be brief",
                "tools": ANTHROPIC_TOOLS,
                "tool_choice": ANTHROPIC_CHOICE,
                "stop_sequences": ["\n\n"],
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 5,
                "metadata": {"user_id": "u"},
                "stream": False,
                "cache_salt": "s",
                "spec_type": "none",
                "spec_draft_max": 4,
                "keep_alive": 300,
            },
            {
                "model": "a",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}],
                "output_config": {"format": {"type": "json_schema", "schema": JSON_SCHEMA}},
                "stream": True,
                # Read to refuse what kvwarm cannot run; empty, they ask nothing.
                "mcp_servers": [],
                "container": {"id": "c", "skills": []},
            },
            {
                "model": "a",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}],
                "output_format": {"type": "json_schema", "schema": JSON_SCHEMA},
            },
        ],
    ),
    "/v1/messages/count_tokens": (
        CountTokensRequest,
        [
            {
                "model": "a",
                "messages": ANTHROPIC_MESSAGES,
                "system": [{"type": "text", "text": "be brief"}],
                "mcp_servers": [],
                "container": "c",
                "tools": ANTHROPIC_TOOLS,
                "tool_choice": ANTHROPIC_CHOICE,
            }
        ],
    ),
    "/v1/responses": (
        ResponsesRequest,
        [
            {
                "model": "a",
                "keep_alive": 300,
                "input": RESPONSES_INPUT,
                "instructions": "be brief",
                "tools": RESPONSES_TOOLS,
                "tool_choice": "auto",
                "max_output_tokens": 3,
                "temperature": 0.5,
                "top_p": 0.9,
                "stream": False,
                "store": False,
                "metadata": {"k": "v"},
                "parallel_tool_calls": True,
                "include": ["message.output_text.logprobs"],
                "top_logprobs": 1,
                "user": "u",
                "cache_salt": "s",
                "spec_type": "none",
                "spec_draft_max": 4,
            },
            {
                "model": "a",
                "input": "x",
                "max_output_tokens": 2,
                "stream": True,
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "n",
                        "schema": JSON_SCHEMA,
                        "strict": True,
                    }
                },
            },
            {
                "model": "a",
                "input": "x",
                "max_output_tokens": 2,
                "tools": RESPONSES_TOOLS,
                "tool_choice": {"type": "function", "name": "f"},
                "background": True,  # answered at once, status queued
            },
            {
                "model": "a",
                "input": "x",
                "max_output_tokens": 2,
                "tools": RESPONSES_TOOLS,
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "function", "name": "f"}],
                },
            },
        ],
    ),
}

#: Declared fields no valid body above sets, and why.
UNSET = {
    # Read only to be refused by name (typed ``object``): never valid.
    "/v1/chat/completions": {"functions", "function_call", "best_of", "audio", "moderation"},
    # A stored response's id: a string, which lax mode already held to one; a conversation,
    # a prompt template and moderation are read only to be refused by name (typed ``object``).
    "/v1/responses": {"previous_response_id", "conversation", "prompt", "moderation"},
    # Needs cache_salt_from_auth; a string, which lax mode already held to one.
    "/cache/prewarm": {"tenant_key"},
    # A path needs a configured key; both strings, which lax mode already held to one.
    "/admin/models/load": {"path", "id"},
    # Any value is refused (kvwarm's samplers run in one order).
    "/completion": {"samplers"},
}

#: Free-form values inside a body (JSON schemas, tool inputs, tool references): any JSON.
FREE_FORM = {
    "parameters",
    "schema",
    "input_schema",
    "input",
    "allowed_tools.tools",
    "tool_choice.tools",
}
#: Lists of texts or of token ids (or of lists of them): an item of the wrong type is named by
#: the field alone (which of the union's lists it was meant for is a guess), and a number for a
#: text or a text for a number may make another of its types.
UNION_LISTS = {"prompt", "input", "content"}


def _wrong_values(path: tuple[str | int, ...], value: object) -> tuple[object, ...]:
    if path[0] in UNION_LISTS and len(path) > 1 and all(isinstance(p, int) for p in path[1:]):
        return (True, 2.5, None)
    if path[-1] == "keep_alive" and not isinstance(value, bool):
        return (True, False)  # seconds or a duration string: a number or a string is taken
    if isinstance(value, bool):
        return (1, 0, "true", "1")
    if isinstance(value, int):
        return (True, str(value), 2.5)
    if isinstance(value, float):
        return (True, str(value))
    if isinstance(value, str):
        return (5, True)
    raise AssertionError(f"not a scalar: {value!r}")


def _leaves(value: object, path: tuple[str | int, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """(path, value) of every scalar in a body, free-form values left out."""
    if len(path) > 1 and (path[-1] in FREE_FORM or ".".join(map(str, path[-2:])) in FREE_FORM):
        return
    if path == ("json_schema",):  # /completion's top-level JSON schema (llama-server's field)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    elif value is not None:
        yield path, value


def _with(body: object, path: tuple[str | int, ...], value: object) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(body, dict):
        return {**body, head: _with(body[head], rest, value)}
    assert isinstance(body, list) and isinstance(head, int)
    return [_with(item, rest, value) if i == head else item for i, item in enumerate(body)]


def _cases() -> list[Any]:
    cases: list[Any] = []
    seen: set[tuple[str, tuple[str | int, ...], str]] = set()
    for route, (_, bodies) in BODIES.items():
        for b, body in enumerate(bodies):
            for path, value in _leaves(body):
                for wrong in _wrong_values(path, value):
                    mark = (route, path, repr(wrong))
                    if mark in seen:
                        continue
                    seen.add(mark)
                    name = ".".join(map(str, path))
                    cases.append(
                        pytest.param(route, b, path, wrong, id=f"{route}:{name}={wrong!r}")
                    )
    return cases


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    folder = tmp_path_factory.mktemp("strict")
    adapters = []
    for name in ("sql", "pirate"):
        (folder / f"{name}.gguf").write_bytes(f"stub adapter: {name}".encode())
        adapters.append((name, str(folder / f"{name}.gguf")))
    settings = stub_settings(
        models=(
            ModelSpec(path="stub-fim", id="fim"),
            ModelSpec(path="stub-a", id="a"),
            ModelSpec(path="stub-b", id="b", n_ctx=256),
            ModelSpec(path="stub-reranker.gguf", id="ranker"),
        ),
        cache_dir=folder / "cache",
        save_tier="disk",
        lora=tuple(adapters),
    )
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


#: Routes that take another's body (the same model).
SAME_BODY = {
    "/completions": "/completion",
    "/embeddings": "/embedding",
    "/apply-template": "/v1/chat/completions",
    "/rerank": "/v1/rerank",
    "/v2/rerank": "/v1/rerank",
    "/reranking": "/v1/rerank",
    "/v1/reranking": "/v1/rerank",
}


def test_every_json_body_is_here_and_strict(client: TestClient) -> None:
    """Every route that declares a JSON body has cases here, and every model of every body,
    at any depth, is a ``JsonBody`` (strict): a route or a part of a body added later is held
    to the rule too."""
    paths = client.get("/openapi.json").json()["paths"]
    with_body = {path for path, ops in paths.items() for op in ops.values() if "requestBody" in op}
    assert with_body == set(BODIES) | set(SAME_BODY)
    seen: set[type[BaseModel]] = set()
    todo: list[type[BaseModel]] = [model for model, _ in BODIES.values()]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        assert issubclass(model, JsonBody) and model.model_config.get("strict"), model
        for field in model.model_fields.values():
            todo.extend(_models_in(field.annotation))
    assert len(seen) > 40  # the walk reached the bodies' parts


def _models_in(annotation: object) -> Iterator[type[BaseModel]]:
    """The models a field's type names, inside lists, unions and ``Annotated``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _models_in(arg)


@pytest.mark.parametrize("route", list(BODIES))
def test_valid_bodies_set_every_field_and_are_200(client: TestClient, route: str) -> None:
    model, bodies = BODIES[route]
    declared = set(model.model_json_schema()["properties"])
    given = {key for body in bodies for item in _objects(body) for key in item}
    assert declared - given == UNSET.get(route, set()), "a field no body here sets"
    for body in bodies:
        response = client.post(route, json=body)
        assert response.status_code == 200, (body, response.text)


def _objects(body: object) -> list[Any]:
    """A body's object, or the objects a list body holds (``/lora-adapters``)."""
    return body if isinstance(body, list) else [body]


def _message(response: Any) -> str:
    error = response.json()["error"]
    assert isinstance(error, dict)
    return str(error["message"])


@pytest.mark.parametrize(("route", "b", "path", "wrong"), _cases())
def test_a_wrong_typed_field_is_a_400_naming_it(
    client: TestClient, route: str, b: int, path: tuple[str | int, ...], wrong: object
) -> None:
    body = _with(BODIES[route][1][b], path, wrong)
    response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    message = _message(response)
    named = message.split(":", 1)[0].split(".")
    expected = path
    if path[-1] == "type":  # a tag telling an object's kind apart: the error names the object
        expected = path[:-1]
    if path[0] in UNION_LISTS and all(isinstance(p, int) for p in path[1:]):
        expected = path[:1]
    # The error names the field's path (a union member's name may sit between its parts).
    rest = iter(named)
    assert all(str(part) in rest for part in expected), (path, message)
    error = response.json()["error"]
    if "param" in error:  # OpenAI's shape; Anthropic's has the message alone
        assert error["param"] == message.split(":", 1)[0]


#: Where an integer is an id (a prompt's token ids, a LoRA adapter's): a JSON integer only.
ID_FIELDS = {"prompt", "input", "tokens", "content"}


def _integers() -> list[Any]:
    cases: list[Any] = []
    for route, (_, bodies) in BODIES.items():
        for b, body in enumerate(bodies):
            for path, value in _leaves(body):
                if isinstance(value, int) and not isinstance(value, bool):
                    is_id = path[-1] == "id" or (
                        path[0] in ID_FIELDS and all(isinstance(p, int) for p in path[1:])
                    )
                    name = ".".join(map(str, path))
                    cases.append(pytest.param(route, b, path, is_id, id=f"{route}:{name}"))
    return cases


@pytest.mark.parametrize(("route", "b", "path", "is_id"), _integers())
def test_an_integral_float_is_a_count_not_an_id(
    client: TestClient, route: str, b: int, path: tuple[str | int, ...], is_id: bool
) -> None:
    """A count or setting takes 3.0 for 3, as llama-server reads its integers (3.5 is a 400
    above); an id is a JSON integer only, as llama-server reads a prompt's token ids."""
    body = BODIES[route][1][b]
    value = body
    for part in path:
        value = value[part]
    response = client.post(route, json=_with(body, path, float(value)))
    if is_id:
        assert response.status_code == 400, response.text
        assert str(path[-1] if path[-1] == "id" else path[0]) in _message(response)
    else:
        assert response.status_code == 200, response.text
