"""An embedding ends early: past its deadline (``timeout_s``, the server's
``request_timeout_s``) or once its caller cancels it (the server's ``Cancellation``, on its
client's disconnect); the inputs not yet embedded are never run (found by review: one
request of many long inputs held the model's queue for as long as it took)."""

from __future__ import annotations

import threading

import pytest

from kvwarm.engine.cancel import Cancellation
from kvwarm.errors import InvalidRequestError, RequestCancelledError, RequestTimeoutError

from .conftest import make_engine
from .test_rerank_stub import RecordingBackend, config

# Each input its own piece (n_batch 512): one job on the worker each.
INPUTS = [f"{i} " + "long input " * 30 for i in range(5)]


def test_an_embedding_past_its_deadline_is_dropped_and_raised() -> None:
    backend = RecordingBackend()
    backend.gate = threading.Event()  # the first piece waits here until the deadline passed
    eng = make_engine()
    try:
        model = eng.load_model("stub-a", model_id="e", config=config(1, backend=backend))
        with pytest.raises(RequestTimeoutError, match=r"deadline .* 5 of its 5 inputs"):
            model.embed(INPUTS, timeout_s=0.05)
        backend.gate.set()
        (vector,) = model.embed(INPUTS[:1])  # the worker is free; the first piece had run
        assert len(backend.embedded) == 2, [len(t) for t in backend.embedded]
        assert vector == model.embed(INPUTS[:1])[0]
        for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
            with pytest.raises(InvalidRequestError, match="timeout_s"):
                model.embed(INPUTS, timeout_s=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="cancel must be a Cancellation"):
            model.embed(INPUTS, cancel=threading.Event())  # type: ignore[arg-type]
    finally:
        backend.gate.set()
        eng.close()


def test_a_cancelled_embedding_stops_and_raises() -> None:
    backend = RecordingBackend()
    backend.gate = threading.Event()
    eng = make_engine()
    try:
        model = eng.load_model("stub-a", model_id="e", config=config(1, backend=backend))
        cancel = Cancellation()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                model.embed(INPUTS, cancel=cancel)
            except BaseException as exc:
                failure.append(exc)

        embedding = threading.Thread(target=run)
        embedding.start()
        assert backend.entered.wait(60)  # its first piece runs
        cancel.cancel()
        backend.gate.set()
        embedding.join(60)
        assert len(failure) == 1 and isinstance(failure[0], RequestCancelledError), failure
        assert len(backend.embedded) == 1  # the piece under way ended; no other began
        assert len(model.embed(INPUTS)) == len(INPUTS)  # a fresh call is unaffected
    finally:
        backend.gate.set()
        eng.close()
