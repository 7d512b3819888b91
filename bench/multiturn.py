"""Multi-turn chat, kvwarm vs llama-server (the peer built from the same pinned llama.cpp by
``bench/peer.py``), side by side in one run, same model, same threads, servers alternated.

    python bench/multiturn.py --model PATH.gguf [--rounds 2] [--system-tokens 1000]
                              [--profile kvwarm.raw] [--servers kvwarm,llama-server]
                              [--base-tree DIR]

``--base-tree DIR`` adds a server ``kvwarm-base``: kvwarm from another source tree (e.g. the
commit before a change, ``git archive``d into DIR), so ``--servers kvwarm,kvwarm-base`` compares
two versions on one load, alternated request by request like any two servers.

The load (issue 22): 3 conversations x 4 turns over one ~1,000-token system prompt, 16-token
replies; then each server restarts and every conversation takes one more turn. Both servers
run side by side and take each request in turn (the order alternating request by request), so
neither decodes while the other does and a drift in the machine's speed (30-50% within
minutes on a shared 2-core host) falls on both alike. Both servers
get the same rendered prompt text through their completions endpoints (Gemma's turn format),
so the chat template is not what is measured. kvwarm runs with a disk tier (it survives the
restart); llama-server with its defaults (RAM prompt cache, context checkpoints).

Prints, per server and round: total time of the run phase and of the after-restart phase, each
request's cached / prompt tokens and latency, and kvwarm's checkpoint bytes on disk per
conversation and, by save reason, per token a row holds (``kvwarm cache ls --json``); for each
kvwarm, its storage against the distinct KV (the tokens of every row, each prefix once, times
the model's f16 K and V bytes a token, every layer, from the GGUF: what a cache storing each
token's KV once would hold), with the rows' final logits apart, and its restore time (the
tier read and the unpack, per restore, from ``/cache/stats``'s latency totals); the
run ratio also without each server's first request (a cold prefill of the system prompt on
both, the same work); and the first server's *floor*: its phase had every request after the
first cost only its decode, by the server's own ``timings`` (no restore, no prefill), against
the other's time: the best ratio any cache could reach on this load and machine, since both
pay the same cold prefill and the same 16-token decodes. ``--profile OUT`` records kvwarm's
round-0 run phase after its first request with py-spy and prints its worker thread's top
functions (sampling stops the process: the ratios of a profiled run are not comparable). Run
it alone: two processes decoding at once on 2 cores halve each other.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peer import llama_server
from profiling import py_spy, stop, top_frames

CONVERSATIONS = 3
TURNS = 4
REPLY_TOKENS = 16
QUESTIONS = [
    "Who kept the lighthouse first?",
    "What happened to the harbour in the great storm?",
    "Which family ran the ferry?",
    "When was the school built?",
    "Why did the fishing fleet shrink?",
]
LORE = (
    "You are the archivist of a small coastal town. You answer questions about its history, "
    "its harbour, its lighthouse and the families who kept them, briefly and in plain words. "
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, object], timeout: float = 600) -> dict[str, object]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, object] = json.loads(resp.read())
        return out


def wait_ready(url: str, proc: subprocess.Popen[bytes], limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)  # polling a child's readiness, not synchronising a test
    raise SystemExit(f"{url} not ready in {limit_s} s")


def stop_server(proc: subprocess.Popen[bytes], limit_s: float = 60) -> None:
    """SIGTERM a server, wait up to ``limit_s`` for it to shut down, then kill it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Server:
    name: str
    model: Path
    threads: int
    work: Path
    slots: int = 1
    gpu_layers: int = 0
    flash_attn: str = "auto"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    last_text: str = ""
    #: The last request's decode time by the server's own ``timings`` (seconds; kvwarm's
    #: ``generation_ms``, llama-server's ``predicted_ms``).
    last_decode_s: float = 0.0
    #: What flash attention it ran: kvwarm's as its ``/v1/models`` reports it (its ``auto``
    #: is ``off`` on the CPU alone), llama-server's as given (llama.cpp's ``auto``: on
    #: wherever the device supports it, the CPU included).
    ran_flash_attn: str = ""

    #: Another kvwarm source tree (its ``src``) this server runs, for ``kvwarm-base``.
    tree: Path | None = None
    #: ``/cache/stats``'s counters, read before each stop (kvwarm only), one per phase.
    counters: list[dict[str, float]] = field(default_factory=list)

    @property
    def is_kvwarm(self) -> bool:
        return self.name.startswith("kvwarm")

    def command(self) -> list[str]:
        if self.is_kvwarm:
            return [
                sys.executable, "-m", "kvwarm", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--model", f"m={self.model}", "--n-ctx", "4096",
                "--n-threads", str(self.threads), "--n-threads-batch", str(self.threads),
                "--cache-dir", str(self.work / "kvwarm-cache"), "--n-parallel", str(self.slots),
                "--n-gpu-layers", str(self.gpu_layers), "--flash-attn", self.flash_attn,
            ]  # fmt: skip
        # llama-server divides its context among its slots: 4,096 tokens each, as kvwarm's.
        return [
            str(llama_server()), "--host", "127.0.0.1", "--port", str(self.port),
            "-m", str(self.model), "-c", str(4096 * self.slots), "-t", str(self.threads),
            "-tb", str(self.threads), "-np", str(self.slots), "--no-webui",
            "-ngl", str(self.gpu_layers), "-fa", self.flash_attn,
        ]  # fmt: skip

    def start(self) -> None:
        env = None
        if self.tree is not None:
            env = {**os.environ, "PYTHONPATH": str(self.tree / "src")}
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc)
        self.ran_flash_attn = f"-fa {self.flash_attn}"
        if self.is_kvwarm:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models") as resp:
                meta = json.loads(resp.read())["data"][0]["meta"]
            self.ran_flash_attn = f"flash_attn {meta['flash_attn']}"

    def stop(self) -> None:
        if self.proc is not None and self.is_kvwarm:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/cache/stats") as resp:
                self.counters.append(json.loads(resp.read())["counters"])
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None

    def complete(self, prompt: str, n: int = REPLY_TOKENS) -> tuple[int, int, float]:
        """(cached tokens, prompt tokens, seconds) of one completion of ``n`` tokens; its text
        is ``last_text``."""
        t0 = time.perf_counter()
        if self.is_kvwarm:
            out = post(
                f"http://127.0.0.1:{self.port}/v1/completions",
                {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0},
            )
            usage = out["usage"]
            assert isinstance(usage, dict)
            details = usage.get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens", 0))
            n_prompt = int(usage["prompt_tokens"])
            text = out["choices"][0]["text"]  # type: ignore[index]
            decode_ms = out["timings"]["generation_ms"]  # type: ignore[index]
        else:
            out = post(
                f"http://127.0.0.1:{self.port}/completion",
                {"prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": True},
            )  # fmt: skip
            timings = out["timings"]
            assert isinstance(timings, dict)
            cached = int(timings.get("cache_n", 0))
            n_prompt = cached + int(timings["prompt_n"])
            text = out["content"]
            decode_ms = timings["predicted_ms"]
        self.last_text = str(text)
        self.last_decode_s = float(decode_ms) / 1e3
        return cached, n_prompt, time.perf_counter() - t0


