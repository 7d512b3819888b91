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
from kvwarm.errors import CacheFormatError, CacheKeyError

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
