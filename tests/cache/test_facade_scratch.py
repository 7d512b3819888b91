"""Reusable read buffers behind ``open_row`` on file tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.cache.facadekit import req

from kvwarm.cache import Cache
from kvwarm.cache.types import CacheConfig, TierConfig


def disk_cache(tmp_path: Path) -> Cache:
    return Cache(
        CacheConfig(tiers=(TierConfig("disk", 1 << 30, tmp_path / "disk"),)), background=False
    )


def test_rows_read_into_one_reused_buffer_per_thread(tmp_path: Path) -> None:
    with disk_cache(tmp_path) as c:
        small, big = req((1,) * 41, 1000, tier="disk"), req((2,) * 42, 5000, tier="disk")
        assert c.save(small, sync=True) and c.save(big, sync=True)
        k_small, k_big = (
            c.key_for(small.namespace, small.tokens),
            c.key_for(big.namespace, big.tokens),
        )
        with c.open_row(k_big) as row:
            assert bytes(row.payload) == big.payload
        first = c._scratch._local.buf
        with c.open_row(k_small) as row:
            assert bytes(row.payload) == small.payload  # a view of exactly this row's bytes
        assert c._scratch._local.buf is first  # the big buffer served the small row too


def test_nested_opens_on_one_thread_never_share_a_buffer(tmp_path: Path) -> None:
    with disk_cache(tmp_path) as c:
        a, b = req((3,) * 43, 3000, tier="disk"), req((4,) * 44, 3000, tier="disk")
        assert c.save(a, sync=True) and c.save(b, sync=True)
        ka, kb = c.key_for(a.namespace, a.tokens), c.key_for(b.namespace, b.tokens)
        with c.open_row(ka) as ra:
            pass
        with c.open_row(ka) as ra, c.open_row(kb) as rb:
            assert bytes(ra.payload) == a.payload
            assert bytes(rb.payload) == b.payload


def test_a_payload_kept_past_open_row_is_released_not_stale(tmp_path: Path) -> None:
    with disk_cache(tmp_path) as c:
        a = req((5,) * 45, 2000, tier="disk")
        assert c.save(a, sync=True)
        with c.open_row(c.key_for(a.namespace, a.tokens)) as row:
            kept = row.payload
        with pytest.raises(ValueError):
            bytes(kept)
