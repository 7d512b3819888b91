"""Pressure sources and the scheduler (tick without the thread; the thread stops)."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvwarm.cache.types import EvictResult, PressureConfig, TierName
from kvwarm.cache.upkeep.pressure import (
    CallableSource,
    NoopSource,
    PressureScheduler,
    SystemMemorySource,
    make_source,
)
from kvwarm.errors import ConfigError


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[TierName, ...]]] = []
        self.called = threading.Event()

    def __call__(self, n: int, tiers: Sequence[TierName]) -> EvictResult:
        self.calls.append((n, tuple(tiers)))
        self.called.set()
        return EvictResult(1, n)


CFG = PressureConfig(enabled=True, high_watermark=0.8, low_watermark=0.6, min_evict_bytes=100)


def test_tick_below_high_does_nothing() -> None:
    rec = Recorder()
    s = PressureScheduler(CFG, CallableSource(lambda: (79, 100)), rec)
    r = s.tick()
    assert r.requested == 0 and r.evicted is None and not rec.calls


def test_tick_above_high_evicts_to_low_with_minimum() -> None:
    rec = Recorder()
    s = PressureScheduler(CFG, CallableSource(lambda: (9_000, 10_000)), rec)
    r = s.tick()
    assert r.requested == 3_000  # 9000 - 0.6 * 10000
    assert rec.calls == [(3_000, ("ram", "ram_file"))]
    rec2 = Recorder()
    s2 = PressureScheduler(CFG, CallableSource(lambda: (80, 100)), rec2)
    assert s2.tick().requested == 100  # 20 bytes over low, but at least min_evict_bytes
    assert s2.last is not None and s2.last.evicted == EvictResult(1, 100)


def test_zero_total_never_evicts() -> None:
    rec = Recorder()
    assert PressureScheduler(CFG, CallableSource(lambda: (5, 0)), rec).tick().evicted is None


def test_thread_runs_and_stops() -> None:
    rec = Recorder()
    cfg = PressureConfig(enabled=True, interval_ms=1, high_watermark=0.5, low_watermark=0.1)
    s = PressureScheduler(cfg, CallableSource(lambda: (10, 10)), rec)
    s.start()
    try:
        assert rec.called.wait(5)
    finally:
        s.stop()
    n = len(rec.calls)
    assert s._thread is None and n >= 1


def test_failing_source_does_not_kill_thread() -> None:
    calls = [0]
    ok = threading.Event()

    def flaky() -> tuple[int, int]:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError("sensor glitch")
        ok.set()
        return 0, 1

    cfg = PressureConfig(enabled=True, interval_ms=1)
    s = PressureScheduler(cfg, CallableSource(flaky), Recorder())
    s.start()
    try:
        assert ok.wait(5)
    finally:
        s.stop()


def test_make_source() -> None:
    assert isinstance(make_source("noop"), NoopSource)
    assert make_source("noop").sample() == (0, 1)
    assert isinstance(make_source("system"), SystemMemorySource)
    assert make_source(lambda: (1, 2)).sample() == (1, 2)
    src = NoopSource()
    assert make_source(src) is src
    with pytest.raises(ConfigError):
        make_source("bogus")


def test_nvidia_without_pynvml_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes "import pynvml" fail
    with pytest.raises(ConfigError, match="nvidia"):
        make_source("nvidia")


def test_system_source_prefers_tighter_cgroup_limit(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("900\n")
    used, total = SystemMemorySource(cgroup_dir=tmp_path).sample()
    assert (used, total) == (900, 1000)  # 90 % in the container beats the host's ratio
    (tmp_path / "memory.max").write_text("max\n")  # unlimited: the host's numbers
    used, total = SystemMemorySource(cgroup_dir=tmp_path).sample()
    assert total > 1000 and 0 <= used <= total


def test_system_source_without_cgroup_files(tmp_path: Path) -> None:
    used, total = SystemMemorySource(cgroup_dir=tmp_path / "missing").sample()
    assert total > 0 and 0 <= used <= total


def test_a_cgroup_v1_memory_limit_is_found(tmp_path: Path) -> None:
    """Found by review: only cgroup v2 was looked for, so inside a v1 container (this review's
    own machine is one) the container's limit was never watched, and nothing said so."""
    from kvwarm.cache.upkeep.pressure import _own_cgroup_files

    v1 = tmp_path / "memory" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("1000\n")
    (v1 / "memory.usage_in_bytes").write_text("950\n")
    proc = "9:name=systemd:/\n4:memory:/docker/abc\n2:cpu,cpuacct:/\n0::/\n"
    files = _own_cgroup_files(tmp_path, proc)
    assert files == (v1 / "memory.limit_in_bytes", v1 / "memory.usage_in_bytes")
    # A v2 directory with memory.max wins over the v1 controller.
    v2 = tmp_path / "svc"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")
    assert _own_cgroup_files(tmp_path, proc.replace("0::/", "0::/svc")) == (
        v2 / "memory.max",
        v2 / "memory.current",
    )
    assert _own_cgroup_files(tmp_path / "none", proc) is None
    source = SystemMemorySource()
    source._files = files
    assert source.sample() == (950, 1000)


