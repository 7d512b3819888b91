"""Model management at the cluster's ingress: once its registry marks a model unloaded
(``/admin/models/unload``, or the idle reaper with ``model_idle_unload_s``), the next request
for it must be served again (the ingress attaches the replicas' model once more), never hang.
The ingress used to reuse ``ServerState._load_one``, which waits up to 600 s for an engine the
ingress never has.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from tests.cluster.test_ingress_stub import DirectCalls, DyingCalls
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.cluster.calls import ModelOp
from kvwarm.cluster.ingress import create_ingress_app
from kvwarm.cluster.replica import EngineReplica
from kvwarm.engine.types import ModelInfo

BODY = {
    "model": "a",
    "messages": [{"role": "user", "content": "Name a colour of the sky."}],
    "max_tokens": 4,
    "temperature": 0,
}


@pytest.fixture
def replica() -> Iterator[EngineReplica]:
    body = EngineReplica(stub_settings(), replica_id="replica-1")
    yield body
    body.engine.close()


def _post_within(client: TestClient, path: str, body: dict[str, object], seconds: float) -> object:
    """The response of POST ``path``, or None if it did not come within ``seconds`` (the stuck
    load is then released, so that the client shuts down cleanly before the test fails)."""
    out: list[object] = []
    worker = threading.Thread(target=lambda: out.append(client.post(path, json=body)), daemon=True)
    worker.start()
    worker.join(seconds)
    if out:
        return out[0]
    client.app.state.kvwarm._engine_known.set()  # type: ignore[attr-defined]
    worker.join(30)
    return None


def test_request_after_admin_unload_at_the_ingress_does_not_hang(replica: EngineReplica) -> None:
    with TestClient(create_ingress_app(stub_settings(), DirectCalls(replica))) as client:
        wait_ready(client.get)
        assert client.post("/v1/chat/completions", json=BODY).status_code == 200
        unload = client.post("/admin/models/unload", json={"model": "a"})
        # Either the ingress refuses (the replicas hold the models) or the model comes back.
        response = _post_within(client, "/v1/chat/completions", BODY, 15.0)
        assert response is not None, (
            f"unload answered {unload.status_code} {unload.json()}; the next request for the "
            "model hung (the ingress's registry waits 600 s for an engine it never has)"
        )
        assert response.status_code in (200, 404, 501, 503), response.json()  # type: ignore[attr-defined]


def test_request_after_idle_unload_at_the_ingress_does_not_hang(replica: EngineReplica) -> None:
    settings = stub_settings(model_idle_unload_s=3600.0)
    with TestClient(create_ingress_app(settings, DirectCalls(replica))) as client:
        wait_ready(client.get)
        assert client.post("/v1/chat/completions", json=BODY).status_code == 200
        state = client.app.state.kvwarm  # type: ignore[attr-defined]
        unloaded = state.registry.reap_idle(now=10**9)  # as the idle thread does, later
        response = _post_within(client, "/v1/chat/completions", BODY, 15.0)
        assert response is not None, (
            f"the idle reaper unloaded {unloaded} at the ingress; the next request hung"
        )
        assert response.status_code == 200, response.json()  # type: ignore[attr-defined]


class SwappedCalls(DyingCalls):
    """``DyingCalls`` whose replicas answer ``info`` with another weights fingerprint once
    ``swapped`` (the model's file changed behind the same id)."""

    swapped = False

    def op(self, op: ModelOp) -> object:
        out = super().op(op)
        if self.swapped and isinstance(out, ModelInfo):
            return dataclasses.replace(out, fingerprint="0" * len(out.fingerprint))
        return out


@pytest.mark.parametrize("swap", [False, True])
def test_a_detached_model_keeps_its_conversations_last_rows(
    replica: EngineReplica, swap: bool
) -> None:
    # Found by review: detaching a model at the ingress (idle or admin unload) dropped its
    # last-row memory and retry count, so each conversation's next turn lost its parent_key
    # and /cluster's retried reset. Kept per model id, unless the model changed.
    calls = SwappedCalls(replica, deaths=1)
    with TestClient(create_ingress_app(stub_settings(), calls)) as client:
        wait_ready(client.get)
        first = client.post("/v1/chat/completions", json=BODY)  # sent again once
        assert first.status_code == 200, first.json()
        assert client.get("/cluster").json()["ingress"]["retried"] == 1
        reply = first.json()["choices"][0]["message"]["content"]
        turn2 = [*BODY["messages"], {"role": "assistant", "content": reply}]  # type: ignore[list-item]
        turn2.append({"role": "user", "content": "Why?"})
        assert client.post("/admin/models/unload", json={"model": "a"}).status_code == 200
        assert client.get("/cluster").json()["ingress"]["retried"] == 1  # while detached
        calls.swapped = swap
        second = client.post("/v1/chat/completions", json={**BODY, "messages": turn2})
        assert second.status_code == 200, second.json()
        parent = calls.calls[-1].options.parent_key
        retried = client.get("/cluster").json()["ingress"]["retried"]
    if swap:  # rows of another model are never a parent
        assert parent is None and retried == 0
    else:
        assert parent is not None and retried == 1
