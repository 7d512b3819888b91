"""The engine's own cost per request, on the stub backend (no native compute): submit, admit
(look up, plan, restore), prefill, one token, finish save, answer. It is the path the house
moves touched (the cache's wings, admission's steps, the ``Prompt`` a request carries), so a
text prompt's cost before and after is compared here, alternating the two trees in one run.

    python bench/request_path.py                       # this tree
    python bench/request_path.py --compare /tmp/old/src  # this tree and another, alternated

Scenarios (each ``--reps`` requests, min and median microseconds a request): ``cold`` (a new
512-token prompt each time), ``exact`` (the same prompt again: restored from live KV or the ram
tier's row) and ``partial`` (the same prompt plus a new tail). Prints the command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time

import trees


def measure(reps: int) -> dict[str, list[float]]:
    from kvwarm.backends.base import ContextParams
    from kvwarm.cache.types import CacheConfig, PolicyConfig, TierConfig
    from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
    from kvwarm.engine.types import GenerationOptions

    policy = PolicyConfig(
        min_tokens=4, cold_min_tokens=8, boundary_trim_tokens=0, boundary_align_tokens=8
    )
    engine = Engine(
        EngineConfig(cache=CacheConfig(tiers=(TierConfig("ram", 256 << 20),)), policy=policy)
    )
    model = engine.load_model(
        config=ModelConfig(
            backend="stub", context=ContextParams(n_ctx=2048, n_batch=512, n_ubatch=512)
        )
    )
    opts = GenerationOptions(max_tokens=1, temperature=0.0)
    out: dict[str, list[float]] = {"cold": [], "exact": [], "partial": []}
    base = [5 + (i * 7) % 250 for i in range(512)]
    for rep in range(reps):
        fresh = [5 + (rep * 13 + i * 7) % 251 for i in range(512)]
        for name, prompt in (
            ("cold", fresh),
            ("exact", base),
            ("partial", [*base, 5 + rep % 250, 6, 7, 8]),
        ):
            t0 = time.perf_counter()
            model.complete(prompt, opts)
            out[name].append((time.perf_counter() - t0) * 1e6)
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    trees.add_arguments(ap, rounds=3)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.reps)))
        return
    runs = trees.alternate(__file__, ["--reps", str(args.reps)], args.rounds, args.compare)
    got: dict[str, dict[str, list[float]]] = {name: {} for name in runs}
    for name, results in runs.items():
        for res in results:
            for k, v in res.items():
                got[name].setdefault(k, []).extend(v)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"{'tree':>6} {'scenario':>8} {'min us':>9} {'median us':>10} {'n':>6}")
    for name, scenarios in got.items():
        for k, v in scenarios.items():
            print(f"{name:>6} {k:>8} {min(v):9.0f} {statistics.median(v):10.0f} {len(v):6d}")


if __name__ == "__main__":
    main()
