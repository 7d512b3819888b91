"""A replica's health check (``EngineReplica.check_health``, which Ray Serve calls to replace a
replica that fails it) and a model whose worker thread died."""

from __future__ import annotations

import pytest
from tests.server.conftest import stub_settings

from kvwarm.cluster.replica import EngineReplica
from kvwarm.errors import KvwarmError


class _Died(BaseException):
    """Stands in for whatever kills a worker thread outright (escaping its error handling)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_replica_whose_model_worker_died_fails_its_health_check() -> None:
    """Found by review: the check read ``Model.status().state``, which stayed "ready" once
    the worker had died, so Ray kept a replica that refused every request of that model
    (``engine_closed``) as healthy, for good, instead of starting another; and its routing
    stats still offered the dead model's slots as free, drawing the router's requests."""
    replica = EngineReplica(stub_settings(), replica_id="replica-1")
    try:
        replica.check_health()  # healthy while every worker runs
        model = replica.models["a"]
        other = replica.models["b"].info().n_parallel
        assert replica.record_routing_stats()["free_slots"] == model.info().n_parallel + other

        def die() -> None:
            raise _Died()

        model._worker.tick.run = die
        with pytest.raises(KvwarmError):
            model.complete("x", max_tokens=2)
        assert model._worker._closed.wait(10)
        thread = model._worker._thread
        assert thread is not None
        # Its exception reaches threading.excepthook as the thread ends, after ``_closed``:
        # joined here, pytest reports it inside this test (filtered), not in the next one.
        thread.join(10)
        assert not thread.is_alive()
        with pytest.raises(KvwarmError, match="model a is failed"):
            replica.check_health()
        assert model.status().state == "failed"
        assert replica.record_routing_stats()["free_slots"] == other  # b's alone
    finally:
        replica.engine.close()
