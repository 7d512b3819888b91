"""kill -9 a checkpoint's save whose window is stored in chunks (KVC version 4), after every
step of its first-cache chunk, of its first and last window chunks and of its manifest,
then restart.

After the restart (scan): every acknowledged checkpoint restores byte-exactly (its first cache
and its window); the interrupted one is absent or complete (complete exactly when the kill
came after its manifest was linked); no manifest names a missing chunk; no temp file remains;
the window chunks that reached their names unnamed are orphans, evicted before any row.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.cache.chunkkit import blob, join, join_rest, window_cells
from tests.cache.tierkit import NS
from tests.faults.test_kill9 import killed
from tests.faults.writer_child import WINDOWED, WINDOWED_TOKENS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.tiers.files import PUBLISH_STEPS
from kvwarm.cache.tiers.publish import CHUNK_STEPS

WINDOW = 100  # chunkkit.window_request's
#: (step, which occurrence): the victim's save publishes its first-cache chunk (1st chunk
#: steps), its three window chunks (2nd to 4th), then its manifest.
VICTIM_CHUNKS = 4
CASES = [
    *((step, 1) for step in CHUNK_STEPS),
    *((step, 2) for step in CHUNK_STEPS),
    *((step, VICTIM_CHUNKS) for step in CHUNK_STEPS),
    *((step, 1) for step in PUBLISH_STEPS),
]


def _whole(n: int) -> bytes:
    tokens = WINDOWED_TOKENS[:n]
    return blob(tokens) + window_cells(tokens, n - WINDOW, n)


def _restored(cache: Cache, key: bytes) -> bytes:
    with cache.open_row(key) as row:
        assert row.rest_chunks
        return join(row.chunks) + join_rest(row.rest_chunks, row.rest_from)


@pytest.mark.parametrize(("step", "nth"), CASES)
def test_kill9_at_every_step_of_a_windowed_save(tmp_path: Path, step: str, nth: int) -> None:
    root = tmp_path / "kvc"
    _, acked = killed("windowed", str(root), step, str(nth))
    assert acked == [cache_key(NS, WINDOWED_TOKENS[:n]) for n in WINDOWED[:-1]]
    victim = cache_key(NS, WINDOWED_TOKENS[: WINDOWED[-1]])

    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=256)
    with Cache(cfg, background=False) as cache:  # the restart
        assert not [n for n in os.listdir(root) if n.endswith(".tmp")]
        assert cache.verify().bad == ()
        for key, n in zip(acked, WINDOWED, strict=False):
            assert _restored(cache, key) == _whole(n)
        linked = step in PUBLISH_STEPS and PUBLISH_STEPS.index(step) >= PUBLISH_STEPS.index(
            "linked"
        )
        assert (cache.lookup_exact(victim) is not None) == linked
        if linked:
            assert _restored(cache, victim) == _whole(WINDOWED[-1])
            return
        # What the victim published is unnamed: evicted before any row, and the acknowledged
        # checkpoints stay whole.
        named = set()
        for info in cache.rows():
            stored = cache._index.stored_in(info.key, "disk")
            assert stored is not None
            named.update(stored.chunk_refs)
        on_disk = {bytes.fromhex(n[:-4]) for n in os.listdir(root) if n.endswith(".kvk")}
        orphans = on_disk - named
        if step in CHUNK_STEPS:  # the chunks before it, and this one once it has its name
            assert len(orphans) == nth - 1 + (step != "chunk_tmp_synced")
        else:  # the manifest's own steps before its link: all its chunks
            assert len(orphans) == VICTIM_CHUNKS
        for _ in orphans:
            assert cache.evict_bytes(1).rows == 0
        assert {bytes.fromhex(n[:-4]) for n in os.listdir(root) if n.endswith(".kvk")} == named
        for key, n in zip(acked, WINDOWED, strict=False):
            assert _restored(cache, key) == _whole(n)
