"""kvwarm joined to a Ray cluster of two nodes started apart from it (``two_nodes``: `ray start
--head` and `ray start --address`, both on 127.0.0.1), three engine replicas spread over
them on the stub backend (paced like a small model: ``KVWARM_STUB_DECODE_DELAY_S``), a cache
directory both nodes mount (``cache_dir_shared``), the event-fed router.

Chat load over three system prompts; one replica killed with SIGKILL while requests run on
it: every non-streamed request is answered (sent again elsewhere), a stream that was running
ends with an error event, every follow-up of the dead replica's conversations restores its
previous prompt from the shared directory on another replica, and Serve's new replica joins
the index. A request that had started on a replica killed under it is sent again by the
ingress itself (its ``retried`` count), not by Serve. Then the ingress (where the router and
its index live) is killed: the new one's index converges to what every replica holds, from
their snapshots.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.cluster.conftest import Deployed, RayNodes, free_port
from tests.cluster.test_cluster_live import stub_cluster_settings, wait_for_saves

from kvwarm.cluster.chains import chat_chain

pytestmark = pytest.mark.slow

DECODE_DELAY_S = 0.04  # x MAX_TOKENS: each reply takes ~2.5 s, long enough to die during
MAX_TOKENS = 64
SYSTEMS = [
    "You are a terse assistant for a quiz about the natural world. Answer in a few words.",
    "You are a patient tutor of elementary arithmetic. Show one step, then the answer.",
    "You are a travel guide for small coastal towns. Name one place and one food.",
]
QUESTIONS = ["Begin.", "And then?", "Why so?", "One more?"]
CONVERSATIONS = 6


def wait_until(what: str, check: Callable[[], bool], deadline_s: float = 90.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:  # bounded poll of the cluster's own answer
        try:
            if check():
                return
        except (httpx.TransportError, AssertionError):  # the ingress restarting: not yet
            pass
        time.sleep(0.2)
    raise AssertionError(f"not in {deadline_s} s: {what}")


@pytest.fixture(scope="module")
def node_env() -> dict[str, str]:
    return {"KVWARM_STUB_DECODE_DELAY_S": str(DECODE_DELAY_S)}


@pytest.fixture(scope="module")
def cluster(two_nodes: RayNodes, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    shared = tmp_path_factory.mktemp("shared")
    settings = stub_cluster_settings(
        replicas=3, cache_dir=shared, cache_dir_shared=True, cluster_routing="events"
    )
    deployed = Deployed(settings, free_port())
    try:
        deployed.wait_ready()
        wait_until("three replicas reporting", lambda: len(running(deployed)) == 3)
        yield deployed
    finally:
        deployed.stop()


def view(deployed: Deployed) -> dict[str, Any]:
    answer = deployed.http.get("/cluster")
    assert answer.status_code == 200, answer.text
    out: dict[str, Any] = answer.json()
    return out


def running(deployed: Deployed) -> list[dict[str, Any]]:
    return [
        r for r in view(deployed)["replicas"] if r["health"] == "running" and r["stats"].get("pid")
    ]


class Chats:
    def __init__(self, deployed: Deployed) -> None:
        self.http = deployed.http
        self.history = [
            [{"role": "system", "content": SYSTEMS[c % len(SYSTEMS)]}] for c in range(CONVERSATIONS)
        ]
        self.served: list[list[str]] = [[] for _ in range(CONVERSATIONS)]
        self.prompt: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
        self.cached: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
        self.keys: list[list[str | None]] = [[] for _ in range(CONVERSATIONS)]
        self.failed_streams: list[int] = []
        self.lock = threading.Lock()

    def turn(self, conv: int, turn: int, *, stream: bool = False) -> None:
        messages = [*self.history[conv], {"role": "user", "content": f"{QUESTIONS[turn]} ({conv})"}]
        body = {"model": "a", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        response = self.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text  # never a failed request
        if stream:
            reply, usage, error = self._read_stream(response.text)
            if error is not None:
                assert error["code"] == "replica_unavailable", error
                with self.lock:
                    self.failed_streams.append(conv)
                return  # the client asks again (the next phase does)
        else:
            done = response.json()
            reply, usage = done["choices"][0]["message"]["content"], done["usage"]
        with self.lock:
            self.history[conv] = [*messages, {"role": "assistant", "content": reply}]
            self.served[conv].append(response.headers["x-kvwarm-replica"])
            self.prompt[conv].append(usage["prompt_tokens"])
            self.cached[conv].append(usage["prompt_tokens_details"]["cached_tokens"])
            self.keys[conv].append(None if stream else response.json()["timings"]["cache_key"])

    @staticmethod
    def _read_stream(text: str) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
        reply, usage, error = [], {}, None
        for line in text.split("\n"):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            for choice in event.get("choices") or []:
                reply.append(choice.get("delta", {}).get("content") or "")
            usage = event.get("usage") or usage
        return "".join(reply), usage, error

    def all(self, turn: int, *, stream: Callable[[int], bool] = lambda _c: False) -> None:
        threads = [
            threading.Thread(target=self.turn, args=(c, turn), kwargs={"stream": stream(c)})
            for c in range(CONVERSATIONS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)


def test_replicas_spread_over_the_nodes_of_the_joined_cluster(cluster: Deployed) -> None:
    import ray

    replicas = running(cluster)
    nodes = {r["node"] for r in replicas}
    assert len(nodes) == 2, replicas  # three replicas over both nodes
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert nodes <= alive
    assert len({r["stats"]["pid"] for r in replicas}) == 3
    assert view(cluster)["ingress"]["pid"] > 0


def test_a_replica_killed_mid_load_loses_no_request_and_its_conversations_restore(
    cluster: Deployed, two_nodes: RayNodes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    chats = Chats(cluster)
    for turn in (0, 1):
        chats.all(turn)
    shared = Path(cluster.settings.cache_dir or "") / "rows"
    wait_for_saves(shared, [k[-1] for k in chats.keys])
    # Turn 2 for everyone, odd conversations streamed; a replica dies while serving.
    load = threading.Thread(target=chats.all, args=(2,), kwargs={"stream": lambda c: c % 2 == 1})
    load.start()
    busiest: list[dict[str, Any]] = []

    def serving() -> bool:
        busiest[:] = sorted(running(cluster), key=lambda r: -r["stats"]["in_flight"])[:1]
        return bool(busiest) and busiest[0]["stats"]["in_flight"] > 0

    wait_until("a replica running requests", serving, 30.0)
    victim = busiest[0]["id"]
    os.kill(busiest[0]["stats"]["pid"], signal.SIGKILL)  # a replica of our own cluster
    homed = [c for c in range(CONVERSATIONS) if chats.served[c][1] == victim]
    load.join(300)
    assert not load.is_alive()
    # What ran there was sent again elsewhere (by the ingress, or by Serve if it had not
    # started), or was a stream that ended with an error event: none failed otherwise.
    print("retried by the ingress:", view(cluster)["ingress"]["retried"], chats.failed_streams)
    # A stream the victim had started ended with an error event; its client asks again.
    for conv in chats.failed_streams:
        assert conv % 2 == 1  # only streams may fail, and with an error event
        chats.turn(conv, 2)
    for conv in range(CONVERSATIONS):
        assert len(chats.served[conv]) == 3, (conv, chats.served[conv])
    for conv in range(CONVERSATIONS):
        # Wherever turn 2 ran (the victim, before it died, or another replica after), it
        # restored turn 1, from a slot or from the directory both nodes mount.
        assert chats.cached[conv][2] >= chats.prompt[conv][1], (conv, chats.cached[conv])
    chats.all(3)  # the conversations go on
    assert all(len(s) == 4 for s in chats.served)
    for conv in homed:
        assert chats.served[conv][3] != victim  # it is gone: the conversation lives elsewhere
    # Serve replaces the dead replica; the new one reports its cache events to the router.
    wait_until(
        "a new replica in the index",
        lambda: len(running(cluster)) == 3 and victim not in {r["id"] for r in running(cluster)},
    )
    dead = [r for r in view(cluster)["replicas"] if r["id"] == victim]
    assert dead and dead[0]["health"] == "dead"


def test_a_request_running_on_a_killed_replica_is_sent_again_by_the_ingress(
    cluster: Deployed,
) -> None:
    # One non-streamed request, long enough (100 tokens, 4 s) to be running when its
    # replica dies. The replica itself reports the conversation running (its ``running``
    # chain ends), so it has started there and Serve no longer holds it to place elsewhere:
    # only the ingress can send it again.
    wait_until("three replicas", lambda: len(running(cluster)) == 3)
    before = view(cluster)["ingress"]["retried"]
    messages = [{"role": "user", "content": "A long answer, please, about the sea."}]
    end = chat_chain("a", messages)[-1]
    body = {"model": "a", "messages": messages, "max_tokens": 100, "temperature": 0}
    answer: list[httpx.Response] = []
    request = threading.Thread(
        target=lambda: answer.append(cluster.http.post("/v1/chat/completions", json=body))
    )
    request.start()
    serving: list[dict[str, Any]] = []

    def running_it() -> bool:
        # A call through the router makes it read the replicas' latest reports.
        cluster.http.post("/tokenize", json={"model": "a", "content": "x"})
        serving[:] = [r for r in running(cluster) if end in (r["stats"].get("running") or [])]
        return len(serving) == 1

    wait_until("the request running on a replica", running_it, 30.0)
    victim = serving[0]["id"]
    os.kill(serving[0]["stats"]["pid"], signal.SIGKILL)  # a replica of our own cluster
    request.join(120)
    assert answer and answer[0].status_code == 200, answer and answer[0].text
    assert answer[0].headers["x-kvwarm-replica"] != victim
    assert len(answer[0].json()["choices"][0]["message"]["content"]) > 0
    assert view(cluster)["ingress"]["retried"] == before + 1
    wait_until(
        "a new replica in the index",
        lambda: len(running(cluster)) == 3 and victim not in {r["id"] for r in running(cluster)},
    )


def test_the_index_converges_after_the_router_restarts(cluster: Deployed) -> None:
    def converged() -> bool:
        replicas = running(cluster)
        if len(replicas) != 3:
            return False
        for r in replicas:
            reported = r["stats"].get("cache") or {}
            indexed = r["indexed"]["tiers"]
            if r["resync_wanted"] or r["seq"] == 0:
                return False
            for tier, sizes in reported.items():
                if int(sizes["rows"]) != indexed.get(tier, {}).get("rows", 0):
                    return False
        return True

    wait_until("the index matches what replicas hold", converged)
    before = view(cluster)
    os.kill(before["ingress"]["pid"], signal.SIGKILL)  # the router's process
    wait_until(
        "a new ingress",
        lambda: (
            cluster.http.get("/health").status_code == 200
            and view(cluster)["ingress"]["pid"] != before["ingress"]["pid"]
        ),
        120.0,
    )
    wait_until("the new router's index matches what replicas hold", converged)
    assert sum(r["resyncs"] for r in running(cluster)) >= 1  # from snapshots, not from zero
