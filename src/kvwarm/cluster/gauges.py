"""A replica's load gauges in Ray's metrics (``ray.serve.metrics``): what ``kvwarm serve``
reports on ``/metrics`` for external routers, for replicas that have no HTTP server of their own.

Invariant: set from ``Model.status()`` snapshots each routing-stats period (no lock a decoding
worker holds); Ray adds the deployment and replica tags and exports them with its own metrics
(the node's Prometheus endpoint, ``metrics_export_port``). Names match ``server/metrics.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

from ray.serve.metrics import Gauge

from kvwarm.engine.types import ModelStatus

# (name, ModelStatus attribute, help): the same series as server/metrics.py's _MODEL_SERIES.
_SERIES = (
    ("kvwarm_model_queue_depth", "queued", "requests waiting for a slot"),
    ("kvwarm_model_active", "active", "requests holding a slot"),
    ("kvwarm_model_free_slots", "free_slots", "slots free for the next request"),
    ("kvwarm_model_kv_cells_used", "kv_cells_used", "context (KV) cells in use"),
    ("kvwarm_model_kv_cache_usage_ratio", "kv_cache_usage", "share of context cells in use"),
)


class ReplicaGauges:
    def __init__(self) -> None:
        self._gauges = [
            (Gauge(name, description=text, tag_keys=("model",)), attr)
            for name, attr, text in _SERIES
        ]

    def update(self, statuses: Iterable[ModelStatus]) -> None:
        for status in statuses:
            for gauge, attr in self._gauges:
                gauge.set(float(getattr(status, attr)), tags={"model": status.id})
