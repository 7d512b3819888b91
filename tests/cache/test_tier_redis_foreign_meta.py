"""Values another client planted beside the redis tier's objects (metadata that is not UTF-8 or
not a number, a hash under a chunk's name) are foreign objects: a probe of the row is a miss or
a hit without hit counts, a listing skips what it cannot size, never an untyped exception."""

from __future__ import annotations

import pytest
import redis
from tests.rediskit import RedisServer

from kvwarm.cache.tiers.layout import name_for
from kvwarm.cache.tiers.objects import ObjectTier
from kvwarm.cache.tiers.redis import RedisStore
from kvwarm.errors import ConfigError


def _tier(url: str) -> ObjectTier:
    return ObjectTier(RedisStore(url), 1 << 20, name="shared")


def test_foreign_metadata_bytes_do_not_escape_a_probe(redis_server: RedisServer) -> None:
    prefix = "kvwarm-foreign-meta/"
    tier = _tier(redis_server.url(prefix))
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    key = bytes(32)
    name = name_for(key)
    client.set(f"{prefix}o:{name}", b"junk")
    client.hset(f"{prefix}m:{name}", b"\xff", b"\xfe")
    assert tier.probe(key) is None  # junk row: a miss, not a UnicodeDecodeError
    client.close()
    tier.close()


def test_foreign_superscript_hits_do_not_escape() -> None:
    from kvwarm.cache.tiers.objects import META_HITS, META_LAST_USED, _int_meta

    assert _int_meta({META_HITS: "\u00b2"}, META_HITS) is None  # "²".isdigit(), int() refuses
    assert _int_meta({META_LAST_USED: "12"}, META_LAST_USED) == 12


def test_a_foreign_stamp_or_type_does_not_stop_a_listing(redis_server: RedisServer) -> None:
    prefix = "kvwarm-foreign-list/"
    store = RedisStore(redis_server.url(prefix))
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    good = "chunks/" + "11" * 32 + ".kvk"
    assert store.put_if_absent(good, b"x" * 10)
    client.set(f"{prefix}o:chunks/" + "22" * 32 + ".kvk", b"y")
    client.hset(f"{prefix}m:chunks/" + "22" * 32 + ".kvk", "t", "not-a-time")
    client.hset(f"{prefix}o:chunks/" + "33" * 32 + ".kvk", "x", "y")  # WRONGTYPE for STRLEN
    listed = {n: s for n, s, _ in store.list("chunks/")}
    assert listed[good] == 10
    assert ("chunks/" + "22" * 32 + ".kvk") in listed
    client.close()
    store.close()


@pytest.mark.parametrize("option", ["decode_responses=true", "decode_responses=0"])
def test_url_options_that_decode_replies_are_refused(option: str) -> None:
    """redis-py passes unknown URL options to the client: ``decode_responses`` would turn every
    reply into text and every get into a TypeError; refused when the tier is built."""
    with pytest.raises(ConfigError, match="decode"):
        RedisStore(f"redis://127.0.0.1:1/0?{option}")
