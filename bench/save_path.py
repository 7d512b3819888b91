"""The save path per tier: a chunked 2,000-token row (the stub KV of ``tests/cache/chunkkit``,
1 KiB a token, 256-token chunks), then its conversation's next turn (2,200 tokens, reusing
the first seven chunks), sync saves, no background threads. Prints the median time of each;
``--s3`` instead counts the requests each save sends to a local moto server: a turn within
``REFRESH_AFTER_S`` of the last, one after it (every reused chunk touched), and a second
replica saving a row the first published (its key taken).

Usage (``PYTHONPATH=src:.``; syscalls per save: run it under ``strace -f -c`` at two
``--reps`` and divide the difference)::

    python bench/save_path.py [--tier ram|ram_file|disk] [--reps 40]
    python bench/save_path.py --s3

Timings of a few microseconds' difference drown in a shared machine's noise; the syscall
and request counts do not.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.cache.chunkkit import blob, split

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.types import Namespace, SaveReason, SaveRequest

NS = Namespace(fingerprint=b"\x42" * 32, quant=3, ctx_hash=b"\x24" * 32)


def _request(tokens: list[int], data: bytes, tier: str) -> SaveRequest:
    return SaveRequest(NS, tuple(tokens), data, SaveReason.CONTINUED, tier, split=split)


def local(tier: str, reps: int) -> None:
    root = None
    if tier in ("disk", "ram_file"):
        root = Path(
            tempfile.mkdtemp(prefix="kvwarm-bench-", dir="/dev/shm" if tier == "ram_file" else None)
        )
    convs = []
    for r in range(reps):
        first = [1000 + r] + [(r * 7 + i) % 30000 for i in range(1999)]
        nxt = first + [(i * 13) % 30000 for i in range(200)]
        convs.append(((first, blob(first)), (nxt, blob(nxt))))
    cfg = CacheConfig(tiers=(TierConfig(tier, 1 << 34, root=root),), chunk_tokens=256)
    cache = Cache(cfg, background=False)
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for turns in convs:
            for (tokens, data), into in zip(turns, times, strict=True):
                t0 = time.perf_counter()
                cache.save(_request(tokens, data, tier), sync=True)
                into.append(time.perf_counter() - t0)
    finally:
        cache.close()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    first_ms, next_ms = (statistics.median(t) * 1e3 for t in times)
    print(f"{tier}: first save {first_ms:.3f} ms, next turn {next_ms:.3f} ms (median of {reps})")


def s3() -> None:
    from tests.cache.chunkkit import chunked_request
    from tests.s3kit import MotoServer, aws_env

    from kvwarm.cache.store import chunking
    from kvwarm.cache.tiers.s3 import S3Tier

    shift = [0.0]

    class _Time:  # chunking's clock, moved by hand past REFRESH_AFTER_S
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        def monotonic(self) -> float:
            return time.monotonic() + shift[0]

    chunking.time = _Time()  # type: ignore[assignment]
    counts: collections.Counter[str] = collections.Counter()
    with aws_env():
        server = MotoServer()
        config = server.config(server.new_bucket())

        def replica() -> Cache:
            tier = S3Tier(config, 1 << 34)
            client = tier.objects.wire.client
            for method in ("put_object", "get_object", "head_object", "copy_object"):
                real = getattr(client, method)

                def counted(*a: Any, _real: Any = real, _m: str = method, **k: Any) -> Any:
                    counts[_m] += 1
                    return _real(*a, **k)

                setattr(client, method, counted)
            cfg = CacheConfig(tiers=(TierConfig("ram", 1 << 30),), chunk_tokens=256)
            return Cache(cfg, tiers=[tier], background=False)

        t1 = list(range(1, 2001))
        t2 = t1 + list(range(5000, 5200))
        t3 = t2 + list(range(6000, 6200))
        a, b = replica(), replica()

        def step(label: str, cache: Cache, tokens: list[int]) -> None:
            counts.clear()
            cache.save(chunked_request(NS, tokens, tier="s3"), sync=True)
            print(f"{label}: {dict(counts)}")

        step("turn 1 (2,000 tokens, all new)", a, t1)
        step("turn 2 (2,200 tokens) within 300 s", a, t2)
        shift[0] += 301
        step("turn 3 (2,400 tokens) 301 s later", a, t3)
        step("replica b saves turn 3's row (key taken)", b, t3)
        a.close()
        b.close()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", choices=("ram", "ram_file", "disk"), action="append")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--s3", action="store_true")
    args = ap.parse_args()
    if args.s3:
        s3()
        return
    for tier in args.tier or ("ram", "ram_file", "disk"):
        local(tier, args.reps)


if __name__ == "__main__":
    main()
