"""Chunk packs in the tiers that have them (s3, redis: ``TierCapabilities.packs``): a save's
new chunks are ONE object, a restore reads each run of adjacent chunks in one ranged GET,
a later save names the same places, the sweep keeps a pack a manifest names and takes an
unreferenced old one, a pack gone or damaged is a miss (never a wrong restore) and the next
save writes its chunks again, rows whose chunks are objects of their own (an older kvwarm's)
still read and are reused. Two ``Cache`` instances on one store stand for two processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
from tests.cache.chunkkit import (
    blob,
    chunked_request,
    join,
    join_rest,
    window_cells,
    window_request,
)
from tests.cache.test_shared_publish_races import backdate_chunks
from tests.cache.tierkit import NS
from tests.rediskit import RedisServer
from tests.s3kit import MotoServer

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats import kvc
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.protocols import PacksChunks, StoredRow, Tier, TierCapabilities
from kvwarm.cache.tiers.objects import CHUNK_DIR, PACK_DIR, ObjectStore, ObjectTier, row_name
from kvwarm.cache.tiers.registry import TierOptions, build_tier
from kvwarm.cache.types import PackLoc
from kvwarm.errors import CacheKeyError, ChunkFormatError

C = 16
R1 = tuple(range(64))  # four chunks
R2 = tuple(range(48)) + (999,) * 16  # shares R1's first three chunks
R3 = tuple(range(500, 564))  # shares nothing
LATER = 7200.0  # seconds after now: past the grace period


@pytest.fixture(params=["s3", "redis"])
def packed(request: pytest.FixtureRequest) -> TierConfig:
    """A tier with packs, on a live server (moto, redis-server), empty."""
    if request.param == "s3":
        server: MotoServer = request.getfixturevalue("moto_server")
        return TierConfig("s3", 1 << 30, s3=server.config(server.new_bucket()))
    redis_server: RedisServer = request.getfixturevalue("redis_server")
    return TierConfig("shared", 1 << 30, url=redis_server.url())


def _config(tier: TierConfig, chunk_tokens: int = C) -> CacheConfig:
    return CacheConfig(tiers=(tier,), chunk_tokens=chunk_tokens)  # restores read the tier


@pytest.fixture
def store(packed: TierConfig) -> Iterator[ObjectTier]:
    """The tier as a third party sees it."""
    tier = build_tier(packed, TierOptions())
    assert isinstance(tier, ObjectTier) and isinstance(tier, PacksChunks)
    assert tier.capabilities.packs
    try:
        yield tier
    finally:
        tier.close()


def _names(store: ObjectTier, where: str) -> list[str]:
    return sorted(store.objects.names(where))


def _stored(cache: Cache, tokens: tuple[int, ...], tier: str) -> StoredRow:
    row = cache._index.stored_in(cache_key(NS, tokens), tier)
    assert row is not None
    return row


def _restores(cache: Cache, tokens: tuple[int, ...]) -> bool:
    with cache.open_row(cache_key(NS, tokens)) as row:
        return join(row.chunks) == blob(tokens)


class _Requests:
    """Counts the GETs a tier's store is asked for (whole, and ranged)."""

    def __init__(self, objects: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gets: list[str] = []
        self.ranges: list[str] = []
        for name, into in (("get", self.gets), ("get_range", self.ranges)):
            monkeypatch.setattr(objects, name, self._counted(getattr(objects, name), into))

    @staticmethod
    def _counted(real: Callable[..., Any], into: list[str]) -> Callable[..., Any]:
        def call(name: str, *args: Any) -> Any:
            into.append(name)
            return real(name, *args)

        return call

    def clear(self) -> None:
        self.gets.clear()
        self.ranges.clear()


def _objects(cache: Cache, tier: str) -> ObjectStore:
    found = cache._tiers[tier]
    assert isinstance(found, ObjectTier)
    return found.objects


def test_a_save_writes_its_chunks_as_one_pack_and_a_restore_reads_it_in_one_get(
    packed: TierConfig, store: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Cache(_config(packed), background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        counts = a.counters()
        assert (counts["packs_written"], counts["chunks_written"]) == (1, len(R1) // C)
        assert len(_names(store, PACK_DIR)) == 1
        assert _names(store, CHUNK_DIR) == []  # no chunk object of its own
        assert len(list(store.stored_keys())) == 1  # and the manifest
    with Cache(_config(packed), background=False) as b:  # another process: learns the places
        got = _Requests(_objects(b, packed.name), monkeypatch)
        assert _restores(b, R1)  # bit-identical
        assert (len(got.gets), len(got.ranges)) == (1, 1)  # the manifest, the pack's run
        [pack] = _names(store, PACK_DIR)
        assert got.ranges == [pack]


def test_a_window_rows_chunks_of_both_caches_go_in_one_pack(
    packed: TierConfig, store: ObjectTier
) -> None:
    """An iSWA row (Gemma 3): its first cache's chunks and its window's, one pack."""
    tokens = list(range(1000, 1600))
    with Cache(_config(packed, chunk_tokens=256), background=False) as a:
        key = a.save(window_request(NS, tokens, [], tier=packed.name), sync=True)
        assert key is not None
        stored = a._index.stored_in(key, packed.name)
        assert stored is not None and stored.rest is not None and len(stored.rest.keys) > 1
        assert len(_names(store, PACK_DIR)) == 1 and _names(store, CHUNK_DIR) == []
        assert len(stored.locs) == len(stored.chunk_refs)
        assert {loc.pack for loc in stored.locs if loc is not None} == {stored.locs[0].pack}  # type: ignore[union-attr]
    with Cache(_config(packed, chunk_tokens=256), background=False) as b:
        with b.open_row(key) as row:
            restored = join(row.chunks) + join_rest(row.rest_chunks, row.rest_from)
        assert restored == blob(tokens) + window_cells(tokens, len(tokens) - 100, len(tokens))


def test_a_later_save_names_the_places_of_the_chunks_it_reuses(
    packed: TierConfig, store: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Cache(_config(packed), background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        written = a.counters()["chunk_bytes_written"]
        one = _stored(a, R1, packed.name).locs[-1]
        assert one is not None
        assert a.save(chunked_request(NS, R2, tier=packed.name), sync=True)
        # Only R2's own last chunk is new: a pack of one.
        assert a.counters()["chunk_bytes_written"] - written == one.length
        assert a.counters()["chunks_reused"] == 3
        r1, r2 = _stored(a, R1, packed.name), _stored(a, R2, packed.name)
        assert r2.locs[:3] == r1.locs[:3]
        assert r2.locs[3] is not None and r2.locs[3].pack != r1.locs[0].pack  # type: ignore[union-attr]
        assert len(_names(store, PACK_DIR)) == 2
    with Cache(_config(packed), background=False) as b:
        assert store.probe(cache_key(NS, R2)) == replace(  # the manifest says the same
            _stored(b, R2, packed.name),
            info=store.probe(cache_key(NS, R2)).info,  # type: ignore[union-attr]
        )
        got = _Requests(_objects(b, packed.name), monkeypatch)
        assert _restores(b, R2)
        assert len(got.ranges) == 2  # R1's pack (three adjacent chunks), R2's own
        written = b.counters()["chunk_bytes_written"]
        assert b.save(chunked_request(NS, R1 + (5,) * 16, tier=packed.name), sync=True)
        # Another process learnt R1's places from the manifests: only the new chunk.
        assert b.counters()["chunks_reused"] == 4


def test_the_sweep_keeps_a_named_pack_and_takes_an_unreferenced_old_one(
    packed: TierConfig, store: ObjectTier
) -> None:
    with Cache(_config(packed), background=False) as w:
        assert w.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        assert w.save(chunked_request(NS, R3, tier=packed.name), sync=True)
        [r1_pack] = {loc.pack for loc in _stored(w, R1, packed.name).locs if loc is not None}
    store.delete(cache_key(NS, R3))  # R3's manifest gone: its pack is named by none
    with Cache(_config(packed), background=False) as a:
        [young] = a.gc_shared(grace_s=3600.0)  # written just now
        assert (young.packs, young.packs_deleted, young.young, young.refused) == (2, 0, 1, "")
        [swept] = a.gc_shared(grace_s=3600.0, now=time.time() + LATER)
        assert (swept.packs, swept.packs_deleted, swept.manifests) == (2, 1, 1)
        assert swept.deleted_bytes > 0 and a.counters()["shared_packs_swept"] == 1
        assert [p for p, _, _ in store.pack_ages()] == [r1_pack]
        assert _restores(a, R1)


def test_a_pack_a_manifest_published_during_the_sweep_names_stays(
    packed: TierConfig, store: ObjectTier
) -> None:
    """The sweep has marked the store's manifests when another process publishes R1 again:
    its chunks are in R1's old pack, named by no manifest until then (R1's was deleted)."""
    with Cache(_config(packed), background=False) as w:
        assert w.save(chunked_request(NS, R1, tier=packed.name), sync=True)
    store.delete(cache_key(NS, R1))
    backdate_chunks(packed, LATER, PACK_DIR)
    cfg = _config(packed)
    with Cache(cfg, background=False) as sweeper, Cache(cfg, background=False) as writer:

        def race(step: str, tier: str) -> None:
            if step == "manifests_marked":
                assert writer.save(chunked_request(NS, R1, tier=tier), sync=True)

        [swept] = sweeper.gc_shared(grace_s=3600.0, on_step=race)
        assert (swept.packs, swept.packs_deleted, swept.refused) == (1, 0, "")
        with Cache(cfg, background=False) as reader:
            assert _restores(reader, R1)


def test_a_save_reusing_an_old_pack_touches_it_before_its_manifest(
    packed: TierConfig, store: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A knows R1's places; R1's manifest is evicted elsewhere and its pack is old. A's save
    of R2 (three of R1's chunks) touches the pack (once) before its manifest: a sweep after
    the manifest's last listing finds it young."""
    from kvwarm.cache.store import chunking

    monkeypatch.setattr(chunking, "REFRESH_AFTER_S", 0.0, raising=False)  # hours later
    cfg = _config(packed)
    with Cache(cfg, background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        [r1_pack] = [p for p, _, _ in store.pack_ages()]
        store.delete(cache_key(NS, R1))
        backdate_chunks(packed, LATER, PACK_DIR)
        touched: list[bytes] = []
        tier = a._tiers[packed.name]
        assert isinstance(tier, ObjectTier)
        real = tier.touch_pack

        def touch_pack(pack: bytes) -> bool:
            touched.append(pack)
            return real(pack)

        monkeypatch.setattr(tier, "touch_pack", touch_pack)
        with Cache(cfg, background=False) as sweeper:

            def race(step: str, _tier: str) -> None:
                if step == "remarked":  # after the last listing of manifests
                    assert a.save(chunked_request(NS, R2, tier=packed.name), sync=True)

            [swept] = sweeper.gc_shared(grace_s=3600.0, on_step=race)
            assert (swept.packs_deleted, swept.refused) == (0, "")
        # R1's pack once for its three chunks (and R2's own new one: every write is "old").
        assert touched.count(r1_pack) == 1
    with Cache(cfg, background=False) as reader:
        assert _restores(reader, R2)


def test_a_lost_pack_is_a_miss_and_the_next_save_writes_its_chunks_again(
    packed: TierConfig, store: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvwarm.cache.store import chunking

    cfg = _config(packed)
    with Cache(cfg, background=False) as a, Cache(cfg, background=False) as b:
        assert a.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        assert b.rescan() == 1  # B learns R1 and its places
        [pack] = [p for p, _, _ in store.pack_ages()]
        store.delete_pack(pack)  # swept elsewhere, or evicted by redis
        with pytest.raises(CacheKeyError), a.open_row(cache_key(NS, R1)):
            pass
        assert a.rows() == [] and a.counters()["shared_rows_forgotten"] == 1
        # The next save of R1 writes its chunks again (its failed read made A look).
        assert a.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        assert a.counters()["chunks_written"] == 2 * len(R1) // C
        assert _restores(a, R1)
        # B still believes the first pack's places; its save of R2 touches it, finds it
        # gone and writes the three chunks (it holds their bytes) with its own.
        store.delete_pack(pack)
        monkeypatch.setattr(chunking, "REFRESH_AFTER_S", 0.0, raising=False)
        assert b.save(chunked_request(NS, R2, tier=packed.name), sync=True)
        assert b.counters()["chunks_written"] == len(R2) // C
    with Cache(cfg, background=False) as reader:
        assert _restores(reader, R2)


def test_a_damaged_pack_is_a_miss_never_a_wrong_restore(
    packed: TierConfig, store: ObjectTier
) -> None:
    cfg = _config(packed)
    with Cache(cfg, background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        stored = _stored(a, R1, packed.name)
        last = stored.locs[-1]
        assert last is not None
        objects = store.objects
        name = PACK_DIR + last.pack.hex() + ".kvp"
        body = bytearray(objects.get(name).data)
        body[last.end - 1] ^= 0xFF  # the last chunk's last payload byte
        objects.delete(name)
        assert objects.put_if_absent(name, bytes(body))
        report = a.verify()
        assert [why for _, why in report.bad] and stored.chunks[-1].hex() in report.bad[0][1]
    with Cache(cfg, background=False) as b:
        with pytest.raises(ChunkFormatError) as err, b.open_row(cache_key(NS, R1)):
            pass
        assert err.value.key == stored.chunks[-1] and "CRC32C" in str(err.value)
        assert b.rows() == []  # forgotten (left in the store: a shared tier)
        # Forgotten, its chunks are unknown here: the next save packs all four again, the
        # same pack (same heads), which replaces the one this process read bad.
        assert b.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        assert b.counters()["chunks_written"] == 4
        assert [p for p, _, _ in store.pack_ages()] == [last.pack]
        assert _restores(b, R1)


def test_rows_of_chunk_objects_still_read_and_are_reused(
    packed: TierConfig, store: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R1 saved by an older kvwarm (each chunk its own object); R2, saved with packs, names
    three of them as they are and packs only its own."""

    def unpacked(self: ObjectTier) -> TierCapabilities:
        return replace(self._capabilities, packs=False, pack_writes=False)

    cfg = _config(packed)
    with monkeypatch.context() as old:
        old.setattr(ObjectTier, "capabilities", property(unpacked))
        with Cache(cfg, background=False) as older:
            assert older.save(chunked_request(NS, R1, tier=packed.name), sync=True)
    assert len(_names(store, CHUNK_DIR)) == 4 and _names(store, PACK_DIR) == []
    with Cache(cfg, background=False) as a:
        assert a.save(chunked_request(NS, R2, tier=packed.name), sync=True)
        locs = _stored(a, R2, packed.name).locs
        assert locs[:3] == (None, None, None) and isinstance(locs[3], PackLoc)
    with Cache(cfg, background=False) as b:
        got = _Requests(_objects(b, packed.name), monkeypatch)
        assert _restores(b, R1) and _restores(b, R2)
        assert len(got.ranges) == 1  # R2's own chunk; the rest are whole-object GETs
        assert b.verify().bad == ()


def _packs_off(tier: TierConfig) -> TierConfig:
    """The same store with ``packs=0`` (TierCapabilities.pack_writes off)."""
    if tier.s3 is not None:
        return replace(tier, s3=replace(tier.s3, packs=False))
    assert tier.url is not None
    return replace(tier, url=tier.url + "&packs=0")


def test_with_packs_off_a_save_writes_chunk_objects_a_kvwarm_before_packs_reads(
    packed: TierConfig, store: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling upgrade: the new replicas save with packs off, the old ones keep hitting."""
    with Cache(_config(_packs_off(packed)), background=False) as new:
        assert not new._tiers[packed.name].capabilities.pack_writes
        assert new.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        assert new.counters()["packs_written"] == 0
        assert _stored(new, R1, packed.name).locs == ()
    assert _names(store, PACK_DIR) == [] and len(_names(store, CHUNK_DIR)) == 4

    def before_packs(self: ObjectTier) -> TierCapabilities:
        return replace(self._capabilities, packs=False, pack_writes=False)

    with monkeypatch.context() as old:
        old.setattr(ObjectTier, "capabilities", property(before_packs))
        with Cache(_config(packed), background=False) as older:
            assert _restores(older, R1)


def test_with_packs_off_packs_other_replicas_wrote_are_still_read_and_named(
    packed: TierConfig, store: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Cache(_config(packed), background=False) as a:  # packs on
        assert a.save(chunked_request(NS, R1, tier=packed.name), sync=True)
    [pack] = _names(store, PACK_DIR)
    with Cache(_config(_packs_off(packed)), background=False) as b:
        got = _Requests(_objects(b, packed.name), monkeypatch)
        assert _restores(b, R1)
        assert got.ranges == [pack]  # R1's chunks read from a's pack
        assert b.save(chunked_request(NS, R2, tier=packed.name), sync=True)
        locs = _stored(b, R2, packed.name).locs
        assert all(isinstance(loc, PackLoc) for loc in locs[:3]) and locs[3] is None
    assert _names(store, PACK_DIR) == [pack] and len(_names(store, CHUNK_DIR)) == 1
    with Cache(_config(packed), background=False) as c:
        assert _restores(c, R2) and c.verify().bad == ()


def test_a_promoted_copy_in_a_local_tier_is_chunk_files_without_pack_places(
    packed: TierConfig, tmp_path: Path
) -> None:
    disk = TierConfig("disk", 1 << 30, root=tmp_path / "kvc")
    with Cache(_config(packed), background=False) as w:
        assert w.save(chunked_request(NS, R1, tier=packed.name), sync=True)
    cfg = CacheConfig(tiers=(disk, packed), chunk_tokens=C, promote_tier="disk")
    with Cache(cfg, background=False) as cache:
        assert _restores(cache, R1)  # from the shared tier, then promoted
        assert cache.flush()
        assert _stored(cache, R1, "disk").locs == ()
        assert _restores(cache, R1)
    manifest = (tmp_path / "kvc" / row_name(cache_key(NS, R1))).read_bytes()
    fields = kvc.parse(manifest).meta.fields
    assert len(fields.chunks) == 4 and fields.chunk_locs == ()
    assert len(list((tmp_path / "kvc").glob("**/*.kvk"))) == 4


class _FakePacks:
    """Records the reads ``chunk_reads`` makes: each chunk object, each pack run."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, object]] = []

    def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
        self.reads.append(("own", key))
        return memoryview(key)

    def load_packed(self, pack: bytes, pieces: list[tuple[bytes, PackLoc]]) -> list[memoryview]:
        self.reads.append(("run", (pack, [loc.offset for _, loc in pieces])))
        return [memoryview(key) for key, _ in pieces]

    def touch_pack(self, pack: bytes) -> bool:
        raise NotImplementedError

    def pack_ages(self) -> Iterator[tuple[bytes, int, float]]:
        raise NotImplementedError

    def pack_age(self, pack: bytes) -> float | None:
        raise NotImplementedError

    def delete_pack(self, pack: bytes) -> None:
        raise NotImplementedError

    def store_pack(self, pack: bytes, parts: list[bytes]) -> int:
        raise NotImplementedError


def test_a_rows_reads_are_one_per_run_of_adjacent_chunks_in_a_pack() -> None:
    from kvwarm.cache.store.chunking import chunk_reads, gather_reads

    p, q = b"p" * 32, b"q" * 32
    keys = [bytes([i]) * 32 for i in range(6)]
    locs = (
        PackLoc(p, 10, 5),  # p [10, 15)
        PackLoc(p, 0, 10),  # p [0, 10): before it in the pack, adjacent
        None,  # an object of its own
        PackLoc(q, 0, 7),
        PackLoc(p, 20, 4),  # p [20, 24): a gap after 15, another run
        PackLoc(q, 7, 3),
    )
    fake = _FakePacks()
    tier = cast(Tier, fake)
    reads = chunk_reads(tier, keys, locs)
    assert gather_reads((read() for read in reads), len(keys)) == keys  # in the row's order
    assert sorted(fake.reads, key=repr) == sorted(
        [("own", keys[2]), ("run", (p, [0, 10])), ("run", (p, [20])), ("run", (q, [0, 7]))],
        key=repr,
    )
    assert len(chunk_reads(tier, keys, ())) == len(keys)  # no places: one read each


def test_a_long_run_is_cut_into_gets_of_at_most_max_run_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvwarm.cache.store import chunking

    monkeypatch.setattr(chunking, "MAX_RUN_BYTES", 25)
    p = b"p" * 32
    keys = [bytes([i]) * 32 for i in range(5)]
    locs = tuple(PackLoc(p, 10 * i, 10) for i in range(5))
    fake = _FakePacks()
    reads = chunking.chunk_reads(cast(Tier, fake), keys, locs)
    assert chunking.gather_reads((read() for read in reads), len(keys)) == keys
    assert fake.reads == [("run", (p, [0, 10])), ("run", (p, [20, 30])), ("run", (p, [40]))]


def test_a_saves_chunks_past_max_pack_bytes_go_into_further_packs(
    packed: TierConfig, store: ObjectTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pack is one PUT whose body is joined in memory: a long row of a large model in one
    pack would hold a second copy of the row and pass S3's 5 GB limit on a PUT. Packs are
    cut at chunk boundaries, and the row still restores bit for bit from another process."""
    from kvwarm.cache.store import chunking

    one = len(blob(R1)) // (len(R1) // C)  # about one chunk object's bytes
    monkeypatch.setattr(chunking, "MAX_PACK_BYTES", 2 * one + one // 2)
    with Cache(_config(packed), background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        assert a.counters()["packs_written"] == 2  # four chunks: two packs of two
        sizes = [n for _, n, _ in cast(PacksChunks, store).pack_ages()]
        assert len(sizes) == 2 and max(sizes) <= chunking.MAX_PACK_BYTES
    with Cache(_config(packed), background=False) as b:
        assert _restores(b, R1)


def test_pack_groups_cut_at_chunk_boundaries() -> None:
    from kvwarm.cache.store.chunking import _pack_groups

    chunks = [(bytes([i]) * 32, b"h" * 4, b"p" * n) for i, n in enumerate((6, 6, 20, 1, 1))]
    groups = _pack_groups(chunks, limit=12)
    assert [[c[0][0] for c in g] for g in groups] == [[0], [1], [2], [3, 4]]  # 10+10 > 12
    assert _pack_groups(chunks, limit=1 << 20) == [chunks]
    assert _pack_groups([], limit=12) == []


def test_a_save_replaces_a_manifest_whose_pack_is_gone(
    packed: TierConfig, store: ObjectTier
) -> None:
    """A manifest naming a pack that is gone is a miss for everyone: a replica cutting the
    row otherwise (another ``chunk_tokens``: none of its chunks) saves the key again, and its
    manifest replaces the broken one instead of adopting it (``_Staged.existing`` asks
    after the pack, once). While the pack is there, the row there is adopted."""
    other = _config(packed, chunk_tokens=C // 2)
    with Cache(other, background=False) as early, Cache(_config(packed), background=False) as a:
        assert a.save(chunked_request(NS, R1, tier=packed.name), sync=True)
        assert early.save(chunked_request(NS, R1, tier=packed.name), sync=True)  # in the way
        assert len(_stored(early, R1, packed.name).chunks) == len(R1) // C  # adopted
        assert _restores(early, R1)
    [pack] = [
        p
        for p, _, _ in store.pack_ages()
        if p in {loc.pack for loc in _stored(a, R1, packed.name).locs if loc is not None}
    ]
    store.delete_pack(pack)
    with Cache(other, background=False) as b:
        if b.rows():  # adopted at start: its read misses, and it is forgotten
            with pytest.raises(CacheKeyError), b.open_row(cache_key(NS, R1)):
                pass
        assert b.save(chunked_request(NS, R1, tier=packed.name), sync=True)
    with Cache(_config(packed), background=False) as reader:
        assert _restores(reader, R1)
        assert len(_stored(reader, R1, packed.name).chunks) == len(R1) // (C // 2)


def test_a_tier_without_packs_reads_no_places_from_a_manifest(tmp_path: Path) -> None:
    """A manifest copied into a directory tier with its pack places (by hand, or a bug):
    the tier reads it as a manifest over chunk files, as a kvwarm before packs would, and
    learns no place from it."""
    disk = TierConfig("disk", 1 << 30, root=tmp_path / "kvc")
    with Cache(_config(disk), background=False) as w:
        assert w.save(chunked_request(NS, R1, tier="disk"), sync=True)
    name = row_name(cache_key(NS, R1))
    manifest = tmp_path / "kvc" / name
    fields = kvc.parse(manifest.read_bytes()).meta.fields
    places = tuple(PackLoc(b"\x09" * 32, 100 * i, 100) for i in range(4))
    body = kvc.build_prefix(replace(fields, chunk_locs=places), b"")
    manifest.write_bytes(body)
    assert kvc.parse(body).meta.fields.chunk_locs == places
    with Cache(_config(disk), background=False) as cache:
        assert _stored(cache, R1, "disk").locs == ()
        assert _restores(cache, R1)
