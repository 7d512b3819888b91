"""The ram tier's quota holds under concurrent saves: room is held when a save is queued, not
checked after it is stored, so saves in flight together cannot overshoot it (issue 41)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from tests.cache.facadekit import req

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.index.index import RoomHold
from kvwarm.cache.protocols import ReservationBook, StoredRow
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.types import SaveRequest

QUOTA = 1000


class ParkedRam(RamTier):
    """A ram tier whose stores park until the test opens ``gate``: once their row is
    published and resident, or, with ``publish_first`` False, before they publish anything;
    ``peak`` is the most bytes it ever held after a store."""

    def __init__(self, *, publish_first: bool = True) -> None:
        super().__init__(QUOTA)
        self.publish_first = publish_first
        self.gate = threading.Event()
        self.parked = 0
        self.peak = 0
        self.changed = threading.Condition()

    def resident(self) -> int:
        with self._lock:
            return sum(len(e.payload) + len(e.logits or b"") for e in self._rows.values())

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        if not self.publish_first:
            self._park()
        row = super().store(key, request, book)
        with self.changed:
            self.peak = max(self.peak, self.resident())
        if self.publish_first:
            self._park()
        return row

    def _park(self) -> None:
        with self.changed:
            self.parked += 1
            self.changed.notify_all()
        assert self.gate.wait(30)


def counting_refusals(cache: Cache, tier: ParkedRam) -> list[int]:
    """The sizes of the saves ``cache`` refuses room in ``tier``, as they are refused."""
    refused: list[int] = []
    hold_room = cache._index.hold_room

    def counted(name: str, n_bytes: int, quota: int) -> tuple[RoomHold | None, list[StoredRow]]:
        held, victims = hold_room(name, n_bytes, quota)
        with tier.changed:
            refused.extend([] if held else [n_bytes])
            tier.changed.notify_all()
        return held, victims

    cache._index.hold_room = counted  # type: ignore[method-assign, assignment]
    return refused


@pytest.mark.parametrize("logits", [0, 300], ids=["kv", "kv-and-logits"])
def test_saves_in_flight_together_never_overshoot_the_quota(logits: int) -> None:
    """Four saves in flight whose rows are 400 bytes each: two fit in 1,000 bytes, and the
    other two are refused their room before a byte is copied in (on the old code all four
    were stored: 1,600). The room a save holds counts its logits too (found by review: held
    for its payload alone, four rows of 100 bytes of KV and 300 of logits all fit)."""
    tier = ParkedRam(publish_first=False)
    config = CacheConfig(tiers=(TierConfig("ram", QUOTA),), writer_threads=4)
    with Cache(config, tiers=[tier], background=False) as cache:
        refused = counting_refusals(cache, tier)
        saves = [req(tuple(range(i * 50, i * 50 + 20)), 400 - logits) for i in range(4)]
        if logits:
            saves = [
                dataclasses.replace(r, logits=b"\x00\x00\x80\x3f" * (logits // 4)) for r in saves
            ]
        keys = [cache.save(r) for r in saves]
        assert all(keys)
        # Every store is either parked holding its room or refused its room.
        with tier.changed:
            assert tier.changed.wait_for(lambda: tier.parked + len(refused) == 4, timeout=30)
        tier.gate.set()
        assert cache.flush(30)
        assert tier.peak <= QUOTA
        assert tier.parked == 2 and refused == [400, 400]
        counters = cache.counters()
        assert counters["save_failures"] == 2 and counters["evictions"] == 0
        assert counters["tier_ram_bytes"] <= QUOTA
