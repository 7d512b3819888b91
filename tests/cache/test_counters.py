"""Counters: every documented name present, increments exact under threads."""

from __future__ import annotations

import threading

import pytest

from kvwarm.cache.counters import BASE_COUNTERS, LATENCY_NAMES, Counters
from kvwarm.cache.types import SaveReason


def test_snapshot_has_every_name_at_zero() -> None:
    snap = Counters().snapshot()
    for name in BASE_COUNTERS:
        assert snap[name] == 0.0
    for name in LATENCY_NAMES:
        assert snap[f"latency_{name}_count"] == 0.0
        assert snap[f"latency_{name}_seconds"] == 0.0
    assert "saves_finish" in snap and "saves_prewarm" in snap


def test_counts_and_latencies() -> None:
    c = Counters()
    c.incr("misses")
    c.incr("evicted_bytes", 1000)
    c.record_save(SaveReason.SHUTDOWN)
    c.record_latency("pack", 0.5)
    c.record_latency("pack", 0.25)
    c.record_latency("custom", 1.0)
    snap = c.snapshot()
    assert snap["misses"] == 1 and snap["evicted_bytes"] == 1000
    assert snap["saves_shutdown"] == 1
    assert snap["latency_pack_count"] == 2 and snap["latency_pack_seconds"] == 0.75
    assert snap["latency_custom_count"] == 1
    assert c.get("misses") == 1
    with pytest.raises(ValueError):
        c.record_latency("bad name", 1.0)


def test_thread_safety() -> None:
    c = Counters()
    start = threading.Barrier(4)

    def worker() -> None:
        start.wait()
        for _ in range(10_000):
            c.incr("hits_exact")
            c.record_latency("lookup", 0.0)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = c.snapshot()
    assert snap["hits_exact"] == 40_000 and snap["latency_lookup_count"] == 40_000
