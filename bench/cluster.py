"""Chat load over kvwarm replicas on a local Ray cluster: prefix-affinity routing vs Ray's
default router (power of two choices), with and without a cache tier the replicas share.

    python bench/cluster.py                          # 2 replicas, 8 conversations x 4 turns
    python bench/cluster.py --conversations 12 --turns 5 --concurrency 4

Keep ``--concurrency`` above ``--replicas``: with exactly one client per replica, Ray's default
router keeps each client on the replica the other client is not using, which looks like
affinity by accident (a first run with 2 and 2 stayed 18/18 under both routers).

Per configuration: follow-ups that stayed on the replica of the turn before, prompt tokens
restored vs prefilled, switched follow-ups that restored (the shared tier's job), TTFT p50/p95
(streamed, first content chunk, as a client sees it). Then the router's own cost per request:
the chain hashing the ingress does and the decision (the ``prefix`` policy) with full warm sets,
timed in-process. Prints its numbers and the command. Goals (issue 10): follow-ups stay >= 99%,
switched follow-ups restore, routing adds < 5 ms.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvwarm.cluster import deploy
from kvwarm.cluster.chains import chat_chain
from kvwarm.cluster.routing import (
    AffinityTable,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    build_policy,
)
from kvwarm.settings import Settings

SYSTEM = {"role": "system", "content": "You are a concise assistant. Reply in one sentence."}
TOPICS = ["rivers", "planets", "bread", "bridges", "volcanoes", "violins", "glaciers", "owls"]
FOLLOW_UPS = ["Tell me more.", "Why is that?", "Give an example.", "Anything surprising?"]


@dataclass
class Turn:
    conv: int
    turn: int
    replica: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float


@dataclass
class Run:
    name: str
    turns: list[Turn] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def chat_turn(
    http: httpx.Client, messages: list[dict[str, str]], max_tokens: int
) -> tuple[str, Turn]:
    body = {
        "messages": messages,  # no model: the first (only) one
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict[str, object] = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        replica = response.headers.get("x-kvwarm-replica", "?")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else (time.perf_counter() - started) * 1000
                    text.append(piece)
            if event.get("usage"):
                usage = event["usage"]
    details = usage.get("prompt_tokens_details") or {}
    assert isinstance(details, dict)
    turn = Turn(
        0,
        0,
        replica,
        int(usage.get("prompt_tokens", 0)),  # type: ignore[call-overload]
        int(details.get("cached_tokens", 0)),
        ttft if ttft is not None else (time.perf_counter() - started) * 1000,
    )
    return "".join(text), turn


def converse(http: httpx.Client, conv: int, turns: int, max_tokens: int, run: Run) -> None:
    messages = [SYSTEM, {"role": "user", "content": f"Tell me one fact about {TOPICS[conv % 8]}."}]
    for t in range(turns):
        reply, turn = chat_turn(http, messages, max_tokens)
        turn.conv, turn.turn = conv, t
        with run.lock:
            run.turns.append(turn)
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
                converse(http, conv, args.turns, args.max_tokens, run)

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


def report(run: Run, wall_s: float) -> dict[str, object]:
    by_conv: dict[int, list[Turn]] = {}
    for turn in sorted(run.turns, key=lambda t: (t.conv, t.turn)):
        by_conv.setdefault(turn.conv, []).append(turn)
    stayed = switched = switched_restored = 0
    for turns in by_conv.values():
        for before, after in itertools.pairwise(turns):
            if after.replica == before.replica:
                stayed += 1
            else:
                switched += 1
                switched_restored += after.cached_tokens > 0
    follow = [t for t in run.turns if t.turn > 0]
    prompt = sum(t.prompt_tokens for t in run.turns)
    cached = sum(t.cached_tokens for t in run.turns)
    return {
        "config": run.name,
        "requests": len(run.turns),
        "replicas_used": len({t.replica for t in run.turns}),
        "follow_ups_stayed": f"{stayed}/{stayed + switched}",
        "switched_that_restored": f"{switched_restored}/{switched}",
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_tokens": prompt - cached,
        "token_hit_rate": round(cached / prompt, 3) if prompt else 0.0,
        "ttft_ms_p50": round(pct([t.ttft_ms for t in run.turns], 0.5), 1),
        "ttft_ms_p95": round(pct([t.ttft_ms for t in run.turns], 0.95), 1),
        "follow_up_ttft_ms_p50": round(pct([t.ttft_ms for t in follow], 0.5), 1),
        "wall_s": round(wall_s, 1),
    }


def run_config(
    name: str, router: str, shared: Path | None, args: argparse.Namespace
) -> dict[str, object]:
    settings = Settings(
        host="127.0.0.1",
        port=args.port,
        n_ctx=args.n_ctx,
        n_parallel=1,
        n_threads=1,
        replicas=args.replicas,
        keepalive_interval_s=0,
        cache_dir=shared,
        cache_dir_shared=shared is not None,
        ram_quota_bytes=256 << 20,
    )
    deploy.run(settings, router=router)  # type: ignore[arg-type]
    base_url = f"http://127.0.0.1:{args.port}"
    with httpx.Client(base_url=base_url, timeout=10) as http:
        end = time.monotonic() + 300
        while time.monotonic() < end:  # readiness poll, bounded
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    run = Run(name)
    try:
        wall = load(base_url, args, run)
    finally:
        from ray import serve

        serve.delete(deploy.APP_NAME)
    return report(run, wall)


def router_cost(n_replicas: int, warm: int, messages: int, rounds: int = 2000) -> dict[str, float]:
    """What the affinity router adds per request, in-process: the ingress's chain hashing and
    the decision over ``n_replicas`` full warm sets (Ray's own routing work is the same for
    both routers)."""
    convo = [SYSTEM] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 40}
        for i in range(messages)
    ]
    started = time.perf_counter()
    for _ in range(rounds):
        chain = chat_chain("default", convo)
    hash_us = (time.perf_counter() - started) / rounds * 1e6
    views = [
        ReplicaView(f"r{i}", in_flight=i % 2, warm=frozenset(f"{i}-{j}" for j in range(warm)))
        for i in range(n_replicas)
    ]
    views[0] = ReplicaView("r0", warm=views[0].warm | set(chain[:-2]))
    table = AffinityTable()
    policy = build_policy(RoutingConfig())
    started = time.perf_counter()
    for _ in range(rounds):
        routed = table.warm_of(chain)
        decision = policy.rank(RouteRequest(chain), views)
        table.record(chain, decision.groups[0][0])
    assert routed is not None
    rank_us = (time.perf_counter() - started) / rounds * 1e6
    return {"chain_hash_us": round(hash_us, 1), "decision_us": round(rank_us, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/cluster"))
    args = parser.parse_args()
    print("command: python " + shlex.join(sys.argv), flush=True)
    print(json.dumps(router_cost(args.replicas, 4096, 12)), flush=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir=args.scratch))
    deploy.start_ray(None, temp_dir=temp, num_cpus=2)
    try:
        for name, router, shared in (
            ("affinity+shared", "affinity", True),
            ("affinity", "affinity", False),
            ("default+shared", "default", True),
            ("default", "default", False),
        ):
            cache = Path(tempfile.mkdtemp(prefix="shared-", dir=args.scratch)) if shared else None
            try:
                print(json.dumps(run_config(name, router, cache, args)), flush=True)
            finally:
                if cache is not None:
                    shutil.rmtree(cache, ignore_errors=True)
    finally:
        deploy.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()
