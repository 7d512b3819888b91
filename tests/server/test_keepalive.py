"""Keep-alive re-warms prewarmed prefixes at a fraction of their TTL, within bounds (entries,
tokens, age), listed and removable through the app (all driven by a fake clock)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import pairwise
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvwarm.cache.types import TtlClass
from kvwarm.errors import (
    BackendError,
    ContextOverflowError,
    EngineClosedError,
    KeepAliveFullError,
    KvwarmError,
    UnknownModelError,
)
from kvwarm.server import create_app
from kvwarm.server.keepalive import KeepAlive, KeepAliveLimits, entry_id

from .conftest import stub_settings, wait_ready


class FakeModel:
    def __init__(self, fail: bool = False, error: KvwarmError | None = None) -> None:
        self.calls: list[tuple[str | Sequence[int], TtlClass, bool]] = []
        self.salts: list[str | None] = []
        self.fail = fail
        self.error = error
        self.tries = 0

    def prewarm(
        self,
        prompt: str | Sequence[int],
        *,
        ttl_class: TtlClass,
        add_special: bool,
        cache_salt: str | None = None,
    ) -> None:
        self.tries += 1
        if self.fail:
            raise self.error or BackendError("boom")
        self.calls.append((prompt, ttl_class, add_special))
        self.salts.append(cache_salt)

    def prewarm_chat(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("these entries are prompts, not chats")


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
    clock.now += 60  # the keep-alive interval: retried on the next tick
    assert len(keep.due()) == 2
    keep.forget("broken")
    assert [e.model_id for e in keep.entries()] == ["loading"]


def _tries_at(keep: KeepAlive, clock: Clock, model: FakeModel, until: float) -> list[float]:
    """Tick every 10 s (the interval) until ``until``: the times ``model`` was tried."""
    seen: list[float] = []
    while clock.now < until:
        clock.now += 10
        before = model.tries
        keep.tick({"m": model}.get)  # type: ignore[arg-type]
        if model.tries > before:
            seen.append(clock.now - 1000)
    return seen


def test_a_failing_entry_backs_off_exponentially_up_to_its_period_and_resets() -> None:
    """A re-warm that kept failing was retried every tick for ever (pinned) or for a day,
    a warning each time (found by review). Now the wait doubles from the interval, capped at
    the entry's re-warm period, and a success resets it."""
    clock = Clock()
    # TTL 1000 s, stale at 0.5: a period of 500 s; the server ticks every 10 s.
    keep = KeepAlive((1000.0,) * 3, 0.5, clock, KeepAliveLimits(10, 1000, 0), interval_s=10)
    model = FakeModel(fail=True)
    entry = keep.register("m", "p", TtlClass.SHORT, pinned=True)
    tries = _tries_at(keep, clock, model, 1000 + 500 + 10 + 20 + 40 + 80 + 160 + 320 + 500 * 2)
    waits = [b - a for a, b in pairwise(tries)]
    assert tries[0] == 500 and waits == [10, 20, 40, 80, 160, 320, 500, 500]
    assert entry.failing == entry.failures == 9 and keep.entries() == [entry]
    model.fail = False
    clock.now += 500
    assert keep.tick({"m": model}.get) == 1  # type: ignore[arg-type]
    assert entry.failing == 0 and entry.failures == 9 and entry.warms == 2
    model.fail = True
    start = clock.now - 1000
    tries = _tries_at(keep, clock, model, clock.now + 500 + 30)
    assert [t - start for t in tries] == [500, 510, 530]  # back to the interval