def test_an_unreadable_cgroup_limit_is_a_warning_not_a_silent_fallback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "memory.max").mkdir()  # reading it fails (EISDIR), as EACCES would for a user
    (tmp_path / "memory.current").write_text("900\n")
    with caplog.at_level("INFO", logger="kvwarm.cache.upkeep.pressure"):
        source = SystemMemorySource(cgroup_dir=tmp_path)
        used, total = source.sample()
        source.sample()
    assert total > 0 and 0 <= used <= total  # the machine's numbers; the tick goes on
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "memory.max" in warnings[0].getMessage()
    assert "not watched" in warnings[0].getMessage()


def test_the_system_source_says_what_it_watches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("10\n")
    with caplog.at_level("INFO", logger="kvwarm.cache.upkeep.pressure"):
        SystemMemorySource(cgroup_dir=tmp_path)
        SystemMemorySource(cgroup_dir=tmp_path / "missing")
    messages = [r.getMessage() for r in caplog.records]
    assert any("cgroup limit" in m and "1000 bytes" in m for m in messages)
    assert any("watching the machine's memory" in m for m in messages)


def test_the_default_evict_tiers_evict_from_a_cache_without_ram_file() -> None:
    """Found by review: the default ``evict_tiers`` names ``ram`` and ``ram_file``, and a
    cache with no ``ram_file`` tier (the library's default, one ``ram`` tier) refused every
    eviction as naming a tier it lacks: each tick failed (logged) and none ever freed a byte.
    The tiers the cache lacks are skipped; naming none of its tiers is a ``ConfigError``."""
    from tests.cache.facadekit import req

    from kvwarm.cache import Cache, CacheConfig, TierConfig

    cfg = CacheConfig(
        tiers=(TierConfig("ram", 1 << 20),),
        pressure=PressureConfig(enabled=True, high_watermark=0.8, low_watermark=0.5),
    )
    with Cache(cfg, pressure_source=lambda: (90, 100), background=False) as c:
        assert c.save(req((1,) * 3, 1000), sync=True)
        assert c.pressure is not None
        result = c.pressure.tick()
        assert result.evicted is not None and result.evicted.rows == 1
        assert c.rows() == []
    refused = CacheConfig(
        tiers=(TierConfig("ram", 1 << 20),),
        pressure=PressureConfig(enabled=True, evict_tiers=("ram_file",)),
    )
    with pytest.raises(ConfigError, match="names no configured tier"):
        Cache(refused, pressure_source=lambda: (0, 1), background=False)


