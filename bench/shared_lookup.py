"""What a longest-prefix lookup costs against a shared s3 tier (a live moto server).

For prompts of 512..8192 tokens, under the server's policy (cold saves at multiples of 512,
n_batch 512), a fresh reader cache looks the prompt up with the probe lengths the engine
passes (``savegates.probe_lengths``):

- ``miss``: nothing published: every probe misses (the worst case, bounded by probe_max);
- ``hit``: another cache published the prompt's cold-save row (its longest aligned prefix);
- ``short``: only a 512-token row (a shared system prompt) exists: the longest waves miss.

Reported per case: probes (keys asked), rounds (waves of concurrent requests: the latency
cost in round trips), HTTP requests actually sent, and ms per lookup (median).

Run: PYTHONPATH=src .venv/bin/python bench/shared_lookup.py [--reps 20] [--port 8180]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace

from kvwarm.alignment import align_down
from kvwarm.cache import Cache, CacheConfig, Namespace, SaveReason, SaveRequest, TierConfig
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.tiers.s3 import S3Tier
from kvwarm.cache.tiers.s3client import S3Client, make_client
from kvwarm.cache.types import S3Config
from kvwarm.engine.worker.savegates import cold_save_length, probe_lengths
from kvwarm.settings import SERVER_POLICY

NS = Namespace(b"\x01" * 32, 1, b"\x02" * 32)
N_BATCH = 512
VOCAB = 49_152
PAYLOAD = 1 << 20  # probes read metadata only: the payload size does not change a lookup


class CountingClient:
    """Counts the HTTP requests a lookup sends (every call is one request: no retries here)."""

    def __init__(self, inner: S3Client) -> None:
        self.inner = inner
        self.requests = 0

    def put_object(self, **kw: object) -> Mapping[str, object]:
        self.requests += 1
        return self.inner.put_object(**kw)

    def get_object(self, **kw: object) -> Mapping[str, object]:
        self.requests += 1
        return self.inner.get_object(**kw)

    def delete_object(self, **kw: object) -> Mapping[str, object]:
        self.requests += 1
        return self.inner.delete_object(**kw)

    def copy_object(self, **kw: object) -> Mapping[str, object]:
        self.requests += 1
        return self.inner.copy_object(**kw)

    def list_objects_v2(self, **kw: object) -> Mapping[str, object]:
        self.requests += 1
        return self.inner.list_objects_v2(**kw)


def _cache(cfg: S3Config, client: S3Client) -> Cache:
    ram = TierConfig("ram", 1 << 30)
    tiers = (ram, TierConfig("s3", 1 << 40, s3=cfg))
    s3 = S3Tier(cfg, 1 << 40, client=client)
    return Cache(CacheConfig(tiers=tiers), tiers=[RamTier(1 << 30), s3], background=False)


def _publish(cfg: S3Config, tokens: tuple[int, ...]) -> None:
    with _cache(cfg, make_client(cfg, 8)) as writer:
        req = SaveRequest(NS, tokens, os.urandom(PAYLOAD), SaveReason.COLD, "s3")
        assert writer.save(req, sync=True) is not None


def _lookup(cfg: S3Config, prompt: tuple[int, ...], expect: int) -> tuple[float, ...]:
    """A reader opened *before* the row is published (its startup scan cannot know it), so
    only probing can find it, as for a replica that is already running."""
    client = CountingClient(make_client(cfg, 16))
    with _cache(cfg, client) as reader:
        if expect:
            _publish(cfg, prompt[:expect])
        lengths = probe_lengths(len(prompt), SERVER_POLICY, N_BATCH)
        before = client.requests
        t0 = time.perf_counter()
        match = reader.longest_prefix(NS, prompt, probe_lengths=lengths)
        ms = (time.perf_counter() - t0) * 1e3
        got = 0 if match is None else match.n_shared
        assert got == expect, (len(prompt), got, expect)
        c = reader.counters()
        return c["probes"], c["probe_rounds"], float(client.requests - before), ms


def _expected(n: int, case: str) -> int:
    if case == "hit":  # the cold row of the previous turn, a prompt 100 tokens shorter
        return min(n, align_down(cold_save_length(max(n - 100, 576), SERVER_POLICY), N_BATCH))
    if case == "short":  # only a shared 512-token system prompt
        return 512
    return 0


def run(base: S3Config, n: int, case: str, reps: int, rng: random.Random) -> str:
    rows = []
    for rep in range(reps):
        cfg = replace(base, prefix=f"{n}-{case}-{rep}/")  # a fresh store for each lookup
        prompt = tuple(rng.randrange(VOCAB) for _ in range(n))
        rows.append(_lookup(cfg, prompt, _expected(n, case)))
    probes, rounds, requests, _ = rows[0]
    ms = statistics.median(r[3] for r in rows)
    found = _expected(n, case)
    return f"{n:>6} {case:>6} {found:>6} {probes:>6.0f} {rounds:>6.0f} {requests:>8.0f} {ms:>9.2f}"


def _start_moto(port: int) -> tuple[subprocess.Popen[bytes], str]:
    """moto's server in a process of its own (as a real store is), ready to answer."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    probe = S3Config(bucket="kvwarm-bench", endpoint_url=endpoint, region="us-east-1")
    client = make_client(probe, 1)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.list_buckets()  # type: ignore[attr-defined]
            return proc, endpoint
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # polling a starting server; nothing to synchronise on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--port", type=int, default=8180, help="moto port on 127.0.0.1")
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    proc, endpoint = _start_moto(args.port)
    try:
        cfg = S3Config(bucket="kvwarm-bench", endpoint_url=endpoint, region="us-east-1")
        make_client(cfg, 1).create_bucket(Bucket=cfg.bucket)  # type: ignore[attr-defined]
        rng = random.Random(7)
        print(f"moto at {endpoint}; probe_max 16, probe_parallel 8; {args.reps} lookups each")
        head = ("tokens", "case", "found", "probes", "rounds")
        print(" ".join(f"{h:>6}" for h in head), f"{'requests':>8} {'ms p50':>9}")
        for n in (512, 1024, 2048, 4096, 8192):
            for case in ("miss", "hit", "short"):
                print(run(cfg, n, case, args.reps, rng), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
