"""Configuration checks for the cache: a ``ConfigError`` naming the first bad field.

Invariant: pure; nothing here does I/O or keeps state. ``Cache`` runs ``validate_cache_config``
on construction; the engine runs ``validate_policy`` on a model's save policy.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from kvwarm.cache.eviction.base import registered_policies
from kvwarm.cache.tiers.registry import check_name, check_url, registered_tiers, tier_spec
from kvwarm.cache.types import (
    TIER_SERIES,
    TIER_TOTALS,
    CacheConfig,
    PolicyConfig,
    PressureConfig,
    S3Config,
    TierConfig,
)
from kvwarm.errors import ConfigError

__all__ = [
    "validate_cache_config",
    "validate_policy",
    "validate_pressure_config",
    "validate_s3_config",
    "validate_tier_config",
]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need_int(obj: str, name: str, value: object, *, minimum: int) -> None:
    if not _is_int(value):
        raise ConfigError(f"{obj}.{name} must be an integer, got {value!r}")
    assert isinstance(value, int)
    if value < minimum:
        raise ConfigError(f"{obj}.{name} must be >= {minimum}, got {value}")


def _need_number(obj: str, name: str, value: object, *, minimum: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{obj}.{name} must be a finite number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{obj}.{name} must be >= {minimum}, got {value}")
    return float(value)


def validate_policy(policy: PolicyConfig) -> None:
    """``ConfigError`` naming the first bad field of a ``PolicyConfig``."""
    obj = "policy"
    for name in ("min_tokens", "cold_min_tokens", "boundary_trim_tokens", "checkpoint_gap_tokens"):
        _need_int(obj, name, getattr(policy, name), minimum=0)
    for name in ("session_resume_wait_ms", "evict_save_timeout_ms"):
        _need_int(obj, name, getattr(policy, name), minimum=0)
    _need_int(obj, "cold_max_tokens", policy.cold_max_tokens, minimum=1)
    _need_int(obj, "continued_interval", policy.continued_interval, minimum=1)
    _need_int(obj, "boundary_align_tokens", policy.boundary_align_tokens, minimum=1)
    if policy.cold_min_tokens > policy.cold_max_tokens:
        raise ConfigError(
            f"policy.cold_min_tokens ({policy.cold_min_tokens}) exceeds "
            f"cold_max_tokens ({policy.cold_max_tokens}): no cold save could ever happen"
        )


def validate_s3_config(cfg: S3Config, obj: str = "s3") -> None:
    """``ConfigError`` for a timeout that is not a finite number > 0 (botocore refuses <= 0
    only once it connects; nan it takes, and waits for ever), too few attempts, an outage
    pause that is not finite and >= 0 (``inf``: the store skipped for good after one fault),
    or a speed floor that is not a whole number >= 0."""
    for name in ("connect_timeout_s", "read_timeout_s"):
        if _need_number(obj, name, getattr(cfg, name), minimum=0.0) <= 0:
            raise ConfigError(f"{obj}.{name} must be > 0, got {getattr(cfg, name)}")
    _need_int(obj, "max_attempts", cfg.max_attempts, minimum=1)
    _need_number(obj, "down_for_s", cfg.down_for_s, minimum=0.0)
    _need_int(obj, "min_bytes_per_s", cfg.min_bytes_per_s, minimum=0)


def validate_tier_config(tier: TierConfig) -> None:
    if tier.url is not None:
        check_name(tier.name)
        check_url(tier)  # ConfigError for a scheme no store registered, or a URL it refuses
        _need_int(f"tier {tier.name}", "quota_bytes", tier.quota_bytes, minimum=0)
        if tier.root is not None or tier.s3 is not None or tier.shared:
            raise ConfigError(f"tier {tier.name}: a URL names the store; root/shared/s3 go")
        return
    spec = tier_spec(tier.name)  # ConfigError for a name no tier registered
    _need_int(f"tier {tier.name}", "quota_bytes", tier.quota_bytes, minimum=0)
    if not spec.needs_root:
        if tier.root is not None:
            raise ConfigError(f"tier {tier.name} takes no root directory (it is not a file tier)")
    elif tier.root is None:
        raise ConfigError(f"tier {tier.name} is a file tier and needs a root directory")
    if tier.shared and not spec.needs_root:
        raise ConfigError(f"tier {tier.name}: only a file tier's directory can be marked shared")
    if tier.s3 is not None:
        validate_s3_config(tier.s3, f"tier {tier.name}")


def validate_pressure_config(cfg: PressureConfig, configured: Collection[str] = ()) -> None:
    obj = "pressure"
    if cfg.source not in ("noop", "system", "nvidia"):
        raise ConfigError(f"pressure.source must be noop, system or nvidia, got {cfg.source!r}")
    _need_int(obj, "interval_ms", cfg.interval_ms, minimum=1)
    _need_int(obj, "min_evict_bytes", cfg.min_evict_bytes, minimum=0)
    high = _need_number(obj, "high_watermark", cfg.high_watermark, minimum=0.0)
    low = _need_number(obj, "low_watermark", cfg.low_watermark, minimum=0.0)
    if not 0.0 < high <= 1.0:
        raise ConfigError(f"pressure.high_watermark must be in (0, 1], got {high}")
    if low >= high:
        raise ConfigError(
            f"pressure.low_watermark ({low}) must be below high_watermark ({high}), "
            "otherwise eviction can never bring the ratio back under the low mark"
        )
    if not cfg.evict_tiers:
        raise ConfigError("pressure.evict_tiers is empty: the scheduler could evict nothing")
    for name in cfg.evict_tiers:
        if name not in registered_tiers() and name not in configured:
            raise ConfigError(f"pressure.evict_tiers names unknown tier {name!r}")
    # A built-in name not configured (the default names both memory tiers, ``ram`` and
    # ``ram_file``) is skipped by the scheduler; with none configured it could free nothing
    # (found by review: every tick failed on the tier it lacked, and none ever evicted).
    if cfg.enabled and configured and not any(name in configured for name in cfg.evict_tiers):
        raise ConfigError(
            f"pressure.evict_tiers ({', '.join(cfg.evict_tiers)}) names no configured tier "
            f"(tiers: {', '.join(configured)}): the scheduler could evict nothing"
        )


def _check_counter_names(name: str, others: Collection[str]) -> None:
    """A tier's counters are named ``tier_<name>_<series>``: two tiers whose names would give
    one name to two of them (``a``'s ``quota_bytes`` and ``a_quota``'s ``bytes``) would
    report one value for both, and ``/metrics`` a series twice (found by review)."""
    series = (*TIER_SERIES, *TIER_TOTALS)
    mine = {f"{name}_{s}" for s in series}
    for other in others:
        clash = sorted(mine & {f"{other}_{s}" for s in series})
        if clash:
            raise ConfigError(
                f"tiers {other} and {name}: both would report a counter tier_{clash[0]}; rename one"
            )
    # Alone, too: ``/metrics`` reads ``tier_<name>_<series>`` as the shortest name that leaves
    # a known series, so ``x_restored``'s ``bytes`` read as tier ``x``'s ``restored_bytes``
    # (a counter, under another tier's label; found by review).
    for own in series:
        longer = [s for s in series if len(s) > len(own) and f"{name}_{own}".endswith(f"_{s}")]
        if longer:
            reads_as = f"{name}_{own}"[: -len(longer[0]) - 1]
            raise ConfigError(
                f"tier {name}: its counter tier_{name}_{own} would read as tier {reads_as}'s "
                f"{longer[0]}; rename it"
            )


def validate_cache_config(cfg: CacheConfig) -> None:
    """``ConfigError`` for any inconsistency in a ``CacheConfig``; called by ``Cache``."""
    # Found by review: a tier given by its name alone (``tiers=("ram",)``) was an
    # AttributeError from below, ``tiers="ram"`` one for each letter, ``ttl_seconds=60`` a
    # TypeError from len().
    if not isinstance(cfg.tiers, tuple | list):
        raise ConfigError(
            f"cache.tiers must be a tuple of TierConfig, not {type(cfg.tiers).__name__}"
        )
    for tier in cfg.tiers:
        if not isinstance(tier, TierConfig):
            raise ConfigError(
                f"each of cache.tiers must be a TierConfig, not {type(tier).__name__} "
                f"({tier!r}: TierConfig({tier!r}, quota_bytes) names a tier)"
            )
    if not isinstance(cfg.ttl_seconds, tuple | list):
        raise ConfigError(
            f"cache.ttl_seconds needs three values: short, long, extended; got {cfg.ttl_seconds!r}"
        )
    if not isinstance(cfg.pressure, PressureConfig):
        raise ConfigError(
            f"cache.pressure must be a PressureConfig, not {type(cfg.pressure).__name__}"
        )
    if not cfg.tiers:
        raise ConfigError("cache needs at least one tier")
    seen: set[str] = set()
    roots: dict[str, str] = {}
    for tier in cfg.tiers:
        validate_tier_config(tier)
        if tier.name in seen:
            raise ConfigError(f"tier {tier.name} configured twice")
        _check_counter_names(tier.name, seen)
        seen.add(tier.name)
        if tier.root is not None:
            root = str(tier.root)
            if root in roots:
                # Two tiers scanning one directory would adopt (and evict) each other's rows.
                raise ConfigError(f"tiers {roots[root]} and {tier.name} share the root {root}")
            roots[root] = tier.name
    _need_int("cache", "writer_threads", cfg.writer_threads, minimum=1)
    _need_int("cache", "writer_queue", cfg.writer_queue, minimum=1)
    _need_number("cache", "reservation_ttl_s", cfg.reservation_ttl_s, minimum=0.001)
    _need_number("cache", "sweep_interval_s", cfg.sweep_interval_s, minimum=0.001)
    _need_int("cache", "probe_max", cfg.probe_max, minimum=0)
    _need_int("cache", "probe_parallel", cfg.probe_parallel, minimum=1)
    _need_int("cache", "chunk_tokens", cfg.chunk_tokens, minimum=0)
    _need_int("cache", "state_history", cfg.state_history, minimum=-1)
    if cfg.promote_tier is not None and cfg.promote_tier not in seen:
        raise ConfigError(f"cache.promote_tier names a tier not configured: {cfg.promote_tier}")
    if len(cfg.ttl_seconds) != 3:
        raise ConfigError("cache.ttl_seconds needs three values: short, long, extended")
    for i, ttl in enumerate(cfg.ttl_seconds):
        _need_number("cache", f"ttl_seconds[{i}]", ttl, minimum=0.001)
    if cfg.eviction not in registered_policies():
        known = ", ".join(registered_policies())
        raise ConfigError(f"cache.eviction {cfg.eviction!r} is unknown; expected one of {known}")
    validate_pressure_config(cfg.pressure, seen)
