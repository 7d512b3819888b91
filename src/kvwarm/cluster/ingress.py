"""The cluster's HTTP ingress: ``kvwarm serve``'s app (``server.create_app``) whose models are
proxies for the engine deployment (``remote.RemoteModel``).

Invariants: the routes, guard, errors, metrics and keep-alive are the server's own; only the
state differs: ``IngressState`` loads no model, it asks a replica for each model's info and
then serves it through the handle (tokenizing each prompt for the router with the model's
vocabulary alone, ``tokens.PromptTokens``), and answers ``GET /cluster`` from the index of the
replicas' cache events it shares with the router in this process. Cache administration
(``/cache/*`` except keep-alive) is per replica and answers 501 here. Every generation's
response names the replica that served it in ``x-kvwarm-replica``. Load is shed here, not in
the replicas (Ray queues past its per-replica cap without bound): ``max_in_flight`` per model,
by the replicas running and the model's ``max_queue``. A prewarm goes to every replica
running; one that joins later gets the kept prefixes, once, when the router's index learns it
runs or, during a model's attach, once that is done (``_warm_joined``, ``_attach``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvwarm.cluster.calls import Failed, Generate, ModelOp
from kvwarm.cluster.remote import ModelMemory, OpCall, OpDeadlines, RemoteModel, ResponseStream
from kvwarm.cluster.routing import ClusterIndex
from kvwarm.cluster.tokens import PromptTokens
from kvwarm.engine.cancel import Cancellation
from kvwarm.engine.types import ModelInfo
from kvwarm.server.app import create_app
from kvwarm.server.errors import HTTPError
from kvwarm.server.metrics import Snapshot
from kvwarm.server.state import ServerState
from kvwarm.settings import Settings
from kvwarm.settings.model import max_queue as model_max_queue

if TYPE_CHECKING:
    from kvwarm.engine.api import Engine
    from kvwarm.server.registry import ModelEntry
    from kvwarm.server.served import ServedModel

log = logging.getLogger("kvwarm.cluster.ingress")

REPLICA_HEADER = b"x-kvwarm-replica"
# The replicas that served the current HTTP request (set per request by ``_ServedBy``).
_served_by: ContextVar[list[str] | None] = ContextVar("kvwarm_served_by", default=None)


def _note_served(replica_id: str) -> None:
    holder = _served_by.get()
    if holder is not None:
        holder.append(replica_id)


class Calls(Protocol):
    """The ways the ingress reaches the engine deployment (``deploy.HandleCalls``)."""

    def replicas(self) -> Sequence[str]:
        """The ids of the replicas running now (a prewarm goes to each); empty if unknown."""
        ...

    def stream(self, call: Generate) -> ResponseStream: ...

    def op(self, op: ModelOp, cancel: Cancellation | None = None) -> object:
        """The op's answer; ``ReplicaTimeoutError`` (the call cancelled) once ``op.timeout_s``
        passed without one; ``RequestCancelledError`` (the call cancelled) once ``cancel`` is
        cancelled."""
        ...


class IngressState(ServerState):
    def __init__(self, settings: Settings, calls: Calls, index: ClusterIndex | None = None) -> None:
        """``index``: the router's index of the replicas' cache events in this process
        (``routing.index_for``); a fresh one when None (tests, no router)."""
        super().__init__(settings)
        self.calls = calls
        self.index = index if index is not None else ClusterIndex()
        self._tokenizers: dict[str, PromptTokens | None] = {}
        self._tokenizers_lock = threading.Lock()
        # Per model id, kept across detach and reattach (``ModelMemory``); guarded by
        # ``_tokenizers_lock``.
        self._memories: dict[str, ModelMemory] = {}
        # A replica that starts later (a replacement, a scale-up) gets the kept prefixes at
        # once, not at the keep-alive's next re-warm: one at a time, off the router's loop.
        self._joins = ThreadPoolExecutor(1, thread_name_prefix="kvwarm-join-prewarm")
        # A replica that joins while a model is being attached: after the attach's fan-out
        # read the running replicas, before the model is ready. Guarded by ``_attach_lock``:
        # per model id being attached, the replicas that joined meanwhile (warmed when it is
        # attached); per model id, the replicas its last attach's fan-out read (warmed by it)
        # and the model it built (ready a moment later); the replicas whose join was handled.
        self._attach_lock = threading.Lock()
        self._attaching: dict[str, set[str]] = {}
        self._handled: set[str] = set()
        self._fanned: dict[str, set[str]] = {}
        self._attached: dict[str, RemoteModel] = {}
        # Whether the router has reported a replica running yet (``_running_count``).
        self._seen_running = False
        self._stop_joins = self.index.on_joined(self._replica_joined)
        with self._attach_lock:  # those running already were announced before we listened
            self._handled.update(self.index.running())

    def _replica_joined(self, replica: str) -> None:
        if not self._closing.is_set():
            self._joins.submit(self._warm_joined, replica)

    def _warm_joined(self, replica: str) -> None:
        """Prewarm every kept prefix (``--prewarm-system``'s, the keep-alive's) of each model
        on ``replica``, once, best effort: a failure is logged and the keep-alive's re-warm
        still comes. A model being attached warms it once attached (``_attach``), unless its
        fan-out reached it; a model not attached warms every running replica when it is."""
        with self._attach_lock:
            self._handled.add(replica)
            for joined in self._attaching.values():
                joined.add(replica)
        warmed = 0
        for model_id in dict.fromkeys(e.model_id for e in self.keepalive.entries()):
            model = self._joinable(model_id, replica)
            if model is not None:
                warmed += self._warm_on(model, model_id, replica)
        if warmed:
            log.info("prewarmed %d kept prefix(es) on new replica %s", warmed, replica)

    def _joinable(self, model_id: str, replica: str) -> RemoteModel | None:
        """The model whose kept prefixes a replica that just joined gets now: the ready one,
        or the one an attach just built (not ready yet); None while it is being attached
        (``_attach`` warms the replica then) or if its attach's fan-out reached the replica
        (the index announces a replica just after it runs, so the fan-out may read it
        before its join is handled here)."""
        with self._attach_lock:
            if model_id in self._attaching:
                return None
            fanned = self._fanned.get(model_id, set())
            if replica in fanned:
                fanned.discard(replica)  # a later join of it is a return: warm it then
                return None
            model = self.ready_model(model_id)
            entry = self.entries.get(model_id)
            if model is None and entry is not None and entry.state == "loading":
                model = self._attached.get(model_id)
        return model if isinstance(model, RemoteModel) else None

    def _warm_on(self, model: RemoteModel, model_id: str, replica: str) -> int:
        """Every kept prefix of ``model_id`` on ``replica`` alone; how many were warmed."""
        warmed = 0
        for entry in self.keepalive.entries():
            if self._closing.is_set():
                break
            if entry.model_id != model_id:
                continue
            try:
                entry.warm(
                    functools.partial(model.prewarm, on=replica),
                    functools.partial(model.prewarm_chat, on=replica),
                )
                warmed += 1
            except Exception as exc:  # best effort: the keep-alive re-warms it later
                log.warning(
                    "prewarm of a kept prefix of %s on new replica %s failed: %s",
                    model_id,
                    replica,
                    exc,
                )
        return warmed

    def _load_all(self) -> None:
        for entry in self.entries.values():
            if self._closing.is_set():
                return
            try:
                model = self._attach(entry.id)
            except Exception as exc:  # a replica that cannot start: /health says why
                entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
                log.error("model %s is not served by the replicas: %s", entry.id, exc)
                continue
            entry.model, entry.state = model, "ready"
            log.info("model %s served by the engine replicas", entry.id)

    def _load_one(self, entry: ModelEntry) -> ServedModel:
        """The registry's loader at the ingress, which has no engine: attach the model the
        replicas serve again (an unload here, by an admin or the idle reaper, only detached
        it; the replicas keep it loaded). A model they do not serve fails at once with their
        error, never a wait for an engine the ingress will not have."""
        return self._attach(entry.id)

    def _attach(self, model_id: str) -> RemoteModel:
        """The model the replicas serve, as a ``RemoteModel``, its ``--prewarm-system``
        prompts warm on every running replica; a replica that joined meanwhile, after the
        fan-out read the running ones, gets every kept prefix of it once it is attached."""
        with self._attach_lock:
            self._attaching[model_id] = set()
            self._fanned.pop(model_id, None)
            self._attached.pop(model_id, None)
        fan_out = _FanOut(self.calls.replicas)
        try:
            model = self._attach_model(model_id, fan_out)
        except BaseException:
            with self._attach_lock:
                self._attaching.pop(model_id, None)
                fan_out.stop()
            raise
        # One step: a replica joining from here on is warmed by ``_warm_joined``.
        with self._attach_lock:
            joined = self._attaching.pop(model_id)
            read = fan_out.stop()
            missed = sorted(joined - read)
            # The fan-out's replicas whose join is still to be handled: that join warms
            # nothing of this model again.
            self._fanned[model_id] = read - self._handled
            self._attached[model_id] = model
        warmed = sum(self._warm_on(model, model_id, replica) for replica in missed)
        if missed:
            log.info(
                "model %s: prewarmed %d kept prefix(es) on %s, which joined as it was attached",
                model_id,
                warmed,
                ", ".join(missed),
            )
        return model

    def _attach_model(self, model_id: str, fan_out: _FanOut) -> RemoteModel:
        op_call: OpCall = self.calls.op
        deadlines = OpDeadlines.of(self.settings)
        info = op_call(ModelOp(model_id, "info", timeout_s=deadlines("info")))
        if isinstance(info, Failed):
            raise info.error
        assert isinstance(info, ModelInfo)
        tokenizer = self._tokenizer(model_id)
        memory = self._memory(model_id, info)
        spec = next((m for m in self.settings.models if m.model_id == model_id), None)
        queue = model_max_queue(self.settings, spec)

        def bound() -> int:  # at each admission: the replicas running then
            return max_in_flight(self.settings, info.n_parallel, queue, self._running_count())

        model = RemoteModel(
            info,
            self.calls.stream,
            op_call,
            _note_served,
            self.index,
            tokenizer,
            deadlines,
            replicas=fan_out.replicas,
            max_in_flight=bound,
            memory=memory,
        )
        self._prewarm_systems(model, model_id)
        return model

    def _running_count(self) -> int | None:
        """How many replicas the router reports running; None until it has reported one (at
        start-up, or with Ray's own router, which reports none). Once it has, 0 is that
        none runs now (all died), not that it is unknown."""
        running = len(self.calls.replicas())
        if running:
            self._seen_running = True
        return running if self._seen_running else None

    def _prewarm_systems(self, model: ServedModel, model_id: str) -> None:
        """``--prewarm-system`` on every replica: at start-up some may still be loading, so
        once the router knows any, wait (``cluster_call_timeout_s`` at most) until it knows
        ``replicas`` of them; a prewarm goes to each replica running then."""
        if self.settings.prewarm_system and self.index.running():
            wanted = self.settings.replicas
            running = self.index.wait_running(wanted, self.settings.cluster_call_timeout_s or None)
            if len(running) < wanted:
                log.warning(
                    "model %s: prewarming %d of %d replicas (the others are not running yet; "
                    "each is prewarmed as the router learns it runs)",
                    model_id,
                    len(running),
                    wanted,
                )
        super()._prewarm_systems(model, model_id)

    def _memory(self, model_id: str, info: ModelInfo) -> ModelMemory:
        """What an earlier attach of ``model_id`` remembered, if its file and configuration
        are the same now (a model detached by an idle or admin unload and attached again);
        else a fresh memory: rows of another model are never a parent."""
        spec = next((m for m in self.settings.models if m.model_id == model_id), None)
        identity = (
            info.path,
            info.fingerprint,
            info.fingerprint_mode,
            info.chat_template_name,
            info.adapters,
            info.n_ctx,
            info.memory,
            spec,
        )
        with self._tokenizers_lock:
            memory = self._memories.get(model_id)
            if memory is None or memory.identity != identity:
                if memory is not None:
                    log.info("model %s changed: its conversations' last rows are dropped", model_id)
                memory = self._memories[model_id] = ModelMemory(identity)
            return memory

    def _unload_one(self, entry: ModelEntry) -> None:
        """Detach (the replicas keep the model loaded): a replica joining now warms nothing of
        it; the next attach warms every running replica."""
        with self._attach_lock:
            self._attached.pop(entry.id, None)
            self._fanned.pop(entry.id, None)
        super()._unload_one(entry)

    def _tokenizer(self, model_id: str) -> PromptTokens | None:
        """The model's vocabulary, loaded here once (``tokens.PromptTokens``), or None."""
        with self._tokenizers_lock:
            if model_id not in self._tokenizers:
                spec = next((m for m in self.settings.models if m.model_id == model_id), None)
                self._tokenizers[model_id] = (
                    None if spec is None else PromptTokens.load(self.settings, spec)
                )
            return self._tokenizers[model_id]

    def close(self) -> None:
        self._stop_joins()
        super().close()
        self._joins.shutdown(wait=False, cancel_futures=True)
        with self._tokenizers_lock:
            for tokenizer in self._tokenizers.values():
                if tokenizer is not None:
                    tokenizer.close()
            self._tokenizers.clear()

    is_cluster = True

    def cluster_view(self) -> dict[str, object]:
        with self._tokenizers_lock:  # detached models' retries too
            retried = sum(m.retried for m in self._memories.values())
        ingress = {"pid": os.getpid(), "node": _node_id(), "retried": retried}
        return {
            "routing": self.settings.cluster_routing,
            "ingress": ingress,
            **self.index.describe(),
        }

    def require_engine(self) -> Engine:
        raise HTTPError(
            501,
            "cache administration is per replica in a cluster: ask a replica's own server",
            code="not_supported_in_cluster",
        )

    def metrics_snapshot(self) -> Snapshot:
        return Snapshot(
            states={e.id: e.state for e in self.entries.values()},
            keepalive_prefixes=len(self.keepalive.entries()),
        )


class _FanOut:
    """The running replicas as a model's prewarms read them, noting which while its attach
    runs (``stop``: the replicas its start-up fan-out reached)."""

    def __init__(self, running: Callable[[], Sequence[str]]) -> None:
        self._running = running
        self._read: set[str] | None = set()
        self._lock = threading.Lock()

    def replicas(self) -> Sequence[str]:
        running = self._running()
        with self._lock:
            if self._read is not None:
                self._read.update(running)
        return running

    def stop(self) -> set[str]:
        with self._lock:
            read, self._read = self._read or set(), None
        return read


def max_in_flight(
    settings: Settings, n_parallel: int, max_queue: int | None = None, running: int | None = None
) -> int:
    """The generations of one model the ingress holds at once before it answers 429
    ``queue_full``: what the replicas running now would hold as ``kvwarm serve`` each (their
    ``n_parallel`` slots plus the model's ``max_queue`` waiting; None: the global one). Ray
    lets only ``max(8, 4 x n_parallel)`` calls reach a replica and keeps the rest in its own
    queue, without bound, so the replicas' own queues never fill. ``running``: the replicas
    the router reports running (``Calls.replicas``); None (none reported yet, or no router in
    this process) counts ``--replicas``, as at the largest this bound is sized for. 0 (every
    replica the router knew died) counts one: what the first replacement will serve, never
    more than the live replicas allowed (found by review: 0 counted ``--replicas``, so with
    every replica dead the ingress let in more than with one alive, all of it waiting in Ray's
    queue for a replacement)."""
    queue = settings.max_queue if max_queue is None else max_queue
    replicas = settings.replicas if running is None else max(running, 1)
    return replicas * (n_parallel + queue)


def _node_id() -> str | None:
    import ray

    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None


class _ServedBy:
    """Pure ASGI: adds ``x-kvwarm-replica`` to a response a replica generated."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holder: list[str] = []
        token = _served_by.set(holder)

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start" and holder:
                headers = [*message.get("headers", []), (REPLICA_HEADER, holder[-1].encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            _served_by.reset(token)


def create_ingress_app(
    settings: Settings, calls: Calls, index: ClusterIndex | None = None
) -> FastAPI:
    app = create_app(settings, IngressState(settings, calls, index))
    app.add_middleware(_ServedBy)
    return app
