"""``background: true`` on ``/v1/responses`` (OpenAI's background mode), on the stub backend:
the ``POST`` answers at once (``queued``), ``GET`` polls it to its end, ``.../cancel`` ends it
and frees its slot. It was served synchronously, the field ignored.

The stub's forward passes are held at a gate (``Gated``), so a response is still running when
the test looks; the test waits for a response's end on the app's own loop
(``Pending.ended``, through the TestClient's portal), never by sleeping.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from kvwarm.backends.stub import StubBackend
from kvwarm.errors import ServerShuttingDownError
from kvwarm.server import create_app
from kvwarm.settings import ModelSpec

from ..engine.test_rerank_stub import RecordingBackend
from .conftest import background_ended, server_state, stub_settings, wait_ready
from .test_api_stub import assert_error

BODY: dict[str, object] = {
    "model": "a",
    "input": "Tell me about the quick brown fox, please.",
    "max_output_tokens": 8,
    "temperature": 0,
    "background": True,
}


class Gated(RecordingBackend):
    """The stub, its forward passes past the first ``free`` held at ``gate`` (``entered`` set
    as one waits); ``free`` None: none held."""

    def __init__(self) -> None:
        super().__init__()
        self.free: int | None = None
        self.passes = 0
        self.gate = threading.Event()

    def wait_gate(self) -> None:
        self.passes += 1
        if self.free is not None and self.passes > self.free:
            self.entered.set()
            assert self.gate.wait(60)


@pytest.fixture
def gated(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[tuple[TestClient, Gated]]:
    """``indirect`` parameters: settings of the server's."""
    backend = Gated()
    monkeypatch.setattr(StubBackend, "from_env", classmethod(lambda cls: backend))
    # One pass prefills a prompt: with ``free`` 1, the next pass (the first decode) is held.
    settings = stub_settings(
        models=(ModelSpec(path="stub-a", id="a"),),
        n_parallel=1,
        n_batch=512,
        **getattr(request, "param", {}),
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        try:
            yield client, backend
        finally:
            backend.gate.set()


def _active(client: TestClient) -> int:
    model = server_state(client).entries["a"].model
    assert model is not None
    return model.status().active + model.status().queued


def test_post_answers_queued_at_once_and_get_polls_it_to_completed(
    gated: tuple[TestClient, Gated],
) -> None:
    client, backend = gated
    backend.free = 0  # its prefill is held: the POST must answer without it
    created = client.post("/v1/responses", json=BODY)
    assert created.status_code == 200, created.json()
    body = created.json()
    assert body["status"] == "queued" and body["background"] is True and body["output"] == []
    assert body["id"].startswith("resp_") and body["usage"] is None
    assert backend.entered.wait(10)  # the generation is running, the POST long answered
    polled = client.get(f"/v1/responses/{body['id']}").json()
    assert polled["status"] == "queued" and polled["id"] == body["id"]
    backend.gate.set()
    background_ended(client, body["id"])
    done = client.get(f"/v1/responses/{body['id']}").json()
    assert done["status"] in ("completed", "incomplete") and done["background"] is True
    (item,) = done["output"]
    assert item["type"] == "message" and item["content"][0]["text"]
    assert done["usage"]["output_tokens"] > 0
    # Stored as any response: its input items listed, a follow-up continues from its reply.
    items = client.get(f"/v1/responses/{body['id']}/input_items").json()["data"]
    assert [i["role"] for i in items] == ["user"]
    after = client.post(
        "/v1/responses",
        json={**BODY, "background": False, "input": "More.", "previous_response_id": body["id"]},
    )
    assert after.status_code == 200, after.json()
    assert after.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_in_progress_once_its_first_token_is_out(gated: tuple[TestClient, Gated]) -> None:
    client, backend = gated
    backend.free = 1  # the prefill's pass (its first token sampled), then held
    rid = client.post("/v1/responses", json=BODY).json()["id"]
    assert backend.entered.wait(10)
    pending = server_state(client).responses.running(rid)
    assert pending is not None
    assert client.portal is not None

    async def started() -> None:  # the task reads the token on the app's loop
        while pending.body["status"] != "in_progress":
            await asyncio.sleep(0)

    client.portal.call(lambda: asyncio.wait_for(started(), 10))
    assert client.get(f"/v1/responses/{rid}").json()["status"] == "in_progress"
    backend.gate.set()
    background_ended(client, rid)
    assert client.get(f"/v1/responses/{rid}").json()["status"] in ("completed", "incomplete")


def test_cancel_ends_a_running_one_and_frees_its_slot(gated: tuple[TestClient, Gated]) -> None:
    client, backend = gated
    backend.free = 1
    rid = client.post("/v1/responses", json={**BODY, "max_output_tokens": 64}).json()["id"]
    assert backend.entered.wait(10)  # generating, held between two tokens
    assert _active(client) == 1
    (gen,) = server_state(client).streams
    asked = gen.stream.request.cancelled  # type: ignore[attr-defined]
    with ThreadPoolExecutor(1) as pool:
        # The cancel answers once the generation has ended: between two tokens, so after
        # the gate opens, which it does once the cancel has reached the engine.
        cancelling = pool.submit(client.post, f"/v1/responses/{rid}/cancel")
        assert asked.wait(10)
        assert not cancelling.done()
        backend.gate.set()
        cancelled = cancelling.result(60)
    assert cancelled.status_code == 200, cancelled.json()
    body = cancelled.json()
    assert body["status"] == "cancelled" and body["id"] == rid and body["error"] is None
    assert _active(client) == 0  # its slot is free
    assert client.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"
    # Cancelling again answers the same response (as OpenAI's, idempotent).
    again = client.post(f"/v1/responses/{rid}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    # Nothing to continue from.
    follow = client.post("/v1/responses", json={**BODY, "previous_response_id": rid})
    assert_error(follow, 400, "invalid_value", "previous_response_id")
    assert "cancelled" in follow.json()["error"]["message"]


def test_cancel_takes_a_queued_one_out_of_its_model_s_queue(
    gated: tuple[TestClient, Gated],
) -> None:
    client, backend = gated
    backend.free = 0  # the first one holds the model's only slot
    first = client.post("/v1/responses", json=BODY).json()["id"]
    assert backend.entered.wait(10)
    queued = client.post("/v1/responses", json=BODY).json()["id"]
    assert _active(client) == 2  # one in the slot, one queued
    cancelled = client.post(f"/v1/responses/{queued}/cancel")  # answered without the gate
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["output"] == []
    assert _active(client) == 1
    backend.gate.set()
    background_ended(client, first)
    assert client.get(f"/v1/responses/{first}").json()["status"] in ("completed", "incomplete")


def test_delete_while_running_cancels_it_and_keeps_nothing(
    gated: tuple[TestClient, Gated],
) -> None:
    client, backend = gated
    backend.free = 0
    rid = client.post("/v1/responses", json=BODY).json()["id"]
    assert backend.entered.wait(10)
    pending = server_state(client).responses.running(rid)
    deleted = client.delete(f"/v1/responses/{rid}")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    backend.gate.set()
    assert pending is not None and client.portal is not None
    client.portal.call(lambda: asyncio.wait_for(pending.ended.wait(), 60))
    assert_error(client.get(f"/v1/responses/{rid}"), 404, "response_not_found")
    assert _active(client) == 0 and len(server_state(client).responses) == 0


def test_failed_generation_is_stored_failed_with_its_error(
    gated: tuple[TestClient, Gated],
) -> None:
    """A generation the server ends (shutdown's end of its graceful wait here) is stored
    ``failed``, with the error a synchronous request would have got."""
    client, backend = gated
    backend.free = 0
    rid = client.post("/v1/responses", json=BODY).json()["id"]
    assert backend.entered.wait(10)
    (gen,) = server_state(client).streams
    assert client.portal is not None
    client.portal.call(gen.cut, ServerShuttingDownError("the server is shutting down"))
    backend.gate.set()
    background_ended(client, rid)
    body = client.get(f"/v1/responses/{rid}").json()
    assert body["status"] == "failed"
    assert body["error"] == {"code": "shutting_down", "message": "the server is shutting down"}
    assert _active(client) == 0


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"store": False}, "background", "invalid_value"),
        ({"stream": True}, "stream", "unsupported_parameter"),
    ],
)
def test_background_needs_store_and_no_stream(
    gated: tuple[TestClient, Gated], extra: dict[str, object], param: str, code: str
) -> None:
    client, _ = gated
    refused = client.post("/v1/responses", json={**BODY, **extra})
    assert_error(refused, 400, code, param)
    assert _active(client) == 0 and len(server_state(client).responses) == 0


