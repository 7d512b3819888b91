"""Issue 23: /health names a model whose worker has not ticked for longer than
``worker_stall_s`` (it said ok while a grammar pinned the worker for minutes)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response
from prometheus_client.parser import text_string_to_metric_families

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready


def test_health_is_degraded_naming_a_stalled_worker() -> None:
    with TestClient(create_app(stub_settings(worker_stall_s=0.05))) as client:
        wait_ready(client.get)
        assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 200
        model = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
        release, entered = threading.Event(), threading.Event()

        def stuck() -> None:  # stands in for native code that does not return
            entered.set()
            release.wait(30)

        done = model._worker.call(stuck)
        try:
            assert entered.wait(10)
            end = time.monotonic() + 10
            while model.stalled_for() <= 0.05 and time.monotonic() < end:
                entered.wait(0.01)  # bounded poll of a clock, not synchronisation
            body = client.get("/health").json()
            assert body["status"] == "degraded", body
            assert "a" in body["stalled"] and "b" not in body.get("stalled", {})
            metrics = client.get("/metrics").text
            line = next(
                x
                for x in metrics.splitlines()
                if x.startswith('kvwarm_worker_stalled_seconds{model="a"}')
            )
            assert float(line.split()[-1]) > 0.05
        finally:
            release.set()
            done.result(10)
        assert client.get("/health").json()["status"] == "ok"


def test_a_request_past_the_server_deadline_ends_with_a_typed_error() -> None:
    settings = stub_settings(request_timeout_s=0.3)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        model = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
        assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 200
        model = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
        release, entered = threading.Event(), threading.Event()

        def stuck() -> None:
            entered.set()
            release.wait(30)

        done = model._worker.call(stuck)
        try:
            assert entered.wait(10)
            start = time.monotonic()
            body = {"model": "a", "prompt": "x", "max_tokens": 4}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 503, response.json()
            assert response.json()["error"]["code"] == "request_timeout"
            assert time.monotonic() - start < 10
        finally:
            release.set()
            done.result(10)
        assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 200


def test_a_cache_key_can_be_waited_for_and_read() -> None:
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        # The prompt alone clears min_tokens (16): a reply sampled short (EOS among its first
        # tokens, ~2.5% of runs) left a shorter prompt without a finish save, hence no key.
        prompt = "wait for me, then read my row"
        done = client.post("/v1/completions", json={"model": "a", "prompt": prompt})
        key = done.json()["timings"]["cache_key"]
        assert key
        row = client.get(f"/cache/rows/{key}", params={"wait_ms": 5000})
        assert row.status_code == 200, row.json()
        assert row.json()["key"] == key
        assert client.get("/cache/rows/00ff", params={"wait_ms": 10}).status_code == 404
        assert client.get("/cache/rows/zz").status_code == 400


class _Died(BaseException):
    """Stands in for whatever kills a worker thread outright (escaping its error handling)."""


def _kill_worker(client: TestClient) -> tuple[Any, Response]:
    """Kill model a's worker thread (its next tick raises past its error handling) with a
    request, and wait until the thread has ended: the model and that request's response."""
    dead = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]

    def die() -> None:
        raise _Died()

    dead._worker.tick.run = die
    response = client.post("/v1/completions", json={"model": "a", "prompt": "x"})
    assert dead._worker._closed.wait(10)
    return dead, response


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_names_a_model_whose_worker_died() -> None:
    """/health said ok while a model whose worker thread had died refused every request."""
    with TestClient(create_app(stub_settings(models=stub_settings().models[:1]))) as client:
        wait_ready(client.get)
        _, response = _kill_worker(client)
        assert response.status_code == 503, response.json()
        health = client.get("/health")
        assert health.status_code == 503, health.json()
        body = health.json()
        assert body["status"] == "error" and body["error"]["code"] == "worker_died", body
        assert "a" in body["error"]["message"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_model_whose_worker_died_is_failed_everywhere_and_loads_again() -> None:
    """Issue 41: a model whose worker died still said "ready" in /v1/models (and on the page,
    which lists its status); it could be brought back only by restarting the server."""
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        dead, response = _kill_worker(client)
        assert response.status_code == 503, response.json()
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["a"]["status"] == "failed", listed["a"]
        assert "worker died" in listed["a"]["error"] and "meta" not in listed["a"]
        assert listed["b"]["status"] == "ready"  # the other model is untouched
        one = client.get("/v1/models/a").json()
        assert one["status"] == "failed", one
        again = client.post("/v1/completions", json={"model": "a", "prompt": "x"})
        assert again.status_code == 503 and again.json()["error"]["code"] == "worker_died"
        health = client.get("/health").json()
        assert health["status"] == "degraded" and "a" in health["errors"], health
        # Back without a restart: the dead model is unloaded and a new one loaded.
        loaded = client.post("/admin/models/load", json={"name": "a"})
        assert loaded.status_code == 200, loaded.json()
        assert loaded.json()["status"] == "ready"
        model = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
        assert model is not dead and dead._state != "ready"
        done = client.post("/v1/completions", json={"model": "a", "prompt": "x"})
        assert done.status_code == 200, done.json()
        assert client.get("/health").json()["status"] == "ok"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_unloading_a_model_whose_worker_died_frees_it() -> None:
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        dead, _ = _kill_worker(client)
        unloaded = client.post("/admin/models/unload", json={"model": "a"})
        assert unloaded.status_code == 200, unloaded.json()
        assert unloaded.json()["status"] == "available"
        assert dead._state != "ready"
        # Its next request loads it again, as for any unloaded model.
        done = client.post("/v1/completions", json={"model": "a", "prompt": "x"})
        assert done.status_code == 200, done.json()


def _sample(text: str, name: str, labels: dict[str, str]) -> float:
    """One sample of a /metrics scrape, read by prometheus_client's own parser."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no {name}{labels} in the scrape")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_metrics_and_the_slots_view_say_a_dead_worker_s_model_is_failed() -> None:
    """Found by review: once a model's worker died, /metrics still said
    ``kvwarm_model_ready{model="a"} 1`` until a request or /health happened to look at the
    registry, and /cache/slots (the page's Cache view) said ``"state": "ready"`` for good,
    while /v1/models and the Models view said failed. Scraped first, before anything else
    looks, all three agree."""
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        _, response = _kill_worker(client)
        assert response.status_code == 503, response.json()
        scrape = client.get("/metrics").text  # before /health or /v1/models notice it
        assert _sample(scrape, "kvwarm_model_ready", {"model": "a"}) == 0.0
        assert _sample(scrape, "kvwarm_model_ready", {"model": "b"}) == 1.0
        slots = {m["id"]: m for m in client.get("/cache/slots").json()["data"]}
        assert slots["a"]["state"] == "failed", slots["a"]
        assert slots["b"]["state"] == "ready"
        listed = {m["id"]: m["status"] for m in client.get("/v1/models").json()["data"]}
        assert listed == {"a": "failed", "b": "ready"}
        # Still so once the registry has noticed (the slots view said "ready" for good).
        slots = {m["id"]: m for m in client.get("/cache/slots").json()["data"]}
        assert slots["a"]["state"] == "failed", slots["a"]
