"""The s3 tier against a live moto server: publish-once races, corrupt objects, a store that
dies mid-get or altogether. (The contract every tier passes is in test_tiers.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import pytest
from botocore.exceptions import ResponseStreamingError
from tests.cache.chunkkit import blob, chunked_request, join
from tests.cache.facadekit import FakeClock
from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import NS, request
from tests.s3kit import MotoServer, object_names

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.formats.kvc import parse
from kvwarm.cache.protocols import RowBytes, StoredRow
from kvwarm.cache.tiers.s3 import S3Tier
from kvwarm.cache.tiers.s3client import S3Client
from kvwarm.cache.types import PackLoc
from kvwarm.errors import CacheFormatError, CacheNetworkError


class FaultyClient:
    """A real client with faults injected: a hook before each put, a body cut mid-get."""

    def __init__(self, inner: S3Client) -> None:
        self.inner = inner
        self.before_put: Callable[[], None] | None = None
        self.cut_get_after: int | None = None  # bytes of a full get delivered, then a reset
        self.puts = 0
        self.gets = 0
        self.races_lost = 0

    def put_object(self, **kw: object) -> Mapping[str, object]:
        if self.before_put is not None:
            self.before_put()
        self.puts += 1
        try:
            return self.inner.put_object(**kw)
        except Exception as exc:
            if "PreconditionFailed" in str(exc):
                self.races_lost += 1
            raise

    def get_object(self, **kw: object) -> Mapping[str, object]:
        self.gets += 1
        resp = dict(self.inner.get_object(**kw))
        if self.cut_get_after is not None and "Range" not in kw:
            resp["Body"] = _CutBody(resp["Body"], self.cut_get_after)
        return resp

    def delete_object(self, **kw: object) -> Mapping[str, object]:
        return self.inner.delete_object(**kw)

    def copy_object(self, **kw: object) -> Mapping[str, object]:
        return self.inner.copy_object(**kw)

    def head_object(self, **kw: object) -> Mapping[str, object]:
        return self.inner.head_object(**kw)

    def list_objects_v2(self, **kw: object) -> Mapping[str, object]:
        return self.inner.list_objects_v2(**kw)


class _CutBody:
    def __init__(self, inner: object, n: int) -> None:
        self._inner = inner
        self._n = n

    def read(self, amt: int | None = None) -> bytes:
        self._inner.read(self._n)  # type: ignore[attr-defined]
        raise ResponseStreamingError(error="connection reset by peer")

    def close(self) -> None:
        self._inner.close()  # type: ignore[attr-defined]


def _tier(server: MotoServer, bucket: str, client: S3Client | None = None) -> S3Tier:
    return S3Tier(server.config(bucket), 1 << 30, client=client)


def test_publish_once_race_two_writers_one_publishes(moto_server: MotoServer) -> None:
    bucket = moto_server.new_bucket()
    a = FaultyClient(moto_server.client())
    b = FaultyClient(moto_server.client())
    tier_a, tier_b = _tier(moto_server, bucket, a), _tier(moto_server, bucket, b)
    both_ready = threading.Barrier(2, timeout=30)
    a.before_put = b.before_put = both_ready.wait  # both PUTs leave together
    key, req = request(tuple(range(40)))
    other_payload = b"another process's KV of the same tokens"
    _, req_b = request(tuple(range(40)), other_payload)
    book_a, book_b = FakeBook(), FakeBook()  # two processes: two indexes
    rows: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda: rows.update(a=tier_a.store(key, req, book_a))),
        threading.Thread(target=lambda: rows.update(b=tier_b.store(key, req_b, book_b))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert rows["a"] is not None and rows["b"] is not None  # both learn the row exists
    assert a.races_lost + b.races_lost == 1  # exactly one PUT created the object
    assert key in book_a.published and key in book_b.published
    assert object_names(tier_a) == [tier_a.object_name(key)]
    winner = req if b.races_lost else req_b
    for tier in (tier_a, tier_b):  # the loser adopted the winner's bytes, never overwrote them
        stored = tier.probe(key)
        assert stored is not None
        assert bytes(tier.load(stored).payload) == winner.payload


# Empty: a ranged GET of it is answered 416, which once read as a store failure.
@pytest.mark.parametrize("junk", [b"junk", b""])
def test_junk_in_the_way_is_replaced(moto_server: MotoServer, junk: bytes) -> None:
    tier = _tier(moto_server, moto_server.new_bucket())
    key, req = request((7, 7, 7))
    tier.wire.client.put_object(Bucket=tier.config.bucket, Key=tier.object_name(key), Body=junk)
    assert tier.probe(key) is None  # junk is not a row
    row = tier.store(key, req, FakeBook())
    assert row is not None
    assert bytes(tier.load(row).payload) == req.payload


def _corrupt(tier: S3Tier, key: bytes) -> None:
    name = tier.object_name(key)
    body = bytearray(
        tier.wire.client.get_object(Bucket=tier.config.bucket, Key=name)["Body"].read()
    )  # type: ignore[attr-defined]
    body[-1] ^= 0x40  # one payload bit: only the payload CRC can see it
    tier.wire.client.put_object(Bucket=tier.config.bucket, Key=name, Body=bytes(body))


def test_corrupt_object_is_refused_by_crc(moto_server: MotoServer) -> None:
    tier = _tier(moto_server, moto_server.new_bucket())
    key, req = request(tuple(range(64)))
    row = tier.store(key, req, FakeBook())
    assert row is not None
    _corrupt(tier, key)
    assert tier.probe(key) is not None  # the metadata is intact: a probe cannot tell
    with pytest.raises(CacheFormatError, match="CRC32C"):
        tier.load(row)


def _s3_cache(server: MotoServer, bucket: str, **kw: float) -> Cache:
    tiers = (
        TierConfig("ram", 1 << 20),
        TierConfig("s3", 1 << 30, s3=server.config(bucket, **kw)),
    )
    return Cache(CacheConfig(tiers=tiers), background=False)


def test_corrupt_object_row_is_forgotten_and_left_for_the_others(moto_server: MotoServer) -> None:
    """A row that fails its CRC in a shared store is only forgotten: another host (a newer
    kvwarm) may read it, and deleting would spread one process's failure to all."""
    bucket = moto_server.new_bucket()
    with _s3_cache(moto_server, bucket) as cache:
        key, req = request(tuple(range(64)), tier="s3")
        assert cache.save(req, sync=True) == key
        s3 = S3Tier(moto_server.config(bucket), 1 << 30)
        _corrupt(s3, key)
        with pytest.raises(CacheFormatError), cache.open_row(key):
            pass
        assert cache.rows() == []  # dropped from the index...
        assert cache.counters()["shared_rows_forgotten"] == 1
        assert object_names(s3) == [s3.object_name(key)]  # ...not from the store


