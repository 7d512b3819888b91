"""Memory-pressure scheduler: sample a source, evict cache rows above a high watermark.

Invariant: a tick evicts only when ``used / total >= high_watermark``, and then asks for
``max(used - low_watermark * total, min_evict_bytes)`` bytes from the configured tiers, so one
tick brings the ratio under the low mark if the cache holds enough evictable bytes. The
``evict_tiers`` it is given are those of the cache's tiers that ``PressureConfig.evict_tiers``
names (``Cache`` drops the others: the default names ``ram`` and ``ram_file``). A sample
that fails or reports ``total <= 0`` never evicts. The scheduler never raises into its thread:
a failing source or evictor is logged (its traceback once while it keeps failing) and retried
next interval.

Sources: ``noop`` (no pressure), ``system`` (psutil, tightened by a cgroup's memory limit, v2
or v1: inside a container psutil reports the host), ``nvidia`` (NVML via the optional
``pynvml`` module, summed over all GPUs) and any callable returning ``(used, total)``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvwarm.cache.types import EvictResult, PressureConfig, TierName
from kvwarm.cache.upkeep.periodic import run_every
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
    """An integer from a cgroup file; None for ``max`` (unlimited) or text that is not one.
    ``OSError`` if it cannot be read (``SystemMemorySource`` says so in the log)."""
    text = path.read_text().strip()
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


# cgroup v1 writes "no limit" as LLONG_MAX rounded down to a page.
_UNLIMITED = 1 << 62

# (limit, usage) file names: cgroup v2, then v1's memory controller.
_V2_FILES = ("memory.max", "memory.current")
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes")
# The usage's reclaimable page cache, in the memory.stat beside it: v1's hierarchical total
# first (its plain ``inactive_file`` is the cgroup's own pages only), then v2's.
_INACTIVE_FILE_KEYS = ("total_inactive_file", "inactive_file")


def _inactive_file(stat: Path) -> int:
    """The inactive file pages ``stat`` (a cgroup's memory.stat) counts, which the kernel
    reclaims before it would OOM-kill: 0 if it cannot be read or has no such key."""
    try:
        text = stat.read_text()
    except OSError:
        return 0
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        values[key] = value.strip()
    for key in _INACTIVE_FILE_KEYS:
        if values.get(key, "").isdigit():
            return int(values[key])
    return 0


def _own_cgroup_files(root: Path, proc_cgroup: str | None = None) -> tuple[Path, Path] | None:
    """This process's cgroup memory limit and usage files: its cgroup v2 directory (``0::/path``
    in /proc/self/cgroup), else its v1 memory controller's (``N:memory:/path``, found by review:
    a v1 container's limit was never watched), else those at the mount roots, ``root``'s v2
    files and ``root/memory``'s v1 ones; None if none exist. A container without a cgroup
    namespace (Docker on a v1 host) sees its cgroup's host path in /proc/self/cgroup but has
    that cgroup itself mounted at the root, where the host path does not exist (found by
    review: such a container's limit was never watched)."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    lines = proc_cgroup.splitlines()
    candidates: list[tuple[Path, tuple[str, str]]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            candidates.insert(0, (root / parts[2].lstrip("/"), _V2_FILES))
        elif "memory" in parts[1].split(","):
            candidates.append((root / "memory" / parts[2].lstrip("/"), _V1_FILES))
    candidates.append((root, _V2_FILES))
    if any(files == _V1_FILES for _, files in candidates):
        candidates.append((root / "memory", _V1_FILES))
    for directory, (limit, usage) in candidates:
        if (directory / limit).exists():
            return directory / limit, directory / usage
    return None


class SystemMemorySource:
    """System memory via psutil, tightened by the cgroup memory limit when one applies.

    ``used`` is total minus available (reclaimable page cache does not count as pressure). If a
    cgroup (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``) sets a limit below the
    machine's memory, the cgroup's usage (less its inactive page cache, ``memory.stat``'s
    ``inactive_file``: reclaimable, as the machine's is) against its limit is used instead
    when it is the higher ratio. What is watched is logged at construction; a cgroup file that
    cannot be read is a warning (once), never a silent fallback to the machine's numbers.
    """

    def __init__(self, cgroup_dir: Path | None = None) -> None:
        try:
            import psutil
        except ImportError as exc:  # psutil is a hard dependency; this is a broken install
            raise ConfigError("pressure source 'system' needs psutil") from exc
        self._psutil = psutil
        if cgroup_dir is not None:
            self._files: tuple[Path, Path] | None = (
                cgroup_dir / _V2_FILES[0],
                cgroup_dir / _V2_FILES[1],
            )
        else:
            self._files = _own_cgroup_files(_CGROUP_ROOT)
        self._warned = False
        self._describe()

    def _describe(self) -> None:
        if self._files is None:
            log.info(
                "pressure source 'system': no cgroup memory files for this process; "
                "watching the machine's memory"
            )
            return
        limit_path = self._files[0]
        try:
            limit = _read_cgroup_value(limit_path)
        except FileNotFoundError:
            log.info("pressure source 'system': no %s; watching the machine's memory", limit_path)
            return
        except OSError as exc:
            self._warn(limit_path, exc)
            return
        log.info(
            "pressure source 'system': watching the machine's memory and the cgroup limit %s (%s)",
            limit_path,
            "unlimited" if limit is None or limit >= _UNLIMITED else f"{limit} bytes",
        )

    def _warn(self, path: Path, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "pressure source 'system': cannot read %s (%s): the cgroup's memory limit is "
                "not watched, only the machine's memory",
                path,
                exc,
            )

    def _cgroup(self) -> tuple[int, int] | None:
        """(usage, limit) of the cgroup when it sets a limit and both read."""
        if self._files is None:
            return None
        limit_path, usage_path = self._files
        try:
            limit = _read_cgroup_value(limit_path)
            current = _read_cgroup_value(usage_path) if limit is not None else None
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn(limit_path if exc.filename == str(limit_path) else usage_path, exc)
            return None
        if limit is None or current is None or limit <= 0:
            return None
        # The usage counts page cache that the kernel fills up to the limit and reclaims at
        # will: its inactive part is no more pressure than the machine's reclaimable cache is
        # (found by review: a container that had read its disk tier looked full, and every
        # tick evicted the RAM tiers). kubelet's working set is the same difference.
        return max(0, current - _inactive_file(usage_path.parent / "memory.stat")), limit

    def sample(self) -> tuple[int, int]:
        vm = self._psutil.virtual_memory()
        used, total = int(vm.total - vm.available), int(vm.total)
        cgroup = self._cgroup()
        if cgroup is not None:
            current, limit = cgroup
            if total <= 0 or current / limit > used / total:
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
        self._idle = False  # the last eviction freed nothing

    def tick(self) -> TickResult:
        """Sample once and evict if needed. Exceptions propagate (the thread logs them)."""
        used, total = self._source.sample()
        requested = 0
        evicted: EvictResult | None = None
        if total > 0 and used / total >= self._cfg.high_watermark:
            target = used - int(self._cfg.low_watermark * total)
            requested = max(target, self._cfg.min_evict_bytes)
            evicted = self._evict(requested, self._cfg.evict_tiers)
            # A tick that frees nothing after one that did not either is DEBUG (found by
            # review: pressure the cache does not cause, a model's weights, logged this at
            # INFO every interval for as long as it lasted, with nothing left to evict).
            idle = not evicted.bytes and not evicted.rows
            log.log(
                logging.DEBUG if idle and self._idle else logging.INFO,
                "memory pressure %.2f >= %.2f: asked for %d bytes, freed %d in %d rows%s",
                used / total,
                self._cfg.high_watermark,
                requested,
                evicted.bytes,
                evicted.rows,
                " (nothing evictable is left; said again once a tick frees some)" if idle else "",
            )
            self._idle = idle
        result = TickResult(used, total, requested, evicted)
        self.last = result
        return result

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvwarm-pressure", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        run_every(self._stop, self._cfg.interval_ms / 1000.0, self.tick, "pressure tick", log)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
