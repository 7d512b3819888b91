"""Conversations about pictures, kvwarm vs llama-server ``--mmproj`` (the peer built from the
same pinned llama.cpp by ``bench/peer.py``), side by side in one run, same files, same threads.

    python bench/media.py [--model PATH.gguf] [--system-tokens 400] [--threads 2] [--rounds 1]

The load (issue 36): three conversations of four turns, each about one picture (the first and
the third show the same picture, the second another), over one system prompt; then both
servers restart and every conversation takes one more turn. The picture comes first in each
conversation's first message, so the third conversation can reuse the first one's KV of it.
The projector is the tiny random-weight one ``tests/tinymodels.py`` writes (16 positions per
picture), so what is measured is the cache, not a vision tower. Both servers get the same
OpenAI chat requests; they take each request in turn (the order alternating request by
request), so a drift in the machine's speed falls on both alike. kvwarm runs with a disk tier
(it survives the restart); llama-server with its defaults (its slot and RAM prompt cache).

Each server, once started (before and after the restart), first answers one warm-up request
that shares nothing with the measured ones (another picture, no system prompt): model load,
weights paged in, buffers allocated and the projector's first encode are no measured request's.

Prints every request's cached / prompt tokens, its wall time, the server's own timings (to the
first token; the reply's tokens) and what the scheduler says of it (``/proc/PID/task/*/
schedstat``): how long the server's threads ran, how long they waited, runnable, for a CPU,
and how long the other, idle server ran meanwhile. Then the goals: every follow-up and every
after-restart request of kvwarm restores through its picture's span; the third
conversation's first request reuses the first one's picture; kvwarm's after-restart time
against llama-server's (goal <= 0.5x); and the bytes one picture's span costs in kvwarm's
cache. Run it alone: on 2 cores a request whose threads waited for a CPU (the ``waited``
column) ran many times slower than alone (llama.cpp's threads wait for each other at every
step of a forward pass); the load average and the busiest other processes are printed with
the results.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvwarm import Engine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from multiturn import LORE, free_port, post, stop_server, wait_ready  # noqa: E402
from peer import llama_server  # noqa: E402

CONVERSATIONS = 3
TURNS = 4
REPLY_TOKENS = 16
PICTURE_OF = (1, 2, 1)  # the seed of each conversation's picture: the first and third alike
WARM_UP_PICTURE = 3
QUESTIONS = [
    "What is in this picture?",
    "Which colours stand out?",
    "What could it be used for?",
    "Describe its left half.",
    "Give it a title.",
]


@dataclass
class Server:
    name: str
    model: Path
    mmproj: Path
    threads: int
    work: Path
    template: Path | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        if self.name == "kvwarm":
            cmd = [
                sys.executable, "-m", "kvwarm", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--model", f"m={self.model}", "--mmproj",
                str(self.mmproj), "--n-ctx", "4096", "--n-parallel", "1",
                "--n-threads", str(self.threads), "--n-threads-batch", str(self.threads),
                "--cache-dir", str(self.work / "kvwarm-cache"), "--flash-attn", "on",
                "--max-body-bytes", "4M",
            ]  # fmt: skip
            return cmd + (["--chat-template", str(self.template)] if self.template else [])
        cmd = [
            str(llama_server()), "--host", "127.0.0.1", "--port", str(self.port),
            "-m", str(self.model), "--mmproj", str(self.mmproj), "-c", "4096", "-np", "1",
            "-t", str(self.threads), "-tb", str(self.threads), "-fa", "on", "--jinja",
            "--no-webui",
        ]  # fmt: skip
        return cmd + (["--chat-template-file", str(self.template)] if self.template else [])

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None

    def sched_s(self) -> tuple[float, float]:
        """Seconds the server's threads (all of them, together) have run on a CPU, and have
        waited, runnable, for one (Linux's ``/proc/PID/task/*/schedstat``; 0, 0 elsewhere).
        A request that waited long was starved by the machine's other load."""
        ran = waited = 0
        if self.proc is not None:
            for task in Path(f"/proc/{self.proc.pid}/task").glob("*/schedstat"):
                try:
                    on_cpu, queued, _ = task.read_text().split()
                except (OSError, ValueError):
                    continue  # a thread that ended meanwhile
                ran, waited = ran + int(on_cpu), waited + int(queued)
        return ran / 1e9, waited / 1e9

    def chat(self, messages: list[dict[str, object]], max_tokens: int = REPLY_TOKENS) -> Reply:
        """One greedy chat turn, timed by the client and by the server's own ``timings``."""
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        t0 = time.perf_counter()
        out = post(f"http://127.0.0.1:{self.port}/v1/chat/completions", body)
        secs = time.perf_counter() - t0
        usage = out["usage"]
        timings = out.get("timings") or {}
        assert isinstance(usage, dict) and isinstance(timings, dict)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        if self.name == "kvwarm":  # queue, restore and prefill; decode
            prefill_ms = float(timings["queue_ms"]) + float(timings["prefill_ms"])
            decode_ms = float(timings["generation_ms"])
        else:
            prefill_ms, decode_ms = float(timings["prompt_ms"]), float(timings["predicted_ms"])
        reply = str(out["choices"][0]["message"]["content"] or "")  # type: ignore[index]
        return Reply(cached, int(usage["prompt_tokens"]), secs, prefill_ms / 1e3,
                     decode_ms / 1e3, reply)  # fmt: skip


@dataclass(frozen=True)
class Reply:
    cached: int  # prompt tokens the server reused
    prompt: int  # prompt tokens
    seconds: float  # the client's wall time
    prefill_s: float  # by the server's timings: to the first token (kvwarm's includes queueing)
    decode_s: float  # by the server's timings: the reply's tokens
    text: str


@dataclass(frozen=True)
class Sched:
    """What the scheduler says of one request (``Server.sched_s``)."""

    ran_s: float  # the server's threads on a CPU
    waited_s: float  # the server's threads runnable but waiting for a CPU: the machine's load
    peer_ran_s: float  # the other, idle server's threads on a CPU meanwhile


@dataclass
class Request:
    conversation: int
    turn: int  # TURNS: the turn after the restart
    reply: Reply
    sched: Sched

    @property
    def seconds(self) -> float:
        return self.reply.seconds


def warm_up(server: Server) -> float:
    """One request that shares nothing with the measured ones (another picture, no system
    prompt), so neither server's first-use costs (weights paged in, buffers allocated, the
    projector's first encode) land in a measured request. Its seconds."""
    t0 = time.perf_counter()
    server.chat([first_message(WARM_UP_PICTURE, "Hello.")], max_tokens=2)
    return time.perf_counter() - t0


def first_message(seed: int, question: str) -> dict[str, object]:
    from tests.media_reference import picture

    uri = "data:image/png;base64," + base64.b64encode(picture(seed)).decode()
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": uri}},
            {"type": "text", "text": question},
        ],
    }


