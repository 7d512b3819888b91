"""A model's loaded LoRA adapters, the model's own set (each at its scale), and the set a
request runs under.

Invariants: every change of the model's set is applied on the worker thread as a job that
waits until no slot is active, so no running request ever sees it change mid-way; after a
change, every idle slot's live KV is forgotten and the namespace is refolded; an adapter that
failed to attach or detach natively is listed exactly as the context has it
(``docs/architecture.md``, "Engine"). A request may name its own set instead
(``GenerationOptions.lora``, llama-server's per-request ``lora``): it is resolved when the
request is admitted (``resolve``), runs in forward passes of its set alone (the tick sets the
context's adapters before each pass, ``Runtime.use_adapters``) and lives in the namespace of
that set, so rows and live KV never cross sets. An adapter at scale 0 is no adapter: left out
of the native set and of the namespace, so it costs nothing and shares the base model's rows.
``applied()`` is the model's set; the embedding context (``engine.embeddings``) follows it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from numbers import Real
from pathlib import Path

from kvwarm.backends.base import EXACT_AT_ANY_LENGTH, Adapter, AdapterSet, BackendModel
from kvwarm.engine.types import AdapterInfo
from kvwarm.engine.worker.loop import Worker
from kvwarm.engine.worker.runtime import LoraChoice
from kvwarm.errors import AdapterError, InvalidRequestError

log = logging.getLogger(__name__)


class Adapters:
    def __init__(
        self,
        bmodel: BackendModel,
        worker: Worker,
        on_change: Callable[[Sequence[tuple[bytes, float]]], None],
        exact: Callable[[Adapter], str] | None = None,
    ) -> None:
        """``on_change`` receives (sha256, scale) of the new set, on the worker thread.
        ``exact``: where a verify pass with an adapter attached is one-token passes
        (``BackendModel.verify_exactness``), asked of each adapter as it loads; None where
        it does not matter (the model does not speculate, or may inexactly)."""
        self._bmodel = bmodel
        self._exact = exact
        #: Adapters (by identity) under which a verify pass is not exact: a request whose
        #: set holds one decodes plainly (``exact_set``).
        self._inexact: set[int] = set()
        self._worker = worker
        self._on_change = on_change
        self._adapters: dict[int, tuple[Adapter, float]] = {}
        self._names: dict[int, str] = {}
        #: The model's set, adapters at scale 0 left out (set on the worker thread).
        self._applied: AdapterSet = ()
        self._next = 1
        self._lock = threading.Lock()

    def load(
        self, path: str | os.PathLike[str], scale: float = 1.0, *, name: str = ""
    ) -> AdapterInfo:
        value = _scale(scale)  # before the native load: a bad scale must not leak the adapter
        if not isinstance(path, str | os.PathLike):  # None was a TypeError from Path()
            raise InvalidRequestError(
                f"an adapter's path is a file path, not {type(path).__name__}", param="path"
            )
        if not isinstance(name, str):
            raise InvalidRequestError(
                f"an adapter's name is a string, not {type(name).__name__}", param="name"
            )
        if not Path(path).is_file():
            raise AdapterError(f"adapter file not found: {path}")
        adapter = self._bmodel.load_adapter(str(path))
        try:
            where = EXACT_AT_ANY_LENGTH if self._exact is None else self._exact(adapter)
        except BaseException:
            adapter.close()
            raise
        if where != EXACT_AT_ANY_LENGTH:
            log.warning(
                "LoRA adapter %s: a verify pass with it is not exact at any length (%s); "
                "requests under it decode plainly (spec_exact = false speculates)",
                Path(path).name,
                where,
            )
        with self._lock:
            if where != EXACT_AT_ANY_LENGTH:
                self._inexact.add(id(adapter))
            handle = self._next
            self._next += 1
            self._adapters[handle] = (adapter, value)
            self._names[handle] = name
        try:
            self._apply()
        except BaseException:
            with self._lock:
                self._adapters.pop(handle, None)
                self._names.pop(handle, None)
                self._inexact.discard(id(adapter))
            adapter.close()
            raise
        return self._info(handle)

    def exact_set(self, adapters: AdapterSet) -> bool:
        """Whether a verify pass under ``adapters`` is exact wherever the model's is (each
        adapter measured as it loaded); on the worker thread."""
        with self._lock:
            return not any(id(adapter) in self._inexact for adapter, _ in adapters)

    def set_scale(self, handle: int, scale: float) -> AdapterInfo:
        value = _scale(scale)
        with self._lock:
            if handle not in self._adapters:
                raise AdapterError(f"no adapter with handle {handle}")
            adapter, old = self._adapters[handle]
            self._adapters[handle] = (adapter, value)
        try:
            self._apply()
        except BaseException:
            # A rejected scale (e.g. NaN) must not stay recorded: it would be reported by
            # list() and make every later load() fail to apply the set.
            with self._lock:
                current = self._adapters.get(handle)
                if current is not None and current[0] is adapter:
                    self._adapters[handle] = (adapter, old)
            raise
        return self._info(handle)

    def detach(self, handle: int) -> None:
        with self._lock:
            if handle not in self._adapters:
                raise AdapterError(f"no adapter with handle {handle}")
            adapter, scale = self._adapters.pop(handle)
        try:
            self._apply()
        except BaseException:
            # Still attached natively: keep listing it, or it could never be detached.
            with self._lock:
                self._adapters[handle] = (adapter, scale)
            raise
        with self._lock:
            self._names.pop(handle, None)
            self._inexact.discard(id(adapter))
        adapter.close()

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(h) for h in sorted(self._adapters)]

    def applied(self) -> AdapterSet:
        """The model's set (what a request without its own runs under, and what embeddings
        use); read on the worker thread."""
        return self._applied

    def applied_choice(self) -> LoraChoice:
        """The model's set as a request's own choice ((handle, scale) pairs; empty: no
        adapter): what a call of several requests (a rerank's documents) names, so that each
        runs under the set the call began under. Found by review: each document took the
        model's set when it was admitted, and a change of it (which waits only for the slots
        then active) ran between two of them: one ranking scored under two sets."""
        applied = self._applied
        with self._lock:
            handles = {id(adapter): handle for handle, (adapter, _) in self._adapters.items()}
        return tuple((handles[id(a)], s) for a, s in applied if id(a) in handles)

    def check(self, choice: LoraChoice | None) -> None:
        """``AdapterError`` for a request's set naming an adapter this model has not loaded:
        the caller's error, before its request is queued."""
        if choice is None:
            return
        with self._lock:
            missing = [handle for handle, _ in choice if handle not in self._adapters]
            known = sorted(self._adapters)
        if missing:
            raise AdapterError(
                f"this model has no LoRA adapter {missing[0]} (loaded: "
                f"{', '.join(map(str, known)) or 'none'})"
            )

    def resolve(self, choice: LoraChoice | None) -> AdapterSet:
        """The set a request runs under: the model's (``choice`` None), or exactly the
        adapters ``choice`` names at its scales, ordered by handle; scale 0 left out. On the
        worker thread, when the request is admitted (an adapter detached since it was queued
        is an ``AdapterError`` for that request alone)."""
        if choice is None:
            return self._applied
        with self._lock:
            out = []
            for handle, scale in sorted(choice):
                entry = self._adapters.get(handle)
                if entry is None:
                    raise AdapterError(f"LoRA adapter {handle} was detached from this model")
                if scale != 0.0:
                    out.append((entry[0], float(scale)))
        return tuple(out)

    def close(self) -> None:
        for adapter, _ in self._adapters.values():
            adapter.close()

    def _info(self, handle: int) -> AdapterInfo:
        adapter, scale = self._adapters[handle]
        name = self._names.get(handle, "")
        return AdapterInfo(
            handle, adapter.path, scale, adapter.sha256.hex(), name, adapter.size_bytes
        )

    def _apply(self) -> None:
        def run() -> None:
            with self._lock:
                wanted = tuple((a, s) for a, s in self._adapters.values() if s != 0.0)
            # At once, not at the next pass: a set the context refuses fails this call, and
            # an adapter detached here is released by the context before it is closed.
            self._worker.rt.use_adapters(wanted)
            self._applied = wanted
            # Live KV was computed under the old adapter set; it must not be reused.
            self._worker.invalidate_live_kv()
            self._on_change([(a.sha256, scale) for a, scale in wanted])

        # needs_idle: no running request ever sees an adapter change mid-way.
        self._worker.call(run, needs_idle=True).result()


#: The largest finite float32: llama.cpp takes a scale as a C float.
_FLOAT32_MAX = 3.4028234663852886e38


def _scale(scale: object) -> float:
    """``scale`` as a finite float. Found by review: ``float(scale)`` ran after the native
    load, so a scale that was no number (``"x"``, ``None``, ``2**2000``) raised a ``ValueError``
    and left the adapter loaded, unlisted, and holding its model open for good."""
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise InvalidRequestError(f"adapter scale {scale!r} is not a number", param="scale")
    try:
        value = float(scale)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise InvalidRequestError(f"adapter scale {scale!r} is not finite", param="scale")
    # Found by review: a finite scale past float32's range (1e39) reached the context (inf
    # there) before the namespace refused it with a ValueError, so the model ran under a
    # scale that neither its listing nor its cache namespace had.
    if abs(value) > _FLOAT32_MAX:
        raise InvalidRequestError(
            f"adapter scale {scale!r} is beyond float32's range (llama.cpp's scale is a float)",
            param="scale",
        )
    return value
