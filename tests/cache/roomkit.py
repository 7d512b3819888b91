"""Shared by the ram tier's room tests (``test_hold_room_atomic.py``, ``test_room_landed.py``):
a ram tier in front of a disk tier, and which tier holds a row."""

from __future__ import annotations

from pathlib import Path

from kvwarm.cache import Cache, CacheConfig, TierConfig

DISK = 1_000_000


def two_tiers(root: Path, ram: int) -> CacheConfig:
    """A ``ram``-byte ram tier before a disk tier at ``root``, 128-token chunks, two writers."""
    return CacheConfig(
        tiers=(TierConfig("ram", ram), TierConfig("disk", DISK, root)),
        chunk_tokens=128,
        writer_threads=2,
    )


def tier_of(cache: Cache, key: bytes) -> str | None:
    info = cache.lookup_exact(key)
    return None if info is None else info.tier
