"""While other models' workers share the process, a worker's loop thread leaves when its
model has nothing to do and the next request, job or stop starts another
(``engine/worker/loop.py``, ``_start_thread``): llama.cpp's OpenMP keeps a pool of threads
for every thread that ran a pass, and an idle model's long-lived worker kept its pool, which
slowed every other model's passes ~1.7x on 2 cores (``docs/internals.md``, "OpenMP thread
pools"). A lone model's thread stays: a new thread's first pass costs ~10 ms more. Stub
backend: the thread mechanics."""

from __future__ import annotations

import gc
import threading

import pytest
from tests.engine.conftest import make_engine, stub_config

from kvwarm.engine import engine as engine_module
from kvwarm.engine.types import GenerationOptions
from kvwarm.engine.worker import loop
from kvwarm.errors import EngineClosedError

OPTS = GenerationOptions(max_tokens=3, temperature=0.0)


def _loop_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"kvwarm-{name}")]


def _gone(threads: list[threading.Thread]) -> bool:
    for thread in threads:
        thread.join(timeout=10.0)
    return not any(t.is_alive() for t in threads)


def test_an_idle_models_thread_leaves_and_its_next_request_starts_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loop, "IDLE_EXIT_S", 0.01)
    engine = make_engine()
    try:
        model = engine.load_model(config=stub_config(), model_id="idle")
        engine.load_model(config=stub_config(), model_id="other")
        first = model.complete("A first prompt for the idle model.", OPTS)
        threads = _loop_threads("idle")
        assert len(threads) <= 1
        assert _gone(threads)  # nothing to do: the loop's thread has left
        second = model.complete("A first prompt for the idle model.", OPTS)
        assert second.completion_tokens == first.completion_tokens
        assert second.stats.cached_tokens > 0  # the slot's live KV outlived the thread
        worker = model._worker
        assert worker._threads >= 2
        # A stop of an idle worker starts a thread to close it; then nothing starts one.
        assert _gone(_loop_threads("idle"))
    finally:
        engine.close()
    assert _gone(_loop_threads("idle"))
    with pytest.raises(EngineClosedError):
        worker.submit(None)  # type: ignore[arg-type]


def test_a_job_on_an_idle_worker_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "IDLE_EXIT_S", 0.01)
    engine = make_engine()
    try:
        model = engine.load_model(config=stub_config(), model_id="jobs")
        engine.load_model(config=stub_config(), model_id="other")
        assert _gone(_loop_threads("jobs"))
        ran_on = model._worker.call(threading.current_thread).result(timeout=10.0)
        assert ran_on.name.startswith("kvwarm-jobs") and ran_on is not threading.current_thread()
    finally:
        engine.close()


def _no_other_workers() -> None:
    """What "lone" needs: no other worker alive in the process. An engine an earlier test
    dropped unclosed is closed by a thread of its own (``engine._DROPPING``), and its worker
    counted as another until then (this test failed after the library lifecycle tests)."""
    gc.collect()
    with engine_module._DROPPING_LOCK:
        dropping = list(engine_module._DROPPING)
    for thread in dropping:
        thread.join(60)
    with loop._WORKERS_LOCK:
        alive = [w.name for w in loop._WORKERS]
    assert not alive, f"workers of earlier tests still alive: {alive}"


def test_a_lone_models_thread_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_other_workers()
    monkeypatch.setattr(loop, "IDLE_EXIT_S", 0.01)
    engine = make_engine()
    try:
        model = engine.load_model(config=stub_config(), model_id="lone")
        model.complete("A prompt for the only model.", OPTS)
        worker = model._worker
        with worker._cond:  # twenty idle periods: it would have left in the first
            left = worker._cond.wait_for(lambda: not worker._running, timeout=0.2)
        assert not left and worker._threads == 1
    finally:
        engine.close()
