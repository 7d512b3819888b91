"""A replica publishing a manifest while another replica's sweep deletes the chunks it
believes unreferenced (``gc_shared``): the manifest must never name a deleted chunk. Two
``Cache`` instances on one store stand for two processes (each knows only what it indexed)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.cache.chunkkit import blob, chunked_request, join
from tests.cache.tierkit import NS
from tests.rediskit import RedisServer
from tests.s3kit import MotoServer

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.protocols import ChunkAges, Tier
from kvwarm.cache.tiers.files import FileStore
from kvwarm.cache.tiers.objects import CHUNK_DIR, ObjectTier
from kvwarm.cache.tiers.redis import RedisStore
from kvwarm.cache.tiers.registry import TierOptions, build_tier
from kvwarm.cache.tiers.s3 import S3Store
from kvwarm.errors import CacheKeyError

C = 16
R1 = tuple(range(64))
R2 = tuple(range(48)) + (999,) * 16  # shares R1's first three chunks
LATER = 7200.0  # seconds after now: every chunk written so far is past the grace period


@pytest.fixture(params=["shared_dir", "s3", "redis"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> TierConfig:
    if request.param == "s3":
        server: MotoServer = request.getfixturevalue("moto_server")
        return TierConfig("s3", 1 << 30, s3=server.config(server.new_bucket()))
    if request.param == "redis":
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        return TierConfig("shared", 1 << 30, url=redis_server.url())
    return TierConfig("disk", 1 << 30, tmp_path / "nfs", shared=True)


def backdate_chunks(tier: TierConfig, seconds: float, where: str = CHUNK_DIR) -> None:
    """Every chunk (``where``: or pack) in the store last modified ``seconds`` earlier, as if
    written long ago."""
    store = build_tier(tier, TierOptions())
    try:
        assert isinstance(store, ObjectTier)
        objects = store.objects
        names = objects.names(where)
        assert names
        if isinstance(objects, FileStore):
            for name in names:
                path = objects.root / name[len(where) :]
                then = path.stat().st_mtime - seconds
                os.utime(path, (then, then))
        elif isinstance(objects, RedisStore):
            for name in names:
                meta = f"{objects._meta(name)}"
                stamp = objects.client.hget(meta, "t")
                assert stamp is not None
                objects.client.hset(meta, "t", str(float(stamp) - seconds))
        else:
            assert isinstance(objects, S3Store)
            from moto.s3.models import s3_backends

            bucket = tier.s3.bucket if tier.s3 is not None else ""
            for account in list(s3_backends.keys()):
                for partition in list(s3_backends[account].keys()):
                    found = s3_backends[account][partition].buckets.get(bucket)
                    for obj in [] if found is None else list(found.keys.values()):
                        if where in obj.name:
                            obj.last_modified -= datetime.timedelta(seconds=seconds)
    finally:
        store.close()


def _config(tier: TierConfig) -> CacheConfig:
    # No ram tier: a restore reads the shared tier itself.
    return CacheConfig(tiers=(tier,), chunk_tokens=C)


def _chunks(tier: TierConfig) -> set[bytes]:
    store: Tier = build_tier(tier, TierOptions())
    try:
        assert isinstance(store, ChunkAges)
        return {key for key, _, _ in store.chunk_ages()}
    finally:
        store.close()


def _restores(cache: Cache, tokens: tuple[int, ...]) -> bool:
    with cache.open_row(cache_key(NS, tokens)) as row:
        return join(row.chunks) == blob(tokens)


@pytest.mark.usefixtures("chunk_objects")  # chunk objects of their own; packs: test_packs.py
def test_a_chunk_another_replica_swept_is_written_again_not_named(
    remote: TierConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A indexes R1; B evicts R1 (its manifest goes, its chunks are only forgotten) and sweeps
    them, hours later. A's index still counts them stored: its save of R2, which shares
    three, must not publish a manifest naming chunks that are gone."""
    from kvwarm.cache.store import chunking

    monkeypatch.setattr(chunking, "REFRESH_AFTER_S", 0.0, raising=False)  # hours later
    cfg = _config(remote)
    with Cache(cfg, background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=remote.name), sync=True)
        with Cache(cfg, background=False) as b:  # adopts R1 on start
            assert b.evict_bytes(1 << 40, [remote.name]).rows == 1
            [swept] = b.gc_shared(grace_s=3600.0, now=time.time() + LATER)
            assert swept.deleted == len(R1) // C
        assert _chunks(remote) == set()
        assert a.save(chunked_request(NS, R2, tier=remote.name), sync=True)
        with Cache(cfg, background=False) as reader:
            assert _restores(reader, R2)


