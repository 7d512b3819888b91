"""Chat load over kvwarm replicas on a Ray cluster of two nodes: the event-fed router
(``events``) vs the text-prefix one (``prefix``) vs Ray Serve's default (power of two
choices), each with and without a cache directory the nodes share, and once with a replica
killed (SIGKILL) in the middle of the load: the replica that served the turn just answered,
the moment that response ended (its finish save may still be under way: what
``--save-wait-s``, the ``cluster_save_wait_s`` setting, guards; 0 shows the risk).

    python bench/cluster.py                                   # 2 local nodes, stub backend
    python bench/cluster.py --conversations 30 --turns 4 --replicas 3
    python bench/cluster.py --address 10.0.0.5:6379 --backend llama_cpp   # a real cluster

Without ``--address`` it starts two Ray nodes on 127.0.0.1 (`ray start --head` and `ray start
--address`, as ``tests/cluster/test_cluster_nodes.py`` does) and stops them at the end. The
stub backend is paced like a small model (``--decode-delay-s`` per token, ``--prefill-delay-s``
per prefilled token: ``KVWARM_STUB_*_DELAY_S``), so a prefix restored instead of prefilled
shows in the latency.

Load: ``--conversations`` conversations over three system prompts, ``--turns`` turns each,
``--concurrency`` at a time; every fifth conversation streams. Per configuration: follow-ups
served from a cached prefix (``cached_tokens`` at least the previous turn's prompt: a slot,
a tier or the shared directory), follow-ups that stayed on their replica, failed non-streamed
requests, streams cut by an error event, prompt tokens cached, latency p50/p95. Then the
event-fed router's own cost with 100,000 indexed chunks (``routing_index.py``). Goals
(issue 40): >= 99% of follow-ups from a cached prefix, 0 failed non-streamed requests through
the kill, routing <= 1 ms p99.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/cluster/conftest.py: the two local Ray nodes

from kvwarm.cluster import deploy  # noqa: E402
from kvwarm.settings import ModelSpec, Settings  # noqa: E402

SYSTEMS = [
    "You are a terse assistant for a quiz about the natural world. Answer every question in a "
    "few plain words, with no lists, no greetings and no follow-up questions.",
    "You are a patient tutor of elementary arithmetic for children. Show exactly one step of "
    "the working, then the answer, and never more than two short sentences.",
    "You are a travel guide for small coastal towns in the north. Name one place to visit and "
    "one local food, in a single sentence, and mention the season it is best in.",
]
FOLLOW_UPS = ["Tell me more.", "Why is that?", "Give an example.", "Anything surprising?"]


@dataclass
class Turn:
    conv: int
    turn: int
    replica: str
    prompt_tokens: int
    cached_tokens: int
    latency_ms: float
    ok: bool
    streamed: bool


@dataclass
class Run:
    name: str
    turns: list[Turn] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: int = 0
    killer: Killer | None = None


def chat_turn(
    http: httpx.Client, messages: list[dict[str, str]], max_tokens: int, stream: bool
) -> tuple[str | None, Turn]:
    body: dict[str, object] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    response = http.post("/v1/chat/completions", json=body)
    latency = (time.perf_counter() - started) * 1000
    replica = response.headers.get("x-kvwarm-replica", "?")
    failed = Turn(0, 0, replica, 0, 0, latency, False, stream)
    if response.status_code != 200:
        print(f"failed: {response.status_code} {response.text[:300]}", file=sys.stderr, flush=True)
        return None, failed
    if not stream:
        done = response.json()
        usage = done["usage"]
        text = done["choices"][0]["message"]["content"]
    else:
        pieces, usage, error = [], {}, None
        for line in response.text.split("\n"):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            error = event.get("error") or error
            for choice in event.get("choices") or []:
                pieces.append(choice.get("delta", {}).get("content") or "")
            usage = event.get("usage") or usage
        if error is not None:
            print(f"stream cut: {error}", file=sys.stderr, flush=True)
            return None, failed
        text = "".join(pieces)
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return text, Turn(0, 0, replica, usage["prompt_tokens"], cached, latency, True, stream)


def converse(http: httpx.Client, conv: int, args: argparse.Namespace, run: Run) -> None:
    stream = conv % 5 == 0
    messages = [
        {"role": "system", "content": SYSTEMS[conv % len(SYSTEMS)]},
        {"role": "user", "content": f"Conversation {conv}: tell me one thing."},
    ]
    for t in range(args.turns):
        reply, turn = chat_turn(http, messages, args.max_tokens, stream)
        if reply is None and stream:  # a stream cut by its replica's death: ask again
            with run.lock:
                run.turns.append(Turn(conv, t, turn.replica, 0, 0, turn.latency_ms, False, True))
            reply, turn = chat_turn(http, messages, args.max_tokens, stream)
        turn.conv, turn.turn = conv, t
        with run.lock:
            run.turns.append(turn)
            run.done += 1
        if run.killer is not None and turn.ok and t < args.turns - 1:
            run.killer.answered(run, turn)  # a turn with a follow-up to come
        if reply is None:
            return
        messages = [*messages, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]})


def load(base_url: str, args: argparse.Namespace, run: Run) -> float:
    queue = list(range(args.conversations))
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(base_url=base_url, timeout=600) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    conv = queue.pop(0)
                converse(http, conv, args, run)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def report(run: Run, wall_s: float, killed: str | None) -> dict[str, object]:
    answered = [t for t in run.turns if t.ok]
    by_conv: dict[int, dict[int, Turn]] = collections.defaultdict(dict)
    for turn in answered:
        by_conv[turn.conv][turn.turn] = turn
    follow = stayed = from_prefix = 0
    for turns in by_conv.values():
        for t, turn in turns.items():
            before = turns.get(t - 1)
            if t == 0 or before is None:
                continue
            follow += 1
            stayed += turn.replica == before.replica
            from_prefix += turn.cached_tokens >= before.prompt_tokens
    prompt = sum(t.prompt_tokens for t in answered)
    cached = sum(t.cached_tokens for t in answered)
    return {
        "config": run.name,
        "requests": len(run.turns),
        "replicas_used": len({t.replica for t in answered}),
        "follow_ups_from_cached_prefix": f"{from_prefix}/{follow}",
        "from_cached_prefix_pct": round(100 * from_prefix / follow, 1) if follow else 0.0,
        "follow_ups_stayed": f"{stayed}/{follow}",
        "failed_non_streamed": sum(1 for t in run.turns if not t.ok and not t.streamed),
        "streams_cut": sum(1 for t in run.turns if not t.ok and t.streamed),
        "token_hit_rate": round(cached / prompt, 3) if prompt else 0.0,
        "latency_ms_p50": round(pct([t.latency_ms for t in answered], 0.5), 1),
        "latency_ms_p95": round(pct([t.latency_ms for t in answered], 0.95), 1),
        "wall_s": round(wall_s, 1),
        "killed": killed,
    }


def cluster_view(base_url: str) -> dict[str, object]:
    out: dict[str, object] = httpx.get(f"{base_url}/cluster", timeout=10).json()
    return out


class Killer:
    """SIGKILLs, once ``at`` turns are done, the replica that served the turn just answered
    (one its conversation follows up), the moment its response has ended: its finish save
    may still be under way then, which is what a replica dying after answering risks
    (``cluster_save_wait_s``)."""

    def __init__(self, base_url: str, at: int) -> None:
        self.at = at
        self.victim: str | None = None
        self._lock = threading.Lock()
        replicas = cluster_view(base_url)["replicas"]
        assert isinstance(replicas, list)
        self._pids = {r["id"]: r["stats"]["pid"] for r in replicas if r["health"] == "running"}

    def answered(self, run: Run, turn: Turn) -> None:
        with self._lock:
            if self.victim is not None or run.done < self.at or turn.replica not in self._pids:
                return
            self.victim = turn.replica
        os.kill(self._pids[turn.replica], signal.SIGKILL)  # a replica this bench started


def run_config(
    name: str,
    router: str,
    policy: str,
    shared: Path | None,
    args: argparse.Namespace,
    *,
    kill: bool = False,
) -> dict[str, object]:
    settings = Settings(
        host="127.0.0.1",
        port=args.port,
        backend=args.backend,
        models=(ModelSpec(path=args.model or default_model(args.backend), id="m"),),
        n_ctx=args.n_ctx,
        n_parallel=1,
        n_threads=1,
        replicas=args.replicas,
        keepalive_interval_s=0,
        cache_dir=shared,
        cache_dir_shared=shared is not None,
        ram_quota_bytes=256 << 20,
        cluster_routing=policy,
        cluster_save_wait_s=args.save_wait_s,
    )
    if args.backend == "stub":
        from tests.server.conftest import LOW_POLICY  # save rows of a stub's short prompts

        settings = settings.replace(policy=LOW_POLICY)
    deploy.run(settings, router=router)  # type: ignore[arg-type]
    base_url = f"http://127.0.0.1:{args.port}"
    with httpx.Client(base_url=base_url, timeout=10) as http:
        end = time.monotonic() + 300
        while time.monotonic() < end:  # readiness poll, bounded
            try:
                # Ray's default router feeds no index: /cluster lists no replica then.
                if http.get("/health").status_code == 200 and (
                    router == "default"
                    or sum(
                        1
                        for r in http.get("/cluster").json()["replicas"]
                        if r["health"] == "running" and r["stats"].get("pid")
                    )
                    == args.replicas
                ):
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    run = Run(name)
    if kill:
        run.killer = Killer(base_url, args.conversations * args.turns * 2 // 5)
    try:
        wall = load(base_url, args, run)
        view = cluster_view(base_url)
        ingress = view["ingress"]
    finally:
        from ray import serve

        serve.delete(deploy.APP_NAME)
    out = report(run, wall, run.killer.victim if run.killer is not None else None)
    out["retried_by_ingress"] = ingress["retried"] if isinstance(ingress, dict) else None
    out["finish_save_waits"] = durable_waits(view)
    return out


def durable_waits(view: dict[str, object]) -> dict[str, float]:
    """What waiting for each reply's finish row cost, over the live replicas (a killed one's
    counts went with it): replies that waited, those whose row was late, mean and max ms.
    Under Ray's default router /cluster lists no replica (no index is fed): all 0 then."""
    waited = late = 0
    total = top = 0.0
    replicas = view.get("replicas")
    for replica in replicas if isinstance(replicas, list) else []:
        durable = (replica.get("stats") or {}).get("durable") or {}
        waited += int(durable.get("waited", 0))
        late += int(durable.get("late", 0))
        total += float(durable.get("wait_ms_mean", 0.0)) * int(durable.get("waited", 0))
        top = max(top, float(durable.get("wait_ms_max", 0.0)))
    mean = round(total / waited, 2) if waited else 0.0
    return {"waited": waited, "late": late, "wait_ms_mean": mean, "wait_ms_max": top}


