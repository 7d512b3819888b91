"""Writer pool: never blocks on submit, survives failing jobs, sync path, drain and close."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest

from kvwarm.cache.store.writer import WriterPool
from kvwarm.errors import ConfigError

WAIT = 10.0  # generous bound for events; tests never sleep


class Gate:
    """A job that signals it started, then blocks until opened."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        assert self.release.wait(WAIT)
        return "gate"


@pytest.fixture
def pool() -> Iterator[WriterPool]:
    p = WriterPool(threads=1, queue_size=2)
    yield p
    p.close(WAIT)


def _recorder(log: list[int], i: int) -> Callable[[], None]:
    return lambda: log.append(i)


def test_jobs_run_and_drain(pool: WriterPool) -> None:
    ran: list[int] = []
    for i in range(2):
        assert pool.submit(_recorder(ran, i))
    assert pool.drain(WAIT)
    assert sorted(ran) == [0, 1] and pool.pending == 0


def test_full_queue_drops_without_blocking(pool: WriterPool) -> None:
    gate, ran = Gate(), []
    assert pool.submit(gate)
    assert gate.started.wait(WAIT)  # the only thread is busy now
    assert pool.submit(_recorder(ran, 1))
    assert pool.submit(_recorder(ran, 2))
    assert not pool.submit(_recorder(ran, 3))  # queue of 2 is full: dropped at once
    assert pool.pending == 3
    assert not pool.drain(0.01)
    gate.release.set()
    assert pool.drain(WAIT)
    assert ran == [1, 2]


def test_failing_job_is_logged_and_thread_survives(
    pool: WriterPool, caplog: pytest.LogCaptureFixture
) -> None:
    def boom() -> None:
        raise OSError("disk on fire")

    ran: list[int] = []
    with caplog.at_level(logging.ERROR, logger="kvwarm.cache.store.writer"):
        assert pool.submit(boom)
        assert pool.submit(_recorder(ran, 1))
        assert pool.drain(WAIT)
    assert ran == [1]
    assert any("disk on fire" in (r.exc_text or "") for r in caplog.records)


def test_sync_job_runs_even_when_queue_full(pool: WriterPool) -> None:
    gate = Gate()
    assert pool.submit(gate)
    assert gate.started.wait(WAIT)
    assert pool.submit(lambda: None) and pool.submit(lambda: None)
    assert not pool.submit(lambda: None)
    assert pool.submit_sync(lambda: 42, WAIT) == 42
    with pytest.raises(ValueError, match="nope"):
        pool.submit_sync(lambda: (_ for _ in ()).throw(ValueError("nope")), WAIT)
    gate.release.set()
    assert pool.drain(WAIT)


def test_sync_timeout_bounds_the_wait(pool: WriterPool) -> None:
    gate = Gate()
    with pytest.raises(TimeoutError):
        pool.submit_sync(gate, 0.05)
    assert gate.started.is_set()
    assert pool.pending == 1  # still running; counted until it ends
    gate.release.set()
    assert pool.drain(WAIT)


def test_close_drains_then_refuses(pool: WriterPool) -> None:
    ran: list[int] = []
    assert pool.submit(_recorder(ran, 1))
    assert pool.close(WAIT)
    assert ran == [1]
    assert pool.closed
    assert not pool.submit(_recorder(ran, 2))
    assert pool.close(WAIT)  # idempotent
    assert not any(t.is_alive() for t in pool._threads)
    assert pool.submit_sync(lambda: "late shutdown save", WAIT) == "late shutdown save"


def test_close_timeout_drops_queued_jobs(pool: WriterPool) -> None:
    gate, ran = Gate(), []
    assert pool.submit(gate)
    assert gate.started.wait(WAIT)
    assert pool.submit(_recorder(ran, 1))
    assert not pool.close(0.01)
    gate.release.set()
    assert pool.drain(WAIT)
    for t in pool._threads:
        t.join(WAIT)
        assert not t.is_alive()
    assert ran == []


def test_parallel_threads_run_concurrently() -> None:
    p = WriterPool(threads=2, queue_size=4)
    try:
        barrier = threading.Barrier(2, timeout=WAIT)
        assert p.submit(barrier.wait) and p.submit(barrier.wait)  # deadlocks unless parallel
        assert p.drain(WAIT)
    finally:
        p.close(WAIT)


@pytest.mark.parametrize(("threads", "size"), [(0, 1), (1, 0)])
def test_bad_config(threads: int, size: int) -> None:
    with pytest.raises(ConfigError):
        WriterPool(threads, size)
