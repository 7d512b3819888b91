"""What a request with a huge JSON schema (a 100,000-value ``enum``) costs the chats served
beside it, on the real model: the schema's preparation (schema to GBNF, prefix tree, cost and
safety checks) is Python on the request's thread, and its sampler is compiled on the model's
worker, where nothing else decodes meanwhile.

    python bench/hostile_schema.py                          # this tree
    python bench/hostile_schema.py --compare /tmp/old/src   # this tree and another, alternated

Each round runs in a fresh process: 8-token chats alone, then back to back for as long as the
enum request runs (``first``: a schema the process never saw; ``again``: the same schema sent
again). With ``--crowd N``, another fresh process per round sends N distinct such schemas at
once (``crowd``), and reports its peak resident memory above what it held before them. Prints,
per tree and phase, the enum requests' seconds and the chats' median and worst latency beside
them, then the command.
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


def measure(values: int, crowd: int) -> dict[str, Any]:
    """The phases ``first`` and ``again``, or (``crowd`` > 1) ``crowd`` alone."""
    import resource

    from kvwarm.cache.types import CacheConfig, TierConfig
    from kvwarm.engine.api import Engine, EngineConfig
    from kvwarm.engine.types import GenerationOptions

    chat = [{"role": "user", "content": "Say hi."}]
    pick = [{"role": "user", "content": "Pick a value."}]
    short = GenerationOptions(max_tokens=8, temperature=0.0)

    def hostile(n: int) -> GenerationOptions:
        schema = {"type": "string", "enum": [f"v{n}-{i}" for i in range(values)]}
        return GenerationOptions(max_tokens=12, temperature=0.0, json_schema=schema)

    out: dict[str, Any] = {}
    with Engine(EngineConfig(CacheConfig(tiers=(TierConfig("ram", 64 << 20),)))) as engine:
        model = engine.load_model(n_ctx=512, n_parallel=2)

        def timed() -> float:
            start = time.perf_counter()
            model.chat(chat, options=short)
            return time.perf_counter() - start

        timed()  # warm
        out["alone"] = [timed() for _ in range(5)]

        def beside(requests: list[GenerationOptions]) -> dict[str, Any]:
            took: list[float] = []

            def run(options: GenerationOptions) -> None:
                start = time.perf_counter()
                model.chat(pick, options=options)
                took.append(time.perf_counter() - start)

            threads = [threading.Thread(target=run, args=(o,)) for o in requests]
            for thread in threads:
                thread.start()
            latencies = []
            while any(t.is_alive() for t in threads):  # chats while an enum request runs
                latencies.append(timed())
            for thread in threads:
                thread.join()
            return {"enum_s": max(took), "beside": latencies}

        if crowd > 1:
            held_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            out["crowd"] = beside([hostile(n) for n in range(crowd)])
            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            out["crowd"]["peak_mib"] = (peak_kib - held_kib) / 1024
        else:
            for phase in ("first", "again"):
                out[phase] = beside([hostile(0)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    trees.add_arguments(ap, rounds=3)
    ap.add_argument("--values", type=int, default=100_000)
    ap.add_argument("--crowd", type=int, default=0, help="distinct schemas sent at once")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.values, args.crowd)))
        return
    child = ["--values", str(args.values)]
    got = trees.alternate(__file__, child, args.rounds, args.compare)
    phases = ["first", "again"]
    if args.crowd > 1:
        crowds = trees.alternate(
            __file__, [*child, "--crowd", str(args.crowd)], args.rounds, args.compare
        )
        for name, runs in crowds.items():
            for run, crowded in zip(got[name], runs, strict=True):
                run["crowd"] = crowded["crowd"]
        phases.append("crowd")
    print("command:", shlex.join([sys.executable, *sys.argv]))
    head = f"{'tree':>6} {'phase':>6} {'enum s':>22} {'chat median s':>14} {'chat worst s':>13}"
    print(head + f" {'peak MiB':>9}")
    for name, runs in got.items():
        alone = [s for run in runs for s in run["alone"]]
        median = statistics.median(alone)
        print(f"{name:>6} {'alone':>6} {'':>22} {median:14.3f} {max(alone):13.3f}")
        for phase in phases:
            enum = " / ".join(f"{run[phase]['enum_s']:.2f}" for run in runs)
            near = [s for run in runs for s in run[phase]["beside"]]
            worst = max(near) if near else 0.0
            median = statistics.median(near) if near else 0.0
            peaks = " / ".join(
                f"{run[phase]['peak_mib']:.0f}" for run in runs if "peak_mib" in run[phase]
            )
            print(f"{name:>6} {phase:>6} {enum:>22} {median:14.3f} {worst:13.3f} {peaks:>9}")


if __name__ == "__main__":
    main()
