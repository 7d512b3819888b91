"""Pure policy: boundaries, save gates, configuration validation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwarm.cache.policy import (
    aligned_boundary,
    cold_save_length,
    should_continued_save,
    should_finish_save,
    validate_cache_config,
    validate_policy,
)
from kvwarm.cache.types import CacheConfig, PolicyConfig, PressureConfig, TierConfig
from kvwarm.errors import ConfigError


def test_aligned_boundary_examples() -> None:
    assert aligned_boundary(5000, 32, 2048) == 4096
    assert aligned_boundary(4128, 32, 2048) == 4096
    assert aligned_boundary(4127, 32, 2048) == 2048
    assert aligned_boundary(2079, 32, 2048) == 0
    assert aligned_boundary(10, 32, 2048) == 0
    assert aligned_boundary(100, 0, 1) == 100
    with pytest.raises(ValueError):
        aligned_boundary(10, 0, 0)


@given(st.integers(0, 100_000), st.integers(0, 500), st.integers(1, 4096))
def test_aligned_boundary_properties(n: int, trim: int, align: int) -> None:
    b = aligned_boundary(n, trim, align)
    assert b % align == 0
    assert 0 <= b <= max(0, n - trim)
    assert n - trim - b < align  # the largest such multiple


def test_cold_save_gates() -> None:
    p = PolicyConfig()
    assert cold_save_length(511, p) == 0  # under cold_min_tokens
    assert cold_save_length(2079, p) == 0  # boundary 0
    assert cold_save_length(2080, p) == 2048
    assert cold_save_length(100_000, p) == 28_672  # capped at cold_max aligned down
    small = replace(p, boundary_align_tokens=64, min_tokens=256, cold_min_tokens=100)
    assert cold_save_length(300, small) == 256
    assert cold_save_length(250, small) == 0  # boundary 192 < min_tokens


def test_continued_and_finish_gates() -> None:
    p = PolicyConfig(continued_interval=100, min_tokens=50)
    assert not should_continued_save(40, 0, p)
    assert not should_continued_save(199, 100, p)
    assert should_continued_save(200, 100, p)
    assert should_finish_save(50, p) and not should_finish_save(49, p)


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        (CacheConfig(tiers=()), "at least one tier"),
        (CacheConfig(tiers=(TierConfig("ram", -1),)), "quota_bytes"),
        (CacheConfig(tiers=(TierConfig("ram", 1, Path("/tmp/x")),)), "no root"),
        (CacheConfig(tiers=(TierConfig("disk", 1),)), "needs a root"),
        (CacheConfig(tiers=(TierConfig("ram", 1), TierConfig("ram", 2))), "twice"),
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
