"""The model registry alone, with fake models: leases, the cap, the idle unload, single-flight
lazy loads, sticky failures, aliases and the models directory's rules."""

from __future__ import annotations

import asyncio
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest

from kvwarm import models_dir
from kvwarm.engine.api import Model
from kvwarm.errors import (
    ConfigError,
    InvalidModelFileError,
    ModelBusyError,
    ModelCapacityError,
    ModelLoadError,
)
from kvwarm.server.errors import HTTPError
from kvwarm.server.registry import (
    ModelEntry,
    ModelRegistry,
    keep_alive_seconds,
    request_leases,
)
from kvwarm.settings import ModelSpec, Settings


@dataclass
class _Status:
    queued: int = 0
    active: int = 0


class FakeModel:
    def __init__(self, model_id: str) -> None:
        self.id = model_id
        self.busy = _Status()

    def status(self) -> _Status:
        return self.busy


class Loads:
    """Loader and unloader for the registry; a gate can hold a load until the test opens it."""

    def __init__(self, fail: frozenset[str] = frozenset()) -> None:
        self.fail = set(fail)
        self.bad_file: set[str] = set()  # raise InvalidModelFileError: the file's fault
        self.die: set[str] = set()  # raise a BaseException, not an Exception
        self.loaded: list[str] = []
        self.unloaded: list[str] = []
        self.gate: threading.Event | None = None
        self.started = threading.Event()

    def load(self, entry: ModelEntry) -> Model:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if entry.id in self.fail:
            raise ModelLoadError(f"{entry.id} is broken")
        if entry.id in self.bad_file:
            raise InvalidModelFileError(f"{entry.id}.gguf is cut short")
        if entry.id in self.die:
            raise SystemExit(f"{entry.id} ended its thread")
        self.loaded.append(entry.id)
        return cast(Model, FakeModel(entry.id))

    def unload(self, entry: ModelEntry) -> None:
        self.unloaded.append(entry.id)


def registry(loads: Loads, **overrides: object) -> ModelRegistry:
    base = Settings(
        cache_dir=None,
        backend="stub",
        models=(ModelSpec(path="stub-a", id="a"), ModelSpec(path="stub-b", id="b")),
    )
    return ModelRegistry(base.replace(**overrides), loads.load, loads.unload)


def _fake(model: Model) -> FakeModel:
    assert isinstance(model, FakeModel)
    return model


