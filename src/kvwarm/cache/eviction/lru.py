"""Least recently used first: the default eviction policy.

Each tier keeps its rows in use order (an ``OrderedDict``: a hit moves a row to the end), and
``victims`` merges the tiers oldest first by recorded last use. Rows adopted at startup arrive
in directory order, so the cache calls ``resort`` once after its scan; from then on every
insert and touch carries a time no older than the tier's newest, and each tier stays sorted.
Not locked: the index calls in under its lock (see ``base.py``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from kvwarm.cache.types import RowInfo, TierName

__all__ = ["LruPolicy"]


class LruPolicy:
    __slots__ = ("_tier_of", "_tiers")

    def __init__(self) -> None:
        # tier -> key -> last used (unix seconds), oldest first
        self._tiers: dict[TierName, OrderedDict[bytes, float]] = {}
        self._tier_of: dict[bytes, TierName] = {}

    def insert(self, key: bytes, info: RowInfo) -> None:
        self._tiers.setdefault(info.tier, OrderedDict())[key] = info.last_used
        self._tier_of[key] = info.tier

    def remove(self, key: bytes) -> None:
        tier = self._tier_of.pop(key, None)
        if tier is not None:
            self._tiers[tier].pop(key, None)

    def touch(self, key: bytes, info: RowInfo) -> None:
        order = self._tiers[info.tier]
        order[key] = info.last_used
        order.move_to_end(key)

    def resort(self) -> None:
        for tier, order in self._tiers.items():
            # Stable: rows with equal times keep their arrival order.
            self._tiers[tier] = OrderedDict(sorted(order.items(), key=lambda kv: kv[1]))

    def order(self, tier: TierName) -> list[bytes]:
        return list(self._tiers.get(tier, ()))

    def victims(
        self, tiers: Sequence[TierName], evictable: Callable[[bytes], bool]
    ) -> Iterator[bytes]:
        def oldest_first(order: OrderedDict[bytes, float]) -> Iterator[tuple[float, bytes]]:
            for key, last_used in order.items():
                if evictable(key):
                    yield last_used, key

        # Each tier is in order, so a lazy merge is oldest first across them all.
        orders = [self._tiers[t] for t in dict.fromkeys(tiers) if t in self._tiers]
        for _, key in heapq.merge(*(oldest_first(o) for o in orders)):
            yield key