def _orphan_r1(tier: TierConfig) -> None:
    """R1's chunks in the store, old, with no manifest naming them: its manifest evicted by a
    process that then exited."""
    with Cache(_config(tier), background=False) as w:
        assert w.save(chunked_request(NS, R1, tier=tier.name), sync=True)
        assert w.evict_bytes(1 << 40, [tier.name]).rows == 1
    backdate_chunks(tier, LATER)


@pytest.mark.usefixtures("chunk_objects")  # chunk objects of their own; packs: test_packs.py
def test_a_sweep_keeps_an_old_chunk_a_save_reuses_meanwhile(remote: TierConfig) -> None:
    """The sweep listed R1's orphaned chunks as old and unreferenced and checked every
    manifest; then another replica saves R1, finds its chunks already there (kept, not
    written) and publishes the manifest. The sweep must not delete them after that."""
    _orphan_r1(remote)
    cfg = _config(remote)
    with Cache(cfg, background=False) as sweeper, Cache(cfg, background=False) as writer:

        def race(step: str, tier: str) -> None:
            if step == "remarked":  # the last listing of manifests is behind the sweep
                assert writer.save(chunked_request(NS, R1, tier=tier), sync=True)

        [swept] = sweeper.gc_shared(grace_s=3600.0, on_step=race)
        assert (swept.deleted, swept.refused) == (0, "")
        with Cache(cfg, background=False) as reader:
            assert _restores(reader, R1)


