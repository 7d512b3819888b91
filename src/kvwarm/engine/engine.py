"""``Engine``: owns one cache (tiers configured once) and any number of loaded ``Model``s.

Invariants: a model id is loaded at most once per engine (the id is reserved while it loads);
unloading a model never touches the cache's rows (a reload finds them again); closing the
engine unloads every model with bounded shutdown saves before closing a cache it owns; an
engine still open when the interpreter exits is closed then (``docs/architecture.md``,
"Engine").
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Unpack

from kvwarm.backends import get_backend
from kvwarm.cache import Cache
from kvwarm.cache.types import TierName
from kvwarm.embedded import model_id_for
from kvwarm.engine.cancel import check_wait
from kvwarm.engine.config import EngineConfig, ModelConfig, ModelOptions, with_options
from kvwarm.engine.model import Model
from kvwarm.engine.types import ModelInfo
from kvwarm.errors import (
    ConfigError,
    EngineClosedError,
    ModelExistsError,
    UnknownModelError,
)

log = logging.getLogger(__name__)


class Engine:
    """Owns one cache (tiers configured once) and any number of loaded models."""

    def __init__(self, config: EngineConfig | None = None, *, cache: Cache | None = None) -> None:
        """``cache``: use this (already built) cache instead of one from ``config.cache``;
        the caller keeps ownership and closes it."""
        if config is not None and not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, not {type(config).__name__}")
        self.config = config or EngineConfig()
        self.config.validate()
        if cache is not None and not isinstance(cache, Cache):
            # Found by review: taken, and the first load failed with an AttributeError.
            raise ConfigError(f"cache must be a Cache, not {type(cache).__name__}")
        self._owns_cache = cache is None
        self.cache = cache if cache is not None else Cache(self.config.cache)
        self._models: dict[str, Model] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Held for the whole of close(): a second caller waits for the first to finish (found
        # by review: it returned at once, or unloaded the same models and closed the cache
        # under the first one's shutdown saves). Re-entrant: a close() from inside close()
        # (a callback it runs) returns at once.
        self._close_lock = threading.RLock()
        _OPEN.add(self)
        # Each loaded model's teardown (``Model.teardown``: no reference to the model), run by
        # the finalizer if this engine is dropped unclosed (its models with it: each holds it).
        self._teardowns: dict[str, Callable[[float], bool]] = {}
        self._finalizer = weakref.finalize(
            self, _dropped, self._teardowns, self.cache if self._owns_cache else None
        )
        self._finalizer.atexit = False  # at exit, _close_open_engines closes what is open

    def load_model(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        model_id: str | None = None,
        config: ModelConfig | None = None,
        progress: Callable[[float], bool] | None = None,
        **options: Unpack[ModelOptions],
    ) -> Model:
        """Load a GGUF (default: ``$KVWARM_MODEL`` or the embedded model) under ``model_id``.

        ``options`` are flat keywords (``n_ctx=``, ``n_gpu_layers=``, ``n_parallel=`` …) that
        replace the matching fields of ``config``; see ``ModelOptions``.
        """
        if config is not None and not isinstance(config, ModelConfig):
            raise ConfigError(f"config must be a ModelConfig, not {type(config).__name__}")
        if model_id is not None and not isinstance(model_id, str):
            raise ConfigError(f"model_id must be a string, got {model_id!r}")
        if path is not None and not isinstance(path, str | os.PathLike):
            raise ConfigError(f"path must be a file path, got {path!r}")
        if progress is not None and not callable(progress):
            # It was a TypeError from inside the load ('int' object is not callable).
            raise ConfigError(
                f"progress must be a function of the fraction loaded, got {progress!r}"
            )
        cfg = with_options(config or ModelConfig(), options)
        cfg.validate()
        if self._closed:
            raise EngineClosedError("engine is closed")
        spec = cfg.backend or self.config.backend
        backend = get_backend(spec) if isinstance(spec, str) else spec
        resolved = backend.locate(path)
        mid = model_id or model_id_for(resolved)
        if not mid or ("/" in mid and len(mid) > 200):
            raise ConfigError(f"invalid model id {mid!r}")
        save_tier = self._save_tier(cfg)
        self._reserve(mid)
        try:
            policy = cfg.policy or self.config.policy
            model = Model(self, mid, resolved, backend, cfg, save_tier, policy, progress)
        except BaseException:
            with self._lock:
                self._models.pop(mid, None)
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                self._models[mid] = model
                self._teardowns[mid] = model.teardown()
        if closed:  # the engine closed while this model loaded: do not leak it
            model.unload()
            raise EngineClosedError("engine was closed while the model loaded")
        return model

    def _save_tier(self, cfg: ModelConfig) -> TierName:
        tiers = self.cache.tier_names()
        save_tier = cfg.save_tier or tiers[0]
        if save_tier not in tiers:
            raise ConfigError(
                f"save_tier {save_tier!r} is not a configured cache tier ({sorted(tiers)})"
            )
        return save_tier

    def _reserve(self, model_id: str) -> None:
        """Hold ``model_id`` while its model loads outside the lock."""
        with self._lock:
            if model_id in self._models:
                raise ModelExistsError(
                    f"a model with id {model_id!r} is already loaded in this engine: give this "
                    "one another model_id=, or use the loaded one (engine.get_model)"
                )
            self._models[model_id] = _LOADING

    def get_model(self, model_id: str) -> Model:
        if not isinstance(model_id, str):  # a list was a TypeError (unhashable)
            raise UnknownModelError(f"no loaded model with id {model_id!r}: an id is a string")
        if self._closed:
            # Not "no loaded model with id ..." (found by review): the model was loaded, and
            # the engine is what is gone, as for every other call of a closed engine.
            raise EngineClosedError("engine is closed")
        model = self._models.get(model_id)
        if model is None or model is _LOADING:
            raise UnknownModelError(f"no loaded model with id {model_id!r}")
        return model

    def list_models(self) -> list[ModelInfo]:
        return [m.info() for m in list(self._models.values()) if m is not _LOADING]

    def unload_model(self, model_id: str) -> None:
        model = self.get_model(model_id)
        model.unload()

    def _forget(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)
            self._teardowns.pop(model_id, None)

    def status(self) -> dict[str, object]:
        return {
            "models": [m.status() for m in list(self._models.values()) if m is not _LOADING],
            "cache": dict(self.cache.counters()),
        }

    def close(self, timeout_s: float = 30.0) -> None:
        """Unload every model (bounded shutdown saves), then drain and close the cache.
        Idempotent and thread-safe: a call while another thread is closing the engine returns
        once that close has finished."""
        check_wait(timeout_s)  # before anything changes: the engine stays open to close again
        with self._close_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            _OPEN.discard(self)
            self._finalizer.detach()
            for model in [m for m in list(self._models.values()) if m is not _LOADING]:
                try:
                    model.unload(timeout_s=timeout_s)
                except Exception:
                    log.exception("error unloading %s", model.id)
            if self._owns_cache:
                self.cache.close(timeout_s)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LOADING: Model = object.__new__(Model)  # placeholder reserving an id during a load

#: Engines not closed yet. Found by review: a program that never called ``close()`` (the
#: README's own ten lines, or one that raised) lost every save still in the writers' queues
#: at exit, and the shutdown saves of its slots' live KV: a disk tier was left empty, so the
#: next run prefilled everything again.
_OPEN: weakref.WeakSet[Engine] = weakref.WeakSet()


#: Threads closing engines that were dropped unclosed (``_dropped``), joined at exit.
_DROPPING: set[threading.Thread] = set()
_DROPPING_LOCK = threading.Lock()


def _dropped(teardowns: dict[str, Callable[[float], bool]], cache: Cache | None) -> None:
    """An engine nobody holds was never closed (its models are gone with it: each holds its
    engine): stop their workers, free their native state and close the cache it owned, as
    ``close()`` does. In a thread of its own: the collector may run this on one of those
    workers' threads, which the teardown waits for."""
    log.info("an engine was dropped without close(): closing it (%d models)", len(teardowns))

    def close() -> None:
        try:
            for teardown in list(teardowns.values()):
                try:
                    teardown(30.0)
                except Exception:
                    log.exception("unloading a model of a dropped engine failed")
            if cache is not None:
                cache.close(30.0)
        finally:
            with _DROPPING_LOCK:
                _DROPPING.discard(threading.current_thread())

    thread = threading.Thread(target=close, name="kvwarm-dropped-engine", daemon=True)
    with _DROPPING_LOCK:
        _DROPPING.add(thread)
    thread.start()


@atexit.register
def _close_open_engines() -> None:
    """At interpreter exit (after non-daemon threads ended), close every engine still open,
    as ``close()`` does: its slots' live KV saved, the pending saves written; and wait for
    those dropped unclosed to finish closing."""
    for engine in list(_OPEN):
        try:
            engine.close()
        except Exception:
            log.exception("closing an engine at exit failed")
    with _DROPPING_LOCK:
        dropping = list(_DROPPING)
    for thread in dropping:
        thread.join(60.0)
