"""A window in chunks (KVC version 4): an iSWA row's rest is cut into chunks keyed like its
first cache's, so checkpoints of one conversation share all but their newest window cells and
conversations over one prompt share its window; every restore is the saved blob; a rest chunk
that is gone or damaged drops the row (never a wrong restore); copies, restarts, verify and
the shared tiers' sweep know these chunks as they know the first cache's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from tests.cache.chunkkit import (
    PER_TOKEN,
    WINDOW_PER_TOKEN,
    blob,
    chunked_request,
    join,
    join_rest,
    window_cells,
    window_request,
)
from tests.cache.conftest import CacheFactory
from tests.cache.tierkit import NS
from tests.s3kit import MotoServer

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats import kvc
from kvwarm.cache.index.index import Index
from kvwarm.cache.sizes import summary
from kvwarm.errors import CacheFormatError, CacheKeyError, StateRestoreError

C = 256  # chunks of the first cache; the window's grid is C // 4 = 64
TOKENS = list(range(1000, 2200))


def _save(cache: Cache, tokens: list[int], window: int = 100) -> bytes:
    tier = cache.tier_names()[0]
    key = cache.save(window_request(NS, tokens, [], tier=tier, window=window), sync=True)
    assert key is not None
    return key


def _whole(tokens: list[int], window: int = 100) -> bytes:
    n = len(tokens)
    return blob(tokens) + window_cells(tokens, max(0, n - window), n)


def _restored(cache: Cache, key: bytes) -> bytes:
    with cache.open_row(key) as row:
        assert row.payload.nbytes == 0 and row.rest_chunks
        return join(row.chunks) + join_rest(row.rest_chunks, row.rest_from)


def _written(cache: Cache, before: float = 0) -> int:
    """Chunk bytes written since ``before`` (the ram tier counts payloads)."""
    return int(cache.counters()["chunk_bytes_written"] - before)


def test_checkpoints_of_one_conversation_share_all_but_their_newest_window_cells(
    make_cache: CacheFactory,
) -> None:
    cache = make_cache()
    keys = {}
    for n in (600, 640, 700):  # windows [500, 600), [540, 640), [600, 700)
        keys[n] = _save(cache, TOKENS[:n])
    for n, key in keys.items():
        assert _restored(cache, key) == _whole(TOKENS[:n])
        with cache.open_row(key) as row:
            assert row.rest_from == n - 100
    rows = {r.n_tokens: r for r in cache.rows()}
    # Every window cell of [500, 700) is stored once: the 640 row's window starts inside the
    # 600 row's chunk [512, 576), which it names rather than storing [540, 576) again.
    window_bytes = sum(
        r.logical_bytes - r.size - r.n_tokens * PER_TOKEN for r in rows.values()
    )  # what the windows restore from, summed over the rows (shared chunks counted per row)
    assert window_bytes >= 300 * WINDOW_PER_TOKEN
    if cache.tier_names()[0] == "ram":  # payloads alone: exact arithmetic
        snap = cache.counters()
        stored = snap["tier_ram_bytes"] - sum(r.size for r in rows.values())
        cells = 700 * PER_TOKEN + 200 * WINDOW_PER_TOKEN
        n_rest_chunks = len({k for r in _stored(cache) for k in r.rest.keys})  # type: ignore[union-attr]
        assert stored == cells + 4 * n_rest_chunks  # each fake rest chunk's 4-byte start


def _stored(cache: Cache) -> list:  # type: ignore[type-arg]
    index: Index = cache._index  # what the manifests name
    return [index.stored_in(r.key, r.tier) for r in cache.rows()]


def test_conversations_over_one_prompt_share_its_window_chunks(make_cache: CacheFactory) -> None:
    cache = make_cache()
    system = TOKENS[:600]
    _save(cache, system)
    before = cache.counters()["chunk_bytes_written"]
    a, b = system + list(range(5000, 5050)), system + list(range(6000, 6050))
    ka, kb = _save(cache, a), _save(cache, b)
    assert _restored(cache, ka) == _whole(a) and _restored(cache, kb) == _whole(b)
    rows = {r.info.key: r for r in _stored(cache)}
    shared = set(rows[ka].rest.keys) & set(rows[kb].rest.keys)
    # [512, 576) (A's and B's window starts at 550 inside it) and [576, 600): the prompt's.
    assert len(shared) == 2
    if cache.tier_names()[0] == "ram":
        # Each conversation wrote its 50 new tokens' cells and nothing of the prompt's.
        per = 50 * (PER_TOKEN + WINDOW_PER_TOKEN)
        assert _written(cache, before) == 2 * per + 4 * 2 * 2  # 2 rest chunks each


def test_a_window_may_begin_in_the_first_chunk_of_a_row_it_extends(
    make_cache: CacheFactory,
) -> None:
    """No grid chunk holds [505, 512) (the 600 row's window began at 500, inside the grid
    cell [448, 512)), but the first chunk of the 600 row's window does: the 605 row names it."""
    cache = make_cache()
    _save(cache, TOKENS[:600])
    before = cache.counters()["chunk_bytes_written"]
    key = _save(cache, TOKENS[:605])
    assert _restored(cache, key) == _whole(TOKENS[:605])
    rows = {r.info.n_tokens: r for r in _stored(cache)}
    assert rows[605].rest.start == 500 and rows[605].rest.keys[0] == rows[600].rest.keys[0]
    if cache.tier_names()[0] == "ram":  # its 5 new tokens, nothing of the window before
        assert _written(cache, before) == 5 * (PER_TOKEN + WINDOW_PER_TOKEN) + 4