def test_a_chunk_swept_while_a_slow_save_uploads_the_next_is_written_again(
    remote: TierConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save's first chunk is older than the grace period by the time its last one is up (a
    slow upload), and a sweep elsewhere deletes it (no manifest names it yet). The save
    checks (touches) the chunks it wrote longer ago than ``REFRESH_AFTER_S`` before the
    manifest: it finds the chunk gone and writes it again."""
    from kvwarm.cache.store import chunking

    monkeypatch.setattr(chunking, "REFRESH_AFTER_S", 0.0, raising=False)  # every write is old
    with Cache(_config(remote), background=False) as a:
        tier = a._tiers[remote.name]
        real = tier.store_chunk
        written: list[bytes] = []

        def store_chunk(key: bytes, head: bytes, payload: bytes) -> int:
            n = real(key, head, payload)
            written.append(key)
            if len(written) == len(R1) // C:  # the last upload ends: a sweep took the first
                tier.delete_chunk(written[0])
            return n

        monkeypatch.setattr(tier, "store_chunk", store_chunk)
        assert a.save(chunked_request(NS, R1, tier=remote.name), sync=True)
        with Cache(_config(remote), background=False) as reader:
            assert _restores(reader, R1)


@pytest.mark.usefixtures("chunk_objects")  # chunk objects of their own; packs: test_packs.py
def test_a_save_replaces_a_manifest_naming_a_gone_chunk(remote: TierConfig) -> None:
    """A manifest whose chunk vanished (swept, evicted) is a miss for everyone. A replica
    cutting the row differently (another ``chunk_tokens``) saves the key again: its manifest
    must replace the broken one, not adopt it, or the key misses for good."""
    with Cache(_config(remote), background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=remote.name), sync=True)
        stored = a._index.stored_in(cache_key(NS, R1), remote.name)
        assert stored is not None
        a._tiers[remote.name].delete_chunk(stored.chunks[-1])
    other = CacheConfig(tiers=(remote,), chunk_tokens=C // 2)
    with Cache(other, background=False) as b:
        assert not b.rows() or not _restores_or_miss(b, R1)
        assert b.save(chunked_request(NS, R1, tier=remote.name), sync=True)
    with Cache(_config(remote), background=False) as reader:
        assert _restores(reader, R1)


def _restores_or_miss(cache: Cache, tokens: tuple[int, ...]) -> bool:
    try:
        return _restores(cache, tokens)
    except CacheKeyError:
        return False


def test_a_sweep_marks_the_manifest_in_the_store_not_a_stale_indexed_copy(
    remote: TierConfig,
) -> None:
    """The sweeper indexes R1 (cut in 16-token chunks); another replica evicts it, and a third,
    cutting 8 tokens at a time, publishes R1 again. The sweep must mark the chunks of the
    manifest now in the store, not of the copy its index still holds."""
    cfg = _config(remote)
    with Cache(cfg, background=False) as sweeper:
        assert sweeper.save(chunked_request(NS, R1, tier=remote.name), sync=True)
        with Cache(cfg, background=False) as evicter:
            assert evicter.evict_bytes(1 << 40, [remote.name]).rows == 1
        finer = CacheConfig(tiers=(remote,), chunk_tokens=C // 2)
        with Cache(finer, background=False) as writer:
            assert writer.save(chunked_request(NS, R1, tier=remote.name), sync=True)
        sweeper.gc_shared(grace_s=3600.0, now=time.time() + LATER)
    with Cache(cfg, background=False) as reader:
        assert _restores(reader, R1)


CHILD = Path(__file__).with_name("replica_child.py")


@pytest.mark.parametrize("kind", ["s3", "redis"])
def test_replicas_in_processes_publishing_the_same_rows_at_once(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Three processes save the same chunked rows (sharing chunks) at once, twice over: every
    conditional put race ends in one object adopted by the others, no save fails, and every
    row restores exactly."""
    from tests.cache.replica_child import ROWS, tier_of

    where: dict[str, object]
    if kind == "s3":
        request.getfixturevalue("moto_server")  # credentials in the environment meanwhile
        server = MotoServer(own_process=True)  # its own GIL: requests really overlap
        request.addfinalizer(server.stop)
        bucket = server.new_bucket()
        where = {"s3": {"bucket": bucket, "prefix": "rows/", "endpoint": server.endpoint}}
    else:
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        where = {"redis": redis_server.url()}
    children = [
        subprocess.Popen(
            [sys.executable, str(CHILD), json.dumps(where), "2"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        for _ in range(3)
    ]
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    reports = []
    for child in children:
        out, _ = child.communicate(timeout=300)
        assert child.returncode == 0
        reports.append(json.loads(out.splitlines()[-1]))
    assert [r["failed"] for r in reports] == [0, 0, 0]
    assert sum(r["counters"].get("save_failures", 0) for r in reports) == 0
    tier = tier_of(where)
    with Cache(CacheConfig(tiers=(tier,), chunk_tokens=C), background=False) as reader:
        for tokens in ROWS:
            assert _restores(reader, tokens)


@pytest.mark.usefixtures("chunk_objects")  # chunk objects of their own; packs: test_packs.py
def test_adopting_a_row_cut_alike_asks_after_no_chunk(
    remote: TierConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica whose publish finds its key taken by a row naming the chunks its own
    manifest names (replicas cutting alike) adopts it without a request per chunk: the save
    has just written or touched them. The merged code asked each chunk's age (a HEAD per
    chunk on s3) on every such save; a chunk only the row there names is still asked."""
    asked: list[bytes] = []
    age = ObjectTier.chunk_age

    def counted(self: ObjectTier, key: bytes) -> float | None:
        asked.append(key)
        return age(self, key)

    monkeypatch.setattr(ObjectTier, "chunk_age", counted)
    with (
        Cache(_config(remote), background=False) as a,
        Cache(_config(remote), background=False) as b,
    ):
        assert a.save(chunked_request(NS, R1, tier=remote.name), sync=True)
        assert b.save(chunked_request(NS, R1, tier=remote.name), sync=True)
        assert asked == []
        assert _restores(b, R1)
    # Cut otherwise: the row there names chunks this save's manifest does not.
    other = CacheConfig(tiers=(remote,), chunk_tokens=C // 2)
    with Cache(_config(remote), background=False) as c, Cache(other, background=False) as d:
        assert c.save(chunked_request(NS, R2, tier=remote.name), sync=True)
        assert d.save(chunked_request(NS, R2, tier=remote.name), sync=True)
        assert asked, "the chunks only the row there names were not checked"
        assert _restores(d, R2)


def test_a_sweep_marks_the_manifest_in_the_store_when_a_new_cut_has_the_same_size(
    remote: TierConfig,
) -> None:
    """As above, but the writer cuts 17 tokens at a time: R1 is again four chunks, so its new
    manifest has exactly the size of the copy the sweeper indexed (found by review: a listed
    size equal to the index copy's was taken as the same manifest, and the new chunks were
    swept, so the republished row was lost)."""
    cfg = _config(remote)
    with Cache(cfg, background=False) as sweeper:
        assert sweeper.save(chunked_request(NS, R1, tier=remote.name), sync=True)
        key = cache_key(NS, R1)
        old = sweeper._index.stored_in(key, remote.name)
        assert old is not None
        with Cache(cfg, background=False) as evicter:
            assert evicter.evict_bytes(1 << 40, [remote.name]).rows == 1
        other = CacheConfig(tiers=(remote,), chunk_tokens=C + 1)
        with Cache(other, background=False) as writer:
            assert writer.save(chunked_request(NS, R1, tier=remote.name), sync=True)
            new = writer._index.stored_in(key, remote.name)
            assert new is not None
        # The premise: another cut, the same count of chunks, the same stored size.
        assert new.chunks != old.chunks and len(new.chunks) == len(old.chunks)
        assert new.info.size == old.info.size
        sweeper.gc_shared(grace_s=3600.0, now=time.time() + LATER)
    with Cache(cfg, background=False) as reader:
        assert _restores(reader, R1)


@pytest.fixture(params=["local_dir", "shared_dir", "s3", "redis"])
def beside(request: pytest.FixtureRequest, tmp_path: Path) -> TierConfig:
    """A tier two processes use at once: one host's directory, or the ``remote`` ones."""
    if request.param == "local_dir":
        return TierConfig("disk", 1 << 30, tmp_path / "local")
    if request.param == "s3":
        server: MotoServer = request.getfixturevalue("moto_server")
        return TierConfig("s3", 1 << 30, s3=server.config(server.new_bucket()))
    if request.param == "redis":
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        return TierConfig("shared", 1 << 30, url=redis_server.url())
    return TierConfig("disk", 1 << 30, tmp_path / "nfs", shared=True)


def test_a_stale_indexed_copy_is_replaced_never_dropped_with_the_row_now_there(
    beside: TierConfig,
) -> None:
    """A indexes R1 cut in 16-token chunks; B evicts it and publishes R1 again cut 17 at a
    time, then sweeps: A's copy's chunks are gone, the manifest under the key is B's. A's
    read of its stale copy must be a miss that adopts B's row, never a failed read that
    drops the key (in a local directory: deletes B's valid manifest; found by review)."""
    cfg = _config(beside)
    key = cache_key(NS, R1)
    with Cache(cfg, background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=beside.name), sync=True)
        other = CacheConfig(tiers=(beside,), chunk_tokens=C + 1)
        with Cache(other, background=False) as b:
            assert b.lookup_exact(key) is not None
            assert b.evict_bytes(1 << 40, [beside.name]).rows == 1
            assert b.save(chunked_request(NS, R1, tier=beside.name), sync=True)
            [swept] = b.gc_shared(grace_s=3600.0, now=time.time() + LATER)
            # A's copy's chunks (or their pack): no manifest names them
            assert swept.deleted + swept.packs_deleted > 0
            with pytest.raises(CacheKeyError), a.open_row(key):  # a miss, this once
                pass
            assert key in set(_store_keys(beside))  # B's row stays
            assert _restores(b, R1)
            assert _restores(a, R1)  # A now holds B's manifest
            assert a.counters()["shared_rows_forgotten"] == 0


def test_a_repairing_verify_of_a_stale_indexed_copy_keeps_the_row_now_there(
    beside: TierConfig,
) -> None:
    """As above, A's ``verify(repair=True)`` instead of a read: the copy's chunks are gone,
    but the row under the key is B's, whole. Nothing is bad and nothing is deleted."""
    cfg = _config(beside)
    key = cache_key(NS, R1)
    with Cache(cfg, background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=beside.name), sync=True)
        other = CacheConfig(tiers=(beside,), chunk_tokens=C + 1)
        with Cache(other, background=False) as b:
            assert b.lookup_exact(key) is not None
            assert b.evict_bytes(1 << 40, [beside.name]).rows == 1
            assert b.save(chunked_request(NS, R1, tier=beside.name), sync=True)
            b.gc_shared(grace_s=3600.0, now=time.time() + LATER)
            report = a.verify(repair=True)
            assert report.bad == ()
            assert key in set(_store_keys(beside))
            assert _restores(b, R1) and _restores(a, R1)
            assert a.verify().bad == ()


def _store_keys(tier: TierConfig) -> list[bytes]:
    store = build_tier(tier, TierOptions())
    try:
        return list(store.stored_keys())
    finally:
        store.close()
