"""Chunks in tiers several processes share (a directory marked shared, s3, or one host's
directory two processes opened): no process deletes a chunk because its own rows stopped
naming it, a failed read of a remote tier only forgets the row,
and ``gc_shared`` sweeps only chunks no manifest in the store names and older than the grace
period -- never one a manifest published during the sweep names. Two ``Cache`` instances on
one store stand for two processes (each knows only the rows it indexed)."""

from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from tests.cache.chunkkit import blob, chunked_request, join
from tests.cache.tierkit import NS
from tests.s3kit import MotoServer

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.protocols import ChunkAges, Tier
from kvwarm.cache.tiers.registry import TierOptions, build_tier
from kvwarm.errors import CacheKeyError

C = 16
R1 = tuple(range(64))
R2 = tuple(range(48)) + (999,) * 16  # shares R1's first three chunks
LATER = 7200.0  # seconds after now: every chunk written by the test is past the grace period


def _tier(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> TierConfig:
    if kind == "s3":
        server: MotoServer = request.getfixturevalue("moto_server")
        return TierConfig("s3", 1 << 30, s3=server.config(server.new_bucket()))
    if kind == "local_dir":  # one host's disk directory, not marked shared: two processes
        return TierConfig("disk", 1 << 30, tmp_path / "local")
    return TierConfig("disk", 1 << 30, tmp_path / "nfs", shared=True)


@pytest.fixture(params=["shared_dir", "s3", "local_dir"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> TierConfig:
    """A tier two processes use at once."""
    return _tier(request.param, request, tmp_path)


@pytest.fixture(params=["shared_dir", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> TierConfig:
    """A tier that is not local: other hosts share it."""
    return _tier(request.param, request, tmp_path)


def _config(shared: TierConfig) -> CacheConfig:
    return CacheConfig(tiers=(TierConfig("ram", 1 << 30), shared), chunk_tokens=C)


def _store(shared: TierConfig) -> Tier:
    """The store as a third party sees it."""
    return build_tier(shared, TierOptions())


def _chunks(store: Tier) -> set[bytes]:
    assert isinstance(store, ChunkAges)
    return {key for key, _, _ in store.chunk_ages()}


def _restores(cache: Cache, tokens: tuple[int, ...]) -> bool:
    with cache.open_row(cache_key(NS, tokens)) as row:
        return join(row.chunks) == blob(tokens)


def test_evicting_a_row_leaves_chunks_another_process_row_names(shared: TierConfig) -> None:
    cfg = _config(shared)
    with Cache(cfg, background=False) as b:
        assert b.save(chunked_request(NS, R1, tier=shared.name), sync=True)
        with Cache(cfg, background=False) as a:  # adopts R1 (and its chunks) on start
            assert b.save(chunked_request(NS, R2, tier=shared.name), sync=True)
            assert a.evict_bytes(1 << 40, [shared.name]).rows == 1
            assert a.rows() == []
        assert _restores(b, R2)  # B's row names chunks A's evicted row named


@pytest.mark.usefixtures("chunk_objects")  # a chunk of its own object deleted; packs: test_packs
def test_a_failed_read_only_forgets_the_row(remote: TierConfig) -> None:
    shared = remote
    cfg = _config(shared)
    store = _store(shared)
    with Cache(cfg, background=False) as a:
        key = a.save(chunked_request(NS, R1, tier=shared.name), sync=True)
        assert key is not None
        with Cache(cfg, background=False) as b:
            before = _chunks(store)
            last = a.rows()[0]
            stored = a._index.stored_in(last.key, shared.name)
            assert stored is not None
            store.delete_chunk(stored.chunks[-1])  # gone behind B's back (a transient view)
            with pytest.raises(CacheKeyError), b.open_row(key):
                pass
            assert b.rows() == []  # forgotten by B...
            assert b.counters()["shared_rows_forgotten"] == 1
            assert key in set(store.stored_keys())  # ...not deleted from the store
            assert _chunks(store) == before - {stored.chunks[-1]}
            assert b.rescan() == 0  # and the rescans do not adopt it again
        store.close()


def _orphan_r1(shared: TierConfig) -> tuple[bytes, ...]:
    """R1's chunks in the store with no manifest naming them (its manifest deleted); R2
    published, naming three of them. Returns R1's chunk keys."""
    with Cache(_config(shared), background=False) as w:
        assert w.save(chunked_request(NS, R1, tier=shared.name), sync=True)
        assert w.save(chunked_request(NS, R2, tier=shared.name), sync=True)
        stored = w._index.stored_in(cache_key(NS, R1), shared.name)
        assert stored is not None
    store = _store(shared)
    store.delete(cache_key(NS, R1))
    store.close()
    return stored.chunks


@pytest.mark.usefixtures("chunk_objects")  # chunks of their own objects; packs: test_packs
def test_gc_shared_sweeps_only_unreferenced_old_chunks(shared: TierConfig) -> None:
    r1_chunks = _orphan_r1(shared)
    store = _store(shared)
    with Cache(_config(shared), background=False) as a:
        before = _chunks(store)
        young = a.gc_shared(grace_s=3600.0)  # everything was written just now
        assert [(r.deleted, r.young, r.refused) for r in young] == [(0, 1, "")]
        assert _chunks(store) == before
        [swept] = a.gc_shared(grace_s=3600.0, now=time.time() + LATER)
        assert (swept.deleted, swept.manifests, swept.refused) == (1, 1, "")
        assert _chunks(store) == before - {r1_chunks[-1]}  # only R1's own last chunk
        assert a.counters()["shared_chunks_swept"] == 1
        assert _restores(a, R2)
    store.close()


@pytest.mark.usefixtures("chunk_objects")  # chunks of their own objects; packs: test_packs
def test_gc_shared_keeps_chunks_of_a_manifest_published_during_the_sweep(
    shared: TierConfig,
) -> None:
    """The sweep has marked the store's manifests when another process publishes R1 again,
    reusing its old orphaned chunks (it writes only the manifest): they must stay."""
    r1_chunks = _orphan_r1(shared)
    cfg = _config(shared)
    store = _store(shared)
    with Cache(cfg, background=False) as sweeper, Cache(cfg, background=False) as writer:
        published: list[bytes | None] = []

        def race(step: str, tier: str) -> None:
            if step == "manifests_marked":
                written = writer.counters()["chunks_written"]
                published.append(writer.save(chunked_request(NS, R1, tier=tier), sync=True))
                assert writer.counters()["chunks_written"] == written  # only the manifest

        [swept] = sweeper.gc_shared(grace_s=3600.0, now=time.time() + LATER, on_step=race)
        assert published == [cache_key(NS, R1)]
        assert (swept.deleted, swept.manifests) == (0, 2)
        assert set(r1_chunks) <= _chunks(store)
        assert _restores(sweeper, R1)
    store.close()


def test_gc_shared_refuses_when_a_manifest_cannot_be_read(tmp_path: Path) -> None:
    shared = TierConfig("disk", 1 << 30, tmp_path / "nfs", shared=True)
    r1_chunks = _orphan_r1(shared)
    junk = tmp_path / "nfs" / (cache_key(NS, (7,)).hex() + ".kvc")
    junk.write_bytes(b"a newer format, perhaps")
    with Cache(_config(shared), background=False) as a:
        [swept] = a.gc_shared(grace_s=0.0, now=time.time() + LATER)
        assert swept.refused == "unreadable manifests" and swept.deleted == 0
    store = _store(shared)
    assert set(r1_chunks) <= _chunks(store)
    store.close()


def test_quota_after_an_adopt_is_enforced_off_the_lookup_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup that adopts another process's row over the quota must not delete on the
    caller's thread (the engine's tick): the eviction runs on the writer pool."""
    from tests.cache.tierkit import request

    root = tmp_path / "nfs"
    one, req_one = request(tuple(range(40)))
    two, req_two = request(tuple(range(100, 140)))
    probe_cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, tmp_path / "probe"),))
    with Cache(probe_cfg, background=False) as sizer:
        assert sizer.save(req_one, sync=True)
        size = int(sizer.counters()["tier_disk_bytes"])
    cfg = CacheConfig(tiers=(TierConfig("disk", size + size // 2, root, shared=True),))
    with Cache(cfg, background=False) as mine, Cache(cfg, background=False) as other:
        assert mine.save(req_one, sync=True) == one
        assert other.save(req_two, sync=True) == two
        deleted_on: list[str] = []
        tier = mine._tiers["disk"]
        real_delete = tier.delete

        def delete(key: bytes) -> None:
            deleted_on.append(threading.current_thread().name)
            real_delete(key)

        monkeypatch.setattr(tier, "delete", delete)
        assert mine.lookup_exact(two) is not None  # adopted: now over the quota
        assert mine.flush()
        assert deleted_on and threading.current_thread().name not in deleted_on
        assert [r.key for r in mine.rows()] == [two]  # the least recently used went


def test_a_sole_user_deletes_chunks_until_another_process_opens_the_directory(
    tmp_path: Path,
) -> None:
    local = TierConfig("disk", 1 << 30, tmp_path / "local")
    store = None
    with Cache(_config(local), background=False) as a:
        assert a.save(chunked_request(NS, R1, tier="disk"), sync=True)
        assert a.evict_bytes(1 << 40, ["disk"]).rows == 1
        observer = _store(local)  # opens (registers) only after the eviction above
        assert _chunks(observer) == set()  # alone: freed with the row
        assert a.save(chunked_request(NS, R1, tier="disk"), sync=True)
        observer.close()  # gone again, but it was here: A's refcounts no longer cover all
        assert a.evict_bytes(1 << 40, ["disk"]).rows == 1
        store = _store(local)
        left = _chunks(store)
        assert len(left) == len(R1) // C  # forgotten, not deleted
        a.sweep()  # the sweeper's pass: the local sweep runs, within the grace period
        assert _chunks(store) == left
        a.sweep_local(grace_s=0.0, force=True)
        assert _chunks(store) == set()  # no manifest names them: swept
    store.close()


def test_a_sweep_beside_another_listing_of_the_directory_misses_no_manifest(
    tmp_path: Path,
) -> None:
    """Found by review: every listing of a file tier's directory went through the one
    descriptor the tier holds (``os.scandir(fd)`` dups it: one shared offset), so a listing
    another thread had under way at the time (the sweeper's rescan, a second ``gc_shared``,
    a caller's ``rescan``) left the sweep's own listings at the end of the directory: it saw
    no manifest and deleted the chunks of another process's row. Here that other listing
    is started (and left under way) at each of the sweep's steps."""
    local = TierConfig("disk", 1 << 30, tmp_path / "local")
    cfg = _config(local)
    with Cache(cfg, background=False) as a, Cache(cfg, background=False) as b:
        assert b.save(chunked_request(NS, R1, tier=local.name), sync=True)  # A never saw it
        tier = a._tiers[local.name]
        dir_fd = tier._files._dir  # type: ignore[attr-defined]

        with ExitStack() as under_way:

            def beside(step: str, name: str) -> None:
                # Another thread's listing, one entry read so far.
                next(under_way.enter_context(os.scandir(dir_fd)), None)

            [swept] = a.gc_shared(grace_s=3600.0, now=time.time() + LATER, on_step=beside)
        assert (swept.deleted, swept.manifests) == (0, 1)
        assert _restores(b, R1)
