"""``CompletionStream``: text fragments of one request, consumed sync or async, ending in stats.

Invariant: every stream ends, exactly once, with either a ``Completion`` (also after
``cancel()``, with ``finish_reason == "cancelled"``) or the exception that failed it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

from kvwarm.engine.request import Done, Failed, Request
from kvwarm.engine.types import Completion


class CompletionStream:
    def __init__(
        self, request: Request, on_cancel: Callable[[Request], None] | None = None
    ) -> None:
        self._req = request
        self._on_cancel = on_cancel
        self._completion: Completion | None = None
        self._error: BaseException | None = None

    @property
    def completion(self) -> Completion | None:
        """The final result once the stream has ended, else None."""
        return self._completion

    @property
    def done(self) -> bool:
        return self._completion is not None or self._error is not None

    def cancel(self) -> None:
        """Ask the worker to stop this request between tokens. Idempotent."""
        if self._on_cancel is not None:
            self._on_cancel(self._req)
        else:
            self._req.cancelled.set()

    def __iter__(self) -> Iterator[str]:
        while not self.done:
            item = self._req.channel.get()
            text = self._route(item)
            if text:
                yield text
        self._raise_if_failed()

    async def __aiter__(self) -> AsyncIterator[str]:
        while not self.done:
            item = await self._req.channel.aget()
            text = self._route(item)
            if text:
                yield text
        self._raise_if_failed()

    def result(self) -> Completion:
        """Consume what is left and return the completion (raises if the request failed)."""
        for _ in self:
            pass
        assert self._completion is not None
        return self._completion

    async def aresult(self) -> Completion:
        async for _ in self:
            pass
        assert self._completion is not None
        return self._completion

    def _route(self, item: str | Done | Failed) -> str | None:
        if isinstance(item, Done):
            self._completion = item.completion
            return None
        if isinstance(item, Failed):
            self._error = item.error
            return None
        return item

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