def span_ends(model: Path, mmproj: Path, system: str, template: Path | None) -> list[int]:
    """Where each conversation's picture ends in its prompt (kvwarm's own layout)."""
    engine = ram_engine()
    m = engine.load_model(
        str(model),
        n_ctx=4096,
        mmproj=str(mmproj),
        chat_template=None if template is None else str(template),
    )
    try:
        ends = []
        for c in range(CONVERSATIONS):
            msgs = [{"role": "system", "content": system}, first_message(PICTURE_OF[c], "x")]
            prompt, _ = m.chat_prompt(msgs)
            ends.append(prompt.prompt.spans[0].end)
        return ends
    finally:
        engine.close()


def ram_engine() -> Engine:
    """An engine of a small RAM tier alone: nothing of the bench is written elsewhere."""
    from kvwarm import CacheConfig, Engine, TierConfig
    from kvwarm.engine.api import EngineConfig

    return Engine(EngineConfig(cache=CacheConfig(tiers=(TierConfig("ram", 1 << 20),))))


def run(
    servers: list[Server], histories: dict[str, list[list[dict[str, object]]]], turns: range
) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = {s.name: [] for s in servers}
    i = 0
    for t in turns:
        for c in range(CONVERSATIONS):
            order = servers if i % 2 == 0 else list(reversed(servers))
            for server in order:
                history = histories[server.name][c]
                question = QUESTIONS[(c + t) % len(QUESTIONS)]
                message = (
                    first_message(PICTURE_OF[c], question)
                    if t == 0
                    else {"role": "user", "content": question}
                )
                history.append(message)
                (peer,) = (s for s in servers if s is not server)
                ran0, waited0 = server.sched_s()
                peer0 = peer.sched_s()[0]
                reply = server.chat(history)
                ran1, waited1 = server.sched_s()
                sched = Sched(ran1 - ran0, waited1 - waited0, peer.sched_s()[0] - peer0)
                history.append({"role": "assistant", "content": reply.text})
                out[server.name].append(Request(c, t, reply, sched))
            i += 1
    return out


def cache_bytes_per_token(cache_dir: Path) -> float:
    """kvwarm's rows: logical bytes (what a restore reads) per token they hold."""
    out = subprocess.run(
        [sys.executable, "-m", "kvwarm", "cache", "ls", "--json", "--cache-dir", str(cache_dir)],
        capture_output=True, check=True, text=True,
    )  # fmt: skip
    rows = json.loads(out.stdout)
    tokens = sum(int(r["n_tokens"]) for r in rows)
    return sum(int(r["bytes"]) for r in rows) / max(tokens, 1)


