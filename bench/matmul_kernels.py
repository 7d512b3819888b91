"""What a speculating K-quant model's exact kernels cost: llama.cpp's tiled K-quant kernel off
(``GGML_CPU_TILED_MM=0``) and its weights not repacked, against the defaults.

A K-quant model that speculates computes without the tiled kernel (ggml reads the switch once a
process, so each configuration runs in a child process of its own) and without repacked weights
(``ModelParams.exact_rows``), so that a verify pass's rows are one-token passes' (docs/internals.md,
"Matrix products, corrected"). Per configuration, on one model (``--model``, a K-quant GGUF such
as Gemma 3 270M's Q4_K_M), flash attention on, q8_0 K and f16 V (a speculating model's cells):

- ``prefill``: a cold prefill of ``--prompt`` tokens (ms);
- ``pass``: the median one-token pass right after it (ms);
- ``rows``: a pass of 17 rows there (a verify pass of 16 drafted tokens, ms).

The configurations alternate over ``--rounds`` rounds, each child dropping its first of four
repetitions (graphs warming); printed are the medians over rounds and each one's ratio to the
defaults. Usage::

    PYTHONPATH=src .venv/bin/python bench/matmul_kernels.py --model $KVWARM_GEMMA [--rounds 3]

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

CHILD = """
import json, statistics, sys, time
from kvwarm.backends.base import BatchToken, ContextParams, ModelParams
from kvwarm.backends.llama import LlamaBackend
path, n, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3]
params = ModelParams(use_extra_bufts=None if extra == "auto" else False)
model = LlamaBackend().load_model(path, params)
ctx = model.new_context(ContextParams(n_ctx=n + 64, n_batch=512, n_ubatch=512, n_threads=2,
                                      flash_attn="on", type_k="q8_0", type_v="f16"))
text = "The keeper of the lighthouse wrote in his ledger about the ships. " * 200
prompt = model.tokenize(text)[:n]
out = {"prefill": [], "pass": [], "rows": []}
for r in range(4):
    ctx.seq_rm(0)
    t0 = time.perf_counter(); ctx.prefill(0, prompt, 0); t1 = time.perf_counter()
    passes = []
    for i in range(20):
        a = time.perf_counter(); ctx.decode([BatchToken(1000 + i, n + i, 0, True)])
        passes.append(time.perf_counter() - a)
    ctx.seq_rm(0, n, -1)
    a = time.perf_counter(); ctx.decode([BatchToken(1000 + i, n + i, 0, True) for i in range(17)])
    b = time.perf_counter()
    if r:
        out["prefill"].append(t1 - t0); out["pass"].append(statistics.median(passes))
        out["rows"].append(b - a)
print("RESULT " + json.dumps({k: statistics.median(v) * 1e3 for k, v in out.items()}))
"""

#: name -> (GGML_CPU_TILED_MM, weights repacked where the CPU repacks: "auto", or "off")
CONFIGS = {"default": (None, "auto"), "tiled off": ("0", "auto"), "exact": ("0", "off")}


def run(model: str, prompt: int, tiled: str | None, extra: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    if tiled is not None:
        env["GGML_CPU_TILED_MM"] = tiled
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(prompt), extra],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", default=os.environ.get("KVWARM_GEMMA"), required=False)
    ap.add_argument("--prompt", type=int, default=600, help="cold prefill tokens")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not args.model:
        ap.error("--model (or KVWARM_GEMMA) names a K-quant GGUF")
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in CONFIGS}
    for _ in range(args.rounds):
        for name, (tiled, extra) in CONFIGS.items():
            for key, value in run(args.model, args.prompt, tiled, extra).items():
                figures[name].setdefault(key, []).append(value)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    base = {k: statistics.median(v) for k, v in figures["default"].items()}
    for name, values in figures.items():
        cells = []
        for key in ("prefill", "pass", "rows"):
            ms = statistics.median(values[key])
            cells.append(f"{key} {ms:8.2f} ms ({ms / base[key]:.2f}x)")
        print(f"{name:10} " + "  ".join(cells))


if __name__ == "__main__":
    main()
