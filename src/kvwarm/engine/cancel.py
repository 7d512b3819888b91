"""Ending a blocking model call (a rerank, an embedding) early: its deadline, or its caller's
cancellation from another thread.

``timeout_s`` (the server's ``request_timeout_s``) bounds the call from its start: past it
what it has not had answered is cancelled and ``RequestTimeoutError`` raised.

The server hands one to ``Model.rerank`` / ``Model.embed`` and cancels it when the client goes
away (``server/generate.py``, ``run_cancellable``), as a generation's stream is cancelled; the
call then cancels what it has queued and not yet had answered, and raises
``RequestCancelledError``.

Invariants: ``cancel`` runs each registered callback exactly once, on the cancelling thread,
outside the lock (a callback may take the worker's lock); a callback registered after the
cancellation runs at once, on the registering thread; a callback taken back before the
cancellation never runs.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from kvwarm.errors import InvalidRequestError

__all__ = ["Cancellation", "check_cancel", "check_timeout", "check_wait"]


def check_timeout(timeout_s: object) -> None:
    """``InvalidRequestError`` unless ``timeout_s`` is None or a finite number > 0."""
    _check_seconds(timeout_s, zero=False)


def check_wait(timeout_s: object) -> None:
    """``InvalidRequestError`` unless ``timeout_s`` is None or a finite number >= 0: how long a
    close or an unload waits for its shutdown saves (0: not at all). Found by review: a string
    was a TypeError with the model half unloaded (its worker stopping, its native state never
    freed), and NaN or a negative bound was taken for no wait, warning that the worker did
    not stop "within nan s"."""
    _check_seconds(timeout_s, zero=True)


def _check_seconds(timeout_s: object, *, zero: bool) -> None:
    """``InvalidRequestError`` unless ``timeout_s`` is None or a finite number of seconds
    above 0 (or 0 itself where ``zero``)."""
    if timeout_s is None:
        return
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s < 0
        or (timeout_s == 0 and not zero)
    ):
        bound = ">= 0" if zero else "> 0"
        raise InvalidRequestError(
            f"timeout_s must be a finite number of seconds {bound} (or None), got {timeout_s!r}",
            param="timeout_s",
        )


def check_cancel(cancel: object) -> Cancellation | None:
    """``cancel``, which must be None or a ``Cancellation`` (``InvalidRequestError``)."""
    if cancel is not None and not isinstance(cancel, Cancellation):
        raise InvalidRequestError(
            f"cancel must be a Cancellation (or None), not {type(cancel).__name__}",
            param="cancel",
        )
    return cancel


class Cancellation:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._next = 0

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Cancel: run every registered callback (once; later calls do nothing)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Run ``callback`` when cancelled (at once if already); returns what takes it back."""
        with self._lock:
            if not self._cancelled:
                key = self._next
                self._next += 1
                self._callbacks[key] = callback

                def forget() -> None:
                    with self._lock:
                        self._callbacks.pop(key, None)

                return forget
        callback()
        return lambda: None
