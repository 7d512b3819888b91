"""Keep-alive re-warms prewarmed prefixes at a fraction of their TTL (driven by a fake clock)."""

from __future__ import annotations

from collections.abc import Sequence

from kvwarm.cache.types import TtlClass
from kvwarm.errors import BackendError
from kvwarm.server.keepalive import KeepAlive


class FakeModel:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str | Sequence[int], TtlClass, bool]] = []
        self.fail = fail

    def prewarm(
        self, prompt: str | Sequence[int], *, ttl_class: TtlClass, add_special: bool
    ) -> None:
        if self.fail:
            raise BackendError("boom")
        self.calls.append((prompt, ttl_class, add_special))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_rewarm_happens_at_the_stale_fraction_of_each_ttl_class() -> None:
    clock = Clock()
    keep = KeepAlive((100.0, 1000.0, 10_000.0), 0.8, clock)
    model = FakeModel()
    keep.register("m", "system prompt", TtlClass.SHORT, add_special=False)
    keep.register("m", [1, 2, 3], TtlClass.LONG)
    resolve = {"m": model}.get
    clock.now += 79
    assert keep.tick(resolve) == 0  # type: ignore[arg-type]
    clock.now += 1  # 80 s: 80% of the short TTL
    assert keep.tick(resolve) == 1  # type: ignore[arg-type]
    assert model.calls == [("system prompt", TtlClass.SHORT, False)]
    clock.now += 79  # the re-warm restarted the short entry's clock
    assert keep.tick(resolve) == 0  # type: ignore[arg-type]
    clock.now += 800  # the long entry is due now (959 s >= 800 s), the short one too
    assert keep.tick(resolve) == 2  # type: ignore[arg-type]
    assert ([1, 2, 3], TtlClass.LONG, True) in model.calls
    warms = {str(e.prompt): e.warms for e in keep.entries()}
    assert warms == {"system prompt": 3, "(1, 2, 3)": 2}


def test_failures_and_unready_models_are_skipped_and_retried() -> None:
    clock = Clock()
    keep = KeepAlive((10.0, 10.0, 10.0), 0.5, clock)
    keep.register("broken", "p", TtlClass.SHORT)
    keep.register("loading", "q", TtlClass.SHORT)
    broken = FakeModel(fail=True)
    clock.now += 5
    assert keep.tick({"broken": broken}.get) == 0  # type: ignore[arg-type]
    (entry,) = [e for e in keep.entries() if e.model_id == "broken"]
    assert entry.failures == 1 and entry.warms == 1
    assert len(keep.due()) == 2  # still due: retried on the next tick
    keep.forget("broken")
    assert [e.model_id for e in keep.entries()] == ["loading"]
