"""The engine deployment's body: one kvwarm ``Engine`` serving the configured models.

Invariants: a replica is a plain ``Engine`` (the same settings, the same cache tiers as
``kvwarm serve``); Ray only constructs it and calls its methods. Every ``generate`` answers
``Served`` first, then fragments, then exactly one ``Finished`` or ``Failed`` (``calls``); a
cancelled call (the client left) cancels the engine stream, or an embedding's or a rerank's
remaining work (``engine.cancel``). A replica reports, through
``record_routing_stats``, the tail of its cache's event log (``eventlog.EventLog``: rows its
tiers gain and lose, live slots, chain links; the whole state on ``snapshot``), the chain
hashes of the requests it finished (bounded, most recent first, for the ``prefix`` policy),
its node, process, load and recent time to first token: what ``routing`` decides by; the
same call refreshes its load gauges in Ray's metrics (``gauges``).

Durability: where the save tier is one other replicas read (``facts.place``: a node or a
cluster scope), a reply's ``Finished`` goes out only once its finish row is published there,
or ``cluster_save_wait_s`` passed (``DurableSaves``): the ingress ends the response on
``Finished``, so a turn the client saw end survives this replica's death as a row another
replica restores by its key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from kvwarm.cluster.calls import (
    Failed,
    Finished,
    Generate,
    ModelOp,
    Prompted,
    Served,
    SnapshotCall,
    StreamItem,
)
from kvwarm.cluster.eventlog import EventLog
from kvwarm.cluster.gauges import ReplicaGauges
from kvwarm.cluster.routing import WarmSet
from kvwarm.cluster.routing.facts import encode_namespace, place
from kvwarm.engine.cancel import Cancellation
from kvwarm.engine.ops import CALLS, CANCELLABLE
from kvwarm.errors import (
    InvalidRequestError,
    KvwarmError,
    ReplicaUnavailableError,
    UnknownModelError,
)
from kvwarm.server import budget
from kvwarm.settings import Settings, model_config
from kvwarm.settings.cache import save_tier

if TYPE_CHECKING:
    from kvwarm.engine.api import Model
    from kvwarm.engine.stream import CompletionStream

log = logging.getLogger("kvwarm.cluster.replica")

# How many chain hashes a replica reports (most recent first): a few hundred conversations
# of a dozen turns. The stats travel to every router each period, so they stay small.
REPORTED_HASHES = 4096
_TTFT_WEIGHT = 0.2  # exponential moving average: about the last five requests
# A time to first token measured longer ago than this is not reported: routers rank a replica
# they take to be slow last, so it gets no request that could measure it again, and a stale
# measure would keep it there for good. Once it lapses the replica is ranked by its load and
# cache again; the next request it finishes measures afresh (the old average is dropped).
TTFT_FRESH_S = 30.0
_clock = time.monotonic


def replica_name() -> str:
    """This replica's id, as the router and ``ray.get_actor(..., namespace="serve")`` know it."""
    from ray import serve

    return str(serve.get_replica_context().replica_id.to_full_id_str())


def node_name() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    import ray

    if not ray.is_initialized():
        return None
    return str(ray.get_runtime_context().get_node_id())


class DurableSaves:
    """Waits for a reply's finish row to be published in a tier other replicas read, before
    the reply ends; counts the waits (``record_routing_stats``: ``durable``)."""

    def __init__(self, settled: Callable[[bytes, float], bool], wait_s: float) -> None:
        self._settled = settled
        self.wait_s = wait_s  # 0: the save tier is this replica's own, or waiting is off
        self.waited = 0  # replies that waited
        self.late = 0  # ... whose row was not published in time (dropped, failed, slow)
        self.wait_ms_total = 0.0
        self.wait_ms_max = 0.0

    async def wait(self, key: bytes | None) -> bool:
        """Whether the row of ``key`` is published (True at once when nothing is waited for)."""
        if key is None or self.wait_s <= 0:
            return True
        t0 = time.perf_counter()
        ok = await asyncio.to_thread(self._settled, key, self.wait_s)
        ms = (time.perf_counter() - t0) * 1e3
        self.waited += 1
        self.wait_ms_total += ms
        self.wait_ms_max = max(self.wait_ms_max, ms)
        if not ok:
            self.late += 1
            log.info("finish row %s not published after %.0f ms", key.hex()[:16], ms)
        return ok

    def stats(self) -> dict[str, float]:
        mean = self.wait_ms_total / self.waited if self.waited else 0.0
        return {
            "wait_s": self.wait_s,
            "waited": self.waited,
            "late": self.late,
            "wait_ms_mean": round(mean, 3),
            "wait_ms_max": round(self.wait_ms_max, 3),
        }


