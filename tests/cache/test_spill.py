"""A row larger than its save tier's quota goes to the next local tier whose quota holds it.

Found by a concurrency stress review: with a ram tier in front of a disk tier, a row past the
ram quota (a long context: an 8B model's 128k tokens are ~16 GiB of KV) was refused ("larger
than the tier's quota: not saved") though the disk had room, so after a restart, or on
another replica, exactly the longest prompts were prefilled from scratch. Now it is saved to
the disk tier through the same publish protocol and found there like any row; only a row no
tier can hold is refused, with the same message. A tier that is not local (s3, redis, a
directory several hosts share) is never a spill target."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
from tests.cache.chunkkit import PER_TOKEN, blob, chunked_request, join, split, tail_request
from tests.cache.facadekit import NS, req

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.types import SaveReason, SaveRequest

RAM = 300_000  # ~290 tokens of the fake codec's KV
DISK = 1_000_000


def config(root: Path, *, disk: int = DISK, shared: bool = False) -> CacheConfig:
    return CacheConfig(
        tiers=(TierConfig("ram", RAM), TierConfig("disk", disk, root, shared=shared)),
        chunk_tokens=128,
    )


def restored(cache: Cache, key: bytes) -> bytes:
    with cache.open_row(key) as row:
        return join(row.chunks) if row.chunks else bytes(row.payload)


def within_quotas(cache: Cache) -> None:
    counters = cache.counters()
    assert counters["tier_ram_bytes"] <= RAM
    assert counters["tier_disk_bytes"] <= counters["tier_disk_quota_bytes"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_row_over_the_ram_quota_is_saved_to_disk_and_restored_after_a_restart(
    tmp_path: Path, chunked: bool
) -> None:
    tokens = list(range(400))  # 400 KB of KV: past the ram quota, within the disk's
    big = chunked_request(NS, tokens) if chunked else req(tuple(tokens), 400 * PER_TOKEN)
    assert big.tier == "ram"
    with Cache(config(tmp_path), background=False) as c:
        small = c.save(req((1,) * 10, 1000), sync=True)
        key = c.save(big, sync=True)
        assert key == cache_key(NS, tokens)
        info = c.lookup_exact(key)
        assert info is not None and info.tier == "disk"
        small_info = c.lookup_exact(small) if small else None
        assert small_info is not None and small_info.tier == "ram"  # nothing evicted for it
        counters = c.counters()
        assert counters["saves_spilled"] == 1 and counters["save_failures"] == 0
        within_quotas(c)
    with Cache(config(tmp_path), background=False) as c:
        info = c.lookup_exact(key)
        assert info is not None and info.tier == "disk"
        match = c.longest_prefix(NS, [*tokens, 7])
        assert match is not None and match.row.key == key
        assert restored(c, key) == bytes(big.payload)


def test_a_conversation_that_outgrows_the_ram_tier_is_packed_again_for_the_disk(
    tmp_path: Path,
) -> None:
    """Its previous turn's chunks are in ram, so the save packs only the new tail, which the
    disk tier could not publish a row over: the row is packed again from what the disk
    lacks (here all of it), once, and restores whole."""
    tokens = [t % 251 for t in range(400)]
    starts: list[int] = []
    with Cache(config(tmp_path), background=False) as c:
        turn = c.save(tail_request(NS, tokens[:200], starts), sync=True)
        key = c.save(tail_request(NS, tokens, starts), sync=True)
        assert turn is not None and key is not None
        assert starts == [0, 200, 0]  # the turn whole; the next as a tail for ram, then whole
        turn_info, info = c.lookup_exact(turn), c.lookup_exact(key)
        assert turn_info is not None and turn_info.tier == "ram"
        assert info is not None and info.tier == "disk"
        within_quotas(c)
        assert restored(c, key) == blob(tokens)
        # The next turn: the tail packed for ram serves the disk, which holds the rest.
        longer = [*tokens, *range(50)]
        assert c.save(tail_request(NS, longer, starts), sync=True) is not None
        assert starts == [0, 200, 0, 200]
        info = c.lookup_exact(cache_key(NS, longer))
        assert info is not None and info.tier == "disk"
        within_quotas(c)
    with Cache(config(tmp_path), background=False) as c:
        assert restored(c, key) == blob(tokens)
        assert restored(c, cache_key(NS, longer)) == blob(longer)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_row_over_every_quota_is_refused_as_before(
    tmp_path: Path, chunked: bool, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = list(range(1100))  # 1.1 MB: past the ram and the disk quota
    big = chunked_request(NS, tokens) if chunked else req(tuple(tokens), 1100 * PER_TOKEN)
    with Cache(config(tmp_path), background=False) as c:
        kept = [c.save(req((i,) * 10, 100_000), sync=True) for i in range(2)]
        kept += [c.save(req((i,) * 20, 200_000, tier="disk"), sync=True) for i in range(2)]
        assert all(kept)
        with caplog.at_level(logging.WARNING, logger="kvwarm.cache"):
            assert c.save(big, sync=True) is None
        assert "ram:" in caplog.text and "larger than the tier's quota" in caplog.text
        counters = c.counters()
        assert counters["save_failures"] == 1 and counters["evictions"] == 0
        assert counters["saves_spilled"] == 0
        assert sorted(r.key for r in c.rows()) == sorted(k for k in kept if k is not None)
        within_quotas(c)


def test_no_row_spills_into_a_tier_several_hosts_share(tmp_path: Path) -> None:
    """A directory several hosts share is not local: a row reaches it only where the
    configuration saves there, never as a spill."""
    with Cache(config(tmp_path, shared=True), background=False) as c:
        assert c.save(chunked_request(NS, range(400)), sync=True) is None
        assert c.rows() == [] and c.counters()["saves_spilled"] == 0


def test_a_row_spills_only_to_later_tiers(tmp_path: Path) -> None:
    """Saving to the disk tier, a row past its quota does not go back to the ram tier
    before it, whatever room that has: the configured order is the order of spills."""
    cfg = CacheConfig(
        tiers=(TierConfig("ram", 10 * DISK), TierConfig("disk", RAM, tmp_path)), chunk_tokens=128
    )
    with Cache(cfg, background=False) as c:
        assert c.save(chunked_request(NS, range(400), tier="disk"), sync=True) is None
        assert c.rows() == []


def test_spilled_rows_keep_every_quota(tmp_path: Path) -> None:
    """Rows of all sizes saved to ram: the small ones stay there, the large ones go to disk,
    whose quota evicts the oldest of them in turn; neither tier ever passes its quota."""
    with Cache(config(tmp_path, disk=900_000), background=False) as c:
        for i in range(6):
            assert c.save(chunked_request(NS, [i] * 100), sync=True) is not None
            within_quotas(c)
            assert c.save(chunked_request(NS, [100 + i] * 350), sync=True) is not None
            within_quotas(c)
        by_tier = sorted((r.tier, r.n_tokens) for r in c.rows())
        assert ("disk", 350) in by_tier and ("ram", 100) in by_tier
        assert all(n == 350 for tier, n in by_tier if tier == "disk")
        assert c.counters()["saves_spilled"] == 6 and c.counters()["evictions"] > 0


def padded(data: bytes | bytearray | memoryview, bounds: Sequence[int]) -> list[bytes]:
    """A codec whose chunks each carry a header of their own (as llama.cpp's do), so a row
    cut in chunks is larger than the blob it was cut from."""
    return [part + bytes(4000) for part in split(data, bounds)]


def test_a_row_found_too_large_once_cut_still_spills(tmp_path: Path) -> None:
    """The save tier is picked before the payload is cut; the cut chunks' own headers take
    this row past the ram quota, so the ram tier refuses it then, and the disk tier takes
    it."""
    tokens = list(range(285))  # 293 KB as a blob: under the ram quota; 305 KB once cut
    request = SaveRequest(NS, tuple(tokens), blob(tokens), SaveReason.COLD, "ram", split=padded)
    with Cache(config(tmp_path), background=False) as c:
        key = c.save(request, sync=True)
        assert key is not None
        info = c.lookup_exact(key)
        assert info is not None and info.tier == "disk"
        assert c.counters()["saves_spilled"] == 1 and c.counters()["save_failures"] == 0
        within_quotas(c)


def test_a_save_tier_whose_filesystem_is_short_of_room_spills_to_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk tier's configured quota holds the row, but its filesystem has room for less
    (the effective quota, which only the writer asks for): the writer's check refuses it
    there and the next local tier, a directory on another filesystem, takes it."""
    real = FileTier.filesystem_free_bytes

    def free(self: FileTier) -> int:
        return 100_000 if self.name == "disk" else real(self)

    monkeypatch.setattr(FileTier, "filesystem_free_bytes", free)
    spare = (tmp_path / "spare").as_uri()
    cfg = CacheConfig(
        tiers=(
            TierConfig("disk", DISK, tmp_path / "disk"),
            TierConfig("spare", DISK, url=spare),
        ),
        chunk_tokens=128,
    )
    with Cache(cfg, background=False) as c:
        key = c.save(chunked_request(NS, range(200), tier="disk"), sync=True)
        assert key is not None
        info = c.lookup_exact(key)
        assert info is not None and info.tier == "spare"
        assert c.counters()["saves_spilled"] == 1
    with Cache(cfg, background=False) as c:
        assert restored(c, key) == blob(range(200))


def test_spills_are_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.DEBUG, logger="kvwarm.cache"),
        Cache(config(tmp_path), background=False) as c,
    ):
        for i in range(3):
            assert c.save(chunked_request(NS, [i] * 300), sync=True) is not None
    said = [r for r in caplog.records if "saved to disk instead" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO, logging.DEBUG, logging.DEBUG]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
