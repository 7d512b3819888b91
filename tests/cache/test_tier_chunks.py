"""The chunk half of the tier contract, for every tier (ram, ram_file, disk, s3 on moto, redis):
store is idempotent, load verifies, delete and scan see exactly what is stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.cache.tierkit import NS, TIERS, TierFactory, factory, shm_dir
from tests.rediskit import RedisServer
from tests.s3kit import MotoServer

from kvwarm.cache.formats import chunkfmt
from kvwarm.cache.tiers import layout, objects
from kvwarm.cache.tiers.objects import ObjectTier
from kvwarm.cache.tiers.redis import RedisStore
from kvwarm.cache.tiers.s3 import S3Tier
from kvwarm.cache.types import PackLoc
from kvwarm.errors import CacheFormatError, CacheIOError, CacheKeyError, ChunkFormatError

TOKENS = tuple(range(40, 72))
PAYLOAD = bytes(range(256)) * 40


def _factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierFactory]:
    name = request.param
    if name == "s3":
        server: MotoServer = request.getfixturevalue("moto_server")
        config = server.config(server.new_bucket())
        yield lambda: S3Tier(config, 1 << 30)
    elif name == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        url = redis.url()
        yield lambda: ObjectTier(RedisStore(url), 1 << 30, name="redis")
    elif name == "ram_file":
        with shm_dir() as d:
            yield factory(name, d)
    else:
        yield factory(name, tmp_path / "kvc")


@pytest.fixture(params=TIERS)
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierFactory]:
    yield from _factory(request, tmp_path)


@pytest.fixture(params=[t for t in TIERS if t != "ram"])
def make_persistent(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierFactory]:
    """Tiers whose chunks outlive the object and could be damaged from outside."""
    yield from _factory(request, tmp_path)


def _chunk(parent: bytes = chunkfmt.ROOT_PARENT) -> tuple[bytes, bytes]:
    return chunkfmt.build_head(NS, parent, TOKENS, PAYLOAD)


def test_store_load_scan_delete(make: TierFactory) -> None:
    tier = make()
    key, head = _chunk()
    size = tier.store_chunk(key, head, PAYLOAD)
    assert size >= len(PAYLOAD)
    assert tier.store_chunk(key, head, PAYLOAD) == size  # idempotent: same content, kept
    assert bytes(tier.load_chunk(key)) == PAYLOAD
    assert dict(tier.scan_chunks()) == {key: size}
    assert not list(tier.stored_keys())  # a chunk is not a row
    tier.delete_chunk(key)
    tier.delete_chunk(key)  # missing is fine
    with pytest.raises(CacheKeyError):
        tier.load_chunk(key)
    assert dict(tier.scan_chunks()) == {}


def test_chunks_outlive_the_tier_object(make_persistent: TierFactory) -> None:
    tier = make_persistent()
    key, head = _chunk()
    size = tier.store_chunk(key, head, PAYLOAD)
    again = make_persistent()
    assert dict(again.scan_chunks()) == {key: size}
    assert bytes(again.load_chunk(key)) == PAYLOAD


def test_a_chunk_stored_under_another_key_is_refused_on_load(
    make_persistent: TierFactory,
) -> None:
    tier = make_persistent()
    _, head = _chunk()
    other, _ = _chunk(parent=b"\x07" * 32)
    tier.store_chunk(other, head, PAYLOAD)  # the object replays to another key
    with pytest.raises(CacheFormatError):
        tier.load_chunk(other)


def test_junk_under_a_chunk_name_is_replaced(make_persistent: TierFactory) -> None:
    tier = make_persistent()
    key, head = _chunk()
    if isinstance(tier, ObjectTier):
        assert tier.objects.put_if_absent(objects.chunk_name(key), b"junk")
    else:
        (getattr(tier, "root") / layout.chunk_name(key)).write_bytes(b"junk")  # noqa: B009
    size = tier.store_chunk(key, head, PAYLOAD)  # the junk is cleared, the chunk linked
    assert bytes(tier.load_chunk(key)) == PAYLOAD
    assert dict(tier.scan_chunks()) == {key: size}


def test_the_pack_half_of_the_contract(make_persistent: TierFactory) -> None:
    """Tiers with packs (s3, redis): a pack is put once (the same id again: kept), read in
    ranges whose every chunk is verified, listed with its age, deleted; the others have
    none (their chunks stay objects of their own)."""
    tier = make_persistent()
    if not tier.capabilities.packs:
        assert isinstance(tier, ObjectTier)  # a file tier
        with pytest.raises(CacheIOError):
            tier.store_pack(b"\x01" * 32, [b"x"])
        return
    assert isinstance(tier, ObjectTier)
    (a, head_a), (b, head_b) = _chunk(), _chunk(parent=b"\x07" * 32)
    pack = b"\x01" * 32
    parts = [head_a, PAYLOAD, head_b, PAYLOAD]
    size = tier.store_pack(pack, parts)
    assert size == sum(map(len, parts))
    assert tier.store_pack(pack, parts) == size  # idempotent: kept
    loc_a = PackLoc(pack, 0, len(head_a) + len(PAYLOAD))
    loc_b = PackLoc(pack, loc_a.end, len(head_b) + len(PAYLOAD))
    assert [bytes(v) for v in tier.load_packed(pack, [(a, loc_a), (b, loc_b)])] == [PAYLOAD] * 2
    assert [bytes(v) for v in tier.load_packed(pack, [(b, loc_b)])] == [PAYLOAD]
    with pytest.raises(ChunkFormatError) as wrong:  # the bytes there are another chunk's
        tier.load_packed(pack, [(a, loc_b)])
    assert wrong.value.key == a
    with pytest.raises(ChunkFormatError):  # past the pack's end
        tier.load_packed(pack, [(b, PackLoc(pack, loc_b.offset, loc_b.length + 9))])
    [(listed, listed_size, _)] = list(tier.pack_ages())
    assert (listed, listed_size) == (pack, size) and tier.pack_age(pack) is not None
    assert tier.touch_pack(pack)
    assert dict(tier.scan_chunks()) == {} and not list(tier.stored_keys())  # no chunk, no row
    # A read found it bad: the next put of its id replaces it instead of keeping it.
    tier.objects.delete(objects.pack_name(pack))
    assert tier.objects.put_if_absent(objects.pack_name(pack), b"junk" * 2000)
    with pytest.raises(ChunkFormatError):
        tier.load_packed(pack, [(a, loc_a)])
    tier.store_pack(pack, parts)
    assert [bytes(v) for v in tier.load_packed(pack, [(a, loc_a)])] == [PAYLOAD]
    tier.delete_pack(pack)
    tier.delete_pack(pack)  # missing is fine
    assert tier.pack_age(pack) is None and not tier.touch_pack(pack)
    with pytest.raises(CacheKeyError):
        tier.load_packed(pack, [(a, loc_a)])
