"""Routing: which replica a request goes to (``base.py`` for the seam, its invariants and the
registry of policies; ``prefix.py`` the built-in policy; ``tables.py`` what replicas report
and where the router sent each chain). Pure: no Ray, no clock, no I/O."""

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
from kvwarm.cluster.routing.prefix import PrefixPolicy, match_length
from kvwarm.cluster.routing.tables import AffinityTable, WarmSet

__all__ = [
    "DEFAULT_POLICY",
    "AffinityTable",
    "Decision",
    "PolicyFactory",
    "PrefixPolicy",
    "ReplicaView",
    "RouteRequest",
    "RoutingConfig",
    "RoutingPolicy",
    "WarmSet",
    "build_policy",
    "check_policy",
    "match_length",
    "register_policy",
    "registered_policies",
    "unregister_policy",
]
