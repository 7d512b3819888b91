"""``AffinityRouter`` (the Ray ``RequestRouter``) without a Ray cluster: fake replicas that
have what ``choose_replicas`` reads (an id, routing stats), typed calls as the first argument.
The rules themselves are ``tests/cluster/test_routing.py``'s; this checks the adapter feeds
them the right inputs and remembers where it sent each chain."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from kvwarm.cluster.calls import Generate, ModelOp
from kvwarm.cluster.chains import chat_chain
from kvwarm.cluster.router import AffinityRouter, request_chain
from kvwarm.cluster.routing import (
    Decision,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    register_policy,
    unregister_policy,
)
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import ConfigError
from kvwarm.settings import Settings

UNKNOWN = r"unknown routing policy 'nope'; expected one of .*prefix"
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


class Reverse:
    """A policy of the test's own: replica ids in reverse order, whatever they hold."""

    seen: ClassVar[list[tuple[RouteRequest, list[object]]]] = []

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config

    def rank(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        Reverse.seen.append((request, [v.reported.get("mine") for v in views]))
        return Decision([[v.id] for v in sorted(views, key=lambda v: v.id, reverse=True)], 0)


async def test_the_setting_selects_a_registered_policy_for_the_router() -> None:
    from kvwarm.cluster.deploy import routing_config

    register_policy("reverse", Reverse)
    try:
        config = routing_config(Settings(cluster_routing="reverse", n_parallel=3))
        assert config == RoutingConfig(policy="reverse", busy_requests=6)
        r = AffinityRouter(deployment_id=ENGINE, handle_source=DeploymentHandleSource.UNKNOWN)
        r.initialize_state(**asdict(config))  # as Ray does with request_router_kwargs
        a, b = FakeReplica("a", {"mine": 1}), FakeReplica("b", {"mine": 2})
        pending = chat("hello")
        groups = await r.choose_replicas([a, b], pending)  # type: ignore[arg-type]
        # The prefix policy would take "a" (equal load, then by id); this one takes "b".
        assert [[x.name for x in g] for g in groups] == [["b"], ["a"]]
        chain = request_chain(pending)  # type: ignore[arg-type]
        assert Reverse.seen == [(RouteRequest(chain, "m"), [1, 2])]  # what replicas reported
    finally:
        unregister_policy("reverse")
        Reverse.seen.clear()


def test_an_unknown_routing_setting_fails_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvwarm.cli import main
    from kvwarm.cluster import deploy

    with pytest.raises(ConfigError, match=UNKNOWN):
        deploy.routing_config(Settings(cluster_routing="nope"))

    def no_ray(*_a: object, **_k: object) -> None:
        raise AssertionError("Ray started for a bad setting")

    monkeypatch.setattr(deploy, "start_ray", no_ray)
    assert main(["cluster", "--cluster-routing", "nope"]) == 2
    assert "unknown routing policy 'nope'" in capsys.readouterr().err