async def test_lazy_loads_are_single_flight_and_wake_every_waiter(tmp_path: Path) -> None:
    for name in ("x.gguf", "y.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    loads = Loads()
    reg = registry(loads, models=(), models_dir=tmp_path)
    assert {i: e.state for i, e in reg.entries.items()} == {"x": "available", "y": "available"}
    loads.gate = threading.Event()
    first = asyncio.create_task(reg.acquire("x"))
    second = asyncio.create_task(reg.acquire("x"))
    assert await asyncio.to_thread(loads.started.wait, 10)
    assert reg.entries["x"].state == "loading" and not first.done()
    loads.gate.set()
    a, b = await asyncio.gather(first, second)
    assert a is b and loads.loaded == ["x"]
    assert reg.entries["x"].state == "ready"


async def test_startup_loads_answer_503_and_failures_stay_failed() -> None:
    loads = Loads(fail=frozenset({"b"}))
    reg = registry(loads)
    with pytest.raises(HTTPError) as info:
        await reg.acquire("a")  # configured, not yet loaded at startup: 503 + Retry-After
    assert (info.value.status, info.value.code) == (503, "model_loading")
    for entry in list(reg.entries.values()):
        reg.load_now(entry)
    assert reg.startup_failure() is None  # a is ready: serve it
    with pytest.raises(HTTPError) as info:
        await reg.acquire("b")
    assert (info.value.status, info.value.code) == (503, "model_load_failed")
    assert "b is broken" in info.value.message
    loads.fail.clear()
    assert await reg.admin_load("b", None, None) == "b"  # an admin load retries it
    assert reg.entries["b"].state == "ready"


async def test_a_file_that_is_no_model_is_every_waiter_s_400_and_tried_again(
    tmp_path: Path,
) -> None:
    """A models_dir file llama.cpp refuses is the caller's to fix: each request that waited
    on the load gets the 400 naming the model (it was a 503 model_load_failed, sticky until
    an admin reloaded it), the entry stays available (``/health`` not degraded), and the
    next request tries the file again."""
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    loads = Loads()
    loads.bad_file.add("x")
    reg = registry(loads, models=(), models_dir=tmp_path)
    loads.gate = threading.Event()
    first = asyncio.create_task(reg.acquire("x"))
    second = asyncio.create_task(reg.acquire("x"))
    assert await asyncio.to_thread(loads.started.wait, 10)
    loads.gate.set()
    errors = await asyncio.gather(first, second, return_exceptions=True)
    for error in errors:
        assert isinstance(error, InvalidModelFileError), error
        assert str(error) == "the model 'x' cannot be loaded: x.gguf is cut short"
    assert errors[0] is not errors[1]  # each its own copy
    entry = reg.entries["x"]
    assert entry.state == "available" and "cut short" in (entry.error or "")
    loads.bad_file.clear()  # the file fixed
    assert _fake(await reg.acquire("x")).id == "x"
    assert entry.state == "ready" and entry.error is None


async def test_a_configured_model_whose_file_is_no_model_fails_as_any_load() -> None:
    """At startup nobody asked for the file but the operator: it fails (503), as before."""
    loads = Loads()
    loads.bad_file.add("b")
    reg = registry(loads)
    for entry in list(reg.entries.values()):
        reg.load_now(entry)
    with pytest.raises(HTTPError) as info:
        await reg.acquire("b")
    assert (info.value.status, info.value.code) == (503, "model_load_failed")
    assert "cut short" in info.value.message


async def test_a_load_thread_ended_by_a_base_exception_fails_the_load_and_wakes_waiters(
    tmp_path: Path,
) -> None:
    # A load that raised a BaseException left the entry "loading" and its waiters waiting on
    # a thread that was gone: every request for the model hung.
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    loads = Loads()
    loads.die.add("x")
    reg = registry(loads, models=(), models_dir=tmp_path)
    with pytest.raises(HTTPError) as info:
        await asyncio.wait_for(reg.acquire("x"), 30)
    assert (info.value.status, info.value.code) == (503, "model_load_failed")
    assert "ended its thread" in info.value.message and reg.entries["x"].state == "failed"


def test_every_model_failed_is_a_startup_failure_with_the_reasons() -> None:
    loads = Loads(fail=frozenset({"a", "b"}))
    reg = registry(loads)
    for entry in list(reg.entries.values()):
        reg.load_now(entry)
    failure = reg.startup_failure()
    assert failure is not None and "a: ModelLoadError: a is broken" in failure
    assert "b: ModelLoadError: b is broken" in failure


async def test_cap_unloads_the_least_recently_used_idle_model_never_a_leased_one() -> None:
    loads = Loads()
    reg = registry(
        loads,
        models=tuple(ModelSpec(path=f"stub-{i}", id=i) for i in "abc"),
        max_loaded_models=2,
    )
    for entry in list(reg.entries.values())[:2]:
        reg.load_now(entry)
    await reg.acquire("b")
    await reg.acquire("a")  # b is now the least recently used
    reg.entries["c"].state = "available"
    await reg.acquire("c")
    assert loads.unloaded == ["b"] and reg.entries["b"].state == "available"
    with request_leases():
        await reg.acquire("a")
        await reg.acquire("c")  # both loaded models leased by this request
        with pytest.raises(ModelCapacityError, match="all are busy"):
            await reg.acquire("b")
    # Requests queued or running inside the engine count as use too.
    _fake(await reg.acquire("a")).busy.active = 1
    _fake(await reg.acquire("c")).busy.queued = 1
    with pytest.raises(ModelCapacityError):
        await reg.acquire("b")
    _fake(await reg.acquire("c")).busy.queued = 0
    assert await reg.acquire("b") is not None and loads.unloaded == ["b", "c"]


async def test_idle_unload_skips_leased_and_busy_models_and_the_next_request_reloads() -> None:
    loads = Loads()
    reg = registry(loads, model_idle_unload_s=10.0)
    for entry in list(reg.entries.values()):
        reg.load_now(entry)
    now = reg.entries["a"].last_used + 11
    with request_leases():
        await reg.acquire("a")
        reg.entries["a"].last_used -= 100  # idle for long, but leased
        assert reg.reap_idle(now) == ["b"]
    _fake(await reg.acquire("a")).busy.active = 1
    assert reg.reap_idle(now + 1000) == []
    _fake(await reg.acquire("a")).busy.active = 0
    assert reg.reap_idle(reg.entries["a"].last_used + 10) == ["a"]
    assert loads.unloaded == ["b", "a"]
    assert reg.entries["a"].state == "available"
    await reg.acquire("a")  # loaded again on use
    assert loads.loaded.count("a") == 2


async def test_admin_unload_refuses_a_model_in_use() -> None:
    loads = Loads()
    reg = registry(loads)
    reg.load_now(reg.entries["a"])
    with request_leases():
        await reg.acquire("a")
        with pytest.raises(ModelBusyError, match="in flight"):
            reg.begin_unload("a")
    entry = reg.begin_unload("a")
    assert entry is not None
    reg.finish_unload(entry)
    assert reg.entries["a"].state == "available" and reg.begin_unload("a") is None


async def test_aliases_resolve_and_bad_ones_are_config_errors() -> None:
    loads = Loads()
    reg = registry(loads, aliases=(("gpt-4o-mini", "a"),))
    reg.load_now(reg.entries["a"])
    assert _fake(await reg.acquire("gpt-4o-mini")).id == "a"
    with pytest.raises(ConfigError, match="no model 'nope'"):
        registry(loads, aliases=(("x", "nope"),))
    with pytest.raises(HTTPError) as info:
        await reg.acquire("unknown")
    assert info.value.status == 404 and "gpt-4o-mini" in info.value.message


def test_models_dir_lists_regular_gguf_files_only(tmp_path: Path) -> None:
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"GGUF")
    d = tmp_path / "models"
    d.mkdir()
    for name in ("one.gguf", "Two.GGUF", "notes.txt", "big-00001-of-00002.gguf"):
        (d / name).write_bytes(b"GGUF")
    (d / "big-00002-of-00002.gguf").write_bytes(b"GGUF")
    os.symlink(outside, d / "link.gguf")
    (d / "sub.gguf").mkdir()
    found = models_dir.scan(d)
    assert sorted(found) == ["Two", "big", "one"]
    assert found["big"].name == "big-00001-of-00002.gguf"
    assert models_dir.checked_path(d, found["one"]) == found["one"]
    with pytest.raises(ModelLoadError, match="symlinks are refused"):
        models_dir.checked_path(d, d / "link.gguf")
    with pytest.raises(ModelLoadError, match="outside models_dir"):
        models_dir.checked_path(d, outside)
    with pytest.raises(ModelLoadError, match="no longer in models_dir"):
        models_dir.checked_path(d, d / "gone.gguf")


