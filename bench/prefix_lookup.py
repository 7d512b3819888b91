"""Longest-prefix lookup latency versus the number of indexed rows.

Rows look like real chat traffic: a few long system prompts, each followed by many distinct
continuations (conversations), plus some rows sharing nothing. Queries are 8k-token prompts:
a system prompt, most of an existing continuation, then new tokens (the common "yesterday's
conversation plus a new turn" case), and a share of prompts that match nothing.

Run: PYTHONPATH=src .venv/bin/python bench/prefix_lookup.py [--rows 10,1000,100000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from array import array

import numpy as np

from kvwarm.cache.index.index import Index
from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.types import Namespace, RowInfo, SaveReason, TtlClass

NS = Namespace(b"\x01" * 32, 1, b"\x02" * 32)
VOCAB = 49_152
PROMPT = 8192
SYSTEM_PROMPTS = 4
SYSTEM_LEN = 2048


def make_rows(n: int, rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    systems = [rng.integers(0, VOCAB, SYSTEM_LEN, dtype=np.uint32) for _ in range(SYSTEM_PROMPTS)]
    rows: list[np.ndarray] = []
    for i in range(n):
        tail = rng.integers(0, VOCAB, int(rng.integers(64, 1024)), dtype=np.uint32)
        if i % 5 == 4:  # one row in five shares nothing with the rest
            rows.append(np.concatenate([rng.integers(0, VOCAB, 512, dtype=np.uint32), tail]))
        else:
            rows.append(np.concatenate([systems[i % SYSTEM_PROMPTS], tail]))
    return systems, rows


def stored(key: bytes, tokens: np.ndarray, size: int) -> StoredRow:
    info = RowInfo(
        key, "disk", size, len(tokens), 0, 0.0, 0.0, SaveReason.COLD, TtlClass.LONG, False, NS
    )
    # A u32 array instead of the tuple a tier would pass: the index only iterates it, and
    # this keeps 10^8 short-lived int objects out of the build time and the memory trace.
    arr = array("I")
    arr.frombytes(tokens.astype(np.uint32).tobytes())
    return StoredRow(info, arr, None)  # type: ignore[arg-type]


def make_queries(rows: list[np.ndarray], rng: np.random.Generator, count: int) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for q in range(count):
        if q % 4 == 3:  # a miss: nothing shares even the first token... usually
            toks = rng.integers(0, VOCAB, PROMPT, dtype=np.uint32)
        else:
            base = rows[int(rng.integers(0, len(rows)))]
            keep = int(rng.integers(len(base) // 2, len(base) + 1))
            toks = np.concatenate(
                [base[:keep], rng.integers(0, VOCAB, PROMPT - keep, dtype=np.uint32)]
            )
        out.append(toks)
    return out


def bench(n_rows: int, n_queries: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    _, rows = make_rows(n_rows, rng)
    batch = [stored(i.to_bytes(32, "big"), t, 1000 + len(t)) for i, t in enumerate(rows)]
    index = Index()
    t0 = time.perf_counter()
    for row in batch:
        index.adopt(row)
    build_s = time.perf_counter() - t0
    # Memory: rebuild the same index under tracemalloc (it slows allocation, not the above).
    index = Index()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for row in batch:
        index.adopt(row)
    index_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del batch
    n_tokens = sum(len(r) for r in rows)
    queries = make_queries(rows, rng, n_queries)
    random.Random(seed).shuffle(queries)
    for q in queries[:20]:  # warm caches
        index.longest(NS, q.tolist())
    lat: list[float] = []
    hits = 0
    for arr in queries:
        q = arr.tolist()  # what the engine holds: a list of Python ints (not timed)
        t = time.perf_counter()
        m = index.longest(NS, q)
        lat.append(time.perf_counter() - t)
        hits += m is not None
    lat.sort()
    return {
        "rows": n_rows,
        "tokens": n_tokens,
        "build_s": build_s,
        "index_mb": index_bytes / 2**20,
        "bytes_per_row": index_bytes / n_rows,
        "median_us": statistics.median(lat) * 1e6,
        "p99_us": lat[int(0.99 * (len(lat) - 1))] * 1e6,
        "hit_rate": hits / len(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="10,1000,100000")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(
        f"prompt={PROMPT} tokens; {SYSTEM_PROMPTS} system prompts x {SYSTEM_LEN} tokens; "
        "continuations 64..1023 tokens; 1 row in 5 unrelated"
    )
    header = (
        f"{'rows':>8} {'tokens':>11} {'build s':>8} {'index MB':>9} {'B/row':>7} "
        f"{'median us':>10} {'p99 us':>8} {'hit rate':>8}"
    )
    print(header)
    for n in (int(x) for x in args.rows.split(",")):
        r = bench(n, args.queries, args.seed)
        print(
            f"{r['rows']:>8} {r['tokens']:>11} {r['build_s']:>8.2f} {r['index_mb']:>9.1f} "
            f"{r['bytes_per_row']:>7.0f} {r['median_us']:>10.1f} {r['p99_us']:>8.1f} "
            f"{r['hit_rate']:>8.2f}"
        )


if __name__ == "__main__":
    main()