def checkpoint_bytes(cache_dir: Path) -> list[str]:
    """The rows kvwarm kept, by save reason: how many, their tokens, and per token they hold
    their logical bytes (what a restore reads: chunks and the row) and their own bytes (the
    row alone: a manifest's window or recurrent state, or a whole blob), from ``kvwarm cache
    ls --json``. Chunks are shared, so own bytes are what each further resume point costs."""
    out = subprocess.run(
        [sys.executable, "-m", "kvwarm", "cache", "ls", "--json", "--cache-dir", str(cache_dir)],
        capture_output=True, check=True, text=True,
    )  # fmt: skip
    by_reason: dict[str, list[tuple[int, int, int]]] = {}
    for row in json.loads(out.stdout):
        held = (int(row["n_tokens"]), int(row["bytes"]), int(row["own_bytes"]))
        by_reason.setdefault(str(row["reason"]), []).append(held)
    lines = []
    for reason, rows in sorted(by_reason.items()):
        tokens = max(sum(t for t, _, _ in rows), 1)
        logical = sum(b for _, b, _ in rows)
        own = sum(o for _, _, o in rows)
        lines.append(
            f"  {reason:8s} rows {len(rows):3d}: logical {logical / 2**20:7.1f} MiB "
            f"({logical / tokens / 1024:5.1f} KiB per token held), own "
            f"{own / 2**20:7.1f} MiB ({own / tokens / 1024:5.1f} KiB per token)"
        )
    return lines


def kv_bytes_per_token(model: Path) -> int:
    """A token's K and V in f16, every layer, from the GGUF's attention shape (read with
    kvwarm's own GGUF reader: the ``gguf`` package is a dev dependency, absent where only
    kvwarm's runtime is installed, such as the GPU machine of docs/operations.md)."""
    from kvwarm.gguf_meta import arch_values

    names = (
        "block_count", "attention.head_count", "attention.head_count_kv", "embedding_length",
        "attention.key_length", "attention.value_length",
    )  # fmt: skip
    found = arch_values(model, names)

    def value(name: str) -> int | None:
        v = found.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    n_layer = value("block_count") or 0
    n_head = value("attention.head_count") or 1
    n_kv = value("attention.head_count_kv") or n_head
    head = (value("embedding_length") or 0) // n_head
    k = value("attention.key_length") or head
    v = value("attention.value_length") or head
    return n_layer * n_kv * (k + v) * 2