def test_store_dying_mid_get_is_a_network_error_and_keeps_the_row(
    moto_server: MotoServer,
) -> None:
    bucket = moto_server.new_bucket()
    with _s3_cache(moto_server, bucket) as cache:
        key, req = request(tuple(range(64)), tier="s3")
        assert cache.save(req, sync=True) == key
    faulty = FaultyClient(moto_server.client())
    tier = _tier(moto_server, bucket, faulty)
    row = tier.probe(key)
    assert row is not None
    faulty.cut_get_after = 100
    with pytest.raises(CacheNetworkError):
        tier.load(row)
    assert tier.wire.is_down()  # the next calls fail fast instead of timing out again
    with pytest.raises(CacheNetworkError):
        tier.probe(key)
    with Cache(
        CacheConfig(tiers=(TierConfig("ram", 1 << 20),)), tiers=[tier], background=False
    ) as c:
        assert c.lookup_exact(key) is None  # a store that cannot answer is a miss


def test_dead_store_degrades_to_misses_and_dropped_saves(own_moto_server: MotoServer) -> None:
    server = own_moto_server
    bucket = server.new_bucket()
    cache = _s3_cache(server, bucket)
    try:
        key, req = request(tuple(range(64)), tier="s3")
        assert cache.save(req, sync=True) == key
        server.stop()  # the store dies with a row we index
        with pytest.raises(CacheNetworkError), cache.open_row(key):
            pass  # the engine answers this by prefilling cold
        assert cache.lookup_exact(key) is not None  # unreachable is not corrupt: row kept
        tokens = tuple(range(64)) + (9,) * 64
        probes = (128, 96, 64)
        other = request(tokens)[1]
        assert cache.longest_prefix(NS, tokens, probe_lengths=probes) is not None
        assert cache.save(replace(other, tier="s3"), sync=True) is None  # dropped, not raised
        counters = cache.counters()
        assert counters["save_failures"] == 1
        assert counters["store_errors"] >= 2
    finally:
        cache.close()


