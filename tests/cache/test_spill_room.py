"""A save its save tier refuses for room it cannot make now spills like a row too large for it.

Left open by the spill of rows past their save tier's quota (test_spill.py): two saves racing
for a small ram tier each fit its quota alone, but not beside what the tier cannot evict (the
room another save in flight holds, a checked-out row); the one refused ("no room for N bytes
under its quota") was saved nowhere, though the disk tier after it had room, and an evict or
shutdown save of it kept the slot's KV live only. Now it goes to the first local tier after
its save tier that takes it, through the same publish protocol, counted in saves_spilled; a
full filesystem with nothing of its tier to evict (ENOSPC) likewise. Never into a tier other
hosts share."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from tests.cache.chunkkit import blob, chunked_request, join, tail_request
from tests.cache.facadekit import NS, req

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.protocols import ReservationBook, StoredRow
from kvwarm.cache.tiers import publish
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.types import SaveRequest

RAM = 300_000  # room for one of the 200-token rows below (1 KB a token), not two
DISK = 1_000_000


def config(root: Path, *, shared: bool = False, writers: int = 2) -> CacheConfig:
    return CacheConfig(
        tiers=(TierConfig("ram", RAM), TierConfig("disk", DISK, root, shared=shared)),
        chunk_tokens=128,
        writer_threads=writers,
    )


def row(tokens: Sequence[int], chunked: bool) -> SaveRequest:
    return chunked_request(NS, tokens) if chunked else req(tuple(tokens), 1024 * len(tokens))


def restored(cache: Cache, key: bytes) -> bytes:
    with cache.open_row(key) as stored:
        return join(stored.chunks) if stored.chunks else bytes(stored.payload)


def tier_of(cache: Cache, key: bytes | None) -> str | None:
    info = cache.lookup_exact(key) if key is not None else None
    return None if info is None else info.tier


@pytest.mark.parametrize("chunked", [False, True])
def test_a_save_a_checked_out_row_leaves_no_room_for_spills_to_disk(
    tmp_path: Path, chunked: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The evict/shutdown save is a synchronous one: refused by ram for room, it was lost."""
    big = row(range(1000, 1200), chunked)
    with Cache(config(tmp_path), background=False) as c:
        first = c.save(row(range(200), chunked), sync=True)
        assert first is not None and tier_of(c, first) == "ram"
        with caplog.at_level(logging.INFO, logger="kvwarm.cache"), c.open_row(first):
            key = c.save(big, sync=True)  # fits the ram quota alone, not beside the pinned row
        assert key is not None and tier_of(c, key) == "disk"
        assert tier_of(c, first) == "ram"  # nothing evicted, nothing moved
        counters = c.counters()
        assert counters["saves_spilled"] == 1 and counters["save_failures"] == 0
        assert counters["evictions"] == 0
        assert counters["tier_ram_bytes"] <= RAM
        assert "has no room now: saved to disk instead" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with Cache(config(tmp_path), background=False) as c:
        assert tier_of(c, key) == "disk"
        assert restored(c, key) == (blob(range(1000, 1200)) if chunked else bytes(big.payload))


class ParkedRam(RamTier):
    """A ram tier whose first store parks before it publishes its row, holding its room (its
    new chunks, if any, already in the tier and pinned), until the test opens ``gate``. (A
    row published is the tier's like any other, evictable: it holds no room.)"""

    def __init__(self) -> None:
        super().__init__(RAM)
        self.gate = threading.Event()
        self.parked = threading.Event()

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        if not self.parked.is_set():
            self.parked.set()
            assert self.gate.wait(30)
        return super().store(key, request, book)


@pytest.mark.parametrize("chunked", [False, True])
def test_two_saves_racing_for_the_ram_tier_are_both_saved(tmp_path: Path, chunked: bool) -> None:
    ram = ParkedRam()
    disk = FileTier("disk", tmp_path, DISK)
    with Cache(config(tmp_path), tiers=[ram, disk], background=False) as c:
        first = c.save(row(range(200), chunked))  # parks in the ram tier, holding its room
        assert first is not None and ram.parked.wait(30)
        second = c.save(row(range(1000, 1200), chunked), sync=True)
        ram.gate.set()
        assert c.flush(30)
        assert tier_of(c, first) == "ram"
        assert second is not None and tier_of(c, second) == "disk"
        counters = c.counters()
        assert counters["saves_spilled"] == 1 and counters["save_failures"] == 0
        assert counters["tier_ram_bytes"] <= RAM


def test_a_save_refused_for_room_never_spills_into_a_shared_tier(tmp_path: Path) -> None:
    with Cache(config(tmp_path, shared=True), background=False) as c:
        first = c.save(chunked_request(NS, range(200)), sync=True)
        assert first is not None
        with c.open_row(first):
            assert c.save(chunked_request(NS, range(1000, 1200)), sync=True) is None
        assert [r.key for r in c.rows()] == [first]
        counters = c.counters()
        assert counters["saves_spilled"] == 0 and counters["save_failures"] == 1


def test_a_tail_refused_for_room_spills_only_where_its_lead_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A conversation's next turn, packed as the tail of the chunks ram holds, cannot be
    published in a disk tier that lacks them (its bytes left the context once): the
    refusal stands, and nothing of it is written there (docs/cache.md says so)."""
    tokens = [t % 251 for t in range(250)]
    starts: list[int] = []
    with Cache(config(tmp_path), background=False) as c:
        turn = c.save(tail_request(NS, tokens[:128], starts), sync=True)  # one 128 KB chunk
        other = c.save(req(tuple(range(500, 560)), 60 * 1024), sync=True)
        assert turn is not None and other is not None
        with (
            caplog.at_level(logging.INFO, logger="kvwarm.cache"),
            c.open_row(turn),
            c.open_row(other),  # 191 KB checked out: 122 KB more won't fit
        ):
            assert c.save(tail_request(NS, tokens, starts), sync=True) is None
        assert "not spilled to disk" in caplog.text and "no room for" in caplog.text
        assert starts == [0, 128]
        assert sorted(r.key for r in c.rows()) == sorted([turn, other])
        assert not list(tmp_path.glob("**/*.kv*"))
        counters = c.counters()
        assert counters["saves_spilled"] == 0 and counters["save_failures"] == 1


class FullDisk:
    """``publish._write_all`` failing with ENOSPC in ``full``'s directory only."""

    def __init__(self, full: Path) -> None:
        self.full = str(full)
        self.real = publish._write_all

    def __call__(self, fd: int, parts: Sequence[object]) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(self.full):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.real(fd, parts)  # type: ignore[arg-type]


def test_a_save_a_full_filesystem_refuses_spills_to_the_next_local_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC and nothing of the tier to evict: room the tier cannot make either."""
    cfg = CacheConfig(
        tiers=(
            TierConfig("disk", DISK, tmp_path / "disk"),
            TierConfig("spare", DISK, url=(tmp_path / "spare").as_uri()),
        ),
        chunk_tokens=128,
    )
    with Cache(cfg, background=False) as c:
        monkeypatch.setattr(publish, "_write_all", FullDisk(tmp_path / "disk"))
        key = c.save(chunked_request(NS, range(200), tier="disk"), sync=True)
        assert key is not None and tier_of(c, key) == "spare"
        counters = c.counters()
        assert counters["saves_spilled"] == 1 and counters["save_failures"] == 0
    monkeypatch.undo()
    with Cache(cfg, background=False) as c:
        assert restored(c, key) == blob(range(200))