@pytest.mark.parametrize(
    "error",
    [ContextOverflowError("too long"), UnknownModelError("gone")],
    ids=["context_overflow", "unknown_model"],
)
def test_a_permanent_failure_drops_an_unpinned_entry_but_not_a_pinned_one(
    error: KvwarmError, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    keep = KeepAlive((100.0,) * 3, 0.5, clock, interval_s=10)
    model = FakeModel(fail=True, error=error)
    keep.register("m", "p", TtlClass.SHORT)
    pinned = keep.register("m", "sys", TtlClass.SHORT, pinned=True)
    clock.now += 50
    with caplog.at_level("WARNING", logger="kvwarm.server.keepalive"):
        assert keep.tick({"m": model}.get) == 0  # type: ignore[arg-type]
    assert keep.entries() == [pinned] and model.tries == 2
    assert sum("dropped" in r.getMessage() for r in caplog.records) == 1
    clock.now += 10
    assert keep.tick({"m": model}.get) == 0  # type: ignore[arg-type]
    assert model.tries == 3 and pinned.failing == 2  # the pinned one retries, backed off
    clock.now += 10
    assert keep.tick({"m": model}.get) == 0 and model.tries == 3  # type: ignore[arg-type]


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


def test_a_model_unloaded_during_its_rewarm_is_not_ready_not_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The model was ready when the tick took it, and unloaded (idle, the memory budget, an
    admin) before its re-warm ran: the re-warm raises ``EngineClosedError``. Found by review:
    that counted as the entry's failure, a warning and a backoff, though nothing is wrong
    with the prefix (an unloaded model's entries wait for it to load: skipped, as when the
    tick finds it unloaded). A model still the ready one that raises it does fail."""
    clock = Clock()
    keep = KeepAlive((100.0,) * 3, 0.5, clock, interval_s=10)
    entry = keep.register("m", "p", TtlClass.SHORT)
    model = FakeModel(fail=True, error=EngineClosedError("model 'm' is closed"))
    ready: dict[str, FakeModel] = {"m": model}

    def unloaded_meanwhile(model_id: str) -> FakeModel | None:
        found = ready.get(model_id)
        ready.clear()  # the next look finds it unloaded
        return found

    clock.now += 50
    with caplog.at_level("WARNING", logger="kvwarm.server.keepalive"):
        assert keep.tick(unloaded_meanwhile) == 0  # type: ignore[arg-type]
    assert model.tries == 1 and (entry.failures, entry.failing, entry.retry_at) == (0, 0, 0.0)
    assert not caplog.records
    assert [e.id for e in keep.due()] == [entry.id]  # re-warmed once the model is back
    assert keep.tick({"m": model}.get) == 0  # type: ignore[arg-type]
    assert entry.failures == 1  # still the ready model: its failure


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
    ok = client.post("/cache/prewarm", json={"prompt": "not kept " * 10, "keep_alive": False})
    assert ok.status_code == 200
    listing = client.get("/cache/keepalive").json()
    assert listing["limits"] == {"max_entries": 2, "max_tokens": 10_000, "max_age_s": 600}
    first, second = listing["data"]
    assert first["model"] == "a" and first["n_tokens"] > 0 and first["expires_in_s"] == 600
    assert client.delete(f"/cache/keepalive/{first['id']}").json() == {"deleted": 1}
    assert client.delete(f"/cache/keepalive/{first['id']}").status_code == 404
    assert [e["id"] for e in client.get("/cache/keepalive").json()["data"]] == [second["id"]]
    assert client.post("/cache/prewarm", json={"prompt": "room again " * 8}).status_code == 200
    clock.now += 599
    assert len(client.get("/cache/keepalive").json()["data"]) == 2
    clock.now += 1  # 600 s after their prewarm: dropped
    assert client.get("/cache/keepalive").json()["data"] == []
    assert client.post("/cache/prewarm", json={"prompt": "x y z " * 12}).status_code == 200
    assert client.delete("/cache/keepalive").json() == {"deleted": 1}
    assert client.get("/cache/stats").json()["keep_alive"] == []


def test_a_prewarm_shorter_than_min_tokens_is_a_400_and_is_not_kept_alive(
    app_clock: tuple[TestClient, Clock],
) -> None:
    """No row under min_tokens is saved or looked up: such a prewarm was prefilled, answered
    200 with no key, and its keep-alive entry prefilled it again every period for nothing. A
    chat's fault names its messages (found by review: it named ``prompt``, which the body did
    not have)."""
    client, _ = app_clock
    short = client.post("/cache/prewarm", json={"prompt": "too short"})
    assert short.status_code == 400, short.json()
    error = short.json()["error"]
    assert error["param"] == "prompt" and "rows are at least min_tokens" in error["message"]
    chat = client.post("/cache/prewarm", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert client.get("/cache/keepalive").json()["data"] == []
    long = client.post("/cache/prewarm", json={"prompt": "long enough " * 8})
    assert long.status_code == 200 and long.json()["key"] is not None
    assert len(client.get("/cache/keepalive").json()["data"]) == 1


def test_a_prewarm_takes_token_ids_as_documented_and_keeps_them_alive(
    app_clock: tuple[TestClient, Clock],
) -> None:
    """Found by review: docs/operations.md says ``/cache/prewarm`` takes ``prompt`` as text
    or token ids (as ``Model.prewarm`` and keep-alive do), but the body refused ids with a 400
    ("Input should be a valid string"). Ids are taken as a completion takes them: as they
    are, checked against the vocabulary."""
    client, clock = app_clock
    ids = [ord(c) for c in "a system prompt given as ids "]
    warm = client.post("/cache/prewarm", json={"prompt": ids})
    assert warm.status_code == 200, warm.json()
    assert warm.json()["prompt_tokens"] == len(ids) and warm.json()["key"] is not None
    (entry,) = client.get("/cache/keepalive").json()["data"]
    assert entry["n_tokens"] == len(ids)
    body = {"model": "a", "prompt": ids, "max_tokens": 1}
    done = client.post("/v1/completions", json=body)
    assert done.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids)
    clock.now += 90  # past the re-warm point of its TTL (100 s): re-warmed from its ids
    client.app.state.kvwarm._keepalive_tick()  # type: ignore[attr-defined]
    (entry,) = client.get("/cache/keepalive").json()["data"]
    assert (entry["warms"], entry["failures"]) == (2, 0)
    bad = client.post("/cache/prewarm", json={"prompt": [*ids, 1 << 20]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


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


def test_the_listing_shows_an_entry_backing_off(app_clock: tuple[TestClient, Clock]) -> None:
    """An operator sees which kept prefixes are failing and when each is tried next."""
    client, clock = app_clock
    assert client.post("/cache/prewarm", json={"prompt": "kept " * 8}).status_code == 200
    (entry,) = client.app.state.kvwarm.keepalive.entries()  # type: ignore[attr-defined]
    fresh = client.get("/cache/keepalive").json()["data"][0]
    assert (fresh["failing"], fresh["retry_in_s"]) == (0, None)
    entry.failing, entry.failures, entry.retry_at = 3, 3, clock.now + 40
    listed = client.get("/cache/keepalive").json()["data"][0]
    assert (listed["failing"], listed["failures"], listed["retry_in_s"]) == (3, 3, 40)


@pytest.mark.parametrize("kind", ["prompt", "messages"])
def test_a_prewarm_past_the_token_limit_is_refused_before_its_prefill(kind: str) -> None:
    """Found by review (memrev): only a prompt of token ids was measured before the prefill;
    a text prompt or a chat passed ``check_room`` as 0 tokens, was prefilled and saved, and
    only then answered 409 (a prefill of any length, for a refusal)."""
    settings = stub_settings(keepalive_max_tokens=40)
    text = "a long system prompt that keeps going " * 10
    chat = [{"role": "system", "content": text}]
    body: dict[str, object] = {"prompt": text} if kind == "prompt" else {"messages": chat}
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        refused = client.post("/cache/prewarm", json=body)
        assert refused.status_code == 409, refused.json()
        assert "over its limit of 40" in refused.json()["error"]["message"]
        counters = client.get("/cache/stats").json()["counters"]
        assert counters.get("saves_prewarm", 0) == 0  # nothing was prefilled or saved
        assert client.get("/cache/keepalive").json()["data"] == []
        kept = client.post("/cache/prewarm", json={**body, "keep_alive": False})
        n_tokens = kept.json()["prompt_tokens"]
        assert kept.status_code == 200 and n_tokens > 40
        # Measured exactly: a limit of just its length keeps it.
        state = client.app.state.kvwarm  # type: ignore[attr-defined]
        state.keepalive.limits = KeepAliveLimits(max_tokens=n_tokens)
        assert client.post("/cache/prewarm", json=body).status_code == 200
        assert [e["n_tokens"] for e in client.get("/cache/keepalive").json()["data"]] == [n_tokens]


def test_a_kept_prefix_of_a_model_that_is_gone_is_dropped(tmp_path: Path) -> None:
    """Found by review (memrev): an entry whose model the server no longer knows (its
    models_dir file deleted, the model unloaded) was skipped by every tick as "not ready",
    never dropped: it held one of ``max_entries`` and was listed as kept for up to
    ``max_age_s`` (for ever with 0), although operations.md says an entry whose model is gone
    is dropped. An entry of a model merely unloaded stays (it re-warms once it loads)."""
    d = tmp_path / "models"
    d.mkdir()
    for name in ("alpha.gguf", "beta.gguf"):
        (d / name).write_bytes(b"GGUF stub weights " + name.encode())
    with TestClient(create_app(stub_settings(models=(), models_dir=d))) as client:
        wait_ready(client.get)
        state = client.app.state.kvwarm  # type: ignore[attr-defined]
        clock = Clock()
        state.keepalive = KeepAlive((100.0,) * 3, 0.8, clock, state.keepalive.limits)
        for model in ("alpha", "beta"):
            body = {"model": model, "prompt": "a system prompt kept warm " * 6}
            assert client.post("/cache/prewarm", json=body).status_code == 200
        for model in ("alpha", "beta"):
            unloaded = client.post("/admin/models/unload", json={"model": model})
            assert unloaded.status_code == 200, unloaded.json()
        (d / "alpha.gguf").unlink()
        state.registry.rescan()
        clock.now += 80  # both due: alpha's is dropped, beta's waits for its model
        state._keepalive_tick()
        listed = client.get("/cache/keepalive").json()["data"]
        assert [e["model"] for e in listed] == ["beta"]


def test_an_unloaded_models_entries_wait_and_load_nothing(
    app_clock: tuple[TestClient, Clock],
) -> None:
    """Keep-alive never loads a model to re-warm it (that would undo the idle unload and the
    memory budget): a due entry of an unloaded model is skipped, kept, and no failure; it
    re-warms once a request has loaded the model again."""
    client, clock = app_clock
    assert (
        client.post("/cache/prewarm", json={"model": "b", "prompt": "kept " * 8}).status_code == 200
    )
    assert client.post("/admin/models/unload", json={"model": "b"}).status_code == 200
    state = client.app.state.kvwarm  # type: ignore[attr-defined]
    clock.now += 80
    state._keepalive_tick()
    assert state.entries["b"].state == "available"
    (entry,) = state.keepalive.entries()
    assert (entry.warms, entry.failures) == (1, 0)
    done = client.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 1})
    assert done.status_code == 200
    state._keepalive_tick()
    assert (entry.warms, entry.failures) == (2, 0)
