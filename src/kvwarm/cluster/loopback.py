"""Keeping a local Ray on 127.0.0.1: its node address, and the gRPC server of each Serve
replica.

Invariants: with ``keep_ray_on_loopback()`` before ``ray.init`` a loopback node address stays
loopback (Ray otherwise swaps it for the host's outward address, and every daemon then binds
all interfaces). Serve starts one more server per replica, for calls between deployments, on
``[::]:0`` with no setting; ``keep_replica_grpc_on_loopback()``, called in a replica's
constructor (before Serve starts that server), binds it to 127.0.0.1 instead when the replica's
node is 127.0.0.1. Both reach into Ray's private modules: ``tests/cluster`` lists every
listening socket to catch a Ray upgrade that moves them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, cast

log = logging.getLogger("kvwarm.cluster")

LOOPBACK = "127.0.0.1"
# Ray reads this (at import, in the driver and in every process it starts) to decide whether
# a node's address may be loopback; off, "127.0.0.1" stays 127.0.0.1 and its servers bind it.
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_ALL_INTERFACES = "[::]:"
_BIND = "add_port_to_grpc_server"  # the helper ray.serve._private.replica binds its server with


def keep_ray_on_loopback() -> None:
    """Make the local Ray about to start keep 127.0.0.1 as its node address (so that every
    service binds it) instead of resolving it to the host's outward address."""
    os.environ[RAY_CLUSTER_ENV] = "0"  # the processes Ray starts inherit it
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported Ray before the variable


def keep_replica_grpc_on_loopback() -> None:
    """In a Serve replica on a loopback node: bind Serve's inter-deployment gRPC server to
    127.0.0.1 instead of every interface. A no-op elsewhere (outside Ray, or on a node with a
    routable address, where other nodes must reach it)."""
    import ray

    if not ray.is_initialized() or ray.util.get_node_ip_address() != LOOPBACK:  # type: ignore[no-untyped-call]
        return
    from ray.serve._private import replica

    bind = cast(Callable[[Any, str], Any], getattr(replica, _BIND))
    if getattr(bind, "kvwarm_loopback", False):
        return

    def on_loopback(server: Any, address: str) -> Any:
        if address.startswith(_ALL_INTERFACES):
            address = f"{LOOPBACK}:{address.removeprefix(_ALL_INTERFACES)}"
        return bind(server, address)

    setattr(on_loopback, "kvwarm_loopback", True)  # noqa: B010
    setattr(replica, _BIND, on_loopback)
    log.debug("Serve replica gRPC server bound to %s", LOOPBACK)