def storage(cache_dir: Path, per_token: int) -> list[str]:
    """What the cache holds against the distinct KV: every row's tokens, each prefix once,
    times ``per_token``; the rows' final logits apart (each row's own: nothing to share)."""
    from kvwarm.cache.formats import kvc

    prefixes: set[tuple[int, bytes]] = set()
    logits = rows = 0
    for path in cache_dir.rglob("*.kvc"):
        fields = kvc.parse_meta(path.read_bytes()).fields
        rows += 1
        logits += len(fields.logits or b"")
        h = hashlib.sha256()
        for i, t in enumerate(fields.tokens):
            h.update(t.to_bytes(4, "little"))
            prefixes.add((i, h.digest()[:16]))
    files = [f for f in cache_dir.rglob("*") if f.is_file() and f.suffix in (".kvc", ".kvk")]
    total = sum(f.stat().st_size for f in files)
    chunks = sum(f.stat().st_size for f in files if f.suffix == ".kvk")
    distinct = len(prefixes) * per_token
    mib = 2**20
    return [
        f"storage: {total / mib:.1f} MiB in {rows} rows = {total / distinct:.2f}x the distinct KV "
        f"({len(prefixes)} tokens x {per_token} B = {distinct / mib:.1f} MiB); without the rows' "
        f"logits ({logits / mib:.1f} MiB) {(total - logits) / distinct:.2f}x; chunk files "
        f"{chunks / mib:.1f} MiB, row files {(total - chunks) / mib:.1f} MiB"
    ]


def restore_times(counters: list[dict[str, float]]) -> list[str]:
    """Per phase: restores, and ms per restore reading the row and its chunks (``restore``
    less ``unpack``; an older kvwarm does not record it) and joining and unpacking them."""
    out = []
    for phase, c in zip(("run", "after restart"), counters, strict=False):
        n = c.get("latency_unpack_count", 0.0)
        if not n:
            continue
        unpack = 1e3 * c.get("latency_unpack_seconds", 0.0) / n
        load = 1e3 * c.get("latency_load_seconds", 0.0) / max(c.get("latency_load_count", 0), 1)
        whole = c.get("latency_restore_seconds")
        read = "" if whole is None else f", {1e3 * whole / n - unpack:.1f} ms with its chunks"
        out.append(
            f"restores ({phase}): {int(n)}, reading {load:.1f} ms the row file{read}, "
            f"{unpack:.1f} ms joining and unpacking"
        )
    return out


def turn_text(history: str, question: str) -> str:
    return f"{history}<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"


@dataclass
class Tally:
    """One server's phase: its requests' seconds (the first is a cold prefill on both), a line
    per request, and each conversation's history as that server answered it."""

    histories: list[str]
    seconds: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)  # of each request's seconds, decoding
    rows: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.seconds)

    @property
    def floor(self) -> float:
        """The phase's time had every request after the first cost its decode alone (no
        restore, no prefill, nothing else): what no cache can go below."""
        return sum(self.seconds[:1]) + sum(self.decode[1:])

    @property
    def rest(self) -> float:
        """Every request but the first: the follow-ups and later conversations, what a cache
        can change."""
        return sum(self.seconds[1:])


def run_phase(
    servers: list[Server], tallies: list[Tally], turns: int, profile: Path | None = None
) -> None:
    """``turns`` turns of every conversation, the servers taking each request in turn (their
    order alternating request by request), so a drift in this machine's speed falls on both
    alike. With ``profile``, py-spy records kvwarm from the second request to the end."""
    spy = None
    i = 0
    for t in range(turns):
        for c in range(CONVERSATIONS):
            order = list(zip(servers, tallies, strict=True))
            for server, tally in order if i % 2 == 0 else list(reversed(order)):
                if (
                    profile is not None and spy is None and tally.rows
                    and server.name == "kvwarm" and server.proc is not None
                ):  # fmt: skip
                    spy = py_spy(server.proc.pid, profile)
                prompt = turn_text(tally.histories[c], QUESTIONS[(c + t) % len(QUESTIONS)])
                cached, n_prompt, secs = server.complete(prompt)
                tally.histories[c] = prompt + server.last_text + "<end_of_turn>\n"
                tally.seconds.append(secs)
                tally.decode.append(server.last_decode_s)
                tally.rows.append(
                    f"conv {c} turn {t}: cached {cached:5d} / {n_prompt:5d}  {secs * 1e3:7.0f} ms"
                )
            i += 1
    if spy is not None:
        stop(spy)


