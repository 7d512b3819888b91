"""What the HTTP routes need of a model and of a generation, by the names the routes use.

Invariant: the routes, ``Generation`` and the keep-alive use a model only through
``ServedModel`` and a generation only through ``ServedStream``: the engine's own declarations
of every model operation (``kvwarm.engine.ops``), not a copy. ``kvwarm.engine.Model`` and
``CompletionStream`` satisfy them in-process (``kvwarm serve``); the cluster ingress passes
proxies that forward to engine replicas (``kvwarm.cluster.remote``), so both servers run the
same route code.
"""

from __future__ import annotations

from kvwarm.engine.ops import Message, ModelOps, OpStream

ServedModel = ModelOps
ServedStream = OpStream

__all__ = ["Message", "ServedModel", "ServedStream", "stalled_for", "worker_failure"]


def stalled_for(model: object) -> float:
    """Seconds ``model``'s worker has gone without ticking; 0.0 for a served model that has
    no local worker to watch (a remote replica)."""
    probe = getattr(model, "stalled_for", None)
    return float(probe()) if callable(probe) else 0.0


def worker_failure(model: object) -> str | None:
    """Why ``model``'s worker thread died, if it did; None for one that runs (or has no local
    worker: a remote replica)."""
    probe = getattr(model, "worker_failure", None)
    failure = probe() if callable(probe) else None
    return failure if isinstance(failure, str) else None
