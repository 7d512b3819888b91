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
dashboard. (``kvwarm.cluster.loopback``.) With ``ray_address`` kvwarm joins a cluster someone
started (``ray start``, KubeRay): its nodes listen where they were told to; kvwarm's own
servers (the HTTP proxy on ``host``, each replica's gRPC server on its node's address) add
nothing wider. Replicas are spread over the nodes (Serve's default spread scheduling; they
reserve no CPU); the HTTP proxy runs on the head node unless ``host`` is a wildcard.
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
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp

from kvwarm.cluster.calls import Generate, ModelOp
from kvwarm.cluster.ingress import create_ingress_app, max_in_flight
from kvwarm.cluster.loopback import LOOPBACK, keep_ray_on_loopback, keep_replica_grpc_on_loopback
from kvwarm.cluster.remote import ResponseStream
from kvwarm.cluster.replica import EngineReplica
from kvwarm.cluster.routing import ClusterIndex, RoutingConfig, check_policy, index_for
from kvwarm.cluster.routing.index import index_name
from kvwarm.engine.cancel import Cancellation
from kvwarm.engine.speculating import kernel_environment
from kvwarm.errors import KvwarmError, ReplicaTimeoutError, RequestCancelledError
from kvwarm.settings import Settings
from kvwarm.settings.model import max_queue, model_slots

log = logging.getLogger("kvwarm.cluster")

APP_NAME = "kvwarm"
ENGINE = "engine"
INGRESS = "ingress"
RouterKind = Literal["affinity", "default"]
STATS_PERIOD_S = 0.5  # replicas report warm chains this often (the router also remembers)


class HandleCalls:
    """``ingress.Calls`` over the engine deployment's handle; the running replicas are those
    the router in this process last told ``index`` of (none known without one)."""

    def __init__(
        self, handle: DeploymentHandle[EngineReplica], index: ClusterIndex | None = None
    ) -> None:
        self._stream = handle.options(stream=True).generate
        self._op = handle.call
        self._index = index

    def replicas(self) -> list[str]:
        return self._index.running() if self._index is not None else []

    def stream(self, call: Generate) -> ResponseStream:
        return cast(ResponseStream, self._stream.remote(call))

    def op(self, op: ModelOp, cancel: Cancellation | None = None) -> object:
        """The op's answer, within its deadline: a replica that is alive but stuck (or a queue
        that never reaches one) must not hold an ingress thread for good. ``cancel`` (the
        route's, on its client's disconnect) cancels the call, and with it the replica's work
        (``EngineReplica.call``): then ``RequestCancelledError``."""
        response = self._op.remote(op)
        forget = cancel.on_cancel(response.cancel) if cancel is not None else None
        try:
            return response.result(timeout_s=op.timeout_s)
        except Exception as exc:
            if cancel is not None and cancel.cancelled:  # Ray's error for a cancelled call
                raise RequestCancelledError(
                    f"{op.op} for {op.model_id} was cancelled by its caller"
                ) from exc
            if not isinstance(exc, TimeoutError):  # Ray's GetTimeoutError is one
                raise
            response.cancel()  # type: ignore[no-untyped-call]
            raise ReplicaTimeoutError(
                f"no replica answered {op.op} for {op.model_id} within {op.timeout_s:g} s"
            ) from None
        finally:
            if forget is not None:
                forget()


class Ingress:
    """The ingress deployment's body: builds the app in the replica (``serve.ingress()``)."""

    def __init__(self, settings: Settings, engine: DeploymentHandle[EngineReplica]) -> None:
        keep_replica_grpc_on_loopback()
        self._settings = settings
        self._engine = engine

    def __serve_build_asgi_app__(self) -> ASGIApp:
        # The index the engine deployment's router in this process feeds (``router.py``),
        # keyed by this application's name: "kvwarm" from ``run``, but ``serve run`` names it
        # "default" and a RayService its own.
        index = index_for(index_name(_application_name(), ENGINE))
        return create_ingress_app(self._settings, HandleCalls(self._engine, index), index)


def _application_name() -> str:
    """The Serve application this replica belongs to (``APP_NAME`` outside a replica)."""
    try:
        return str(serve.get_replica_context().app_name)
    except RayServeException:  # not in a replica (tests build the app directly)
        return APP_NAME


def _deployment(cls: type, **options: Any) -> Deployment:
    return cast(Deployment, serve.deployment(cls, **options))


def routing_config(settings: Settings) -> RoutingConfig:
    """The router's configuration; ``ConfigError`` naming the registered routing policies if
    ``cluster_routing`` is none of them."""
    check_policy(settings.cluster_routing)
    busy = settings.cluster_busy_requests or 2 * settings.n_parallel
    return RoutingConfig(policy=settings.cluster_routing, busy_requests=busy)


