"""What each KV cell type costs, and whether a verify pass's rows are one-token passes with it.

Issue 39's speculation is exact where each row of a verify pass is what a one-token pass at
that position computes. On the CPU with f16 (or f32) KV and two or more threads, llama.cpp
computes a one-token pass over a KV view of 512 cells or more with its split-KV attention
kernel, which no pass of several rows takes, so exactness ends there; KV of another type
(q8_0, bf16 ...) is attended row by row in every pass (docs/internals.md, "Numerics"). This
script measures, per KV type (``--types``, K and V alike), on one model (the embedded SmolLM2
unless ``--model``), flash attention on; a type ``K:V`` (``f16:q8_0``) gives K and V each
their own:

- ``prefill``: a cold prefill of ``--prompt`` tokens (ms);
- ``pass@N``: the median one-token pass with ``N`` cells in use (``--at``; ms);
- ``rows``: how many rows of a ``--rows``-row pass at the first ``--at`` differ from the
  one-token passes at the same positions (0 is exact).

The types alternate over ``--rounds`` rounds (f16, q8_0, ..., f16, q8_0, ...), after one
round that warms each context and is dropped, so a drift of the machine's speed falls on each;
the figures printed are the medians over rounds, with each type's ratio to the first type's.

Usage::

    PYTHONPATH=src .venv/bin/python bench/kv_types.py [--types f16,q8_0,bf16] [--rounds 5]

Run it alone: a second process decoding beside it moves every figure.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

from kvwarm.backends.base import BackendContext, BatchToken, ContextParams
from kvwarm.backends.llama import LlamaBackend
from kvwarm.backends.verify_rows import differing_rows
from kvwarm.embedded import default_model_path

TEXT = "The keeper of the lighthouse wrote in his ledger every evening about the ships. " * 200


def one_token_pass(ctx: BackendContext, at: int, reps: int) -> float:
    """The median seconds of a one-token pass with ``at`` cells in use."""
    times = []
    for i in range(reps):
        ctx.seq_rm(0, at, -1)
        start = time.perf_counter()
        ctx.decode([BatchToken(1000 + i, at, 0, True)])
        times.append(time.perf_counter() - start)
    ctx.seq_rm(0, at, -1)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--types", default="f16,q8_0,bf16")
    ap.add_argument("--prompt", type=int, default=1000, help="cold prefill tokens")
    ap.add_argument("--at", default="1000,600", help="cells in use for one-token passes")
    ap.add_argument("--rows", type=int, default=63, help="rows of the verify pass checked")
    ap.add_argument("--reps", type=int, default=20, help="one-token passes per figure")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    types = args.types.split(",")
    points = sorted((int(a) for a in args.at.split(",")), reverse=True)
    if max(points) > args.prompt:
        ap.error("--at must not exceed --prompt")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    model = LlamaBackend().load_model(args.model)
    contexts = {
        t: model.new_context(
            ContextParams(
                n_ctx=args.prompt + args.rows + 64,
                n_batch=512,
                n_ubatch=512,
                n_threads=args.threads,
                flash_attn="on",
                type_k=t.split(":")[0],
                type_v=t.split(":")[-1],
            )
        )
        for t in types
    }
    prompt = model.tokenize(TEXT)[: args.prompt + args.rows]
    if len(prompt) < args.prompt + args.rows:
        ap.error("--prompt is longer than the bench's text")
    figures: dict[str, dict[str, list[float]]] = {t: {} for t in types}
    differing: dict[str, int] = {}
    for r in range(args.rounds + 1):  # round 0 warms each context's graphs, and is dropped
        for t, ctx in contexts.items():
            ctx.seq_rm(0)
            start = time.perf_counter()
            ctx.prefill(0, prompt[: args.prompt], 0)
            prefill = time.perf_counter() - start
            passes = {f"pass@{at}": one_token_pass(ctx, at, args.reps) for at in points}
            if r > 0:  # ``points`` descend: each trims what the last left
                for name, seconds in {"prefill": prefill, **passes}.items():
                    figures[t].setdefault(name, []).append(seconds)
    at = min(points)
    for t, ctx in contexts.items():
        ctx.seq_rm(0)
        differing[t] = differing_rows(ctx, prompt[:at], prompt[at : at + args.rows], (args.rows,))
        ctx.close()
    model.close()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    first = types[0]
    for t in types:
        parts = []
        for name, values in figures[t].items():
            ms = statistics.median(values) * 1e3
            ratio = ms / (statistics.median(figures[first][name]) * 1e3)
            parts.append(f"{name} {ms:8.2f} ms ({ratio:.2f}x)")
        rows = f"rows {differing[t]}/{args.rows} differ at {min(points)} cells"
        print(f"{t:9s} " + "  ".join(parts) + "  " + rows)
    print("command: " + shlex.join([sys.executable, *sys.argv]))


if __name__ == "__main__":
    main()