def test_a_wider_chunk_that_left_the_tier_is_not_named(
    make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wider first chunk is looked up before the chunks are pinned; if it went in
    between (evicted), the save stores the window's own first cells instead."""
    cache = make_cache()
    _save(cache, TOKENS[:600])
    real = Index.chunk_sizes

    def claims_stored(self: Index, tier: str, keys: list[bytes]) -> list[int | None]:
        sizes = real(self, tier, keys)
        return [1 if len(keys) == 1 else s for s in sizes]  # the lookup of the wide chunk

    monkeypatch.setattr(Index, "chunk_sizes", claims_stored)
    evicted = cache.evict_bytes(1 << 40)
    assert evicted.rows == 1  # the 600 row and every chunk went
    key = _save(cache, TOKENS[:640])
    monkeypatch.undo()
    assert _restored(cache, key) == _whole(TOKENS[:640])
    (row,) = _stored(cache)
    assert row.rest.start == row.rest.first == 540


def test_a_rest_the_codec_will_not_cut_stays_in_the_row(make_cache: CacheFactory) -> None:
    def refuse(data: object) -> tuple[int, int]:
        raise StateRestoreError("not a window")

    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = TOKENS[:600]
    request = replace(window_request(NS, tokens, [], tier=tier), rest_span=refuse)
    key = cache.save(request, sync=True)
    assert key is not None
    with cache.open_row(key) as row:
        assert row.rest_chunks == () and row.chunks
        assert join(row.chunks) + bytes(row.payload) == _whole(tokens)


def test_evicting_a_checkpoint_keeps_the_window_chunks_others_name(
    make_cache: CacheFactory,
) -> None:
    cache = make_cache()
    first = _save(cache, TOKENS[:600])
    later = _save(cache, TOKENS[:640])
    assert cache.delete(first)
    assert _restored(cache, later) == _whole(TOKENS[:640])
    (row,) = _stored(cache)
    tier = cache.tier_names()[0]
    assert cache.counters()[f"tier_{tier}_chunks"] == len(row.chunks) + len(row.rest.keys)


def _disk(root: Path) -> CacheConfig:
    return CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)


def test_a_restart_adopts_version_4_rows_and_restores_them(tmp_path: Path) -> None:
    cfg = _disk(tmp_path / "kvc")
    with Cache(cfg, background=False) as cache:
        keys = {n: _save(cache, TOKENS[:n]) for n in (600, 700)}
        used = cache.counters()["tier_disk_bytes"]
    for key in keys.values():
        assert (tmp_path / "kvc" / f"{key.hex()}.kvc").read_bytes()[3] == 4
    with Cache(cfg, background=False) as cache:
        assert cache.counters()["tier_disk_bytes"] == used
        for n, key in keys.items():
            assert _restored(cache, key) == _whole(TOKENS[:n])
        assert cache.verify().bad == ()


@pytest.fixture
def windowed(tmp_path: Path) -> Iterator[tuple[Path, bytes, bytes]]:
    """A disk tier holding one window row; (root, its key, a key of one of its rest chunks
    that no other row names)."""
    root = tmp_path / "kvc"
    with Cache(_disk(root), background=False) as cache:
        key = _save(cache, TOKENS[:600])
        (row,) = _stored(cache)
    yield root, key, row.rest.keys[-1]


def test_a_missing_rest_chunk_sets_the_row_aside_at_start(
    windowed: tuple[Path, bytes, bytes],
) -> None:
    root, key, chunk = windowed
    (root / f"{chunk.hex()}.kvk").unlink()
    with Cache(_disk(root), background=False) as cache:
        assert cache.lookup_exact(key) is None
        assert list((root / "quarantine").glob(f"{key.hex()}*"))


