"""``AffinityRouter``: Ray Serve's ``RequestRouter`` that places requests where a routing policy
ranks them first (``routing``; the default, ``events``, by what each replica's cache could
serve of the request, from the replicas' cache events).

Invariants: the decision is the configured routing policy's (``routing``, pure, chosen by
name: ``RoutingConfig.policy``); this class only gathers its inputs from Ray (the live
candidates, their nodes, their queue lengths, the routing stats replicas report) and from
this process's ``ClusterIndex`` (``routing/index.py``: every replica's cache events, applied
as their reports arrive, plus what the ingress saw them serve) and the router's own
``AffinityTable`` (where it sent each chain, so a follow-up that arrives before the next
report still finds its replica). It routes each request to the replica chosen for *that*
request (no FIFO reassignment, which would move a conversation off its replica). A
``SnapshotCall`` goes to the replica it names and nowhere else.

When a replica's events show a gap (reports missed, this router new), the router fetches
that replica's snapshot on a thread of its own, one at a time per replica, through a handle
to its deployment; until it arrives the index keeps what it had. Dead replicas leave the
candidates through Ray (health checks, ``ActorDiedError`` on a probe) and leave the table
and the index here; a call for one that is gone (a fan-out that read the running replicas
just before it died) goes to another, which refuses it at once. A fault in gathering or
ranking (a policy's bug) never leaves a request unrouted: it is logged and Ray picks among all
the candidates.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvwarm.cache.formats.key import salted_namespace
from kvwarm.cache.types import Namespace
from kvwarm.cluster.calls import Generate, ModelOp, SnapshotCall
from kvwarm.cluster.routing import (
    AffinityTable,
    ClusterIndex,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    build_policy,
    index_for,
)
from kvwarm.cluster.routing.facts import decode_namespace
from kvwarm.cluster.routing.index import index_name

log = logging.getLogger("kvwarm.cluster.router")

SNAPSHOT_TIMEOUT_S = 30.0

SnapshotFetch = Callable[[str], object]  # replica id -> its snapshot (plain values)


def route_request(pending: PendingRequest | None) -> RouteRequest:
    """What a ``Generate`` or ``ModelOp`` carried as its first argument tells a routing
    policy (an empty request for any other call)."""
    if pending is None or not pending.args:
        return RouteRequest()
    call = pending.args[0]
    if isinstance(call, Generate):
        return RouteRequest(call.chain, call.model_id, call.options.parent_key, call.tokens)
    if isinstance(call, ModelOp):
        return RouteRequest(chain=call.chain, model_id=call.model_id)
    return RouteRequest()


def request_namespace(call: Generate, replicas: Sequence[RunningReplica]) -> Namespace | None:
    """The cache namespace ``call``'s prompt is keyed in: its model's, as the replicas report
    it (``EngineReplica.record_routing_stats``), salted by its cache salt. None when no
    replica reported it yet, or when the call runs under LoRA adapters (their set is folded
    into the namespace on the replica); an empty set, or adapters at scale 0, is the plain
    model's namespace (what the server sends for a plain request of a model with adapters,
    whose own set it keeps empty: ``server/lora.py``)."""
    if any(scale != 0.0 for _, scale in call.options.lora or ()):
        return None
    for replica in replicas:
        stats = replica.routing_stats or {}
        namespaces = stats.get("namespaces")
        raw = namespaces.get(call.model_id) if isinstance(namespaces, Mapping) else None
        base = decode_namespace(raw)
        if base is not None:
            return salted_namespace(base, call.options.salt_bytes())
    return None


def request_chain(pending: PendingRequest | None) -> tuple[str, ...]:
    """The chain a ``Generate`` or ``ModelOp`` carries as its first argument (else none)."""
    return route_request(pending).chain


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


class AffinityRouter(RequestRouter):
    """Configured by ``RequestRouterConfig(request_router_kwargs=...)`` with the fields of
    ``RoutingConfig`` (``deploy.py`` passes the settings' values), the policy among them."""

    # Ray skips a replica that does not say its queue length within this deadline (its
    # default, 0.1 s, is often missed by a replica whose cores are busy decoding, which would
    # move a conversation off its warm replica for no reason).
    queue_len_response_deadline_s = 0.5

    def initialize_state(self, **kwargs: Any) -> None:
        self._policy = build_policy(RoutingConfig(**kwargs))
        self._table = AffinityTable()
        # Reported hash lists, as sets, rebuilt only when a replica's report changes.
        self._warm: dict[str, tuple[int, frozenset[str]]] = {}
        deployment = self._deployment_id
        self._index: ClusterIndex = index_for(index_name(deployment.app_name, deployment.name))
        self._seen: dict[str, int] = {}  # id() of each replica's last stats applied
        self._fetching: dict[str, threading.Thread] = {}
        self._fetch_lock = threading.Lock()
        self._fetch: SnapshotFetch | None = None
        self._live: frozenset[str] = frozenset()  # the replica ids the table last kept

    def _ensure_state(self) -> None:
        if not hasattr(self, "_table"):
            self.initialize_state()

    @property
    def index(self) -> ClusterIndex:
        self._ensure_state()
        return self._index

    def use_snapshot_fetch(self, fetch: SnapshotFetch) -> None:
        """Fetch snapshots with ``fetch`` instead of a handle (tests)."""
        self._ensure_state()
        self._fetch = fetch

    # ---------------------------------------------------------------- the index's feed

    def _ingest(self, replica: RunningReplica) -> None:
        """Apply a replica's routing stats to the index once per report."""
        rid = replica.replica_id.to_full_id_str()
        stats = replica.routing_stats or {}
        if self._seen.get(rid) == id(stats):
            return
        self._seen[rid] = id(stats)
        if self._index.observe(rid, replica.node_id, stats, time.time()):
            self._resync(rid)

    def _resync(self, rid: str) -> None:
        with self._fetch_lock:
            if rid in self._fetching:
                return
            thread = threading.Thread(
                target=self._fetch_snapshot, args=(rid,), name="kvwarm-resync", daemon=True
            )
            self._fetching[rid] = thread
        thread.start()

    def wait_resyncs(self, timeout_s: float) -> None:
        """Wait for the snapshot fetches under way (tests)."""
        with self._fetch_lock:
            threads = list(self._fetching.values())
        for thread in threads:
            thread.join(timeout_s)

    def _fetch_snapshot(self, rid: str) -> None:
        try:
            fetch = self._fetch or self._handle_fetch()
            if self._index.load_snapshot(rid, fetch(rid)):
                log.info("replica %s: cache facts resynced from its snapshot", rid)
        except Exception as exc:  # a dead or slow replica: the next report asks again
            log.info("replica %s: snapshot not fetched: %s", rid, exc)
        finally:
            with self._fetch_lock:
                self._fetching.pop(rid, None)

    def _handle_fetch(self) -> SnapshotFetch:
        from ray import serve

        deployment = self._deployment_id
        handle = serve.get_deployment_handle(deployment.name, deployment.app_name)

        def fetch(rid: str) -> object:
            response = handle.snapshot.remote(SnapshotCall(rid))
            try:
                return response.result(timeout_s=SNAPSHOT_TIMEOUT_S)
            except Exception:
                response.cancel()  # type: ignore[no-untyped-call]
                raise

        self._fetch = fetch
        return fetch

    # ---------------------------------------------------------------- routing

    def _view(self, replica: RunningReplica) -> tuple[str, ReplicaView]:
        rid = replica.replica_id.to_full_id_str()
        stats = replica.routing_stats or {}
        reported = stats.get("warm") or []
        cached = self._warm.get(rid)
        if cached is None or cached[0] != id(reported):
            cached = (id(reported), frozenset(str(h) for h in reported))
            self._warm[rid] = cached
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        in_flight = queue_len if queue_len is not None else _number(stats.get("in_flight")) or 0
        view = ReplicaView(
            id=rid,
            in_flight=int(in_flight),
            warm=cached[1],
            ttft_ms=_number(stats.get("ttft_ms")),
            # The report and the table overlap; the larger is the better count.
            held=max(len(cached[1]), self._table.count(rid), self._index.held(rid)),
            reported=stats,
            slots=int(_number(stats.get("slots")) or 1),
        )
        return rid, view

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._ensure_state()
        if pending_request is not None and pending_request.args:
            target = pending_request.args[0]
            pinned = None
            if isinstance(target, SnapshotCall):
                pinned = target.replica_id
            elif isinstance(target, ModelOp) and target.replica is not None:  # a fan-out's call
                pinned = target.replica
            if pinned is not None:
                return [_pinned(candidate_replicas, pinned)]
            if isinstance(target, Generate) and target.avoid:
                # A retry after its replica was lost: anywhere else (Ray may not know yet).
                others = [r for r in candidate_replicas if _rid(r) not in target.avoid]
                candidate_replicas = others or candidate_replicas
        try:
            return self._rank(candidate_replicas, pending_request)
        except Exception:
            # Raised out of here, Ray logs it, ends the routing task and never routes the
            # request: it waits until its deadline. Any replica serves it, only less warm.
            log.exception("routing failed: the request goes to the least loaded replica")
            return [list(candidate_replicas)]

    def _rank(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        """The policy's groups for the request (``choose_replicas``, past pinned calls)."""
        request = route_request(pending_request)
        for replica in candidate_replicas:
            self._ingest(replica)
        routed = self._claims(request.chain)
        running = {_rid(r): r.node_id for r in candidate_replicas}
        if request.tokens and pending_request is not None:
            call = pending_request.args[0]
            assert isinstance(call, Generate)
            request = dataclasses.replace(
                request, namespace=request_namespace(call, candidate_replicas)
            )
        reach = self._index.reach(
            request.chain,
            request.parent_key,
            running,
            tokens=request.tokens,
            namespace=request.namespace,
        )
        by_id: dict[str, RunningReplica] = {}
        views: list[ReplicaView] = []
        for replica in candidate_replicas:
            rid, view = self._view(replica)
            by_id[rid] = replica
            held = routed.get(rid)
            views.append(
                dataclasses.replace(
                    view,
                    routed=frozenset(held) if held else view.routed,
                    routed_tokens=self._table.tokens_of(request.chain, held) if held else 0,
                    reach=reach.get(rid, {}),
                )
            )
        decision = self._policy.rank(request, views)
        return [[by_id[i] for i in group] for group in decision.groups]

    def _claims(self, chain: Sequence[str]) -> dict[str, set[str]]:
        """Where this router's record places ``chain``'s hashes, per replica, up to the
        longest conversation sent there of which the replica may still hold something: one
        whose slot it reported reused and whose finish row it reported gone from its tiers
        (``ClusterIndex.let_go``) is the index's to place, by what the replica still holds.
        Found by review: the record counted an earlier prompt at the ``live`` weight there for
        good, over a replica holding most of it in RAM. A slot's reuse alone does not end it:
        with one slot a replica the next conversation reuses it at once, and the finish row's
        report often comes after the slot's."""
        out: dict[str, set[str]] = {}
        now = time.time()
        for rid, held in self._table.warm_of(chain).items():
            ends = self._table.ends_in(held)
            gone = self._index.let_go(rid, ends, now) if ends else set()
            if not gone:
                out[rid] = held
                continue
            # Hashes past the last end sent came with a longer conversation that branched off
            # this chain (an edited message): nothing says it is gone, so they stay.
            at = [i for i, h in enumerate(chain) if h in ends]
            cut = max((i for i in at if chain[i] not in gone), default=-1)
            claim = {h for i, h in enumerate(chain) if h in held and (i <= cut or i > at[-1])}
            if claim:
                out[rid] = claim
        return out

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        self._ensure_state()
        request = route_request(pending_request)
        if request.chain:
            self._table.record(request.chain, replica_id.to_full_id_str(), len(request.tokens))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._ensure_state()
        live = frozenset(_rid(r) for r in replicas)
        # Ray calls this on every change of any replica's routing stats (twice a second a
        # replica); the table is scanned (65,536 routes: 3.5 ms) only when replicas went.
        if live != self._live:
            self._table.forget(live)
            self._live = live
        self._warm = {k: v for k, v in self._warm.items() if k in live}
        self._index.retain({_rid(r): r.node_id for r in replicas})
        self._seen = {k: v for k, v in self._seen.items() if k in live}
        for replica in replicas:
            self._ingest(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ensure_state()
        self._live = frozenset(r.to_full_id_str() for r in self.curr_replicas)
        self._table.forget(self._live)
        self._index.died(replica_id.to_full_id_str())
        log.info("replica %s died: its conversations move", replica_id.to_full_id_str())


def _rid(replica: RunningReplica) -> str:
    return replica.replica_id.to_full_id_str()


def _pinned(candidates: list[RunningReplica], replica_id: str) -> list[RunningReplica]:
    """Where a call for one replica goes: that replica; if Ray no longer runs it, any other,
    which refuses the call at once (``EngineReplica``: ``ReplicaUnavailableError``). Found
    by review: no replica at all made Ray retry, with backoff, until the call's deadline
    (600 s for a prewarm), holding one of its routing tasks (two per replica at most) and
    the caller (a fan-out waits for every replica) all that time."""
    return [r for r in candidates if _rid(r) == replica_id] or candidates