# --- keep_alive and pinned models (issue 41) --------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        (2.5, 2.5),
        (0, 0.0),
        ("0", 0.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        ("300", 300.0),
        (-1, math.inf),
        ("-1m", math.inf),
        ("-1", math.inf),
        (1e999, math.inf),
    ],
)
def test_keep_alive_reads_as_ollama_reads_it(value: float | str, seconds: float) -> None:
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize(
    "value",
    [
        *("", "5 minutes", "m", "5mm", "1h-30m", "nan", True, "5d"),
        # Found by review: the string was read by Python's float() and \d, so these were
        # durations (docs/server.md: "anything else is a 400"): "--5m" kept the model loaded
        # for ever, "1_0" was 10 s, Arabic-Indic and full-width digits were digits.
        *("--5m", "+-5", "-+5m", "1_0", "1_0m", "inf", "-Infinity", "1e3", "\u0663m"),
        *("\uff11\uff10", "\uff11\uff10m", "1e400"),
    ],
)
def test_a_keep_alive_that_is_no_duration_is_a_400(value: object) -> None:
    with pytest.raises(HTTPError) as caught:
        keep_alive_seconds(value)  # type: ignore[arg-type]
    assert caught.value.status == 400 and caught.value.param == "keep_alive"


async def test_a_requests_keep_alive_sets_how_long_its_model_stays() -> None:
    loads = Loads()
    reg = registry(loads, model_idle_unload_s=600.0)
    for entry in reg.entries.values():
        reg.load_now(entry)
    a, b = reg.entries["a"], reg.entries["b"]
    with request_leases():
        await reg.acquire("a", keep_alive=30.0, generation=True)
        assert reg.due(a) is None  # in use: never due
    assert reg.keep_alive(a) == 30.0 and reg.keep_alive(b) == 600.0
    start = a.last_used
    assert reg.reap_idle(start + 29) == []
    assert reg.reap_idle(start + 30) == ["a"] and loads.unloaded == ["a"]
    # The next request without one goes back to the server's (as each Ollama request does).
    await reg.acquire("a", generation=True)
    assert reg.keep_alive(a) == 600.0
    # Negative: loaded for ever (until an admin unloads it), even past the server's limit.
    await reg.acquire("a", keep_alive=math.inf, generation=True)
    assert reg.due(a) is None and reg.reap_idle(a.last_used + 1e9) == ["b"]
    # A lookup that is no generation (tokenize, an admin load) leaves it as it is.
    await reg.acquire("a")
    assert reg.keep_alive(a) == math.inf


