"""Flash attention on the CPU, on against off, for the work a cache serves.

    python bench/flash_attn.py [GGUF ...] [--shapes all|none|NAME,...] [--reps 5]
                               [--positions 1100] [--threads 2]

For each model, two contexts of the pinned llama.cpp (``flash_attn_type`` 1 and 0, everything
else equal, no layer offloaded) prefill the same ``--positions`` random tokens, then take turns
(the order alternating per rep) at: a 20- and a 40-token prefill on top of them (a follow-up
turn after a cache hit) and 8 single-token decodes; each is removed again after it is timed.
Prints the minimum over the reps of each (decode: of the per-rep median), and the cold prefill
of the ``--positions`` tokens in 512-token batches, once per context.

Models: the GGUF paths given, and ``--shapes``: random-weight llama models (4 layers, Q4_0,
written once into ``~/.cache/kvwarm-bench/shapes`` with ``tests/tinymodels.py``) whose layers
have the widths, heads and head sizes of common small and mid-size models. Attention's share
of a layer, and so flash attention's effect per layer, does not depend on how many layers
there are. This is what kvwarm's ``flash_attn="auto"`` is decided from
(``LlamaModel.context_params``). Run it alone: two processes decoding at once on 2 cores
halve each other.
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
from tests.tinymodels import N_VOCAB, write_tiny_model

CACHE = Path.home() / ".cache" / "kvwarm-bench" / "shapes"
# name: (n_embd, n_head, n_head_kv, n_ff, head_dim)
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "smollm2-135m": (576, 9, 3, 1536, 64),
    "qwen2.5-0.5b": (896, 14, 2, 4864, 64),
    "llama3.2-1b": (2048, 32, 8, 8192, 64),
    "qwen3-0.6b": (1024, 16, 8, 3072, 128),
    "llama3-8b": (4096, 32, 8, 14336, 128),
    "gemma3-270m": (640, 4, 1, 2048, 256),
}
SHAPE_LAYERS = 4
LLAMA_FTYPE_MOSTLY_Q4_0 = 2


def shape_keys(shape: tuple[int, int, int, int, int]) -> Callable[[Any, str], None]:
    n_embd, n_head, n_head_kv, n_ff, head_dim = shape

    def keys(w: Any, arch: str) -> None:
        k = f"{arch}."
        w.add_uint32(k + "vocab_size", N_VOCAB)
        w.add_uint32(k + "context_length", 4096)
        w.add_uint32(k + "embedding_length", n_embd)
        w.add_uint32(k + "block_count", SHAPE_LAYERS)
        w.add_uint32(k + "feed_forward_length", n_ff)
        w.add_uint32(k + "attention.head_count", n_head)
        w.add_uint32(k + "attention.head_count_kv", n_head_kv)
        w.add_uint32(k + "attention.key_length", head_dim)
        w.add_uint32(k + "attention.value_length", head_dim)
        w.add_uint32(k + "rope.dimension_count", head_dim)
        w.add_float32(k + "attention.layer_norm_rms_epsilon", 1e-5)

    return keys


def shape_model(name: str) -> Path:
    """The Q4_0 random-weight model of shape ``name``, built once."""
    import llama_cpp

    out = CACHE / f"{name}.q4_0.gguf"
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    f32 = CACHE / f"{name}.f32.gguf"
    write_tiny_model(f32, "llama", stdev=0.02, keys=shape_keys(SHAPES[name]))
    qp = llama_cpp.llama_model_quantize_default_params()
    qp.ftype = LLAMA_FTYPE_MOSTLY_Q4_0
    qp.nthread = 2
    tmp = out.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(qp))
    f32.unlink()
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) for {name}")
    tmp.rename(out)
    return out


class Ctx:
    """One context of ``model`` with flash attention on or off, holding sequence 0."""

    def __init__(self, model: object, flash: bool, threads: int, n_ctx: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = 1 if flash else 0
        cp.swa_full = False  # as kvwarm (and llama-server) run a sliding-window model
        self.ptr = llama_cpp.llama_init_from_model(model, cp)
        if not self.ptr:
            raise RuntimeError("llama_init_from_model failed")
        self.mem = llama_cpp.llama_get_memory(self.ptr)

    def decode(self, tokens: Sequence[int], pos0: int) -> float:
        lib = self.lib
        batch = lib.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for i, tok in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(tokens) - 1
            t0 = time.perf_counter()
            rc = lib.llama_decode(self.ptr, batch)
            lib.llama_synchronize(self.ptr)
            elapsed = time.perf_counter() - t0
        finally:
            lib.llama_batch_free(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return elapsed

    def drop_from(self, pos: int) -> None:
        if not self.lib.llama_memory_seq_rm(self.mem, 0, pos, -1):
            raise RuntimeError("llama_memory_seq_rm refused")

    def close(self) -> None:
        self.lib.llama_free(self.ptr)


def measure(path: Path, reps: int, positions: int, threads: int) -> dict[str, dict[str, float]]:
    import llama_cpp

    from kvwarm.backends.llama.native import amx_in_use

    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = not amx_in_use()  # as kvwarm loads it (AMX matmul crashes)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise RuntimeError(f"could not load {path}")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(1, min(n_vocab, 5000), positions + 64)]
    ctxs = {flash: Ctx(model, flash, threads, positions + 512) for flash in (True, False)}
    out: dict[str, dict[str, float]] = {}
    try:
        samples: dict[bool, dict[str, list[float]]] = {}
        for flash, ctx in ctxs.items():
            cold = sum(
                ctx.decode(tokens[s : min(positions, s + 512)], s) for s in range(0, positions, 512)
            )
            samples[flash] = {"cold": [cold], "p20": [], "p40": [], "decode": []}
        for rep in range(reps):
            for flash in (True, False) if rep % 2 == 0 else (False, True):
                ctx, got = ctxs[flash], samples[flash]
                for key, n in (("p20", 20), ("p40", 40)):
                    got[key].append(ctx.decode(tokens[positions : positions + n], positions))
                    ctx.drop_from(positions)
                steps = [ctx.decode([tokens[positions + i]], positions + i) for i in range(8)]
                got["decode"].append(statistics.median(steps))
                ctx.drop_from(positions)
        for flash, got in samples.items():
            out["on" if flash else "off"] = {k: min(v) * 1000 for k, v in got.items()}
    finally:
        for ctx in ctxs.values():
            ctx.close()
        llama_cpp.llama_model_free(model)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path, help="GGUF files")
    ap.add_argument("--shapes", default="all", help="all, none, or names: " + ",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--positions", type=int, default=1100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from kvwarm.backends.llama import native

    native.lib()  # backend initialised, llama.cpp's log routed to logging
    names = (
        []
        if args.shapes == "none"
        else list(SHAPES)
        if args.shapes == "all"
        else args.shapes.split(",")
    )
    runs = [(str(p.name), p) for p in args.models] + [
        (f"{n} (shape)", shape_model(n)) for n in names
    ]
    print(f"$ python {shlex.join(sys.argv)}")
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, "
          f"{args.positions} positions, min of {args.reps} reps, ms; on / off")  # fmt: skip
    print(f"{'model':28s} {'decode':>15s} {'prefill 20':>17s} {'prefill 40':>17s} {'cold':>17s}")
    for label, path in runs:
        got = measure(path, args.reps, args.positions, args.threads)
        on, off = got["on"], got["off"]
        cells = [f"{on[k]:7.1f} /{off[k]:7.1f}" for k in ("decode", "p20", "p40", "cold")]
        print(f"{label:28s} {cells[0]:>15s} {cells[1]:>17s} {cells[2]:>17s} {cells[3]:>17s}")
        print(
            f"{'':28s} off/on: decode {off['decode'] / on['decode']:.2f}, "
            f"prefill 20 {off['p20'] / on['p20']:.2f}, 40 {off['p40'] / on['p40']:.2f}, "
            f"cold {off['cold'] / on['cold']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
