"""Tiers by name: how a ``TierConfig`` becomes a ``Tier``.

Invariant: the facade and the config validation learn what tiers exist only from this
registry, so adding a tier is a ``Tier`` implementation plus one ``register_tier`` call, with
no edit to the facade, the index or the validation. The built-in tiers ``ram``, ``ram_file``,
``disk`` and ``s3`` register themselves below (``s3`` imports boto3 only when built). See
docs/architecture.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvwarm.cache.protocols import Tier
from kvwarm.cache.types import TierConfig
from kvwarm.errors import ConfigError

__all__ = [
    "TierOptions",
    "TierSpec",
    "build_tier",
    "register_tier",
    "registered_tiers",
    "tier_spec",
    "unregister_tier",
]


@dataclass(frozen=True, slots=True)
class TierOptions:
    """How the cache opens its tiers: ``repair=False`` means a scan moves and deletes nothing
    (``kvwarm cache verify``)."""

    repair: bool = True


TierFactory = Callable[[TierConfig, TierOptions], Tier]


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    factory: TierFactory
    needs_root: bool  # the TierConfig must name a root directory (and must not otherwise)


_lock = threading.Lock()
_specs: dict[str, TierSpec] = {}


def register_tier(name: str, factory: TierFactory, *, needs_root: bool) -> None:
    """Make ``name`` configurable. Registering a name twice replaces the earlier factory
    (tests, or a deployment overriding a built-in)."""
    if not name or not name.replace("_", "").isalnum():
        raise ConfigError(f"tier names are [A-Za-z0-9_]+ (they appear in metric names): {name!r}")
    with _lock:
        _specs[name] = TierSpec(name, factory, needs_root)


def unregister_tier(name: str) -> None:
    with _lock:
        _specs.pop(name, None)


def tier_spec(name: str) -> TierSpec:
    spec = _specs.get(name)
    if spec is None:
        known = ", ".join(registered_tiers())
        raise ConfigError(f"unknown tier {name!r}; expected one of {known}")
    return spec


def registered_tiers() -> tuple[str, ...]:
    with _lock:
        return tuple(_specs)


def build_tier(config: TierConfig, options: TierOptions) -> Tier:
    return tier_spec(config.name).factory(config, options)


def _ram(config: TierConfig, options: TierOptions) -> Tier:
    from kvwarm.cache.tiers.ram import RamTier

    return RamTier(config.quota_bytes, name=config.name)


def _file(config: TierConfig, options: TierOptions) -> Tier:
    from kvwarm.cache.tiers.files import FileTier

    assert config.root is not None  # validated: the spec needs a root
    return FileTier(
        config.name,
        config.root,
        config.quota_bytes,
        repair=options.repair,
        shared_dir=config.shared,
    )


def _s3(config: TierConfig, options: TierOptions) -> Tier:
    from kvwarm.cache.tiers.s3 import S3Tier

    if config.s3 is None:
        raise ConfigError(f"tier {config.name} needs an s3 configuration (bucket, endpoint...)")
    return S3Tier(config.s3, config.quota_bytes, name=config.name, repair=options.repair)


register_tier("ram", _ram, needs_root=False)
register_tier("ram_file", _file, needs_root=True)
register_tier("disk", _file, needs_root=True)
register_tier("s3", _s3, needs_root=False)
