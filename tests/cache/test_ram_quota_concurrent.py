"""The ram tier's quota holds under concurrent saves: room is held when a save is queued, not
checked after it is stored, so saves in flight together cannot overshoot it (issue 41)."""

from __future__ import annotations

import dataclasses
import threading

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


def test_saves_in_flight_together_never_overshoot_the_quota() -> None:
    tier = ParkedRam(publish_first=False)
    config = CacheConfig(tiers=(TierConfig("ram", QUOTA),), writer_threads=4)
    with Cache(config, tiers=[tier], background=False) as cache:
        refused = counting_refusals(cache, tier)
        keys = [cache.save(req(tuple(range(i * 50, i * 50 + 20)), 400)) for i in range(4)]
        assert all(keys)
        # Every store is either parked holding its room or refused its room.
        with tier.changed:
            assert tier.changed.wait_for(lambda: tier.parked + len(refused) == 4, timeout=30)
        tier.gate.set()
        assert cache.flush(30)
        # Two 400-byte rows fit in 1,000 bytes; the other two saves are refused their room
        # before a byte is copied in (on the old code all four were stored: 1,600).
        assert tier.peak <= QUOTA
        assert tier.parked == 2 and refused == [400, 400]
        counters = cache.counters()
        assert counters["save_failures"] == 2 and counters["evictions"] == 0
        assert counters["tier_ram_bytes"] <= QUOTA


def test_rows_published_by_saves_in_flight_make_room_by_eviction() -> None:
    """A save's published row counts as the tier's own, not also as room held (found by
    review: counted twice, the third and fourth saves here were refused their room): the
    next saves evict it, in policy order, and the quota still holds."""
    tier = ParkedRam()
    config = CacheConfig(tiers=(TierConfig("ram", QUOTA),), writer_threads=4)
    with Cache(config, tiers=[tier], background=False) as cache:
        refused = counting_refusals(cache, tier)
        keys: list[bytes] = []
        for i in range(4):  # one at a time: each parked, its row published, or refused
            key = cache.save(req(tuple(range(i * 50, i * 50 + 20)), 400))
            assert key is not None
            keys.append(key)
            with tier.changed:
                done = tier.changed.wait_for(lambda: tier.parked + len(refused) == len(keys), 30)
                assert done
        tier.gate.set()
        assert cache.flush(30)
        # Resident after each store: on the code before room was held, all four (1,600).
        assert tier.peak <= QUOTA
        assert tier.parked == 4 and refused == []
        counters = cache.counters()
        assert counters["evictions"] == 2 and counters["tier_ram_rows"] == 2
        assert [cache.lookup_exact(k) is not None for k in keys] == [False, False, True, True]
        assert counters["tier_ram_bytes"] <= QUOTA


def test_room_comes_from_evicting_rows_no_save_holds() -> None:
    tier = ParkedRam()
    tier.gate.set()
    config = CacheConfig(tiers=(TierConfig("ram", QUOTA),), writer_threads=2)
    with Cache(config, tiers=[tier], background=False) as cache:
        for i in range(6):  # each save evicts the oldest rows to make its room
            assert cache.save(req(tuple(range(i * 50, i * 50 + 20)), 400), sync=True)
            assert tier.resident() <= QUOTA
        assert cache.counters()["tier_ram_rows"] == 2
        with cache.open_row(cache.key_for(req((1,)).namespace, tuple(range(250, 270)))):
            # A checked-out row cannot be evicted: a save needing its room is dropped.
            assert cache.save(req(tuple(range(900, 920)), 700), sync=True) is None
        assert cache.save(req(tuple(range(900, 920)), 700), sync=True)


def test_a_rows_logits_count_against_the_ram_tiers_quota() -> None:
    """Found by review: a ram row's size was its payload alone, yet the tier holds its logits
    too (a finish or cold save's, ``n_vocab`` float32s: 1 MiB a row for Gemma 3's 262k
    vocabulary), so a ram tier under its quota, and the memory budget that sized it, held
    any number of them uncounted. They count now, as a manifest's did."""
    logits = b"\x00\x00\x80\x3f" * 100  # 400 bytes
    with Cache(CacheConfig(tiers=(TierConfig("ram", QUOTA),)), background=False) as c:
        for i in range(5):
            r = dataclasses.replace(req((i + 1,) * 3, 100), logits=logits)
            assert c.save(r, sync=True) is not None
        rows = c.rows()
        size = 100 + len(logits)
        assert all(row.size == size for row in rows)
        assert len(rows) * size <= QUOTA  # what the tier holds, within its quota
        assert c.counters()["tier_ram_bytes"] == len(rows) * size


def test_saves_in_flight_hold_room_for_their_logits() -> None:
    """The room a save holds counts its logits too: held for its payload alone, four saves
    in flight whose rows are 400 bytes each (100 of KV, 300 of logits) all fit in 1,000
    bytes, and 1,600 were stored."""
    tier = ParkedRam(publish_first=False)
    config = CacheConfig(tiers=(TierConfig("ram", QUOTA),), writer_threads=4)
    logits = b"\x00\x00\x80\x3f" * 75  # 300 bytes
    with Cache(config, tiers=[tier], background=False) as cache:
        refused = counting_refusals(cache, tier)
        saves = [req(tuple(range(i * 50, i * 50 + 20)), 100) for i in range(4)]
        keys = [cache.save(dataclasses.replace(r, logits=logits)) for r in saves]
        assert all(keys)
        with tier.changed:
            assert tier.changed.wait_for(lambda: tier.parked + len(refused) == 4, timeout=30)
        tier.gate.set()
        assert cache.flush(30)
        assert tier.peak <= QUOTA
        assert tier.parked == 2 and refused == [400, 400]
        assert cache.counters()["tier_ram_bytes"] <= QUOTA
