"""What the event-fed router costs per request with a full index, in-process (no Ray).

    python bench/routing_index.py                      # 3 replicas on 2 nodes, 100,000 chunks
    python bench/routing_index.py --chunks 400000 --requests 50000

Builds the cluster's index (``routing/index.py``) as replicas' cache events would: rows of
``--chunks-per-row`` chunks in each replica's RAM tier, in its node's disk tier and in a tier
all replicas share, each linked to a conversation's chain, until ``--chunks`` chunk
references are indexed; then routes ``--requests`` requests (follow-ups of those
conversations, one in three a new conversation over one of three system prompts) through
``reach`` and the ``events`` policy's ``rank``, and the ingress's ``note_served`` after each.
Rows' chunk keys are the cache's own for their tokens (a system prompt's chunk, then the
conversation's), and every request carries its prompt's tokens, so ``reach`` walks the
prompt's chunk keys in every store too (``--no-tokens``: rows and chains only, as before).
Prints the p50/p99/max of one decision (reach + rank), wall clock and this thread's CPU time
(the cost without the waits a busy host's scheduler adds), and of applying one report of
events.
Goal (issue 40): routing <= 1 ms p99 with 100,000 indexed chunks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shlex
import sys
import time

from kvwarm.cache.formats.chunkfmt import chunk_keys
from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.types import Namespace, RowInfo, SaveReason, TtlClass
from kvwarm.cluster.eventlog import EventLog
from kvwarm.cluster.routing import (
    ClusterIndex,
    ReplicaView,
    RouteRequest,
    RoutingConfig,
    build_policy,
)
from kvwarm.cluster.routing.facts import Scope, Source

NS = Namespace(b"f" * 32, 1, b"c" * 32)
PLACES: dict[str, tuple[Scope, Source]] = {
    "ram": ("replica", "memory"),
    "disk": ("node", "local"),
    "s3": ("cluster", "remote"),
}


def digest(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def chain_of(conv: int, turns: int) -> tuple[str, ...]:
    return tuple(digest("chain", conv, i).hex()[:24] for i in range(turns))


CHUNK = 256


def tokens_of(conv: int, n: int) -> tuple[int, ...]:
    """Conversation ``conv``'s first ``n`` tokens: its system prompt's chunk (one of three),
    then its own."""
    return tuple(range(conv % 3 * CHUNK, conv % 3 * CHUNK + CHUNK)) + tuple(
        (conv * 7919 + i) % 50_000 + 1000 for i in range(n - CHUNK)
    )


def row(conv: int, turn: int, tier: str, per_row: int) -> StoredRow:
    key = digest("row", conv, turn)
    n = CHUNK * per_row
    info = RowInfo(key, tier, 4096, n, 0, 0.0, 0.0, SaveReason.FINISH, TtlClass.SHORT, False, NS)
    # A conversation's rows share their leading chunks, as real ones do.
    lens = (CHUNK,) * per_row
    return StoredRow(info, (), None, chunk_keys(NS, tokens_of(conv, n), lens), lens)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--chunks-per-row", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8, help="chain units of a follow-up")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-tokens", action="store_true", help="requests carry no tokens")
    args = parser.parse_args()
    print("command: python " + shlex.join(sys.argv), flush=True)
    rng = random.Random(args.seed)
    replicas = {f"r{i}": f"node{i % args.nodes}" for i in range(args.replicas)}
    logs = {r: EventLog(PLACES, slots=4, capacity=1 << 20, max_events=1 << 20) for r in replicas}
    index = ClusterIndex()
    tiers = list(PLACES)
    conv = 0
    while index.sizes()["chunks"] < args.chunks:
        rid = rng.choice(list(replicas))
        stored = row(conv, 0, rng.choice(tiers), args.chunks_per_row)
        logs[rid].row_stored(stored)
        logs[rid].served(chain_of(conv, args.turns - 2), stored.info.key, stored.info.n_tokens)
        conv += 1
        if conv % 500 == 0:
            for r, log in logs.items():
                index.observe(r, replicas[r], {"events": log.report()})
    for r, log in logs.items():
        index.observe(r, replicas[r], {"events": log.report()})
    sizes = index.sizes()
    policy = build_policy(RoutingConfig(policy="events", busy_requests=8))
    decide: list[float] = []
    decide_cpu: list[float] = []  # this thread's CPU time: the cost without preemption
    for i in range(args.requests):
        new = rng.random() < 1 / 3
        c = conv + i if new else rng.randrange(conv)
        chain = chain_of(c, args.turns)
        parent = None if new else digest("row", c, 0)
        prompt = () if args.no_tokens else tokens_of(c, CHUNK * args.chunks_per_row + 64)
        started, cpu = time.perf_counter(), time.thread_time()
        reach = index.reach(chain, parent, replicas, tokens=prompt, namespace=NS)
        views = [
            ReplicaView(r, in_flight=rng.randrange(3), reach=reach.get(r, {}), slots=4)
            for r in replicas
        ]
        decision = policy.rank(RouteRequest(chain, "m", parent, prompt, NS), views)
        decide.append((time.perf_counter() - started) * 1e6)
        decide_cpu.append((time.thread_time() - cpu) * 1e6)
        index.note_served(decision.groups[0][0], chain, digest("row", c, 1), 4000)
    # Applying reports: 200 events (a busy replica's half second) each.
    apply: list[float] = []
    for n in range(50):
        rid = rng.choice(list(replicas))
        for k in range(200):
            logs[rid].row_stored(row(10_000_000 + n * 200 + k, 0, "ram", args.chunks_per_row))
        report = {"events": logs[rid].report()}
        started = time.perf_counter()
        index.observe(rid, replicas[rid], report)
        apply.append((time.perf_counter() - started) * 1e3)
    print(
        json.dumps(
            {
                "index": sizes,
                "decision_us": {
                    "p50": round(pct(decide, 0.5), 1),
                    "p99": round(pct(decide, 0.99), 1),
                    "max": round(max(decide), 1),
                },
                "decision_cpu_us": {
                    "p50": round(pct(decide_cpu, 0.5), 1),
                    "p99": round(pct(decide_cpu, 0.99), 1),
                    "max": round(max(decide_cpu), 1),
                },
                "report_of_200_events_ms": {
                    "p50": round(pct(apply, 0.5), 2),
                    "p99": round(pct(apply, 0.99), 2),
                },
                "goal_p99_us": 1000,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
