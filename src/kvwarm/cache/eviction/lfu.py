"""Least frequently used first: fewest hits, then least recently used, then smallest key.

For a workload with a stable hot set (shared system prompts, few-shot headers) whose rows
would be pushed out of a small tier by one burst of one-off prompts under LRU. The cost is the
mirror image: a fresh row has no hits, so once a tier is full of reused rows, new rows are the
first to go. There is no aging; TTL classes still retire rows nobody uses (the index's job).

``hits`` is what the rows record (``RowInfo.hits``, persisted in file headers), so a restart
keeps the frequencies. Ordering is computed when victims are asked for: O(n) to build a heap
over the tiers' evictable rows plus O(log n) per victim taken. Not locked: the index calls in
under its lock (see ``base.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence

from kvwarm.cache.types import RowInfo, TierName

__all__ = ["LfuPolicy"]

_Rank = tuple[int, float]  # (hits, last used): smaller goes first


class LfuPolicy:
    __slots__ = ("_tier_of", "_tiers")

    def __init__(self) -> None:
        self._tiers: dict[TierName, dict[bytes, _Rank]] = {}
        self._tier_of: dict[bytes, TierName] = {}

    def insert(self, key: bytes, info: RowInfo) -> None:
        self._tiers.setdefault(info.tier, {})[key] = (info.hits, info.last_used)
        self._tier_of[key] = info.tier

    def remove(self, key: bytes) -> None:
        tier = self._tier_of.pop(key, None)
        if tier is not None:
            self._tiers[tier].pop(key, None)

    def touch(self, key: bytes, info: RowInfo) -> None:
        self._tiers[info.tier][key] = (info.hits, info.last_used)

    def resort(self) -> None:
        """Nothing to do: the order is computed from recorded hits when it is asked for."""

    def order(self, tier: TierName) -> list[bytes]:
        ranks = self._tiers.get(tier, {})
        return sorted(ranks, key=lambda k: (*ranks[k], k))

    def victims(
        self, tiers: Sequence[TierName], evictable: Callable[[bytes], bool]
    ) -> Iterator[bytes]:
        heap = [
            (hits, last_used, key)
            for tier in dict.fromkeys(tiers)
            for key, (hits, last_used) in self._tiers.get(tier, {}).items()
            if evictable(key)
        ]
        heapq.heapify(heap)
        while heap:
            yield heapq.heappop(heap)[2]
