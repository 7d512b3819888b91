"""The eviction seam: which published rows leave first when a tier is over quota, under memory
pressure, or asked to free bytes.

Invariants every policy keeps (the index relies on them, see docs/architecture.md):

- A policy is told about every row the index publishes (``insert``), uses (``touch``) and
  forgets (``remove``), always under the index lock and never concurrently, so it needs no lock
  of its own and knows exactly the index's published set.
- ``victims`` yields keys first victim first, only keys of the tiers asked for and only keys
  the ``evictable`` predicate accepts (the index passes "not checked out"). The index consumes
  it lazily, stops once enough bytes are freed and mutates nothing while it iterates.
- A policy decides order only. Quotas, TTL classes, refcounts and the bytes themselves stay
  the index's and the facade's, so a new policy cannot break them.

Policies are registered by name (``register_policy``), like tiers; ``CacheConfig.eviction``
picks one. The built-ins are ``lru`` (the default) and ``lfu``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from kvwarm.cache.types import RowInfo, TierName
from kvwarm.plugins import Plugins

__all__ = [
    "EvictionPolicy",
    "PolicyFactory",
    "build_policy",
    "register_policy",
    "registered_policies",
    "unregister_policy",
]


class EvictionPolicy(Protocol):
    """Orders published rows for eviction. See the module invariants."""

    def insert(self, key: bytes, info: RowInfo) -> None:
        """A row was published or adopted (a key is never inserted twice without a remove)."""
        ...

    def remove(self, key: bytes) -> None:
        """A row left the index (evicted, expired, corrupt or deleted). Unknown keys are fine."""
        ...

    def touch(self, key: bytes, info: RowInfo) -> None:
        """A row was used: ``info`` carries its updated ``hits`` and ``last_used``."""
        ...

    def resort(self) -> None:
        """After a bulk adopt at startup: order by what the rows recorded, not arrival order."""
        ...

    def order(self, tier: TierName) -> list[bytes]:
        """Every key of ``tier``, first victim first, checked-out rows included."""
        ...

    def victims(
        self, tiers: Sequence[TierName], evictable: Callable[[bytes], bool]
    ) -> Iterator[bytes]:
        """Keys of ``tiers`` that ``evictable`` accepts, first victim first, each once."""
        ...


PolicyFactory = Callable[[], EvictionPolicy]

_policies: Plugins[PolicyFactory] = Plugins("eviction policy")


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make ``name`` selectable through ``CacheConfig.eviction``. Registering a name twice
    replaces the earlier factory."""
    _policies.register(name, factory)


def unregister_policy(name: str) -> None:
    _policies.unregister(name)


def registered_policies() -> tuple[str, ...]:
    return _policies.names()


def build_policy(name: str) -> EvictionPolicy:
    """A fresh policy (one per index: a policy holds that index's order)."""
    return _policies.get(name)()


def _lru() -> EvictionPolicy:
    from kvwarm.cache.eviction.lru import LruPolicy

    return LruPolicy()


def _lfu() -> EvictionPolicy:
    from kvwarm.cache.eviction.lfu import LfuPolicy

    return LfuPolicy()


register_policy("lru", _lru)
register_policy("lfu", _lfu)
