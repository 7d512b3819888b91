"""Starting (or joining) Ray and running kvwarm on it: the engine deployment, the ingress and
the router, from one ``Settings``.

Invariants: the same settings that configure ``kvwarm serve`` configure every replica (models,
context, cache tiers); ``replicas``, ``ray_address``, ``cluster_routing`` and
``cluster_busy_requests`` add the cluster's own. Replicas ask Ray for no CPU reservation
(``num_cpus=0``): llama.cpp's threads are set by ``n_threads``, not by Ray. The HTTP proxy
listens on ``host:port``, as ``serve``.

A local Ray (no ``ray_address``) listens on 127.0.0.1 only, every service of it: GCS, raylet,
agents, workers, the Serve controller (Ray's GCS takes a token but runs any driver that has
it). Ray would otherwise turn a loopback ``_node_ip_address`` into the host's address and bind
its gRPC servers to every interface; ``node_ip`` opens it to that address deliberately. No
dashboard. (``kvwarm.cluster.loopback``.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, cast

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application, Deployment
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp

from kvwarm.cluster.calls import Generate, ModelOp
from kvwarm.cluster.ingress import create_ingress_app
from kvwarm.cluster.loopback import LOOPBACK, keep_ray_on_loopback, keep_replica_grpc_on_loopback
from kvwarm.cluster.remote import ResponseStream
from kvwarm.cluster.replica import EngineReplica
from kvwarm.cluster.routing import RoutingConfig, check_policy
from kvwarm.settings import Settings

log = logging.getLogger("kvwarm.cluster")

APP_NAME = "kvwarm"
ENGINE = "engine"
INGRESS = "ingress"
RouterKind = Literal["affinity", "default"]
STATS_PERIOD_S = 0.5  # replicas report warm chains this often (the router also remembers)


class HandleCalls:
    """``ingress.Calls`` over the engine deployment's handle."""

    def __init__(self, handle: DeploymentHandle[EngineReplica]) -> None:
        self._stream = handle.options(stream=True).generate
        self._op = handle.call

    def stream(self, call: Generate) -> ResponseStream:
        return cast(ResponseStream, self._stream.remote(call))

    def op(self, op: ModelOp) -> object:
        return self._op.remote(op).result()


class Ingress:
    """The ingress deployment's body: builds the app in the replica (``serve.ingress()``)."""

    def __init__(self, settings: Settings, engine: DeploymentHandle[EngineReplica]) -> None:
        keep_replica_grpc_on_loopback()
        self._settings = settings
        self._engine = engine

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return create_ingress_app(self._settings, HandleCalls(self._engine))


def _deployment(cls: type, **options: Any) -> Deployment:
    return cast(Deployment, serve.deployment(cls, **options))


def routing_config(settings: Settings) -> RoutingConfig:
    """The router's configuration; ``ConfigError`` naming the registered routing policies if
    ``cluster_routing`` is none of them."""
    check_policy(settings.cluster_routing)
    busy = settings.cluster_busy_requests or 2 * settings.n_parallel
    return RoutingConfig(policy=settings.cluster_routing, busy_requests=busy)


def build_app(
    settings: Settings,
    *,
    router: RouterKind = "affinity",
    stats_period_s: float = STATS_PERIOD_S,
    actor_options: Mapping[str, object] | None = None,
) -> Application:
    """The Serve application: ``ingress`` in front of ``settings.replicas`` engine replicas,
    routed by the ``cluster_routing`` policy. ``router="default"`` keeps Ray's own (power of
    two choices), for comparison."""
    options: dict[str, object] = {"num_cpus": 0, **(actor_options or {})}
    router_fields: dict[str, Any] = {}  # empty: Ray's default (power of two choices)
    if router == "affinity":
        from kvwarm.cluster.router import AffinityRouter

        router_fields = {
            "request_router_class": AffinityRouter,
            "request_router_kwargs": asdict(routing_config(settings)),
            "request_routing_stats_period_s": stats_period_s,
        }
    # serve.deployment's annotation is its decorator form; called with the class it returns
    # the Deployment itself.
    engine = _deployment(
        EngineReplica,
        name=ENGINE,
        num_replicas=settings.replicas,
        # Ray's cap on calls in flight per replica; the engine queues past its slots, and the
        # router moves a conversation on well before this (busy_requests).
        max_ongoing_requests=max(8, 4 * settings.n_parallel),
        ray_actor_options=options,
        request_router_config=RequestRouterConfig(**router_fields),
    )
    ingress_class = cast(type[Ingress], serve.ingress()(Ingress))
    ingress = _deployment(
        ingress_class,
        name=INGRESS,
        ray_actor_options={"num_cpus": 0},
        # The ingress only parses and waits on replicas: let it hold every request they can.
        max_ongoing_requests=settings.replicas * (settings.n_parallel + settings.max_queue),
    )
    app: Application = ingress.bind(settings, engine.bind(settings))
    return app


def start_ray(
    address: str | None,
    *,
    node_ip: str | None = None,
    temp_dir: Path | None = None,
    num_cpus: int | None = None,
) -> None:
    """Join the Ray cluster at ``address``, or start a local one (no dashboard) listening on
    127.0.0.1 only, or on ``node_ip`` when given (other nodes can then join it)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    if node_ip is None or node_ip == LOOPBACK:
        keep_ray_on_loopback()
    else:
        log.warning("kvwarm cluster: Ray listens on %s, reachable from that network", node_ip)
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=num_cpus,
        _node_ip_address=node_ip or LOOPBACK,
        _temp_dir=str(temp_dir) if temp_dir is not None else None,
    )


def run(
    settings: Settings,
    *,
    router: RouterKind = "affinity",
    stats_period_s: float = STATS_PERIOD_S,
) -> DeploymentHandle[EngineReplica]:
    """Deploy on the current Ray cluster (``start_ray`` first) and wait until it is healthy;
    the HTTP proxy listens on ``settings.host:settings.port``."""
    serve.start(http_options={"host": settings.host, "port": settings.port})
    app = build_app(settings, router=router, stats_period_s=stats_period_s)
    handle: DeploymentHandle[EngineReplica] = serve.run(
        app, name=APP_NAME, route_prefix="/", blocking=False
    )
    log.info(
        "kvwarm cluster: %d replica(s), %s router, http://%s:%d",
        settings.replicas,
        router,
        settings.host,
        settings.port,
    )
    return handle


def shutdown(*, owned: bool = True) -> None:
    """Remove the application; with ``owned`` (a local Ray started by ``start_ray``) stop
    Serve and Ray too. A joined cluster keeps its other applications."""
    if not ray.is_initialized():
        return
    if owned:
        serve.shutdown()  # type: ignore[no-untyped-call]
    else:
        serve.delete(APP_NAME)
    ray.shutdown()
