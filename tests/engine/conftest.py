"""Fixtures for engine tests: an engine with a RAM (and optionally disk) tier and low save
gates so short prompts are cached."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwarm.backends.base import ContextParams
from kvwarm.backends.stub import StubBackend
from kvwarm.cache.types import CacheConfig, PolicyConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, ModelConfig

LOW_GATES = PolicyConfig(
    min_tokens=4,
    cold_min_tokens=8,
    cold_max_tokens=100_000,
    continued_interval=64,
    boundary_trim_tokens=0,
    boundary_align_tokens=8,
    session_resume_wait_ms=2000,
    evict_save_timeout_ms=10_000,
)


def stub_config(
    n_parallel: int = 1,
    *,
    backend: StubBackend | None = None,
    deterministic: bool = False,
    n_batch: int = 16,
    strategy: str = "decode_first",
) -> ModelConfig:
    return ModelConfig(
        backend=backend or "stub",
        context=ContextParams(n_ctx=512, n_batch=n_batch, n_ubatch=n_batch),
        n_parallel=n_parallel,
        deterministic=deterministic,
        batch_strategy=strategy,  # type: ignore[arg-type]
    )


def make_engine(tmp: Path | None = None, *, policy: PolicyConfig = LOW_GATES) -> Engine:
    tiers = [TierConfig("ram", 64 << 20)]
    if tmp is not None:
        tiers.append(TierConfig("disk", 256 << 20, tmp / "disk"))
    return Engine(EngineConfig(cache=CacheConfig(tiers=tuple(tiers)), policy=policy))


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = make_engine()
    yield eng
    eng.close()


class StepGate:
    """Opened for good (``set``) or for one forward pass at a time (``step``): a test decides
    exactly how far the worker may get, with no timing assumptions.

    Invariant: ``step`` returns only once the worker has run the pass and come back to the gate,
    so everything that pass produced (tokens, finished requests) has been delivered.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self._cond = threading.Condition()
        self._open = False
        self._permits = 0
        self._arrivals = 0  # passes the worker has asked for
        self._passes = 0  # passes it was let through
        self._timeout_s = timeout_s

    def set(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._open = False

    def is_set(self) -> bool:
        return self._open

    def wait(self) -> None:
        """The worker's side: called before every forward pass."""
        with self._cond:
            self._arrivals += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._open or self._permits > 0)
            if not self._open:
                self._permits -= 1
            self._passes += 1

    def step(self, n: int = 1) -> None:
        """Let ``n`` forward passes run, one by one, each waited for as the invariant says."""
        for _ in range(n):
            self._step_once()

    def _step_once(self) -> None:
        with self._cond:
            parked = self._cond.wait_for(lambda: self._arrivals > self._passes, self._timeout_s)
            assert parked, "the worker never reached the gate"
            arrivals = self._arrivals
            self._permits += 1
            self._cond.notify_all()
            back = self._cond.wait_for(lambda: self._arrivals > arrivals, self._timeout_s)
            assert back, "the worker did not come back to the gate after one pass"


class _GatedContext:
    """Delegates to a stub context, but each ``decode`` first waits for the gate to open."""

    def __init__(self, inner: object, gate: StepGate) -> None:
        self._inner = inner
        self._gate = gate

    def decode(self, batch: object) -> None:
        self._gate.wait()
        self._inner.decode(batch)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


class _GatedModel:
    def __init__(self, inner: object, gate: StepGate) -> None:
        self._inner = inner
        self._gate = gate

    def new_context(self, params: object) -> _GatedContext:
        return _GatedContext(self._inner.new_context(params), self._gate)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


class GatedBackend:
    """A stub backend whose forward passes run only while ``gate`` is set, or one per
    ``gate.step()``: tests decide exactly when the worker can make progress."""

    name = "stub"

    def __init__(self) -> None:
        self.gate = StepGate()
        self._stub = StubBackend()

    def locate(self, path: str | None) -> Path:
        return self._stub.locate(path)

    def load_model(self, path: str, params: object = None) -> _GatedModel:
        return _GatedModel(self._stub.load_model(path, params), self.gate)  # type: ignore[arg-type]
