"""The sweeper's loop: its steps and its failures (the loop runs in the test's thread)."""

from __future__ import annotations

import logging

import pytest

from kvwarm.cache import Cache, CacheConfig, TierConfig


class _Passes:
    """A stop event for ``sweep_loop`` that lets ``n`` passes run, then stops it: the loop runs
    in the test's thread, with no waiting."""

    def __init__(self, n: int) -> None:
        self.left = n

    def wait(self, timeout: float | None = None) -> bool:
        self.left -= 1
        return self.left < 0


def test_a_failing_sweep_step_skips_no_other_and_logs_one_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: the sweeper's pass ran its steps in one ``try``, so a step that kept
    failing (the TTL sweep, say) skipped the hit persistence, the rescans and the chunk sweep
    of shared /dev/shm directories on every pass for as long as it failed (their chunks were
    never reclaimed), and logged its traceback every interval. Each step runs now; the pass
    still raises the failure (``Cache.sweep``), and the loop logs its traceback once while it
    keeps failing, and says when it works again."""
    ran: list[str] = []
    failures = [3]

    def gc() -> None:
        ran.append("gc")
        if failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("ttl sweep broke")

    with Cache(CacheConfig(tiers=(TierConfig("ram", 1 << 20),)), background=False) as c:
        upkeep = c._upkeep
        upkeep.gc = gc  # type: ignore[method-assign, assignment]
        upkeep.persist_hits = lambda: ran.append("hits")  # type: ignore[method-assign]
        upkeep.rescan = lambda: ran.append("rescan") or 0  # type: ignore[method-assign]
        upkeep._sweeper.sweep_local = lambda *a, **k: ran.append("chunks")  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="ttl sweep broke"):
            c.sweep()
        assert ran == ["gc", "hits", "rescan", "chunks"]
        ran.clear()
        caplog.set_level(logging.DEBUG, logger="kvwarm.cache.upkeep.scans")
        upkeep._stop = _Passes(4)  # type: ignore[assignment]
        upkeep.sweep_loop()  # two passes fail, two work
        assert ran == ["gc", "hits", "rescan", "chunks"] * 4
    failed = [r for r in caplog.records if "sweep failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.ERROR, logging.DEBUG]
    assert failed[0].exc_info is not None
    assert sum("succeed again" in r.getMessage() for r in caplog.records) == 1
