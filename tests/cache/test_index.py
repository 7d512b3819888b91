"""The index alone: reservation state machine, waiters, LRU, accounting, eviction choice."""

from __future__ import annotations

import threading

from tests.cache.facadekit import NS, NS2, FakeClock

from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.index.index import Index
from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.types import Namespace, RowInfo, SaveReason, TierName, TtlClass


def row(
    tokens: tuple[int, ...],
    size: int = 10,
    *,
    tier: TierName = "ram",
    ns: Namespace = NS,
    last_used: float = 0.0,
    ttl: TtlClass = TtlClass.SHORT,
) -> StoredRow:
    key = cache_key(ns, tokens)
    info = RowInfo(
        key, tier, size, len(tokens), 0, last_used, last_used, SaveReason.COLD, ttl, False, ns
    )
    return StoredRow(info, tokens, None if tier == "ram" else f"/x/{key.hex()}.kvc")


def test_reserve_publish_roundtrip() -> None:
    idx = Index()
    r = row((1, 2, 3), 30)
    key = r.info.key
    tok = idx.reserve(key, "ram")
    assert tok is not None
    assert idx.reserve(key, "ram") is None  # one live writer per key
    assert idx.check(key, tok)
    assert idx.get(key) is None
    assert idx.publish(key, tok, r)
    assert idx.get(key) == r.info
    assert idx.reserve(key, "ram") is None  # published: skip the save
    assert idx.tokens(key) == (1, 2, 3)
    assert idx.usage() == {"ram": (30, 1)}
    assert idx.pending_reservations() == 0


def test_abandon_and_lost_reservation() -> None:
    idx = Index()
    r = row((4,))
    key = r.info.key
    tok = idx.reserve(key, "ram")
    assert tok is not None
    idx.abandon(key, tok)
    idx.abandon(key, tok)  # idempotent
    assert not idx.check(key, tok)
    assert not idx.publish(key, tok, r)  # lost: must not announce
    assert idx.get(key) is None
    tok2 = idx.reserve(key, "ram")
    assert tok2 is not None and tok2 != tok


def test_expired_reservation_is_superseded_and_reaped_in_two_stages() -> None:
    mono = FakeClock(0.0)
    idx = Index(reservation_ttl_s=10.0, monotonic=mono)
    a, b = row((1,), tier="disk"), row((2,), tier="disk")
    ta = idx.reserve(a.info.key, "disk")
    tb = idx.reserve(b.info.key, "disk")
    assert ta is not None and tb is not None
    idx.mark_linked(b.info.key, tb, "/x/b.kvc")
    mono.advance(5)
    assert idx.reap_reservations() == (0, [])  # not expired yet
    mono.advance(6)
    dropped, orphans = idx.reap_reservations()
    assert dropped == 1
    assert [(o.key, o.tier, o.location) for o in orphans] == [(b.info.key, "disk", "/x/b.kvc")]
    assert not idx.check(a.info.key, ta) and not idx.publish(b.info.key, tb, b)
    # superseding: an expired (not yet reaped) holder loses to a new writer
    tc = idx.reserve(a.info.key, "disk")
    assert tc is not None
    mono.advance(11)
    td = idx.reserve(a.info.key, "disk")
    assert td is not None and not idx.check(a.info.key, tc) and idx.check(a.info.key, td)


def test_adopt_refuses_duplicates_and_bad_token_counts() -> None:
    idx = Index()
    r = row((5, 6))
    assert idx.adopt(r) and not idx.adopt(r)
    bad = StoredRow(row((7, 8)).info, (7,), None)
    assert not idx.adopt(bad)
    assert len(idx) == 1


def test_publish_after_concurrent_adopt_does_not_double_count() -> None:
    idx = Index()
    r = row((9,) * 4, 50, tier="disk")
    tok = idx.reserve(r.info.key, "disk")
    assert tok is not None
    assert idx.adopt(r)  # e.g. a rescan saw our linked file first
    assert idx.publish(r.info.key, tok, r)
    assert idx.usage() == {"disk": (50, 1)}


def test_a_check_in_of_a_removed_copy_leaves_the_next_copy_pinned() -> None:
    """Pins count per stored copy: the old reader's check-in must not release the pin of a
    reader of the copy published again under the same key."""
    idx = Index()
    r = row((1, 2), 10)
    key = r.info.key
    assert idx.adopt(r)
    old = idx.lease(key)
    assert old is not None
    removed = idx.remove(key)  # e.g. a failed read elsewhere, or ``delete``
    assert removed is not None
    assert not idx.adopt(r)  # its file is still being deleted
    idx.retired([removed])
    assert idx.adopt(r)  # published again
    new = idx.lease(key)
    assert new is not None and new[1] != old[1]
    idx.checkin(key, old[1])  # the first reader ends
    assert idx.refcount(key) == 1
    assert idx.evict(1 << 30) == []  # the second reader's copy is still pinned
    idx.checkin(key, new[1])
    assert idx.refcount(key) == 0 and len(idx.evict(1 << 30)) == 1


def test_a_row_adopted_again_after_a_failed_promotion_keeps_its_chunks_alive() -> None:
    """A promotion forgets the shared row (``remove_unpinned``: its chunks' bytes stay in the
    store) and adopts it again when the copy fails. Its chunks are then named and stored as
    before: a save reusing them neither waits for a delete nobody will do nor writes them
    again, and the tier's bytes still count them."""
    idx = Index()
    chunks = (b"a" * 32, b"b" * 32)
    r = row((1, 2, 3, 4), 10, tier="s3")
    r = StoredRow(r.info, r.tokens, r.location, chunks, (2, 2))
    assert idx.adopt(r)
    for chunk in chunks:
        idx.chunk_stored("s3", chunk, 100)
    before = idx.sizes()["s3"]
    removed = idx.remove_unpinned(r.info.key, "s3")
    assert removed is not None
    assert idx.adopt(removed)  # the copy to the local tier failed
    assert idx.sizes()["s3"] == before
    assert idx.pin_chunks("s3", chunks, timeout_s=0.0) == []  # nothing to write, no wait
    idx.unpin_chunks("s3", chunks)
    assert idx.take_freed_chunks() == []