def test_cancel_of_a_response_made_without_background_is_400(
    gated: tuple[TestClient, Gated],
) -> None:
    client, _ = gated
    made = client.post("/v1/responses", json={**BODY, "background": False}).json()
    assert made["background"] is False and made["status"] in ("completed", "incomplete")
    cancel = client.post(f"/v1/responses/{made['id']}/cancel")
    assert_error(cancel, 400, "invalid_value", "response_id")
    assert_error(client.post("/v1/responses/resp_nope/cancel"), 404, "response_not_found")


def test_a_running_one_cannot_be_continued_yet(gated: tuple[TestClient, Gated]) -> None:
    client, backend = gated
    backend.free = 0
    rid = client.post("/v1/responses", json=BODY).json()["id"]
    follow = client.post("/v1/responses", json={**BODY, "previous_response_id": rid})
    assert_error(follow, 400, "invalid_value", "previous_response_id")
    assert "still running" in follow.json()["error"]["message"]
    backend.gate.set()
    background_ended(client, rid)


@pytest.mark.parametrize(
    "gated", [{"api_key": "user", "admin_key": "root", "cache_salt_from_auth": True}], indirect=True
)
def test_another_tenant_can_neither_see_nor_cancel_it(gated: tuple[TestClient, Gated]) -> None:
    client, backend = gated
    user, other = {"authorization": "Bearer user"}, {"x-api-key": "root"}
    backend.free = 0
    rid = client.post("/v1/responses", json=BODY, headers=user).json()["id"]
    for method, path in (
        ("GET", f"/v1/responses/{rid}"),
        ("POST", f"/v1/responses/{rid}/cancel"),
        ("DELETE", f"/v1/responses/{rid}"),
        ("GET", f"/v1/responses/{rid}/input_items"),
    ):
        assert_error(client.request(method, path, headers=other), 404, "response_not_found")
    follow = {**BODY, "previous_response_id": rid}
    refused = client.post("/v1/responses", json=follow, headers=other)
    assert_error(refused, 404, "previous_response_not_found")
    assert client.get(f"/v1/responses/{rid}", headers=user).json()["status"] == "queued"
    backend.gate.set()
    background_ended(client, rid)
    assert client.get(f"/v1/responses/{rid}", headers=user).json()["status"] != "queued"


