"""A stream read by several threads at once (stub backend; found by the library and CLI
review): the reader that did not take the worker's one answer waited for ever."""

from __future__ import annotations

import threading

from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.engine.stream import CompletionStream
from kvwarm.engine.types import GenerationOptions

SHORT = GenerationOptions(max_tokens=3, temperature=0.0, ignore_eos=True)


def _entering_get(stream: CompletionStream) -> threading.Semaphore:
    """Released each time a reader of ``stream`` is about to wait on its channel."""
    channel = stream.request.channel
    real_get = channel.get
    entered = threading.Semaphore(0)

    def get(timeout: float | None = None) -> object:
        entered.release()
        return real_get(timeout)

    channel.get = get  # type: ignore[method-assign]
    return entered


def test_every_reader_of_a_stream_sees_its_end() -> None:
    """One thread iterates a stream while another waits in ``result()``: the worker answers
    once, and the reader that did not take that answer waited for another event for ever."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        stream = model.stream("two readers", SHORT)
        entered = _entering_get(stream)
        pieces: list[str] = []
        results: list[str] = []
        iterating = threading.Thread(target=lambda: pieces.extend(stream), daemon=True)
        waiting = threading.Thread(
            target=lambda: results.append(stream.result().stats.finish_reason), daemon=True
        )
        iterating.start()
        waiting.start()
        # Both are past the stream's "done?" check and waiting for an event before any comes.
        assert entered.acquire(timeout=60) and entered.acquire(timeout=60)
        backend.gate.set()
        iterating.join(60)
        waiting.join(60)
        assert not iterating.is_alive() and not waiting.is_alive()
        assert results == ["length"]
        completion = stream.result()  # a third read, after the end, returns it again
        assert "".join(pieces) in completion.text
    finally:
        eng.close()
