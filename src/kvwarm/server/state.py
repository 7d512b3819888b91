"""Everything one server instance owns: the engine, its models' load states, its metrics.

Invariants: there is no module-level state; one ``ServerState`` lives on ``app.state`` and is
built by ``create_app``. Models load on a background thread after the server is listening, so
``/health`` answers 503 until every configured model is ready. A request names its model; a
model that is still loading (or failed to load) is a 503, an unknown one a 404.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvwarm.cache.types import TtlClass
from kvwarm.errors import KvwarmError, ModelLoadError
from kvwarm.server.errors import HTTPError
from kvwarm.server.keepalive import KeepAlive, KeepAliveLimits
from kvwarm.server.metrics import ServerMetrics, Snapshot
from kvwarm.settings import ModelSpec, Settings, model_config

if TYPE_CHECKING:
    from kvwarm.engine.api import Engine
    from kvwarm.server.served import ServedModel

log = logging.getLogger("kvwarm.server")

LoadState = Literal["loading", "ready", "failed"]


@dataclass(slots=True)
class ModelEntry:
    spec: ModelSpec
    id: str
    state: LoadState = "loading"
    model: ServedModel | None = None
    error: str | None = None


class ServerState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.time()
        self.engine: Engine | None = None
        self.engine_error: str | None = None
        self.entries: dict[str, ModelEntry] = {
            spec.model_id: ModelEntry(spec, spec.model_id) for spec in settings.models
        }
        self.default_id = settings.models[0].model_id
        # Counts requests and finished generations; reads the engine at scrape time.
        self.counters = ServerMetrics(self.metrics_snapshot)
        # Strong references to fire-and-forget tasks (the loop keeps only weak ones).
        self.background: set[asyncio.Task[None]] = set()
        ttl = settings.cache_config().ttl_seconds
        limits = KeepAliveLimits(
            settings.keepalive_max_entries,
            settings.keepalive_max_tokens,
            settings.keepalive_max_age_s,
        )
        self.keepalive = KeepAlive(ttl, settings.keepalive_stale_fraction, limits=limits)
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # --- lifecycle ---------------------------------------------------------------------------

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

    def _load_all(self) -> None:
        from kvwarm.engine.api import Engine, EngineConfig

        try:
            engine = Engine(
                EngineConfig(cache=self.settings.cache_config(), backend=self.settings.backend)
            )
        except KvwarmError as exc:
            log.error("cannot start the engine: %s", exc)
            self.engine_error = str(exc)
            for entry in self.entries.values():
                entry.state, entry.error = "failed", f"engine failed to start: {exc}"
            return
        with self._lock:
            if self._closing.is_set():
                engine.close()
                return
            self.engine = engine
        tiers = ", ".join(
            f"{t.name} {t.quota_bytes / 2**30:.1f} GiB" + (f" at {t.root}" if t.root else "")
            for t in self.settings.cache_config().tiers
        )
        log.info("cache tiers: %s; new rows go to %s", tiers, self.settings.effective_save_tier())
        for entry in self.entries.values():
            if self._closing.is_set():
                return
            self._load_one(engine, entry)

    def _load_one(self, engine: Engine, entry: ModelEntry) -> None:
        started = time.perf_counter()
        log.info("loading model %s (%s)", entry.id, entry.spec.path or "default")
        try:
            model = engine.load_model(
                entry.spec.path,
                model_id=entry.id,
                config=model_config(self.settings, entry.spec),
                progress=lambda _fraction: not self._closing.is_set(),
            )
        except KvwarmError as exc:
            entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("model %s failed to load: %s", entry.id, exc)
            return
        except Exception as exc:  # a bug in a backend must not kill the loader silently
            entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("model %s failed to load", entry.id)
            return
        for prompt in self.settings.prewarm_system:
            self._prewarm_system(model, entry.id, prompt)
        entry.model = model
        entry.state = "ready"
        log.info("model %s ready in %.0f ms", entry.id, (time.perf_counter() - started) * 1000)

    def _prewarm_system(self, model: ServedModel, model_id: str, prompt: str) -> None:
        try:
            # The same tokens Model.stream_chat builds for a chat that starts this way.
            tokens, _ = model.chat_tokens(
                [{"role": "system", "content": prompt}], add_generation_prompt=False
            )
            model.prewarm(tokens, ttl_class=TtlClass.LONG, add_special=False)
            # Pinned: the operator asked for it, so no limit refuses it and it never ages out.
            self.keepalive.register(
                model_id,
                tokens,
                TtlClass.LONG,
                add_special=False,
                n_tokens=len(tokens),
                pinned=True,
            )
        except KvwarmError as exc:  # best effort: the first request just prefills cold
            log.warning("prewarm of a system prompt for %s failed: %s", model_id, exc)

    def _keepalive_loop(self) -> None:
        # Event.wait doubles as an interruptible timer: close() wakes it at once.
        while not self._closing.wait(self.settings.keepalive_interval_s):
            self.keepalive.tick(self.ready_model)

    def close(self) -> None:
        self._closing.set()
        for thread in self._threads:
            # The loader aborts at its next progress callback; a native load in flight may
            # still take a moment, which is bounded by the model's size.
            thread.join(timeout=60)
        with self._lock:
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    # --- lookups -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return all(entry.state == "ready" for entry in self.entries.values())

    def metrics_snapshot(self) -> Snapshot:
        """What ``/metrics`` reports of the engine; snapshots only, no worker lock."""
        engine = self.engine
        return Snapshot(
            cache=engine.cache.counters() if engine is not None else {},
            states={e.id: e.state for e in self.entries.values()},
            statuses=[e.model.status() for e in self.entries.values() if e.model is not None],
            keepalive_prefixes=len(self.keepalive.entries()),
        )

    def ready_model(self, model_id: str) -> ServedModel | None:
        entry = self.entries.get(model_id)
        return entry.model if entry is not None and entry.state == "ready" else None

    def model(self, name: str | None) -> ServedModel:
        """The ready model a request names (the first configured one if it names none)."""
        model_id = name or self.default_id
        entry = self.entries.get(model_id)
        if entry is None:
            raise HTTPError(
                404,
                f"the model {model_id!r} does not exist; available: {', '.join(self.entries)}",
                code="model_not_found",
                param="model",
            )
        if entry.state == "loading":
            raise HTTPError(
                503,
                f"the model {model_id!r} is still loading",
                type="service_unavailable",
                code="model_loading",
                headers={"Retry-After": "1"},
            )
        if entry.state == "failed" or entry.model is None:
            raise HTTPError(
                503,
                f"the model {model_id!r} failed to load: {entry.error}",
                type="service_unavailable",
                code="model_load_failed",
            )
        return entry.model

    def require_engine(self) -> Engine:
        engine = self.engine
        if engine is None:
            if self.engine_error is not None:
                raise ModelLoadError(self.engine_error)
            raise HTTPError(
                503, "the engine is starting", type="service_unavailable", code="model_loading"
            )
        return engine