def test_a_deleted_one_is_gone_at_once_though_it_still_winds_down(
    gated: tuple[TestClient, Gated],
) -> None:
    """Found by review: between its DELETE and its generation's end, GET still showed it
    (``in_progress``), a second DELETE deleted it again and ``.../cancel`` waited on it, and a
    follow-up was told it was still running: a deleted response is gone to every route."""
    client, backend = gated
    backend.free = 0
    rid = client.post("/v1/responses", json=BODY).json()["id"]
    assert backend.entered.wait(10)
    pending = server_state(client).responses.running(rid)
    assert client.delete(f"/v1/responses/{rid}").status_code == 200
    try:  # the gate still holds it: it has not ended yet
        assert server_state(client).responses.running(rid) is pending
        assert_error(client.get(f"/v1/responses/{rid}"), 404, "response_not_found")
        assert_error(client.get(f"/v1/responses/{rid}/input_items"), 404, "response_not_found")
        assert_error(client.delete(f"/v1/responses/{rid}"), 404, "response_not_found")
        assert_error(client.post(f"/v1/responses/{rid}/cancel"), 404, "response_not_found")
        follow_up = {**BODY, "background": False, "previous_response_id": rid}
        assert_error(
            client.post("/v1/responses", json=follow_up), 404, "previous_response_not_found"
        )
    finally:
        backend.gate.set()
    assert pending is not None and client.portal is not None
    client.portal.call(lambda: asyncio.wait_for(pending.ended.wait(), 60))
    assert len(server_state(client).responses) == 0
