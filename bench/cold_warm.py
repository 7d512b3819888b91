"""Cold vs warm time to first token on the embedded model, per tier, plus multi-turn and
shared-prefix scenarios with and without the cache.

    python bench/cold_warm.py                      # full matrix (128..4096 tokens; ~3 min)
    python bench/cold_warm.py --lengths 128 512    # a quicker subset
    python bench/cold_warm.py --scenarios-only

Prints its numbers and the command that produced them. Speed goals live here, not in tests.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from kvwarm.backends.base import ContextParams
from kvwarm.cache.types import CacheConfig, PolicyConfig, TierConfig, TierName
from kvwarm.engine.api import Engine, EngineConfig, Model, ModelConfig
from kvwarm.engine.types import GenerationOptions

ONE = GenerationOptions(max_tokens=1, temperature=0.0)
N_BATCH = 512
POLICY = PolicyConfig(
    min_tokens=64,
    cold_min_tokens=64,
    boundary_trim_tokens=0,
    boundary_align_tokens=N_BATCH,
    continued_interval=100_000,
    session_resume_wait_ms=2000,
)
NO_CACHE = replace(POLICY, min_tokens=10**9, cold_min_tokens=10**9, cold_max_tokens=10**9)


def engine_for(tier: TierName, root: Path, policy: PolicyConfig = POLICY) -> Engine:
    if tier == "ram":
        tiers = (TierConfig("ram", 8 << 30),)
    elif tier == "ram_file":
        tiers = (TierConfig("ram_file", 8 << 30, Path("/dev/shm") / f"kvwarm-bench-{root.name}"),)
    else:
        tiers = (TierConfig("disk", 8 << 30, root / "disk"),)
    return Engine(EngineConfig(cache=CacheConfig(tiers=tiers), policy=policy))


def model_on(engine: Engine, n_ctx: int) -> Model:
    ctx = ContextParams(
        n_ctx=n_ctx, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=2, n_threads_batch=2
    )
    return engine.load_model(config=ModelConfig(context=ctx))


def prompt_tokens(model: Model, n: int) -> list[int]:
    base = model.tokenize(
        "In the beginning the engineers measured everything twice and trusted nothing. " * 400
    )
    return base[:n]


def memcpy_ms(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def matrix(lengths: list[int], tiers: list[TierName]) -> None:
    n_ctx = max(lengths) + 64
    root = Path(tempfile.mkdtemp(prefix="kvwarm-bench-"))
    cold_ms: dict[int, float] = {}
    with engine_for("ram", root, NO_CACHE) as eng:
        model = model_on(eng, n_ctx)
        for n in lengths:
            toks = prompt_tokens(model, n)
            model.evict()
            out = model.complete(toks, ONE)
            cold_ms[n] = out.stats.ttft_ms
    print(
        f"{'tokens':>7} {'tier':>9} {'cold ms':>9} {'warm ms':>9} {'speedup':>8} "
        f"{'restore ms':>10} {'KV MB':>7} {'memcpy ms':>9} {'restore/memcpy':>14}"
    )
    for tier in tiers:
        with engine_for(tier, root) as eng:
            model = model_on(eng, n_ctx)
            for n in lengths:
                toks = prompt_tokens(model, n)
                model.complete(toks, ONE)
                eng.cache.flush()
                ttfts, restores = [], []
                for _ in range(3):  # steady state: the median of three restores
                    model.evict()
                    before = eng.cache.counters()
                    warm = model.complete(toks, ONE)
                    after = eng.cache.counters()
                    ttfts.append(warm.stats.ttft_ms)
                    restores.append(
                        sum(
                            after.get(f"{k}_seconds", 0.0) - before.get(f"{k}_seconds", 0.0)
                            for k in ("latency_load", "latency_unpack")
                        )
                    )
                warm_ms, restore_s = statistics.median(ttfts), statistics.median(restores)
                rows = [r for r in eng.cache.rows() if r.n_tokens >= n]
                size = min((r.logical_bytes for r in rows), default=0)  # the KV it restores
                mc = memcpy_ms(size) if size else float("nan")
                print(
                    f"{n:>7} {tier:>9} {cold_ms[n]:>9.1f} {warm_ms:>9.1f} "
                    f"{cold_ms[n] / max(warm_ms, 1e-6):>7.0f}x "
                    f"{restore_s * 1e3:>10.2f} {size / 1e6:>7.1f} {mc:>9.2f} "
                    f"{restore_s * 1e3 / mc if size else float('nan'):>14.2f}"
                )


def multiturn(policy: PolicyConfig, label: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="kvwarm-bench-"))
    with engine_for("ram", root, policy) as eng:
        model = model_on(eng, 2048)
        system = " ".join(["You are a careful assistant who follows the house rules."] * 90)
        convs: list[list[dict[str, object]]] = [
            [{"role": "system", "content": system}] for _ in range(3)
        ]
        computed = total = 0
        t0 = time.perf_counter()
        for turn in range(4):
            for i, conv in enumerate(convs):
                conv.append({"role": "user", "content": f"Conversation {i}, turn {turn}: go on."})
                out = model.chat(conv, options=GenerationOptions(max_tokens=16, temperature=0.0))
                conv.append({"role": "assistant", "content": out.text})
                computed += out.stats.prompt_tokens - out.stats.cached_tokens
                total += out.stats.prompt_tokens
                if policy is NO_CACHE:
                    model.evict()
        dt = time.perf_counter() - t0
        print(
            f"multi-turn ({label}): 3 conversations x 4 turns, {total} prompt tokens, "
            f"{computed} prefilled, {dt:.1f} s"
        )


def agents(policy: PolicyConfig, label: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="kvwarm-bench-"))
    with engine_for("ram", root, policy) as eng:
        model = model_on(eng, 2048)
        system = " ".join(["Shared agent instructions: plan, act, check, report."] * 100)
        computed = total = 0
        t0 = time.perf_counter()
        for i in range(4):
            out = model.complete(
                system + f" Agent {i}: begin.", GenerationOptions(max_tokens=16, temperature=0.0)
            )
            computed += out.stats.prompt_tokens - out.stats.cached_tokens
            total += out.stats.prompt_tokens
            if policy is NO_CACHE:
                model.evict()
        dt = time.perf_counter() - t0
        print(f"4 agents ({label}): {total} prompt tokens, {computed} prefilled, {dt:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    ap.add_argument(
        "--tiers",
        nargs="+",
        default=["ram", "ram_file", "disk"],
        choices=["ram", "ram_file", "disk"],
    )
    ap.add_argument("--scenarios-only", action="store_true")
    ap.add_argument("--matrix-only", action="store_true")
    args = ap.parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    if not args.scenarios_only:
        matrix(args.lengths, args.tiers)
    if not args.matrix_only:
        for policy, label in ((NO_CACHE, "no cache"), (POLICY, "cache")):
            multiturn(policy, label)
            agents(policy, label)
    for leftover in (
        *Path(tempfile.gettempdir()).glob("kvwarm-bench-*"),
        *Path("/dev/shm").glob("kvwarm-bench-*"),
    ):
        shutil.rmtree(leftover, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
