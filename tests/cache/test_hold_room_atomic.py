"""A save the ram tier refuses room evicts nothing for it (``Index.hold_room``).

Found by review: ``hold_room`` refused outright only where the tier's checked-out rows left no
room; else it evicted in policy order and only then found the room still short, and refused
the save with its victims already gone. Bytes no eviction can free but that no checked-out
row names made the difference: the chunks a save in flight pins (reusing them, or written and
not yet published). Evicting the rows naming them freed only their manifests, so a save
spilled to disk (``test_spill_room.py``) after throwing away every row ram had, for nothing.
Now the room is planned first, as the eviction would free it, and a save it cannot have
evicts nothing; one it can have evicts exactly as before."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.cache.chunkkit import blob, chunked_request, join
from tests.cache.facadekit import NS, req
from tests.cache.roomkit import DISK, tier_of, two_tiers

from kvwarm.cache import Cache, CacheConfig
from kvwarm.cache.protocols import ReservationBook, StoredRow
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.types import SaveRequest

RAM = 300_000  # two 128-token chunks (1 KB a token) and a little more


class ParkedRam(RamTier):
    """A ram tier whose first store once ``armed`` parks before it publishes anything, its
    chunks written and pinned and its room held, until the test opens ``gate``."""

    def __init__(self) -> None:
        super().__init__(RAM)
        self.armed = threading.Event()
        self.gate = threading.Event()
        self.parked = threading.Event()

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        if self.armed.is_set() and not self.parked.is_set():
            self.parked.set()
            assert self.gate.wait(30)
        return super().store(key, request, book)


def config(root: Path) -> CacheConfig:
    return two_tiers(root, RAM)


@dataclass
class InFlight:
    """A cache whose ram holds a small row and a two-chunk prompt, and the prompt's next turn
    parked in flight (reusing, so pinning, both chunks), released when the block ends; then
    the turn is in ram, no save failed, the quota held and the prompt reads whole."""

    cache: Cache
    small: bytes
    prompt: bytes
    turn: bytes


@contextmanager
def turn_in_flight(root: Path) -> Iterator[InFlight]:
    parked = ParkedRam()
    disk = FileTier("disk", root, DISK)
    with Cache(config(root), tiers=[parked, disk], background=False) as c:
        small = c.save(req(tuple(range(500, 520)), 20 * 1024), sync=True)
        prompt = c.save(chunked_request(NS, range(256)), sync=True)  # two 128 KB chunks
        assert small is not None and prompt is not None
        assert tier_of(c, small) == tier_of(c, prompt) == "ram"
        parked.armed.set()
        try:
            turn = c.save(chunked_request(NS, range(264)))
            assert turn is not None and parked.parked.wait(30)
            yield InFlight(c, small, prompt, turn)
        finally:
            parked.gate.set()
        assert c.flush(30)
        assert tier_of(c, turn) == "ram"
        counters = c.counters()
        assert counters["save_failures"] == 0 and counters["tier_ram_bytes"] <= RAM
        with c.open_row(prompt) as row:  # its chunks, pinned by the turn, stayed whole
            assert join(row.chunks) == blob(range(256))


def test_a_save_refused_room_for_chunks_a_save_in_flight_pins_evicts_nothing(
    tmp_path: Path,
) -> None:
    with turn_in_flight(tmp_path) as f:
        c = f.cache
        # 40 KB more fit the quota beside what is checked out (nothing) and held (8 KB): the
        # old first check let it evict the small row, then the prompt's manifest; the
        # prompt's chunks stayed (the turn pins them), so it was refused all the same.
        other = c.save(req(tuple(range(900, 940)), 40 * 1024), sync=True)
        assert other is not None and tier_of(c, other) == "disk"
        assert tier_of(c, f.small) == "ram" and tier_of(c, f.prompt) == "ram"
        counters = c.counters()
        assert counters["evictions"] == 0 and counters["saves_spilled"] == 1


def test_a_save_that_can_have_its_room_evicts_in_policy_order_beside_pinned_chunks(
    tmp_path: Path,
) -> None:
    """The planned eviction is the one done: the oldest row first, only what the room needs,
    and the chunks the save in flight pins are not counted as freed."""
    with turn_in_flight(tmp_path) as f:
        c = f.cache
        other = c.save(req(tuple(range(900, 910)), 10 * 1024), sync=True)
        assert other is not None and tier_of(c, other) == "ram"
        assert tier_of(c, f.small) is None and tier_of(c, f.prompt) == "ram"
        counters = c.counters()
        assert counters["evictions"] == 1 and counters["saves_spilled"] == 0
