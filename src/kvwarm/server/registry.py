"""The models a server knows and which of them are loaded: configured models (loaded at start),
the files of a models directory (loaded on first use), models an admin loads by path; aliases;
LoRA adapters' names (each runs on its model, ``server/lora.py``); the cap on loaded models and
the idle unload.

Invariants:

- Every state change of an entry happens under the registry lock. Loads and unloads run on
  threads of their own, never on the event loop, and wake every request waiting on them.
- A request holds a *lease* on its model from the lookup until its response is fully sent
  (``request_leases``, opened by the app's outer middleware); work that outlives its request
  (a background response) holds one of its own until it ends (``hold``). A model with a
  lease, or with queued or running requests, is never unloaded, by the cap or by the idle
  timer; an admin unload of one is a ``ModelBusyError``.
- A request for a model that is loading because a request asked for it waits for the load; a
  model loading at startup answers 503 with Retry-After, as before (``docs/architecture.md``).
- A failed load stays failed (503 with its reason) until an admin loads it again; a file an
  admin loads by path and that fails is forgotten instead (the admin got the error).
- A load a request or an admin asked for whose file is no loadable model
  (``InvalidModelFileError``: a header cut short, an unknown architecture...) is the asker's
  400 naming the file and why, given to every request that waited on it, and leaves the entry
  ``available`` (its ``error`` kept for the listing), not failed: the file is the caller's to
  fix, ``/health`` is not degraded by it, and the next request tries the file again. A
  configured model's (loaded at start) fails as any load does: the server was misconfigured.
  Likewise a load a request or an admin asked for that the memory budget has no room for
  (``MemoryBudgetError``: the models in its way are busy or pinned) is a 507 to every request
  that waited on it and leaves the entry ``available``: the next request tries again.
- A loaded model whose worker thread died is failed too, from the first lookup or listing that
  notices (``_notice_death``): ``/v1/models``, the page and ``/health`` say so, its requests get
  a 503 ``worker_died``, and an admin load starts it again (its dead engine model is unloaded
  first) without a restart.
- How long an idle model stays loaded is the last request's ``keep_alive`` (Ollama's: seconds
  or a duration, 0 unloads it as soon as that request ends, negative never), else the
  server's ``model_idle_unload_s`` (0: never). A *pinned* model (setting ``pinned``) is never
  unloaded by any of these, nor to make room (the cap, the memory budget); an admin may still
  unload it. Time is ``time.monotonic()`` unless a caller passes ``now`` (tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvwarm import models_dir
from kvwarm.embedded import model_id_for
from kvwarm.errors import (
    ConfigError,
    InvalidModelFileError,
    KvwarmError,
    MemoryBudgetError,
    ModelBusyError,
    ModelCapacityError,
    ModelExistsError,
)
from kvwarm.server.errors import HTTPError
from kvwarm.server.served import worker_failure
from kvwarm.settings import ModelSpec, Settings
from kvwarm.settings.model import is_pinned, model_lora

if TYPE_CHECKING:
    from kvwarm.server.served import ServedModel

log = logging.getLogger("kvwarm.server")

EntryState = Literal["available", "loading", "ready", "failed", "unloading"]
Source = Literal["configured", "models_dir", "admin"]
Loader = Callable[["ModelEntry"], "ServedModel"]
Unloader = Callable[["ModelEntry"], None]

_HELD: ContextVar[list[Callable[[], None]] | None] = ContextVar("kvwarm_leases", default=None)


@contextlib.contextmanager
def request_leases() -> Iterator[None]:
    """Scope of one HTTP request: leases taken inside are released when it ends."""
    held: list[Callable[[], None]] = []
    token = _HELD.set(held)
    try:
        yield
    finally:
        _HELD.reset(token)
        for release in held:
            release()


# ASCII digits only (found by review: \d and float() read Arabic-Indic and full-width digits,
# "1_0", "1e3" and "inf" as numbers, and "--5m" as negative: kept loaded for ever).
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_SECONDS = re.compile(_NUMBER)
_DURATION = re.compile(rf"({_NUMBER})(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | str, *, param: str = "keep_alive") -> float:
    """Ollama's ``keep_alive`` as seconds: a number is seconds; a string is a Go duration
    (``"5m"``, ``"1h30m"``, ``"0"``) or a number; any negative value is ``inf`` (kept loaded
    until an admin unloads it). ``HTTPError`` 400 naming ``param`` for anything else."""
    seconds: float
    if isinstance(value, bool):
        raise HTTPError(
            400, "keep_alive is a duration, not a boolean", code="invalid_type", param=param
        )
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text[1:] if text[:1] in ("+", "-") else text  # one sign, as Go's
        if _SECONDS.fullmatch(body):
            seconds = sign * float(body)
        else:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise HTTPError(
                    400,
                    f"keep_alive {value!r} is not a duration: seconds, or a number with a "
                    'unit as "30s", "5m", "1h30m" (0: unload after this request; '
                    "negative: keep loaded)",
                    param=param,
                    code="invalid_value",
                )
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise HTTPError(400, "keep_alive is not a number", param=param, code="invalid_value")
    return math.inf if seconds < 0 else seconds


@dataclass(slots=True, eq=False)
class ModelEntry:
    spec: ModelSpec
    id: str
    source: Source = "configured"
    state: EntryState = "loading"
    model: ServedModel | None = None
    error: str | None = None
    on_demand: bool = False  # a request asked for this load: requests wait for it
    in_progress: bool = False  # a load thread runs (a configured model waits as "loading")
    leases: int = 0
    died: bool = False  # failed because its worker died; ``model`` is the dead one until unloaded
    last_used: float = 0.0  # time.monotonic()
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    pinned: bool = False  # never unloaded but by an admin (setting ``pinned``)
    #: The last request's ``keep_alive`` in seconds (inf: for ever); None: the server's
    #: ``model_idle_unload_s``.
    keep_alive_s: float | None = None


class ModelRegistry:
    def __init__(self, settings: Settings, loader: Loader, unloader: Unloader) -> None:
        self._settings = settings
        self._loader = loader
        self._unloader = unloader
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.entries: dict[str, ModelEntry] = {
            spec.model_id: ModelEntry(spec, spec.model_id, pinned=is_pinned(settings, spec))
            for spec in settings.models
        }
        #: Set whenever an unload may have come due sooner (a lease ended, a keep_alive was
        #: given): the server's reaper thread waits on it (``next_due``, ``reap_idle``).
        self.reaper_wake = threading.Event()
        self.models_dir = settings.models_dir
        self.aliases: dict[str, str] = dict(settings.aliases)
        # vLLM's served LoRA adapters: an adapter's name runs on its model (server/lora.py).
        self.adapter_models: dict[str, str] = {
            name: spec.model_id
            for spec in settings.models
            for name, _ in model_lora(settings, spec)
        }
        self._rescan()
        for alias, target in self.aliases.items():
            if alias in self.entries:
                raise ConfigError(f"alias {alias!r} is also the id of a model")
            if target not in self.entries:
                raise ConfigError(
                    f"alias {alias}={target}: no model {target!r} "
                    f"(models: {', '.join(self.entries) or 'none'})"
                )
        first = settings.models[0].model_id if settings.models else None
        self.default_id = first

    # --- lookups -----------------------------------------------------------------------------

    def _rescan(self) -> None:
        """Add new files of models_dir; forget vanished ones that are not loaded."""
        if self.models_dir is None:
            return
        found = models_dir.scan(self.models_dir)
        for model_id, path in found.items():
            entry = self.entries.get(model_id)
            if model_id in self.aliases or model_id in self.adapter_models:
                # Found by review: a file named as an alias or an adapter took its requests.
                log.debug("models_dir file %s is shadowed by the alias or adapter", path.name)
            elif entry is None:
                projector = models_dir.projector_for(self.models_dir, path, len(found))
                options = () if projector is None else (("mmproj", projector),)
                spec = ModelSpec(path=str(path), id=model_id, options=options)
                pinned = is_pinned(self._settings, spec)
                self.entries[model_id] = ModelEntry(
                    spec, model_id, "models_dir", "available", pinned=pinned
                )
            elif entry.source != "models_dir" and entry.spec.path != str(path):
                log.debug("models_dir file %s is shadowed by model %s", path.name, model_id)
        for model_id, entry in list(self.entries.items()):
            gone = entry.source == "models_dir" and model_id not in found
            if gone and entry.state in ("available", "failed"):
                del self.entries[model_id]

    def rescan(self) -> None:
        """Pick up models_dir's new files; notice models whose worker died."""
        with self._lock:
            self._rescan()
            for entry in self.entries.values():
                self._notice_death(entry)

    def notice_deaths(self) -> None:
        """Mark failed every loaded model whose worker died (``_notice_death``)."""
        with self._lock:
            for entry in self.entries.values():
                self._notice_death(entry)

    @staticmethod
    def _notice_death(entry: ModelEntry) -> None:
        """Under the lock: a ready model whose worker thread died serves nothing any more;
        it becomes failed (the dead model stays in ``entry.model`` until unloaded)."""
        if entry.state != "ready" or entry.model is None:
            return
        reason = worker_failure(entry.model)
        if reason is None:
            return
        entry.state, entry.died = "failed", True
        entry.error = f"its worker died ({reason}); POST /admin/models/load to load it again"
        log.error("model %s stopped: its worker died (%s)", entry.id, reason)

    def _resolve(self, name: str | None) -> ModelEntry:
        if name is None:
            if self.default_id is None:
                raise HTTPError(
                    400,
                    "this server has no default model: name one",
                    code="invalid_value",
                    param="model",
                )
            name = self.default_id
        target = name
        if name not in self.entries:
            target = self.aliases.get(name) or self.adapter_models.get(name) or name
        entry = self.entries.get(target)
        if entry is None and self.models_dir is not None:
            self._rescan()
            entry = self.entries.get(target)
        if entry is not None:
            self._notice_death(entry)
        if entry is None:
            known = ", ".join([*self.entries, *self.aliases, *self.adapter_models])
            raise HTTPError(
                404,
                f"the model {name!r} does not exist; available: {known}",
                code="model_not_found",
                param="model",
            )
        return entry

    def ready_model(self, model_id: str) -> ServedModel | None:
        entry = self.entries.get(model_id)
        return entry.model if entry is not None and entry.state == "ready" else None

    # --- acquiring -----------------------------------------------------------------------------

    async def acquire(
        self,
        name: str | None,
        *,
        lease: bool = True,
        keep_alive: float | None = None,
        generation: bool = False,
        load: bool = True,
    ) -> ServedModel:
        """The ready model ``name`` (an id or an alias) names, loading it first if need be
        (with ``load`` false, a model not loaded is a 409 ``model_not_loaded``, and the
        request is no use of the model: its idle timer runs on. Found by review: a GET of
        ``/props`` or ``/slots``, which any web page may send, restarted it, so polling kept
        an idle model loaded for ever).

        Inside ``request_leases`` the model is leased until the request ends. A
        ``generation`` sets how long the model stays loaded once idle, as each Ollama request
        does: ``keep_alive`` seconds (``keep_alive_seconds``), or None for the server's
        ``model_idle_unload_s``."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                entry = self._resolve(name)
                if entry.state == "ready" and entry.model is not None:
                    if lease:
                        self._lease(entry, touch=load)
                    if load:
                        entry.last_used = time.monotonic()
                    if generation:
                        entry.keep_alive_s = keep_alive
                        self.reaper_wake.set()
                    return entry.model
                self._refuse_unready(entry)
                if not load and entry.state == "available":
                    raise HTTPError(
                        409,
                        f"the model {entry.id!r} is not loaded, and this route loads none (a "
                        "GET any web page may send): a request to the model, or POST "
                        "/admin/models/load, loads it",
                        code="model_not_loaded",
                        param="model",
                    )
                if entry.state == "available":
                    self._check_model_file(entry)
                    self._start_load(entry, on_demand=True)
                waiter: asyncio.Future[None] = loop.create_future()
                entry.waiters.append(waiter)
            await waiter

    def _check_model_file(self, entry: ModelEntry) -> None:
        """A file that is not a GGUF model is the caller's 400, never a load (a 503 that
        left the entry failed and /health degraded)."""
        if self._settings.backend == "stub" or not entry.spec.path:
            return
        if Path(os.path.expanduser(entry.spec.path)).is_file():
            models_dir.check_gguf_magic(Path(os.path.expanduser(entry.spec.path)))

    def _refuse_unready(self, entry: ModelEntry) -> None:
        if entry.state == "failed" and entry.died:
            raise HTTPError(
                503,
                f"the model {entry.id!r} stopped: {entry.error}",
                type="service_unavailable",
                code="worker_died",
            )
        if entry.state == "failed":
            raise HTTPError(
                503,
                f"the model {entry.id!r} failed to load: {entry.error}",
                type="service_unavailable",
                code="model_load_failed",
            )
        if entry.state == "loading" and not entry.on_demand:
            raise HTTPError(
                503,
                f"the model {entry.id!r} is still loading",
                type="service_unavailable",
                code="model_loading",
                headers={"Retry-After": "1"},
            )

    def _lease(self, entry: ModelEntry, *, touch: bool = True) -> None:
        held = _HELD.get()
        if held is None:
            return
        held.append(self._leased(entry, touch=touch))

    def _leased(self, entry: ModelEntry, *, touch: bool = True) -> Callable[[], None]:
        """Under the lock: one more lease on ``entry``, and what releases it (once);
        ``touch``: its release is a use of the model (its idle timer starts again)."""
        entry.leases += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                entry.leases -= 1
                if touch:
                    entry.last_used = time.monotonic()
            self.reaper_wake.set()  # keep_alive 0: due now

        return release

    def hold(self, model_id: str) -> Callable[[], None]:
        """A lease on the loaded model ``model_id`` (its id, as ``ServedModel.id``), for work
        that outlives the request that started it (a background response): taken while that
        request still holds its own, released by calling what this returns. Found by review:
        a background response held none, so its ``keep_alive`` ran from its ``POST`` (a
        model unloaded the moment a long response ended, not ``keep_alive`` after)."""
        with self._lock:
            entry = self.entries.get(model_id)
            if entry is None:  # never for a model a request got from ``acquire``
                return lambda: None
            return self._leased(entry)

    # --- loading and unloading -------------------------------------------------------------

    def _start_load(self, entry: ModelEntry, *, on_demand: bool) -> None:
        """Under the lock: mark ``entry`` loading (making room first) and start its thread."""
        victim = self._make_room(entry)
        entry.state, entry.on_demand, entry.error = "loading", on_demand, None
        entry.in_progress, entry.died = True, False
        thread = threading.Thread(
            target=self._load, args=(entry, victim), name=f"kvwarm-load-{entry.id}", daemon=True
        )
        # Only the loads that may still run are kept for ``join`` (found by review: every
        # load's thread was kept for the server's life, one more per reload: keep_alive 0
        # reloads a model per request).
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _make_room(self, incoming: ModelEntry) -> ModelEntry | None:
        """Under the lock: the idle model to unload so that ``incoming`` fits the cap."""
        cap = self._settings.max_loaded_models
        loaded = [e for e in self.entries.values() if e.state == "ready" or e.in_progress]
        if cap <= 0 or len([e for e in loaded if e is not incoming]) < cap:
            return None
        idle = [e for e in loaded if e.state == "ready" and self._idle(e) and not e.pinned]
        if not idle:
            raise ModelCapacityError(
                f"{cap} models are loaded (max_loaded_models) and all are busy or pinned; "
                f"cannot load {incoming.id!r} now"
            )
        victim = min(idle, key=lambda e: e.last_used)
        victim.state = "unloading"
        log.info("unloading model %s to make room for %s", victim.id, incoming.id)
        return victim

    @staticmethod
    def _idle(entry: ModelEntry) -> bool:
        if entry.leases > 0 or entry.model is None:
            return False
        status = entry.model.status()
        return status.queued == 0 and status.active == 0

    def load_now(self, entry: ModelEntry) -> None:
        """Load ``entry`` on this thread (startup): 503 to requests until it is ready."""
        with self._lock:
            try:
                victim = self._make_room(entry)
            except ModelCapacityError as exc:
                entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
                log.error("model %s not loaded: %s", entry.id, exc)
                return
            entry.state, entry.on_demand, entry.in_progress = "loading", False, True
        self._load(entry, victim)

    def _load(self, entry: ModelEntry, victim: ModelEntry | None) -> None:
        if victim is not None:
            self._unload_now(victim)
        if entry.model is not None:  # the dead model of a worker that died: unload it first
            try:
                self._unloader(entry)
            except Exception:
                log.exception("error unloading the dead model %s", entry.id)
            with self._lock:
                entry.model = None
        try:
            model = self._loader(entry)
        # Whatever ends the load (a backend's bug, even a BaseException such as SystemExit),
        # the entry fails and its waiters wake: a request must never wait on a dead thread.
        except BaseException as exc:
            # A file a request or an admin named that is no model: their 400, not a failure
            # of this server (the entry stays loadable, /health unchanged). So is a model the
            # memory budget has no room for now (507): found by review, it stayed failed, so
            # once the models in its way went idle it was still refused until an admin load.
            refused = isinstance(exc, InvalidModelFileError | MemoryBudgetError) and entry.on_demand
            with self._lock:
                entry.state = "available" if refused else "failed"
                entry.error = f"{type(exc).__name__}: {exc}"
                entry.in_progress = False
                self._wake(entry, exc if refused else None)
            if isinstance(exc, KvwarmError):
                log.error("model %s failed to load: %s", entry.id, exc)
            else:
                log.exception("model %s failed to load", entry.id)
            return
        with self._lock:
            entry.model, entry.state, entry.last_used = model, "ready", time.monotonic()
            entry.in_progress = False
            # A request of an earlier load said how long that one stayed; this one stays by
            # the server's rule until a request on it says otherwise. Found by review: a
            # keep_alive of 0 left from the request that had the model unloaded made the
            # reload due at once, and the reaper could unload it again before the request
            # that waited for it had taken its lease (another load, for nothing).
            entry.keep_alive_s = None
            self._wake(entry)

    def _unload_now(self, entry: ModelEntry) -> None:
        """Unload an entry already marked ``unloading``; it becomes ``available`` again."""
        try:
            self._unloader(entry)
        except Exception:
            log.exception("error unloading model %s", entry.id)
        with self._lock:
            entry.model, entry.state = None, "available"
            entry.error, entry.died = None, False
            self._wake(entry)
        log.info("model %s unloaded", entry.id)

    @staticmethod
    def _wake(entry: ModelEntry, refused: BaseException | None = None) -> None:
        """Wake every request waiting on ``entry``'s load; with ``refused`` (the file's
        ``InvalidModelFileError``, the budget's ``MemoryBudgetError``), each raises a copy of
        it naming the model."""
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            error = None if refused is None else _refusal(entry, refused)
            with contextlib.suppress(RuntimeError):  # the loop already closed: nobody waits
                waiter.get_loop().call_soon_threadsafe(_resolve_waiter, waiter, error)

    def keep_alive(self, entry: ModelEntry) -> float:
        """How long ``entry`` stays loaded once idle, in seconds (inf: for ever): pinned, the
        last request's ``keep_alive``, else ``model_idle_unload_s`` (0: for ever)."""
        if entry.pinned:
            return math.inf
        if entry.keep_alive_s is not None:
            return entry.keep_alive_s
        return self._settings.model_idle_unload_s or math.inf

    def due(self, entry: ModelEntry) -> float | None:
        """When (``time.monotonic()``) a ready, unleased ``entry`` unloads; None: never, or
        not while it is in use."""
        ttl = self.keep_alive(entry)
        if entry.state != "ready" or entry.leases > 0 or math.isinf(ttl):
            return None
        return entry.last_used + ttl

    def next_due(self, now: float | None = None) -> float | None:
        """Seconds until the next model may come due (<= 0: one is due; None: none will
        until a request says otherwise): how long the reaper may sleep."""
        now = time.monotonic() if now is None else now
        with self._lock:
            times = [d for e in self.entries.values() if (d := self.due(e)) is not None]
        return min(times) - now if times else None

    def reap_idle(self, now: float | None = None) -> list[str]:
        """Unload every idle model whose keep-alive has run out (``keep_alive``); returns
        their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [
                e
                for e in self.entries.values()
                if (due := self.due(e)) is not None and now >= due and self._idle(e)
            ]
            for entry in stale:
                entry.state = "unloading"
        for entry in stale:
            log.info("model %s idle for %.1f s: unloading", entry.id, now - entry.last_used)
            self._unload_now(entry)
        return [e.id for e in stale]

    def _memory_candidates(self, incoming: ModelEntry) -> list[ModelEntry]:
        """Under the lock: the models the budget may unload for ``incoming`` (ready, idle,
        not pinned)."""
        return [
            e
            for e in self.entries.values()
            if e is not incoming and e.state == "ready" and self._idle(e) and not e.pinned
        ]

    def memory_candidates(self, incoming: ModelEntry) -> set[str]:
        """The ids of the models the budget may unload for ``incoming`` now."""
        with self._lock:
            return {e.id for e in self._memory_candidates(incoming)}

    def memory_victim(self, incoming: ModelEntry) -> ModelEntry | None:
        """The least recently used idle model, not pinned, to unload so that ``incoming``
        fits the memory budget (marked unloading); None if there is none."""
        with self._lock:
            idle = self._memory_candidates(incoming)
            if not idle:
                return None
            victim = min(idle, key=lambda e: e.last_used)
            victim.state = "unloading"
        log.info("unloading model %s to fit %s in the memory budget", victim.id, incoming.id)
        return victim

    # --- admin -------------------------------------------------------------------------------

    async def admin_load(self, name: str | None, path: Path | None, model_id: str | None) -> str:
        """Load a known model by name (a failed one is retried), or a file by path. A path
        that fails to load is forgotten again: the admin got the error, and a failed entry
        kept would hold its id (the right file under it: 409) and degrade /health for good."""
        with self._lock:
            known = set(self.entries)
            entry = self._admin_entry(path, model_id) if path is not None else self._resolve(name)
            if entry.state == "failed":
                entry.state, entry.error = "available", None
        try:
            await self.acquire(entry.id, lease=False)
        except BaseException:
            if entry.id not in known:
                self._forget_unloaded(entry)
            raise
        return entry.id

    def _forget_unloaded(self, entry: ModelEntry) -> None:
        """Drop an admin entry whose load failed (one still loading, e.g. after the caller
        went away, is kept)."""
        with self._lock:
            if self.entries.get(entry.id) is entry and entry.state in ("failed", "available"):
                del self.entries[entry.id]

    def _admin_entry(self, path: Path, model_id: str | None) -> ModelEntry:
        mid = model_id or model_id_for(path)
        if mid in self.aliases or mid in self.adapter_models:
            # Found by review: an entry of that id took every request naming the alias or
            # adapter (the config refuses such a clash; a load must too).
            raise ModelExistsError(
                f"{mid!r} names an alias or a LoRA adapter of this server: give another id"
            )
        entry = self.entries.get(mid)
        if entry is None:
            spec = ModelSpec(path=str(path), id=mid)
            pinned = is_pinned(self._settings, spec)
            entry = self.entries[mid] = ModelEntry(spec, mid, "admin", "available", pinned=pinned)
        elif Path(entry.spec.path or "") != path:
            raise ModelExistsError(f"a model with id {mid!r} is already known (another file)")
        return entry

    def begin_unload(self, name: str) -> ModelEntry | None:
        """Mark a model unloading (``ModelBusyError`` if in use); None if nothing is loaded."""
        with self._lock:
            entry = self._resolve(name)
            if entry.state == "failed" and entry.model is not None:
                entry.state = "unloading"  # a dead worker's model: free what it holds
                return entry
            if entry.state == "failed":
                entry.state, entry.error = "available", None
                return None
            if entry.state in ("available", "unloading"):
                return None
            if entry.state == "loading" or not self._idle(entry):
                raise ModelBusyError(
                    f"the model {entry.id!r} has requests in flight (or is loading)"
                )
            entry.state = "unloading"
            return entry

    def finish_unload(self, entry: ModelEntry) -> None:
        self._unload_now(entry)

    # --- whole-server views ------------------------------------------------------------------

    def startup_failure(self) -> str | None:
        """Why nothing can ever be served, once every configured model has been tried."""
        entries = list(self.entries.values())
        if any(e.state != "failed" for e in entries) or not self._settings.models:
            return None
        return "; ".join(f"{e.id}: {e.error}" for e in entries) or "no model"

    def join(self, timeout_s: float) -> None:
        for thread in list(self._threads):
            thread.join(timeout=timeout_s)


def _resolve_waiter(waiter: asyncio.Future[None], error: BaseException | None = None) -> None:
    if waiter.done():
        return
    if error is None:
        waiter.set_result(None)
    else:
        waiter.set_exception(error)


def _refusal(entry: ModelEntry, exc: BaseException) -> KvwarmError:
    """A waiter's own copy of a load's ``InvalidModelFileError`` or ``MemoryBudgetError``
    (its class kept: its error code), naming the model it was loaded as."""
    message = f"the model {entry.id!r} cannot be loaded: {exc}"
    if isinstance(exc, MemoryBudgetError):
        return type(exc)(message)
    assert isinstance(exc, InvalidModelFileError)
    return type(exc)(message, param=exc.param)