def test_scan_reports_junk_and_leaves_it(moto_server: MotoServer) -> None:
    """The bucket is shared: what one kvwarm cannot read may be another's (a newer KVC
    version), so no scan deletes it."""
    bucket = moto_server.new_bucket()
    tier = _tier(moto_server, bucket)
    key, req = request((1, 2, 3))
    assert tier.store(key, req, FakeBook()) is not None
    junk_key, _ = request((4, 5))
    tier.wire.client.put_object(Bucket=bucket, Key=tier.object_name(junk_key), Body=b"x" * 10)
    viewer = S3Tier(moto_server.config(bucket), 1 << 30, repair=False)
    assert [r.info.key for r in viewer.scan()] == [key]
    assert [where for where, _ in viewer.problems()] == [viewer.location(junk_key)]
    assert [r.info.key for r in tier.scan()] == [key]
    assert [where for where, _ in tier.problems()] == [tier.location(junk_key)]
    assert sorted(object_names(tier)) == sorted([tier.object_name(key), tier.object_name(junk_key)])


def test_object_is_a_kvc_file(moto_server: MotoServer) -> None:
    """The object is byte-for-byte what a file tier writes: any KVC tool reads it."""
    tier = _tier(moto_server, moto_server.new_bucket())
    key, req = request(tuple(range(10)), logits=b"\0\0\x80\x3f" * 3)
    assert tier.store(key, req, FakeBook()) is not None
    name = tier.object_name(key)
    body = tier.wire.client.get_object(Bucket=tier.config.bucket, Key=name)["Body"].read()  # type: ignore[attr-defined]
    parsed = parse(body, expected_key=key)
    assert bytes(parsed.payload) == req.payload
    assert parsed.meta.fields.logits == req.logits


def test_ttl_forgets_shared_rows_but_leaves_them_for_the_others(moto_server: MotoServer) -> None:
    """One replica's idle timer must not delete what the other replicas use."""
    clock = FakeClock(time.time())  # tiers stamp rows with the wall clock
    bucket = moto_server.new_bucket()
    tiers = (TierConfig("ram", 1 << 20), TierConfig("s3", 1 << 30, s3=moto_server.config(bucket)))
    cfg = CacheConfig(tiers=tiers, ttl_seconds=(10.0, 10.0, 10.0))
    with Cache(cfg, clock=clock, background=False) as cache:
        key, req = request(tuple(range(32)), tier="s3")
        local_key, local_req = request(tuple(range(100, 132)), tier="ram")
        assert cache.save(req, sync=True) == key
        assert cache.save(local_req, sync=True) == local_key
        clock.advance(1000)  # far past the 10 s TTL, however long the saves took
        assert cache.gc().rows == 1  # the ram row's bytes go; the s3 row is only forgotten
        assert cache.rows() == []
        s3 = S3Tier(moto_server.config(bucket), 1 << 30)
        assert object_names(s3) == [s3.object_name(key)]
        assert cache.lookup_exact(key) is not None  # and found again by the next probe


def test_cache_starts_while_its_store_is_down(own_moto_server: MotoServer) -> None:
    bucket = own_moto_server.new_bucket()
    own_moto_server.stop()
    with _s3_cache(own_moto_server, bucket) as cache:  # starting is not refused...
        assert cache.counters()["store_errors"] == 1  # ...the failed scan is counted
        tokens = tuple(range(64))
        assert cache.longest_prefix(NS, tokens, probe_lengths=(64, 32)) is None
        assert cache.save(request(tokens, tier="s3")[1], sync=True) is None