def test_a_damaged_rest_chunk_drops_the_row_on_read_and_verify_names_it(
    windowed: tuple[Path, bytes, bytes],
) -> None:
    root, key, chunk = windowed
    path = root / f"{chunk.hex()}.kvk"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    with Cache(_disk(root), background=False) as cache:
        report = cache.verify()
        assert len(report.bad) == 1 and cache.lookup_exact(key) is not None
        with pytest.raises((CacheFormatError, CacheKeyError)), cache.open_row(key):
            pass
        assert cache.lookup_exact(key) is None


def test_an_older_kvwarm_refuses_a_version_4_row(
    windowed: tuple[Path, bytes, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kvwarm that reads versions 1 to 3 refuses such a row by its version (the scan sets
    it aside, a read is a miss), never reading it as chunks without their window."""
    root, key, _ = windowed
    data = (root / f"{key.hex()}.kvc").read_bytes()
    meta = kvc.parse(data, expected_key=key).meta
    assert meta.fields.rest_chunks is not None and meta.payload_length == 0
    monkeypatch.setattr(kvc, "_READABLE_VERSIONS", (1, 2, 3))
    with pytest.raises(CacheFormatError, match="unsupported version 4"):
        kvc.parse(data, expected_key=key)


def test_a_promoted_row_keeps_its_window_chunks(moto_server: MotoServer) -> None:
    """A hit on a shared tier copies a version-4 manifest to the local tier with its first
    cache's chunks and its window's, a wider first one included: the local copy restores to
    the same blob."""
    from tests.cache.facadekit import FakeClock

    clock = FakeClock(time.time())
    s3 = TierConfig("s3", 1 << 30, s3=moto_server.config(moto_server.new_bucket()))
    cfg = CacheConfig(
        tiers=(TierConfig("ram", 1 << 30), s3), ttl_seconds=(10.0, 10.0, 10.0), chunk_tokens=C
    )
    tokens = TOKENS[:640]
    with Cache(cfg, clock=clock, background=False) as cache:
        assert cache.save(window_request(NS, TOKENS[:600], [], tier="s3"), sync=True)
        # Its window begins in the 600 row's chunk [512, 576): the copy needs that one too.
        key = cache.save(window_request(NS, tokens, [], tier="s3"), sync=True)
        assert key is not None
        clock.advance(1000)
        cache.gc()  # forgotten here, still in the bucket
        assert cache.lookup_exact(key) is not None
        for tier in ("s3", "ram"):  # read from s3 (and promoted), then from ram
            with cache.open_row(key) as row:
                assert row.info.tier == tier
                assert join(row.chunks) + join_rest(row.rest_chunks, row.rest_from) == _whole(
                    tokens
                )
            assert cache.flush()


def test_the_shared_sweep_keeps_window_chunks_a_manifest_names(tmp_path: Path) -> None:
    shared = TierConfig("disk", 1 << 30, tmp_path / "nfs", shared=True)
    cfg = CacheConfig(tiers=(TierConfig("ram", 1 << 30), shared), chunk_tokens=C)
    with Cache(cfg, background=False) as cache:
        key = cache.save(window_request(NS, TOKENS[:700], [], tier="disk"), sync=True)
        assert key is not None
        [swept] = cache.gc_shared(grace_s=0.0, now=time.time() + 7200)
        assert (swept.deleted, swept.refused) == (0, "")
        with cache.open_row(key) as row:
            assert join(row.chunks) + join_rest(row.rest_chunks, row.rest_from) == _whole(
                TOKENS[:700]
            )


def test_stats_report_stored_against_logical_bytes_per_memory_kind(
    make_cache: CacheFactory,
) -> None:
    """``memory_<kind>_*`` and ``summary``'s ``memory_kinds``: a window's checkpoints restore
    far more than they store; full-attention rows beside them are counted apart."""
    cache = make_cache()
    tier = cache.tier_names()[0]
    for n in (600, 640, 700, 760):
        request = replace(window_request(NS, TOKENS[:n], [], tier=tier), memory="swa")
        assert cache.save(request, sync=True) is not None
    other = [7, *TOKENS[1:600]]
    full = replace(chunked_request(NS, other, tier=tier), memory="full")
    assert cache.save(full, sync=True) is not None
    counters = cache.counters()
    rows = cache.rows()
    kinds = summary(counters, rows, cache.tier_names())["memory_kinds"]
    assert set(kinds) == {"swa", "full"}
    swa, plain = kinds["swa"], kinds["full"]
    assert (swa["rows"], plain["rows"]) == (4, 1)
    assert swa["bytes"] + plain["bytes"] == counters[f"tier_{tier}_bytes"]
    assert swa["logical_bytes"] + plain["logical_bytes"] == counters[f"tier_{tier}_logical_bytes"]
    assert plain["dedup_ratio"] == pytest.approx(1.0, abs=0.01)  # one row: nothing shared
    assert swa["dedup_ratio"] > 2  # four checkpoints, each window stored once in all
    assert {r.memory for r in rows} == {"swa", "full"}
