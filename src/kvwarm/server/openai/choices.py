"""The ``n`` choices of one request: ``n`` engine streams sharing one prompt prefill, watched
for a disconnect once, consumed together or interleaved as their fragments arrive.

Invariants: a disconnect cancels every choice at once; leaving a ``Choices`` by any path
cancels the choices that have not finished (each ``Generation`` collects and logs its own);
usage counts the prompt once (the engine prefilled it once) and the completions of all choices
(with ``best_of``, of every candidate, returned or not).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from starlette.requests import Request

from kvwarm.engine.request import Fragment
from kvwarm.engine.types import Completion, CompletionStats
from kvwarm.server.generate import Generation, start_stream, wait_disconnect

if TYPE_CHECKING:
    from kvwarm.server.served import ServedStream
    from kvwarm.server.state import ServerState

# (choice index, fragment), or (index, None) once that choice has ended.
Item = tuple[int, Fragment | None]


class Choices:
    """``async with``: the choices of one request, bound to it."""

    def __init__(
        self,
        request: Request,
        streams: Sequence[ServedStream],
        endpoint: str,
        model_id: str,
        state: ServerState,
        *,
        user: str | None = None,
    ) -> None:
        self._request = request
        self.gens = [
            Generation(request, s, endpoint, model_id, state, watch=False, user=user)
            for s in streams
        ]
        self.disconnected = False
        self._watcher: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        request: Request,
        submit: Callable[[], Sequence[ServedStream]],
        endpoint: str,
        model_id: str,
        state: ServerState,
        *,
        user: str | None = None,
        names: Mapping[str, str] | None = None,
    ) -> Choices:
        """Queue the choices off the event loop (``start_stream``'s cancellation rule and
        ``names``)."""
        streams = await start_stream(submit, names)
        return cls(request, streams, endpoint, model_id, state, user=user)

    async def __aenter__(self) -> Choices:
        self._watcher = asyncio.create_task(self._watch())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def _watch(self) -> None:
        await wait_disconnect(self._request)
        self.disconnected = True
        for gen in self.gens:
            gen.disconnected = True
            gen.stream.cancel()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        for gen in self.gens:
            gen.close()

    async def results(self) -> list[Completion]:
        return [await gen.result() for gen in self.gens]

    async def open_streaming(self) -> None:
        """Watch and prime every choice, so errors before the first fragment raise here."""
        await self.__aenter__()
        try:
            for gen in self.gens:
                await gen.prime()
        except BaseException:
            self.close()
            raise

    async def merged(self) -> AsyncIterator[Item]:
        """Every choice's fragments as they arrive, and ``(index, None)`` as each ends."""
        queue: asyncio.Queue[Item | BaseException] = asyncio.Queue()

        async def pump(index: int, gen: Generation) -> None:
            try:
                async for fragment in gen.fragments():
                    queue.put_nowait((index, fragment))
                queue.put_nowait((index, None))
            except Exception as exc:  # re-raised in the consumer, as one stream would
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.gens)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item[1] is None:
                    remaining -= 1
                yield item
        finally:
            for task in tasks:
                task.cancel()


def mean_logprob(done: Completion) -> float:
    """A candidate's score for ``best_of``: the mean logprob of its reply's tokens (those its
    ``logprobs`` hold: no end-of-generation token, no stop sequence's); -inf for an empty reply,
    which has no token to score."""
    if not done.logprobs:
        return -math.inf
    return math.fsum(t.logprob for t in done.logprobs) / len(done.logprobs)


def best_of(results: Sequence[Completion], n: int) -> list[Completion]:
    """OpenAI's ``best_of``: the ``n`` candidates with the highest mean logprob per token,
    best first (a tie keeps the candidates' order). Each needs its logprobs (``logprobs=0``)."""
    ranked = sorted(range(len(results)), key=lambda i: (-mean_logprob(results[i]), i))
    return [results[i] for i in ranked[:n]]


def group_stats(all_stats: Sequence[CompletionStats]) -> CompletionStats:
    """One usage for the choices of one prompt: its tokens once (it was prefilled once), the
    first choice's cache figures and timings, every choice's completion tokens and drafted
    and accepted tokens (found by review: ``draft_n`` was the first choice's alone, where
    ``/metrics`` counts every choice's)."""
    first = all_stats[0]
    return dataclasses.replace(
        first,
        completion_tokens=sum(s.completion_tokens for s in all_stats),
        drafted_tokens=sum(s.drafted_tokens for s in all_stats),
        accepted_tokens=sum(s.accepted_tokens for s in all_stats),
    )
