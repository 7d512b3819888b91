"""A model's attached LoRA adapters.

Invariants: every change is applied on the worker thread as a job that waits until no slot is
active, so no running request ever sees an adapter change mid-way; after a change, every idle
slot's live KV is forgotten (it was computed under the old set) and the namespace is refolded;
an adapter that failed to attach or detach natively is listed exactly as the context has it
(``docs/architecture.md``, "Engine"). ``applied()`` is the set the generation context has
natively; the embedding context (``engine.embeddings``) follows it before each embedding.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Sequence
from numbers import Real
from pathlib import Path

from kvwarm.backends.base import Adapter, BackendContext, BackendModel
from kvwarm.engine.types import AdapterInfo
from kvwarm.engine.worker.loop import Worker
from kvwarm.errors import AdapterError, InvalidRequestError


class Adapters:
    def __init__(
        self,
        bmodel: BackendModel,
        ctx: BackendContext,
        worker: Worker,
        on_change: Callable[[Sequence[tuple[bytes, float]]], None],
    ) -> None:
        """``on_change`` receives (sha256, scale) of the new set, on the worker thread."""
        self._bmodel = bmodel
        self._ctx = ctx
        self._worker = worker
        self._on_change = on_change
        self._adapters: dict[int, tuple[Adapter, float]] = {}
        #: The set the generation context has natively (set on the worker thread).
        self._applied: tuple[tuple[Adapter, float], ...] = ()
        self._next = 1
        self._lock = threading.Lock()

    def load(self, path: str | os.PathLike[str], scale: float = 1.0) -> AdapterInfo:
        value = _scale(scale)  # before the native load: a bad scale must not leak the adapter
        if not Path(path).is_file():
            raise AdapterError(f"adapter file not found: {path}")
        adapter = self._bmodel.load_adapter(str(path))
        with self._lock:
            handle = self._next
            self._next += 1
            self._adapters[handle] = (adapter, value)
        try:
            self._apply()
        except BaseException:
            with self._lock:
                self._adapters.pop(handle, None)
            adapter.close()
            raise
        return self._info(handle)

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
        adapter.close()

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            items = sorted(self._adapters.items())
        return [AdapterInfo(h, a.path, scale, a.sha256.hex()) for h, (a, scale) in items]

    def applied(self) -> tuple[tuple[Adapter, float], ...]:
        """The set the generation context has natively; read on the worker thread."""
        return self._applied

    def close(self) -> None:
        for adapter, _ in self._adapters.values():
            adapter.close()

    def _info(self, handle: int) -> AdapterInfo:
        adapter, scale = self._adapters[handle]
        return AdapterInfo(handle, adapter.path, scale, adapter.sha256.hex())

    def _apply(self) -> None:
        def run() -> None:
            wanted = tuple(self._adapters.values())
            self._ctx.set_adapters(wanted)
            self._applied = wanted
            # Live KV was computed under the old adapter set; it must not be reused.
            self._worker.invalidate_live_kv()
            self._on_change([(a.sha256, scale) for a, scale in self._adapters.values()])

        # needs_idle: no running request ever sees an adapter change mid-way.
        self._worker.call(run, needs_idle=True).result()


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
    return value
