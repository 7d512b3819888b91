"""Every call the ingress makes to a replica has a deadline (found by review): the blocking
handle calls (tokenize, templates, model info, embeddings, prewarms) waited without one, so a
replica that was alive but stuck held an ingress thread for good. A call past its deadline is
cancelled on its replica and answered 504 ``replica_timeout``. No Ray: the deployment handle
is a fake with Ray's ``result(timeout_s=)`` contract (``TimeoutError`` when no answer came)."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tests.cluster.test_ingress_stub import DirectStream
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.cluster import replica as replica_module
from kvwarm.cluster.calls import Generate, ModelOp
from kvwarm.cluster.deploy import HandleCalls
from kvwarm.cluster.ingress import create_ingress_app
from kvwarm.cluster.remote import MODEL_PASS_OPS, OpDeadlines, RemoteModel
from kvwarm.cluster.replica import EngineReplica
from kvwarm.engine.cancel import Cancellation
from kvwarm.engine.ops import CALLS, CANCELLABLE
from kvwarm.engine.types import ModelInfo
from kvwarm.errors import ReplicaTimeoutError, ReplicaUnavailableError, RequestCancelledError
from kvwarm.server.errors import error_response


class FakeResponse:
    """A ``DeploymentResponse``: ``result`` answers, or (stuck) raises ``TimeoutError`` as
    Ray does once ``timeout_s`` passed; without a deadline a stuck call would never return."""

    def __init__(self, op: ModelOp, replica: EngineReplica, stuck: bool) -> None:
        self.op, self.replica, self.stuck = op, replica, stuck
        self.timeout_s: float | None = None
        self.cancelled = False

    def result(self, timeout_s: float | None = None) -> object:
        self.timeout_s = timeout_s
        if self.stuck:
            if timeout_s is None:
                raise AssertionError(f"{self.op.op}: no deadline, the thread would wait for good")
            raise TimeoutError(f"Timed out after {timeout_s}s.")
        return pickle.loads(pickle.dumps(asyncio.run(self.replica.call(self.op))))

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """The two handle methods ``HandleCalls`` uses, over one replica in this process."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica = replica
        self.stuck: set[str] = set()
        self.responses: list[FakeResponse] = []
        self.call = SimpleNamespace(remote=self._call)

    def _call(self, op: ModelOp) -> FakeResponse:
        op = pickle.loads(pickle.dumps(op))
        response = FakeResponse(op, self.replica, op.op in self.stuck)
        self.responses.append(response)
        return response

    def options(self, **_options: object) -> SimpleNamespace:
        def generate(call: Generate) -> DirectStream:
            return DirectStream(self.replica.generate(pickle.loads(pickle.dumps(call))))

        return SimpleNamespace(generate=SimpleNamespace(remote=generate))

    def last(self, op: str) -> FakeResponse:
        return next(r for r in reversed(self.responses) if r.op.op == op)


SETTINGS = stub_settings(cluster_call_timeout_s=2.5, request_timeout_s=40.0)


@pytest.fixture(scope="module")
def replica() -> Iterator[EngineReplica]:
    body = EngineReplica(SETTINGS, replica_id="replica-1")
    yield body
    body.engine.close()


@pytest.fixture
def handle(replica: EngineReplica) -> FakeHandle:
    return FakeHandle(replica)


@pytest.fixture
def client(handle: FakeHandle) -> Iterator[TestClient]:
    calls = HandleCalls(handle)  # type: ignore[arg-type]
    with TestClient(create_ingress_app(SETTINGS, calls)) as test_client:
        wait_ready(test_client.get)
        yield test_client


def test_every_call_the_ingress_makes_carries_a_deadline(
    client: TestClient, handle: FakeHandle
) -> None:
    assert handle.last("info").timeout_s == 2.5  # the model's info, fetched at start-up
    done = client.post("/tokenize", json={"model": "a", "content": "hello"})
    assert done.status_code == 200, done.json()
    assert handle.last("tokenize").timeout_s == 2.5


def test_a_stuck_tokenize_is_a_504_and_its_call_is_cancelled(
    client: TestClient, handle: FakeHandle
) -> None:
    handle.stuck = {"tokenize"}
    response = client.post("/tokenize", json={"model": "a", "content": "hello"})
    assert response.status_code == 504, response.json()
    assert response.json()["error"]["code"] == "replica_timeout"
    stuck = handle.last("tokenize")
    assert stuck.timeout_s == 2.5 and stuck.cancelled
    # The ingress is not held: the next call answers.
    handle.stuck = set()
    assert client.post("/detokenize", json={"model": "a", "tokens": [1, 2]}).status_code == 200


def test_a_stuck_template_check_fails_a_tool_request_with_504(
    client: TestClient, handle: FakeHandle
) -> None:
    handle.stuck = {"apply_chat_template"}
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 504, response.json()
    assert handle.last("apply_chat_template").cancelled


def test_a_replica_stuck_at_start_up_fails_the_model_not_the_ingress(
    replica: EngineReplica,
) -> None:
    handle = FakeHandle(replica)
    handle.stuck = {"info"}
    calls = HandleCalls(handle)  # type: ignore[arg-type]
    with (
        TestClient(create_ingress_app(SETTINGS, calls)) as test_client,
        pytest.raises(AssertionError, match="ReplicaTimeoutError"),
    ):
        wait_ready(test_client.get, deadline_s=30)
    assert handle.last("info").cancelled


def _remote(deadlines: OpDeadlines) -> tuple[RemoteModel, list[ModelOp]]:
    info = ModelInfo("m", "stub", "stub", 512, 64, 2, 100, 512, 8, 0, "", "00", "fast", "ram", True)
    seen: list[ModelOp] = []

    def op_call(op: ModelOp) -> object:
        seen.append(op)
        return None

    def no_stream(call: Generate) -> Any:
        raise AssertionError("no generation expected")

    return RemoteModel(info, no_stream, op_call, deadlines=deadlines), seen


