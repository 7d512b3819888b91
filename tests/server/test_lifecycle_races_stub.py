"""Models unloaded while work they hold no lease for is in flight (review "races"), on the
stub: a background response (its ``POST``, and its lease, long over) is the model's work until
it ends, so neither a ``keep_alive`` of 0 nor the idle timer may unload its model under it.
Every wait is on an event the worker reaches or on the app's own loop, never on time."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from kvwarm.engine.request import Request
from kvwarm.engine.worker.admission import Admission, Planned, Restored
from kvwarm.server import create_app
from kvwarm.server.state import ServerState

from .conftest import stub_settings, wait_ready

BODY: dict[str, object] = {
    "model": "a",
    "input": "Tell me about the quick brown fox, please.",
    "max_output_tokens": 4,
    "temperature": 0,
    "background": True,
    "keep_alive": 0,
}


def _state(client: TestClient) -> ServerState:
    state = client.app.state.kvwarm  # type: ignore[attr-defined]
    assert isinstance(state, ServerState)
    return state


def _ended(client: TestClient, response_id: str) -> None:
    """Wait (on the app's loop, bounded) until the background response has ended."""
    pending = _state(client).responses.running(response_id)
    if pending is None:
        return
    assert client.portal is not None

    async def wait() -> None:
        await asyncio.wait_for(pending.ended.wait(), 60)

    client.portal.call(wait)


def test_keep_alive_zero_never_unloads_a_background_response_s_model_while_it_is_admitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: while the worker admitted a request (looked up, read and unpacked its
    prompt's row: a disk read), the request was neither queued nor active, so the reaper took
    a model whose only work was a background response for idle and unloaded it: the response
    ended ``cancelled`` though nobody cancelled it."""
    entered, release = threading.Event(), threading.Event()
    real = Admission.restore

    def held(admission: Admission, planned: Planned, req: Request) -> Restored:
        entered.set()
        assert release.wait(60)
        return real(admission, planned, req)

    monkeypatch.setattr(Admission, "restore", held)
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        try:
            created = client.post("/v1/responses", json=BODY)
            assert created.status_code == 200, created.json()
            rid = created.json()["id"]
            assert entered.wait(10)  # its POST (and lease) over, the worker admitting it
            registry = _state(client).registry
            assert registry.reap_idle() == []
            assert registry.entries["a"].state == "ready"
        finally:
            release.set()
        _ended(client, rid)
        done = client.get(f"/v1/responses/{rid}").json()
        assert done["status"] in ("completed", "incomplete"), done
