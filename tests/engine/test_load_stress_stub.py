"""A seeded random walk of submits (n of 1 to 3 choices, a small max_queue), cancels (queued,
waiting forks, prefilling, generating), evictions, RAM-quota changes (the memory budget
shrinking to 0 and growing) and single forward passes on the gated stub. After every step the
worker's bookkeeping holds (no slot held by an answered request, no answered request queued);
at the end every request is answered, no slot is busy, nothing is queued, no row is left
checked out, no save or hold is left in flight, and the bytes the index counts for the RAM tier
are exactly the bytes it holds, within its quota (review of load and memory pressure)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.engine.stream import CompletionStream
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import QueueFullError

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


@pytest.mark.parametrize("seed", range(20))
def test_random_submits_cancels_and_evictions_keep_the_worker_consistent(seed: int) -> None:
    rng = random.Random(seed)
    streams: list[CompletionStream] = []
    with make_engine() as eng:
        backend = GatedBackend()
        n_parallel = 3
        config = replace(stub_config(n_parallel=n_parallel, backend=backend), max_queue=6)  # type: ignore[arg-type]
        model = eng.load_model(config=config)
        worker = model._worker
        for _ in range(120):
            op = rng.random()
            if op < 0.35:
                prefix = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
                opts = GenerationOptions(max_tokens=rng.randint(0, 12), temperature=0.0)
                n = rng.choice((1, 1, 1, 2, 3))
                try:
                    got = model.streams(prefix, opts, n=n)
                except QueueFullError:
                    continue
                streams.extend(got)
            elif op < 0.5 and streams:
                rng.choice(streams).cancel()
            elif op < 0.55:
                eng.cache.evict_bytes(rng.randint(1, 1 << 16))
            elif op < 0.6:
                eng.cache.resize_tier("ram", rng.choice((0, 1 << 12, 1 << 14, 1 << 16, 64 << 20)))
            else:
                _pass(backend, worker)
            _settle(backend, worker)
            _check(worker)
        backend.gate.set()
        for s in streams:
            s.result()
        eng.cache.flush()
        status = model.status()
        assert status.active == 0 and status.queued == 0
        assert all(s.active is None for s in worker.slots)
        for s in streams:
            assert s.request.answered
        index = eng.cache._index
        for info in eng.cache.rows():
            assert index.refcount(info.key) == 0, "a row left checked out"
        assert not index._inflight._marks, "a save or hold left in flight"
        _check_bytes(eng)


def _check_bytes(eng: Any) -> None:
    """What the index counts for the RAM tier is what the tier holds (whole rows here: each
    one's payload and logits), within its quota."""
    tier = eng.cache._core.tiers["ram"]
    assert not any(e.row.chunks for e in tier._rows.values())
    stored = sum(memoryview(e.payload).nbytes + len(e.logits or b"") for e in tier._rows.values())
    stored += sum(memoryview(h).nbytes for h in tier._chunks.values())
    used, rows = eng.cache._index.usage().get("ram", (0, 0))
    assert (used, rows) == (stored, len(tier._rows))
    assert used <= tier.quota_bytes


def _pass(backend: GatedBackend, worker: Any) -> None:
    """Let one forward pass run once the worker is parked at the gate, and wait until it is
    parked again or has nothing it can do (then it never comes back to the gate)."""
    _settle(backend, worker)
    gate = backend.gate
    with gate._cond:
        if gate._arrivals <= gate._passes:
            return
        passes = gate._passes
        gate._permits += 1
        gate._cond.notify_all()
        # The gate notifies an arrival, not a pass: look again every 10 ms.
        for _ in range(6000):
            if gate._cond.wait_for(lambda: gate._passes > passes, 0.01):
                break
    _settle(backend, worker)


def _settle(backend: GatedBackend, worker: Any) -> None:
    """Wait until the worker is parked at the gate or idle: the gate's condition is not
    notified when the worker goes idle, so this looks again every 10 ms."""
    gate = backend.gate
    with gate._cond:
        for _ in range(1000):
            if gate._cond.wait_for(lambda: gate._arrivals > gate._passes, 0.01):
                return
            if (
                worker._iteration_since is None
                and not worker._admissible()
                and not any(s.active is not None for s in worker.slots)
            ):
                return
    raise AssertionError("the worker neither reached the gate nor went idle")


def _check(worker: object) -> None:
    for slot in worker.slots:
        act = slot.active
        if act is not None:
            assert not act.req.answered, "a slot held by an answered request"
    for req in list(worker._queue):
        assert not any(r.answered for r in req.group), "an answered request still queued"
