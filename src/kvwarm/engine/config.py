"""Engine and model configuration: frozen values, validated before anything native is built.

Invariant: ``validate()`` raises ``ConfigError`` naming the first bad field, so a bad
configuration never reaches llama.cpp (``docs/architecture.md``, "Engine").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwarm.backends.base import Backend, ContextParams, ModelParams
from kvwarm.cache.policy import validate_policy
from kvwarm.cache.types import CacheConfig, PolicyConfig, TierName
from kvwarm.engine.batching import StrategyName, strategy
from kvwarm.engine.fingerprint import parse_mode
from kvwarm.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Per-model options. ``context.n_ctx`` is the window of *one* request (slot); the
    context is created with ``n_ctx * n_parallel`` cells shared by ``n_parallel`` slots."""

    backend: str | Backend | None = None  # a name, an instance, or None: the engine's default
    context: ContextParams = field(default_factory=ContextParams)
    model_params: ModelParams = field(default_factory=ModelParams)
    n_parallel: int = 1
    policy: PolicyConfig | None = None  # None: the engine's default policy
    save_tier: TierName | None = None  # None: the engine's first configured tier
    fingerprint_mode: str = "safe"
    fingerprint: bytes | None = None
    deterministic: bool = False
    max_queue: int = 256
    batch_strategy: StrategyName = "decode_first"

    def validate(self) -> None:
        self.context.validate()
        if not 1 <= self.n_parallel <= 64:
            raise ConfigError(f"n_parallel must be in [1, 64], got {self.n_parallel}")
        if self.n_parallel > self.context.n_batch:
            # Every generating slot puts one token in each tick's batch.
            raise ConfigError(
                f"n_parallel ({self.n_parallel}) must be <= n_batch ({self.context.n_batch})"
            )
        if self.max_queue < 1:
            raise ConfigError("max_queue must be >= 1")
        parse_mode(self.fingerprint_mode)
        strategy(self.batch_strategy)
        if self.policy is not None:
            validate_policy(self.policy)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    backend: str = "llama_cpp"
    policy: PolicyConfig = field(default_factory=PolicyConfig)
