"""Memory-pressure scheduler: sample a source, evict cache rows above a high watermark.

Invariant: a tick evicts only when ``used / total >= high_watermark``, and then asks for
``max(used - low_watermark * total, min_evict_bytes)`` bytes from the configured tiers, so one
tick brings the ratio under the low mark if the cache holds enough evictable bytes. A sample
that fails or reports ``total <= 0`` never evicts. The scheduler never raises into its thread:
a failing source or evictor is logged and retried next interval.

Sources: ``noop`` (no pressure), ``system`` (psutil, tightened by cgroup v2 limits: inside a
container psutil reports the host), ``nvidia`` (NVML via the optional ``pynvml`` module, summed
over all GPUs) and any callable returning ``(used, total)``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvwarm.cache.types import EvictResult, PressureConfig, TierName
from kvwarm.errors import ConfigError

__all__ = [
    "CallableSource",
    "NoopSource",
    "NvidiaSource",
    "PressureScheduler",
    "PressureSource",
    "SystemMemorySource",
    "TickResult",
    "make_source",
]

log = logging.getLogger(__name__)

_CGROUP_ROOT = Path("/sys/fs/cgroup")


@runtime_checkable
class PressureSource(Protocol):
    def sample(self) -> tuple[int, int]:
        """(used bytes, total bytes) of the resource. Must be cheap: it runs every tick."""
        ...


class NoopSource:
    """Always reports zero pressure."""

    def sample(self) -> tuple[int, int]:
        return 0, 1


class CallableSource:
    def __init__(self, fn: Callable[[], tuple[int, int]]) -> None:
        self._fn = fn

    def sample(self) -> tuple[int, int]:
        used, total = self._fn()
        return int(used), int(total)


def _read_cgroup_value(path: Path) -> int | None:
    """An integer from a cgroup v2 file; None for ``max`` (unlimited) or if unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _own_cgroup_dir(root: Path) -> Path:
    """This process's cgroup v2 directory (``0::/path`` in /proc/self/cgroup), else ``root``."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                candidate = root / line[3:].lstrip("/")
                if (candidate / "memory.max").exists():
                    return candidate
    except OSError:
        pass
    return root


class SystemMemorySource:
    """System memory via psutil, tightened by the cgroup v2 memory limit when one applies.

    ``used`` is total minus available (reclaimable page cache does not count as pressure). If a
    cgroup sets ``memory.max`` below the machine's memory, the cgroup's ``memory.current``
    against its ``memory.max`` is used instead when it is the higher ratio.
    """

    def __init__(self, cgroup_dir: Path | None = None) -> None:
        try:
            import psutil
        except ImportError as exc:  # psutil is a hard dependency; this is a broken install
            raise ConfigError("pressure source 'system' needs psutil") from exc
        self._psutil = psutil
        self._cgroup = cgroup_dir if cgroup_dir is not None else _own_cgroup_dir(_CGROUP_ROOT)

    def sample(self) -> tuple[int, int]:
        vm = self._psutil.virtual_memory()
        used, total = int(vm.total - vm.available), int(vm.total)
        limit = _read_cgroup_value(self._cgroup / "memory.max")
        current = _read_cgroup_value(self._cgroup / "memory.current")
        if (
            limit is not None
            and current is not None
            and limit > 0
            and (total <= 0 or current / limit > used / total)
        ):
            return current, limit
        return used, total


class NvidiaSource:
    """VRAM summed over all visible NVIDIA GPUs (NVML)."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise ConfigError(
                "pressure source 'nvidia' needs NVML bindings: pip install 'kvwarm[nvidia]'"
            ) from exc
        try:
            pynvml.nvmlInit()
            self._handles = [
                pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
            ]
        except Exception as exc:  # pynvml raises its own NVMLError tree
            raise ConfigError(f"pressure source 'nvidia': NVML unavailable: {exc}") from exc
        self._nvml = pynvml

    def sample(self) -> tuple[int, int]:
        used = total = 0
        for h in self._handles:
            mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
            used += int(mem.used)
            total += int(mem.total)
        return used, total


def make_source(
    spec: str | PressureSource | Callable[[], tuple[int, int]],
) -> PressureSource:
    """A source from a config name, a ``PressureSource`` or a plain callable."""
    if isinstance(spec, str):
        if spec == "noop":
            return NoopSource()
        if spec == "system":
            return SystemMemorySource()
        if spec == "nvidia":
            return NvidiaSource()
        raise ConfigError(f"unknown pressure source {spec!r}")
    if isinstance(spec, PressureSource):
        return spec
    if callable(spec):
        return CallableSource(spec)
    raise ConfigError(f"pressure source must be a name or callable, got {type(spec).__name__}")


@dataclass(frozen=True, slots=True)
class TickResult:
    used: int
    total: int
    requested: int  # bytes asked of the cache; 0 when under the high watermark
    evicted: EvictResult | None


Evictor = Callable[[int, Sequence[TierName]], EvictResult]


class PressureScheduler:
    """Polls ``source`` every ``interval_ms`` and evicts through ``evict`` above the mark."""

    def __init__(self, config: PressureConfig, source: PressureSource, evict: Evictor) -> None:
        self._cfg = config
        self._source = source
        self._evict = evict
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last: TickResult | None = None

    def tick(self) -> TickResult:
        """Sample once and evict if needed. Exceptions propagate (the thread logs them)."""
        used, total = self._source.sample()
        requested = 0
        evicted: EvictResult | None = None
        if total > 0 and used / total >= self._cfg.high_watermark:
            target = used - int(self._cfg.low_watermark * total)
            requested = max(target, self._cfg.min_evict_bytes)
            evicted = self._evict(requested, self._cfg.evict_tiers)
            log.info(
                "memory pressure %.2f >= %.2f: asked for %d bytes, freed %d in %d rows",
                used / total,
                self._cfg.high_watermark,
                requested,
                evicted.bytes,
                evicted.rows,
            )
        result = TickResult(used, total, requested, evicted)
        self.last = result
        return result

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvwarm-pressure", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = self._cfg.interval_ms / 1000.0
        while not self._stop.wait(interval):
            try:
                self.tick()
            except Exception:
                log.exception("pressure tick failed; retrying next interval")

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