async def test_keep_alive_zero_unloads_when_the_request_ends() -> None:
    loads = Loads()
    reg = registry(loads)  # model_idle_unload_s 0: nothing else would ever unload it
    reg.load_now(reg.entries["a"])
    reg.reaper_wake.clear()
    with request_leases():
        await reg.acquire("a", keep_alive=0.0, generation=True)
        assert reg.reap_idle() == []  # still answering
    assert reg.reaper_wake.is_set()  # the lease's end wakes the server's reaper ...
    assert reg.next_due() is not None and reg.next_due() <= 0  # type: ignore[operator]
    assert reg.reap_idle() == ["a"]  # ... which finds it due at once
    assert reg.entries["a"].state == "available" and reg.next_due() is None


async def test_pinned_models_are_never_unloaded_but_by_an_admin() -> None:
    loads = Loads()
    models = (
        ModelSpec(path="stub-a", id="a", options=(("pinned", True),)),
        ModelSpec(path="stub-b", id="b"),
        ModelSpec(path="stub-c", id="c"),
    )
    reg = registry(loads, models=models, model_idle_unload_s=5.0, max_loaded_models=2)
    a, b = reg.entries["a"], reg.entries["b"]
    assert a.pinned and not b.pinned
    reg.load_now(a)
    reg.load_now(b)
    await reg.acquire("a", keep_alive=0.0, generation=True)  # pinned wins over keep_alive
    later = max(a.last_used, b.last_used) + 1e6
    assert reg.due(a) is None and reg.reap_idle(later) == ["b"]
    reg.load_now(b)
    a.last_used = b.last_used - 100  # a is the least recently used: still never the victim
    reg.entries["c"].state = "available"
    await reg.acquire("c")
    assert loads.unloaded == ["b", "b"] and a.state == "ready"
    with request_leases():
        await reg.acquire("c")
        with pytest.raises(ModelCapacityError, match="busy or pinned"):
            await reg.acquire("b")
    assert reg.memory_victim(b) is reg.entries["c"]  # the budget's victim: never a
    reg.entries["c"].state = "ready"
    entry = reg.begin_unload("a")  # the admin's unload still works
    assert entry is not None
    reg.finish_unload(entry)
    assert a.state == "available"


def test_pinned_is_a_setting_global_or_per_model(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        '[[models]]\nid = "a"\npath = "stub-a"\npinned = true\n'
        '[[models]]\nid = "b"\npath = "stub-b"\nbackend = "stub"\n'
    )
    from kvwarm.settings import load_settings

    env = {"XDG_CONFIG_HOME": "/nonexistent-kvwarm-test"}
    s = load_settings({"config": str(config), "backend": "stub"}, env)
    reg = ModelRegistry(s, Loads().load, Loads().unload)
    assert (reg.entries["a"].pinned, reg.entries["b"].pinned) == (True, False)
    everything = load_settings(
        {"config": str(config), "backend": "stub"}, {**env, "KVWARM_PINNED": "1"}
    )
    reg = ModelRegistry(everything, Loads().load, Loads().unload)
    assert reg.entries["b"].pinned


async def test_the_threads_of_finished_loads_are_not_kept() -> None:
    """Found by review: the registry kept every load's thread for ``join`` for the server's
    life, one more per reload (``keep_alive`` 0 reloads a model for each request)."""
    loads = Loads()
    reg = registry(loads)
    for entry in list(reg.entries.values()):
        reg.load_now(entry)
    for _ in range(4):
        entry = reg.begin_unload("a")
        assert entry is not None
        reg.finish_unload(entry)
        await reg.acquire("a", lease=False)  # loaded again, on a thread of its own
        reg.join(10)  # that thread has ended
    assert loads.loaded.count("a") == 5
    assert len(reg._threads) == 1  # the last load's; the others were let go


async def test_a_reload_is_not_due_at_once_for_the_keep_alive_of_the_last_load() -> None:
    """Found by review: the ``keep_alive`` 0 of the request that had a model unloaded stayed
    on its entry, so the model loaded again for the next request was due at once: the reaper
    could unload it between the load's end and that request's lease (its waiter woken, not yet
    run), and the request then loaded it once more."""
    loads = Loads()
    reg = registry(loads, models=(), models_dir=None)
    reg.entries["a"] = ModelEntry(ModelSpec(path="stub-a", id="a"), "a", "admin", "available")
    with request_leases():
        await reg.acquire("a", keep_alive=0.0, generation=True)
    reg.join(10)
    assert reg.reap_idle() == ["a"]  # keep_alive 0: unloaded as its request ended
    loads.gate, loads.started = threading.Event(), threading.Event()
    again = asyncio.create_task(reg.acquire("a", generation=True))
    assert await asyncio.to_thread(loads.started.wait, 10)
    loads.gate.set()
    reg.join(10)  # loaded; the waiting request is woken but has not run yet (this loop)
    assert reg.reap_idle() == []
    assert await again is reg.entries["a"].model
    assert loads.loaded == ["a", "a"]
