"""Lifetime of a handle whose resource must be freed exactly once, never while in use.

Invariants:

- ``free`` runs at most once, and only after ``close()`` was called *and* every dependent that
  ``acquire()``-d the handle has ``release()``-d it (a model outlives its contexts, samplers and
  adapters; an adapter outlives the contexts it is attached to).
- Every operation on the resource runs inside ``using()``, which holds the handle's lock and
  raises ``HandleClosedError`` once ``close()`` has begun; a close from another thread waits for
  the call in flight instead of freeing memory under it.
- ``close()`` is idempotent.

The pattern is the "two-resource lifetime" of the erllama NIF: the child keeps a reference on
the parent, the parent's explicit close only flips a flag when children remain.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from kvwarm.errors import HandleClosedError

log = logging.getLogger(__name__)


class Lifetime:
    """Lock, closed flag and dependent count of one native (or fake) resource."""

    __slots__ = ("_closed", "_deps", "_free", "_freed", "_guard", "_lock", "kind")

    def __init__(self, kind: str, free: Callable[[], None]) -> None:
        self.kind = kind
        self._free = free
        # Re-entrant: a method running under ``using()`` may call another public method.
        self._lock = threading.RLock()
        self._closed = False
        self._freed = False
        self._deps = 0
        self._guard = _Using(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def freed(self) -> bool:
        return self._freed

    @property
    def dependents(self) -> int:
        return self._deps

    def check(self) -> None:
        if self._closed:
            raise HandleClosedError(f"{self.kind} is closed")

    def using(self) -> _Using:
        """``with lifetime.using(): ...``: hold the lock, and raise ``HandleClosedError``
        if the handle is closed. One guard object per lifetime, re-entered as the lock is
        (it keeps no state of its own): a decode step enters several, and a generator-based
        context manager cost ~1 us each where this costs a third of that."""
        return self._guard

    def acquire(self) -> None:
        """Register a dependent; fails if the handle is already closed."""
        with self._lock:
            self.check()
            self._deps += 1

    def release(self) -> None:
        """Drop a dependent; frees the resource if it was the last one and close() happened."""
        with self._lock:
            if self._deps <= 0:
                # A bug in the caller, but freeing twice would be worse than logging.
                log.error("%s: release() without a matching acquire()", self.kind)
                return
            self._deps -= 1
            self._maybe_free()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._deps:
                log.debug("%s: close deferred until %d dependents close", self.kind, self._deps)
            self._maybe_free()

    def _maybe_free(self) -> None:
        if self._closed and self._deps == 0 and not self._freed:
            self._freed = True
            self._free()


class _Using:
    """``Lifetime.using()``'s context manager: the lock, then the closed check."""

    __slots__ = ("_life", "_lock")

    def __init__(self, life: Lifetime) -> None:
        self._life = life
        self._lock = life._lock

    def __enter__(self) -> None:
        self._lock.acquire()
        if self._life._closed:
            self._lock.release()
            raise HandleClosedError(f"{self._life.kind} is closed")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()
