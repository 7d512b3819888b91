"""Everything one server instance owns: the engine, its model registry, its metrics.

Invariants: there is no module-level state; one ``ServerState`` lives on ``app.state`` and is
built by ``create_app``. Configured models load on a background thread after the server is
listening, so ``/health`` answers 503 until that is done; a request names its model (an id or
an alias) and the registry (``server/registry.py``) finds, loads or refuses it. If every
configured model failed and nothing else can be served, ``on_fatal`` is told why (``kvwarm
serve`` then exits non-zero with that reason).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request

from kvwarm import models_dir
from kvwarm.cache.types import TtlClass
from kvwarm.errors import (
    KvwarmError,
    MemoryBudgetError,
    ModelLoadError,
    ServerShuttingDownError,
    UnknownModelError,
)
from kvwarm.server import budget, tenancy
from kvwarm.server.budget import CacheOwner, ModelMemory
from kvwarm.server.errors import HTTPError
from kvwarm.server.keepalive import KeepAlive, KeepAliveLimits
from kvwarm.server.lora import LoraChoice, LoraTable
from kvwarm.server.metrics import ServerMetrics, Snapshot
from kvwarm.server.registry import ModelEntry, ModelRegistry, keep_alive_seconds
from kvwarm.server.responses.store import ResponseStore
from kvwarm.server.served import stalled_for
from kvwarm.server.totals import ModelTotals
from kvwarm.settings import Settings, model_config

if TYPE_CHECKING:
    from kvwarm.engine.api import Engine
    from kvwarm.server.generate import BlockingCall, Generation
    from kvwarm.server.served import ServedModel

log = logging.getLogger("kvwarm.server")


class ServerState:
    def __init__(self, settings: Settings, on_fatal: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.started = time.time()
        self.engine: Engine | None = None
        self.engine_error: str | None = None
        self.on_fatal = on_fatal
        self.registry = ModelRegistry(settings, self._load_one, self._unload_one)
        # The configured LoRA adapters, their ids and global scales (server/lora.py).
        self.lora = LoraTable(settings)
        # The registry's dict: read-only views for routes and metrics.
        self.entries: dict[str, ModelEntry] = self.registry.entries
        self.default_id = self.registry.default_id
        # Set once the engine exists (or failed to): on-demand loads wait for it.
        self._engine_known = threading.Event()
        # Each model's running totals over the server's lifetime, its unloads included.
        self.totals = ModelTotals()
        # Counts requests and finished generations; reads the engine at scrape time.
        self.counters = ServerMetrics(self.metrics_snapshot)
        # Strong references to fire-and-forget tasks (the loop keeps only weak ones).
        self.background: set[asyncio.Task[None]] = set()
        # Generations being served (event loop only), so shutdown can end them with an error.
        self.streams: set[Generation] = set()
        # Reranks and embeddings being served (``run_cancellable``; event loop only): ended
        # by shutdown as the generations are.
        self.blocking_calls: set[BlockingCall] = set()
        self.draining: KvwarmError | None = None  # set once shutdown ended the streams
        ttl = settings.cache_config().ttl_seconds
        limits = KeepAliveLimits(
            settings.keepalive_max_entries,
            settings.keepalive_max_tokens,
            settings.keepalive_max_age_s,
        )
        self.keepalive = KeepAlive(
            ttl,
            settings.keepalive_stale_fraction,
            limits=limits,
            interval_s=settings.keepalive_interval_s,
        )
        # Responses API objects kept for previous_response_id (bounded, in memory).
        self.responses = ResponseStore()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        # The memory budget (server/budget.py): the models admitted under it and the plan
        # the RAM tier is sized by, changed together under their own lock.
        self._budget_lock = threading.Lock()
        self._admitted: dict[str, ModelMemory] = {}
        self.memory = budget.plan(0, [], settings.cache_config().tiers)

    # --- lifecycle ---------------------------------------------------------------------------

    def drain(self, after_s: float) -> None:
        """Shutdown began (event loop): the generations still running ``after_s`` seconds
        from now, just before uvicorn's graceful wait ends and it cancels whatever is left,
        are ended with ``ServerShuttingDownError``, so each stream ends with an error event
        in its API's shape instead of being cut mid-reply (issue 41); later ones at once.
        Reranks and embeddings still running are cancelled then too (their work not yet done
        dropped, as at a disconnect) and answered 503 ``shutting_down`` (found by review:
        they ran on until uvicorn cancelled their handlers, their threads still in the model
        as the engine closed)."""

        def cut() -> None:
            error = ServerShuttingDownError(
                "the server is shutting down; retry on another instance or later"
            )
            self.draining = error
            streams, calls = list(self.streams), list(self.blocking_calls)
            if streams or calls:
                log.warning(
                    "shutdown: ending %d generations and %d reranks or embeddings still running",
                    len(streams),
                    len(calls),
                )
            for gen in streams:
                gen.cut(error)
            for call in calls:
                call.cut(error)

        asyncio.get_running_loop().call_later(max(0.0, after_s), cut)

    def start(self) -> None:
        """Start loading in the background (and the keep-alive); returns at once."""
        loader = threading.Thread(target=self._load_all, name="kvwarm-loader", daemon=True)
        self._threads.append(loader)
        loader.start()
        if self.settings.keepalive_interval_s > 0:
            keeper = threading.Thread(
                target=self._keepalive_loop, name="kvwarm-keepalive", daemon=True
            )
            self._threads.append(keeper)
            keeper.start()
        # Always: a request's keep_alive may unload a model even with model_idle_unload_s 0.
        reaper = threading.Thread(target=self._idle_loop, name="kvwarm-idle", daemon=True)
        self._threads.append(reaper)
        reaper.start()

    def _load_all(self) -> None:
        from kvwarm.engine.api import Engine, EngineConfig

        try:
            # A budget the in-memory tiers alone pass is refused before anything is built.
            first = budget.plan(self.settings.memory_budget, [], self.settings.cache_config().tiers)
            engine = Engine(
                EngineConfig(cache=self.settings.cache_config(), backend=self.settings.backend)
            )
            self._apply_plan(engine, first)
        except KvwarmError as exc:
            log.error("cannot start the engine: %s", exc)
            self.engine_error = str(exc)
            for entry in self.entries.values():
                entry.state, entry.error = "failed", f"engine failed to start: {exc}"
            self._engine_known.set()
            self._startup_finished(f"the engine failed to start: {exc}")
            return
        with self._lock:
            if self._closing.is_set():
                engine.close()
                return
            self.engine = engine
        self._engine_known.set()
        tiers = ", ".join(
            f"{t.name} {t.quota_bytes / 2**30:.1f} GiB" + (f" at {t.root}" if t.root else "")
            for t in self.settings.cache_config().tiers
        )
        log.info("cache tiers: %s; new rows go to %s", tiers, self.settings.effective_save_tier())
        for entry in [e for e in self.entries.values() if e.source == "configured"]:
            if self._closing.is_set():
                return
            self.registry.load_now(entry)
        self._startup_finished(self.registry.startup_failure())

    @property
    def startup_done(self) -> bool:
        """Every configured model has been tried: each is ready or failed (or was since
        unloaded, or is loading again because a request asked for it)."""
        entries = [e for e in list(self.entries.values()) if e.source == "configured"]
        return all(e.state != "loading" or e.on_demand for e in entries)

    def _startup_finished(self, failure: str | None) -> None:
        if failure is not None and not self._closing.is_set():
            log.error("no model could be loaded: %s", failure)
            if self.on_fatal is not None:
                self.on_fatal(failure)

    def _load_one(self, entry: ModelEntry) -> ServedModel:
        """The registry's loader: load ``entry`` into the engine (raises on failure)."""
        self._engine_known.wait(timeout=600)  # a request may ask before the engine exists
        engine = self.require_engine()
        started = time.perf_counter()
        log.info("loading model %s (%s)", entry.id, entry.spec.path or "default")
        path = entry.spec.path
        config = model_config(self.settings, entry.spec)
        # The models_dir files, when they are read through other paths (``pinned``).
        named: Path | None = None
        named_projector: str | None = None
        with ExitStack() as stack:
            if entry.source == "models_dir" and self.settings.models_dir is not None and path:
                directory = self.settings.models_dir
                path = str(models_dir.checked_path(directory, Path(path)))
                # What else the name opens, checked as the model is (found by review: a
                # projector or a part swapped for a symlink after the scan was followed), then
                # all opened once: llama.cpp reads those files, whatever the names point to
                # by the time it opens them (found by review: a symlink swapped in after the
                # check was followed).
                projector = dict(entry.spec.options).get("mmproj")
                others = [*models_dir.parts(Path(path)), *([projector] if projector else [])]
                for other in others:
                    models_dir.checked_path(directory, Path(str(other)))
                files = [Path(path), *(Path(str(o)) for o in others)]
                opened = stack.enter_context(models_dir.pinned(directory, files))
                named, path = Path(path), str(opened[Path(path)])
                if projector:
                    named_projector = str(projector)
                    config = replace(config, mmproj=str(opened[Path(named_projector)]))
            model = engine.load_model(
                path,
                model_id=entry.id,
                config=config,
                progress=lambda _fraction: not self._closing.is_set(),
            )
        if named is not None:  # what it shows is the file's name, not the path it was read by
            model.path = named
            model.mmproj_path = named_projector
        try:
            self._admit_evicting(engine, entry, model)
        except KvwarmError:
            engine.unload_model(entry.id)  # loaded only to learn its sizes: it does not fit
            raise
        self._prewarm_systems(model, entry.id)
        log.info("model %s ready in %.0f ms", entry.id, (time.perf_counter() - started) * 1000)
        return model

    def _unload_one(self, entry: ModelEntry) -> None:
        engine = self.engine
        if engine is not None and entry.model is not None:
            try:
                engine.unload_model(entry.id)
            finally:
                # Its counts live on in the server's totals: its worker has stopped (or died),
                # so they are final, and the registry forgets the model next. Nor does the
                # budget count it any more, whatever the unload raised (found by review: a
                # failed free kept the model, unloaded for the registry and the engine, in
                # the budget and in /cache/stats, its memory refused to every later load).
                self.totals.retire(entry.id, entry.model)
                self._release(engine, entry.id)

    def _release(self, engine: Engine, model_id: str) -> None:
        """The budget without ``model_id``: the RAM tier grows by what it held (past the
        budget still, as ``remeasure`` may leave it, the RAM tier stays empty)."""
        with self._budget_lock:
            self._admitted.pop(model_id, None)
            self._apply_plan(engine, self._plan_or_over(self._admitted))

    # --- the memory budget ---------------------------------------------------------------------

    def _plan(self, models: Iterable[ModelMemory]) -> budget.MemoryPlan:
        tiers = self.settings.cache_config().tiers
        return budget.plan(self.settings.memory_budget, list(models), tiers)

    def _admit(self, engine: Engine, model_id: str, model: ServedModel) -> None:
        """Count a loaded model against the budget and shrink the RAM tier to what is left;
        ``MemoryBudgetError`` (nothing changed) if it does not fit."""
        memory = budget.memory_of(model_id, model)
        with self._budget_lock:
            admitted = {**self._admitted, model_id: memory}
            self._apply_plan(engine, self._plan(admitted.values()))
            self._admitted = admitted

    def _admit_evicting(self, engine: Engine, entry: ModelEntry, model: ServedModel) -> None:
        """``_admit``; for a load a request asked for, unloading idle models that are not
        pinned, least recently used first, while the budget has no room for ``model`` (as
        Ollama makes room for the model a request names); ``MemoryBudgetError`` once there is
        none to unload. The configured models loading at startup never unload each other."""
        while True:
            try:
                self._admit(engine, entry.id, model)
                return
            except MemoryBudgetError:
                if not entry.on_demand:
                    raise
                self._fits_without_idle(entry, model)
                victim = self.registry.memory_victim(entry)
                if victim is None:
                    raise
                self.registry.finish_unload(victim)

    def _fits_without_idle(self, entry: ModelEntry, model: ServedModel) -> None:
        """``MemoryBudgetError`` (the arithmetic of what would stay) unless ``model`` fits
        once every model the budget may unload for it is unloaded. Found by review: a model
        that could never fit (larger than the budget alone, or beside the pinned and busy
        ones) unloaded every idle model first, then was refused all the same."""
        idle = self.registry.memory_candidates(entry)
        with self._budget_lock:
            staying = [m for mid, m in self._admitted.items() if mid not in idle | {entry.id}]
        self._plan([*staying, budget.memory_of(entry.id, model)])

    def remeasure(self, model_id: str, model: ServedModel) -> None:
        """Count a loaded model's memory again: its embedding context is created on its first
        embedding and grows with longer inputs (found by review: it was counted nowhere). The
        RAM tier shrinks to what is left; past the budget it is emptied, and the log says by
        how much the server is over (the embedding already ran: nothing is refused)."""
        engine = self.engine
        with self._budget_lock:
            if engine is None or model_id not in self._admitted:
                return
            memory = budget.memory_of(model_id, model)
            if memory == self._admitted[model_id]:
                return
            admitted = {**self._admitted, model_id: memory}
            self._apply_plan(engine, self._plan_or_over(admitted))
            self._admitted = admitted

    def _plan_or_over(self, admitted: dict[str, ModelMemory]) -> budget.MemoryPlan:
        """The plan of the models ``admitted``; past the budget (memory a loaded model
        allocated since it was admitted), the RAM tier emptied and the log saying by how
        much."""
        try:
            return self._plan(admitted.values())
        except MemoryBudgetError as exc:
            log.error("%s; the RAM tier is emptied", exc)
            return budget.overcommitted(
                self.settings.memory_budget,
                list(admitted.values()),
                self.settings.cache_config().tiers,
            )

    def _apply_plan(self, engine: Engine, plan: budget.MemoryPlan) -> None:
        """Make ``plan`` the server's: with a budget, the RAM tier gets its remainder."""
        budget.apply(engine.cache, plan)
        self.memory = plan

    def _prewarm_systems(self, model: ServedModel, model_id: str) -> None:
        """``--prewarm-system``: every prompt, in every namespace a tenant may ask from
        (``tenancy.system_salts``). Shared with the cluster's ingress, which warms through
        the replicas. A reranker is skipped: it never chats."""
        if "generate" not in model.info().capabilities:
            return
        for prompt in self.settings.prewarm_system:
            for salt in tenancy.system_salts(self.settings):
                self._prewarm_system(model, model_id, prompt, salt)

    def _prewarm_system(
        self, model: ServedModel, model_id: str, prompt: str, salt: str | None = None
    ) -> None:
        try:
            # The same tokens Model.stream_chat builds for a chat that starts this way.
            tokens, _ = model.chat_tokens(
                [{"role": "system", "content": prompt}], add_generation_prompt=False
            )
            model.prewarm(tokens, ttl_class=TtlClass.LONG, add_special=False, cache_salt=salt)
            # Pinned: the operator asked for it, so no limit refuses it and it never ages out.
            self.keepalive.register(
                model_id,
                tokens,
                TtlClass.LONG,
                add_special=False,
                n_tokens=len(tokens),
                pinned=True,
                cache_salt=salt,
            )
        except KvwarmError as exc:  # best effort: the first request just prefills cold
            log.warning("prewarm of a system prompt for %s failed: %s", model_id, exc)

    def _keepalive_loop(self) -> None:
        # Event.wait doubles as an interruptible timer: close() wakes it at once.
        while not self._closing.wait(self.settings.keepalive_interval_s):
            self._keepalive_tick()

    def _keepalive_tick(self) -> None:
        """Re-warm what is due, but nothing more once the server is closing. Found by
        review: a tick went on through every due entry (a prefill each) while ``close``
        waited up to 60 s for this thread before it closed the engine."""

        def model(model_id: str) -> ServedModel | None:
            if self._closing.is_set():
                return None
            if model_id not in self.entries:
                # Found by review: an entry of a model the server no longer knows (its
                # models_dir file deleted) was skipped as "not ready" by every tick, never
                # dropped. One merely unloaded stays: it re-warms once the model loads.
                raise UnknownModelError(f"the server no longer knows the model {model_id!r}")
            return self.ready_model(model_id)

        self.keepalive.tick(model)

    def _idle_loop(self) -> None:
        """Unload models whose keep-alive ran out: sleeps until the next one may come due
        (at most 10 s), or until a lease ends or a request sets a keep_alive."""
        wake = self.registry.reaper_wake
        while not self._closing.is_set():
            due_in = self.registry.next_due()
            # Due but still in use (a request queued by another way than HTTP): look again
            # soon, not in a busy loop.
            timeout = 10.0 if due_in is None else min(max(due_in, 0.0) + 0.01, 10.0)
            if due_in is not None and due_in <= 0:
                timeout = 0.5
            wake.wait(timeout)
            wake.clear()
            if self._closing.is_set():
                return
            self.registry.reap_idle()

    def close(self) -> None:
        self._closing.set()
        self.registry.reaper_wake.set()  # the reaper sees the close at once
        self._engine_known.set()  # a load waiting for the engine gives up (require_engine)
        for thread in self._threads:
            # The loader aborts at its next progress callback; a native load in flight may
            # still take a moment, which is bounded by the model's size.
            thread.join(timeout=60)
        self.registry.join(timeout_s=60)
        with self._lock:
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    # --- lookups -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Startup loading is over and some model can be served."""
        return self.startup_done and self.registry.startup_failure() is None

    def metrics_snapshot(self) -> Snapshot:
        """What ``/metrics`` reports of the engine; snapshots only, no worker lock."""
        # A model whose worker died is failed from here on (``kvwarm_model_ready`` 0), as
        # /health and /v1/models notice it: found by review, a scrape said 1 until one of
        # them, or a request, happened to look.
        self.registry.notice_deaths()
        engine = self.engine
        entries = list(self.entries.values())  # a snapshot: a rescan may add entries meanwhile
        models = self.totals.snapshot(_loaded(entries))
        return Snapshot(
            memory=self.memory,
            cache=engine.cache.counters() if engine is not None else {},
            states={e.id: e.state for e in entries},
            statuses=models.statuses,
            totals=models.totals,
            keepalive_prefixes=len(self.keepalive.entries()),
            stalled_s={e.id: stalled_for(e.model) for e in entries if e.model is not None},
        )

    def model_totals(self) -> dict[str, dict[str, float]]:
        """Per model id, its running totals over the server's lifetime (``server/totals.py``):
        every load of it, the loaded one's live counts included."""
        return self.totals.snapshot(_loaded(list(self.entries.values()))).totals

    def cache_owners(self) -> dict[str, CacheOwner]:
        """Which rows are each loaded model's share of the cache: its own namespaces'
        fingerprints (``Model.cache_fingerprints``) and its draft model's namespaces
        (``Model.draft_namespaces``). Models of another process (a cluster's) have none."""
        engine = self.engine
        out: dict[str, CacheOwner] = {}
        for entry in list(self.entries.values()):
            if entry.state != "ready" or engine is None:
                continue
            try:
                model = engine.get_model(entry.id)
            except KvwarmError:
                continue
            out[entry.id] = CacheOwner(model.cache_fingerprints(), model.draft_namespaces())
        return out

    def ready_model(self, model_id: str) -> ServedModel | None:
        return self.registry.ready_model(model_id)

    async def acquire(self, name: str | None, *, load: bool = True) -> ServedModel:
        """The ready model a request names (an id, an alias or a LoRA adapter's name; the
        first configured model if it names none), loaded on first use (``load`` false: a
        409 instead, for a GET that must change nothing); leased until the request ends."""
        return await self.registry.acquire(name, load=load)

    #: Whether ``cluster_view`` answers: the page asks ``/cluster`` only then (``/ui/config.json``).
    is_cluster: bool = False

    def cluster_view(self) -> dict[str, object]:
        """``GET /cluster``: the replicas behind this server and what their caches hold.
        A plain server has none (404); the cluster's ingress answers (``cluster/ingress.py``)."""
        raise HTTPError(
            404, "not a cluster: `kvwarm cluster` answers /cluster", code="not_a_cluster"
        )

    async def acquire_generation(
        self,
        name: str | None,
        *,
        keep_alive: float | str | None,
        lora: Sequence[tuple[int, float]] | None = None,
    ) -> tuple[ServedModel, LoraChoice | None]:
        """``acquire`` for a generation (or an embedding): its ``keep_alive`` (None when the
        request gave none: the server's ``model_idle_unload_s``) says how long the model then
        stays loaded once idle, as each Ollama request does (``registry``); and the LoRA
        adapters the request runs under: its ``lora`` list (llama-server's), the adapter its
        model name names (vLLM's), or the model's global scales (``server/lora.py``)."""
        seconds = None if keep_alive is None else keep_alive_seconds(keep_alive)
        model = await self.registry.acquire(name, keep_alive=seconds, generation=True)
        return model, self.lora.choice(model, name, lora)

    def require_engine(self) -> Engine:
        engine = self.engine
        if engine is None:
            if self.engine_error is not None:
                raise ModelLoadError(self.engine_error)
            raise HTTPError(
                503,
                "the engine is starting",
                type="service_unavailable",
                code="model_loading",
                headers={"Retry-After": "1"},
            )
        return engine


def _loaded(entries: Iterable[ModelEntry]) -> list[tuple[str, ServedModel]]:
    return [(e.id, e.model) for e in entries if e.model is not None]


def server_state(request: Request) -> ServerState:
    """The ``ServerState`` an application built by ``create_app`` carries."""
    state = request.app.state.kvwarm
    assert isinstance(state, ServerState)
    return state