def test_a_source_that_stays_broken_logs_one_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: each failing tick logged its traceback, so a source that stayed
    broken (NVML after a driver reset) wrote one every interval for as long as the process
    ran. The first failure of a run is an error with its traceback; the rest are DEBUG, and
    a tick that works again says so."""
    calls = [0]
    recovered = threading.Event()

    def broken_for_a_while() -> tuple[int, int]:
        calls[0] += 1
        if calls[0] <= 5:
            raise OSError("NVML: GPU is lost")
        recovered.set()
        return 0, 1

    caplog.set_level(logging.DEBUG, logger="kvwarm.cache.upkeep.pressure")
    cfg = PressureConfig(enabled=True, interval_ms=1)
    s = PressureScheduler(cfg, CallableSource(broken_for_a_while), Recorder())
    s.start()
    try:
        assert recovered.wait(5)
    finally:
        s.stop()
    failed = [r for r in caplog.records if "tick failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.ERROR] + [logging.DEBUG] * 4
    assert failed[0].exc_info is not None
    assert any("succeed again" in r.getMessage() for r in caplog.records)


def test_a_cgroups_reclaimable_page_cache_is_not_pressure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (memrev): the cgroup's usage (``memory.current``) counts its page cache,
    which the kernel fills up to the limit and reclaims at will (a disk tier's reads), so a
    container whose cache files were read looked ~100 % used and every tick evicted the RAM
    tiers. Its inactive file pages are taken off, as the machine's reclaimable cache is (and as
    kubelet's working set does)."""
    import psutil

    host = SimpleNamespace(total=1 << 40, available=(1 << 40) - (1 << 30))  # 0.1 % used
    monkeypatch.setattr(psutil, "virtual_memory", lambda: host)
    (tmp_path / "memory.max").write_text("1000\n")
    (tmp_path / "memory.current").write_text("950\n")
    (tmp_path / "memory.stat").write_text("anon 300\nfile 640\ninactive_file 600\n")
    assert SystemMemorySource(cgroup_dir=tmp_path).sample() == (350, 1000)
    # Without memory.stat (or the key in it): the usage as it is.
    (tmp_path / "memory.stat").write_text("anon 300\n")
    assert SystemMemorySource(cgroup_dir=tmp_path).sample() == (950, 1000)
    (tmp_path / "memory.stat").unlink()
    assert SystemMemorySource(cgroup_dir=tmp_path).sample() == (950, 1000)


def test_a_cgroup_mounted_at_its_own_root_is_found(tmp_path: Path) -> None:
    """Docker on a cgroup v1 host (no cgroup namespace) lists the container's memory cgroup
    by its host path (``4:memory:/docker/<id>``) yet mounts that cgroup itself at
    /sys/fs/cgroup/memory, so the host path below the mount does not exist there. Found by
    review: only that path and the v2 root were tried, so such a container's limit was never
    watched (the machine's memory was, which the container cannot have). The controller's
    mount root is the next candidate, as the v2 root already was."""
    from kvwarm.cache.upkeep.pressure import _own_cgroup_files

    mount = tmp_path / "memory"
    mount.mkdir()
    (mount / "memory.limit_in_bytes").write_text("1000\n")
    (mount / "memory.usage_in_bytes").write_text("950\n")
    proc = "9:name=systemd:/docker/abc\n4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n"
    files = _own_cgroup_files(tmp_path, proc)
    assert files == (mount / "memory.limit_in_bytes", mount / "memory.usage_in_bytes")
    # The process's own directory, where it exists, still comes first.
    own = mount / "docker" / "abc"
    own.mkdir(parents=True)
    (own / "memory.limit_in_bytes").write_text("500\n")
    assert _own_cgroup_files(tmp_path, proc)[0] == own / "memory.limit_in_bytes"  # type: ignore[index]


def test_pressure_the_cache_cannot_relieve_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: under pressure the cache does not cause (a model's weights), once
    nothing is left to evict every tick logged "asked for N bytes, freed 0" at INFO, every
    interval (5 s) for as long as it lasted. The first such tick says so; the next ones are
    DEBUG until a tick frees something again."""
    freed = [0]

    def evict(n: int, tiers: Sequence[TierName]) -> EvictResult:
        return EvictResult(1 if freed[0] else 0, freed[0])

    s = PressureScheduler(CFG, CallableSource(lambda: (90, 100)), evict)
    caplog.set_level(logging.DEBUG, logger="kvwarm.cache.upkeep.pressure")
    for _ in range(3):
        s.tick()
    freed[0] = 10
    s.tick()
    freed[0] = 0
    s.tick()
    levels = [r.levelno for r in caplog.records if "memory pressure" in r.getMessage()]
    assert levels == [logging.INFO, logging.DEBUG, logging.DEBUG, logging.INFO, logging.INFO]
