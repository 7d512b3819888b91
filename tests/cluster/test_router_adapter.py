"""``AffinityRouter`` (the Ray ``RequestRouter``) without a Ray cluster: fake replicas that
have what ``choose_replicas`` reads (an id, routing stats), typed calls as the first argument.
The rules themselves are ``tests/cluster/test_routing.py``'s; this checks the adapter feeds
them the right inputs and remembers where it sent each chain."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from kvwarm.cluster.calls import Generate, ModelOp
from kvwarm.cluster.chains import chat_chain
from kvwarm.cluster.router import AffinityRouter, request_chain
from kvwarm.engine.types import GenerationOptions

ENGINE = DeploymentID(name="engine", app_name="kvwarm")
SYSTEM = {"role": "system", "content": "be brief"}


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict[str, object] = field(default_factory=dict)

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(unique_id=self.name, deployment_id=ENGINE)


@dataclass
class FakePending:
    args: list[object]


def router() -> AffinityRouter:
    r = AffinityRouter(deployment_id=ENGINE, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(busy_requests=2)
    return r


def chat(*turns: str) -> FakePending:
    messages = [SYSTEM] + [{"role": "user", "content": t} for t in turns]
    call = Generate("m", "chat", GenerationOptions(), chain=chat_chain("m", messages))
    return FakePending([call])


def full_id(replica: FakeReplica) -> str:
    return replica.replica_id.to_full_id_str()


async def test_reported_warm_chains_choose_the_replica() -> None:
    pending = chat("hello", "and then?")
    chain = request_chain(pending)  # type: ignore[arg-type]
    a = FakeReplica("a", {"warm": [chain[0]], "in_flight": 0})
    b = FakeReplica("b", {"warm": ["other"], "in_flight": 0})
    groups = await router().choose_replicas([b, a], pending)  # type: ignore[arg-type]
    assert [[r.name for r in g] for g in groups] == [["a"], ["b"]]


async def test_its_own_routes_count_before_any_report() -> None:
    r = router()
    a, b = FakeReplica("a"), FakeReplica("b")
    first = chat("hello")
    r.on_request_routed(first, b.replica_id, None)  # type: ignore[arg-type]
    follow_up = chat("hello", "more")
    groups = await r.choose_replicas([a, b], follow_up)  # type: ignore[arg-type]
    assert groups[0][0].name == "b"
    # A new conversation goes to the replica holding less.
    fresh = await r.choose_replicas([a, b], chat("something else"))  # type: ignore[arg-type]
    assert fresh[0][0].name == "a"
    # b dies: the table forgets it, so its conversations are free to move.
    r.on_replica_actor_died(b.replica_id)
    moved = await r.choose_replicas([a], follow_up)  # type: ignore[arg-type]
    assert [[x.name for x in g] for g in moved] == [["a"]]


async def test_busy_replica_reported_in_flight_is_passed_over() -> None:
    pending = chat("hello", "again")
    chain = request_chain(pending)  # type: ignore[arg-type]
    warm = FakeReplica("warm", {"warm": list(chain[:1]), "in_flight": 5})
    cold = FakeReplica("cold", {"warm": [], "in_flight": 0})
    groups = await router().choose_replicas([warm, cold], pending)  # type: ignore[arg-type]
    assert [g[0].name for g in groups] == ["cold", "warm"]


def test_only_typed_calls_carry_a_chain() -> None:
    assert request_chain(None) == ()
    assert request_chain(FakePending([])) == ()  # type: ignore[arg-type]
    assert request_chain(FakePending(["text"])) == ()  # type: ignore[arg-type]
    op = ModelOp("m", "prewarm", chain=("x",))
    assert request_chain(FakePending([op])) == ("x",)  # type: ignore[arg-type]
    assert full_id(FakeReplica("a")).endswith("a")
