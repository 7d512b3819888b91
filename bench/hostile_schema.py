"""What a request with a huge JSON schema (a 100,000-value ``enum``) costs the chats served
beside it, on the real model: the schema's preparation (schema to GBNF, prefix tree, cost and
safety checks) is Python on the request's thread, and its sampler is compiled on the model's
worker, where nothing else decodes meanwhile.

    python bench/hostile_schema.py                          # this tree
    python bench/hostile_schema.py --compare /tmp/old/src   # this tree and another, alternated

Each round runs in a fresh process: 8-token chats alone, then back to back for as long as the
enum request runs (``first``: a schema the process never saw; ``again``: the same schema sent
again). Prints, per tree and phase, the enum request's seconds and the chats' median and worst
latency beside it, then the command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import threading
import time
from typing import Any

import trees


def measure(values: int) -> dict[str, Any]:
    from kvwarm.cache.types import CacheConfig, TierConfig
    from kvwarm.engine.api import Engine, EngineConfig
    from kvwarm.engine.types import GenerationOptions

    chat = [{"role": "user", "content": "Say hi."}]
    pick = [{"role": "user", "content": "Pick a value."}]
    schema = {"type": "string", "enum": [f"value-{i}" for i in range(values)]}
    short = GenerationOptions(max_tokens=8, temperature=0.0)
    hostile = GenerationOptions(max_tokens=12, temperature=0.0, json_schema=schema)
    out: dict[str, Any] = {}
    with Engine(EngineConfig(CacheConfig(tiers=(TierConfig("ram", 64 << 20),)))) as engine:
        model = engine.load_model(n_ctx=512, n_parallel=2)

        def timed() -> float:
            start = time.perf_counter()
            model.chat(chat, options=short)
            return time.perf_counter() - start

        timed()  # warm
        out["alone"] = [timed() for _ in range(5)]
        took: dict[str, float] = {}

        def run() -> None:
            start = time.perf_counter()
            model.chat(pick, options=hostile)
            took["seconds"] = time.perf_counter() - start

        for phase in ("first", "again"):
            thread = threading.Thread(target=run)
            thread.start()
            beside = []
            while thread.is_alive():  # chats for as long as the enum request runs
                beside.append(timed())
            thread.join()
            out[phase] = {"enum_s": took["seconds"], "beside": beside}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    trees.add_arguments(ap, rounds=3)
    ap.add_argument("--values", type=int, default=100_000)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.values)))
        return
    got = trees.alternate(__file__, ["--values", str(args.values)], args.rounds, args.compare)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"{'tree':>6} {'phase':>6} {'enum s':>16} {'chat median s':>14} {'chat worst s':>13}")
    for name, runs in got.items():
        alone = [s for run in runs for s in run["alone"]]
        median = statistics.median(alone)
        print(f"{name:>6} {'alone':>6} {'':>16} {median:14.3f} {max(alone):13.3f}")
        for phase in ("first", "again"):
            enum = " / ".join(f"{run[phase]['enum_s']:.2f}" for run in runs)
            beside = [s for run in runs for s in run[phase]["beside"]]
            worst = max(beside) if beside else 0.0
            median = statistics.median(beside) if beside else 0.0
            print(f"{name:>6} {phase:>6} {enum:>16} {median:14.3f} {worst:13.3f}")


if __name__ == "__main__":
    main()
