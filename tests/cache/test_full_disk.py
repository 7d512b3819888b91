"""A full filesystem does not stay full: a save refused with ENOSPC evicts from its tier (the
policy picks) and is retried once, and a file tier's effective quota is capped by the room on
its filesystem (what it holds plus the free space), said once in the log and in the counters.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from tests.cache.chunkkit import chunked_request
from tests.cache.facadekit import req
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.tiers import publish

ROW = 10_000  # payload bytes of each test row


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvwarm-full-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def disk_cache(root: Path, quota: int = 1 << 20) -> Cache:
    return Cache(CacheConfig(tiers=(TierConfig("disk", quota, root),)), background=False)


class FullOnce:
    """``publish._write_all`` that fails with ENOSPC the first ``times`` calls."""

    def __init__(self, times: int = 1) -> None:
        self.left = times
        self.calls = 0
        self.real = publish._write_all

    def __call__(self, fd: int, parts: Sequence[object]) -> None:
        self.calls += 1
        if self.left:
            self.left -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.real(fd, parts)  # type: ignore[arg-type]


def fill(cache: Cache, n: int) -> list[bytes]:
    keys = []
    for i in range(n):
        key = cache.save(req((i,) * 8, ROW, tier="disk"), sync=True)
        assert key is not None
        keys.append(key)
    return keys


def saved_after_one_enospc(cache: Cache, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A row saved on the disk tier through one ENOSPC: refused once, then written after the
    eviction it made (each checked); its key."""
    full = FullOnce()
    monkeypatch.setattr(publish, "_write_all", full)
    key = cache.save(req((7,) * 8, ROW, tier="disk"), sync=True)
    assert key is not None and cache.lookup_exact(key) is not None
    counters = cache.counters()
    assert full.calls == 2  # refused once, then written
    assert counters["saves_retried_after_enospc"] == 1
    assert counters["save_failures"] == 0
    return key


def test_a_save_refused_for_space_evicts_and_is_retried(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with disk_cache(root) as cache:
        fill(cache, 4)
        order = cache._index.eviction_order("disk")
        key = saved_after_one_enospc(cache, monkeypatch)
        counters = cache.counters()
        # Room for one row of 10 kB plus its header: the policy's first two victims leave.
        assert counters["evictions"] == 2
        assert [cache.lookup_exact(k) is None for k in order] == [True, True, False, False]
        with cache.open_row(key) as row:
            assert len(row.payload) == ROW
        assert len(list(root.glob("*.kvc"))) == 3


def test_enospc_with_nothing_to_evict_fails_the_save_only(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with disk_cache(root) as cache:
        monkeypatch.setattr(publish, "_write_all", FullOnce())
        assert cache.save(req((7,) * 8, ROW, tier="disk"), sync=True) is None
        counters = cache.counters()
        assert counters["save_failures"] == 1
        assert counters["saves_retried_after_enospc"] == 0
        assert cache.save(req((8,) * 8, ROW, tier="disk"), sync=True) is not None


def statvfs_with_free(free: int) -> object:
    real = os.statvfs

    def fake(path: object) -> object:
        st = real(path)  # type: ignore[arg-type]
        return SimpleNamespace(f_bavail=free // 512, f_frsize=512, f_blocks=st.f_blocks)

    return fake


def test_the_quota_is_capped_by_the_room_on_the_filesystem(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with disk_cache(root, quota=1 << 20) as cache:
        fill(cache, 2)
        counters = cache.counters()
        assert counters["tier_disk_effective_quota_bytes"] == 1 << 20  # plenty of room
        assert counters["tier_disk_quota_capped_by_filesystem"] == 0
        used = int(counters["tier_disk_bytes"])
        monkeypatch.setattr(os, "statvfs", statvfs_with_free(5120))
        with caplog.at_level(logging.WARNING, logger="kvwarm.cache.store.quota"):
            counters = cache.counters()
            cache.counters()
            fill(cache, 3)  # the save's quota check uses the capped quota too
        assert counters["tier_disk_quota_bytes"] == 1 << 20
        assert counters["tier_disk_effective_quota_bytes"] == used + 5120
        assert counters["tier_disk_quota_capped_by_filesystem"] == 1
        said = [r for r in caplog.records if "effective quota" in r.getMessage()]
        assert len(said) == 1, said  # once per tier, not on every check


def test_enospc_is_retried_when_the_eviction_frees_only_orphan_chunks(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the retry waited for an evicted row, so a full disk whose tier held
    only orphan chunks (a crash's leftovers: chunks no manifest names, which an eviction
    frees first) failed the save after deleting them, the room made and unused."""
    config = CacheConfig(tiers=(TierConfig("disk", 1 << 20, root),), chunk_tokens=16)
    with Cache(config, background=False) as cache:
        key = cache.save(chunked_request(NS, list(range(48)), tier="disk"), sync=True)
        assert key is not None
    (root / f"{key.hex()}.kvc").unlink()  # its three chunks are orphans now
    with Cache(config, background=False) as cache:
        assert cache.counters()["tier_disk_chunks"] == 3 and not cache.rows()
        saved_after_one_enospc(cache, monkeypatch)
        assert len(list(root.glob("*.kvk"))) < 3
