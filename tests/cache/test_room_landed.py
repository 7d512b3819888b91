"""A ram save's bytes count once against the quota: the room it holds shrinks as they land.

Found by review: the room ``Index.hold_room`` held for a save stayed whole until ``give_room``
(after ``tier.store`` returned), while the bytes it was for counted in the tier from the moment
they entered the index (``chunk_stored`` for its new chunks, ``publish`` for its row). Meanwhile
a concurrent save saw the tier fuller than it was: it evicted rows it need not (the row the save
in flight had just published among them, though that save returned its key) or was refused and
spilled. Now ``chunk_stored`` and ``publish`` take what they land out of the save's hold."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.cache.chunkkit import chunked_request
from tests.cache.facadekit import NS, req
from tests.cache.roomkit import DISK, tier_of, two_tiers

from kvwarm.cache import Cache, CacheConfig
from kvwarm.cache.index.index import Index
from kvwarm.cache.protocols import ReservationBook, StoredRow
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.types import SaveRequest

RAM = 310_000
KB = 1024


class ParkedRam(RamTier):
    """A ram tier whose first store once ``armed`` parks until the test opens ``gate``: before
    it publishes anything (its new chunks already in), or ``after`` its row is published."""

    def __init__(self, *, after: bool) -> None:
        super().__init__(RAM)
        self.after = after
        self.armed = threading.Event()
        self.gate = threading.Event()
        self.parked = threading.Event()

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        park = self.armed.is_set() and not self.parked.is_set()
        if park and not self.after:
            self._park()
        row = super().store(key, request, book)
        if park and self.after:
            self._park()
        return row

    def _park(self) -> None:
        self.parked.set()
        assert self.gate.wait(30)


def config(root: Path) -> CacheConfig:
    return two_tiers(root, RAM)


@contextmanager
def small_row_and_armed(root: Path, *, after: bool) -> Iterator[tuple[Cache, ParkedRam, bytes]]:
    """A cache whose ram holds a 20 KB row and whose next ram store parks (``ParkedRam``)."""
    parked = ParkedRam(after=after)
    disk = FileTier("disk", root, DISK)
    with Cache(config(root), tiers=[parked, disk], background=False) as c:
        small = c.save(req(tuple(range(500, 520)), 20 * KB), sync=True)
        assert small is not None
        parked.armed.set()
        yield c, parked, small


def test_a_published_row_does_not_also_count_as_room_held(tmp_path: Path) -> None:
    with small_row_and_armed(tmp_path, after=True) as (c, parked, small):
        try:
            first = c.save(req(tuple(range(1000, 1100)), 100 * KB))
            assert first is not None and parked.parked.wait(30)
            # 20 + 100 + 150 KB fit 310,000 bytes; counting the published 100 KB twice (in
            # the tier and as room held) evicted the small row, then the row just published.
            other = c.save(req(tuple(range(2000, 2150)), 150 * KB), sync=True)
            assert other is not None and tier_of(c, other) == "ram"
            assert tier_of(c, small) == "ram" and tier_of(c, first) == "ram"
            assert c.counters()["evictions"] == 0
        finally:
            parked.gate.set()
        assert c.flush(30)
        counters = c.counters()
        assert tier_of(c, first) == "ram" and counters["evictions"] == 0
        assert counters["tier_ram_bytes"] == (20 + 100 + 150) * KB <= RAM


def test_chunks_written_do_not_also_count_as_room_held(tmp_path: Path) -> None:
    with small_row_and_armed(tmp_path, after=False) as (c, parked, small):
        try:
            # Its chunks written (136 KB, in the tier and pinned), its manifest to come.
            first = c.save(chunked_request(NS, range(136)))
            assert first is not None and parked.parked.wait(30)
            # 20 + 136 + 140 KB fit (and the manifest); counting the chunks twice left 124 KB
            # to evict, of which only the small row could go: refused, the save spilled.
            other = c.save(req(tuple(range(2000, 2140)), 140 * KB), sync=True)
            assert other is not None and tier_of(c, other) == "ram"
            assert tier_of(c, small) == "ram"
            counters = c.counters()
            assert counters["evictions"] == 0 and counters["saves_spilled"] == 0
        finally:
            parked.gate.set()
        assert c.flush(30)
        counters = c.counters()
        assert tier_of(c, first) == "ram" and counters["evictions"] == 0
        assert counters["tier_ram_rows"] == 3 and counters["tier_ram_bytes"] <= RAM


def test_what_lands_leaves_the_hold_once_and_give_room_returns_the_rest() -> None:
    idx = Index()
    c, d = b"c" * 32, b"d" * 32
    assert idx.pin_chunks("ram", (c, d), 1.0) == [c, d]  # written by saves in flight
    hold, victims = idx.hold_room("ram", 1000, 2000)
    assert hold is not None and victims == []
    idx.chunk_stored("ram", c, 600, hold=hold)
    idx.chunk_stored("ram", c, 600, hold=hold)  # stored already: lands nothing
    assert hold.left == 400
    # 600 in the tier and 400 held: another 1,000 fit 2,000 exactly, not one byte more.
    assert idx.hold_room("ram", 1001, 2000) == (None, [])
    other, victims = idx.hold_room("ram", 1000, 2000)
    assert other is not None and victims == []
    idx.chunk_stored("ram", d, 1500, hold=other)  # more than held: the hold empties
    assert other.left == 0
    idx.give_room(hold)
    idx.give_room(other)
    assert hold.left == 0
    # Nothing held now: the tier's 2,100 pinned bytes alone count.
    assert idx.hold_room("ram", 1, 2100) == (None, [])
    last, victims = idx.hold_room("ram", 1, 2101)
    assert last is not None and victims == []