@dataclass
class Result:
    run: Tally
    after: Tally
    lines: list[str]
    disk: int


def one_round(
    names: list[str], args: argparse.Namespace, system: str, profile: Path | None
) -> dict[str, Result]:
    """Both servers up side by side from empty caches: the run phase, a restart of both,
    then one more turn of every conversation."""
    works = [Path(tempfile.mkdtemp(prefix=f"kvwarm-mt-{name}-")) for name in names]
    servers = [
        Server(
            name,
            args.model,
            args.threads,
            work,
            gpu_layers=args.gpu_layers,
            flash_attn=args.flash_attn,
            tree=args.base_tree if name == "kvwarm-base" else None,
        )
        for name, work in zip(names, works, strict=True)
    ]
    try:
        runs = [Tally([f"<start_of_turn>user\n{system}\n\n"] * CONVERSATIONS) for _ in names]
        for server in servers:
            server.start()
        try:
            run_phase(servers, runs, TURNS, profile)
        finally:
            for server in servers:
                server.stop()
        afters = [Tally(list(run.histories)) for run in runs]
        for server in servers:
            server.start()  # restart: only what the server persisted survives
        try:
            run_phase(servers, afters, 1)
        finally:
            for server in servers:
                server.stop()
        out = {}
        for name, work, run, after in zip(names, works, runs, afters, strict=True):
            files = [f for f in (work / "kvwarm-cache").rglob("*") if f.is_file()]
            disk = sum(f.stat().st_size for f in files)
            n_rows = sum(1 for f in files if f.suffix == ".kvc")
            tail = [f"cache rows: {n_rows}, {disk / max(n_rows, 1) / 2**20:.1f} MiB each"]
            if name.startswith("kvwarm"):
                tail += checkpoint_bytes(work / "kvwarm-cache")
                tail += storage(work / "kvwarm-cache", kv_bytes_per_token(args.model))
                server = next(s for s in servers if s.name == name)
                tail += restore_times(server.counters)
            ran = next(s.ran_flash_attn for s in servers if s.name == name)
            lines = [f"flash attention: {ran}", *run.rows, "-- restart --", *after.rows, *tail]
            out[name] = Result(run, after, lines, disk)
        return out
    finally:
        for work in works:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--servers", default="kvwarm,llama-server")
    ap.add_argument(
        "--base-tree", type=Path, default=None, help="the kvwarm-base server's source tree"
    )
    ap.add_argument("--gpu-layers", type=int, default=0, help="layers offloaded, both servers")
    ap.add_argument(
        "--flash-attn", choices=("auto", "on", "off"), default="auto", help="both servers"
    )
    ap.add_argument(
        "--profile", type=Path, default=None, help="py-spy kvwarm's round-0 run phase into this"
    )
    args = ap.parse_args(argv)
    system = LORE * max(1, args.system_tokens // 34)
    print("command:", shlex.join([sys.executable, *sys.argv]))
    names = args.servers.split(",")
    results: dict[str, list[Result]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else list(reversed(names))
        got = one_round(order, args, system, args.profile if rnd == 0 else None)
        for name in names:
            r = got[name]
            results[name].append(r)
            totals = f"run {r.run.total:.2f} s, after restart {r.after.total:.2f} s"
            print(f"[round {rnd}] {name}: {totals}")
    for name, rs in results.items():
        print(f"\n== {name}")
        for i, r in enumerate(rs):
            print(f"round {i}: run {r.run.total:.2f} s, after restart {r.after.total:.2f} s")
            for line in r.lines:
                print("   ", line)
            if r.disk:
                print(f"    cache on disk: {r.disk / 2**20:.1f} MiB, "
                      f"{r.disk / CONVERSATIONS / 2**20:.1f} MiB per conversation")  # fmt: skip
    if len(names) == 2 and all(results.values()):
        a, b = (results[n] for n in names)
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            print(f"round {i}: {names[0]}/{names[1]} run {x.run.total / y.run.total:.2f}x "
                  f"(all but its cold first request {x.run.rest / y.run.rest:.2f}x), "
                  f"after restart {x.after.total / y.after.total:.2f}x; {names[0]}'s floor "
                  f"(its first request, then decoding alone) {x.run.floor / y.run.total:.2f}x "
                  f"and {x.after.floor / y.after.total:.2f}x")  # fmt: skip
    if args.profile is not None and args.profile.exists():
        print(f"\n== kvwarm's worker thread, round 0 run phase after its first request "
              f"({args.profile}), samples at 250 Hz")  # fmt: skip
        for line in top_frames(args.profile, 25, within="Worker._run"):
            print("  ", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
