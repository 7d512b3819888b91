"""The hot path: kvwarm vs llama-server where both already hold the prefix (issue 24).

    python bench/hotpath.py [--model PATH.gguf] [--reps 15] [--agents 8] [--calls 10]
                            [--profile kvwarm.raw]

Both servers run side by side (4 slots each, 4,096 positions per slot, the same threads); a
scenario alternates them request by request (or round by round), so neither runs while the
other decodes:

1. ``cached``: a 1-token reply to a ~1,000-token prompt that was sent before (``exact``), and
   to the same prompt plus ~20 new tokens (``partial``): median and min latency per server.
2. ``agents``: 8 agents at once over one ~2,000-token system prompt, each making 10 short calls
   (its history grows by a 16-token reply and a short tool result per call): total wall time
   and the slowest request, per server.

``--profile OUT`` runs kvwarm under ``py-spy record`` and prints the top frames of its worker
and HTTP threads after scenario 1 (py-spy needs ptrace rights over its child). The multi-turn
chat load is ``bench/multiturn.py``. Run it alone: two processes decoding at once on 2 cores
halve each other.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from multiturn import LORE, Server
from profiling import py_spy, stop, top_frames

SLOTS = 4


def _default_model() -> Path:
    from kvwarm.embedded import default_model_path

    return Path(default_model_path())


def cached(servers: list[Server], reps: int) -> dict[str, dict[str, list[float]]]:
    prompt = LORE * 28  # ~1,000 tokens (SmolLM2)
    lat: dict[str, dict[str, list[float]]] = {s.name: {"exact": [], "partial": []} for s in servers}
    n_prompt = [s.complete(prompt, 1)[1] for s in servers]  # both now hold it
    print(f"  prompt: {n_prompt[0]} tokens")
    for i in range(reps):
        tail = f" Question {i}: who kept the lighthouse in the year {1800 + 7 * i}, and why?"
        for kind, text in (("exact", prompt), ("partial", prompt + tail)):
            order = servers if i % 2 == 0 else list(reversed(servers))
            for s in order:
                cached_n, _, secs = s.complete(text, 1)
                if kind == "exact" and cached_n == 0:
                    print(f"  warning: {s.name} reused nothing on an exact repeat")
                lat[s.name][kind].append(secs * 1e3)
            if kind == "partial":
                for s in order:
                    s.complete(prompt, 1)  # back to the bare prompt, as the next agent call would
    return lat


def agents(server: Server, n_agents: int, calls: int) -> tuple[float, float, list[float]]:
    system = LORE * 56  # ~2,000 tokens (SmolLM2)
    server.complete(system, 1)  # the shared prefix is warm on both servers alike
    lat: list[float] = []
    lock = threading.Lock()

    def agent(a: int) -> None:
        history = f"{system}\nAgent {a} task: list the keepers of light number {a}.\n"
        for c in range(calls):
            _, _, secs = server.complete(history, 16)
            with lock:
                lat.append(secs * 1e3)
            history += f"{server.last_text}\nTool result {c}: record {a * 100 + c} found.\n"

    t0 = time.perf_counter()
    threads = [threading.Thread(target=agent, args=(a,)) for a in range(n_agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, max(lat), lat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="agents rounds, servers alternated")
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--skip", default="", help="comma-separated scenarios to skip")
    ap.add_argument("--gpu-layers", type=int, default=0, help="layers offloaded, both servers")
    ap.add_argument(
        "--flash-attn", choices=("auto", "on", "off"), default="auto", help="both servers"
    )
    args = ap.parse_args(argv)
    model = args.model or _default_model()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"model: {model}, threads {args.threads}, {SLOTS} slots each, "
          f"{args.gpu_layers} layers on the GPU, flash attention {args.flash_attn}")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="kvwarm-hot-"))
    servers = [
        Server(n, model, args.threads, work / n, SLOTS, args.gpu_layers, args.flash_attn)
        for n in ("kvwarm", "llama-server")
    ]
    skip = set(args.skip.split(","))
    try:
        for s in servers:
            s.start()
        print("flash attention ran:", ", ".join(f"{s.name} {s.ran_flash_attn}" for s in servers))
        if "cached" not in skip:
            kv = servers[0].proc
            spy = py_spy(kv.pid, args.profile) if args.profile is not None and kv else None
            lat = cached(servers, args.reps)
            if spy is not None:
                stop(spy)
            print("\n== 1. a 1-token reply to a cached ~1,000-token prompt (ms)")
            for kind in ("exact", "partial"):
                meds = {n: statistics.median(v[kind]) for n, v in lat.items()}
                for n, v in lat.items():
                    print(f"  {kind:8s} {n:13s} median {meds[n]:7.1f}  min {min(v[kind]):7.1f}"
                          f"  max {max(v[kind]):7.1f}  (n={len(v[kind])})")  # fmt: skip
                print(f"  {kind:8s} kvwarm / llama-server median: "
                      f"{meds['kvwarm'] / meds['llama-server']:.2f}x")  # fmt: skip
        if "agents" not in skip:
            print(f"\n== 2. {args.agents} agents x {args.calls} calls over a ~2,000-token prompt")
            totals: dict[str, list[tuple[float, float]]] = {s.name: [] for s in servers}
            for rnd in range(args.rounds):
                for s in servers if rnd % 2 == 0 else list(reversed(servers)):
                    total, slowest, _ = agents(s, args.agents, args.calls)
                    totals[s.name].append((total, slowest))
                    print(f"  round {rnd} {s.name:13s} total {total:6.2f} s, "
                          f"slowest request {slowest:7.0f} ms")  # fmt: skip
            for rnd in range(args.rounds):
                k, p = totals["kvwarm"][rnd], totals["llama-server"][rnd]
                print(f"  round {rnd}: kvwarm / llama-server total {k[0] / p[0]:.2f}x, "
                      f"slowest {k[1] / p[1]:.2f}x")  # fmt: skip
    finally:
        for s in servers:
            s.stop()
    if args.profile is not None and args.profile.exists():
        print(f"\n== kvwarm profile of scenario 1 ({args.profile}), inclusive share of samples")
        for line in top_frames(args.profile):
            print("  ", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
