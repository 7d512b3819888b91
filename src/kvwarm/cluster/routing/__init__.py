"""Routing: which replica a request goes to (``base.py`` for the seam, its invariants and the
registry of policies; ``events.py`` the default policy, by what replicas' caches hold;
``prefix.py`` the text-prefix one; ``facts.py`` the cache facts replicas publish and
``index.py`` the router's index of them; ``tables.py`` what replicas report and where the
router sent each chain). Pure: no Ray, no clock, no I/O."""

from kvwarm.cluster.routing.base import (
    DEFAULT_POLICY,
    Decision,
    PolicyFactory,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    RoutingPolicy,
    build_policy,
    check_policy,
    register_policy,
    registered_policies,
    unregister_policy,
)
from kvwarm.cluster.routing.events import EventsPolicy
from kvwarm.cluster.routing.index import ClusterIndex, index_for
from kvwarm.cluster.routing.prefix import PrefixPolicy, match_length
from kvwarm.cluster.routing.tables import AffinityTable, WarmSet

__all__ = [
    "DEFAULT_POLICY",
    "AffinityTable",
    "ClusterIndex",
    "Decision",
    "EventsPolicy",
    "PolicyFactory",
    "PrefixPolicy",
    "ReplicaView",
    "RouteRequest",
    "RoutingConfig",
    "RoutingPolicy",
    "WarmSet",
    "build_policy",
    "check_policy",
    "index_for",
    "match_length",
    "register_policy",
    "registered_policies",
    "unregister_policy",
]
