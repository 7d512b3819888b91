"""``AffinityRouter`` (the Ray ``RequestRouter``) without a Ray cluster: fake replicas that
have what ``choose_replicas`` reads (an id, routing stats), typed calls as the first argument.
The rules themselves are ``tests/cluster/test_routing.py``'s; this checks the adapter feeds
them the right inputs and remembers where it sent each chain."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.types import Namespace, RowInfo, SaveReason, TtlClass
from kvwarm.cluster.calls import Generate, ModelOp, SnapshotCall
from kvwarm.cluster.chains import chat_chain
from kvwarm.cluster.eventlog import EventLog
from kvwarm.cluster.router import AffinityRouter, request_chain, route_request
from kvwarm.cluster.routing import (
    Decision,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    register_policy,
    unregister_policy,
)
from kvwarm.cluster.routing.facts import Scope, Source
from kvwarm.cluster.routing.index import forget_indexes
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import ConfigError
from kvwarm.settings import Settings

UNKNOWN = r"unknown routing policy 'nope'; expected one of .*prefix"
ENGINE = DeploymentID(name="engine", app_name="kvwarm")
SYSTEM = {"role": "system", "content": "be brief"}
NS = Namespace(b"f" * 32, 1, b"c" * 32)


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict[str, object] = field(default_factory=dict)
    node_id: str = "node-1"

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(unique_id=self.name, deployment_id=ENGINE)


@dataclass
class FakePending:
    args: list[object]


@pytest.fixture(autouse=True)
def fresh_indexes() -> Iterator[None]:
    """Routers find their index by deployment in the process: each test starts empty."""
    forget_indexes()
    yield
    forget_indexes()


def router(policy: str = "prefix") -> AffinityRouter:
    r = AffinityRouter(deployment_id=ENGINE, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(busy_requests=2, policy=policy)
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


async def test_a_replica_that_leaves_loses_its_routes_and_a_stats_change_keeps_them() -> None:
    # Ray updates the replicas on every change of a replica's routing stats: the table is
    # scanned for routes to forget only when the set of replicas changed.
    r = router()
    a, b = FakeReplica("a"), FakeReplica("b")
    r.update_replicas([a, b])  # type: ignore[list-item]
    r.on_request_routed(chat("hello"), b.replica_id, None)  # type: ignore[arg-type]
    b.routing_stats = {"in_flight": 1}
    r.update_replicas([a, b])  # type: ignore[list-item]
    assert r._table.count(full_id(b)) == 1  # type: ignore[attr-defined]
    r.update_replicas([a])  # type: ignore[list-item]
    assert r._table.count(full_id(b)) == 0  # type: ignore[attr-defined]


async def test_its_own_route_counts_the_prompt_tokens_it_sent() -> None:
    r = router("events")
    a, b = FakeReplica("a"), FakeReplica("b")
    first = chat("hello")
    first.args[0] = dataclasses.replace(first.args[0], tokens=tuple(range(300)))
    r.on_request_routed(first, b.replica_id, None)  # type: ignore[arg-type]
    follow_up = chat("hello", "more")
    follow_up.args[0] = dataclasses.replace(follow_up.args[0], tokens=tuple(range(340)))
    views: list[ReplicaView] = []
    policy = r._policy  # type: ignore[attr-defined]
    rank = policy.rank

    def spy(request: RouteRequest, seen: Sequence[ReplicaView]) -> Decision:
        views.extend(seen)
        return rank(request, seen)

    policy.rank = spy
    groups = await r.choose_replicas([a, b], follow_up)  # type: ignore[arg-type]
    assert groups[0][0].name == "b"
    assert {v.id.split("#")[-1]: v.routed_tokens for v in views} == {"a": 0, "b": 300}


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


# ---- the events policy: the router feeds the index from routing stats ----------------------


def places() -> dict[str, tuple[Scope, Source]]:
    return {"ram": ("replica", "memory"), "disk": ("node", "local")}


def stored(name: str, tier: str, n_tokens: int) -> StoredRow:
    key = name.encode().ljust(32, b".")
    info = RowInfo(
        key, tier, 1, n_tokens, 0, 0.0, 0.0, SaveReason.FINISH, TtlClass.SHORT, False, NS
    )
    return StoredRow(info, tuple(range(n_tokens)), None, (key,), (n_tokens,))


async def test_cache_events_in_routing_stats_choose_the_replica() -> None:
    first = chat("hello")
    follow_up = chat("hello", "more")
    chain = request_chain(first)  # type: ignore[arg-type]
    log_a, log_b = EventLog(places(), epoch="a"), EventLog(places(), epoch="b")
    log_b.row_stored(stored("turn1", "ram", 700))
    log_b.served(chain, b"turn1".ljust(32, b"."), 700)
    a = FakeReplica("a", {"events": log_a.report(), "in_flight": 0})
    b = FakeReplica("b", {"events": log_b.report(), "in_flight": 1})
    r = router("events")
    groups = await r.choose_replicas([a, b], follow_up)  # type: ignore[arg-type]
    assert [g[0].name for g in groups] == ["b", "a"]  # 700 live - 128 load beats nothing
    # b's process dies; its node's directory holds the row a can read: a's turn.
    r.update_replicas([a])  # type: ignore[list-item]
    assert r.index.reach(follow_up.args[0].chain, None, {full_id(a): "node-1"}) == {}  # type: ignore[attr-defined]
    log_a.row_stored(stored("turn1", "disk", 700))
    a.routing_stats = {"events": log_a.report(), "in_flight": 0}
    r.update_replicas([a])  # type: ignore[list-item]
    parent = b"turn1".ljust(32, b".")
    assert r.index.reach((), parent, {full_id(a): "node-1"}) == {full_id(a): {"local": 700}}


async def test_a_gap_in_a_replicas_events_fetches_its_snapshot() -> None:
    log = EventLog(places(), window=1)
    a = FakeReplica("a", {"events": log.report()})
    r = router("events")
    asked: list[str] = []

    def fetch(rid: str) -> object:
        asked.append(rid)
        return log.snapshot()

    r.use_snapshot_fetch(fetch)
    r.update_replicas([a])  # type: ignore[list-item]
    for i in range(3):  # events in reports the router never sees
        log.row_stored(stored(f"k{i}", "ram", 100))
        log.report()
    a.routing_stats = {"events": log.report()}
    r.update_replicas([a])  # type: ignore[list-item]
    r.wait_resyncs(10.0)
    assert asked == [full_id(a)]
    rows, _, seq = r.index.facts_of(full_id(a)) or (frozenset(), frozenset(), 0)
    assert seq == log.seq and len(rows) == 3


async def test_a_snapshot_call_goes_to_its_replica_only() -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    r = router("events")
    call = FakePending([SnapshotCall(full_id(b))])
    groups = await r.choose_replicas([a, b], call)  # type: ignore[arg-type]
    assert [[x.name for x in g] for g in groups] == [["b"]]


@pytest.mark.parametrize(
    "call", [SnapshotCall("gone"), ModelOp("m", "prewarm", ("hi",), replica="gone")]
)
async def test_a_call_for_a_replica_gone_goes_to_one_that_refuses_it(call: object) -> None:
    """No replica at all (``[[]]``) made Ray retry, with backoff, until the call's deadline
    (600 s for a prewarm), holding one of its few routing tasks and the fan-out that waits
    for every replica (found by review); another replica refuses it at once instead."""
    a, b = FakeReplica("a"), FakeReplica("b")
    r = router("events")
    groups = await r.choose_replicas([a, b], FakePending([call]))  # type: ignore[arg-type]
    assert [[x.name for x in g] for g in groups] == [["a", "b"]]


async def test_a_prewarm_fanned_out_goes_to_its_replica_only() -> None:
    # A prewarm is sent to each running replica (found by review: one replica only was
    # warmed); the router puts each call on the replica it names, and the ingress learns
    # which replicas run from the index the router feeds.
    a, b = FakeReplica("a"), FakeReplica("b")
    r = router("events")
    r.update_replicas([a, b])  # type: ignore[list-item]
    assert r.index.running() == sorted([full_id(a), full_id(b)])
    call = FakePending([ModelOp("m", "prewarm", ("hi",), replica=full_id(b))])
    groups = await r.choose_replicas([a, b], call)  # type: ignore[arg-type]
    assert [[x.name for x in g] for g in groups] == [["b"]]
    r.update_replicas([a])  # type: ignore[list-item]
    assert r.index.running() == [full_id(a)]


def test_a_follow_up_carries_its_parent_row_to_the_policy() -> None:
    options = GenerationOptions(parent_key=b"p" * 32)
    call = Generate("m", "chat", options, chain=("x",))
    assert route_request(FakePending([call])) == RouteRequest(("x",), "m", b"p" * 32)  # type: ignore[arg-type]


def test_address_names_the_cluster_to_join(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvwarm.cli import main
    from kvwarm.cluster import deploy

    joined: list[object] = []

    def start_ray(address: str | None, **_kw: object) -> None:
        joined.append(address)
        raise ConfigError("stop here")  # the test needs no Ray

    monkeypatch.setattr(deploy, "start_ray", start_ray)
    assert main(["cluster", "--address", "127.0.0.1:6379", "--backend", "stub"]) == 2
    assert main(["cluster", "--ray-address", "ray://head:10001", "--backend", "stub"]) == 2
    assert joined == ["127.0.0.1:6379", "ray://head:10001"]
    assert deploy._loopback("127.0.0.1:6379") and deploy._loopback("[::1]:6379")
    assert not deploy._loopback("10.0.0.5:6379") and not deploy._loopback("ray://127.0.0.1:1")
    assert deploy.proxy_location("127.0.0.1") == "HeadOnly"
    assert deploy.proxy_location("0.0.0.0") == "EveryNode"


async def test_a_prompts_tokens_reach_the_replica_holding_its_chunks() -> None:
    from kvwarm.cache.formats.chunkfmt import chunk_keys
    from kvwarm.cache.formats.key import salted_namespace
    from kvwarm.cluster.routing.facts import encode_namespace

    tokens = tuple(range(100, 164))
    salt = "tenant-1"
    ns = salted_namespace(NS, salt.encode())
    info = RowInfo(
        b"r".ljust(32, b"."), "ram", 1, 48, 0, 0.0, 0.0, SaveReason.FINISH, TtlClass.SHORT,
        False, ns,
    )  # fmt: skip
    lens = (32, 16)
    row = StoredRow(info, tokens[:48], None, chunk_keys(ns, tokens[:48], lens), lens)
    log_a, log_b = EventLog(places(), epoch="a"), EventLog(places(), epoch="b")
    log_b.row_stored(row)
    namespaces = {"m": encode_namespace(NS)}
    a = FakeReplica("a", {"events": log_a.report(), "in_flight": 0, "namespaces": namespaces})
    b = FakeReplica("b", {"events": log_b.report(), "in_flight": 0, "namespaces": namespaces})
    r = router("events")
    options = GenerationOptions(cache_salt=salt)
    call = Generate("m", "chat", options, chain=("fresh",), tokens=tokens)
    groups = await r.choose_replicas([a, b], FakePending([call]))  # type: ignore[arg-type]
    assert [g[0].name for g in groups] == ["b", "a"]  # 48 tokens in b's RAM
    # Another tenant's salt keys other chunks: nothing held, the least loaded (a, by id).
    unsalted = Generate("m", "chat", GenerationOptions(), chain=("fresh",), tokens=tokens)
    groups = await r.choose_replicas([a, b], FakePending([unsalted]))  # type: ignore[arg-type]
    assert [g[0].name for g in groups] == ["a", "b"]
    # A model with LoRA adapters: a request under none of them (an empty set, as the server
    # sends for its plain requests, or scale 0) is keyed in the plain namespace, so it is
    # walked too; one under an adapter is not (its namespace folds the adapter on the
    # replica). Every request of such a model was left to rows and chains (found by review).
    for lora in ((), ((1, 0.0),)):
        plain = Generate("m", "chat", dataclasses.replace(options, lora=lora), tokens=tokens)
        groups = await r.choose_replicas([a, b], FakePending([plain]))  # type: ignore[arg-type]
        assert [g[0].name for g in groups] == ["b", "a"], lora
    adapted = dataclasses.replace(options, lora=((1, 1.0),))
    groups = await r.choose_replicas(
        [a, b], FakePending([dataclasses.replace(call, options=adapted)])
    )  # type: ignore[arg-type]
    assert [g[0].name for g in groups] == ["a", "b"]


def test_an_application_that_fails_to_deploy_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Serve raises a bare RuntimeError when the application fails to deploy (a replica
    whose model cannot load); ``kvwarm cluster`` said so with a traceback. Found by review."""
    from ray import serve

    from kvwarm.cli import main
    from kvwarm.cluster import deploy

    def failed(*_a: object, **_k: object) -> None:
        raise RuntimeError("Deploying application kvwarm failed: ModelNotFoundError: no file")

    monkeypatch.setattr(deploy, "start_ray", lambda *_a, **_k: None)
    monkeypatch.setattr(deploy, "shutdown", lambda **_k: None)
    monkeypatch.setattr(deploy, "alive_nodes", lambda: 1)
    monkeypatch.setattr(serve, "start", lambda **_k: None)
    monkeypatch.setattr(serve, "run", failed)
    assert main(["cluster", "--backend", "stub", "--model", "a=stub-a"]) == 1
    err = capsys.readouterr().err
    assert "the application did not start" in err and "ModelNotFoundError: no file" in err


