"""Saves under way, and the threads parked until one of them ends.

A key is *in flight* from the moment ``Cache.save`` accepts it until its writer job ends
(published, failed or dropped); ``lookup_exact_or_wait`` parks on it instead of missing.

Invariants:

- Marks are counted: two saves of one key in flight need two clears.
- Every change that can end a wait (a row published or adopted, a reservation taken or reaped,
  an in-flight mark cleared) calls ``wake`` under the owner's lock, and a waiter re-checks its
  condition under that same lock, so no wake-up is lost between the check and the wait.
- Not locked itself: the condition variable is built on the owner's (``Index``'s) lock, the one
  lock every index room lives under. ``__contains__`` alone is a lock-free read (a single dict
  lookup, atomic under the GIL).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["InFlight"]

T = TypeVar("T")


class InFlight:
    __slots__ = ("_changed", "_marks")

    def __init__(self, lock: threading.Lock) -> None:
        self._changed = threading.Condition(lock)
        self._marks: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return bool(self._marks.get(key))

    def mark(self, key: bytes) -> None:
        self._marks[key] = self._marks.get(key, 0) + 1

    def clear(self, key: bytes) -> None:
        n = self._marks.get(key, 0) - 1
        if n > 0:
            self._marks[key] = n
        else:
            self._marks.pop(key, None)
        self.wake()

    def clear_all(self) -> None:
        self._marks.clear()
        self.wake()

    def wake(self) -> None:
        self._changed.notify_all()

    def wait(
        self, found: Callable[[], T | None], pending: Callable[[], bool], timeout_s: float
    ) -> T | None:
        """``found()`` once it is not None; None as soon as nothing is ``pending()`` any more
        or ``timeout_s`` passed. Call with the owner's lock held."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            value = found()
            if value is not None:
                return value
            if not pending():
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._changed.wait(remaining)


class Holds:
    """Keys held in flight by a caller that has not handed their save over yet (``Cache.hold``):
    ``Cache.flush`` waits for them before draining the writer, so a save announced to a client
    before it was packed is still one that ``flush`` waits for."""

    __slots__ = ("_changed", "_n")

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._n = 0

    def take(self) -> None:
        with self._changed:
            self._n += 1

    def give(self) -> None:
        with self._changed:
            self._n -= 1
            if self._n <= 0:
                self._changed.notify_all()

    def wait_none(self, timeout_s: float) -> bool:
        """True once no key is held (False if ``timeout_s`` passed first)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._n <= 0, timeout_s)
