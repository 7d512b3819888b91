"""The eviction seam: LRU and LFU orders, refcounts, quotas, selection by name, and that the
index keeps its invariants whatever a policy yields."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.cache.facadekit import NS, FakeClock, req
from tests.cache.test_index import row

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.eviction import (
    LfuPolicy,
    LruPolicy,
    build_policy,
    register_policy,
    registered_policies,
    unregister_policy,
)
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.index.index import Index
from kvwarm.cache.types import RowInfo, TierName
from kvwarm.cache.validate import validate_cache_config
from kvwarm.errors import ConfigError


def _hits(idx: Index, key: bytes, n: int) -> None:
    for _ in range(n):
        assert idx.checkout(key) is not None
        idx.checkin(key)


def test_lfu_orders_by_hits_then_last_use_then_key() -> None:
    clock = FakeClock(100.0)
    idx = Index(clock=clock, eviction=LfuPolicy())
    a, b, c, d = (row((i,), 10, last_used=float(i)) for i in range(4))
    for r in (a, b, c, d):
        idx.adopt(r)
    _hits(idx, a.info.key, 3)  # a: 3 hits, b: 1, c and d: none (c used longer ago)
    _hits(idx, b.info.key, 1)
    assert idx.eviction_order("ram") == [c.info.key, d.info.key, b.info.key, a.info.key]
    victims = idx.evict(15)
    assert [v.info.key for v in victims] == [c.info.key, d.info.key]
    # Ties on hits and last use fall back to the key, so the order is deterministic.
    e, f = row((7,), 10, last_used=200.0), row((8,), 10, last_used=200.0)
    idx.adopt(e)
    idx.adopt(f)
    assert idx.eviction_order("ram")[:2] == sorted([e.info.key, f.info.key])


def test_lfu_never_evicts_a_checked_out_row() -> None:
    idx = Index(eviction=LfuPolicy())
    cold, warm = row((1,), 10), row((2,), 10)
    idx.adopt(cold)
    idx.adopt(warm)
    _hits(idx, warm.info.key, 2)
    pinned = idx.checkout(cold.info.key, touch=False)  # the least used row, pinned
    assert pinned is not None and idx.eviction_order("ram")[0] == cold.info.key
    assert [v.info.key for v in idx.evict(1)] == [warm.info.key]
    assert idx.evict(1000) == [] and len(idx) == 1
    idx.checkin(cold.info.key)
    assert [v.info.key for v in idx.evict(1)] == [cold.info.key]


def test_lfu_merges_tiers_and_respects_scope() -> None:
    idx = Index(eviction=LfuPolicy())
    ram, disk = row((1,), 10, tier="ram"), row((2,), 10, tier="disk")
    idx.adopt(ram)
    idx.adopt(disk)
    _hits(idx, disk.info.key, 1)
    assert [v.info.key for v in idx.evict(1, ("disk",))] == [disk.info.key]
    assert idx.usage() == {"ram": (10, 1), "disk": (0, 0)}


def test_enforce_quota_with_lfu_keeps_the_reused_row() -> None:
    """The same history under both policies: LRU drops the row used longest ago, LFU the row
    used least, so the one reused prompt survives a burst of one-off saves."""
    survivors: dict[str, set[bytes]] = {}
    for name in ("lru", "lfu"):
        clock = FakeClock(1000.0)
        idx = Index(clock=clock, eviction=build_policy(name))
        idx.adopt(row((0,), 100, last_used=clock.t))
        _hits(idx, row((0,)).info.key, 3)
        for i in (1, 2, 3):  # one-off prompts, each saved after the hot row's last use
            clock.advance(1)
            idx.adopt(row((i,), 100, last_used=clock.t))
        evicted = idx.enforce_quota("ram", 300)
        assert len(evicted) == 1 and idx.usage()["ram"] == (300, 3)
        survivors[name] = {r.key for r in idx.rows()}
    hot_key, one_key = row((0,)).info.key, row((1,)).info.key
    assert hot_key not in survivors["lru"] and one_key in survivors["lru"]
    assert hot_key in survivors["lfu"] and one_key not in survivors["lfu"]


def test_lfu_quota_through_the_facade() -> None:
    cfg = CacheConfig(tiers=(TierConfig("ram", 300),), eviction="lfu")
    with Cache(cfg, background=False) as cache:
        hot = cache.save(req((1,), 100), sync=True)
        assert hot is not None
        for _ in range(2):
            with cache.open_row(hot):
                pass
        for toks in ((2,), (3,), (4,)):
            assert cache.save(req(toks, 100), sync=True) is not None
        keys = {r.key for r in cache.rows()}
        assert hot in keys and len(keys) == 3
        assert cache_key(NS, (2,)) not in keys  # the oldest row nobody reused


def test_lfu_order_survives_a_restart(tmp_path: Path) -> None:
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 20, tmp_path),), eviction="lfu")
    keys = []
    with Cache(cfg, background=False) as cache:
        for i in range(3):
            key = cache.save(req((i,), 100, tier="disk"), sync=True)
            assert key is not None
            keys.append(key)
            for _ in range(3 - i):  # row 0 most used, row 2 least
                with cache.open_row(key):
                    pass
    with Cache(cfg, background=False) as cache:  # hits were persisted in the file headers
        assert cache._index.eviction_order("disk") == keys[::-1]


class _Sloppy:
    """A policy that yields duplicates, pinned and unknown keys, and other tiers' rows."""

    def __init__(self) -> None:
        self.inner = LruPolicy()

    def insert(self, key: bytes, info: RowInfo) -> None:
        self.inner.insert(key, info)

    def remove(self, key: bytes) -> None:
        self.inner.remove(key)

    def touch(self, key: bytes, info: RowInfo) -> None:
        self.inner.touch(key, info)

    def resort(self) -> None:
        self.inner.resort()

    def order(self, tier: TierName) -> list[bytes]:
        return self.inner.order(tier)

    def victims(
        self, tiers: Sequence[TierName], evictable: Callable[[bytes], bool]
    ) -> Iterator[bytes]:
        everything = [k for t in ("ram", "disk") for k in self.inner.order(t)]
        yield b"\x00" * 32
        for key in everything:
            yield key
            yield key


