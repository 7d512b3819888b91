"""A request with tools asks the model's template whether it renders them: two renders, which
under ``kvwarm cluster`` are two replica round trips a request (found by review). The answer
is remembered per model object and tool set, so a reattached (reloaded) model asks again."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
from fastapi.testclient import TestClient
from tests.cluster.test_ingress_stub import SYSTEM, DirectCalls
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.cluster.calls import Generate, ModelOp
from kvwarm.cluster.ingress import create_ingress_app
from kvwarm.cluster.remote import RemoteModel
from kvwarm.cluster.replica import EngineReplica
from kvwarm.engine.types import ModelInfo
from kvwarm.server.chat import PROBED_TOOL_SETS, renders_tools
from kvwarm.server.schemas import Tool


def _tool(name: str) -> Tool:
    return Tool.model_validate({"type": "function", "function": {"name": name}})


class Template:
    """A replica's ``apply_chat_template`` that renders tool names, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, op: ModelOp) -> object:
        assert op.op == "apply_chat_template"
        self.calls += 1
        tools = op.kwargs.get("tools") or []
        assert isinstance(tools, list)
        names = [t["function"]["name"] for t in tools if isinstance(t, Mapping)]
        return "<user>hi</user>" + "".join(f"<tool>{n}</tool>" for n in names)


def _remote(template: Template) -> RemoteModel:
    info = ModelInfo("m", "stub", "stub", 512, 64, 2, 100, 512, 8, 0, "", "00", "fast", "ram", True)

    def no_stream(call: Generate) -> object:
        raise AssertionError("no generation expected")

    return RemoteModel(info, no_stream, template)  # type: ignore[arg-type]


def test_the_answer_is_remembered_per_model_and_tool_set() -> None:
    template = Template()
    model = _remote(template)
    assert renders_tools(model, [_tool("get_time")])
    assert renders_tools(model, [_tool("get_time")])
    assert template.calls == 2  # one probe: with the tools, and without
    assert renders_tools(model, [_tool("get_weather")])
    assert template.calls == 4  # another tool set is probed
    reattached = _remote(template)  # the model reloaded: a new object asks again
    assert renders_tools(reattached, [_tool("get_time")])
    assert template.calls == 6


def test_the_memory_per_model_is_bounded() -> None:
    template = Template()
    model = _remote(template)
    for i in range(PROBED_TOOL_SETS + 1):
        renders_tools(model, [_tool(f"tool_{i}")])
    renders_tools(model, [_tool(f"tool_{PROBED_TOOL_SETS}")])  # the newest: remembered
    assert template.calls == 2 * (PROBED_TOOL_SETS + 1)
    renders_tools(model, [_tool("tool_0")])  # the oldest went first
    assert template.calls == 2 * (PROBED_TOOL_SETS + 2)


class CountingCalls(DirectCalls):
    def __init__(self, replica: EngineReplica) -> None:
        super().__init__(replica)
        self.ops: list[str] = []

    def op(self, op: ModelOp) -> object:
        self.ops.append(op.op)
        return super().op(op)


@pytest.fixture(scope="module")
def replica() -> Iterator[EngineReplica]:
    body = EngineReplica(stub_settings(), replica_id="replica-1")
    yield body
    body.engine.close()


def test_tool_requests_through_the_ingress_probe_the_template_once(
    replica: EngineReplica,
) -> None:
    calls = CountingCalls(replica)
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    body = {"model": "a", "messages": [SYSTEM], "tools": [tool], "max_tokens": 3}
    with TestClient(create_ingress_app(stub_settings(), calls)) as client:
        wait_ready(client.get)
        for _ in range(3):
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.json()
    # The tool set's probe (with the tools, and without), then, the stub's template showing
    # none, whether it takes a system message to describe them in: each once.
    assert calls.ops.count("apply_chat_template") == 3
