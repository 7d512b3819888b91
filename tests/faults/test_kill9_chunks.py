"""kill -9 a chunked save after every step of its chunks' and its manifest's publish, restart.

After a restart (scan): every acknowledged row restores byte-exactly; the interrupted row is
absent or complete (complete exactly when the kill came after its manifest was linked); no
manifest names a missing chunk; no temp file remains; chunks no manifest names (orphans) are
adopted unreferenced and evicted before any row.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from tests.cache.chunkkit import blob, join
from tests.cache.tierkit import NS
from tests.faults.test_kill9 import killed
from tests.faults.writer_child import chunked_rows
from tests.rediskit import RedisServer

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.protocols import PacksChunks
from kvwarm.cache.tiers.files import PUBLISH_STEPS
from kvwarm.cache.tiers.publish import CHUNK_STEPS

STEPS = [*CHUNK_STEPS, *PUBLISH_STEPS]
N_ACKED = 2


@pytest.mark.parametrize("step", STEPS)
def test_kill9_at_every_chunk_and_manifest_step(tmp_path: Path, step: str) -> None:
    root = tmp_path / "kvc"
    lines, acked = killed("chunked", str(root), "disk", step, str(N_ACKED))
    rows = chunked_rows(N_ACKED)
    assert acked == [cache_key(NS, t) for t in rows[:N_ACKED]]
    victim = cache_key(NS, rows[N_ACKED])
    assert f"VICTIM {victim.hex()}" in lines

    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=256)
    with Cache(cfg, background=False) as cache:  # the restart
        assert not [n for n in os.listdir(root) if n.endswith(".tmp")]
        for key, tokens in zip(acked, rows, strict=False):
            with cache.open_row(key) as row:
                assert join(row.chunks) == blob(tokens)
        manifest_linked = step in PUBLISH_STEPS and PUBLISH_STEPS.index(step) >= (
            PUBLISH_STEPS.index("linked")
        )
        assert (cache.lookup_exact(victim) is not None) == manifest_linked
        if manifest_linked:
            with cache.open_row(victim) as row:
                assert join(row.chunks) == blob(rows[N_ACKED])
            return
        # The victim's new chunks that reached their names are orphans: evicted first, and
        # the acknowledged rows stay whole.
        before = cache.counters()["tier_disk_bytes"]
        freed = cache.evict_bytes(1 << 40, ["disk"])
        assert freed.bytes <= before
        assert not [n for n in os.listdir(root) if n.endswith((".kvk", ".kvc"))]


@pytest.mark.parametrize("step", CHUNK_STEPS)
def test_orphans_go_before_rows(tmp_path: Path, step: str) -> None:
    root = tmp_path / "kvc"
    killed("chunked", str(root), "disk", step, str(N_ACKED))
    rows = chunked_rows(N_ACKED)
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=256)
    with Cache(cfg, background=False) as cache:
        orphans = [
            n for n in os.listdir(root) if n.endswith(".kvk")
        ]  # 2 shared + 3 per acked row, + the victim's linked ones
        n_orphans = len(orphans) - (2 + 3 * N_ACKED)
        assert n_orphans == (0 if step == "chunk_tmp_synced" else 1)
        freed = cache.evict_bytes(1)
        assert freed.rows == (1 if n_orphans == 0 else 0)
        if n_orphans:
            for tokens in rows[:N_ACKED]:
                with cache.open_row(cache_key(NS, tokens)) as row:
                    assert join(row.chunks) == blob(tokens)


#: The steps of a save into a tier with packs (redis): its pack put, the manifest checked
#: (not yet put), then put (``marked_linked``) and published.
PACK_STEPS = ("pack_linked", "checked", "marked_linked", "published")


@pytest.mark.parametrize("step", PACK_STEPS)
def test_kill9_between_a_pack_and_its_manifest(redis_server: RedisServer, step: str) -> None:
    """A save into a tier with packs killed after its pack is put and before its manifest
    (or after it): every acknowledged row restores byte-exactly; the victim is absent, its
    pack an orphan no manifest names (the sweep's), or it is whole."""
    url = redis_server.url()
    _, acked = killed("packed", url, step, str(N_ACKED))
    rows = chunked_rows(N_ACKED)
    assert acked == [cache_key(NS, t) for t in rows[:N_ACKED]]
    victim = cache_key(NS, rows[N_ACKED])
    cfg = CacheConfig(tiers=(TierConfig("shared", 1 << 30, url=url),), chunk_tokens=256)
    with Cache(cfg, background=False) as cache:  # the restart: another process
        packs = cache._tiers["shared"]
        assert isinstance(packs, PacksChunks)
        # One pack per save, the victim's put before any of these steps.
        assert len(list(packs.pack_ages())) == N_ACKED + 1
        for key, tokens in zip(acked, rows, strict=False):
            with cache.open_row(key) as row:
                assert join(row.chunks) == blob(tokens)
        linked = step in ("marked_linked", "published")
        assert (cache.lookup_exact(victim) is not None) == linked
        if linked:
            with cache.open_row(victim) as row:
                assert join(row.chunks) == blob(rows[N_ACKED])
            return
        # The victim's pack is an orphan: no manifest names it, the sweep takes it once old.
        [swept] = cache.gc_shared(grace_s=3600.0, now=time.time() + 7200.0)
        assert (swept.packs, swept.packs_deleted) == (N_ACKED + 1, 1)
        for key, tokens in zip(acked, rows, strict=False):
            with cache.open_row(key) as row:
                assert join(row.chunks) == blob(tokens)
