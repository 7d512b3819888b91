"""Continuous batching throughput: aggregate generated tokens/s with 1, 2, 4, 8 concurrent
streams (n_parallel = streams, and the 1-slot baseline), time to first token under load, beside
a bare ``llama_decode`` loop with the same batch shapes in the same run (the ceiling here).

    python bench/batching.py
    python bench/batching.py --streams 1 4 --tokens 64
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time

import llama_cpp as L  # noqa: N812  (the C API reads best with its own prefix)

from kvwarm.backends.base import ContextParams
from kvwarm.backends.llama.native import amx_in_use as native_amx_in_use
from kvwarm.backends.llama.native import lib as native
from kvwarm.cache.types import CacheConfig, PolicyConfig, TierConfig
from kvwarm.embedded import default_model_path
from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
from kvwarm.engine.types import GenerationOptions

N_CTX = 512
PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details."


def bare_loop(n_seq: int, steps: int) -> float:
    """Tokens/s of a bare loop: n_seq sequences, one token each per llama_decode, each
    followed by a greedy llama_sampler_sample (no Python bookkeeping at all)."""
    native()  # kvwarm's one-time init: backend up, llama.cpp logs routed to `logging`
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = not native_amx_in_use()  # as kvwarm loads it (AMX matmul segfaults)
    model = L.llama_model_load_from_file(str(default_model_path()).encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = N_CTX * n_seq
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = n_seq
    cp.kv_unified = True
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = 0  # as kvwarm runs a CPU model: its flash_attn "auto" is off there
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(512, 0, 1)
    # A real loop must choose each next token: greedy, as llama.cpp samples it.
    sparams = L.llama_sampler_chain_default_params()
    greedy = L.llama_sampler_chain_init(sparams)
    L.llama_sampler_chain_add(greedy, L.llama_sampler_init_greedy())
    try:

        def decode(items: list[tuple[int, int, int]]) -> None:
            for i, (tok, pos, seq) in enumerate(items):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = True
            batch.n_tokens = len(items)
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
        for s in range(n_seq):
            decode([(t, p, s) for p, t in enumerate(prompt)])
        pos = len(prompt)
        for _ in range(4):  # warm-up: the first calls pay one-time allocation costs
            decode([(100 + s, pos, s) for s in range(n_seq)])
            pos += 1
        t0 = time.perf_counter()
        for _ in range(steps):
            decode([(100 + s, pos, s) for s in range(n_seq)])
            for s in range(n_seq):
                L.llama_sampler_sample(greedy, ctx, s)
            pos += 1
        return n_seq * steps / (time.perf_counter() - t0)
    finally:
        L.llama_sampler_free(greedy)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)


def bare_loop_on_a_thread(n_seq: int, steps: int) -> float:
    """The bare loop on a fresh thread, as kvwarm's per-model worker thread runs its decodes.

    llama.cpp's CPU backend uses OpenMP here (libgomp), whose thread team belongs to the calling
    thread; measured on this machine, the same loop runs ~5% slower from a fresh non-main
    thread than from the main thread. Comparing like with like isolates kvwarm's own cost."""
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.append(bare_loop(n_seq, steps)))
    worker.start()
    worker.join()
    return out[0]


def kvwarm_run(n_streams: int, n_parallel: int, tokens: int) -> tuple[float, float, float, float]:
    """(decode-phase aggregate tok/s, aggregate tok/s including prefill and queueing,
    median TTFT ms, median ms per token of one stream)."""
    policy = PolicyConfig(min_tokens=10**9, cold_min_tokens=10**9, cold_max_tokens=10**9)
    eng = Engine(
        EngineConfig(cache=CacheConfig(tiers=(TierConfig("ram", 1 << 28),)), policy=policy)
    )
    try:
        cfg = ModelConfig(
            context=ContextParams(
                n_ctx=N_CTX, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2
            ),
            n_parallel=n_parallel,
        )
        model = eng.load_model(config=cfg)
        # Every stream generates exactly `tokens` tokens, like the bare loop's fixed steps.
        opts = GenerationOptions(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        model.complete(
            PROMPT, GenerationOptions(max_tokens=2, temperature=0.0, ignore_eos=True)
        )  # warm-up
        t0 = time.perf_counter()
        streams = [model.submit(PROMPT + f" Story {i}.", opts) for i in range(n_streams)]
        results = [s.result() for s in streams]
        dt = time.perf_counter() - t0
        generated = sum(r.stats.completion_tokens for r in results)
        ttft = statistics.median(r.stats.ttft_ms for r in results)
        per_tok = statistics.median(
            r.stats.generation_ms / max(1, r.stats.completion_tokens - 1) for r in results
        )
        # Comparable with the bare loop, which times decode steps only: tokens decoded after
        # each stream's first one, over the span in which streams were decoding.
        decode_span = max(r.stats.generation_ms for r in results) / 1e3
        decoded = sum(r.stats.completion_tokens - 1 for r in results)
        return decoded / decode_span, generated / dt, ttft, per_tok
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(
        f"{'streams':>7} {'bare tok/s':>10} {'kvwarm tok/s':>12} {'ratio':>6} "
        f"{'incl. prefill':>13} {'1-slot tok/s':>12} {'TTFT ms':>8} "
        f"{'ms/tok kvwarm':>13} {'ms/tok bare':>11}"
    )
    for n in args.streams:
        keys = ("bare", "agg", "total", "one", "ttft", "tok")
        runs: dict[str, list[float]] = {k: [] for k in keys}
        for _ in range(args.reps):  # interleaved: drift in machine speed hits both sides
            runs["bare"].append(bare_loop_on_a_thread(n, args.tokens))
            agg, total, ttft, per_tok = kvwarm_run(n, n, args.tokens)
            runs["agg"].append(agg)
            runs["total"].append(total)
            runs["ttft"].append(ttft)
            runs["tok"].append(per_tok)
            runs["one"].append(kvwarm_run(n, 1, args.tokens)[1])
        m = {k: statistics.median(v) for k, v in runs.items()}
        print(
            f"{n:>7} {m['bare']:>10.1f} {m['agg']:>12.1f} {m['agg'] / m['bare']:>6.2f} "
            f"{m['total']:>13.1f} {m['one']:>12.1f} {m['ttft']:>8.1f} "
            f"{m['tok']:>13.2f} {n * 1e3 / m['bare']:>11.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
