"""A prewarm warms every replica (found by review): ``--prewarm-system`` (and a keep-alive
prewarm) was one call, routed to one replica, so only that replica's RAM held the prefix and
a conversation routed elsewhere prefilled it. Now each running replica gets its own call,
routed to it by id. No Ray: two replica bodies in this process behind a fake ``Calls``."""

from __future__ import annotations

import asyncio
import pickle
import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from tests.cluster.test_ingress_stub import DirectStream
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.cluster.calls import Generate, ModelOp, SnapshotCall
from kvwarm.cluster.ingress import create_ingress_app
from kvwarm.cluster.replica import EngineReplica
from kvwarm.cluster.routing import ClusterIndex
from kvwarm.errors import ReplicaUnavailableError

PROMPT = "You are a terse assistant. Answer in one word whenever you can."
SETTINGS = stub_settings(prewarm_system=(PROMPT,))


class TwoReplicas:
    """``ingress.Calls`` over two replicas: an op naming a replica runs there (the router
    routes it so), any other call on the first."""

    def __init__(self, replicas: list[EngineReplica]) -> None:
        self.by_id = {r.replica_id: r for r in replicas}
        self.ran: list[tuple[str, str]] = []  # (op, replica)
        self.broken: set[str] = set()  # replicas whose prewarms fail

    def replicas(self) -> list[str]:
        return list(self.by_id)

    def op(self, op: ModelOp) -> object:
        op = pickle.loads(pickle.dumps(op))
        target = getattr(op, "replica", None)
        replica = self.by_id[target] if target else next(iter(self.by_id.values()))
        self.ran.append((op.op, replica.replica_id))
        if op.op.startswith("prewarm") and replica.replica_id in self.broken:
            raise RuntimeError("ActorDiedError: the replica's process died")
        return pickle.loads(pickle.dumps(asyncio.run(replica.call(op))))

    def stream(self, call: Generate) -> DirectStream:
        first = next(iter(self.by_id.values()))
        return DirectStream(first.generate(pickle.loads(pickle.dumps(call))))


@pytest.fixture
def replicas() -> Iterator[list[EngineReplica]]:
    bodies = [EngineReplica(SETTINGS, replica_id=f"replica-{i}") for i in (1, 2)]
    yield bodies
    for body in bodies:
        body.engine.close()


def _ram_rows(replica: EngineReplica) -> float:
    return replica.engine.cache.counters().get("tier_ram_rows", 0.0)


def test_prewarm_system_warms_every_replica(replicas: list[EngineReplica]) -> None:
    calls = TwoReplicas(replicas)
    with TestClient(create_ingress_app(SETTINGS, calls)) as client:
        wait_ready(client.get)
        prewarms = [(op, r) for op, r in calls.ran if op == "prewarm"]
        # One prewarm per model (a and b) and replica.
        assert sorted(prewarms) == sorted([("prewarm", "replica-1"), ("prewarm", "replica-2")] * 2)
        for replica in replicas:
            assert _ram_rows(replica) >= 2, replica.replica_id  # both models' prefix rows


class IndexedReplicas(TwoReplicas):
    """The running replicas as the router tells them to the index (``HandleCalls``);
    ``moved`` is set once the ingress prewarms or waits for replicas, whichever is first."""

    def __init__(self, replicas: list[EngineReplica], index: ClusterIndex) -> None:
        super().__init__(replicas)
        self.index = index
        self.moved = threading.Event()

    def replicas(self) -> list[str]:
        return self.index.running()

    def op(self, op: ModelOp) -> object:
        if op.op.startswith("prewarm"):
            self.moved.set()
        return super().op(op)


class WatchedIndex(ClusterIndex):
    def __init__(self, moved: threading.Event) -> None:
        super().__init__()
        self.moved = moved

    def wait_running(self, n: int, timeout_s: float | None) -> list[str]:
        self.moved.set()
        return super().wait_running(n, timeout_s)


def test_at_start_up_the_prewarm_waits_for_every_replica_to_run(
    replicas: list[EngineReplica],
) -> None:
    # Under Ray the ingress may start while a replica still loads: the router knows one.
    moved = threading.Event()
    index = WatchedIndex(moved)
    index.retain({"replica-1": None})
    calls = IndexedReplicas(replicas, index)
    calls.moved = moved
    settings = SETTINGS.replace(replicas=2, cluster_call_timeout_s=120.0)
    with TestClient(create_ingress_app(settings, calls, index)) as client:
        assert moved.wait(60)  # the ingress prewarmed already, or waits for replicas
        index.retain({"replica-1": None, "replica-2": None})  # the second one is up
        wait_ready(client.get)
    # Both models' prompt on both replicas.
    warmed = sorted(r for op, r in calls.ran if op == "prewarm")
    assert warmed == ["replica-1", "replica-1", "replica-2", "replica-2"], calls.ran


def test_the_wait_for_replicas_is_bounded(replicas: list[EngineReplica]) -> None:
    index = ClusterIndex()
    index.retain({"replica-1": None})
    calls = IndexedReplicas(replicas, index)
    settings = SETTINGS.replace(replicas=2, cluster_call_timeout_s=0.2)
    with TestClient(create_ingress_app(settings, calls, index)) as client:
        wait_ready(client.get)  # the replica that never came is not waited for
    assert _ram_rows(replicas[0]) >= 2 and _ram_rows(replicas[1]) == 0