class _FakeHandle:
    """What ``HandleCalls`` reads of the engine deployment's handle (no call is made)."""

    call = None
    generate = None

    def options(self, **_kw: object) -> _FakeHandle:
        return self


def test_the_ingress_meets_its_routers_index_under_any_application_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``serve run kvwarm.cluster.serve_app:app`` names the application "default" (a
    RayService, its own name): the router keys its index by that name, and the ingress,
    keying it by "kvwarm", fed and read another, so ``/cluster`` listed no replica and the
    served notes reached no router. Found by review."""
    from types import SimpleNamespace

    from ray import serve

    from kvwarm.cluster import deploy

    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(app_name="llm"))
    body = deploy.Ingress(Settings(backend="stub"), _FakeHandle())  # type: ignore[arg-type]
    app = body.__serve_build_asgi_app__()
    state = app.state.kvwarm  # type: ignore[attr-defined]
    engine = DeploymentID(name=deploy.ENGINE, app_name="llm")
    r = AffinityRouter(deployment_id=engine, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(policy="events")
    assert state.index is r.index


def test_a_stop_signal_while_the_application_deploys_stops_kvwarm_cluster(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Serve waits for the application to run with no deadline (replicas that cannot be
    placed, a model loading for minutes): SIGTERM or Ctrl-C then only marked the stop, and
    the process went on waiting, unstoppable but by SIGKILL. Found by review."""
    import os
    import signal
    import threading

    from ray import serve

    from kvwarm.cli import main
    from kvwarm.cluster import deploy

    removed: list[bool] = []

    def deploying(*_a: object, **_k: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # a stop asked while Serve waits
        threading.Event().wait(5.0)  # Serve's own wait for RUNNING, interruptible
        raise AssertionError("the stop signal did not end the deploy's wait")

    monkeypatch.setattr(deploy, "start_ray", lambda *_a, **_k: None)
    monkeypatch.setattr(deploy, "shutdown", lambda **_k: removed.append(True))
    monkeypatch.setattr(deploy, "alive_nodes", lambda: 1)
    monkeypatch.setattr(serve, "start", lambda **_k: None)
    monkeypatch.setattr(serve, "run", deploying)
    assert main(["cluster", "--backend", "stub", "--model", "a=stub-a"]) == 0
    assert removed == [True]  # the application (and an own Ray) removed on the way out
    assert "kvwarm cluster: http://" not in capsys.readouterr().out


# ---- the router's own record of a conversation ends when its replica holds none of it -----

DOCUMENT = tuple(range(1000, 1256))  # a long document two conversations start with


def tokenized(pending: FakePending, n: int) -> FakePending:
    call = pending.args[0]
    assert isinstance(call, Generate)
    pending.args[0] = dataclasses.replace(call, tokens=(*DOCUMENT, *range(n)))
    return pending


def one_slot_pair() -> tuple[AffinityRouter, FakeReplica, FakeReplica, EventLog, EventLog]:
    """Replicas a and b of one slot each; b's RAM holds the document's chunks (another
    conversation over it), a's nothing yet."""
    from kvwarm.cache.formats.chunkfmt import chunk_keys

    r = router("events")
    log_a, log_b = EventLog(places(), epoch="a", slots=1), EventLog(places(), epoch="b")
    info = RowInfo(
        b"doc".ljust(32, b"."), "ram", 1, 256, 0, 0.0, 0.0, SaveReason.FINISH, TtlClass.SHORT,
        False, NS,
    )  # fmt: skip
    log_b.row_stored(StoredRow(info, DOCUMENT, None, chunk_keys(NS, DOCUMENT, (256,)), (256,)))
    a, b = FakeReplica("a", node_id="node-1"), FakeReplica("b", node_id="node-2")
    report(r, (a, log_a), (b, log_b))
    return r, a, b, log_a, log_b


def report(r: AffinityRouter, *replicas: tuple[FakeReplica, EventLog]) -> None:
    from kvwarm.cluster.routing.facts import encode_namespace

    for replica, log in replicas:
        replica.routing_stats = {"events": log.report(), "namespaces": {"m": encode_namespace(NS)}}
    r.update_replicas([replica for replica, _ in replicas])  # type: ignore[misc]


async def first_choice(r: AffinityRouter, replicas: list[FakeReplica], pending: FakePending) -> str:
    groups = await r.choose_replicas(replicas, pending)  # type: ignore[arg-type]
    return str(groups[0][0].name)  # type: ignore[attr-defined]


async def test_its_own_route_stops_counting_once_the_replica_holds_nothing_of_it() -> None:
    """Found by review: the router's record of where it sent a conversation counted the
    earlier prompt at the ``live`` weight there for good, so after that replica reported
    the slot reused and the row evicted, the follow-up still went there (to prefill it
    all) over a replica holding most of the prompt in RAM."""
    r, a, b, log_a, log_b = one_slot_pair()
    first = tokenized(chat("hello"), 44)
    chain = request_chain(first)  # type: ignore[arg-type]
    r.on_request_routed(first, a.replica_id, None)  # type: ignore[arg-type]
    key = b"turn1".ljust(32, b".")
    r.index.note_served(full_id(a), chain, key, 300)  # the ingress, as the response ended
    log_a.served(chain, key, 300)
    turn1 = stored("turn1", "ram", 300)
    log_a.row_stored(turn1)
    # Then a's one slot went to another conversation and its RAM let the row go.
    log_a.served(("other",), None, 50)
    log_a.row_dropped(turn1, bytes_kept=False)
    report(r, (a, log_a), (b, log_b))
    assert r.index.reach(chain, None, {full_id(a): "node-1"}) == {}  # a holds none of it
    follow_up = tokenized(chat("hello", "more"), 84)
    assert await first_choice(r, [a, b], follow_up) == "b"  # 256 x 0.95 in b's RAM
    # A conversation sent there and not reported since (still running) keeps its claim.
    second = tokenized(chat("hello", "again"), 44)
    r.on_request_routed(second, a.replica_id, None)  # type: ignore[arg-type]
    assert await first_choice(r, [a, b], tokenized(chat("hello", "again", "more"), 84)) == "a"


async def test_its_own_route_holds_while_the_finish_row_is_on_its_way() -> None:
    """One slot a replica: the next conversation sent there reuses the slot at once, and
    the finish row's report comes after the slot's. The follow-up must stay (an earlier
    fix dropped the record on the slot's reuse alone, and live clusters saw conversations
    switch replicas); only the row's own report of leaving a's tiers ends it."""
    r, a, b, log_a, log_b = one_slot_pair()
    first = tokenized(chat("hello"), 44)
    chain = request_chain(first)  # type: ignore[arg-type]
    r.on_request_routed(first, a.replica_id, None)  # type: ignore[arg-type]
    key = b"turn1".ljust(32, b".")
    r.index.note_served(full_id(a), chain, key, 300)
    log_a.served(chain, key, 300)
    # Conversations in turn: the next one on a takes its slot before turn 1's row is saved.
    other = chat("another conversation")
    r.on_request_routed(other, a.replica_id, None)  # type: ignore[arg-type]
    r.index.note_served(full_id(a), request_chain(other), None, 50)  # type: ignore[arg-type]
    log_a.served(request_chain(other), None, 50)  # type: ignore[arg-type]
    report(r, (a, log_a), (b, log_b))
    follow_up = tokenized(chat("hello", "more"), 84)
    assert await first_choice(r, [a, b], follow_up) == "a"  # its row is on its way
    turn1 = stored("turn1", "ram", 300)
    log_a.row_stored(turn1)  # the row's report, after the slot's
    report(r, (a, log_a), (b, log_b))
    assert await first_choice(r, [a, b], follow_up) == "a"
    log_a.row_dropped(turn1, bytes_kept=False)  # now a holds nothing of it
    report(r, (a, log_a), (b, log_b))
    assert await first_choice(r, [a, b], follow_up) == "b"


# ---- a fault in the router's own path never leaves a request unrouted ----------------------


class Broken:
    """A policy with a bug: every ranking raises."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config

    def rank(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        raise RuntimeError("a bug in the policy")


async def test_a_routing_fault_falls_back_to_every_candidate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exception out of ``choose_replicas`` is not an error for the request: Ray logs it,
    its routing task ends, and the request waits, unrouted, until its deadline (found by
    review). The router logs the fault and lets Ray pick among all the candidates."""
    register_policy("broken", Broken)
    try:
        r = router("broken")
        a, b = FakeReplica("a"), FakeReplica("b")
        with caplog.at_level("ERROR", logger="kvwarm.cluster.router"):
            groups = await r.choose_replicas([a, b], chat("hello"))  # type: ignore[arg-type]
        assert [[x.name for x in g] for g in groups] == [["a", "b"]]
        assert "a bug in the policy" in caplog.text
        # Calls pinned to a replica are still pinned (they never reach the policy).
        pinned = FakePending([SnapshotCall(full_id(b))])
        groups = await r.choose_replicas([a, b], pinned)  # type: ignore[arg-type]
        assert [[x.name for x in g] for g in groups] == [["b"]]
    finally:
        unregister_policy("broken")


async def test_a_prompt_of_ids_no_vocabulary_has_is_routed() -> None:
    """A text completion's token ids reach the router as the client sent them; one outside
    0..2^32-1 made the chunk walk raise, and the request was never routed (found by
    review). It goes where its chain's facts say, for the replica to refuse it as a 400."""
    r, a, b, _log_a, _log_b = one_slot_pair()
    bad = (*DOCUMENT, -1)
    call = Generate("m", "text", GenerationOptions(), prompt=bad, tokens=bad)
    groups = await r.choose_replicas([a, b], FakePending([call]))  # type: ignore[arg-type]
    assert sorted(g[0].name for g in groups) == ["a", "b"]
    # With ids it can encode, the same prompt goes to b, whose RAM holds the document.
    call = dataclasses.replace(call, prompt=DOCUMENT, tokens=DOCUMENT)
    assert await first_choice(r, [a, b], FakePending([call])) == "b"
