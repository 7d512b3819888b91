"""The cache's memory of gone rows and saves in flight (``cache/explain.py``): bounded, confined
to a namespace, forgotten when a key is published again."""

from __future__ import annotations

from kvwarm.cache.explain import MissHistory, MissReason, ReuseReport, describe, reuse_json
from kvwarm.cache.types import Namespace

NS = Namespace(b"\1" * 32, 2, b"\3" * 32)
OTHER = Namespace(b"\1" * 32, 2, b"\4" * 32)


def test_a_gone_row_is_found_only_in_its_namespace_and_beyond_what_was_reused() -> None:
    now = [100.0]
    h = MissHistory(clock=lambda: now[0])
    h.gone(NS, b"k1", [1, 2, 3, 4], MissReason.EVICTED, "disk", "lfu")
    now[0] = 130.0
    r = h.lookup(NS, [1, 2, 3, 9], beyond=0)
    assert r == ReuseReport(MissReason.EVICTED, 3, 0, 30.0, "disk", "lfu")
    assert h.lookup(NS, [1, 2, 3, 9], beyond=3) is None  # reused as much already
    assert h.lookup(OTHER, [1, 2, 3, 9], beyond=0) is None


def test_a_republished_key_is_no_longer_gone() -> None:
    h = MissHistory()
    h.gone(NS, b"k1", [1, 2, 3], MissReason.EXPIRED, "ram", "short")
    h.republished(b"k1")
    assert h.lookup(NS, [1, 2, 3], beyond=0) is None and len(h) == 0


def test_the_history_is_bounded_by_rows_and_by_tokens() -> None:
    h = MissHistory(max_rows=3, max_tokens=10)
    for i in range(5):
        h.gone(NS, bytes([i]), [i + 10, 1], MissReason.EVICTED, "ram", "lru")
    assert len(h) == 3
    assert h.lookup(NS, [10, 1], beyond=0) is None  # the oldest left first
    assert h.lookup(NS, [14, 1], beyond=0) is not None
    h.gone(NS, b"long", list(range(100, 109)), MissReason.EVICTED, "ram", "lru")  # 9 tokens
    assert len(h) == 1  # only room for it
    h.gone(NS, b"huge", list(range(11)), MissReason.EVICTED, "ram", "lru")  # over the bound
    assert len(h) == 1


def test_a_save_in_flight_is_found_until_it_ends() -> None:
    h = MissHistory()
    h.saving(b"k", NS, (1, 2, 3, 4, 5), "ram")
    r = h.lookup(NS, [1, 2, 3, 4, 7], beyond=2)
    assert r is not None and (r.reason, r.found_tokens, r.tier) == (
        MissReason.SAVE_IN_FLIGHT,
        4,
        "ram",
    )
    h.saved(b"k")
    assert h.lookup(NS, [1, 2, 3, 4, 7], beyond=2) is None


def test_a_report_renders_as_json_and_as_a_line() -> None:
    r = ReuseReport(MissReason.EVICTED, 300, 12, 4.56789, "disk", "lru")
    assert reuse_json(r) == {
        "reason": "evicted",
        "found_tokens": 300,
        "reused_tokens": 12,
        "age_s": 4.568,
        "tier": "disk",
        "detail": "lru",
    }
    assert describe(r).startswith("evicted: the row that shared more was evicted (found 300")
    assert reuse_json(ReuseReport(MissReason.NO_PREFIX)) == {
        "reason": "no_prefix",
        "found_tokens": 0,
        "reused_tokens": 0,
    }
