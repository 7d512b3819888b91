"""A handler cancelled while its request is being submitted must not leave it running."""

from __future__ import annotations

import asyncio
import threading
from typing import cast

import pytest

from kvwarm.engine.stream import CompletionStream
from kvwarm.server.generate import start_stream


class FakeStream:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


async def test_a_stream_submitted_after_the_handler_was_cancelled_is_cancelled() -> None:
    release = threading.Event()
    entered = threading.Event()
    made = FakeStream()

    def submit() -> CompletionStream:
        entered.set()
        release.wait(10)
        return cast(CompletionStream, made)

    task = asyncio.ensure_future(start_stream(submit))
    await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not made.cancelled.is_set()  # nothing existed to cancel yet
    release.set()  # the submission completes after its handler is gone
    assert await asyncio.to_thread(made.cancelled.wait, 10)


async def test_a_normal_submission_is_returned_untouched() -> None:
    made = FakeStream()
    got = await start_stream(lambda: cast(CompletionStream, made))
    assert got is made
    assert not made.cancelled.is_set()
