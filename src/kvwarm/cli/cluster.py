"""``kvwarm cluster``: the OpenAI-compatible server over several engine replicas on Ray Serve.

Invariant: the same settings as ``serve`` (flags, ``KVWARM_*`` env, TOML), plus ``--replicas``,
``--ray-address``, ``--node-ip``, ``--cluster-routing`` (checked before Ray starts),
``--cluster-busy-requests`` and ``--cluster-save-wait-s``; a local Ray listens on 127.0.0.1
only unless ``--node-ip`` opens it; it runs until SIGINT/SIGTERM (one during the deploy too),
then removes the application (and stops Ray if it started it).
"""

from __future__ import annotations

import argparse
import threading

from kvwarm.cli.common import decide_kernels, settings_from, stop_signals
from kvwarm.errors import ConfigError
from kvwarm.settings import Settings, add_settings_arguments


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "cluster",
        help="serve the OpenAI API from N engine replicas on Ray Serve (kvwarm[cluster])",
        description="Start (or join, --ray-address) Ray, deploy --replicas engine replicas of "
        "the configured models and an ingress with the same routes as `kvwarm serve`; requests "
        "go to the replica holding their conversation's longest prefix warm. Give replicas a "
        "shared cache tier so any of them restores what another saved.",
    )
    # Every setting, its own (CLUSTER_ONLY) included; a server, so no -v: it logs at INFO as
    # serve does (found by review: add_settings made it a quiet one-shot command).
    add_settings_arguments(parser, tuple(Settings.model_fields))
    parser.set_defaults(run=run)


class _StoppedDeployingError(Exception):
    """A stop signal while the application deploys (raised by the handler, in the main
    thread, out of Serve's wait)."""


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    try:
        from kvwarm.cluster import deploy
    except ImportError as exc:
        raise ConfigError(
            f"kvwarm cluster needs the cluster extra (kvwarm[cluster]): {exc}"
        ) from exc
    deploy.routing_config(settings)  # an unknown routing policy fails before Ray starts
    # Before Ray's threads: the kernels the replicas' models compute with, handed to each
    # replica's process (``deploy.build_app``), which loads them where it cannot decide.
    decide_kernels(settings, settings.models)
    deploy.start_ray(settings.ray_address, node_ip=settings.node_ip)
    stop = threading.Event()
    deploying = True

    def on_stop(*_: object) -> None:
        stop.set()
        if deploying:  # Serve waits for the application with no deadline: leave that wait
            raise _StoppedDeployingError

    # After ray.init: Ray installs its own SIGTERM handler in the driver (a stack dump and an
    # abort); a requested shutdown must remove the application and exit 0 instead.
    try:
        with stop_signals(on_stop):
            deploy.run(settings)
            deploying = False
            print(
                f"kvwarm cluster: http://{settings.host}:{settings.port} (Ctrl-C stops)", flush=True
            )
            stop.wait()
    except _StoppedDeployingError:
        pass  # stopped before the application ran: remove what was deployed
    finally:
        deploy.shutdown(owned=not settings.ray_address)
    return 0