def _cancel_started(starting: asyncio.Future[CompletionStream]) -> None:
    """Cancel the stream a start made after its call was cancelled (if it made one)."""
    if not starting.cancelled() and starting.exception() is None:
        starting.result().cancel()


def _portable(exc: BaseException) -> BaseException:
    """An error the ingress can unpickle and map by type (``server/errors.py``). An
    unexpected one is logged here, with its traceback, and crosses as a 500 that names no
    internals, as ``kvwarm serve`` answers it (found by review: its message, paths and all,
    reached the client)."""
    if isinstance(exc, KvwarmError):
        return exc
    log.error("unexpected error in a replica call", exc_info=exc)
    return KvwarmError(f"internal server error ({type(exc).__name__} in a replica; see its log)")


def _not_here(op: str, meant_for: str, replica_id: str) -> ReplicaUnavailableError:
    """A call meant for another replica: the router sends one here only when Ray no longer
    runs that one (``router._pinned``)."""
    return ReplicaUnavailableError(
        f"{op} for replica {meant_for} reached {replica_id}: {meant_for} is not running"
    )


class EngineReplica:
    def __init__(self, settings: Settings, replica_id: str | None = None) -> None:
        from kvwarm.cluster.loopback import keep_replica_grpc_on_loopback
        from kvwarm.engine.api import Engine, EngineConfig

        keep_replica_grpc_on_loopback()
        self.settings = settings
        self.replica_id = replica_id or replica_name()
        self.engine = Engine(EngineConfig(cache=settings.cache_config(), backend=settings.backend))
        self.models: dict[str, Model] = {}
        try:
            for spec in settings.models:
                self.models[spec.model_id] = self.engine.load_model(
                    spec.path, model_id=spec.model_id, config=model_config(settings, spec)
                )
            # ``memory_budget`` per replica, as ``serve`` applies it: MemoryBudgetError if
            # the models do not fit, else the RAM tier gets what is left.
            memories = [budget.memory_of(mid, m) for mid, m in self.models.items()]
            budget.apply(
                self.engine.cache,
                budget.plan(settings.memory_budget, memories, settings.cache_config().tiers),
            )
        except BaseException:
            self.engine.close()
            raise
        self.warm = WarmSet(REPORTED_HASHES)
        places = {name: place(caps) for name, caps in self.engine.cache.tier_capabilities().items()}
        slots = sum(m.info().n_parallel for m in self.models.values())
        self.events = EventLog(places, slots=slots)
        self.engine.cache.watch_rows(self.events)  # rows already indexed are told first
        scope, _source = places.get(save_tier(settings), ("replica", "memory"))
        wait_s = settings.cluster_save_wait_s if scope != "replica" else 0.0
        self.durable = DurableSaves(self.engine.cache.settled, wait_s)
        self.node = node_name()
        self.gauges = ReplicaGauges()
        self.ttft_ms: float | None = None
        self._ttft_at: float | None = None  # when ``ttft_ms`` was last measured (``_clock``)
        self.in_flight = 0
        # The chain ends of the generations running here (``/cluster`` shows where each
        # conversation's request runs now).
        self.running: Counter[str] = Counter()
        log.info("replica %s ready: %s", self.replica_id, ", ".join(self.models))

    def _model(self, model_id: str) -> Model:
        model = self.models.get(model_id)
        if model is None:
            raise UnknownModelError(f"the model {model_id!r} does not exist")
        return model

    def _start(self, call: Generate) -> CompletionStream:
        model = self._model(call.model_id)
        if call.kind == "chat":
            return model.stream_chat(
                call.messages, tools=call.tools, options=call.options, prefill=call.prefill
            )
        if call.kind == "text":
            return model.stream(call.prompt, call.options)
        return model.submit(call.prompt, call.options)

    async def generate(self, call: Generate) -> AsyncIterator[StreamItem]:
        yield Served(self.replica_id)
        self.in_flight += 1
        end = call.chain[-1] if call.chain else None
        if end is not None:
            self.running[end] += 1
        try:
            # Tokenizing, templating and a parent_key wait run off the replica's event loop.
            # Ray cancels this call when the client leaves: the stream the thread goes on to
            # start is then cancelled once it exists, never left to run unread.
            starting = asyncio.ensure_future(asyncio.to_thread(self._start, call))
            try:
                stream = await asyncio.shield(starting)
            except asyncio.CancelledError:
                starting.add_done_callback(_cancel_started)
                raise
            except Exception as exc:
                yield Failed(_portable(exc))
                return
            try:
                prompted = False
                async for fragment in stream:
                    # Prefilled before the first fragment: its prompt logprobs, if asked for.
                    if not prompted and stream.prompt_logprobs is not None:
                        prompted = True
                        yield Prompted(tuple(stream.prompt_tokens), stream.prompt_logprobs)
                    yield fragment
                done = await stream.aresult()
            except Exception as exc:
                yield Failed(_portable(exc))
                return
            finally:
                if not stream.done:  # cancelled by Ray (the client left), or a failed yield
                    stream.cancel()
            if done.stats.finish_reason != "cancelled":
                await self.durable.wait(done.stats.key)
                self.warm.add(call.chain)
                n_tokens = done.stats.prompt_tokens + done.stats.completion_tokens
                self.events.served(call.chain, done.stats.key, n_tokens)
                ttft = done.stats.ttft_ms
                prev = self.recent_ttft_ms()
                self.ttft_ms = ttft if prev is None else prev + _TTFT_WEIGHT * (ttft - prev)
                self._ttft_at = _clock()
            yield Finished(done)
        finally:
            self.in_flight -= 1
            if end is not None:
                self.running[end] -= 1
                if self.running[end] <= 0:
                    del self.running[end]

    async def call(self, op: ModelOp) -> object:
        """Anything but a generation; runs off the event loop. Errors come back as
        ``Failed`` (the ingress re-raises them). Ray cancels this call when the ingress
        does (its client left, or its deadline passed): an embedding's or a rerank's
        remaining work is then cancelled too, not left running in the thread."""
        cancel = Cancellation()
        if op.op in CANCELLABLE:
            op = dataclasses.replace(op, kwargs={**op.kwargs, "cancel": cancel})
        try:
            return await asyncio.to_thread(self._call, op)
        except asyncio.CancelledError:
            cancel.cancel()
            raise
        except Exception as exc:
            return Failed(_portable(exc))

    def _call(self, op: ModelOp) -> object:
        """Any of the model's non-streaming operations, by name (``engine.ops.CALLS``): a
        new operation declared there needs nothing here."""
        if op.op not in CALLS:
            raise InvalidRequestError(f"a replica has no operation {op.op!r}")
        if op.replica is not None and op.replica != self.replica_id:  # its replica is gone
            raise _not_here(op.op, op.replica, self.replica_id)
        model = self._model(op.model_id)
        result = getattr(model, op.op)(*op.args, **op.kwargs)
        if op.op in ("prewarm", "prewarm_chat"):
            self.warm.add(op.chain)
            key = getattr(result, "key", None)
            self.events.served(op.chain, key if isinstance(key, bytes) else None, 0)
        return result

    async def snapshot(self, call: SnapshotCall) -> dict[str, object]:
        """Everything this replica's cache events add up to (a router missed some)."""
        if call.replica_id != self.replica_id:  # its replica is gone
            raise _not_here("snapshot", call.replica_id, self.replica_id)
        return self.events.snapshot()

    def record_routing_stats(self) -> dict[str, object]:
        statuses = [m.status() for m in self.models.values()]
        self.gauges.update(statuses)  # Ray asks every period: the gauges' refresh too
        return {
            "warm": self.warm.recent(),
            "events": self.events.report(),
            "node": self.node,
            "pid": os.getpid(),
            "slots": self.events.slots,
            "in_flight": self.in_flight,
            "running": sorted(self.running),
            "queued": sum(s.queued for s in statuses),
            "free_slots": sum(s.free_slots for s in statuses),
            "ttft_ms": self.recent_ttft_ms(),
            "models": sorted(self.models),
            "cache": self._cache_sizes(),
            "durable": self.durable.stats(),
            # Each model's cache namespace: the router keys a prompt's chunks in it.
            "namespaces": {mid: encode_namespace(m.namespace()) for mid, m in self.models.items()},
        }

    def recent_ttft_ms(self) -> float | None:
        """The average time to first token, if measured within ``TTFT_FRESH_S``; else None."""
        if self._ttft_at is None or _clock() - self._ttft_at > TTFT_FRESH_S:
            return None
        return self.ttft_ms

    def _cache_sizes(self) -> dict[str, dict[str, float]]:
        """Per tier: rows, chunks, bytes and quota, as this replica's cache counts them."""
        counters = self.engine.cache.counters()
        return {
            tier: {
                field: counters.get(f"tier_{tier}_{field}", 0.0)
                for field in ("rows", "chunks", "bytes", "quota_bytes")
            }
            for tier in self.engine.cache.tier_names()
        }

    def check_health(self) -> None:
        for model in self.models.values():
            if model.status().state != "ready":
                raise KvwarmError(f"model {model.id} is {model.status().state}")

    def __del__(self) -> None:
        # Ray Serve calls this on a graceful shutdown: flush the cache (pending saves).
        if getattr(self, "engine", None) is not None and not getattr(self, "_closed", False):
            self._closed = True
            self.engine.close()
