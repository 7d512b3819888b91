"""The ``Cache`` facade with the RAM tier (and a gated RAM tier for timing control)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from tests.cache.facadekit import NS, NS2, FakeClock, GatedTier, req

from kvwarm.cache import Cache, CacheConfig, PressureConfig, SaveReason, TierConfig, TtlClass
from kvwarm.cache.api import CacheApi
from kvwarm.cache.tiers.registry import check_name
from kvwarm.errors import CacheFormatError, CacheKeyError, ConfigError, InvalidRequestError
from kvwarm.settings.types import as_tier


@pytest.fixture
def cache() -> Iterator[Cache]:
    c = Cache(CacheConfig(tiers=(TierConfig("ram", 10_000),)), background=False)
    yield c
    c.close()


def test_implements_cache_api(cache: Cache) -> None:
    api: CacheApi = cache  # mypy checks structural conformance
    for name in CacheApi.__dict__:
        if not name.startswith("_"):
            assert callable(getattr(api, name)), name


def test_save_lookup_open_roundtrip(cache: Cache) -> None:
    toks = tuple(range(40))
    assert cache.save(req(toks, 300), sync=True)
    key = cache.key_for(NS, toks)
    info = cache.lookup_exact(key)
    assert info is not None and info.size == 300 and info.n_tokens == 40
    with cache.open_row(key) as row:
        assert row.tokens == toks
        assert bytes(row.payload) == bytes([40]) * 300
        assert cache._index.refcount(key) == 1
    assert cache._index.refcount(key) == 0
    assert cache.lookup_exact(key).hits == 1  # type: ignore[union-attr]
    c = cache.counters()
    # A lookup is no request's hit (the engine counts what served one: record_hit).
    assert c["hits_exact"] == 0 and c["saves_cold"] == 1
    assert c["tier_ram_bytes"] == 300 and c["tier_ram_rows"] == 1
    assert c["tier_ram_quota_bytes"] == 10_000
    assert c["latency_load_count"] == 1 and c["latency_save_count"] == 1


def test_longest_prefix_any_length_and_namespaces(cache: Cache) -> None:
    assert cache.save(req(tuple(range(100)), 500), sync=True)
    assert cache.save(req(tuple(range(100)), 50, ns=NS2), sync=True)
    q = (*tuple(range(73)), 9999, 1)
    m = cache.longest_prefix(NS, q)
    assert m is not None and m.n_shared == 73 and m.row.size == 500
    assert cache.longest_prefix(NS, q, min_shared=74) is None
    assert cache.longest_prefix(NS, (5, 6)) is None
    assert cache.counters()["hits_longest_prefix"] == 0  # a lookup counts no hit


def test_record_hit_counts_only_hit_counters(cache: Cache) -> None:
    cache.record_hit("hits_live")
    cache.record_hit("hits_draft_prefix")
    cache.record_miss()
    c = cache.counters()
    assert (c["hits_live"], c["hits_draft_prefix"], c["misses"]) == (1, 1, 1)
    for name in ("misses", "saves_cold", "hits_shared", "hits_typo"):
        with pytest.raises(ValueError, match="not a hit counter"):
            cache.record_hit(name)
    assert cache.counters()["misses"] == 1 and "hits_typo" not in cache.counters()


def test_unknown_key_and_unconfigured_tier(cache: Cache) -> None:
    with pytest.raises(CacheKeyError), cache.open_row(b"\x00" * 32):
        pass
    with pytest.raises(InvalidRequestError):
        cache.save(req((1, 2, 3), tier="disk"))
    assert cache.lookup_exact(b"\x00" * 32) is None


def test_quota_evicts_lru_but_never_checked_out(cache: Cache) -> None:
    keys = []
    for i in range(4):
        toks = (i,) * 10
        assert cache.save(req(toks, 3000), sync=True)
        keys.append(cache.key_for(NS, toks))
    # quota 10_000 holds three 3000-byte rows: the oldest went
    assert cache.lookup_exact(keys[0]) is None
    assert cache.counters()["evictions"] == 1
    with cache.open_row(keys[1]):  # pinned and now most recent
        assert cache.save(req((9,) * 10, 3000), sync=True)
        assert cache.lookup_exact(keys[1]) is not None
        assert cache.lookup_exact(keys[2]) is None  # the LRU unpinned row went instead
    assert cache.counters()["tier_ram_bytes"] <= 10_000


def test_async_save_dropped_when_writer_full() -> None:
    tier = GatedTier()
    tier.gate.clear()
    c = Cache(CacheConfig(writer_threads=1, writer_queue=1), tiers=[tier], background=False)
    try:
        # taken by the single thread, parks at the gate; an async save returns the key at once
        assert c.save(req((1,) * 5)) == c.key_for(NS, (1,) * 5)
        assert tier.entered.wait(5)
        assert c.save(req((2,) * 5))  # fills the queue
        assert c.save(req((3,) * 5)) is None  # dropped
        assert c.counters()["saves_dropped"] == 1
        assert not c._index.in_flight(c.key_for(NS, (3,) * 5))
        tier.gate.set()
        assert c.flush(5)
        assert len(c.rows()) == 2
    finally:
        tier.gate.set()
        c.close()


def test_waiter_wakes_when_in_flight_save_publishes() -> None:
    tier = GatedTier()
    tier.gate.clear()
    c = Cache(CacheConfig(), tiers=[tier], background=False)
    try:
        toks = (7,) * 30
        key = c.key_for(NS, toks)
        assert c.save(req(toks, reason=SaveReason.FINISH))
        assert c._index.in_flight(key)  # marked before save() returned
        result: list[object] = []
        parked = threading.Event()

        def waiter() -> None:
            parked.set()
            result.append(c.lookup_exact_or_wait(key, 30.0))

        t = threading.Thread(target=waiter)
        t.start()
        assert parked.wait(5)
        assert tier.entered.wait(5)
        tier.gate.set()
        t.join(10)
        assert not t.is_alive()
        assert result and result[0] is not None
        # Waiting for a row (GET /cache/rows/{key}, a parent_key) restores nothing: no hit.
        counters = c.counters()
        assert counters["hits_resume"] == counters["hits_exact"] == 0
    finally:
        tier.gate.set()
        c.close()


def test_waiter_gives_up_at_timeout_and_on_failure() -> None:
    tier = GatedTier()
    tier.gate.clear()
    c = Cache(CacheConfig(), tiers=[tier], background=False)
    try:
        toks = (8,) * 30
        key = c.key_for(NS, toks)
        assert c.save(req(toks))
        assert c.lookup_exact_or_wait(key, 0.05) is None  # still parked at the gate
        tier.fail_store = True
        done = threading.Event()
        out: list[object] = ["unset"]

        def waiter() -> None:
            out[0] = c.lookup_exact_or_wait(key, 30.0)
            done.set()

        t = threading.Thread(target=waiter)
        t.start()
        tier.gate.set()
        assert done.wait(10)  # woke on failure long before its 30 s timeout
        assert out[0] is None
        assert c.counters()["save_failures"] == 1
        # nothing in flight: no wait at all
        assert c.lookup_exact_or_wait(c.key_for(NS, (1, 2)), 30.0) is None
    finally:
        tier.gate.set()
        c.close()


def test_corrupt_row_dropped_on_open() -> None:
    tier = GatedTier()
    c = Cache(CacheConfig(), tiers=[tier], background=False)
    try:
        toks = tuple(range(20))
        assert c.save(req(toks), sync=True)
        key = c.key_for(NS, toks)
        tier.corrupt.add(key)
        with pytest.raises(CacheFormatError), c.open_row(key):
            pass
        assert c.lookup_exact(key) is None and key in tier.deleted
        assert c.longest_prefix(NS, toks) is None
    finally:
        c.close()


def test_verify_reports_and_drops_bad_rows() -> None:
    tier = GatedTier()
    c = Cache(CacheConfig(), tiers=[tier], background=False)
    try:
        for i in range(3):
            assert c.save(req((i,) * 8), sync=True)
        bad = c.key_for(NS, (1,) * 8)
        tier.corrupt.add(bad)
        assert c.verify() == c.verify()  # reporting is not repairing: nothing is dropped
        assert len(c.rows()) == 3 and not tier.deleted
        report = c.verify(repair=True)
        assert report.checked == 3 and len(report.bad) == 1
        assert report.bad[0][0] == bad.hex()
        assert len(c.rows()) == 2
        assert all(r.hits == 0 for r in c.rows())  # verify is not a use
    finally:
        c.close()


def test_ttl_sweep_with_injected_clock() -> None:
    clock = FakeClock()
    tier = GatedTier()
    c = Cache(
        CacheConfig(ttl_seconds=(10.0, 100.0, 1000.0)), tiers=[tier], clock=clock, background=False
    )
    try:
        for toks, ttl in (
            ((1,) * 4, TtlClass.SHORT),
            ((2,) * 4, TtlClass.LONG),
            ((3,) * 4, TtlClass.EXTENDED),
        ):
            # RamTier stamps rows with the wall clock; adopt through the index's clock instead
            assert c.save(req(toks, ttl=ttl), sync=True)
        for r in c.rows():
            c._index.checkout(r.key)  # stamps last_used from the injected clock
            c._index.checkin(r.key)
        clock.advance(11)
        assert c.gc().rows == 1
        pinned = c.key_for(NS, (2,) * 4)
        assert c._index.checkout(pinned) is not None  # touched at +11, pinned
        clock.advance(200)
        assert c.gc().rows == 0  # the long row is checked out: never expires while in use
        c._index.checkin(pinned)
        assert c.gc().rows == 1
        clock.advance(1000)
        assert c.gc().rows == 1 and not c.rows()
        assert c.counters()["evictions"] == 3
    finally:
        c.close()


def test_delete_record_miss_latency_and_close_idempotent() -> None:
    c = Cache(background=False)
    assert c.save(req((5,) * 10), sync=True)
    key = c.key_for(NS, (5,) * 10)
    assert c.delete(key) and not c.delete(key)
    c.record_miss()
    c.record_latency("unpack", 0.25)
    snap = c.counters()
    assert snap["misses"] == 1 and snap["latency_unpack_seconds"] == 0.25
    c.close()
    c.close()
    assert not c.save(req((6,) * 10))


def test_evict_bytes_oldest_first(cache: Cache) -> None:
    for i in range(3):
        assert cache.save(req((i,) * 5, 1000), sync=True) == cache.key_for(NS, (i,) * 5)
    res = cache.evict_bytes(1500)
    assert (res.rows, res.bytes) == (2, 2000)
    assert [r.n_tokens for r in cache.rows()] == [5]
    assert cache.lookup_exact(cache.key_for(NS, (2,) * 5)) is not None


def test_persist_hits_batches_to_tier() -> None:
    tier = GatedTier()
    c = Cache(CacheConfig(), tiers=[tier], background=False)
    try:
        assert c.save(req((4,) * 6), sync=True)
        key = c.key_for(NS, (4,) * 6)
        for _ in range(3):
            with c.open_row(key):
                pass
        assert tier.hits == {}
        c.persist_hits()
        assert tier.hits == {key: 3}
    finally:
        c.close()


def test_bad_config_fails_at_construction(tmp_path: object) -> None:
    with pytest.raises(ConfigError):
        Cache(CacheConfig(writer_threads=0))
    with pytest.raises(ConfigError):
        Cache(CacheConfig(pressure=PressureConfig(high_watermark=0.5, low_watermark=0.6)))


@pytest.mark.parametrize("name", ["disqué", "ram²", "my-tier", ""])
def test_a_tier_name_must_be_ascii_letters_digits_and_underscores(name: str) -> None:
    """Names appear in /metrics, whose tier pattern is ASCII (found by review: "disqué"
    passed str.isalnum() and its sizes were exposed as mangled counters)."""
    with pytest.raises(ConfigError, match="tier names"):
        check_name(name)
    if name:  # save_tier's parser (settings) says the same
        with pytest.raises(ValueError, match="tier name"):
            as_tier(name)


def test_pressure_scheduler_evicts_through_facade() -> None:
    used = [0]
    cfg = CacheConfig(
        pressure=PressureConfig(
            enabled=True,
            high_watermark=0.8,
            low_watermark=0.5,
            min_evict_bytes=1,
            evict_tiers=("ram",),
        ),
    )
    c = Cache(cfg, pressure_source=lambda: (used[0], 10_000), background=False)
    try:
        for i in range(5):
            assert c.save(req((i,) * 3, 1000), sync=True)
        assert c.pressure is not None
        assert c.pressure.tick().evicted is None
        used[0] = 9000  # 0.9 >= 0.8: free down to 0.5 -> 4000 bytes
        res = c.pressure.tick()
        assert res.requested == 4000 and res.evicted is not None
        assert res.evicted.bytes == 4000 and len(c.rows()) == 1
    finally:
        c.close()
