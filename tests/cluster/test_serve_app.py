"""``kvwarm.cluster.serve_app:app``, what a KubeRay ``RayService`` imports: the application
``kvwarm cluster`` deploys, built from the ``KVWARM_*`` variables (no Ray needed to build it)."""

from __future__ import annotations

import importlib
import sys

import pytest
from ray.serve.deployment import Application

from kvwarm.errors import ConfigError


def build(monkeypatch: pytest.MonkeyPatch, **env: str) -> Application:
    monkeypatch.setenv("KVWARM_CONFIG", "/nonexistent-kvwarm.toml")
    monkeypatch.delenv("KVWARM_CONFIG")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sys.modules.pop("kvwarm.cluster.serve_app", None)
    module = importlib.import_module("kvwarm.cluster.serve_app")
    app: Application = module.app
    return app


def test_the_application_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    app = build(monkeypatch, KVWARM_BACKEND="stub", KVWARM_MODEL="stub-a", KVWARM_REPLICAS="3")
    ingress = app._bound_deployment  # type: ignore[attr-defined]
    engine = ingress.init_args[1]._bound_deployment  # the engine deployment, bound as its arg
    assert engine.num_replicas == 3
    settings = ingress.init_args[0]
    assert settings.replicas == 3 and settings.backend == "stub"


def test_a_bad_routing_policy_fails_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="unknown routing policy"):
        build(monkeypatch, KVWARM_BACKEND="stub", KVWARM_CLUSTER_ROUTING="nope")


@pytest.mark.parametrize("switch", ["0", None])
def test_each_replica_gets_the_kernels_its_command_decided(
    monkeypatch: pytest.MonkeyPatch, switch: str | None
) -> None:
    """A replica loads its models in a Ray actor, where other threads run and its load may
    not set llama.cpp's kernel switch (``GGML_CPU_TILED_MM``); ``kvwarm cluster`` decides it
    at its start (``cli/common.decide_kernels``) and each replica's process starts with it."""
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    env = {} if switch is None else {"GGML_CPU_TILED_MM": switch}
    app = build(monkeypatch, KVWARM_BACKEND="stub", KVWARM_MODEL="stub-a", **env)
    engine = app._bound_deployment.init_args[1]._bound_deployment  # type: ignore[attr-defined]
    assert engine.ray_actor_options.get("runtime_env", {}).get("env_vars", {}) == env
