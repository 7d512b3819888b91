"""Fixtures: a local Ray instance (127.0.0.1, no dashboard, 2 CPUs, a short temp dir) for the
module, and kvwarm deployed on it over HTTP on a free port."""

from __future__ import annotations

import shutil
import socket
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
