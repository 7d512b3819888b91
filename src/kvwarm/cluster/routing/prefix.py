"""The ``prefix`` routing policy: the replica holding the longest prefix of a request's chain.

Invariants:

- A request goes first to the replica holding the longest prefix of its chain
  (``chains``) warm, unless that replica is *busy* (``busy_requests`` or more in flight) or
  *slow* (its recent time to first token is over ``slow_factor`` times the median and over
  ``slow_floor_ms``). Busy and slow replicas are never dropped, only ranked last: when every
  replica is busy the request still has somewhere to go.
- A request no replica holds warm goes to the least loaded replica (fewest in flight), then
  the one holding the fewest chain hashes: new conversations spread out.
- What a replica holds is what it reported (``ReplicaView.warm``) and what this router sent
  there (``ReplicaView.routed``); a chain's hashes are of its text, so this is a guess from
  the prompt, not a fact of the replica's cache. Pure (``base.py``): every rule is a unit test
  (``tests/cluster/test_routing.py``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from kvwarm.cluster.routing.base import Decision, ReplicaView, RouteRequest, RoutingConfig


def match_length(chain: Sequence[str], *held: AbstractSet[str]) -> int:
    """How many leading units of ``chain`` a replica holds: the longest i with chain[i-1] in
    one of the ``held`` sets. A chained hash implies its whole prefix, so the walk goes from
    the longest down."""
    for i in range(len(chain), 0, -1):
        if any(chain[i - 1] in s for s in held):
            return i
    return 0


def _match(chain: Sequence[str], view: ReplicaView) -> int:
    return match_length(chain, view.warm, view.routed)


def slow_replicas(views: Sequence[ReplicaView], config: RoutingConfig) -> set[str]:
    """Replicas whose recent time to first token is over ``slow_factor`` x the median of
    those reported and over ``slow_floor_ms`` (none when fewer than two reported)."""
    reported = [v.ttft_ms for v in views if v.ttft_ms is not None]
    if len(reported) < 2:
        return set()  # nothing to compare with
    limit = max(config.slow_floor_ms, config.slow_factor * statistics.median(reported))
    return {v.id for v in views if v.ttft_ms is not None and v.ttft_ms > limit}


class PrefixPolicy:
    """``RoutingPolicy`` by chain prefix, load and speed; holds nothing between calls."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config

    def rank(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        """Replicas for a request with ``request.chain``, best first, one to a group (Ray
        tries each group in turn and moves on when a replica refuses or does not answer)."""
        if not views:
            return Decision([], 0)
        chain = request.chain
        slow = slow_replicas(views, self.config)
        matches = {v.id: _match(chain, v) for v in views}
        ok = [v for v in views if v.in_flight < self.config.busy_requests and v.id not in slow]
        ok_ids = {v.id for v in ok}
        # Warmest first; among equals (a new conversation: all 0) the least loaded, then the
        # one holding the fewest conversations, so sequential new conversations spread out.
        ok.sort(key=lambda v: (-matches[v.id], v.in_flight, v.held, v.id))
        # Busy or slow replicas may hold the prefix too: after the others, warmest first.
        rest = sorted(
            (v for v in views if v.id not in ok_ids),
            key=lambda v: (v.id in slow, -matches[v.id], v.in_flight, v.id),
        )
        groups = [[v.id] for v in (*ok, *rest)]
        return Decision(groups, matches[ok[0].id] if ok else 0)
