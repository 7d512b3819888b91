"""``Engine.close()`` and ``Model.unload()`` called from several threads at once, from inside
a callback, and while a stream is read (stub backend; found by review): a second close
returned at once while the first was still unloading, or unloaded the same model again and
closed the cache under the first one's shutdown saves."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import EngineClosedError

LONG = GenerationOptions(max_tokens=200, temperature=0.0, stop=(), ignore_eos=True)


class _Contended:
    """A lock that says (``blocked``) when a caller had to wait for it."""

    def __init__(self, inner: Any, blocked: threading.Event) -> None:
        self._inner = inner
        self._blocked = blocked

    def __enter__(self) -> None:
        if not self._inner.acquire(blocking=False):
            self._blocked.set()
            self._inner.acquire()

    def __exit__(self, *exc: object) -> None:
        self._inner.release()


def _hold_first_unload(target: Any) -> tuple[threading.Event, threading.Event]:
    """``target.unload``'s first call waits for ``release`` (after setting ``entered``);
    later calls and the held one then run the real unload."""
    entered, release = threading.Event(), threading.Event()
    real: Callable[..., None] = target.unload
    calls = [0]

    def unload(timeout_s: float | None = None) -> None:
        calls[0] += 1
        if calls[0] == 1:
            entered.set()
            assert release.wait(60)
        real(timeout_s=timeout_s)

    target.unload = unload
    return entered, release


def test_a_second_close_waits_for_the_first_and_the_cache_closes_once_after_the_models() -> None:
    eng = make_engine()
    model = eng.load_model(config=stub_config())
    entered, release = _hold_first_unload(model)
    states_at_cache_close: list[str] = []
    real_cache_close = eng.cache.close

    def cache_close(timeout_s: float = 30.0) -> None:
        states_at_cache_close.append(model.status().state)
        real_cache_close(timeout_s)

    eng.cache.close = cache_close  # type: ignore[method-assign]
    progress = threading.Event()  # the second close is blocked, or has returned
    eng._close_lock = _Contended(eng._close_lock, progress)  # type: ignore[assignment]
    seen_by_second: list[str] = []

    def second() -> None:
        eng.close()
        seen_by_second.append(model.status().state)
        progress.set()

    first = threading.Thread(target=eng.close)
    first.start()
    assert entered.wait(60)  # the first close is inside the model's unload
    other = threading.Thread(target=second)
    other.start()
    assert progress.wait(60)
    release.set()
    first.join(60)
    other.join(60)
    assert not first.is_alive() and not other.is_alive()
    assert seen_by_second == ["closed"], "the second close returned before the first ended"
    assert states_at_cache_close == ["closed"]


def test_two_threads_unloading_one_model_both_return_once_it_is_closed() -> None:
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config())
        barrier = threading.Barrier(2)
        seen: list[str] = []

        def unload() -> None:
            barrier.wait(60)
            model.unload()
            seen.append(model.status().state)

        threads = [threading.Thread(target=unload) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert seen == ["closed", "closed"]
        assert eng.list_models() == []
    finally:
        eng.close()


def test_close_from_the_load_progress_callback() -> None:
    eng = make_engine()

    def progress(_fraction: float) -> bool:
        eng.close()
        eng.close()  # and again: idempotent from inside the callback too
        return True

    with pytest.raises(EngineClosedError):
        eng.load_model(config=stub_config(), progress=progress)
    assert eng.list_models() == []
    eng.close()


def test_close_while_a_stream_is_read() -> None:
    """The reader's stream ends, cancelled, the close returns, and the model refuses more."""
    eng = make_engine()
    backend = GatedBackend()
    model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
    stream = model.stream("Tell me a long story", LONG)
    backend.gate.step(2)  # the prefill and a token; the worker waits at the gate
    pieces = iter(stream)
    assert next(pieces)
    stopping = threading.Event()
    worker = model._worker
    real_stop = worker.stop

    def stop(*args: Any) -> bool:
        stopping.set()
        return real_stop(*args)

    worker.stop = stop  # type: ignore[method-assign]
    closer = threading.Thread(target=eng.close)
    closer.start()
    assert stopping.wait(60)
    backend.gate.set()
    rest = list(pieces)
    closer.join(60)
    assert not closer.is_alive()
    completion = stream.completion
    assert completion is not None
    assert completion.stats.finish_reason == "cancelled"
    assert len(rest) < LONG.max_tokens - 1
    with pytest.raises(EngineClosedError):
        model.complete("again", LONG)