def what_else_ran() -> list[str]:
    """The load average and the busiest processes not started by this run."""
    lines = [f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    ps = subprocess.run(
        ["ps", "-eo", "pcpu,etimes,args", "--sort=-pcpu"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    own = str(os.getpid())
    for line in ps.stdout.splitlines()[1:8]:
        if own not in line:
            lines.append("  " + line[:140])
    return lines


def one_round(
    args: argparse.Namespace, model: Path, mmproj: Path, system: str, ends: list[int], work: Path
) -> float:
    """Both servers through the whole load once, in their own directories under ``work``;
    what it measured printed; kvwarm's after-restart time over llama-server's (wall)."""
    servers = []
    for name in ("kvwarm", "llama-server"):
        (work / name).mkdir()
        servers.append(Server(name, model, mmproj, args.threads, work / name, args.template))
    histories = {s.name: [[{"role": "system", "content": system}] for _ in range(3)]
                 for s in servers}  # fmt: skip
    warm: dict[str, list[float]] = {s.name: [] for s in servers}
    for s in servers:
        s.start()
        warm[s.name].append(warm_up(s))
    try:
        before = run(servers, histories, range(TURNS))
    finally:
        for s in servers:
            s.stop()
    for s in servers:
        s.start()  # only what each server persisted survives
        warm[s.name].append(warm_up(s))
    try:
        after = run(servers, histories, range(TURNS, TURNS + 1))
    finally:
        for s in servers:
            s.stop()
    for name in before:
        print(f"\n== {name} (warm-ups, not counted: "
              f"{', '.join(f'{w * 1e3:.0f} ms' for w in warm[name])})")  # fmt: skip
        print("                          cached / prompt    wall  prefill   decode     ran"
              "  waited  peer ran")  # fmt: skip
        for r in before[name] + after[name]:
            label = "after restart" if r.turn == TURNS else f"turn {r.turn}"
            x = r.reply
            print(f"conv {r.conversation} {label:13s}: {x.cached:5d} / {x.prompt:5d}  "
                  f"{x.seconds * 1e3:6.0f}  {x.prefill_s * 1e3:7.0f}  {x.decode_s * 1e3:7.0f}"
                  f"  {r.sched.ran_s * 1e3:6.0f}  {r.sched.waited_s * 1e3:6.0f}"
                  f"  {r.sched.peer_ran_s * 1e3:8.0f}  ms (picture ends at "
                  f"{ends[r.conversation]})")  # fmt: skip
    k_before, k_after = before["kvwarm"], after["kvwarm"]
    follow = [r for r in k_before if r.turn > 0] + k_after
    through = [r.reply.cached >= ends[r.conversation] for r in follow]
    shared = next(r for r in k_before if r.conversation == 2 and r.turn == 0)
    ratio = sum(r.seconds for r in k_after) / sum(r.seconds for r in after["llama-server"])
    served = sum(r.reply.prefill_s + r.reply.decode_s for r in k_after) / sum(
        r.reply.prefill_s + r.reply.decode_s for r in after["llama-server"]
    )
    per_token = cache_bytes_per_token(servers[0].work / "kvwarm-cache")
    print("\n== goals")
    print(f"kvwarm follow-ups and after-restart turns restoring through their picture: "
          f"{sum(through)}/{len(through)}")  # fmt: skip
    print(f"third conversation (the first's picture) reused it: cached {shared.reply.cached} "
          f">= {ends[2]}: {shared.reply.cached >= ends[2]}")  # fmt: skip
    print(f"after the restart, kvwarm/llama-server: {ratio:.2f}x by wall time, {served:.2f}x "
          "by the servers' own timings (goal <= 0.5x)")  # fmt: skip
    print(f"one picture's span (16 positions) in kvwarm's cache: {per_token * 16 / 1024:.0f} "
          f"KiB ({per_token / 1024:.1f} KiB per position)")  # fmt: skip
    for name in ("kvwarm", "llama-server"):
        for phase, rs in (("run", before[name]), ("after restart", after[name])):
            print(f"{name} {phase}: {sum(r.seconds for r in rs):.2f} s, of which its threads "
                  f"waited for a CPU {sum(r.sched.waited_s for r in rs):.2f} s "
                  "(the machine's other load)")  # fmt: skip
    print("\n== what else was running")
    for line in what_else_ran():
        print(line)
    return ratio


def main(argv: list[str] | None = None) -> int:
    from tests.tinymodels import write_tiny_projector

    from kvwarm.embedded import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--width", type=int, default=0, help="the model's n_embd (default: read it)")
    ap.add_argument("--template", type=Path, default=None, help="a Jinja chat template, both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=1, help="the whole load this many times")
    args = ap.parse_args(argv)
    model = args.model or default_model_path()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    system = LORE * max(1, args.system_tokens // 34)
    work = Path(tempfile.mkdtemp(prefix="kvwarm-media-"))
    try:
        width = args.width
        if not width:
            probe = ram_engine()
            width = probe.load_model(str(model), n_ctx=256).info().n_embd
            probe.close()
        mmproj = write_tiny_projector(work / "mmproj.gguf", width)
        ends = span_ends(model, mmproj, system, args.template)
        ratios = []
        for n in range(args.rounds):
            if args.rounds > 1:
                print(f"\n######## round {n + 1} of {args.rounds}")
            (work / str(n)).mkdir()
            ratios.append(one_round(args, model, mmproj, system, ends, work / str(n)))
        if args.rounds > 1:
            print(f"\nafter the restart, kvwarm/llama-server by round: "
                  f"{', '.join(f'{r:.2f}x' for r in ratios)}; median "
                  f"{statistics.median(ratios):.2f}x (goal <= 0.5x)")  # fmt: skip
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
