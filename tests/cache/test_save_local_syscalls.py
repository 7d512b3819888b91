"""The save path of a local file tier this process alone uses: no per-save look at the
directory's registry of processes (``cotenants.py``), yet a process that registers later is
still noticed, and from then on saves touch the chunks they reuse."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.cache.chunkkit import chunked_request
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.store import core
from kvwarm.cache.store.core import CacheCore
from kvwarm.cache.tiers.cotenants import Cotenants
from kvwarm.cache.tiers.files import FileTier


class _Clock:
    now = 5000.0

    def __call__(self) -> float:
        return self.now


class _Time:
    """``core``'s ``time`` module with its monotonic clock moved by hand."""

    def __init__(self, clock: _Clock) -> None:
        self.monotonic = clock


def test_saves_to_a_sole_local_tier_do_not_list_the_registry_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(core, "time", _Time(clock), raising=False)
    listings: list[int] = []
    count = Cotenants._count

    def counted(self: Cotenants, dir_fd: int) -> int:
        listings.append(dir_fd)
        return count(self, dir_fd)

    monkeypatch.setattr(Cotenants, "_count", counted)
    touched: list[bytes] = []
    touch = FileTier.touch_chunk

    def touch_counted(self: FileTier, key: bytes) -> bool:
        touched.append(key)
        return touch(self, key)

    monkeypatch.setattr(FileTier, "touch_chunk", touch_counted)
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=tmp_path / "kvc"),))
    cache = Cache(cfg, background=False)
    try:
        base = list(range(1, 601))
        for turn in range(6):  # a conversation's turns, each reusing the earlier chunks
            tokens = base + list(range(1000, 1000 + 50 * turn))
            assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
        # The merged code listed the registry once per save (six here).
        assert len(listings) <= 1
        assert touched == []
        # Another process registers in the directory: noticed once the answer is stale,
        # and then the chunks a save reuses are touched before its manifest.
        other = FileTier("disk", tmp_path / "kvc", 1 << 30)
        try:
            clock.now += CacheCore.SOLE_RECHECK_S
            assert cache.save(chunked_request(NS, [*base, 7, 8, 9], tier="disk"), sync=True)
            assert touched, "a save after another process registered touched no chunk"
        finally:
            other.close()
    finally:
        cache.close()
