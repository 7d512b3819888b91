"""The worker's save gates: boundaries and when to save (pure)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwarm.cache.types import PolicyConfig
from kvwarm.engine.worker.savegates import (
    aligned_boundary,
    cold_save_length,
    should_continued_save,
    should_finish_save,
)


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
