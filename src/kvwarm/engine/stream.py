"""``CompletionStream``: text fragments of one request, consumed sync or async, ending in stats.

Invariant: every stream ends, exactly once, with either a ``Completion`` (also after
``cancel()``, with ``finish_reason == "cancelled"``) or the exception that failed it; read from
several threads (or tasks) at once, each fragment goes to one of them and every one sees the
end. The
fragments' logprobs, concatenated, are the completion's logprobs. A stream nobody holds any
more (a ``for`` loop left with ``break``, a stream dropped unread) cancels its request, so an
abandoned generation frees its slot instead of running to ``max_tokens``.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable, Iterator

from kvwarm.engine.request import Done, Event, Failed, Fragment, Prefilled, Request
from kvwarm.engine.types import Completion, TokenLogprob


class CompletionStream:
    def __init__(
        self,
        request: Request,
        on_cancel: Callable[[Request], None] | None = None,
        *,
        head: CompletionStream | None = None,
    ) -> None:
        """``head``: the stream of the first choice of an ``n > 1`` group this stream is a
        fork of; held so that it is abandoned (cancelling the whole group) only once every
        choice's stream is."""
        self._req = request
        self._on_cancel = on_cancel
        self._head = head
        self._owner: object = None  # the model, kept alive while its stream is (``keep``)
        # Found by review: a stream left half-read (``for piece in model.stream(...): break``)
        # went on generating to max_tokens, holding its slot. Only the request's event is set
        # here: a finalizer runs on whatever thread collects the stream, possibly the worker
        # inside its own lock, so it takes none (the worker drops a cancelled request at
        # admission and ends a running one between tokens).
        weakref.finalize(self, _abandoned, request).atexit = False
        self._completion: Completion | None = None
        self._error: BaseException | None = None
        self._prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    def keep(self, owner: object) -> CompletionStream:
        """Hold ``owner`` (the model) while this stream lives: a model, and the engine it
        holds, dropped by everyone else is closed when collected, and must not be while a
        stream of it is still read (``Engine``)."""
        self._owner = owner
        return self

    @property
    def prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """Set once the prompt is prefilled, when prompt logprobs were asked for."""
        return self._prompt_logprobs

    @property
    def request(self) -> Request:
        """The engine request behind this stream (its forks, for ``n > 1``)."""
        return self._req

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        return self._req.prompt_tokens

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
            item = self._route(self._req.channel.get())
            if item is not None and item.text:
                yield item.text
        self._raise_if_failed()

    async def __aiter__(self) -> AsyncIterator[str]:
        async for item in self.afragments():
            if item.text:
                yield item.text

    async def afragments(self) -> AsyncIterator[Fragment]:
        """Every fragment with its logprobs, including those whose text is still empty."""
        while not self.done:
            item = self._route(await self._req.channel.aget())
            if item is not None:
                yield item
        self._raise_if_failed()

    def result(self) -> Completion:
        """Consume what is left and return the completion (raises if the request failed)."""
        for _ in self:
            pass
        assert self._completion is not None
        return self._completion

    async def aresult(self) -> Completion:
        async for _ in self.afragments():
            pass
        assert self._completion is not None
        return self._completion

    def _route(self, item: Event) -> Fragment | None:
        if isinstance(item, Done | Failed):
            # The end is put back for any other reader of this stream (a thread waiting in
            # ``result()`` while another iterates, or an ``async for`` beside it): the worker
            # answers once, and a reader that did not take that answer waited for another
            # event for ever (found by review). A reader taking it again changes nothing.
            self._req.channel.put(item)
            if isinstance(item, Done):
                self._completion = item.completion
            else:
                self._error = item.error
            return None
        if isinstance(item, Prefilled):
            self._prompt_logprobs = item.prompt_logprobs
            return None
        return item

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def _abandoned(request: Request) -> None:
    """The stream of ``request`` was collected: nobody can read its reply any more."""
    if not request.answered:
        request.cancelled.set()
