"""``chunking.Freshness``: when this process last wrote or touched each chunk of a tier
others sweep. Its table stays bounded over a long-running server without rebuilding itself
at every note."""

from __future__ import annotations

import threading

import pytest

from kvwarm.cache.store import chunking
from kvwarm.cache.store.chunking import REFRESH_AFTER_S, Freshness


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(chunking.time, "monotonic", c)
    monkeypatch.setattr(Freshness, "PRUNE_AT", 64)
    return c


def test_notes_past_the_prune_bound_do_not_rebuild_the_table_each_time(clock: _Clock) -> None:
    """More chunks noted within REFRESH_AFTER_S than PRUNE_AT (a busy server): nothing is
    stale to prune, and the merged code rebuilt the whole table at every note past the
    bound (quadratic: 65,536 entries copied per chunk written)."""
    fresh = Freshness()
    rebuilds, table = 0, fresh._at
    for i in range(64 * 10):
        fresh.note("s3", i.to_bytes(8, "little"))
        if fresh._at is not table:
            rebuilds, table = rebuilds + 1, fresh._at
    assert rebuilds <= 5  # doubling: 64 -> 128 -> 256 -> 512
    assert all(fresh.recent("s3", i.to_bytes(8, "little")) for i in range(640))


def test_stale_entries_are_pruned_so_the_table_stays_bounded(clock: _Clock) -> None:
    """Over a long run the table holds about what was noted within REFRESH_AFTER_S, not
    every chunk ever noted."""
    fresh = Freshness()
    for i in range(10_000):
        clock.now += REFRESH_AFTER_S / 100  # 100 notes per refresh period
        fresh.note("s3", i.to_bytes(8, "little"))
        assert len(fresh._at) <= 2 * 100 + 1
    assert fresh.recent("s3", (9_999).to_bytes(8, "little"))
    assert not fresh.recent("s3", (0).to_bytes(8, "little"))


class _RemoteTouches:
    """A tier whose touches wait for ``together`` of them to be in flight at once (a barrier
    with a timeout: touches made one after another break it), and report which chunks are
    there."""

    def __init__(self, together: int, gone: set[bytes]) -> None:
        self._barrier = threading.Barrier(together, timeout=10.0)
        self._gone = gone
        self.touched: list[bytes] = []
        self._lock = threading.Lock()

    def touch_chunk(self, key: bytes) -> bool:
        self._barrier.wait()
        with self._lock:
            self.touched.append(key)
        return key not in self._gone


def test_many_touches_due_at_one_save_go_out_together() -> None:
    """A long conversation saved after a pause has a touch due for each of its chunks; on s3
    each is a CopyObject round trip, and made one after another they held the writer thread
    for seconds (found by review). They go out together; chunks found gone are reported and
    the others noted fresh."""
    keys = [bytes([i]) * 32 for i in range(4)]
    tier = _RemoteTouches(together=4, gone={keys[2]})
    fresh = Freshness()
    lost = chunking._refresh(tier, "s3", [*keys, keys[0]], fresh)  # type: ignore[arg-type]
    assert lost == {keys[2]}
    assert sorted(tier.touched) == sorted(keys)  # each once, though named twice
    assert [fresh.recent("s3", k) for k in keys] == [True, True, False, True]
    assert chunking._refresh(tier, "s3", [keys[0], keys[1]], fresh) == set()  # none due
