"""The ``events`` routing policy (the default): the replica that could serve the most of a
request from what its cache holds, weighed against its load.

The score of replica ``r`` for a request (docs/cluster.md, "Routing"):

    served(r) = max over sources s of  tokens(r, s) x weight(s)
    score(r)  = served(r) - load_tokens x in_flight(r) / slots(r)

``tokens(r, s)``: the most tokens of the request's prefix ``r`` could take from source ``s``
(``ReplicaView.reach``, from the cluster's index of cache events): ``live`` (a slot still
holds the conversation), ``memory`` (its own RAM tier), ``local`` (a file tier on its node,
its own or shared with the node's other replicas), ``remote`` (a tier every replica reads:
s3, redis, a directory all nodes mount). Weights (``RoutingConfig``; 1.0, 0.95, 0.8, 0.6 by
default) rank the sources by what a restore from them costs against a prefill; a prefix only
this router's record places on ``r`` (sent there, not yet reported) counts
``routed_unit_tokens`` a chain unit at the ``live`` weight, or, where the ingress tokenized
the prompt it extends, that prompt's tokens (``ReplicaView.routed_tokens``): the chunk keys
other replicas reported for a shared system prompt never outrank the replica a conversation
was just sent to while its report is on the way. ``load_tokens`` (128) is what one
request in flight per slot costs, in tokens of prefill.

Invariants (``base.py``'s, plus): slow replicas (time to first token over ``slow_factor`` x
the median and ``slow_floor_ms``) rank after all others, and so do busy ones (``busy_requests``
in flight) when a replica that is not busy could serve some of the request (it restores it
from a tier instead of waiting) or when they hold twice that; a busy replica that alone holds
the conversation keeps it below that (moving it would prefill it all: the score weighs that
wait). None is ever dropped. Ties go to the least loaded, then the one holding least, then
by id, so new conversations (all scores equal) spread out. Pure; every rule is a unit test
(``tests/cluster/test_routing_events.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwarm.cluster.routing.base import Decision, ReplicaView, RouteRequest, RoutingConfig
from kvwarm.cluster.routing.prefix import match_length, slow_replicas

__all__ = ["EventsPolicy"]


class EventsPolicy:
    """``RoutingPolicy`` by the tokens each replica could serve, against its load."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._weights = {
            "live": config.weight_live,
            "memory": config.weight_memory,
            "local": config.weight_local,
            "remote": config.weight_remote,
        }

    def served(self, request: RouteRequest, view: ReplicaView) -> float:
        """``served(r)`` of the module docstring."""
        best = 0.0
        for source, tokens in view.reach.items():
            best = max(best, tokens * self._weights.get(source, 0.0))
        if view.routed:
            units = match_length(request.chain, view.routed)
            best = max(best, units * self.config.routed_unit_tokens * self.config.weight_live)
        # The earlier prompt of this conversation the router sent there, in tokens: its
        # slot (or RAM) holds it before the replica's next report says so.
        return max(best, view.routed_tokens * self.config.weight_live)

    def score(self, request: RouteRequest, view: ReplicaView) -> float:
        load = view.in_flight / max(1, view.slots)
        return self.served(request, view) - self.config.load_tokens * load

    def rank(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        if not views:
            return Decision([], 0)
        slow = slow_replicas(views, self.config)
        scores = {v.id: self.score(request, v) for v in views}
        busy = self.config.busy_requests
        free = [v for v in views if v.in_flight < busy and v.id not in slow]
        warm_elsewhere = any(self.served(request, v) > 0 for v in free)
        ok = [
            v
            for v in views
            if v.id not in slow
            and (v.in_flight < busy or (not warm_elsewhere and v.in_flight < 2 * busy))
        ]
        ok_ids = {v.id for v in ok}
        ok.sort(key=lambda v: (-scores[v.id], v.in_flight, v.held, v.id))
        rest = sorted(
            (v for v in views if v.id not in ok_ids),
            key=lambda v: (v.id in slow, -scores[v.id], v.in_flight, v.id),
        )
        first = (ok or rest)[0]
        groups = [[v.id] for v in (*ok, *rest)]
        return Decision(groups, int(self.served(request, first)) if ok else 0)
