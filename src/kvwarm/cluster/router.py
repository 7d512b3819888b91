"""``AffinityRouter``: Ray Serve's ``RequestRouter`` that places requests where a routing policy
ranks them first (``routing``; the default, ``prefix``, by the conversation's warm prefix).

Invariants: the decision is the configured routing policy's (``routing``, pure, chosen by
name: ``RoutingConfig.policy``); this class only gathers its inputs from Ray (the live
candidates, their queue lengths, the routing stats replicas report) and the router's own
``AffinityTable`` (where it sent each chain, so a follow-up that arrives before
the next stats report still finds its replica). It routes each request to the replica chosen
for *that* request (no FIFO reassignment, which would move a conversation off its replica).
Dead replicas leave the candidates through Ray (health checks, ``ActorDiedError`` on a probe)
and leave the table here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvwarm.cluster.calls import Generate, ModelOp
from kvwarm.cluster.routing import (
    AffinityTable,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    build_policy,
)

log = logging.getLogger("kvwarm.cluster.router")


def route_request(pending: PendingRequest | None) -> RouteRequest:
    """What a ``Generate`` or ``ModelOp`` carried as its first argument tells a routing
    policy (an empty request for any other call)."""
    if pending is None or not pending.args:
        return RouteRequest()
    call = pending.args[0]
    if isinstance(call, Generate | ModelOp):
        return RouteRequest(chain=call.chain, model_id=call.model_id)
    return RouteRequest()


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

    def _ensure_state(self) -> None:
        if not hasattr(self, "_table"):
            self.initialize_state()

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
            held=max(len(cached[1]), self._table.count(rid)),
            reported=stats,
        )
        return rid, view

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._ensure_state()
        request = route_request(pending_request)
        routed = self._table.warm_of(request.chain)
        by_id: dict[str, RunningReplica] = {}
        views: list[ReplicaView] = []
        for replica in candidate_replicas:
            rid, view = self._view(replica)
            by_id[rid] = replica
            held = routed.get(rid)
            views.append(view if held is None else _with_routed(view, held))
        decision = self._policy.rank(request, views)
        return [[by_id[i] for i in group] for group in decision.groups]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        self._ensure_state()
        chain = request_chain(pending_request)
        if chain:
            self._table.record(chain, replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._ensure_state()
        live = [r.replica_id.to_full_id_str() for r in replicas]
        self._table.forget(live)
        self._warm = {k: v for k, v in self._warm.items() if k in set(live)}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ensure_state()
        self._table.forget(r.to_full_id_str() for r in self.curr_replicas)
        log.info("replica %s died: its conversations move", replica_id.to_full_id_str())


def _with_routed(view: ReplicaView, routed: set[str]) -> ReplicaView:
    return dataclasses.replace(view, routed=frozenset(routed))