def test_index_keeps_its_invariants_whatever_the_policy_yields() -> None:
    idx = Index(eviction=_Sloppy())
    rows = [row((i,), 10, tier="ram") for i in range(3)] + [row((9,), 10, tier="disk")]
    for r in rows:
        idx.adopt(r)
    assert idx.checkout(rows[0].info.key) is not None
    victims = [v.info.key for v in idx.evict(1000, ("ram",))]
    assert victims == [rows[1].info.key, rows[2].info.key]  # once each, no pin, no disk
    assert idx.usage() == {"ram": (10, 1), "disk": (10, 1)}


def test_policies_are_chosen_by_name() -> None:
    assert {"lru", "lfu"} <= set(registered_policies())
    assert isinstance(build_policy("lfu"), LfuPolicy)
    with pytest.raises(ConfigError, match="eviction"):
        validate_cache_config(CacheConfig(eviction="mru"))
    with pytest.raises(ConfigError, match="mru"):
        Cache(CacheConfig(eviction="mru"), background=False)
    with pytest.raises(ConfigError, match="policy names"):
        register_policy("a b", LruPolicy)
    built: list[LruPolicy] = []

    def custom() -> LruPolicy:
        built.append(LruPolicy())
        return built[-1]

    register_policy("custom_test", custom)
    try:
        with Cache(CacheConfig(eviction="custom_test"), background=False) as cache:
            assert cache.save(req((1,)), sync=True) is not None
        assert len(built) == 1 and built[0].order("ram") == [cache_key(NS, (1,))]
    finally:
        unregister_policy("custom_test")
    assert "custom_test" not in registered_policies()


# ------------------------------------------------------------------ LFU against a model

_ops = st.lists(
    st.tuples(st.sampled_from(["add", "hit", "pin", "unpin", "evict"]), st.integers(0, 4)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops)
def test_lfu_eviction_matches_a_model(ops: list[tuple[str, int]]) -> None:
    clock = FakeClock(0.0)
    idx = Index(clock=clock, eviction=LfuPolicy())
    model: dict[bytes, tuple[int, float]] = {}  # key -> (hits, last used)
    pins: dict[bytes, int] = {}
    for op, i in ops:
        clock.advance(1)
        r = row((i,), 10 + i, last_used=clock.t)
        key = r.info.key
        if op == "add" and key not in model:
            assert idx.adopt(r)
            model[key] = (0, clock.t)
        elif op == "hit" and key in model:
            _hits(idx, key, 1)
            model[key] = (model[key][0] + 1, clock.t)
        elif op == "pin" and key in model:
            assert idx.checkout(key, touch=False) is not None
            pins[key] = pins.get(key, 0) + 1
        elif op == "unpin" and pins.get(key):
            idx.checkin(key)
            pins[key] -= 1
        elif op == "evict":
            order = sorted(model, key=lambda k: (*model[k], k))
            want, freed = [], 0
            for k in order:
                if freed >= i * 10:
                    break
                if not pins.get(k):
                    want.append(k)
                    freed += idx.get(k).size  # type: ignore[union-attr]
            evicted = idx.evict(i * 10)
            idx.retired(evicted)  # their bytes deleted, as ``CacheCore.retire`` does
            got = [v.info.key for v in evicted]
            assert got == want
            for k in got:
                del model[k]
        assert idx.eviction_order("ram") == sorted(model, key=lambda k: (*model[k], k))
