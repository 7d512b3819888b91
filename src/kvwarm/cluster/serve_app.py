"""The kvwarm application for Ray Serve's own deployment tools (``serve run``, a KubeRay
``RayService``'s ``serveConfigV2``): ``import_path: kvwarm.cluster.serve_app:app``.

Invariant: built once on import from ``load_settings()`` (the ``KVWARM_*`` variables of the
runtime environment, then ``$KVWARM_CONFIG``), exactly as ``kvwarm cluster`` builds it from its
flags, so a ``RayService`` and the CLI deploy the same application (docs/cluster.md), spread
over the nodes alive at import. Serve's proxy settings come from the Serve config there, not
from ``host``/``port``.
"""

from __future__ import annotations

import ray
from ray.serve.deployment import Application

from kvwarm.cluster.deploy import alive_nodes, build_app
from kvwarm.settings import load_settings

# Serve imports this in a Ray process: the replicas are spread over the nodes alive then.
app: Application = build_app(load_settings(), nodes=alive_nodes() if ray.is_initialized() else None)
