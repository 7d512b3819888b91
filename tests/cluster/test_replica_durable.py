"""A replica ends a reply only once its finish row is published in a tier other replicas
read (``replica.DurableSaves``): the ingress ends the response on ``Finished``, so a turn
the client saw end survives the replica's death. bench/cluster.py's kill run found two
follow-ups whose previous turn's save died with its replica, still being written."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest
from tests.server.conftest import stub_settings

from kvwarm.cache.types import SaveReason, SaveRequest
from kvwarm.cluster.calls import Finished, Generate
from kvwarm.cluster.chains import chat_chain
from kvwarm.cluster.replica import EngineReplica
from kvwarm.engine.stream import CompletionStream
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import ConfigError

MESSAGES = [
    {"role": "system", "content": "You answer in one short sentence, always politely."},
    {"role": "user", "content": "Name a colour of the sky, please."},
]


def _call() -> Generate:
    return Generate(
        model_id="a",
        kind="chat",
        options=GenerationOptions(max_tokens=6, temperature=0),
        chain=chat_chain("a", MESSAGES),
        messages=MESSAGES,
    )


def _drive(replica: EngineReplica, on_finished: threading.Event, order: list[str]) -> bytes | None:
    key: bytes | None = None

    async def run() -> None:
        nonlocal key
        async for item in replica.generate(_call()):
            if isinstance(item, Finished):
                key = item.completion.stats.key
                order.append("finished")
                on_finished.set()

    asyncio.run(run())
    return key


def test_a_reply_ends_only_once_its_finish_row_is_in_a_shared_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replica = EngineReplica(
        stub_settings(cache_dir=tmp_path, cluster_save_wait_s=30.0), replica_id="r1"
    )
    try:
        assert replica.durable.wait_s == 30.0  # the disk tier: every replica of the node reads it
        order: list[str] = []
        # The finish save is held until the reply ended (old behaviour) or the replica waits
        # for it: whichever comes first releases it, so the test never hangs on either.
        go = threading.Event()
        core = replica.engine.cache._core  # type: ignore[attr-defined]
        store_row = core.store_row

        def slow_store(key: bytes, request: SaveRequest, *args: object) -> object:
            if request.reason is not SaveReason.FINISH:
                return store_row(key, request, *args)
            assert go.wait(30.0)  # a bound, not a synchronisation by time
            out = store_row(key, request, *args)
            order.append("published")
            return out

        monkeypatch.setattr(core, "store_row", slow_store)
        settled = replica.durable._settled
        seen_running: list[object] = []

        def waiting(key: bytes, timeout_s: float) -> bool:
            # Still in flight: the replica says which conversation runs here (/cluster).
            seen_running.append(replica.record_routing_stats()["running"])
            go.set()
            return settled(key, timeout_s)

        monkeypatch.setattr(replica.durable, "_settled", waiting)
        key = _drive(replica, go, order)
        assert key is not None
        assert order == ["published", "finished"]
        assert seen_running == [[chat_chain("a", MESSAGES)[-1]]]
        assert replica.record_routing_stats()["running"] == []
        assert replica.engine.cache.lookup_exact(key) is not None
        durable = replica.record_routing_stats()["durable"]
        assert isinstance(durable, dict)
        assert (durable["waited"], durable["late"]) == (1, 0)
    finally:
        replica.engine.close()


def test_a_replica_of_its_own_tier_alone_or_told_not_to_does_not_wait(tmp_path: Path) -> None:
    ram = EngineReplica(stub_settings(), replica_id="r1")
    try:
        assert ram.durable.wait_s == 0.0  # its RAM dies with it: nothing to wait for
        key = _drive(ram, threading.Event(), [])
        assert key is not None
        assert ram.record_routing_stats()["durable"] == {
            "wait_s": 0.0, "waited": 0, "late": 0, "wait_ms_mean": 0.0, "wait_ms_max": 0.0
        }  # fmt: skip
    finally:
        ram.engine.close()
    off = EngineReplica(stub_settings(cache_dir=tmp_path, cluster_save_wait_s=0), replica_id="r2")
    try:
        assert off.durable.wait_s == 0.0
    finally:
        off.engine.close()


def test_a_negative_wait_is_refused() -> None:
    with pytest.raises(ConfigError, match="cluster_save_wait_s"):
        stub_settings(cluster_save_wait_s=-1.0).check()


def test_a_call_cancelled_while_its_generation_starts_cancels_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client left (Ray cancels the replica's call) while the generation was being
    started off the loop (tokenizing, a parent_key wait, admission): the stream that start
    makes must not run unobserved to ``max_tokens`` in a slot (found by review)."""
    monkeypatch.setenv("KVWARM_STUB_DECODE_DELAY_S", "0.05")  # 200 tokens: 10 s uncancelled
    replica = EngineReplica(stub_settings(), replica_id="r1")
    entered, release, made = threading.Event(), threading.Event(), threading.Event()
    started: list[object] = []
    start = replica._start

    def held_start(call: Generate) -> object:
        entered.set()
        release.wait(10)
        stream = start(call)
        started.append(stream)
        made.set()
        return stream

    monkeypatch.setattr(replica, "_start", held_start)
    long = dataclasses.replace(_call(), options=GenerationOptions(max_tokens=200, ignore_eos=True))

    async def run() -> str:
        gen = replica.generate(long)
        await gen.__anext__()  # Served
        pending = asyncio.ensure_future(gen.__anext__())
        await asyncio.to_thread(entered.wait, 10)
        pending.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await pending
        release.set()
        assert await asyncio.to_thread(made.wait, 10)
        stream = started[0]
        assert isinstance(stream, CompletionStream)
        done = await asyncio.wait_for(stream.aresult(), 5.0)
        return done.stats.finish_reason

    try:
        assert asyncio.run(run()) == "cancelled"
        assert replica.in_flight == 0 and not replica.running
    finally:
        replica.engine.close()


def test_a_replicas_time_to_first_token_lapses_when_nothing_measured_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Routers rank a replica whose reported time to first token is over 3x the median last,
    so it gets no request that could measure it again: one slow spell (a few long cold
    prompts) kept it out of rotation for good (found by review). The measure lapses after
    ``TTFT_FRESH_S`` and the next request measures afresh, not blended with the stale one."""
    from kvwarm.cluster import replica as replica_module

    now = [1000.0]
    monkeypatch.setattr(replica_module, "_clock", lambda: now[0])
    fresh_s = replica_module.TTFT_FRESH_S
    replica = EngineReplica(stub_settings(), replica_id="r1")
    try:
        assert replica.record_routing_stats()["ttft_ms"] is None  # nothing measured yet
        _drive(replica, threading.Event(), [])
        replica.ttft_ms = 60_000.0  # as a slow spell left it
        assert replica.record_routing_stats()["ttft_ms"] == 60_000.0
        now[0] += fresh_s / 2
        assert replica.record_routing_stats()["ttft_ms"] == 60_000.0  # still recent
        now[0] += fresh_s
        assert replica.record_routing_stats()["ttft_ms"] is None  # lapsed: ranked as any
        ttft: list[float] = []

        async def run() -> None:
            async for item in replica.generate(_call()):
                if isinstance(item, Finished):
                    ttft.append(item.completion.stats.ttft_ms)

        asyncio.run(run())
        assert replica.record_routing_stats()["ttft_ms"] == ttft[0]  # not blended with 60 s
    finally:
        replica.engine.close()
