"""Promotion of a shared tier's hit into the local tier never moves a row someone is reading.

The index's invariant: a checked-out row leaves only through ``remove`` (corruption, an
explicit delete). A promotion that forgot a pinned shared row lost its pin: the reader's
check-in then released the *local* copy's pin, held by another reader, and that copy could
be evicted under it."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
from tests.cache.tierkit import request

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.errors import CacheIOError


def _cache(root: Path) -> Cache:
    tiers = (TierConfig("ram", 1 << 30), TierConfig("disk", 1 << 30, root, shared=True))
    return Cache(CacheConfig(tiers=tiers), background=False)


def test_a_row_being_read_is_not_promoted_away_from_its_reader(tmp_path: Path) -> None:
    with _cache(tmp_path / "nfs") as cache:
        key, req = request(tuple(range(64)), tier="disk")
        assert cache.save(req, sync=True) == key
        with ExitStack() as first_reader:
            first_reader.enter_context(cache.open_row(key))  # reads the shared copy
            with cache.open_row(key):  # a second hit on it queues a promotion
                pass
            assert cache.flush()
            info = cache.lookup_exact(key)
            assert info is not None and info.tier == "disk"  # still where its reader has it
            with cache.open_row(key) as third:
                first_reader.close()  # the first reader leaves while the third still reads
                assert cache.evict_bytes(1 << 40).rows == 0  # the third's row is pinned
                assert third.tokens == tuple(range(64))
        # Nobody reads it now: the next hit promotes it.
        with cache.open_row(key):
            pass
        assert cache.flush()
        info = cache.lookup_exact(key)
        assert info is not None and info.tier == "ram"
        assert cache.counters()["promotions"] == 1


def test_deleting_a_promoted_row_deletes_the_shared_copy_too(tmp_path: Path) -> None:
    """Found by review: ``delete`` of a row promoted into the ram tier removed the ram copy
    alone and answered True, and the next lookup found the row again in the shared store
    (restored as if never deleted). A delete removes the key from every tier holding it;
    the shared copy's chunks are left to the shared sweep, as always."""
    with _cache(tmp_path / "nfs") as cache:
        key, req = request(tuple(range(64)), tier="disk")
        assert cache.save(req, sync=True) == key
        with cache.open_row(key):  # a hit in the shared tier: copied to ram
            pass
        assert cache.flush()
        info = cache.lookup_exact(key)
        assert info is not None and info.tier == "ram"
        assert cache.delete(key)
        assert cache.lookup_exact(key) is None
        assert not list((tmp_path / "nfs").glob("*.kvc"))
        assert not cache.delete(key)


def test_a_shared_store_that_is_down_does_not_undo_the_delete_of_the_local_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _cache(tmp_path / "nfs") as cache:
        key, req = request(tuple(range(64)), tier="disk")
        assert cache.save(req, sync=True) == key
        with cache.open_row(key):
            pass
        assert cache.flush()
        shared = cache._core.tiers["disk"]

        def down(_key: bytes) -> None:
            raise CacheIOError("the store is down")

        monkeypatch.setattr(shared, "probe", down)
        assert cache.delete(key)  # the ram copy is gone: said so, the outage counted
        assert cache.counters()["store_errors"] == 1
        assert [r.tier for r in cache.rows()] == []
        with pytest.raises(CacheIOError):  # nothing of ours: the outage is the answer
            cache.delete(key)
