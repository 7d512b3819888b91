"""One contract suite for every tier: ram, ram_file (/dev/shm), disk (tmp_path), s3 (a live
moto server on 127.0.0.1) and redis (a live redis-server on 127.0.0.1)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import NS, TIERS, TierFactory, factory, request, shm_dir
from tests.rediskit import RedisServer
from tests.s3kit import MotoServer, object_names

from kvwarm.cache.formats import kvc
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.index.index import Index
from kvwarm.cache.protocols import Tier
from kvwarm.cache.tiers.cotenants import PROCS
from kvwarm.cache.tiers.layout import name_for
from kvwarm.cache.tiers.objects import ObjectTier, row_name
from kvwarm.cache.tiers.redis import RedisStore
from kvwarm.cache.tiers.s3 import S3Tier
from kvwarm.cache.types import SaveReason, TtlClass
from kvwarm.errors import CacheKeyError


@pytest.fixture(params=TIERS)
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierFactory]:
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


def _files(tier: Tier) -> list[str]:
    if isinstance(tier, S3Tier):
        return object_names(tier)
    if isinstance(tier, ObjectTier):
        return sorted(name for name, _, _ in tier.objects.list(""))
    root = getattr(tier, "root", None)
    # The registry of processes using the directory (``cotenants.py``) holds no data.
    return sorted(n for n in os.listdir(root) if n != PROCS) if root is not None else []


def test_store_then_load_round_trip(make: TierFactory) -> None:
    tier, book = make(), FakeBook()
    logits = b"\x00\x00\x80\x3f" * 5
    key, req = request((1, 2, 3, 4), logits=logits, reason=SaveReason.FINISH)
    row = tier.store(key, req, book)
    assert row is not None
    assert book.published[key] == row
    assert not book.reservations
    assert book.calls[0] == "reserve" and book.calls[-1] == "publish" and "check" in book.calls
    info = row.info
    size = len(req.payload)  # the ram tier's own bytes, with its logits
    if tier.name == "ram":
        size += len(logits)
    else:  # a file's or object's: all of it
        size += len(kvc.build_prefix(kvc.fields_from_request(req, now=0), req.payload))
    assert (info.key, info.tier, info.size, info.n_tokens) == (key, tier.name, size, 4)
    assert (info.reason, info.ttl_class, info.has_logits) == (
        SaveReason.FINISH,
        TtlClass.LONG,
        True,
    )
    assert info.namespace == NS and info.canonical_tokens == 4 and info.hits == 0
    assert row.tokens == (1, 2, 3, 4)
    got = tier.load(row)
    assert isinstance(got.payload, memoryview)
    assert bytes(got.payload) == req.payload
    assert got.tokens == req.tokens and got.logits == logits
    assert tier.probe(key) is not None


def test_refused_reservation_writes_nothing(make: TierFactory) -> None:
    tier, book = make(), FakeBook()
    key, req = request((5, 6))
    assert tier.store(key, req, book) is not None
    before = _files(tier)
    other = make()
    assert other.store(key, req, book) is None  # already published in the book
    assert _files(tier) == before
    assert book.calls[-1] == "reserve"


@pytest.mark.parametrize("lose_at", ["check", "publish"])
def test_lost_reservation_is_not_announced(make: TierFactory, lose_at: str) -> None:
    tier, book = make(), FakeBook(lose_at=lose_at)
    key, req = request((7, 8, 9))
    assert tier.store(key, req, book) is None
    assert key not in book.published
    assert not any(f.endswith(".tmp") for f in _files(tier))
    if lose_at == "check":
        assert not book.reservations  # abandoned
        assert tier.probe(key) is None
        assert _files(tier) == []


def test_key_mismatch_is_a_value_error_before_reserving(make: TierFactory) -> None:
    tier, book = make(), FakeBook()
    key, req = request((1, 2))
    with pytest.raises(ValueError):
        tier.store(cache_key(NS, (1, 3)), req, book)
    with pytest.raises(ValueError):
        tier.store(key[:31], req, book)
    assert book.calls == []


def test_delete_then_load_is_a_key_error(make: TierFactory) -> None:
    tier, book = make(), FakeBook()
    key, req = request((11, 12))
    row = tier.store(key, req, book)
    assert row is not None
    tier.delete(key)
    tier.delete(key)  # idempotent
    with pytest.raises(CacheKeyError):
        tier.load(row)
    assert tier.probe(key) is None
    assert _files(tier) == []


def test_probe_missing_is_none(make: TierFactory) -> None:
    assert make().probe(cache_key(NS, (404,))) is None


def test_record_hit_persists(make: TierFactory) -> None:
    tier, book = make(), FakeBook()
    key, req = request((21, 22, 23))
    row = tier.store(key, req, book)
    assert row is not None
    tier.record_hit(row, 7, 1_700_000_000.0)  # in the past: a future one reads as now
    seen = tier.probe(key)
    assert seen is not None
    assert (seen.info.hits, seen.info.last_used) == (7, 1_700_000_000.0)
    assert bytes(tier.load(row).payload) == req.payload  # hit fields stay outside the CRC


def test_scan_yields_what_the_tier_holds(make: TierFactory) -> None:
    tier, book = make(), FakeBook()
    keys = set()
    for i in range(5):
        key, req = request((100 + i, i))
        assert tier.store(key, req, book) is not None
        keys.add(key)
    assert {r.info.key for r in tier.scan()} == keys
    restarted = make()
    persistent = tier.name != "ram"
    found = {r.info.key: r for r in restarted.scan()}
    assert set(found) == (keys if persistent else set())
    for key, row in found.items():
        assert bytes(restarted.load(row).payload) == bytes(tier.load(book.published[key]).payload)


def test_many_rows_distinct(make: TierFactory) -> None:
    tier, book = make(), FakeBook()
    rows = []
    for n in range(1, 20):
        key, req = request(tuple(range(n)))
        row = tier.store(key, req, book)
        assert row is not None
        rows.append((row, req.payload))
    for row, payload in rows:
        assert bytes(tier.load(row).payload) == payload


def test_empty_payload_and_tokens(make: TierFactory) -> None:
    tier, book = make(), FakeBook()
    key, req = request((), payload=b"")
    row = tier.store(key, req, book)
    assert row is not None
    got = tier.load(row)
    assert bytes(got.payload) == b"" and got.tokens == () and got.logits is None


def test_with_the_real_index_as_book(make: TierFactory) -> None:
    index, tier = Index(), make()
    key, req = request((61, 62, 63), logits=b"\0" * 8)
    row = tier.store(key, req, index)
    assert row is not None and index.get(key) == row.info
    assert index.pending_reservations() == 0
    assert tier.store(key, req, index) is None  # published: a second save is refused
    assert bytes(tier.load(row).payload) == req.payload
    restarted, fresh = make(), Index()
    for found in restarted.scan():
        assert fresh.adopt(found)
    assert (fresh.get(key) is not None) == (tier.name != "ram")


def _plant(tier: Tier, key: bytes, body: bytes) -> None:
    """Put ``body`` under ``key``'s row name behind the tier's back (junk, or a row)."""
    if isinstance(tier, ObjectTier):
        tier.objects.delete(row_name(key))
        assert tier.objects.put_if_absent(row_name(key), body)
    else:
        root = getattr(tier, "root")  # noqa: B009 - file tiers only
        (root / name_for(key)).write_bytes(body)


PERSISTENT = [t for t in TIERS if t != "ram"]


@pytest.mark.parametrize("make", PERSISTENT, indirect=True)
def test_junk_under_the_name_is_replaced_and_a_valid_row_adopted(make: TierFactory) -> None:
    tier, book = make(), FakeBook()
    key, req = request((31, 32, 33))
    _plant(tier, key, b"not a row at all")
    row = tier.store(key, req, book)  # the junk is cleared and the link tried again
    assert row is not None and bytes(tier.load(row).payload) == req.payload
    other, other_book = make(), FakeBook()  # another writer of the same key, same storage
    adopted = other.store(key, req, other_book)
    assert adopted is not None and adopted.info.key == key
    assert other_book.published[key] == adopted and "mark_linked" in other_book.calls
    assert bytes(other.load(adopted).payload) == req.payload
