"""A local Ray started the way ``kvwarm cluster`` starts it listens on loopback only.

Ray's GCS, raylet, agents, workers and the Serve controller and proxy: every listening TCP
socket of this process's descendants is on 127.0.0.1 (or its IPv4-mapped IPv6 form). Before
the fix Ray resolved ``_node_ip_address="127.0.0.1"`` to the host's address and bound its gRPC
servers to every interface.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import psutil
import pytest
from tests.cluster.conftest import Deployed
from tests.cluster.test_cluster_live import stub_cluster_settings

pytestmark = pytest.mark.slow


def listening_sockets() -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket in LISTEN of this process and its
    descendants (Ray's daemons and workers)."""
    me = psutil.Process()
    pids = {me.pid} | {child.pid for child in me.children(recursive=True)}
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.NoSuchProcess:
                continue
            found.append((name, conn.laddr.ip, conn.laddr.port))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", maxsplit=1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@pytest.fixture(scope="module")
def deployed(ray_port: int) -> Iterator[Deployed]:
    cluster = Deployed(stub_cluster_settings(replicas=1), ray_port)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


def test_every_ray_service_listens_on_loopback_only(deployed: Deployed) -> None:
    # The ingress reaches the engine replica (Serve's calls between deployments still work).
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = deployed.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    sockets = listening_sockets()
    names = {name for name, _, _ in sockets}
    # The test sees Ray's own daemons, not just the driver (else it would prove nothing).
    assert {"gcs_server", "raylet"} <= names, sockets
    assert any(port == deployed.settings.port for _, _, port in sockets), sockets
    exposed = [s for s in sockets if not is_loopback(s[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"
