"""LoRA adapters over HTTP, in the two forms servers offer them.

- llama-server's: ``GET /lora-adapters`` lists a model's adapters by id (their position in its
  ``lora`` setting) with their global scales; ``POST /lora-adapters`` sets those scales (an
  adapter not listed: 0); a request's ``lora`` list (``[{"id": 0, "scale": 0.5}]``) runs that
  request under exactly those adapters instead (an adapter not listed: off).
- vLLM's: each adapter is also a model name of its own (``--lora NAME=PATH``); a request for
  ``NAME`` runs on the adapter's model with that adapter alone, at scale 1 (its own ``lora``
  list may add others or change the scale). ``/v1/models`` lists it with its model as
  ``parent``.

Invariants: every adapter is loaded with its model, off (scale 0), so the model serves itself
unchanged; which adapters a request runs under is decided here, per request, and handed to
the engine as ``GenerationOptions.lora`` (engine handles, never positions), whose namespace
folds that set in: a request with an adapter never reuses a row or live KV made without it,
nor the other way round (``engine/adapters.py``). The global scales live here, in the
server, so a cluster's ingress applies them to every replica alike. ``POST /lora-adapters``
changes what every later request of the model runs under: an admin path when an admin key is
set (``server/guard.py``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwarm.engine.types import MAX_LORA_SCALE
from kvwarm.errors import AdapterError
from kvwarm.server.errors import HTTPError
from kvwarm.settings import Settings
from kvwarm.settings.model import model_lora

if TYPE_CHECKING:
    from kvwarm.server.served import ServedModel

#: A request's adapters as the engine takes them: (handle, scale).
LoraChoice = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """A configured adapter: ``id`` its position among its model's (llama-server's id),
    ``name`` the model name it is served under (vLLM's), ``model`` its model's id."""

    id: int
    name: str
    path: str
    model: str


class LoraTable:
    """The adapters of every configured model and their global scales (thread-safe)."""

    def __init__(self, settings: Settings) -> None:
        self._by_model: dict[str, tuple[ServedAdapter, ...]] = {}
        self.by_name: dict[str, ServedAdapter] = {}
        for spec in settings.models:
            adapters = tuple(
                ServedAdapter(i, name, path, spec.model_id)
                for i, (name, path) in enumerate(model_lora(settings, spec))
            )
            if adapters:
                self._by_model[spec.model_id] = adapters
                self.by_name.update((a.name, a) for a in adapters)
        self._scales: dict[str, dict[int, float]] = {m: {} for m in self._by_model}
        self._lock = threading.Lock()

    def adapters(self, model_id: str) -> tuple[ServedAdapter, ...]:
        return self._by_model.get(model_id, ())

    def base_of(self, name: str) -> str | None:
        """The model an adapter's name runs on (None: not an adapter's name)."""
        adapter = self.by_name.get(name)
        return None if adapter is None else adapter.model

    def scales(self, model_id: str) -> dict[int, float]:
        """Every adapter's global scale (0 unless ``POST /lora-adapters`` set one)."""
        with self._lock:
            chosen = dict(self._scales.get(model_id, {}))
        return {a.id: chosen.get(a.id, 0.0) for a in self.adapters(model_id)}

    def set_scales(self, model_id: str, items: Sequence[tuple[int, float]]) -> None:
        """llama-server's ``POST /lora-adapters``: the listed scales, every other adapter 0."""
        scales = self._scales_of(model_id, items, param="body")
        with self._lock:
            self._scales[model_id] = scales

    def choice(
        self,
        model: ServedModel,
        requested: str | None,
        items: Sequence[tuple[int, float]] | None,
    ) -> LoraChoice | None:
        """The adapters a request runs under: those of its ``lora`` list, else the adapter
        its model name names (at 1), else the global scales; None for a model without
        adapters (its requests need no set of their own)."""
        adapters = self.adapters(model.id)
        named = self.by_name.get(requested or "")
        if not adapters:
            if items:
                raise HTTPError(
                    400,
                    f"the model {model.id!r} has no LoRA adapters (setting lora)",
                    param="lora",
                    code="invalid_value",
                )
            return None
        if items is not None:
            # Exactly the adapters listed, an empty list none (found by review: ``[]`` ran
            # under the global scales, where the docs and llama-server turn every one off).
            scales = self._scales_of(model.id, items, param="lora")
            if named is not None:
                scales.setdefault(named.id, 1.0)
        elif named is not None:
            scales = {named.id: 1.0}
        else:
            scales = self.scales(model.id)
        handles = _handles(model, adapters)
        return tuple((handles[i], s) for i, s in sorted(scales.items()) if s != 0.0)

    def _scales_of(
        self, model_id: str, items: Sequence[tuple[int, float]], *, param: str
    ) -> dict[int, float]:
        known = {a.id for a in self.adapters(model_id)}
        scales: dict[int, float] = {}
        for adapter_id, scale in items:
            if adapter_id not in known:
                listed = ", ".join(map(str, sorted(known))) or "none"
                raise HTTPError(
                    400,
                    f"the model {model_id!r} has no LoRA adapter {adapter_id} (ids: {listed}; "
                    "GET /lora-adapters lists them)",
                    param=param,
                    code="invalid_value",
                )
            if adapter_id in scales:
                raise HTTPError(
                    400,
                    f"LoRA adapter {adapter_id} is listed twice",
                    code="invalid_value",
                    param=param,
                )
            if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
                raise HTTPError(
                    400,
                    f"LoRA scale {scale} must be finite and within +-{MAX_LORA_SCALE:g}",
                    param=param,
                    code="invalid_value",
                )
            scales[adapter_id] = float(scale)
        return scales

    def reply_name(self, requested: str | None, model: ServedModel) -> str:
        """The model name a reply carries: the adapter's, for a request that named one (as
        vLLM answers), else the model's id."""
        return requested if requested is not None and requested in self.by_name else model.id

    def listing(self, model_id: str) -> list[dict[str, object]]:
        """``GET /lora-adapters``: llama-server's fields (id, path, scale) and ours (name,
        model)."""
        scales = self.scales(model_id)
        return [
            {"id": a.id, "path": a.path, "scale": scales[a.id], "name": a.name, "model": a.model}
            for a in self.adapters(model_id)
        ]


def _handles(model: ServedModel, adapters: Sequence[ServedAdapter]) -> Mapping[int, int]:
    """Each adapter's id to its handle in the loaded model (they were loaded by name)."""
    loaded = {a.name: a.handle for a in model.info().adapters}
    out: dict[int, int] = {}
    for adapter in adapters:
        handle = loaded.get(adapter.name)
        if handle is None:
            raise AdapterError(f"LoRA adapter {adapter.name!r} is not loaded on {model.id!r}")
        out[adapter.id] = handle
    return out
