"""Redis evicting our keys by itself (``maxmemory`` with an ``allkeys-*`` policy): chunk
strings vanish under the manifests naming them, and metadata hashes vanish under their
objects. A restore is then exact or a typed miss, never a wrong row nor an untyped error; a
row saved again afterwards restores; a chunk written again is young, whatever hash its
evicted predecessor left."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
import redis
from tests.cache.chunkkit import blob, chunked_request, join
from tests.cache.tierkit import NS
from tests.rediskit import RedisServer

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.tiers.objects import CHUNK_DIR, ObjectTier
from kvwarm.cache.tiers.registry import TierOptions, build_tier
from kvwarm.errors import CacheKeyError

C = 16

# Chunks as their own objects (an older kvwarm's rows); packs: test_packs.py.
pytestmark = pytest.mark.usefixtures("chunk_objects")


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A server of this test's own: its memory limit is changed."""
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


def _config(url: str) -> CacheConfig:
    return CacheConfig(tiers=(TierConfig("shared", 1 << 30, url=url),), chunk_tokens=C)


def _rows(n: int) -> list[tuple[int, ...]]:
    """Conversations sharing a prefix, so later rows reuse earlier rows' chunks."""
    return [tuple(range(32)) + tuple(range(1000 * i, 1000 * i + 32)) for i in range(n)]


def _restore(cache: Cache, tokens: tuple[int, ...]) -> bool:
    """True: restored exactly; False: a typed miss. Anything else fails the test."""
    try:
        with cache.open_row(cache_key(NS, tokens)) as row:
            assert join(row.chunks) == blob(tokens)
            return True
    except CacheKeyError:
        return False


def test_chunks_redis_evicts_are_misses_and_a_new_save_restores(own_redis: RedisServer) -> None:
    url = own_redis.url()
    admin = redis.Redis(host="127.0.0.1", port=own_redis.port)
    rows = _rows(12)
    with Cache(_config(url), background=False) as writer:
        for tokens in rows:
            assert writer.save(chunked_request(NS, tokens, tier="shared"), sync=True)
    with Cache(_config(url), background=False) as reader:  # indexes every row and chunk
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory-policy", "allkeys-random")
        admin.config_set("maxmemory", str(used - 400_000))  # ~20 chunks must go
        admin.set("pressure", b"x")  # any write makes redis evict down to the limit
        admin.config_set("maxmemory", "0")
        # And for certain, the first chunk every row shares (random eviction may spare it).
        stored = reader._index.stored_in(cache_key(NS, rows[-1]), "shared")
        assert stored is not None
        prefix = url.split("prefix=")[1]
        admin.delete(f"{prefix}o:{CHUNK_DIR}{stored.chunks[0].hex()}.kvk")
        missed = 0
        for tokens in rows:  # a miss, then the cold prefill's save, as the engine does
            if not _restore(reader, tokens):
                missed += 1
                assert reader.save(chunked_request(NS, tokens, tier="shared"), sync=True)
        assert missed, "redis evicted nothing under a manifest: no test"
        with Cache(_config(url), background=False) as fresh:
            assert all(_restore(fresh, tokens) for tokens in rows)
    admin.close()


def test_a_chunk_written_again_after_redis_evicted_it_is_young(own_redis: RedisServer) -> None:
    """Redis evicted a chunk's string but not its metadata hash, whose stamp is old: the
    chunk written again must not inherit that stamp (a sweep would delete it as old before
    the manifest naming it is published)."""
    url = own_redis.url()
    admin = redis.Redis(host="127.0.0.1", port=own_redis.port)
    with Cache(_config(url), background=False) as writer:
        assert writer.save(chunked_request(NS, _rows(1)[0], tier="shared"), sync=True)
    tier = build_tier(TierConfig("shared", 1 << 30, url=url), TierOptions())
    assert isinstance(tier, ObjectTier)
    [(key, _, _), *_] = list(tier.chunk_ages())
    prefix = url.split("prefix=")[1]
    obj, meta = f"{prefix}o:{CHUNK_DIR}{key.hex()}.kvk", f"{prefix}m:{CHUNK_DIR}{key.hex()}.kvk"
    body = admin.get(obj)
    assert body is not None
    admin.hset(meta, "t", str(time.time() - 7200))  # written two hours ago...
    admin.delete(obj)  # ...and evicted, its hash left behind
    assert tier.objects.put_if_absent(f"{CHUNK_DIR}{key.hex()}.kvk", body)
    [age] = [mtime for k, _, mtime in tier.chunk_ages() if k == key]
    assert math.isfinite(age) and abs(time.time() - age) < 600
    tier.close()
    admin.close()


def test_a_full_redis_that_evicts_nothing_drops_saves_and_still_serves(
    own_redis: RedisServer,
) -> None:
    """``noeviction`` (or a ``volatile-*`` policy: kvwarm sets no TTLs) answers OOM to writes
    once full: each save is dropped, counted, and the rows already there still restore."""
    url = own_redis.url()
    admin = redis.Redis(host="127.0.0.1", port=own_redis.port)
    first, *rest = _rows(4)
    with Cache(_config(url), background=False) as cache:
        assert cache.save(chunked_request(NS, first, tier="shared"), sync=True)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", str(int(admin.info("memory")["used_memory"]) - 1024))
        for tokens in rest:
            assert cache.save(chunked_request(NS, tokens, tier="shared"), sync=True) is None
        assert cache.counters()["save_failures"] == len(rest)
        assert _restore(cache, first)
        admin.config_set("maxmemory", "0")
    admin.close()


def test_the_replica_that_wrote_a_chunk_redis_evicted_writes_it_again(
    own_redis: RedisServer,
) -> None:
    """The writer itself misses on a row whose shared chunk redis evicted a moment after it
    wrote it (no sweep's grace applies to redis's own eviction): its next save of the row
    must find the chunk gone and write it again, though it wrote it recently."""
    url = own_redis.url()
    admin = redis.Redis(host="127.0.0.1", port=own_redis.port)
    rows = _rows(3)
    with Cache(_config(url), background=False) as cache:
        for tokens in rows:
            assert cache.save(chunked_request(NS, tokens, tier="shared"), sync=True)
        stored = cache._index.stored_in(cache_key(NS, rows[0]), "shared")
        assert stored is not None
        prefix = url.split("prefix=")[1]
        assert admin.delete(f"{prefix}o:{CHUNK_DIR}{stored.chunks[0].hex()}.kvk") == 1
        assert not _restore(cache, rows[0])
        assert cache.save(chunked_request(NS, rows[0], tier="shared"), sync=True)
        assert _restore(cache, rows[0])
    admin.close()


def test_a_writer_whose_clock_lags_stamps_its_chunks_with_the_servers_time(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk ages come from one clock, the server's: a replica whose clock runs two hours
    behind must not stamp the chunks it writes as two hours old (a sweep elsewhere would
    delete them before their manifest)."""
    tier = build_tier(TierConfig("shared", 1 << 30, url=own_redis.url()), TierOptions())
    assert isinstance(tier, ObjectTier)
    real = time.time()
    with monkeypatch.context() as m:
        m.setattr(time, "time", lambda: real - 7200)
        assert tier.objects.put_if_absent(f"{CHUNK_DIR}{'ab' * 32}.kvk", b"bytes")
    [(_, _, age)] = list(tier.chunk_ages())
    assert abs(age - real) < 600
    tier.close()
