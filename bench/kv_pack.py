"""Time kv_pack / kv_unpack of one sequence beside a plain memcpy of the same bytes.

Prefills ~2048 tokens of the embedded model (n_ctx 4096), then, over several interleaved
repetitions (so machine noise hits every variant alike), times:

- kv_pack as shipped (llama.cpp writes straight into the returned ``bytes``), and two
  alternatives it was chosen over: a ctypes array copied out with ``bytes()``, and a bytearray
  filled through ``from_buffer`` then copied with ``bytes()``;
- kv_unpack from ``bytes``, ``bytearray`` and ``memoryview`` (all zero-copy);
- memcpy baselines: ``bytearray(blob)`` and ``numpy.copy``.

Prints median milliseconds and the blob size. Usage::

    PYTHONPATH=src .venv/bin/python bench/kv_pack.py [--tokens 2048] [--reps 9] [--threads N]
"""

from __future__ import annotations

import argparse
import ctypes
import shlex
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from kvwarm.backends.base import ContextParams
from kvwarm.backends.llama import LlamaBackend, LlamaContext
from kvwarm.embedded import default_model_path

TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. "
    "Keepers trimmed wicks, polished lenses and logged every passing vessel in ledgers. "
)


def pack_ctypes_array(ctx: LlamaContext) -> bytes:
    lib, ptr = ctx._lib, ctx._ptr
    n = int(lib.llama_state_seq_get_size(ptr, 0))
    buf = (ctypes.c_uint8 * n)()
    lib.llama_state_seq_get_data(ptr, buf, n, 0)
    return bytes(buf)


def pack_bytearray(ctx: LlamaContext) -> bytes:
    lib, ptr = ctx._lib, ctx._ptr
    n = int(lib.llama_state_seq_get_size(ptr, 0))
    out = bytearray(n)
    lib.llama_state_seq_get_data(ptr, (ctypes.c_uint8 * n).from_buffer(out), n, 0)
    return bytes(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    model = LlamaBackend().load_model(str(default_model_path()))
    params = ContextParams(n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=args.threads)
    ctx = model.new_context(params)
    tokens = (model.tokenize(TEXT * (args.tokens // 20 + 1)))[: args.tokens]
    started = time.perf_counter()
    ctx.prefill(0, tokens, 0)
    prefill_s = time.perf_counter() - started

    blob = ctx.kv_pack(0)
    assert pack_ctypes_array(ctx) == blob and pack_bytearray(ctx) == blob
    as_bytearray = bytearray(blob)
    as_view = memoryview(blob)
    as_numpy = np.frombuffer(blob, dtype=np.uint8)

    variants: dict[str, Callable[[], object]] = {
        "kv_pack (shipped: fill bytes in place)": lambda: ctx.kv_pack(0),
        "kv_pack alt: ctypes array + bytes()": lambda: pack_ctypes_array(ctx),
        "kv_pack alt: bytearray from_buffer + bytes()": lambda: pack_bytearray(ctx),
        "kv_unpack(bytes)": lambda: ctx.kv_unpack(0, blob),
        "kv_unpack(bytearray)": lambda: ctx.kv_unpack(0, as_bytearray),
        "kv_unpack(memoryview)": lambda: ctx.kv_unpack(0, as_view),
        "memcpy: bytearray(blob)": lambda: bytearray(blob),
        "memcpy: numpy copy": as_numpy.copy,
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1000)
    assert ctx.seq_pos_max(0) == len(tokens) - 1

    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"tokens: {len(tokens)}  prefill: {prefill_s:.1f} s ({len(tokens) / prefill_s:.0f} tok/s)"
        f"  blob: {len(blob) / 1e6:.1f} MB ({len(blob) / len(tokens) / 1e3:.1f} KB/token)"
        f"  reps: {args.reps}"
    )
    for name, values in samples.items():
        print(f"  {name:<46} median {statistics.median(values):7.2f} ms  min {min(values):7.2f} ms")
    ctx.close()
    model.close()


if __name__ == "__main__":
    main()