def test_probe_reads_long_metadata_in_a_second_range(moto_server: MotoServer) -> None:
    """Stored logits of a large vocabulary push the payload past the first ranged read."""
    faulty = FaultyClient(moto_server.client())
    tier = _tier(moto_server, moto_server.new_bucket(), faulty)
    logits = b"\0\0\x80\x3f" * 100_000  # 400 KB: a 100k vocabulary
    key, req = request(tuple(range(16)), logits=logits)
    assert tier.store(key, req, FakeBook()) is not None
    before = faulty.gets
    row = tier.probe(key)
    assert faulty.gets - before == 2  # the first 256 KiB, then the rest of the metadata
    assert row is not None and row.info.has_logits and row.tokens == tuple(range(16))
    assert tier.load(row).logits == logits


def test_sweeps_do_not_read_rows_the_ttl_forgot_again(moto_server: MotoServer) -> None:
    """A row our TTL forgot stays forgotten by the sweeps (each would read its metadata again,
    and the next gc forget it again); a lookup still finds it."""
    clock = FakeClock(time.time())
    bucket = moto_server.new_bucket()
    faulty = FaultyClient(moto_server.client())
    s3 = _tier(moto_server, bucket, faulty)
    cfg = CacheConfig(tiers=(TierConfig("s3", 1 << 30),), ttl_seconds=(10.0, 10.0, 10.0))
    with Cache(cfg, tiers=[s3], clock=clock, background=False) as cache:
        key, req = request(tuple(range(32)), tier="s3")
        assert cache.save(req, sync=True) == key
        clock.advance(1000)
        cache.sweep()  # forgets the row
        gets = faulty.gets
        for _ in range(3):
            cache.sweep()
            assert cache.rows() == []
        assert faulty.gets == gets  # listing only: no object read again
        assert cache.lookup_exact(key) is not None  # discovery still finds it
        assert [r.key for r in cache.rows()] == [key]


class _ManifestAfterChunks(S3Tier):
    """An s3 tier whose manifest read waits (bounded) until a chunk read has begun, and says
    whether one had."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.chunk_started = threading.Event()
        self.overlapped: list[bool] = []

    def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
        self.overlapped.append(self.chunk_started.wait(timeout=5.0))
        return super().load(row, buffer)

    def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
        self.chunk_started.set()
        return super().load_chunk(key, buffer)

    def load_packed(self, pack: bytes, pieces: list[tuple[bytes, PackLoc]]) -> list[memoryview]:
        self.chunk_started.set()
        return super().load_packed(pack, pieces)


def test_a_remote_rows_chunk_reads_start_before_its_manifest_is_read(
    moto_server: MotoServer,
) -> None:
    # Issue 38: a row read from a remote store cost two round trips, its manifest's and then
    # its chunks'; the index names the chunks, so both go at once.
    s3 = moto_server.config(moto_server.new_bucket())
    tier = _ManifestAfterChunks(s3, 1 << 30)
    cfg = CacheConfig(tiers=(TierConfig("s3", 1 << 30, s3=s3),), chunk_tokens=256)
    tokens = tuple(range(1000, 1600))
    with Cache(cfg, tiers=[tier], background=False) as cache:
        key = cache.save(chunked_request(NS, tokens, tier="s3"), sync=True)
        assert key is not None
        with cache.open_row(key, from_token=0) as row:
            assert len(row.chunks) == 3
            assert join(row.chunks) == blob(tokens)
    assert tier.overlapped == [True]


class _ConflictFirst(FaultyClient):
    """Each name's first conditional PUT answers 409 ConditionalRequestConflict."""

    def __init__(self, inner: S3Client) -> None:
        super().__init__(inner)
        self.conflicted: set[str] = set()

    def put_object(self, **kw: object) -> Mapping[str, object]:
        from botocore.exceptions import ClientError

        name = str(kw["Key"])
        if name not in self.conflicted:
            self.conflicted.add(name)
            error = {"Code": "ConditionalRequestConflict", "Message": "a put is in flight"}
            meta = {"HTTPStatusCode": 409}
            raise ClientError({"Error": error, "ResponseMetadata": meta}, "PutObject")
        return super().put_object(**kw)


