"""How fast exact speculative decoding can be on this machine: a verify pass of ``r`` rows
against ``r`` one-token passes, on each model as a speculating kvwarm runs it.

A verify pass puts the pending token and ``r - 1`` drafted ones through the model at once;
when every drafted token is kept it yields ``r`` tokens. Plain decoding yields them in ``r``
one-token passes. So, with every draft accepted, speculation is ``r * t_1 / t_r`` times plain
decoding: the ceiling no drafter can pass, however good its drafts (issue 39's goal of 2x on
copy-heavy loads is measured against it). On a GPU a pass of a few dozen rows costs about one
row's; on a CPU the matrix products scale with the rows.

Per model (the embedded SmolLM2 by default; ``--model`` adds others, e.g. ``$KVWARM_GEMMA``),
in a child process of its own, with a speculating model's settings: flash attention on, q8_0 K
and f16 V cells, and for a K-quant model llama.cpp's tiled K-quant kernel off
(``GGML_CPU_TILED_MM=0``) and the model loaded as a speculating model loads
(``ModelParams.exact_rows``: weights not repacked where repacking is their only several-row
kernel), the kernels whose rows equal one-token passes (docs/internals.md "Matrix products,
corrected"). After a
``--context``-token prefill: the median one-token pass, and the median pass of each ``--rows``
count, each ``--reps`` times (the first of each dropped: graphs warming), over ``--rounds``
rounds. Printed: ms, the pass's cost in one-token passes, and the ceiling ``r / that``.

Usage::

    PYTHONPATH=src .venv/bin/python bench/verify_ceiling.py [--model GGUF ...] [--rounds 3]

Run it alone: a second process decoding beside it moves every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, statistics, sys, time
from kvwarm.backends.base import BatchToken, ContextParams, ModelParams
from kvwarm.backends.llama import LlamaBackend
path, context, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = [int(x) for x in sys.argv[4].split(",")]
model = LlamaBackend().load_model(path, ModelParams(exact_rows=True))  # as it speculates
ctx = model.new_context(ContextParams(n_ctx=context + max(rows) + 64, n_batch=512, n_ubatch=512,
                                      n_threads=2, flash_attn="on", type_k="q8_0", type_v="f16"))
text = "The keeper of the lighthouse wrote in his ledger about the ships. " * 200
tokens = model.tokenize(text)[: context + max(rows)]
ctx.prefill(0, tokens[:context], 0)

def timed(r):
    a = time.perf_counter()
    ctx.decode([BatchToken(tokens[context + i], context + i, 0, True) for i in range(r)])
    b = time.perf_counter()
    ctx.seq_rm(0, context, -1)
    return b - a

out = {}
for r in [1, *rows]:
    out[str(r)] = statistics.median([timed(r) for _ in range(reps + 1)][1:]) * 1e3
print("RESULT " + json.dumps(out))
"""


def run(model: str, context: int, reps: int, rows: list[int]) -> dict[str, float]:
    env = dict(os.environ, GGML_CPU_TILED_MM="0")  # read once a process: a child each
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(context), str(reps), ",".join(map(str, rows))],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"the child for {model} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", action="append", default=[], help="a GGUF (repeatable)")
    ap.add_argument("--context", type=int, default=200, help="tokens prefilled before the passes")
    ap.add_argument("--rows", default="8,16,32,48,62", help="the verify passes' row counts")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import kvwarm.embedded

    models = [str(kvwarm.embedded.default_model_path()), *args.model]
    rows = [int(x) for x in args.rows.split(",")]
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    figures: dict[str, dict[str, list[float]]] = {m: {} for m in models}
    for _ in range(args.rounds):
        for m in models:  # alternated, so a drift of the machine's speed falls on each
            for key, ms in run(m, args.context, args.reps, rows).items():
                figures[m].setdefault(key, []).append(ms)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for m, values in figures.items():
        one = statistics.median(values["1"])
        print(f"{Path(m).name}: one-token pass {one:.2f} ms (median of {args.rounds} rounds)")
        for r in rows:
            ms = statistics.median(values[str(r)])
            print(
                f"  {r:3d} rows {ms:8.1f} ms = {ms / one:5.1f} one-token passes; "
                f"ceiling with every draft kept {r * one / ms:.2f}x"
            )


if __name__ == "__main__":
    main()