def ingress_max_ongoing(settings: Settings) -> int:
    """Ray's cap on the HTTP requests the ingress holds at once. The ingress only parses and
    waits on replicas; it answers 429 past each model's ``ingress.max_in_flight``, so it must
    be let hold more than those (all models' generations, and room for the requests it turns
    away and for the other routes): a request past this cap would wait in Serve's proxy
    instead, with no answer."""
    per_model = [
        max_in_flight(settings, model_slots(settings, spec), max_queue(settings, spec))
        for spec in settings.models
    ]
    return 2 * max(sum(per_model), 1) + 64


def build_app(
    settings: Settings,
    *,
    router: RouterKind = "affinity",
    stats_period_s: float = STATS_PERIOD_S,
    actor_options: Mapping[str, object] | None = None,
    nodes: int | None = None,
) -> Application:
    """The Serve application: ``ingress`` in front of ``settings.replicas`` engine replicas,
    routed by the ``cluster_routing`` policy. ``router="default"`` keeps Ray's own (power of
    two choices), for comparison: it feeds no index, so the ingress knows no replica running
    (a prewarm is one call, a 429 bound counts ``--replicas``), and it cannot send a call to a
    given replica, so a prewarm cannot fan out (``docs/cluster.md``). With ``nodes`` (the
    cluster's, when more than one) no node runs more than its share of the replicas
    (``ceil(replicas / nodes)``): Serve's own spread is best effort, and replicas reserving no
    CPU may all land on one node."""
    options: dict[str, object] = {"num_cpus": 0, **(actor_options or {})}
    if switch := kernel_environment():
        # The kernels the command decided at its start (``cli/common.decide_kernels``), set
        # in each replica's process before it runs: its own load could not set them safely.
        given = dict(cast(Mapping[str, Any], options.get("runtime_env") or {}))
        given["env_vars"] = {**switch, **given.get("env_vars", {})}
        options["runtime_env"] = given
    spread: dict[str, Any] = {}
    if nodes is not None and nodes > 1:
        spread["max_replicas_per_node"] = -(-settings.replicas // nodes)
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
        **spread,
    )
    ingress_class = cast(type[Ingress], serve.ingress()(Ingress))
    ingress = _deployment(
        ingress_class,
        name=INGRESS,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=ingress_max_ongoing(settings),
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
        if _loopback(address):
            keep_ray_on_loopback()  # else Ray swaps 127.0.0.1 for the host's outward address
        ray.init(address=address, log_to_driver=True)
        log.info("kvwarm cluster: joined the Ray cluster at %s (%d nodes)", address, alive_nodes())
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


def _loopback(address: str) -> bool:
    """Whether a ``HOST:PORT`` address names this machine's loopback."""
    if "://" in address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def alive_nodes() -> int:
    """Nodes of the Ray cluster this process is connected to that are alive now."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return len([node for node in nodes if node.get("Alive")])


def proxy_location(host: str) -> str:
    """Where Serve runs its HTTP proxy: on every node with a replica when ``host`` is a
    wildcard (each node serves its own interfaces), else on the head node only (a loopback
    or one machine's address is bound on one node; several proxies on one host would
    collide on the port)."""
    return "EveryNode" if host in ("0.0.0.0", "::", "") else "HeadOnly"


def run(
    settings: Settings,
    *,
    router: RouterKind = "affinity",
    stats_period_s: float = STATS_PERIOD_S,
) -> DeploymentHandle[EngineReplica]:
    """Deploy on the current Ray cluster (``start_ray`` first) and wait until it is healthy;
    the HTTP proxy listens on ``settings.host:settings.port``. ``KvwarmError`` with Serve's
    reason when the application fails to deploy (a replica that cannot load its model)."""
    serve.start(
        proxy_location=proxy_location(settings.host),
        http_options={"host": settings.host, "port": settings.port},
    )
    app = build_app(settings, router=router, stats_period_s=stats_period_s, nodes=alive_nodes())
    try:
        handle: DeploymentHandle[EngineReplica] = serve.run(
            app, name=APP_NAME, route_prefix="/", blocking=False
        )
    except RuntimeError as exc:  # DEPLOY_FAILED: a replica's constructor error is in its message
        raise KvwarmError(f"kvwarm cluster: the application did not start: {exc}") from exc
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
    Serve and Ray too. A joined cluster keeps its other applications. This process leaves
    Ray even when removing the application fails (a cluster already gone)."""
    if not ray.is_initialized():
        return
    try:
        if owned:
            serve.shutdown()  # type: ignore[no-untyped-call]
        else:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()
