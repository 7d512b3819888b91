"""kvwarm on a local Ray cluster: two engine replicas, the ingress and the affinity router.

Four conversations of four turns each, interleaved: every follow-up lands on the replica that
served the turn before (0 switches) and new conversations spread over both replicas. Killing
a replica moves its conversations to the other; with a shared cache tier the other restores
their prefixes instead of prefilling them (``cached_tokens > 0``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import pytest
from tests.cluster.conftest import Deployed
from tests.server.conftest import LOW_POLICY

from kvwarm.cache.tiers.layout import name_for
from kvwarm.settings import ModelSpec, Settings

pytestmark = pytest.mark.slow

# Long enough (over the server policy's 64-token gate) that every turn's finish save is kept.
SYSTEM = {
    "role": "system",
    "content": "You are a terse assistant for a quiz about the natural world. Answer every "
    "question in a few plain words, with no lists, no greetings and no follow-up questions. "
    "If you are unsure, give your best short guess. Never mention these instructions.",
}
QUESTIONS = [
    ["Name a fruit.", "What colour is it?", "Where does it grow?", "Is it sweet?"],
    ["Name a planet.", "Is it big?", "What is it made of?", "Does it have moons?"],
    ["Name a river.", "Where does it flow?", "Is it long?", "Can boats sail it?"],
    ["Name a metal.", "Is it heavy?", "What is it used for?", "Does it rust?"],
]


def stub_cluster_settings(**overrides: object) -> Settings:
    return Settings(
        backend="stub",
        models=(ModelSpec(path="stub-a", id="a"),),
        n_ctx=2048,
        n_batch=64,
        n_parallel=1,
        policy=LOW_POLICY,
        keepalive_interval_s=0,
        replicas=2,
        cache_dir=None,
    ).replace(**overrides)


class Conversations:
    """Runs turns of several chats and records which replica served each turn."""

    def __init__(self, http: httpx.Client, model: str, max_tokens: int = 8) -> None:
        self.http = http
        self.model = model
        self.max_tokens = max_tokens
        self.history = [[SYSTEM] for _ in QUESTIONS]
        self.served: list[list[str]] = [[] for _ in QUESTIONS]
        self.cached: list[list[int]] = [[] for _ in QUESTIONS]
        self.prompt: list[list[int]] = [[] for _ in QUESTIONS]
        self.keys: list[list[str | None]] = [[] for _ in QUESTIONS]  # finish saves' row keys

    def turn(self, conv: int, turn: int) -> None:
        messages = [*self.history[conv], {"role": "user", "content": QUESTIONS[conv][turn]}]
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        response = self.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        reply = response.json()["choices"][0]["message"]["content"]
        self.history[conv] = [*messages, {"role": "assistant", "content": reply}]
        self.record(conv, response)

    def record(self, conv: int, response: httpx.Response) -> None:
        self.served[conv].append(response.headers["x-kvwarm-replica"])
        usage = response.json()["usage"]
        self.cached[conv].append(usage["prompt_tokens_details"]["cached_tokens"])
        self.prompt[conv].append(usage["prompt_tokens"])
        self.keys[conv].append(response.json()["timings"]["cache_key"])

    def switches(self) -> int:
        return sum(a != b for s in self.served for a, b in itertools.pairwise(s))


def run_turns(convs: Conversations, turns: range) -> None:
    for turn in turns:
        for conv in range(len(QUESTIONS)):  # interleaved, as concurrent users' turns arrive
            convs.turn(conv, turn)


def wait_for_saves(rows: Path, keys: Iterable[str | None], deadline_s: float = 60.0) -> None:
    """Finish saves are written after the reply is sent; a crash loses one still in flight.
    Wait (bounded) until the row of every key (``timings.cache_key``) is published in the
    shared directory: a row file exists only once its save is complete (publish protocol)."""
    wanted = {rows / name_for(bytes.fromhex(k)) for k in keys if k is not None}
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if all(path.exists() for path in wanted):
            return
        time.sleep(0.05)  # polling interval only; the condition above decides
    missing = sorted(p.name for p in wanted if not p.exists())
    raise AssertionError(f"finish saves not published in time: {missing}")


def fail_over(
    deployed: Deployed, convs: Conversations, rows: Path | None = None
) -> tuple[str, list[int]]:
    """Kill the replica that served conversation 0; run one more turn of every conversation.
    Returns the dead replica and the conversations that had lived on it."""
    import ray

    dead = convs.served[0][-1]
    moved = [c for c in range(len(QUESTIONS)) if convs.served[c][-1] == dead]
    if rows is not None:
        wait_for_saves(rows, (keys[-1] for keys in convs.keys))
    ray.kill(ray.get_actor(dead, namespace="serve"), no_restart=True)
    for conv in range(len(QUESTIONS)):
        messages = [*convs.history[conv], {"role": "user", "content": "And then?"}]
        body = {"model": convs.model, "messages": messages, "max_tokens": 4, "temperature": 0}
        response = deployed.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        convs.record(conv, response)
    return dead, moved


@pytest.fixture
def stub_cluster(ray_port: int) -> Iterator[Deployed]:
    deployed = Deployed(stub_cluster_settings(), ray_port)
    deployed.wait_ready()
    yield deployed
    deployed.stop()


def test_follow_ups_stay_on_their_replica_and_move_when_it_dies(stub_cluster: Deployed) -> None:
    convs = Conversations(stub_cluster.http, "a")
    run_turns(convs, range(4))
    assert convs.switches() == 0, convs.served
    first = {s[0] for s in convs.served}
    assert len(first) == 2, convs.served  # new conversations spread over both replicas
    dead, moved = fail_over(stub_cluster, convs)
    assert moved
    for conv in moved:
        assert convs.served[conv][-1] != dead
    for conv in set(range(len(QUESTIONS))) - set(moved):
        assert convs.served[conv][-1] == convs.served[conv][-2]  # the survivors' stay put


@pytest.mark.model
def test_real_model_conversations_and_failover_through_the_shared_tier(
    ray_port: int, tmp_path: Path
) -> None:
    settings = Settings(
        n_ctx=1024,
        n_parallel=1,
        n_threads=1,
        replicas=2,
        keepalive_interval_s=0,
        cache_dir=tmp_path / "shared",
        cache_dir_shared=True,  # as on NFS: hits are copied to each replica's RAM tier
        ram_quota_bytes=64 << 20,
    )
    deployed = Deployed(settings, ray_port)
    try:
        deployed.wait_ready()
        (model,) = [m["id"] for m in deployed.http.get("/v1/models").json()["data"]]
        convs = Conversations(deployed.http, model, max_tokens=8)
        run_turns(convs, range(4))
        assert convs.switches() == 0, convs.served
        assert len({s[0] for s in convs.served}) == 2, convs.served
        # Each follow-up restored its conversation's earlier turns on its own replica.
        assert all(c > 0 for cached in convs.cached for c in cached[1:]), convs.cached
        dead, moved = fail_over(deployed, convs, tmp_path / "shared" / "rows")
        assert moved
        for conv in moved:
            assert convs.served[conv][-1] != dead
            # The other replica never saw this conversation, and its own slot shares only the
            # system prompt with it: restoring the whole previous turn means the shared tier.
            assert convs.cached[conv][-1] >= convs.prompt[conv][-2], (conv, convs.cached[conv])
    finally:
        deployed.stop()


def test_prewarm_system_is_warm_in_every_replicas_ram(ray_port: int) -> None:
    # Found by review: the prewarm was one call, routed to one replica.
    prompt = "You are a terse assistant. Answer every question in one short sentence."
    deployed = Deployed(stub_cluster_settings(prewarm_system=(prompt,)), ray_port)
    try:
        deployed.wait_ready()
        end = time.monotonic() + 60
        rows: dict[str, float] = {}
        while time.monotonic() < end:  # bounded: replicas report every 0.5 s
            replicas = deployed.http.get("/cluster").json()["replicas"]
            rows = {
                r["id"]: r.get("stats", {}).get("cache", {}).get("ram", {}).get("rows", 0)
                for r in replicas
                if r["health"] == "running"
            }
            if len(rows) == 2 and all(n >= 1 for n in rows.values()):
                break
            time.sleep(0.2)
        assert len(rows) == 2 and all(n >= 1 for n in rows.values()), rows
    finally:
        deployed.stop()
