"""A replica that hangs mid-reply, under Ray: its process stopped (``SIGSTOP``), alive to Ray
until its health checks give up on it (30 s and more). The request it was serving ends at
the server's deadline (``request_timeout_s``) with its error event, as under ``kvwarm
serve``, not when Ray kills the replica (found by review: the ingress waited for the stopped
replica to acknowledge the cancel)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.cluster.conftest import Deployed, free_port
from tests.cluster.test_cluster_live import stub_cluster_settings

DELAY = "KVWARM_STUB_DECODE_DELAY_S"
DEADLINE_S = 4.0


@pytest.fixture(scope="module")
def ray_port() -> Iterator[int]:
    """A local Ray for the module whose replicas decode at a small model's pace (set before
    Ray starts: its workers inherit it), so a reply is still running when it is stopped."""
    from kvwarm.cluster import deploy

    saved = os.environ.get(DELAY)
    os.environ[DELAY] = "0.05"  # 200 tokens: 10 s, past the deadline
    temp = Path(tempfile.mkdtemp(prefix="kvray-", dir="/tmp"))
    try:
        deploy.start_ray(None, temp_dir=temp, num_cpus=2)
        try:
            yield free_port()
        finally:
            deploy.shutdown()
    finally:
        if saved is None:
            os.environ.pop(DELAY, None)
        else:
            os.environ[DELAY] = saved
        shutil.rmtree(temp, ignore_errors=True)


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


def test_a_replica_that_hangs_mid_reply_ends_the_stream_at_its_deadline(ray_port: int) -> None:
    deployed = Deployed(stub_cluster_settings(replicas=1, request_timeout_s=DEADLINE_S), ray_port)
    pid, stopped, events = 0, False, []
    try:
        deployed.wait_ready()
        pid = _replica_pid(deployed)
        messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
        body = {"model": "a", "messages": messages, "max_tokens": 200, "stream": True}
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
