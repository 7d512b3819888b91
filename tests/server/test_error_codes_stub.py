"""Every refusal carries a ``code`` from server.md's table, the same kind of failure the same code
on every route. Found by review: these answered ``"code": null`` (``tests/test_docs.py``
checks the source for raise sites without one; these drive a sample of them)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from .test_api_stub import assert_error

HI = [{"role": "user", "content": "hi"}]


def _fn(name: str, kind: str = "object") -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": kind}}}


def _chat(**fields: object) -> tuple[str, dict[str, object]]:
    return "/v1/chat/completions", {"model": "a", "messages": HI, "max_tokens": 1, **fields}


def _responses(**fields: object) -> tuple[str, dict[str, object]]:
    return "/v1/responses", {"model": "a", "input": "hi", "max_output_tokens": 1, **fields}


def _allowed(*refs: dict[str, object]) -> dict[str, object]:
    return {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": list(refs)}}


_NO_SCHEMA = {"format": {"type": "json_schema", "name": "x"}}
_UNNAMED = {"type": "function", "parameters": {"type": "object"}}
_JSON = {"type": "json_object"}

# (path, body), the code, the param. A missing field is invalid_type, as validation's own
# "Field required" is; an empty one, two fields that cannot go together, or one a field needs
# but lacks, invalid_value; a field (or combination) kvwarm does not serve, unsupported_parameter.
CASES = [
    (_chat(logit_bias={"x": 1}), "invalid_value", "logit_bias"),
    (_chat(grammar='root ::= "a"', response_format=_JSON), "invalid_value", "grammar"),
    (_chat(tools=[_fn("f"), _fn("f")]), "invalid_value", "tools.1"),
    (_chat(tools=[_fn("f", "array")]), "invalid_value", "tools.0"),
    (
        _chat(tools=[_fn("f")], tool_choice={"type": "function", "function": {"name": "g"}}),
        "invalid_value",
        "tool_choice",
    ),
    (
        _chat(
            tools=[_fn("f")], tool_choice=_allowed({"type": "function", "function": {"name": "g"}})
        ),
        "invalid_value",
        "tool_choice.allowed_tools.tools.0",
    ),
    (
        _chat(tools=[_fn("f")], tool_choice=_allowed({"type": "function"})),
        "invalid_type",
        "tool_choice.allowed_tools.tools.0",
    ),
    (
        _chat(tools=[_fn("f")], tool_choice=_allowed({"type": "function", "name": ""})),
        "invalid_value",
        "tool_choice.allowed_tools.tools.0",
    ),
    (
        _chat(tools=[_fn("f")], tool_choice="required", response_format=_JSON),
        "unsupported_parameter",
        "response_format",
    ),
    # Chat's fields read only to be refused, one code for them all (audio's was invalid_value).
    (_chat(modalities=["text", "audio"]), "unsupported_parameter", "modalities"),
    (_chat(audio={"voice": "alloy", "format": "wav"}), "unsupported_parameter", "audio"),
    (
        ("/v1/completions", {"model": "a", "prompt": "x", "suffix": "y", "echo": True}),
        "invalid_value",
        "echo",
    ),
    (("/v1/completions", {"model": "a", "prompt": []}), "invalid_value", "prompt"),
    (
        ("/infill", {"model": "a", "input_prefix": "a", "input_suffix": "b", "n": 2}),
        "invalid_value",
        "n",
    ),
    # llama-server's /embedding without its text, as /v1/embeddings without its input.
    (("/embedding", {"model": "a"}), "invalid_type", "content"),
    (("/v1/embeddings", {"model": "a"}), "invalid_type", "input"),
    (_responses(tools=[_UNNAMED]), "invalid_type", "tools.0.name"),
    (_responses(tools=[{**_UNNAMED, "name": ""}]), "invalid_value", "tools.0.name"),
    (_responses(input=[{"type": "reasoning", "summary": []}]), "invalid_value", "input"),
    (_responses(text=_NO_SCHEMA), "invalid_value", "text.format.schema"),
    (
        _responses(
            tools=[{**_UNNAMED, "name": "f"}], tool_choice="required", text={"format": _JSON}
        ),
        "unsupported_parameter",
        "text",
    ),
    (("/cache/prewarm", {"model": "a"}), "invalid_value", "prompt"),
    (
        ("/cache/prewarm", {"model": "a", "prompt": "x", "tenant_key": "k", "shared": True}),
        "invalid_value",
        "tenant_key",
    ),
    (("/cache/prewarm", {"model": "a", "prompt": "x", "shared": True}), "invalid_value", "shared"),
    (("/admin/models/load", {}), "invalid_value", "name"),
    (("/admin/models/load", {"name": "a", "id": "z"}), "invalid_value", "id"),
]


@pytest.mark.parametrize(("request_", "code", "param"), CASES)
def test_a_refused_body_names_its_code(
    client: TestClient, request_: tuple[str, dict[str, object]], code: str, param: str
) -> None:
    path, body = request_
    assert_error(client.post(path, json=body), 400, code, param)


@pytest.mark.parametrize(
    ("path", "code", "param"),
    [
        ("/cache/rows/zz", "invalid_value", "key"),
        ("/cache/rows/" + "00" * 65, "invalid_value", "key"),
        ("/v1/responses/{id}?stream=true", "unsupported_parameter", "stream"),
        ("/v1/responses/{id}/input_items?order=up", "invalid_value", "order"),
        ("/v1/responses/{id}/input_items?limit=0", "invalid_value", "limit"),
        ("/v1/responses/{id}/input_items?after=nope", "invalid_value", "after"),
    ],
)
def test_a_refused_query_names_its_code(
    client: TestClient, path: str, code: str, param: str
) -> None:
    if "{id}" in path:
        made = client.post("/v1/responses", json=_responses()[1])
        assert made.status_code == 200, made.json()
        path = path.replace("{id}", made.json()["id"])
    assert_error(client.get(path), 400, code, param)