def default_model(backend: str) -> str | None:
    return "stub-a" if backend == "stub" else None  # llama_cpp: the embedded SmolLM2


def routing_cost() -> dict[str, object]:
    script = Path(__file__).with_name("routing_index.py")
    out = (
        subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()
    )
    result: dict[str, object] = json.loads(out[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", help="join this Ray cluster (default: two local nodes)")
    parser.add_argument("--backend", default="stub", choices=["stub", "llama_cpp"])
    parser.add_argument(
        "--model", help="the model (default: the stub's stub-a, llama_cpp's embedded one)"
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--decode-delay-s", type=float, default=0.02)
    parser.add_argument("--prefill-delay-s", type=float, default=0.0005)
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    parser.add_argument(
        "--save-wait-s",
        type=float,
        default=5.0,
        help="cluster_save_wait_s: a reply ends once its finish row is in the shared tier "
        "(0: it does not wait, the behaviour before)",
    )
    parser.add_argument("--only", help="comma-separated configuration names")
    args = parser.parse_args()
    print("command: python " + shlex.join(sys.argv), flush=True)
    print(json.dumps({"routing_cost": routing_cost()}), flush=True)
    from tests.cluster.conftest import RayNodes, free_port, join_with_auth

    if not args.port:
        args.port = free_port()
    nodes = None
    temp = Path(tempfile.mkdtemp(prefix="kvb2n-", dir="/tmp"))
    scratch = Path(tempfile.mkdtemp(prefix="kvbench-"))
    try:
        if args.address is None:
            env = {
                "KVWARM_STUB_DECODE_DELAY_S": str(args.decode_delay_s),
                "KVWARM_STUB_PREFILL_DELAY_S": str(args.prefill_delay_s),
            }
            nodes = RayNodes(temp, env)
            nodes.start_head('{"kvwarm_head": 1}')
            nodes.add_node('{"kvwarm_second": 1}')
            join_with_auth(nodes.env["RAY_AUTH_MODE"])
            deploy.start_ray(nodes.address)
            nodes.wait_nodes(2)
        else:
            deploy.start_ray(args.address)
        configs = [
            ("events+shared", "affinity", "events", True, False),
            ("events", "affinity", "events", False, False),
            ("prefix+shared", "affinity", "prefix", True, False),
            ("prefix", "affinity", "prefix", False, False),
            ("default+shared", "default", "events", True, False),
            ("default", "default", "events", False, False),
            ("events+shared+kill", "affinity", "events", True, True),
        ]
        wanted = set(args.only.split(",")) if args.only else None
        for name, router, policy, shared, kill in configs:
            if wanted is not None and name not in wanted:
                continue
            cache = Path(tempfile.mkdtemp(prefix="shared-", dir=scratch)) if shared else None
            print(json.dumps(run_config(name, router, policy, cache, args, kill=kill)), flush=True)
    finally:
        deploy.shutdown(owned=False)
        if nodes is not None:
            nodes.stop()
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