def test_checkout_pins_touches_and_counts() -> None:
    clock = FakeClock(100.0)
    idx = Index(clock=clock)
    rows = [row((i,), 10, last_used=float(i)) for i in range(3)]
    for r in rows:
        idx.adopt(r)
    assert idx.eviction_order("ram") == [r.info.key for r in rows]
    s = idx.checkout(rows[0].info.key)
    assert s is not None and s.tokens == (0,) and idx.refcount(rows[0].info.key) == 1
    assert idx.eviction_order("ram")[-1] == rows[0].info.key
    info = idx.get(rows[0].info.key)
    assert info is not None and info.hits == 1 and info.last_used == 100.0
    victims = idx.evict(1000)
    assert [v.info.key for v in victims] == [rows[1].info.key, rows[2].info.key]
    assert len(idx) == 1 and idx.evict(1) == []  # the pinned one stays
    idx.checkin(rows[0].info.key)
    idx.checkin(rows[0].info.key)  # never negative
    assert idx.refcount(rows[0].info.key) == 0
    assert [r.info.key for r in idx.take_dirty_hits()] == [rows[0].info.key]
    assert idx.take_dirty_hits() == []


def test_eviction_merges_tiers_oldest_first_and_respects_scope() -> None:
    idx = Index()
    idx.adopt(row((1,), 10, tier="ram", last_used=5))
    idx.adopt(row((2,), 10, tier="disk", last_used=1))
    idx.adopt(row((3,), 10, tier="ram_file", last_used=3))
    idx.resort()
    order = [v.info.tier for v in idx.evict(25, ("ram", "ram_file", "disk"))]
    assert order == ["disk", "ram_file", "ram"]
    idx.adopt(row((4,), 10, tier="disk", last_used=0))
    idx.adopt(row((5,), 10, tier="ram", last_used=9))
    assert [v.info.tier for v in idx.evict(100, ("ram",))] == ["ram"]
    assert idx.usage()["disk"] == (10, 1)


def test_enforce_quota_and_expire() -> None:
    clock = FakeClock(1000.0)
    idx = Index(clock=clock, ttl_seconds=(10.0, 100.0, 1000.0))
    for i in range(5):
        idx.adopt(row((i,), 100, last_used=995.0 + i, ttl=TtlClass(i % 3)))
    assert [v.info.size for v in idx.enforce_quota("ram", 250)] == [100, 100, 100]
    assert idx.usage()["ram"] == (200, 2)
    clock.advance(20)  # rows 3 (SHORT) and 4 (LONG) remain; the short one expires
    expired = idx.expire()
    assert [v.tokens for v in expired] == [(3,)]


def test_longest_and_rows_filter_namespace() -> None:
    idx = Index()
    idx.adopt(row((1, 2, 3, 4), 40))
    idx.adopt(row((1, 2, 9), 5, ns=NS2))
    m = idx.longest(NS, (1, 2, 3, 7))
    assert m is not None and m.n_shared == 3 and m.row.size == 40
    assert idx.longest(NS2, (1, 2, 3)) is not None
    assert [r.namespace for r in idx.rows(NS2)] == [NS2]
    assert len(idx.rows()) == 2
    removed = idx.remove(cache_key(NS, (1, 2, 3, 4)))
    assert removed is not None and removed.tokens == (1, 2, 3, 4)
    assert idx.longest(NS, (1, 2, 3)) is None and idx.remove(removed.info.key) is None


def test_waiter_wakes_on_publish_and_returns_none_on_abandon() -> None:
    idx = Index()
    r = row((3, 3, 3))
    key = r.info.key
    assert idx.wait_for(key, 30.0) is None  # nothing in flight: no wait
    idx.mark_in_flight(key)
    tok = idx.reserve(key, "ram")
    assert tok is not None
    got: list[object] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        got.append(idx.wait_for(key, 30.0))

    t = threading.Thread(target=waiter)
    t.start()
    assert started.wait(5)
    assert idx.publish(key, tok, r)
    idx.clear_in_flight(key)
    t.join(10)
    assert got == [r.info]

    other = row((4, 4))
    idx.mark_in_flight(other.info.key)
    tok2 = idx.reserve(other.info.key, "ram")
    assert tok2 is not None
    got2: list[object] = []
    t2 = threading.Thread(target=lambda: got2.append(idx.wait_for(other.info.key, 30.0)))
    t2.start()
    idx.abandon(other.info.key, tok2)
    idx.clear_in_flight(other.info.key)
    t2.join(10)
    assert not t2.is_alive() and got2 == [None]


def test_wait_times_out() -> None:
    idx = Index()
    key = row((1,)).info.key
    idx.mark_in_flight(key)
    assert idx.wait_for(key, 0.02) is None
    idx.clear_all_in_flight()
    assert not idx.in_flight(key)


def test_lookups_run_while_a_writer_holds_the_lock() -> None:
    idx = Index()
    r = row((1, 2, 3))
    idx.adopt(r)
    out: list[object] = []
    with idx._lock:  # a writer mid-mutation
        t = threading.Thread(
            target=lambda: out.extend([idx.get(r.info.key), idx.longest(NS, (1, 2))])
        )
        t.start()
        t.join(5)
        assert not t.is_alive()
    assert out[0] == r.info and out[1] is not None
