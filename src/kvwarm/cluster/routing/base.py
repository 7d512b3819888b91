"""The routing seam: what a routing policy is told, what it answers, and the policies by name.

Invariants every policy keeps (the router relies on them, see docs/architecture.md):

- A policy is pure over its inputs: a request's facts (``RouteRequest``) and one view per live
  replica (``ReplicaView``) in, a ranking (``Decision``) out. It reads no clock and does no
  I/O, so every rule is a unit test; the router (``cluster/router.py``) gathers the inputs
  from Ray and its own ``AffinityTable``.
- Every replica it is shown appears in exactly one group of its answer (none is dropped: a
  busy or slow replica is ranked last, so a request always has somewhere to go); it answers
  ``Decision([], 0)`` only when shown no replica. Dead replicas are not shown (Ray removes
  them).
- A policy is built once per router (``build_policy``) and may keep state of its own between
  calls (an index fed by what replicas report); the router calls it from one task at a time.

Policies are registered by name (``register_policy``), like eviction policies and tiers; the
``cluster_routing`` setting picks one (``RoutingConfig.policy``). The built-ins: ``events``
(``events.py``, the default): what each replica could serve of the request, from the facts
its cache events told the router (``index.py``; ``ReplicaView.reach``), weighed against its
load; ``prefix`` (``prefix.py``): the replica holding the longest prefix of the request's
chain warm, as guessed from the text it served. A new policy is one module here plus one
``register_policy`` call at the end of this file, where every process that routes (Ray runs
the router in its own) registers it on import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol

from kvwarm.cache.types import Namespace
from kvwarm.plugins import Plugins

__all__ = [
    "DEFAULT_POLICY",
    "Decision",
    "PolicyFactory",
    "ReplicaView",
    "RouteRequest",
    "RoutingConfig",
    "RoutingPolicy",
    "build_policy",
    "check_policy",
    "register_policy",
    "registered_policies",
    "unregister_policy",
]

DEFAULT_POLICY = "events"


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How the router is configured (``deploy.routing_config`` fills it from the settings;
    it crosses to Ray's router as keyword arguments, so its fields are plain values)."""

    policy: str = DEFAULT_POLICY  # a registered policy's name
    busy_requests: int = 2  # in flight (queued + running) at or above which a replica is busy
    slow_factor: float = 3.0  # slow: ttft over slow_factor x the median of the candidates ...
    slow_floor_ms: float = 2000.0  # ... and over this many milliseconds
    # ``events``: the score is tokens served x the source's weight - load_tokens x load
    # (docs/cluster.md, "Routing"); a chain unit only this router's record places counts
    # routed_unit_tokens.
    load_tokens: float = 128.0
    weight_live: float = 1.0
    weight_memory: float = 0.95
    weight_local: float = 0.8
    weight_remote: float = 0.6
    routed_unit_tokens: int = 64


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy knows of the request it places (the ingress computed it; the router
    reads it off the typed call, ``cluster/calls.py``)."""

    chain: tuple[str, ...] = ()  # chained hashes of its prompt (``chains``); (): no prompt
    model_id: str | None = None  # the model it names (None: not a typed call)
    parent_key: bytes | None = None  # its previous turn's finish row, if the ingress knows it
    # Its prompt's token ids, as the replicas will make them (the ingress tokenized it; ()
    # when it could not), and the cache namespace they are keyed in (the model's, salted by
    # the request's cache salt: from the replicas' reports; None: not known): with both,
    # the index scores the chunks of the prompt each replica could restore.
    tokens: tuple[int, ...] = ()
    namespace: Namespace | None = None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the router knows of one live replica when it routes."""

    id: str
    in_flight: int = 0
    warm: AbstractSet[str] = field(default_factory=frozenset)  # reported by the replica
    routed: AbstractSet[str] = field(default_factory=frozenset)  # sent there by this router
    # Tokens of this request's prompt the router's own record places there: the longest
    # earlier prompt of its chain it sent there (0: none, or not tokenized).
    routed_tokens: int = 0
    ttft_ms: float | None = None  # recent time to first token, None if not reported yet
    held: int = 0  # chain hashes it holds (reported and routed): how many conversations
    # Everything the replica last reported (``EngineReplica.record_routing_stats``): a policy
    # that needs a fact of its own reads it here, with no change to the router.
    reported: Mapping[str, object] = field(default_factory=dict)
    # What it could serve of this request, per source (live, memory, local, remote), in
    # tokens: from the cluster's index of cache events (``index.ClusterIndex.reach``).
    reach: Mapping[str, int] = field(default_factory=dict)
    slots: int = 1  # conversations it runs at once (its models' slots)


@dataclass(frozen=True, slots=True)
class Decision:
    groups: list[list[str]]  # ranked: try the first group, then the next ...
    # How much of the request the first choice holds, in the policy's unit (prefix: chain
    # units; events: tokens weighed by source); 0: nothing (a new conversation).
    matched: int


class RoutingPolicy(Protocol):
    """Ranks the live replicas for one request. See the module invariants."""

    def rank(self, request: RouteRequest, views: Sequence[ReplicaView]) -> Decision:
        """Replicas for ``request``, best first, one or more to a group (Ray tries each group
        in turn and moves on when a replica refuses or does not answer)."""
        ...


PolicyFactory = Callable[[RoutingConfig], RoutingPolicy]

_policies: Plugins[PolicyFactory] = Plugins("routing policy")


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make ``name`` selectable through ``RoutingConfig.policy`` (the ``cluster_routing``
    setting). Registering a name twice replaces the earlier factory."""
    _policies.register(name, factory)


def unregister_policy(name: str) -> None:
    _policies.unregister(name)


def registered_policies() -> tuple[str, ...]:
    return _policies.names()


def check_policy(name: str) -> None:
    """``ConfigError`` naming the registered policies unless ``name`` is one of them."""
    _policies.get(name)


def build_policy(config: RoutingConfig) -> RoutingPolicy:
    """A fresh policy, ``config.policy``, configured by ``config`` (one per router)."""
    return _policies.get(config.policy)(config)


def _prefix(config: RoutingConfig) -> RoutingPolicy:
    from kvwarm.cluster.routing.prefix import PrefixPolicy

    return PrefixPolicy(config)


def _events(config: RoutingConfig) -> RoutingPolicy:
    from kvwarm.cluster.routing.events import EventsPolicy

    return EventsPolicy(config)


register_policy("events", _events)
register_policy("prefix", _prefix)
