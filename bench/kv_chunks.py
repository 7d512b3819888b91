"""What cutting a sequence's KV into chunks costs, beside kv_pack / kv_unpack and a memcpy.

Prefills ``--tokens`` (2048) tokens of the embedded model (f16 cells, n_ctx 4096), packs the
sequence, and over interleaved repetitions (so machine noise hits every variant alike) times:

- ``kv_pack`` and ``kv_unpack`` of the whole blob (what a single-blob row costs);
- ``kv_split`` into ``--chunk`` (256) token chunks, ``kv_join`` of them, and both;
- a restore from chunks (``kv_join`` + ``kv_unpack``) against ``kv_unpack`` alone;
- memcpy baselines: ``bytearray(blob)`` and ``numpy.copy``;
- ``kv_pack``, ``kv_split`` and ``kv_join`` again without the huge-page hint on their fresh
  output buffers (``backends/_buffers.advise_huge``), to show what the hint buys.

Then, for f16, q8_0 and q4_0 cells (V by cell, flash attention on) and f16 with V transposed
(flash attention off), the bytes one token costs in a blob and in a chunk. Prints the load
average before and after: the numbers mean little on a busy machine.

Usage::

    PYTHONPATH=src .venv/bin/python bench/kv_chunks.py [--tokens 2048] [--chunk 256] [--reps 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from kvwarm.backends import _buffers
from kvwarm.backends.base import ContextParams, FlashAttn, KvType
from kvwarm.backends.kv_chunk import header_size
from kvwarm.backends.llama import LlamaBackend, LlamaModel
from kvwarm.backends.llama.kv_layout import parse_blob
from kvwarm.buffers import u8
from kvwarm.embedded import default_model_path

TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. "
    "Keepers trimmed wicks, polished lenses and logged every passing vessel in ledgers. "
)
CELL_TYPES: list[tuple[FlashAttn, KvType, KvType]] = [
    ("on", "f16", "f16"),
    ("off", "f16", "f16"),
    ("on", "q8_0", "q8_0"),
    ("on", "q4_0", "q4_0"),
]


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def _no_hint(run: Callable[[], object]) -> Callable[[], object]:
    """``run`` with ``advise_huge`` disabled (fresh pages faulted in 4 KiB at a time)."""

    def wrapped() -> object:
        saved, _buffers._madvise = _buffers._madvise, None
        try:
            return run()
        finally:
            _buffers._madvise = saved

    return wrapped


def _timings(model: LlamaModel, n_tokens: int, chunk: int, reps: int, threads: int | None) -> None:
    params = ContextParams(n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=threads)
    ctx = model.new_context(params)
    tokens = model.tokenize(TEXT * (n_tokens // 20 + 1))[:n_tokens]
    started = time.perf_counter()
    ctx.prefill(0, tokens, 0)
    print(f"prefill {n_tokens} tokens: {time.perf_counter() - started:.1f} s")
    blob = ctx.kv_pack(0)
    bounds = [*range(0, n_tokens, chunk), n_tokens]
    chunks = ctx.kv_split(blob, bounds)
    joined = ctx.kv_join(chunks)
    assert joined == blob, "join(split(blob)) must be the blob"
    array = np.frombuffer(blob, dtype=np.uint8)

    variants: dict[str, Callable[[], object]] = {
        "kv_pack": lambda: ctx.kv_pack(0),
        "kv_unpack(blob)": lambda: ctx.kv_unpack(0, blob),
        f"kv_split into {len(chunks)} chunks": lambda: ctx.kv_split(blob, bounds),
        "kv_join of them": lambda: ctx.kv_join(chunks),
        "kv_split + kv_join": lambda: ctx.kv_join(ctx.kv_split(blob, bounds)),
        "restore from chunks (join + unpack)": lambda: ctx.kv_unpack(0, ctx.kv_join(chunks)),
        "memcpy: bytearray(blob)": lambda: bytearray(blob),
        "memcpy: numpy copy": array.copy,
        "kv_pack, no huge-page hint": _no_hint(lambda: ctx.kv_pack(0)),
        "kv_split, no huge-page hint": _no_hint(lambda: ctx.kv_split(blob, bounds)),
        "kv_join, no huge-page hint": _no_hint(lambda: ctx.kv_join(chunks)),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    mib = len(blob) / 2**20
    print(f"blob: {len(blob):,} bytes ({mib:.1f} MiB), {len(chunks)} chunks of {chunk} tokens")
    for name, values in samples.items():
        ms = statistics.median(values) * 1e3
        print(f"  {name:<40} {ms:8.2f} ms  ({mib / (ms / 1e3) / 1024:5.2f} GiB/s)")
    ctx.close()


def _cell_bytes(model: LlamaModel, chunk: int, threads: int | None) -> None:
    tokens = model.tokenize(TEXT)[:32]
    print(f"bytes per token (chunks of {chunk} tokens):")
    for flash, type_k, type_v in CELL_TYPES:
        params = ContextParams(
            n_ctx=256,
            n_batch=64,
            n_ubatch=64,
            n_threads=threads,
            type_k=type_k,
            type_v=type_v,
            flash_attn=flash,
        )
        ctx = model.new_context(params)
        ctx.prefill(0, tokens, 0)
        blob = ctx.kv_pack(0)
        layout = parse_blob(u8(blob))
        per_cell = layout.structure.cell_bytes
        chunk_bytes = header_size(layout.descriptor) + chunk * per_cell
        v = "V transposed" if layout.structure.v_trans else "V by cell"
        print(
            f"  K {type_k:<5} V {type_v:<5} ({v:<12}): {per_cell:6,} B/token; "
            f"a {chunk}-token chunk {chunk_bytes:,} B ({chunk_bytes / (chunk * per_cell):.5f}x)"
        )
        ctx.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    print(_load())
    model = LlamaBackend().load_model(str(default_model_path()))
    try:
        _timings(model, args.tokens, args.chunk, args.reps, args.threads)
        _cell_bytes(model, args.chunk, args.threads)
    finally:
        model.close()
    print(_load())


if __name__ == "__main__":
    main()
