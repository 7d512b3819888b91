"""Each model's running totals over the server's lifetime, whatever loads and unloads it.

A model's counters (``ModelStatus``: requests, prompt, cached and generated tokens, prefill
time ...) live in its worker and start at zero each time it loads. ``ModelTotals`` keeps, per
model id, the final counts of every instance that unloaded, and adds the loaded instance's
live ones: what ``/metrics`` exports as counters and ``/cache/stats`` as ``model_totals`` (the
dashboard's tokens served from the cache and time saved), so they never go down when a model
unloads or loads again.

Invariants: an instance's counts are folded in once, after it unloaded (``retire``: its worker
has stopped, so they are final and at least any live reading of it); from then on a snapshot
reads it no more, though the registry may still name it for a moment. ``snapshot`` and
``retire`` take one lock, so a snapshot sees an instance either live or folded, never both
nor neither. Nothing here calls into a worker but ``ModelStatus`` reads (no worker lock).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvwarm.engine.types import ModelStatus
from kvwarm.server.metrics import MODEL_TOTALS, model_totals_of
from kvwarm.server.served import ServedModel

__all__ = ["TOTALS", "ModelTotals", "TotalsSnapshot", "totals_of"]

#: The ``ModelStatus`` fields that are running totals: those ``/metrics`` exports as counters.
TOTALS = MODEL_TOTALS
totals_of = model_totals_of


@dataclass(frozen=True, slots=True)
class TotalsSnapshot:
    """One consistent reading: the live statuses of the loaded instances not yet folded in,
    and per model id its totals over every instance (those folded in plus the live)."""

    statuses: list[ModelStatus] = field(default_factory=list)
    totals: dict[str, dict[str, float]] = field(default_factory=dict)


class ModelTotals:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, dict[str, float]] = {}
        # Every instance folded in, not only each id's last: a reading may list an instance
        # that unloaded after the reading listed it and before it took the lock, and
        # another instance of its id may have loaded and unloaded meanwhile (found by review:
        # only the last was remembered, so the earlier one was counted live on top of its
        # folded counts). Weakly: an unloaded model is not kept alive by this.
        self._retired: weakref.WeakSet[ServedModel] = weakref.WeakSet()
        # Per model id, the last instance folded in that cannot be weakly referred to.
        self._retired_held: dict[str, ServedModel] = {}

    def _is_retired(self, model_id: str, model: ServedModel) -> bool:
        return model in self._retired or self._retired_held.get(model_id) is model

    def retire(self, model_id: str, model: ServedModel) -> None:
        """``model`` (loaded as ``model_id``) has unloaded: fold its final counts in, once."""
        with self._lock:
            if self._is_retired(model_id, model):
                return
            done = self._done.setdefault(model_id, dict.fromkeys(TOTALS, 0.0))
            for name, value in totals_of(model.status()).items():
                done[name] += value
            try:
                self._retired.add(model)
            except TypeError:  # not weakly referable: held until the next instance retires
                self._retired_held[model_id] = model

    def snapshot(self, loaded: Iterable[tuple[str, ServedModel]]) -> TotalsSnapshot:
        """The ``loaded`` instances' statuses (those not folded in yet) and every model id's
        totals, read together."""
        with self._lock:
            live = [(i, m.status()) for i, m in loaded if not self._is_retired(i, m)]
            totals = {i: dict(d) for i, d in self._done.items()}
        for model_id, status in live:
            mine = totals.setdefault(model_id, dict.fromkeys(TOTALS, 0.0))
            for name, value in totals_of(status).items():
                mine[name] += value
        return TotalsSnapshot([s for _, s in live], totals)
