"""Eviction policies: which rows leave first (see ``base.py`` for the seam and its invariants)."""

from kvwarm.cache.eviction.base import (
    EvictionPolicy,
    PolicyFactory,
    build_policy,
    register_policy,
    registered_policies,
    unregister_policy,
)
from kvwarm.cache.eviction.lfu import LfuPolicy
from kvwarm.cache.eviction.lru import LruPolicy

__all__ = [
    "EvictionPolicy",
    "LfuPolicy",
    "LruPolicy",
    "PolicyFactory",
    "build_policy",
    "register_policy",
    "registered_policies",
    "unregister_policy",
]