CALLERS: dict[str, Callable[[RemoteModel], object]] = {
    "tokenize": lambda m: m.tokenize("x"),
    "detokenize": lambda m: m.detokenize([1]),
    "token_pieces": lambda m: m.token_pieces([1]),
    "apply_chat_template": lambda m: m.apply_chat_template([{"role": "user", "content": "x"}]),
    "chat_tokens": lambda m: m.chat_tokens([{"role": "user", "content": "x"}]),
    "count_chat_tokens": lambda m: m.count_chat_tokens([{"role": "user", "content": "x"}]),
    "infill_tokens": lambda m: m.infill_tokens("a", "b"),
    "embed": lambda m: m.embed(["x"]),
    "rerank": lambda m: m.rerank("q", ["d"]),
    "prewarm": lambda m: m.prewarm("x"),
    "prewarm_chat": lambda m: m.prewarm_chat([{"role": "user", "content": "x"}]),
}


def test_every_call_is_covered_below() -> None:
    assert set(CALLERS) == CALLS - {"info"}


@pytest.mark.parametrize("op", sorted(CALLERS))
def test_model_passes_take_request_timeout_s_the_rest_cluster_call_timeout_s(op: str) -> None:
    model, seen = _remote(OpDeadlines.of(SETTINGS))
    with contextlib.suppress(AssertionError):  # the fake answers None, not the op's type
        CALLERS[op](model)
    assert [o.op for o in seen] == [op]
    assert seen[0].timeout_s == (40.0 if op in MODEL_PASS_OPS else 2.5)


def test_zero_turns_a_deadline_off() -> None:
    deadlines = OpDeadlines.of(stub_settings(cluster_call_timeout_s=0, request_timeout_s=0))
    assert deadlines("tokenize") is None and deadlines("embed") is None


def test_a_replica_timeout_is_a_typed_504() -> None:
    error = ReplicaTimeoutError("no replica answered tokenize")
    assert isinstance(error, ReplicaUnavailableError)  # a tool probe re-raises it too
    assert error_response(error, "/v1/chat/completions").status_code == 504


# --- a caller's cancellation (the route's, on its client's disconnect) -----------------------


@pytest.mark.parametrize("op", sorted(CANCELLABLE))
def test_a_cancellation_stays_at_the_ingress_and_cancels_the_call(op: str) -> None:
    """The route's ``Cancellation`` does not cross to the replica (it could not: the replica
    makes its own); it goes to the call, which it cancels. The deadline crosses."""
    sent: list[tuple[ModelOp, Cancellation | None]] = []

    def op_call(call: ModelOp, cancel: Cancellation | None = None) -> object:
        sent.append((call, cancel))
        return None

    def no_stream(call: Generate) -> Any:
        raise AssertionError("no generation expected")

    info = ModelInfo("m", "stub", "stub", 512, 64, 2, 100, 512, 8, 0, "", "00", "fast", "ram", True)
    model = RemoteModel(info, no_stream, op_call, deadlines=OpDeadlines.of(SETTINGS))
    cancel = Cancellation()
    with contextlib.suppress(AssertionError):  # the fake answers None, not the op's type
        if op == "embed":
            model.embed(["x"], timeout_s=9.0, cancel=cancel)
        else:
            model.rerank("q", ["d"], timeout_s=9.0, cancel=cancel)
    ((call, given),) = sent
    assert given is cancel and "cancel" not in call.kwargs and call.kwargs["timeout_s"] == 9.0


class _HeldResponse:
    """A call the replica is still running: ``result`` returns once it is cancelled, with
    Ray's error for a cancelled call."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.cancelled = threading.Event()

    def result(self, timeout_s: float | None = None) -> object:
        self.waiting.set()
        assert self.cancelled.wait(60)
        raise RuntimeError("RequestCancelledError: the request was cancelled")

    def cancel(self) -> None:
        self.cancelled.set()


def test_a_cancelled_call_is_cancelled_on_its_replica() -> None:
    response = _HeldResponse()
    handle = SimpleNamespace(
        call=SimpleNamespace(remote=lambda _op: response),
        options=lambda **_o: SimpleNamespace(generate=None),
    )
    calls = HandleCalls(handle)  # type: ignore[arg-type]
    cancel = Cancellation()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            calls.op(ModelOp("a", "embed", (["x"],), timeout_s=40.0), cancel)
        except BaseException as exc:
            failure.append(exc)

    caller = threading.Thread(target=run)
    caller.start()
    assert response.waiting.wait(60)
    cancel.cancel()
    caller.join(60)
    assert response.cancelled.is_set()
    assert len(failure) == 1 and isinstance(failure[0], RequestCancelledError), failure


def test_a_replica_cancels_an_embedding_when_its_call_is(
    replica: EngineReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray cancels a replica's call when the ingress does (its client left, its deadline
    passed): the embedding or rerank the replica's thread runs is cancelled with it, not left
    running for nobody."""
    made: list[Cancellation] = []

    class Recorded(Cancellation):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(replica_module, "Cancellation", Recorded)

    async def cancelled_call() -> None:
        task = asyncio.ensure_future(replica.call(ModelOp("a", "embed", (["x"],))))
        await asyncio.sleep(0)  # it has handed the embedding to its thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_call())
    (cancel,) = made
    assert cancel.cancelled
    # And an uncancelled call passes it to the model, which answers as before.
    answer = asyncio.run(replica.call(ModelOp("a", "embed", (["x"],))))
    assert isinstance(answer, list) and len(answer) == 1
