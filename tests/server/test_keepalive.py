"""Keep-alive re-warms prewarmed prefixes at a fraction of their TTL, within bounds (entries,
tokens, age), listed and removable through the app (all driven by a fake clock)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from fastapi.testclient import TestClient

from kvwarm.cache.types import TtlClass
from kvwarm.errors import BackendError, KeepAliveFullError
from kvwarm.server import create_app
from kvwarm.server.keepalive import KeepAlive, KeepAliveLimits, entry_id

from .conftest import stub_settings, wait_ready


class FakeModel:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str | Sequence[int], TtlClass, bool]] = []
        self.salts: list[str | None] = []
        self.fail = fail

    def prewarm(
        self,
        prompt: str | Sequence[int],
        *,
        ttl_class: TtlClass,
        add_special: bool,
        cache_salt: str | None = None,
    ) -> None:
        if self.fail:
            raise BackendError("boom")
        self.calls.append((prompt, ttl_class, add_special))
        self.salts.append(cache_salt)


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


class Buggy(FakeModel):
    def prewarm(self, prompt: str | Sequence[int], **kwargs: object) -> None:
        raise RuntimeError("a bug, not a KvwarmError")


def test_an_unexpected_error_fails_that_entry_only_and_keeps_the_loop_alive() -> None:
    """A re-warm raising anything but a KvwarmError escaped ``tick``: the entries after it
    were not re-warmed, and the server's keep-alive thread (``_keepalive_loop``, no handler)
    died, silently ending every re-warm for the rest of the process (found by review)."""
    clock = Clock()
    keep = KeepAlive((10.0, 10.0, 10.0), 0.5, clock)
    keep.register("buggy", "p", TtlClass.SHORT)
    keep.register("good", "q", TtlClass.SHORT)
    good = FakeModel()
    clock.now += 5
    assert keep.tick({"buggy": Buggy(), "good": good}.get) == 1  # type: ignore[arg-type]
    assert good.calls == [("q", TtlClass.SHORT, True)]
    (entry,) = [e for e in keep.entries() if e.model_id == "buggy"]
    assert entry.failures == 1 and entry.warms == 1


def test_limits_refuse_past_the_entry_and_token_caps_but_not_pinned() -> None:
    keep = KeepAlive((10.0,) * 3, 0.5, Clock(), KeepAliveLimits(2, 100, 0))
    keep.register("m", "a", TtlClass.SHORT, n_tokens=40)
    keep.register("m", "b", TtlClass.SHORT, n_tokens=40)
    with pytest.raises(KeepAliveFullError, match="maximum of 2"):
        keep.register("m", "c", TtlClass.SHORT, n_tokens=1)
    keep.register("m", "b", TtlClass.SHORT, n_tokens=60)  # re-registering is not growth
    keep.remove(keep.entries()[0].id)
    with pytest.raises(KeepAliveFullError, match="over its limit of 100"):
        keep.register("m", "c", TtlClass.SHORT, n_tokens=41)
    keep.register("m", "sys", TtlClass.LONG, n_tokens=500, pinned=True)
    assert len(keep.entries()) == 2 and keep.remove() == 2 and keep.entries() == []


def test_entries_expire_after_max_age_unless_pinned_or_registered_again() -> None:
    clock = Clock()
    keep = KeepAlive((100.0,) * 3, 0.8, clock, KeepAliveLimits(10, 1000, 300.0))
    model = FakeModel()
    keep.register("m", "old", TtlClass.SHORT)
    keep.register("m", "refreshed", TtlClass.SHORT)
    keep.register("m", "sys", TtlClass.SHORT, pinned=True)
    clock.now += 200
    keep.register("m", "refreshed", TtlClass.SHORT)  # a new prewarm restarts its age
    assert keep.tick({"m": model}.get) == 2  # type: ignore[arg-type]  # not "refreshed"
    clock.now += 100  # "old" is 300 s old now: dropped, and never re-warmed again
    assert sorted(str(e.prompt) for e in keep.entries()) == ["refreshed", "sys"]
    clock.now += 250  # refreshed at 200 s, so 350 s old now
    assert keep.tick({"m": model}.get) == 1  # type: ignore[arg-type]
    assert [e.prompt for e in keep.entries()] == ["sys"]


# --- through the app ---------------------------------------------------------------------------


@pytest.fixture
def app_clock() -> Iterator[tuple[TestClient, Clock]]:
    settings = stub_settings(
        keepalive_max_entries=2, keepalive_max_tokens=10_000, keepalive_max_age_s=600
    )
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        state = test_client.app.state.kvwarm  # type: ignore[attr-defined]
        clock = Clock()
        limits = state.keepalive.limits
        state.keepalive = KeepAlive((100.0,) * 3, 0.8, clock, limits)
        yield test_client, clock


def test_prewarm_keepalive_is_bounded_listed_removable_and_expires(
    app_clock: tuple[TestClient, Clock],
) -> None:
    client, clock = app_clock
    for i in range(2):
        body = {"model": "a", "prompt": f"system prompt number {i} " * 4}
        assert client.post("/cache/prewarm", json=body).status_code == 200
    third = client.post("/cache/prewarm", json={"model": "a", "prompt": "one too many"})
    assert third.status_code == 409, third.json()
    assert third.json()["error"]["code"] == "keepalive_full"
    ok = client.post("/cache/prewarm", json={"prompt": "not kept", "keep_alive": False})
    assert ok.status_code == 200
    listing = client.get("/cache/keepalive").json()
    assert listing["limits"] == {"max_entries": 2, "max_tokens": 10_000, "max_age_s": 600}
    first, second = listing["data"]
    assert first["model"] == "a" and first["n_tokens"] > 0 and first["expires_in_s"] == 600
    assert client.delete(f"/cache/keepalive/{first['id']}").json() == {"deleted": 1}
    assert client.delete(f"/cache/keepalive/{first['id']}").status_code == 404
    assert [e["id"] for e in client.get("/cache/keepalive").json()["data"]] == [second["id"]]
    assert client.post("/cache/prewarm", json={"prompt": "room again"}).status_code == 200
    clock.now += 599
    assert len(client.get("/cache/keepalive").json()["data"]) == 2
    clock.now += 1  # 600 s after their prewarm: dropped
    assert client.get("/cache/keepalive").json()["data"] == []
    assert client.post("/cache/prewarm", json={"prompt": "x y z"}).status_code == 200
    assert client.delete("/cache/keepalive").json() == {"deleted": 1}
    assert client.get("/cache/stats").json()["keep_alive"] == []


def test_entries_rewarm_under_their_own_salt_and_one_prompt_per_salt_is_kept() -> None:
    clock = Clock()
    keep = KeepAlive((100.0, 1000.0, 10_000.0), 0.8, clock)
    model = FakeModel()
    plain = keep.register("m", "system prompt", TtlClass.SHORT)
    alice = keep.register("m", "system prompt", TtlClass.SHORT, cache_salt="alice")
    keep.register("m", "system prompt", TtlClass.SHORT, cache_salt="alice")  # refresh, not add
    assert len(keep.entries()) == 2 and plain.id != alice.id
    # Unsalted ids are what they always were.
    assert plain.id == entry_id("m", "system prompt")
    clock.now += 80
    assert keep.tick({"m": model}.get) == 2  # type: ignore[arg-type]
    assert len(model.salts) == 2 and set(model.salts) == {"alice", None}
    assert keep.remove(alice.id) == 1
    assert [e.cache_salt for e in keep.entries()] == [None]
