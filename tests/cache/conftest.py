"""Fixtures the cache's chunk tests share: a ``Cache`` over each kind of tier."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.cache.tierkit import shm_dir
from tests.s3kit import MotoServer

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.protocols import Tier
from kvwarm.cache.tiers.s3 import S3Tier

CacheFactory = Callable[..., Cache]


@pytest.fixture(params=["ram", "ram_file", "disk", "s3"])
def make_cache(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CacheFactory]:
    name = request.param
    made: list[Cache] = []

    def build(quota: int = 1 << 30, chunk_tokens: int = 256) -> Cache:
        cfg = CacheConfig(tiers=(TierConfig(name, quota, root=root),), chunk_tokens=chunk_tokens)
        tiers: list[Tier] | None = None
        if name == "s3":
            tiers = [S3Tier(s3_config, quota)]
            cfg = CacheConfig(tiers=(TierConfig("ram", quota),), chunk_tokens=chunk_tokens)
        cache = Cache(cfg, tiers=tiers, background=False)
        made.append(cache)
        return cache

    root: Path | None = None
    if name == "s3":
        server: MotoServer = request.getfixturevalue("moto_server")
        s3_config = server.config(server.new_bucket())
    if name == "ram_file":
        with shm_dir() as d:
            root = d
            yield build
            for c in made:
                c.close()
        return
    if name == "disk":
        root = tmp_path / "kvc"
    yield build
    for c in made:
        c.close()


@pytest.fixture
def chunk_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiers with packs (s3, redis) write each chunk as its own object, as kvwarm did before
    packs: the rows an older kvwarm left in a shared store (``tests/cache/test_packs.py``
    tests packs themselves). Only this process: a child process writes packs."""
    from dataclasses import replace

    from kvwarm.cache.protocols import TierCapabilities
    from kvwarm.cache.tiers.objects import ObjectTier

    def unpacked(self: ObjectTier) -> TierCapabilities:
        return replace(self._capabilities, packs=False, pack_writes=False)

    monkeypatch.setattr(ObjectTier, "capabilities", property(unpacked))
