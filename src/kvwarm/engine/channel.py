"""A one-producer event channel from a model's worker thread to a sync or async consumer.

The worker never blocks on a consumer: ``put`` appends and wakes whoever waits (a thread on the
condition, or an asyncio future through ``call_soon_threadsafe``). No executor threads are
used for async waiting, so thousands of idle streams cost nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Channel(Generic[T]):
    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def put(self, item: T) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            # A closed consumer loop raises RuntimeError: nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_wake, fut)

    def get(self, timeout: float | None = None) -> T:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._items), timeout):
                raise TimeoutError("no event within timeout")
            return self._items.popleft()

    async def aget(self) -> T:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            await fut


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