def test_a_conflicting_conditional_put_is_a_lost_race_not_a_failed_save(
    moto_server: MotoServer,
) -> None:
    """S3 answers 409 ConditionalRequestConflict to a conditional PUT while another of the
    same name is in flight: the tier looks at what is there, as after a 412, and the save
    (its chunks and its manifest) still publishes."""
    s3 = moto_server.config(moto_server.new_bucket())
    client = _ConflictFirst(moto_server.client())
    tier = S3Tier(s3, 1 << 30, client=client)
    cfg = CacheConfig(tiers=(TierConfig("s3", 1 << 30, s3=s3),), chunk_tokens=16)
    tokens = tuple(range(64))
    with Cache(cfg, tiers=[tier], background=False) as cache:
        key = cache.save(chunked_request(NS, tokens, tier="s3"), sync=True)
        assert key is not None and len(client.conflicted) == 2  # the pack of 4 chunks, the manifest
        with cache.open_row(key) as row:
            assert join(row.chunks) == blob(tokens)


class _NoSelfCopy(FaultyClient):
    """An S3-compatible store (or a bucket policy) that refuses a copy onto itself."""

    def copy_object(self, **kw: object) -> Mapping[str, object]:
        from botocore.exceptions import ClientError

        error = {"Code": "InvalidRequest", "Message": "copy onto itself"}
        meta = {"HTTPStatusCode": 400}
        raise ClientError({"Error": error, "ResponseMetadata": meta}, "CopyObject")


@pytest.mark.usefixtures("chunk_objects")  # a chunk object of its own is touched (packs too)
def test_a_store_refusing_a_copy_onto_itself_still_takes_saves_reusing_chunks(
    moto_server: MotoServer,
) -> None:
    """Touching a reused chunk is a copy onto itself; a store that refuses it only has the
    chunk checked to be there: saves go on, and a chunk that is gone is still found out."""
    s3 = moto_server.config(moto_server.new_bucket())
    tier = S3Tier(s3, 1 << 30, client=_NoSelfCopy(moto_server.client()))
    cfg = CacheConfig(tiers=(TierConfig("s3", 1 << 30, s3=s3),), chunk_tokens=16)
    first, second = tuple(range(64)), tuple(range(48)) + (7,) * 16
    with Cache(cfg, tiers=[tier], background=False) as cache:
        assert cache.save(chunked_request(NS, first, tier="s3"), sync=True)
        stored = cache._index.stored_in(cache_key(NS, first), "s3")
        assert stored is not None
        assert tier.touch_chunk(stored.chunks[0])
        tier.delete_chunk(stored.chunks[-1])
        assert not tier.touch_chunk(stored.chunks[-1])
        key = cache.save(chunked_request(NS, second, tier="s3"), sync=True)  # reuses three
        assert key is not None
        with cache.open_row(key) as row:
            assert join(row.chunks) == blob(second)


def test_a_put_sends_its_body_at_once_without_asking_to_continue(
    moto_server: MotoServer,
) -> None:
    """A PUT's body is a file (``PacedBody``, held to the speed floor), for which botocore
    asks for "100-continue": a round trip before every body, and a second's wait on a store
    that never answers it. The tier's client sends it at once, as a bytes body was."""
    tier = _tier(moto_server, moto_server.new_bucket())
    sent: list[dict[str, str]] = []
    tier.wire.client.meta.events.register(
        "before-send.s3.PutObject", lambda request, **_: sent.append(dict(request.headers))
    )
    key, req = request(tuple(range(40)))
    assert tier.store(key, req, FakeBook()) is not None and sent
    assert all("Expect" not in headers for headers in sent), sent
