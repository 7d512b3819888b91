"""Models unloaded while work they hold no lease for is in flight (review "races"), on the
stub: a background response (its ``POST``, and its lease, long over) is the model's work until
it ends, so neither a ``keep_alive`` of 0 nor the idle timer may unload its model under it.
Every wait is on an event the worker reaches or on the app's own loop, never on time."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from fastapi.testclient import TestClient

from kvwarm.cache.types import TtlClass
from kvwarm.engine.request import Done
from kvwarm.engine.stream import CompletionStream
from kvwarm.engine.types import CompletionStats
from kvwarm.errors import ServerShuttingDownError
from kvwarm.server import create_app
from kvwarm.server.generate import Generation
from kvwarm.server.state import ServerState

from ..engine.conftest import GatedBackend, make_engine, stub_config
from .conftest import background_ended, hold_restores, server_state, stub_settings, wait_ready

BODY: dict[str, object] = {
    "model": "a",
    "input": "Tell me about the quick brown fox, please.",
    "max_output_tokens": 4,
    "temperature": 0,
    "background": True,
    "keep_alive": 0,
}


def test_keep_alive_zero_never_unloads_a_background_response_s_model_while_it_is_admitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: while the worker admitted a request (looked up, read and unpacked its
    prompt's row: a disk read), the request was neither queued nor active, so the reaper took
    a model whose only work was a background response for idle and unloaded it: the response
    ended ``cancelled`` though nobody cancelled it."""
    entered, release = hold_restores(monkeypatch)
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        try:
            created = client.post("/v1/responses", json=BODY)
            assert created.status_code == 200, created.json()
            rid = created.json()["id"]
            assert entered.wait(10)  # its POST (and lease) over, the worker admitting it
            registry = server_state(client).registry
            assert registry.reap_idle() == []
            assert registry.entries["a"].state == "ready"
        finally:
            release.set()
        background_ended(client, rid)
        done = client.get(f"/v1/responses/{rid}").json()
        assert done["status"] in ("completed", "incomplete"), done


def _answered(stream: CompletionStream) -> None:
    """Wait until the worker has put ``stream``'s final event, unread, on its channel."""
    channel = stream.request.channel
    with channel._cond:
        assert channel._cond.wait_for(lambda: any(isinstance(e, Done) for e in channel._items), 10)


def test_a_reply_answered_whole_before_the_server_s_cut_is_read_keeps_its_result() -> None:
    """Found by review: ``Generation.cut`` (the deadline, the shutdown's drain) decided by
    ``stream.done``, which only the reader sets: a reply the worker had already answered in
    full, its ``Done`` not yet read, was thrown away for the cut's error (a background
    response stored ``failed``, a stream ended with an error event)."""
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        state = ServerState(stub_settings())

        def generation(stream: CompletionStream) -> Generation:
            return Generation(None, stream, "test", model.id, state, watch=False)  # type: ignore[arg-type]

        async def run() -> None:
            backend.gate.set()
            for read in ("result", "fragments"):
                stream = model.stream("a short prompt to answer", max_tokens=3, temperature=0)
                _answered(stream)
                gen = generation(stream)
                gen.cut(ServerShuttingDownError("shutting down"))
                if read == "fragments":
                    assert "".join([f.text async for f in gen.fragments()])
                done = await gen.result()
                assert done.stats.finish_reason in ("length", "stop")
                gen.close()
            # A reply the cut did end still raises the cut's error.
            backend.gate.clear()
            gen = generation(model.stream("a short prompt to answer", max_tokens=8))
            gen.cut(ServerShuttingDownError("shutting down"))
            backend.gate.set()
            with pytest.raises(ServerShuttingDownError):
                await gen.result()
            gen.close()

        asyncio.run(run())


def test_a_background_response_s_keep_alive_counts_from_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a background response held no lease once its ``POST`` was answered,
    so its model's ``keep_alive`` ran from the ``POST``: a response running longer than that
    had its model unloaded the moment it ended (and an admin saw it unleased meanwhile). It
    now holds its model's lease until it ends."""
    entered, release = hold_restores(monkeypatch)
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        registry = server_state(client).registry
        entry = registry.entries["a"]
        try:
            created = client.post("/v1/responses", json={**BODY, "keep_alive": 3600})
            assert created.status_code == 200, created.json()
            assert entered.wait(10)
            assert entry.leases == 1  # the POST is over; the response holds its model
            before = time.monotonic()
        finally:
            release.set()
        background_ended(client, created.json()["id"])
        assert entry.leases == 0
        due = registry.due(entry)
        assert due is not None and due >= before + 3600  # from its end, not its POST


def test_a_keep_alive_tick_re_warms_nothing_more_once_the_server_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a keep-alive tick went on through every due entry (a prefill each)
    after shutdown began, while ``ServerState.close`` waited up to 60 s for its thread
    before it closed the engine."""
    state = ServerState(stub_settings())
    warmed: list[str] = []

    class Model:
        def prewarm(self, prompt: str, **_: object) -> CompletionStats:
            warmed.append(prompt)
            state._closing.set()  # shutdown begins during the first re-warm
            return CompletionStats(0, 0, 0, 0.0, 0.0, 0.0, "cold", "length", None)

        prewarm_chat = prewarm

    monkeypatch.setattr(state, "ready_model", lambda _id: Model())
    for prompt in ("first", "second", "third"):
        state.keepalive.register("a", prompt, TtlClass.SHORT)
    for entry in state.keepalive.entries():
        entry.last_warm = -math.inf  # due
    state._keepalive_tick()
    assert warmed == ["first"]


def test_a_reply_read_to_its_end_is_counted_once_whether_its_result_is_read_or_not() -> None:
    """Found by review: a generation was counted (``kvwarm_generations_total``, the request
    log) only by ``result`` or, for a stream not yet done, by ``close``. The ``n`` choices'
    pumps (``Choices.merged``) read a choice to its end ahead of the response: a client that
    left (or was cut off as a slow reader) before the response got to that end had a reply
    the model finished and counted (``kvwarm_requests_total``) counted nowhere else. Its end
    read, it is counted, once, whatever follows."""
    with make_engine() as eng:
        model = eng.load_model(config=stub_config())
        state = ServerState(stub_settings())

        def finished() -> float:
            total = 0.0
            for reason in ("stop", "length"):
                value = state.counters.registry.get_sample_value(
                    "kvwarm_generations_total", {"model": model.id, "reason": reason}
                )
                total += value or 0.0
            return total

        def generation(prompt: str) -> Generation:
            stream = model.stream(prompt, max_tokens=3)
            return Generation(None, stream, "test", model.id, state, watch=False)  # type: ignore[arg-type]

        async def run() -> None:
            gen = generation("a short prompt")
            assert "".join([f.text async for f in gen.fragments()])
            assert finished() == 1  # its result never read: the response was left
            gen.close()
            await asyncio.gather(*state.background)
            assert finished() == 1
            # Read to its end, then its result (the usual path), then closed: once.
            gen = generation("another prompt")
            assert "".join([f.text async for f in gen.fragments()])
            await gen.result()
            gen.close()
            await gen.result()
            assert finished() == 2
            assert state.counters.registry.get_sample_value("kvwarm_client_disconnects_total") == 0

        asyncio.run(run())
