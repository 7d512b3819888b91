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
