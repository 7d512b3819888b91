"""The prefix-affinity routing decision, pure: candidates and their stats in, ranked groups out.

Invariants:

- A request goes first to the replica holding the longest prefix of its chain
  (``chains``) warm, unless that replica is *busy* (``busy_requests`` or more in flight) or
  *slow* (its recent time to first token is over ``slow_factor`` times the median and over
  ``slow_floor_ms``). Busy and slow replicas are never dropped, only ranked last: when every
  replica is busy the request still has somewhere to go.
- A request no replica holds warm goes to the least loaded replica (fewest in flight), then
  the one holding the fewest chain hashes: new conversations spread out.
- Dead replicas are not candidates: Ray removes them (its own health checks and probes).
- Nothing here reads a clock or does I/O, so every rule is a unit test
  (``tests/cluster/test_routing.py``).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    busy_requests: int = 2  # in flight (queued + running) at or above which a replica is busy
    slow_factor: float = 3.0  # slow: ttft over slow_factor x the median of the candidates ...
    slow_floor_ms: float = 2000.0  # ... and over this many milliseconds


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows of one live replica when it routes."""

    id: str
    in_flight: int = 0
    warm: AbstractSet[str] = field(default_factory=frozenset)  # reported by the replica
    routed: AbstractSet[str] = field(default_factory=frozenset)  # sent there by this router
    ttft_ms: float | None = None  # recent time to first token, None if not reported yet
    held: int = 0  # chain hashes it holds (reported and routed): how many conversations


@dataclass(frozen=True, slots=True)
class Decision:
    groups: list[list[str]]  # ranked: try the first group, then the next ...
    matched: int  # chain units the first choice holds warm (0: a new conversation)


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


def _slow(views: Sequence[ReplicaView], policy: RoutingPolicy) -> set[str]:
    reported = [v.ttft_ms for v in views if v.ttft_ms is not None]
    if len(reported) < 2:
        return set()  # nothing to compare with
    limit = max(policy.slow_floor_ms, policy.slow_factor * statistics.median(reported))
    return {v.id for v in views if v.ttft_ms is not None and v.ttft_ms > limit}


def rank(chain: Sequence[str], views: Sequence[ReplicaView], policy: RoutingPolicy) -> Decision:
    """Replicas for a request with ``chain``, best first, one to a group (Ray tries each group
    in turn and moves on when a replica refuses or does not answer)."""
    if not views:
        return Decision([], 0)
    slow = _slow(views, policy)
    matches = {v.id: _match(chain, v) for v in views}
    ok = [v for v in views if v.in_flight < policy.busy_requests and v.id not in slow]
    ok_ids = {v.id for v in ok}
    # Warmest first; among equals (a new conversation: all 0) the least loaded, then the one
    # holding the fewest conversations, so sequential new conversations spread out.
    ok.sort(key=lambda v: (-matches[v.id], v.in_flight, v.held, v.id))
    # Busy or slow replicas may hold the prefix too: after the others, warmest first.
    rest = sorted(
        (v for v in views if v.id not in ok_ids),
        key=lambda v: (v.id in slow, -matches[v.id], v.in_flight, v.id),
    )
    groups = [[v.id] for v in (*ok, *rest)]
    return Decision(groups, matches[ok[0].id] if ok else 0)


class WarmSet:
    """The chain hashes a replica served, most recent first, at most ``capacity`` of them
    (what it reports through routing stats)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, None] = OrderedDict()

    def add(self, chain: Iterable[str]) -> None:
        for h in chain:
            self._items[h] = None
            self._items.move_to_end(h)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def recent(self, limit: int | None = None) -> list[str]:
        out = list(reversed(self._items))
        return out if limit is None else out[:limit]

    def __len__(self) -> int:
        return len(self._items)


class AffinityTable:
    """The router's own memory of where it sent each chain hash (bounded, least recent out).

    Replicas report what they hold every stats period; a follow-up often arrives sooner, so the
    router also remembers its own decisions. Forgetting a replica drops its entries."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._counts: dict[str, int] = {}

    def _drop(self, h: str) -> None:
        owner = self._owner.pop(h)
        self._counts[owner] -= 1

    def record(self, chain: Iterable[str], replica_id: str) -> None:
        for h in chain:
            if h in self._owner:
                self._drop(h)
            self._owner[h] = replica_id
            self._counts[replica_id] = self._counts.get(replica_id, 0) + 1
        while len(self._owner) > self.capacity:
            self._drop(next(iter(self._owner)))

    def forget(self, live: Iterable[str]) -> None:
        keep = set(live)
        for h in [h for h, r in self._owner.items() if r not in keep]:
            self._drop(h)
        self._counts = {r: n for r, n in self._counts.items() if r in keep}

    def count(self, replica_id: str) -> int:
        return self._counts.get(replica_id, 0)

    def warm_of(self, chain: Sequence[str]) -> Mapping[str, set[str]]:
        """For each replica, the hashes of ``chain`` this table places there."""
        out: dict[str, set[str]] = {}
        for h in chain:
            owner = self._owner.get(h)
            if owner is not None:
                out.setdefault(owner, set()).add(h)
        return out

    def __len__(self) -> int:
        return len(self._owner)
