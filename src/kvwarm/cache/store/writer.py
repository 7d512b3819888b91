"""A bounded pool of writer threads with a bounded queue.

Invariants:
- ``submit`` never blocks: a full queue (or a closed pool) returns False at once and the job is
  not run; the caller counts it as ``saves_dropped``. Decoding never waits on disk.
- A job that raises is logged and its thread goes on serving: a failed save releases its slot.
- ``submit_sync`` (evict/shutdown saves) runs its job on a thread of its own, so a sync save is
  never dropped because async saves filled the queue, never waits behind them, and the caller's
  wait stays bounded by ``timeout_s`` even if the file system hangs. On timeout the job keeps
  running and may still publish; only the caller stops waiting.
- ``pending`` counts queued plus running jobs (async and sync); ``drain`` waits for zero.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from kvwarm.errors import ConfigError

__all__ = ["Job", "WriterPool"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Job = Callable[[], object]


class WriterPool:
    def __init__(self, threads: int, queue_size: int, *, name: str = "kvwarm-writer") -> None:
        if threads < 1 or queue_size < 1:
            raise ConfigError("writer pool needs threads >= 1 and queue_size >= 1")
        self._queue_size = queue_size
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._closed = False
        self._name = name
        self._sync_serial = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (job not run) if the queue is full or the pool is closed."""
        with self._cond:
            if self._closed or len(self._jobs) >= self._queue_size:
                return False
            self._jobs.append(job)
            self._pending += 1
            self._cond.notify_all()
            return True

    def submit_sync(self, job: Callable[[], T], timeout_s: float) -> T:
        """Run ``job`` now on its own thread and return its result (or raise its exception).
        ``TimeoutError`` if it has not finished within ``timeout_s``. Accepted even after
        ``close``: a shutdown save must not be lost to the order of teardown calls."""
        done = threading.Event()
        outcome: list[tuple[bool, object]] = []

        def run() -> None:
            try:
                outcome.append((True, job()))
            except BaseException as exc:  # handed to the waiting caller, not swallowed
                outcome.append((False, exc))
            finally:
                self._finish()
                done.set()

        with self._cond:
            self._pending += 1
            self._sync_serial += 1
            serial = self._sync_serial
        threading.Thread(target=run, name=f"{self._name}-sync-{serial}", daemon=True).start()
        if not done.wait(timeout_s):
            raise TimeoutError(f"sync save still running after {timeout_s:.3f}s")
        ok, value = outcome[0]
        if ok:
            return value  # type: ignore[return-value]  # job's own return value, a T
        assert isinstance(value, BaseException)
        raise value

    def drain(self, timeout_s: float) -> bool:
        """Wait until no job is queued or running; True if that happened in time."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Refuse new async jobs, let queued ones finish (bounded), stop the threads.
        True if everything finished in time; otherwise the jobs still queued are dropped
        (logged) and the daemon threads exit after their current job. Idempotent."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            drained = self._cond.wait_for(lambda: self._pending == 0, max(0.0, timeout_s))
            if not drained and self._jobs:
                log.warning("%s: dropping %d queued saves at close", self._name, len(self._jobs))
                self._pending -= len(self._jobs)
                self._jobs.clear()
                self._cond.notify_all()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return drained

    def _finish(self) -> None:
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return  # closed and nothing left
                job = self._jobs.popleft()
            try:
                job()
            except BaseException:
                log.exception("%s: a save job failed", self._name)
            finally:
                self._finish()
