"""Fixtures: a local Ray instance (127.0.0.1, no dashboard, 2 CPUs, a short temp dir) for the
module, and kvwarm deployed on it over HTTP on a free port; or two Ray nodes started apart
from the test (``ray start --head`` and ``ray start --address``, each on 127.0.0.1 with its
own ports and resources) that the test joins, as `kvwarm cluster --address` does."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvwarm.settings import Settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def ray_port() -> Iterator[int]:
    """A local Ray for the module; the port its Serve HTTP proxy listens on."""
    from kvwarm.cluster import deploy

    # Ray's socket paths live under its temp dir and must stay short (108 bytes).
    temp = Path(tempfile.mkdtemp(prefix="kvray-", dir="/tmp"))
    deploy.start_ray(None, temp_dir=temp, num_cpus=2)
    try:
        yield free_port()
    finally:
        deploy.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


class Deployed:
    """kvwarm on the module's Ray, reachable at ``base_url``; ``stop()`` removes it."""

    def __init__(self, settings: Settings, port: int, router: str = "affinity") -> None:
        from kvwarm.cluster import deploy

        self.settings = settings.replace(host="127.0.0.1", port=port)
        self.base_url = f"http://127.0.0.1:{self.settings.port}"
        deploy.run(self.settings, router=router)  # type: ignore[arg-type]
        self.http = httpx.Client(base_url=self.base_url, timeout=120)

    def wait_ready(self, deadline_s: float = 180.0) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:  # bounded readiness poll, not a sleep-as-sync
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("the cluster did not become ready in time")

    def stop(self) -> None:
        from ray import serve

        from kvwarm.cluster.deploy import APP_NAME

        self.http.close()
        serve.delete(APP_NAME)


# `ray start`, keeping a loopback --node-ip-address: with multi-node clusters enabled (Linux)
# Ray swaps 127.0.0.1 for the host's outward address, and these nodes must stay on loopback.
RAY_START = """import sys
from ray._private import services
services.resolve_ip_for_localhost = lambda host: host
from ray.scripts.scripts import main
sys.argv = ["ray", *sys.argv[1:]]
main()
"""


class RayNodes:
    """Ray nodes started as `ray start --block` processes, each its own process group, so
    that ``stop()`` ends exactly them (never `ray stop`, which would end every Ray on the
    machine). A node's services run in its group; its workers die with its raylet."""

    def __init__(self, temp: Path, env: dict[str, str] | None = None) -> None:
        self.temp = temp
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.script = temp / "ray_start.py"
        self.script.write_text(RAY_START)
        self.procs: list[subprocess.Popen[bytes]] = []
        # A head started while ~/.ray/auth_token exists asks every client for that token; a
        # second node refuses to start where multi-node clusters are off (a local Ray of an
        # earlier test turned them off in this process's environment: loopback.py).
        self.env = {
            **os.environ,
            **(env or {}),
            "RAY_AUTH_MODE": self.auth_mode(),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
        }

    @staticmethod
    def auth_mode() -> str:
        return "token" if (Path.home() / ".ray" / "auth_token").exists() else "disabled"

    def _start(self, name: str, args: list[str]) -> None:
        ports = [
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        common = [
            "--block",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            f"--object-store-memory={100 << 20}",
            "--disable-usage-stats",
            *ports,
        ]
        log = (self.temp / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, str(self.script), "start", *args, *common],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self.procs.append(proc)

    def start_head(self, resources: str) -> None:
        self._start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--temp-dir={self.temp / 'r'}",
                f"--resources={resources}",
            ],
        )
        end = time.monotonic() + 120
        while time.monotonic() < end:  # bounded: until the GCS accepts connections
            assert self.procs[0].poll() is None, (self.temp / "head.log").read_text()
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        raise AssertionError("the head node did not start")

    def add_node(self, resources: str) -> None:
        self._start(
            f"node{len(self.procs)}", [f"--address={self.address}", f"--resources={resources}"]
        )

    def wait_nodes(self, n: int, deadline_s: float = 120.0) -> None:
        """In a driver joined to this cluster: until ``n`` nodes are alive."""
        import ray

        end = time.monotonic() + deadline_s
        while time.monotonic() < end:  # bounded poll on the cluster's own state
            if sum(1 for node in ray.nodes() if node["Alive"]) >= n:
                return
            for proc in self.procs:
                assert proc.poll() is None, "a Ray node exited"
            time.sleep(0.2)
        raise AssertionError(f"{n} Ray nodes did not come up")

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # our own `ray start` group, by its id
            proc.wait(timeout=30)
        self.procs.clear()


def join_with_auth(mode: str) -> None:
    """Ask a cluster for its token as a driver started with ``RAY_AUTH_MODE=token`` does (this
    process imported Ray before the variable was set, so its config is read again)."""
    os.environ["RAY_AUTH_MODE"] = mode
    if mode == "token":
        from ray._raylet import Config

        Config.initialize("")


@pytest.fixture(scope="module")
def node_env() -> dict[str, str]:
    """Environment the Ray nodes' processes (so every replica) get; a module overrides it."""
    return {}


@pytest.fixture(scope="module")
def two_nodes(node_env: dict[str, str]) -> Iterator[RayNodes]:
    """Two Ray nodes on 127.0.0.1 (a head and one more, each with one CPU and a resource of
    its own), joined by this process as `kvwarm cluster --address` joins; always stopped."""
    from kvwarm.cluster import deploy

    temp = Path(tempfile.mkdtemp(prefix="kv2n-", dir="/tmp"))  # Ray's socket paths: short
    nodes = RayNodes(temp, node_env)
    saved = os.environ.get("RAY_AUTH_MODE")
    try:
        nodes.start_head('{"kvwarm_head": 1}')
        nodes.add_node('{"kvwarm_second": 1}')
        join_with_auth(nodes.env["RAY_AUTH_MODE"])
        deploy.start_ray(nodes.address)
        nodes.wait_nodes(2)
        yield nodes
    finally:
        try:
            deploy.shutdown(owned=False)
        finally:
            nodes.stop()
            if saved is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = saved
            shutil.rmtree(temp, ignore_errors=True)
