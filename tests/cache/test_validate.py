"""Configuration checks for the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwarm.cache.types import (
    TIER_SERIES,
    TIER_TOTALS,
    CacheConfig,
    PolicyConfig,
    PressureConfig,
    TierConfig,
)
from kvwarm.cache.validate import validate_cache_config, validate_policy
from kvwarm.errors import ConfigError


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        (CacheConfig(tiers=()), "at least one tier"),
        (CacheConfig(tiers=(TierConfig("ram", -1),)), "quota_bytes"),
        (CacheConfig(tiers=(TierConfig("ram", 1, Path("/tmp/x")),)), "no root"),
        (CacheConfig(tiers=(TierConfig("disk", 1),)), "needs a root"),
        (CacheConfig(tiers=(TierConfig("ram", 1), TierConfig("ram", 2))), "twice"),
        # Their counters would clash: a's quota_bytes is a_quota's bytes (a series twice).
        (
            CacheConfig(
                tiers=(
                    TierConfig("a", 1, url="file:///tmp/kv-a"),
                    TierConfig("a_quota", 1, url="file:///tmp/kv-b"),
                )
            ),
            "tiers a and a_quota: both would report a counter tier_a_quota_bytes",
        ),
        (
            CacheConfig(
                tiers=(
                    TierConfig("x_restored", 1, url="file:///tmp/kv-a"),
                    TierConfig("x", 1, url="file:///tmp/kv-b"),
                )
            ),
            "tier_x_restored_bytes",
        ),
        # Alone too: /metrics read x_restored's bytes as tier x's restored_bytes, a_quota's as
        # a's quota_bytes (the shortest name leaving a known series; found by review).
        (
            CacheConfig(tiers=(TierConfig("x_restored", 1, url="file:///tmp/kv-a"),)),
            "tier x_restored: its counter tier_x_restored_bytes would read as tier x's "
            "restored_bytes",
        ),
        (
            CacheConfig(tiers=(TierConfig("hot_effective", 1, url="file:///tmp/kv-a"),)),
            "would read as tier hot's effective_quota_bytes",
        ),
        (
            CacheConfig(
                tiers=(
                    TierConfig("disk", 1, Path("/tmp/a")),
                    TierConfig("ram_file", 1, Path("/tmp/a")),
                )
            ),
            "share the root",
        ),
        (CacheConfig(tiers=(TierConfig("nvme", 1, Path("/x")),)), "unknown tier"),  # type: ignore[arg-type]
        (CacheConfig(writer_threads=0), "writer_threads"),
        (CacheConfig(writer_queue=0), "writer_queue"),
        (CacheConfig(reservation_ttl_s=0), "reservation_ttl_s"),
        (CacheConfig(ttl_seconds=(1.0, 2.0)), "three values"),  # type: ignore[arg-type]
        (CacheConfig(ttl_seconds=(1.0, -2.0, 3.0)), "ttl_seconds[1]"),
        (CacheConfig(pressure=PressureConfig(low_watermark=0.9, high_watermark=0.9)), "below"),
        (CacheConfig(pressure=PressureConfig(high_watermark=1.5)), "(0, 1]"),
        (CacheConfig(pressure=PressureConfig(interval_ms=0)), "interval_ms"),
        (CacheConfig(pressure=PressureConfig(min_evict_bytes=-1)), "min_evict_bytes"),
        (CacheConfig(pressure=PressureConfig(evict_tiers=())), "evict nothing"),
        (CacheConfig(pressure=PressureConfig(source="gpu")), "source"),  # type: ignore[arg-type]
        (CacheConfig(writer_threads=True), "integer"),
    ],
)
def test_bad_cache_configs(cfg: CacheConfig, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        validate_cache_config(cfg)
    assert needle in str(ei.value)


def test_an_accepted_tier_names_its_own_counters_in_metrics() -> None:
    """Every name the check lets through reads back, in ``/metrics``, as its own tier's."""
    from kvwarm.server.metrics import _TIER_KEY

    for name in ("restored", "disk", "s3_eu", "ram_2", "quota", "bytes"):
        validate_cache_config(CacheConfig(tiers=(TierConfig(name, 1, url="file:///tmp/kv"),)))
        for series in (*TIER_SERIES, *TIER_TOTALS):
            parsed = _TIER_KEY.match(f"tier_{name}_{series}")
            assert parsed is not None and parsed.groups() == (name, series)


def test_stats_keeps_a_tier_named_restored_bytes() -> None:
    """``kvwarm cache stats`` drops the tiers' restore counts (a server's), by their exact
    names: a suffix dropped tier ``restored``'s ``tier_restored_bytes`` too (found by review)."""
    from kvwarm.cli.cache_cmd import _levels

    counters = {"tier_restored_bytes": 5.0, "tier_restored_restores": 0.0, "hits_exact": 1.0}
    assert _levels(counters, ["restored"]) == {"tier_restored_bytes": 5.0}


def test_default_configs_are_valid() -> None:
    validate_cache_config(CacheConfig())
    validate_policy(PolicyConfig())


@pytest.mark.parametrize(
    ("policy", "needle"),
    [
        (PolicyConfig(boundary_align_tokens=0), "boundary_align_tokens"),
        (PolicyConfig(continued_interval=0), "continued_interval"),
        (PolicyConfig(min_tokens=-1), "min_tokens"),
        (PolicyConfig(cold_min_tokens=10, cold_max_tokens=5), "no cold save"),
        (PolicyConfig(session_resume_wait_ms=-5), "session_resume_wait_ms"),
        (PolicyConfig(checkpoint_gap_tokens=-1), "checkpoint_gap_tokens"),
    ],
)
def test_bad_policies(policy: PolicyConfig, needle: str) -> None:
    with pytest.raises(ConfigError) as ei:
        validate_policy(policy)
    assert needle in str(ei.value)
