"""The cluster sheds load as ``kvwarm serve`` does (found by review): Ray lets only
``max(8, 4 x n_parallel)`` calls reach a replica and queues the rest itself, without bound,
so a replica's own queue never filled and no request was ever refused; the extra ones waited
until ``request_timeout_s``. The ingress now holds at most ``replicas x (n_parallel +
max_queue)`` generations of a model; one more is the same 429 ``queue_full``, with
Retry-After, that a single server gives. The replicas counted are those running (found by
review: ``--replicas`` was counted, so with one of two replicas dead the ingress let twice
what the live one holds wait in Ray's queue), and ``max_queue`` is the model's own. No Ray: a
replica body behind direct calls, and streams parked (admitted, never answered) to fill the
ingress."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Iterator

import pytest
from fastapi.testclient import TestClient
from tests.cluster.test_ingress_stub import SYSTEM, DirectCalls, DirectStream
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.cluster.calls import Generate
from kvwarm.cluster.deploy import ingress_max_ongoing
from kvwarm.cluster.ingress import create_ingress_app, max_in_flight
from kvwarm.cluster.remote import RemoteModel
from kvwarm.cluster.replica import EngineReplica
from kvwarm.errors import QueueFullError
from kvwarm.settings.model import max_queue, model_config

# Two replicas of two slots and one queued request each: six generations at once.
SETTINGS = stub_settings(replicas=2, n_parallel=2, max_queue=1)
BODY = {"model": "a", "messages": [SYSTEM], "max_tokens": 3}


class Parked:
    """A replica call that never answers (it waits in Ray's queue)."""

    def __init__(self) -> None:
        self.cancelled = False

    def __anext__(self) -> Awaitable[object]:
        raise AssertionError("a parked call is never read here")

    def cancel(self) -> None:
        self.cancelled = True


class ParkingCalls(DirectCalls):
    """Generations park while ``park`` is set, else reach the replica."""

    park = False

    def __init__(self, replica: EngineReplica) -> None:
        super().__init__(replica)
        self.parked: list[Generate] = []
        # What the router knows runs (one body serves both: the bound only counts them).
        self.running = ["replica-1", "replica-2"]

    def replicas(self) -> list[str]:
        return list(self.running)

    def stream(self, call: Generate) -> DirectStream | Parked:  # type: ignore[override]
        if not self.park:
            return super().stream(call)
        self.parked.append(call)
        return Parked()


@pytest.fixture(scope="module")
def replica() -> Iterator[EngineReplica]:
    body = EngineReplica(SETTINGS, replica_id="replica-1")
    yield body
    body.engine.close()


@pytest.fixture
def calls(replica: EngineReplica) -> ParkingCalls:
    return ParkingCalls(replica)


@pytest.fixture
def client(calls: ParkingCalls) -> Iterator[TestClient]:
    with TestClient(create_ingress_app(SETTINGS, calls)) as test_client:
        wait_ready(test_client.get)
        yield test_client


def _model(client: TestClient) -> RemoteModel:
    model = client.app.state.kvwarm.entries["a"].model  # type: ignore[attr-defined]
    assert isinstance(model, RemoteModel)
    return model


def test_a_request_past_the_replicas_capacity_is_a_429_with_retry_after(
    client: TestClient, calls: ParkingCalls
) -> None:
    model = _model(client)
    assert max_in_flight(SETTINGS, 2) == 6
    calls.park = True
    parked = [model.stream_chat([SYSTEM]) for _ in range(6)]
    assert model.in_flight == 6
    for body in (BODY, {**BODY, "stream": True}):
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "queue_full"
        assert response.headers["retry-after"] == "1"
    # One ends (the client left): its place is free again.
    parked[0].cancel()
    assert model.in_flight == 5
    calls.park = False
    done = client.post("/v1/chat/completions", json=BODY)
    assert done.status_code == 200, done.text
    assert model.in_flight == 5  # the finished request gave its place back
    for stream in parked[1:]:
        stream.cancel()
    assert model.in_flight == 0


def test_the_bound_follows_the_replicas_running(client: TestClient, calls: ParkingCalls) -> None:
    model = _model(client)
    calls.park = True
    calls.running = ["replica-1"]  # the other died: what one replica holds, 2 + 1
    held = [model.stream("hello") for _ in range(3)]
    with pytest.raises(QueueFullError, match="at most 3"):
        model.stream("hello")
    calls.running = ["replica-1", "replica-2", "replica-3"]  # a replacement and one more
    held += [model.stream("hello") for _ in range(6)]
    with pytest.raises(QueueFullError, match="at most 9"):
        model.stream("hello")
    for stream in held:
        stream.cancel()
    assert model.in_flight == 0


def test_with_every_replica_dead_the_bound_is_one_replicas(
    client: TestClient, calls: ParkingCalls
) -> None:
    """The router reported replicas, then none (all died): what the first replacement will
    serve waits, as with one alive; --replicas' worth, twice that, did (found by review)."""
    model = _model(client)
    calls.park = True
    held = [model.stream("hello") for _ in range(6)]  # two running: 2 x (2 + 1)
    for stream in held[3:]:
        stream.cancel()
    calls.running = []
    with pytest.raises(QueueFullError, match="at most 3"):
        model.stream("hello")
    for stream in held[:3]:
        stream.cancel()
    assert model.in_flight == 0


def test_no_replica_ever_reported_counts_the_replicas_asked_for(replica: EngineReplica) -> None:
    """No router in this process (Ray's own), or none reported yet: --replicas counts."""
    calls = ParkingCalls(replica)
    calls.running = []
    with TestClient(create_ingress_app(SETTINGS, calls)) as client:
        wait_ready(client.get)
        model = _model(client)
        calls.park = True
        held = [model.stream("hello") for _ in range(6)]
        with pytest.raises(QueueFullError, match="at most 6"):
            model.stream("hello")
        for stream in held:
            stream.cancel()
    assert model.in_flight == 0


def test_a_models_own_max_queue_sizes_its_bound(replica: EngineReplica) -> None:
    spec = dataclasses.replace(SETTINGS.models[0], options=(("max_queue", 4),))
    settings = SETTINGS.replace(models=(spec, SETTINGS.models[1]))
    assert max_queue(settings, spec) == 4 and max_queue(settings, settings.models[1]) == 1
    assert model_config(settings, spec).max_queue == 4  # a replica queues as many
    calls = ParkingCalls(replica)
    with TestClient(create_ingress_app(settings, calls)) as client:
        wait_ready(client.get)
        model = _model(client)
        calls.park = True
        held = [model.stream("hello") for _ in range(12)]  # 2 x (2 + 4)
        with pytest.raises(QueueFullError, match="at most 12"):
            model.stream("hello")
        for stream in held:
            stream.cancel()
    assert ingress_max_ongoing(settings) >= 12 + max_in_flight(settings, 2)


def test_n_choices_are_admitted_all_or_none(client: TestClient, calls: ParkingCalls) -> None:
    model = _model(client)
    calls.park = True
    held = [*model.streams("hello", n=2), *model.streams("hello", n=2), model.stream("hello")]
    with pytest.raises(QueueFullError):
        model.streams("hello", n=2)  # 5 + 2 > 6: neither of the two started
    assert model.in_flight == 5 and len(calls.parked) == 5
    for stream in held:
        stream.cancel()
    assert model.in_flight == 0


def test_a_stream_dropped_unread_gives_its_place_back(
    client: TestClient, calls: ParkingCalls
) -> None:
    model = _model(client)
    calls.park = True
    model.stream_chat([SYSTEM])  # dropped at once
    assert model.in_flight == 0


def test_a_bad_request_takes_no_place(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={**BODY, "temperature": -3})
    assert response.status_code == 400
    assert _model(client).in_flight == 0


def test_the_ingress_deployment_can_hold_more_than_the_models_bound() -> None:
    # Past Ray's cap the request would wait in Serve's proxy, never reaching the 429.
    per_model = max_in_flight(SETTINGS, SETTINGS.n_parallel)
    assert ingress_max_ongoing(SETTINGS) > per_model * len(SETTINGS.models)
