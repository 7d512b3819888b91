"""``Cache.watch_rows``: a listener told of every row that joins or leaves the index holds,
by replaying what it was told, exactly the rows the index holds, whatever happened in
between (saves, quota eviction, deletes, a restart's scan, a shared row forgotten), and
learns whether a row's bytes left with it."""

from __future__ import annotations

import random
import time
from pathlib import Path

from tests.cache.chunkkit import chunked_request
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.protocols import StoredRow

C = 64


class Replay:
    """What a listener knows: key -> (tier, chunk keys), from the events alone."""

    def __init__(self) -> None:
        self.rows: dict[bytes, tuple[str, tuple[bytes, ...]]] = {}
        self.dropped: list[tuple[bytes, bool]] = []

    def row_stored(self, row: StoredRow) -> None:
        self.rows[row.info.key] = (row.info.tier, row.chunks)

    def row_dropped(self, row: StoredRow, *, bytes_kept: bool) -> None:
        held = self.rows.get(row.info.key)
        assert held is not None and held[0] == row.info.tier, "dropped a row never stored"
        del self.rows[row.info.key]
        self.dropped.append((row.info.key, bytes_kept))


def indexed(cache: Cache) -> dict[bytes, str]:
    return {r.key: r.tier for r in cache.rows()}


def test_a_listener_replays_the_index_through_saves_evictions_and_deletes() -> None:
    # A quota of about six rows: saves keep evicting older ones.
    cache = Cache(
        CacheConfig(tiers=(TierConfig("ram", 6 * 200 * 1024),), chunk_tokens=C), background=False
    )
    early = cache.save(chunked_request(NS, list(range(150))), sync=True)
    replay = Replay()
    cache.watch_rows(replay)  # a row indexed before the listener came is told first
    assert early is not None and set(replay.rows) == {early}
    rng = random.Random(7)
    saved: list[bytes] = [early]
    for i in range(60):
        op = rng.random()
        if op < 0.7:  # conversations over a few shared heads: shared chunks
            head = [1000 * rng.randrange(3) + t for t in range(64)]
            key = cache.save(
                chunked_request(NS, head + [50_000 + i] * rng.randrange(40, 160)), sync=True
            )
            if key is not None:
                saved.append(key)
        elif op < 0.85 and saved:
            cache.delete(rng.choice(saved))
        else:
            cache.evict_bytes(rng.randrange(1, 400_000))
        assert {k: t for k, (t, _) in replay.rows.items()} == indexed(cache), i
    assert any(not kept for _, kept in replay.dropped)  # evicted or deleted: bytes gone
    for key, (_, chunks) in replay.rows.items():
        info = cache.lookup_exact(key)
        assert info is not None and len(chunks) == len(cache.chunk_lens(key))
    cache.watch_rows(None)
    cache.save(chunked_request(NS, list(range(5000, 5100))), sync=True)
    assert len(replay.rows) < len(indexed(cache))  # told nothing once stopped
    cache.close()


def test_a_restart_tells_its_scanned_rows_and_a_forgotten_shared_row_keeps_its_bytes(
    tmp_path: Path,
) -> None:
    now = [time.time()]

    def disk(shared: bool) -> Cache:
        tier = TierConfig("disk", 1 << 30, root=tmp_path / "disk", shared=shared)
        config = CacheConfig(tiers=(tier,), chunk_tokens=C)
        return Cache(config, clock=lambda: now[0], background=False)

    first = disk(False)
    keys = [
        first.save(chunked_request(NS, list(range(n)), tier="disk"), sync=True) for n in (90, 200)
    ]
    first.close()
    second = disk(True)  # as on NFS: a tier other hosts publish into
    replay = Replay()
    second.watch_rows(replay)
    assert set(replay.rows) == set(keys) == set(indexed(second))
    assert all(tier == "disk" for tier, _ in replay.rows.values())
    caps = second.tier_capabilities()["disk"]
    assert caps.shared and not caps.local
    # A TTL lapse in a tier other processes share only forgets the row: its bytes stay.
    now[0] += 10 * 86_400  # every row idle past its TTL
    second.gc()
    assert indexed(second) == {} and replay.rows == {}
    assert sorted(replay.dropped) == sorted((k, True) for k in keys if k is not None)
    second.close()
