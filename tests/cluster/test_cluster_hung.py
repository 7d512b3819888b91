"""A cluster's generations end when the server or the client ends them, under Ray, on the
stub backend paced like a small model. A replica that hangs mid-reply (its process stopped,
``SIGSTOP``: alive to Ray until its health checks give up on it, 30 s and more) ends the
request at the server's deadline (``request_timeout_s``) with its error event, as under
``kvwarm serve`` (found by review: the ingress waited for the stopped replica to acknowledge
the cancel, 119.6 s for a 4 s deadline); a client that leaves mid-reply frees its replica's
slot at once (its generation is cancelled through Serve's proxy and the ingress)."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
from tests.cluster.conftest import Deployed
from tests.cluster.test_cluster_live import stub_cluster_settings

DELAY = "KVWARM_STUB_DECODE_DELAY_S"
DEADLINE_S = 4.0


@pytest.fixture
def paced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas that decode at a small model's pace (each process gets it from Ray's
    runtime environment), so a reply of 200 tokens runs 10 s: past the deadline."""
    from kvwarm.cluster import deploy

    build = deploy.build_app
    env = {"runtime_env": {"env_vars": {DELAY: "0.05"}}}

    def paced_app(*args: Any, **kwargs: Any) -> Any:
        return build(*args, **kwargs, actor_options=env)

    monkeypatch.setattr(deploy, "build_app", paced_app)


def _replica_pid(deployed: Deployed) -> int:
    end = time.monotonic() + 60
    while time.monotonic() < end:  # bounded poll: until the router has the replica's report
        replicas = deployed.http.get("/cluster").json()["replicas"]
        pids = [r["stats"].get("pid") for r in replicas if r["health"] == "running"]
        if pids and pids[0]:
            return int(pids[0])
        deployed.http.post("/tokenize", json={"model": "a", "content": "x"})  # reads reports
        time.sleep(0.2)
    raise AssertionError("no replica reported its pid")


@pytest.mark.usefixtures("paced")
@pytest.mark.slow
def test_a_replica_that_hangs_mid_reply_ends_the_stream_at_its_deadline(ray_port: int) -> None:
    deployed = Deployed(stub_cluster_settings(replicas=1, request_timeout_s=DEADLINE_S), ray_port)
    pid, stopped, events = 0, False, []
    try:
        deployed.wait_ready()
        pid = _replica_pid(deployed)
        messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
        body = {
            "model": "a",
            "messages": messages,
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
        started = time.monotonic()
        with deployed.http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                events.append(event)
                text = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
                if text and not stopped:
                    os.kill(pid, signal.SIGSTOP)  # our own cluster's replica, by its pid
                    stopped = True
        elapsed = time.monotonic() - started
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        deployed.stop()
    assert stopped, events
    assert events[-1]["error"]["code"] == "request_timeout", events[-1]
    # At the deadline, not at Ray's health checks' (30 s and more, then a replacement).
    assert elapsed < DEADLINE_S + 10, elapsed


@pytest.mark.usefixtures("paced")
@pytest.mark.slow
def test_a_client_that_leaves_mid_reply_frees_its_replicas_slot(ray_port: int) -> None:
    """The client's disconnect reaches the replica through Serve's proxy and the ingress: its
    generation is cancelled there, so the one slot is free for the next request at once,
    not after the abandoned reply's 10 s."""
    deployed = Deployed(stub_cluster_settings(replicas=1, n_parallel=1), ray_port)
    try:
        deployed.wait_ready()
        messages = [{"role": "user", "content": "Tell me a long story about the hills."}]
        body = {"model": "a", "messages": messages, "max_tokens": 200, "ignore_eos": True}
        with deployed.http.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as response:
            for line in response.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # text is coming; leaving the read closes the connection
        left = time.monotonic()
        quick = deployed.http.post("/v1/chat/completions", json={**body, "max_tokens": 5})
        waited = time.monotonic() - left
    finally:
        deployed.stop()
    assert quick.status_code == 200, quick.text
    assert quick.json()["usage"]["completion_tokens"] == 5
    assert waited < 6, waited  # the abandoned reply would hold the slot ~9.5 s more
