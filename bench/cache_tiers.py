"""Save and load throughput of each cache tier, beside memcpy and a plain file read.

    python bench/cache_tiers.py [--sizes-mb 1 10 50] [--reps 5] [--disk-dir DIR]

For every payload size: ``ram`` (in process), ``ram_file`` (a temp dir on /dev/shm) and
``disk`` (a temp dir under the user cache dir, on the real disk). Save = the whole publish
protocol (build prefix with CRC, O_EXCL temp, writev, fdatasync, link, dir fsync). Load =
``Tier.load`` (one readinto into a fresh buffer + CRC32C + key replay; zero-copy for ram).
Baselines in the same run: memcpy into a fresh bytearray, and a plain ``readinto`` of the same
file (open + fstat + fresh bytearray + read). Ratios are load time / baseline time (goal: file
tiers within 1.5x of a plain read). Medians; loads are page-cache warm.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.protocols import StoredRow, Tier
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.types import Namespace, SaveReason, SaveRequest, TierName

NS = Namespace(fingerprint=b"\x01" * 32, quant=1, ctx_hash=b"\x02" * 32)
MB = 1 << 20


class YesBook:
    """Grants every reservation: the bench measures the tiers, not the index."""

    def __init__(self) -> None:
        self._tokens = itertools.count(1)

    def reserve(self, key: bytes, tier: TierName) -> int | None:
        return next(self._tokens)

    def check(self, key: bytes, token: int) -> bool:
        return True

    def mark_linked(self, key: bytes, token: int, location: str) -> None:
        pass

    def publish(self, key: bytes, token: int, row: StoredRow) -> bool:
        return True

    def abandon(self, key: bytes, token: int) -> None:
        pass

    def adopt(self, row: StoredRow) -> bool:
        return True


def plain_read(path: str) -> bytearray:
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        mv, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(mv[got:])
            if not n:
                break
            got += n
        mv.release()
    return buf


def bench_tier(
    tier: Tier, payload: bytes, reps: int, serial: itertools.count[int]
) -> dict[str, float]:
    """Median seconds per save, load, plain read and memcpy. Loads, reads and copies are
    interleaved sample by sample so that background load on a shared machine hits all alike."""
    book = YesBook()
    saves: list[float] = []
    loads: list[float] = []
    reads: list[float] = []
    copies: list[float] = []
    tokens_base = tuple(range(2048))
    inner = max(3, 64 * MB // max(len(payload), 1))
    for _ in range(reps):
        tokens = (next(serial), *tokens_base)
        key = cache_key(NS, tokens)
        req = SaveRequest(NS, tokens, payload, SaveReason.COLD, tier.name)
        t0 = time.perf_counter()
        stored = tier.store(key, req, book)
        saves.append(time.perf_counter() - t0)
        assert stored is not None
        tier.load(stored)  # warm-up: page cache and allocator, as a hot restore would see
        for _ in range(inner):
            t0 = time.perf_counter()
            tier.load(stored)
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            bytearray(payload)
            copies.append(time.perf_counter() - t0)
            if stored.location is not None:
                t0 = time.perf_counter()
                plain_read(stored.location)
                reads.append(time.perf_counter() - t0)
        tier.delete(stored.info.key)
    out = {
        "save": statistics.median(saves),
        "load": statistics.median(loads),
        "memcpy": statistics.median(copies),
    }
    if reads:
        out["read"] = statistics.median(reads)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 10, 50])
    ap.add_argument("--reps", type=int, default=5)
    default_disk = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    ap.add_argument("--disk-dir", type=Path, default=default_disk)
    args = ap.parse_args()

    shm = Path(tempfile.mkdtemp(prefix="kvwarm-bench-", dir="/dev/shm"))
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    disk = Path(tempfile.mkdtemp(prefix="kvwarm-bench-", dir=args.disk_dir))
    serial = itertools.count(1_000_000)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"ram_file root: {shm}   disk root: {disk}   reps: {args.reps} (median)")
    hdr = f"{'tier':<9}{'MB':>5}{'save MB/s':>11}{'load MB/s':>11}{'memcpy MB/s':>13}"
    hdr += f"{'read MB/s':>11}{'load/memcpy':>13}{'load/read':>11}"
    print(hdr)
    print("-" * len(hdr))
    try:
        for size in args.sizes_mb:
            payload = os.urandom(size * MB)
            tiers: list[Tier] = [
                RamTier(1 << 40),
                FileTier("ram_file", shm, 1 << 40),
                FileTier("disk", disk, 1 << 40),
            ]
            for tier in tiers:
                r = bench_tier(tier, payload, args.reps, serial)
                read, memcpy = r.get("read"), r["memcpy"]
                read_s = f"{size / read:>11.0f}" if read else f"{'-':>11}"
                ratio_r = f"{r['load'] / read:>11.2f}" if read else f"{'-':>11}"
                print(
                    f"{tier.name:<9}{size:>5}{size / r['save']:>11.0f}{size / r['load']:>11.0f}"
                    f"{size / memcpy:>13.0f}{read_s}{r['load'] / memcpy:>13.2f}{ratio_r}"
                )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
