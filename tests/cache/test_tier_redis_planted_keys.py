"""A key planted under the redis tier's prefix whose name is not UTF-8 (any client may write
one: Redis keys are binary) must not stop the tier's listings: the rescan, the startup scan
and the shared chunk GC each treat it as not ours (as the file store treats a stray name),
and still see the valid rows and chunks beside it."""

from __future__ import annotations

import redis
from tests.cache.facadekit import req
from tests.rediskit import RedisServer

from kvwarm.cache import Cache, CacheConfig, TierConfig


def _config(url: str) -> CacheConfig:
    return CacheConfig(tiers=(TierConfig("ram", 1 << 20), TierConfig("shared", 1 << 20, url=url)))


def test_a_non_utf8_key_under_the_prefix_does_not_stop_rescan_or_gc(
    redis_server: RedisServer,
) -> None:
    prefix = "kvwarm-planted-utf8/"
    url = redis_server.url(prefix)
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.set(prefix.encode() + b"o:\xff\xfe.kvc", b"junk")  # planted, not ours
    with Cache(_config(url), background=False) as reader:
        with Cache(_config(url), background=False) as writer:
            key = writer.save(req((5,) * 8, tier="shared"), sync=True)
            assert key is not None
        # Another host's row: the periodic rescan must adopt it despite the stray key.
        assert reader.rescan() == 1
        assert reader.lookup_exact(key) is not None
        # The shared chunk sweep must run (or refuse, saying why), never raise.
        results = reader.gc_shared(grace_s=0)
        assert [r.tier for r in results] == ["shared"]
    client.close()


def test_a_key_of_another_type_under_a_row_name_does_not_stop_the_scan(
    redis_server: RedisServer,
) -> None:
    """A hash (not a string) under a row's name is junk like any other unreadable object:
    reported, while the valid rows beside it are still adopted at start-up."""
    prefix = "kvwarm-planted-type/"
    url = redis_server.url(prefix)
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    with Cache(_config(url), background=False) as writer:
        key = writer.save(req((5,) * 8, tier="shared"), sync=True)
        assert key is not None
    other = "00" * 32 + ".kvc"
    client.hset(f"{prefix}o:{other}", "x", "y")  # WRONGTYPE for GETRANGE
    with Cache(_config(url), background=False) as reader:
        # Adopted by the startup scan (no probe: the index itself knows it).
        assert key in [r.key for r in reader.rows()]
    client.close()