def test_a_replica_that_fails_its_prewarm_leaves_the_others_warm(
    replicas: list[EngineReplica],
) -> None:
    calls = TwoReplicas(replicas)
    calls.broken = {"replica-2"}
    with TestClient(create_ingress_app(SETTINGS, calls)) as client:
        wait_ready(client.get)  # the models are served: one replica holds the prefix
        assert client.get("/health").json()["status"] == "ok"
    assert _ram_rows(replicas[0]) >= 2 and _ram_rows(replicas[1]) == 0


def test_a_prewarm_every_replica_fails_is_the_first_error(replicas: list[EngineReplica]) -> None:
    calls = TwoReplicas(replicas)
    with TestClient(create_ingress_app(stub_settings(), calls)) as client:
        wait_ready(client.get)
        calls.broken = {"replica-1", "replica-2"}
        model = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
        with pytest.raises(ReplicaUnavailableError, match=r"replica replica-1 .*RuntimeError"):
            model.prewarm("hello there")


def test_a_replica_refuses_an_op_meant_for_another(replicas: list[EngineReplica]) -> None:
    # The router sends it here only once its own replica is gone (``router._pinned``).
    op = ModelOp("a", "tokenize", ("hi",), replica="replica-2")
    failed = asyncio.run(replicas[0].call(op))
    assert isinstance(getattr(failed, "error", None), ReplicaUnavailableError)
    with pytest.raises(ReplicaUnavailableError, match="not running"):
        asyncio.run(replicas[0].snapshot(SnapshotCall("replica-2")))


def _joins_done(client: TestClient) -> None:
    """Every join prewarm submitted so far has run (one worker: FIFO)."""
    client.app.state.kvwarm._joins.submit(lambda: None).result(60)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_replica_that_starts_later_gets_the_kept_prefixes_at_once(
    replicas: list[EngineReplica], caplog: pytest.LogCaptureFixture
) -> None:
    # A replacement after a death, a scale-up: found by review, it got the pinned prefixes
    # only at the keep-alive's next re-warm (never with keepalive_interval_s=0).
    index = ClusterIndex()
    index.retain({"replica-1": None})
    calls = IndexedReplicas(replicas, index)
    settings = SETTINGS.replace(keepalive_interval_s=0.0)
    with TestClient(create_ingress_app(settings, calls, index)) as client:
        wait_ready(client.get)
        assert _ram_rows(replicas[1]) == 0
        before = len(calls.ran)
        index.retain({"replica-1": None, "replica-2": None})  # the router learns it runs
        _joins_done(client)
        assert sorted(calls.ran[before:]) == [("prewarm", "replica-2")] * 2  # a and b, there
        assert _ram_rows(replicas[1]) >= 2
        index.retain({"replica-1": None, "replica-2": None})  # known already: once only
        index.observe("replica-2", None, {})
        _joins_done(client)
        assert len(calls.ran) == before + 2
        # A replica whose prewarm fails is logged and passed over.
        calls.by_id["replica-3"] = replicas[0]
        calls.broken = {"replica-3"}
        index.retain({"replica-1": None, "replica-2": None, "replica-3": None})
        _joins_done(client)
        assert client.get("/health").json()["status"] == "ok"
    assert "on new replica replica-3 failed" in caplog.text


class JoinsMidAttach(IndexedReplicas):
    """Replica 2 starts while model a is being attached, just after its fan-out read the
    running replicas (at its first prewarm), and the ingress has seen it join before the
    attach goes on."""

    state: object = None

    def op(self, op: ModelOp) -> object:
        if op.op == "prewarm" and "replica-2" not in self.index.running():
            self.index.retain({"replica-1": None, "replica-2": None})
            self.state._joins.submit(lambda: None).result(60)  # type: ignore[attr-defined]
        return super().op(op)


@pytest.mark.slow
def test_a_replica_that_joins_during_an_attach_is_warmed_once_attached(
    replicas: list[EngineReplica],
) -> None:
    # Found by review: it missed both paths, the attach's fan-out (which read the running
    # replicas before it joined) and the join's (the model was not ready yet).
    index = ClusterIndex()
    index.retain({"replica-1": None})
    calls = JoinsMidAttach(replicas, index)
    app = create_ingress_app(SETTINGS.replace(keepalive_interval_s=0.0), calls, index)
    calls.state = app.state.kvwarm
    with TestClient(app) as client:
        wait_ready(client.get)
        _joins_done(client)
        # Each model's prompt once on each replica: a's on replica 2 after its attach.
        warmed = sorted(r for op, r in calls.ran if op == "prewarm")
        assert warmed == ["replica-1", "replica-1", "replica-2", "replica-2"], calls.ran
        assert _ram_rows(replicas[1]) >= 2
        # The index announces a replica just after it runs: an announce the fan-out beat
        # warms nothing twice; a later one (it came back after being thought dead) does.
        state = client.app.state.kvwarm  # type: ignore[attr-defined]
        state._fanned["a"].add("replica-1")
        before = len(calls.ran)
        state._warm_joined("replica-1")
        assert [r for _, r in calls.ran[before:]] == ["replica-1"]  # b's only
        state._warm_joined("replica-1")
        assert [r for _, r in calls.ran[before:]] == ["replica-1"] * 3
