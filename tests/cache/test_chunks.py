"""Rows as manifests over content-addressed chunks, through the ``Cache`` facade and every
tier: restores join to the saved blob, saves write only what a tier lacks, shared prefixes are
stored once, eviction frees a row's unshared chunks from the leaves, restarts adopt chunks and
orphans, and a damaged or missing chunk drops the row (never a wrong restore)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tests.cache.chunkkit import (
    PER_TOKEN,
    REST,
    blob,
    chunked_request,
    join,
    rest_of,
    tail_request,
    two_part_request,
)
from tests.cache.conftest import CacheFactory
from tests.cache.tierkit import NS
from tests.s3kit import MotoServer

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats import chunkfmt
from kvwarm.cache.formats.chunkfmt import head_size
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.tiers.s3 import S3Tier
from kvwarm.cache.types import SaveReason, SaveRequest
from kvwarm.errors import CacheFormatError, CacheKeyError, StateRestoreError

C = 256


def _save(cache: Cache, tokens: list[int]) -> bytes:
    tier = cache.tier_names()[0]
    key = cache.save(chunked_request(NS, tokens, tier=tier), sync=True)
    assert key == cache_key(NS, tokens)
    return key


def _restored(cache: Cache, key: bytes) -> bytes:
    with cache.open_row(key) as row:
        return join(row.chunks) if row.chunks else bytes(row.payload)


def _chunk_bytes(n_chunks: int, cache: Cache | None = None, tokens: int = C) -> int:
    """Bytes ``n_chunks`` chunks of ``tokens`` occupy: the ram tier keeps payloads only, the
    others whole chunk objects (head and payload)."""
    in_ram = cache is not None and cache.tier_names()[0] == "ram"
    return n_chunks * ((0 if in_ram else head_size(tokens)) + tokens * PER_TOKEN)


def _manifest(n_tokens: int, n_chunks: int) -> int:
    """A ram-tier manifest's own bytes as the index counts them (tokens and chunk list)."""
    return 4 * n_tokens + 36 * n_chunks


def _manifests(cache: Cache, *shapes: tuple[int, int]) -> int:
    """The rows' own bytes: the ram tier's estimate, else what the files or objects hold
    (each manifest's stored size, which ``rows()`` reports)."""
    if cache.tier_names()[0] == "ram":
        return sum(_manifest(n, k) for n, k in shapes)
    return sum(r.size for r in cache.rows())


def _own(cache: Cache, key: bytes, n_tokens: int, n_chunks: int) -> int:
    """One row's own bytes (``_manifests`` for one row)."""
    if cache.tier_names()[0] == "ram":
        return _manifest(n_tokens, n_chunks)
    info = cache.lookup_exact(key)
    assert info is not None
    return info.size


@pytest.mark.parametrize("n", [1000, 512, 257, 255])
def test_restore_joins_to_the_saved_blob(make_cache: CacheFactory, n: int) -> None:
    cache = make_cache()
    tokens = list(range(7, 7 + n))
    key = _save(cache, tokens)
    with cache.open_row(key) as row:
        assert len(row.chunks) == (-(-n // C) if n >= C else 0)  # the last one shorter
        got = join(row.chunks) if row.chunks else bytes(row.payload)
        assert row.payload.nbytes == (0 if n >= C else n * PER_TOKEN)
    assert got == blob(tokens)


def test_continued_saves_write_only_new_chunks(make_cache: CacheFactory) -> None:
    cache = make_cache()
    tokens = list(range(3000))
    _save(cache, tokens[:1024])
    assert cache.counters()["chunks_written"] == 4
    written = cache.counters()["chunk_bytes_written"]
    key = _save(cache, tokens[:2100])  # continued: 4 new full chunks and a short one
    snap = cache.counters()
    assert snap["chunks_written"] == 9 and snap["chunks_reused"] == 4
    new = _chunk_bytes(4, cache) + _chunk_bytes(1, cache, 52)
    assert snap["chunk_bytes_written"] - written == new
    key3 = _save(cache, tokens[:2200])  # the next turn reuses every chunk, the short one too
    assert cache.counters()["chunks_written"] == 10
    tier = cache.tier_names()[0]
    manifests = _manifests(cache, (1024, 4), (2100, 9), (2200, 10))
    stored = _chunk_bytes(8, cache) + _chunk_bytes(1, cache, 52) + _chunk_bytes(1, cache, 100)
    assert cache.counters()[f"tier_{tier}_bytes"] == stored + manifests  # each chunk once
    assert _restored(cache, key) == blob(tokens[:2100])
    assert _restored(cache, key3) == blob(tokens[:2200])


def test_a_save_packs_only_what_its_tier_lacks(make_cache: CacheFactory) -> None:
    # The engine hands the cache a packer: the tokens the tier holds as chunks of this row's
    # plan never leave the context again, and the row restores to the whole blob.
    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = list(range(3000))
    starts: list[int] = []
    first = cache.save(tail_request(NS, tokens[:1000], starts, tier=tier), sync=True)
    assert starts == [0] and first is not None  # nothing stored yet: the whole sequence
    key = cache.save(tail_request(NS, tokens[:1300], starts, tier=tier), sync=True)
    assert starts == [0, 1000]  # the first row's chunks (its short last one too) are held
    assert key is not None and _restored(cache, key) == blob(tokens[:1300])
    # Every planned chunk held (the row's manifest gone, its chunks shared with the longer
    # row): nothing is packed at all, and the row restores.
    cache.delete(first)
    again = cache.save(tail_request(NS, tokens[:1000], starts, tier=tier), sync=True)
    assert starts == [0, 1000] and again == first
    assert _restored(cache, first) == blob(tokens[:1000])


def test_a_tail_whose_head_went_is_not_stored(make_cache: CacheFactory) -> None:
    # The chunks a tail was packed without must still be there when it is stored; if one
    # went (evicted between the plan and the write), the save fails and publishes nothing.
    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = list(range(1300))
    base = _save(cache, tokens[:512])
    request = replace(
        tail_request(NS, tokens, [], tier=tier), payload=blob(tokens)[512 * PER_TOKEN :]
    )
    request = replace(request, pack=None, payload_from=512)
    cache.delete(base)  # its two chunks are freed with it
    assert cache.save(request, sync=True) is None
    assert cache.lookup_exact(cache_key(NS, tokens)) is None
    assert cache.counters()["save_failures"] == 1


def test_the_chunks_a_tail_is_packed_without_stay_until_it_is_stored(
    make_cache: CacheFactory,
) -> None:
    """A save packs its tail on the worker and the writer stores it later: the chunks before
    the tail must not leave the tier between the two. Found by the concurrency stress (a
    4 KiB ram tier): another save's room or an evict took the lead chunk meanwhile, the save
    failed ("went while its tail was being saved"), and an evict save kept its slot's KV live,
    the only copy, which a shutdown save would have lost the same way."""
    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = list(range(1300))
    base = _save(cache, tokens[:512])
    starts: list[int] = []
    request = tail_request(NS, tokens, starts, tier=tier)
    packer = request.pack
    assert packer is not None

    def pack_then_evict(start: int) -> tuple[bytes, int]:
        packed = packer(start)
        assert cache.delete(base)  # the lead's row leaves while the tail is on its way
        return packed

    key = cache.save(replace(request, pack=pack_then_evict), sync=True)
    assert starts == [512]  # packed as the tail of the chunks the tier held
    assert key is not None and _restored(cache, key) == blob(tokens)
    assert cache.counters()["save_failures"] == 0
    assert cache.lookup_exact(base) is None
    report = cache.verify()
    assert not report.bad, report


def test_a_packer_that_fails_leaves_nothing_in_flight(make_cache: CacheFactory) -> None:
    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = list(range(600))

    def broken(start: int) -> tuple[bytes, int]:
        raise StateRestoreError("the context went away")

    request = replace(tail_request(NS, tokens, [], tier=tier), pack=broken)
    assert cache.save(request) is None  # a dropped save, not the caller's error
    assert cache.counters()["saves_dropped"] == 1
    assert not cache.has(cache_key(NS, tokens))  # not in flight: a later save may try again
    assert cache.save(chunked_request(NS, tokens, tier=tier), sync=True) is not None


def test_conversations_over_a_shared_prompt_store_it_once(make_cache: CacheFactory) -> None:
    cache = make_cache()
    system = list(range(1000))  # not a multiple of C: the second conversation cuts there
    for conv in range(20):
        own = [5000 + conv * 1000 + i for i in range(256)]
        _save(cache, system + own)
    snap = cache.counters()
    assert snap["chunks_written"] == 5 + 2 + 18  # then one chunk a conversation
    distinct_kv = (1000 + 20 * 256) * PER_TOKEN
    tier = cache.tier_names()[0]
    assert snap[f"tier_{tier}_bytes"] <= 1.1 * distinct_kv


def test_evicting_a_long_row_keeps_the_shared_prefix(make_cache: CacheFactory) -> None:
    cache = make_cache()
    tokens = list(range(2048))
    long_key = _save(cache, tokens)
    short_key = _save(cache, tokens[:1024])  # reuses the long row's first 4 chunks
    tier = cache.tier_names()[0]
    long_own, short_own = _own(cache, long_key, 2048, 8), _own(cache, short_key, 1024, 4)
    assert cache.counters()[f"tier_{tier}_bytes"] == _chunk_bytes(8, cache) + long_own + short_own
    # A shared store's chunks are only forgotten (other processes' rows may name them; the
    # mark-and-sweep reclaims them): they leave the usage but are not deleted bytes.
    deleted = 0 if tier == "s3" else _chunk_bytes(4, cache)
    result = cache.evict_bytes(1)  # LRU: the long row is the oldest
    assert result.rows == 1 and result.bytes == deleted + long_own
    assert cache.lookup_exact(long_key) is None
    assert cache.counters()[f"tier_{tier}_bytes"] == _chunk_bytes(4, cache) + short_own
    assert _restored(cache, short_key) == blob(tokens[:1024])
    assert cache.evict_bytes(1).bytes == deleted + short_own
    assert cache.counters()[f"tier_{tier}_bytes"] == 0


def test_quota_counts_unique_chunks(make_cache: CacheFactory) -> None:
    # Room for 6 chunks and the manifests: two rows sharing 5 of their chunks fit (6 unique),
    # a third needing 8 does not.
    # The files' heads (chunk heads, manifests' headers) get 12 KiB: far less than a chunk.
    room = _chunk_bytes(6) + _manifest(1280, 5) + _manifest(1536, 6) + (12 << 10)
    cache = make_cache(quota=room)
    tokens = list(range(2048))
    a = _save(cache, tokens[:1280])
    b = _save(cache, tokens[:1536])
    assert cache.lookup_exact(a) is not None and cache.lookup_exact(b) is not None
    tier = cache.tier_names()[0]
    # Its 8 chunks alone exceed the quota: refused before anything is written or evicted
    # (it used to be stored, or its room held, by evicting a and b, and then lost as well:
    # tests/cache/test_row_over_quota.py).
    assert cache.save(chunked_request(NS, tokens, tier=tier), sync=True) is None
    assert cache.counters()[f"tier_{tier}_bytes"] <= room
    assert cache.lookup_exact(a) is not None and cache.lookup_exact(b) is not None
    assert cache.lookup_exact(cache_key(NS, tokens)) is None
    # One that fits alone (6 chunks of its own) evicts the oldest rows until it does.
    other = [10_000 + t for t in range(1536)]
    c = _save(cache, other)
    assert cache.counters()[f"tier_{tier}_bytes"] <= room
    assert cache.lookup_exact(a) is None and cache.lookup_exact(b) is None
    assert _restored(cache, c) == blob(other)


def test_restart_adopts_rows_chunks_and_orphans(tmp_path: Path) -> None:
    root = tmp_path / "kvc"
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)
    tokens = list(range(1100))
    with Cache(cfg, background=False) as cache:
        key = _save(cache, tokens)
    orphan_tier = FileTier("disk", root, 1 << 30)

    other = list(range(900, 900 + C))
    okey, head = chunkfmt.build_head(NS, chunkfmt.ROOT_PARENT, other, blob(other))
    orphan_tier.store_chunk(okey, head, blob(other))  # a save killed before its manifest
    orphan_tier.close()
    with Cache(cfg, background=False) as cache:
        manifest = (root / f"{key.hex()}.kvc").stat().st_size  # a row's size is its file's
        used = _chunk_bytes(5) + _chunk_bytes(1, tokens=76) + manifest
        assert cache.counters()["tier_disk_bytes"] == used
        assert _restored(cache, key) == blob(tokens)
        freed = cache.evict_bytes(1)
        assert (freed.rows, freed.bytes) == (0, _chunk_bytes(1, cache))  # the orphan goes first
        assert not (root / f"{okey.hex()}.kvk").exists()
        assert _restored(cache, key) == blob(tokens)


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_a_damaged_chunk_drops_the_row(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "kvc"
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)
    with Cache(cfg, background=False) as cache:
        key = _save(cache, list(range(600)))
        victim = sorted(p for p in root.iterdir() if p.suffix == ".kvk")[0]
        data = bytearray(victim.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0x10
            victim.write_bytes(data)
        elif damage == "truncate":
            victim.write_bytes(data[:-1])
        else:
            os.unlink(victim)
        with pytest.raises((CacheFormatError, CacheKeyError)), cache.open_row(key):
            pass
        assert cache.lookup_exact(key) is None
        assert not [p for p in root.iterdir() if p.suffix == ".kvc"]


def test_a_chunk_a_read_finds_damaged_is_set_aside_so_the_next_save_heals_its_rows(
    tmp_path: Path,
) -> None:
    """A chunk whose payload is damaged (its head intact, so the startup scan keeps it) is
    named by two rows. A read of one found it bad and dropped that row, but the chunk stayed
    (the other row named it): the cold prefill's save of the same tokens reused it, and so
    every restart read it, dropped the row and prefilled cold again, for good (found on Gemma
    3 270M, whose checkpoints share their window chunks). The read now sets the chunk aside:
    the save writes it afresh, and the other row reads again too. The read stops at the first
    bad chunk; the row's others are checked then, so one save heals them all."""
    root = tmp_path / "kvc"
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)
    tokens = list(range(700))
    with Cache(cfg, background=False) as cache:
        short, long = _save(cache, tokens[:600]), _save(cache, tokens)
    shared = chunkfmt.chunk_keys(NS, tokens, (C, C))  # both named by both rows
    paths = [root / f"{key.hex()}.kvk" for key in shared]

    def damage() -> None:
        for path in paths:
            data = bytearray(path.read_bytes())
            data[-1] ^= 1
            path.write_bytes(data)

    damage()
    for _ in range(2):  # each a restart: the damage persists only while the chunks do
        with Cache(cfg, background=False) as cache:
            with pytest.raises(CacheFormatError), cache.open_row(short):
                pass
            assert _save(cache, tokens[:600]) == short  # the cold prefill's save
            assert _restored(cache, short) == blob(tokens[:600])
            assert _restored(cache, long) == blob(tokens)
            assert cache.verify().bad == ()
        assert sorted(p.name for p in (root / "quarantine").iterdir()) == sorted(
            p.name for p in paths
        )
        damage()


def test_a_chunk_a_read_finds_gone_is_written_by_the_next_save(tmp_path: Path) -> None:
    """As above, but the shared chunks' files are removed behind the cache's back (by hand,
    a tmp cleaner) while it runs. The read of one row is a miss; the other row still names
    the chunks, so the index went on counting them stored: every save of the same tokens
    reused them and published a manifest naming files that were gone, and the prefix was
    never served again (found by review). The next save now writes them again, and both
    rows read."""
    root = tmp_path / "kvc"
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)
    tokens = list(range(700))
    with Cache(cfg, background=False) as cache:
        short, long = _save(cache, tokens[:600]), _save(cache, tokens)
        for key in chunkfmt.chunk_keys(NS, tokens, (C, C)):  # both named by both rows
            os.unlink(root / f"{key.hex()}.kvk")
        with pytest.raises(CacheKeyError), cache.open_row(short):
            pass
        assert _save(cache, tokens[:600]) == short  # the cold prefill's save
        assert _restored(cache, short) == blob(tokens[:600])
        assert _restored(cache, long) == blob(tokens)
        assert cache.verify().bad == ()


def test_unchunked_config_stores_whole_blobs(make_cache: CacheFactory) -> None:
    cache = make_cache(chunk_tokens=0)
    tokens = list(range(1000))
    key = _save(cache, tokens)
    with cache.open_row(key) as row:
        assert row.chunks == () and bytes(row.payload) == blob(tokens)
    assert cache.counters()["chunks_written"] == 0


def test_verify_reads_every_chunk_and_repair_drops_rows_naming_a_bad_one(tmp_path: Path) -> None:
    root = tmp_path / "kvc"
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)
    with Cache(cfg, background=False) as cache:
        tokens = list(range(1024))
        short, long = _save(cache, tokens[:600]), _save(cache, tokens)
        assert cache.verify().bad == ()
        first = chunkfmt.chunk_keys(NS, tokens, (C,))[0]  # named by both rows
        path = root / f"{first.hex()}.kvk"
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(data)
        report = cache.verify()
        assert len(report.bad) == 2 and cache.lookup_exact(short) is not None  # only reported
        assert all(why.startswith(f"chunk {first.hex()}: ") for _, why in report.bad)
        assert len(cache.verify(repair=True).bad) == 2
        assert cache.lookup_exact(short) is None and cache.lookup_exact(long) is None
        assert not path.exists()  # set aside, as a failed read does
        assert (root / "quarantine" / path.name).exists()


def test_verify_repair_only_forgets_bad_rows_of_a_shared_directory(tmp_path: Path) -> None:
    """In a directory other processes share, a row this process cannot read may be another's
    doing or be read fine by a newer kvwarm elsewhere: ``verify(repair=True)`` forgets it, as
    a failed read does (``CacheCore.drop_unreadable``), and deletes no file."""
    root = tmp_path / "kvc"
    tiers = (TierConfig("disk", 1 << 30, root=root, shared=True),)
    with Cache(CacheConfig(tiers=tiers, chunk_tokens=C), background=False) as cache:
        tokens = list(range(1024))
        short, long = _save(cache, tokens[:600]), _save(cache, tokens)
        first = chunkfmt.chunk_keys(NS, tokens, (C,))[0]  # named by both rows
        path = root / f"{first.hex()}.kvk"
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(data)
        assert len(cache.verify(repair=True).bad) == 2
        assert cache.rows() == []  # forgotten (a lookup may discover them again, as after a read)
        assert path.exists()
        assert {p.name for p in root.glob("*.kvc")} == {f"{k.hex()}.kvc" for k in (short, long)}


def test_a_save_replaces_what_a_read_of_a_shared_directory_found_damaged(tmp_path: Path) -> None:
    """In a directory other hosts share a row that fails its read is only forgotten, its bytes
    left in place. A chunk or a whole row whose payload fails its CRC has a valid head, so
    the next save of the same tokens adopted it (the save reported success) and every read
    failed again: the prefix was never served from that tier again. The tier remembers what
    its loads found bad and a save replaces it, as it replaces junk."""
    root = tmp_path / "kvc"
    tiers = (TierConfig("disk", 1 << 30, root=root, shared=True),)
    cfg = CacheConfig(tiers=tiers, chunk_tokens=C)
    chunked, whole = list(range(600)), list(range(5000, 5040))

    def whole_request() -> SaveRequest:
        return SaveRequest(NS, tuple(whole), blob(whole), SaveReason.COLD, "disk")

    with Cache(cfg, background=False) as cache:
        assert _save(cache, chunked) and cache.save(whole_request(), sync=True)
    first = chunkfmt.chunk_keys(NS, chunked, (C,))[0]
    for path in (root / f"{first.hex()}.kvk", root / f"{cache_key(NS, whole).hex()}.kvc"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(data)
    with Cache(cfg, background=False) as cache:
        for tokens in (chunked, whole):
            with pytest.raises(CacheFormatError), cache.open_row(cache_key(NS, tokens)):
                pass
        assert _save(cache, chunked) and cache.save(whole_request(), sync=True)
        assert _restored(cache, cache_key(NS, chunked)) == blob(chunked)
        assert _restored(cache, cache_key(NS, whole)) == blob(whole)
    with Cache(cfg, background=False) as cache:  # another host, or a restart
        assert cache.verify().bad == ()


def test_saves_queued_together_line_up(make_cache: CacheFactory) -> None:
    """A finish save accepted while its cold save is still queued shares its chunks (both
    may run at once on the writer pool: cuts are planned when a save is accepted)."""
    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = list(range(1100))
    for n in (1000, 1100):
        assert cache.save(chunked_request(NS, tokens[:n], tier=tier)) is not None
    assert cache.flush()
    stored = _chunk_bytes(3, cache) + _chunk_bytes(1, cache, 232) + _chunk_bytes(1, cache, 100)
    manifests = _manifests(cache, (1000, 4), (1100, 5))
    assert cache.counters()[f"tier_{tier}_bytes"] == stored + manifests
    assert _restored(cache, cache_key(NS, tokens)) == blob(tokens)


def test_chunk_reads_reuse_one_arena_and_views_end_with_the_lease(tmp_path: Path) -> None:
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=tmp_path / "kvc"),), chunk_tokens=C)
    with Cache(cfg, background=False) as cache:
        a, b = list(range(700)), list(range(5000, 5900))
        key_a, key_b = _save(cache, a), _save(cache, b)
        with cache.open_row(key_a) as row:
            kept = row.chunks[0]
            first = join(row.chunks)
        with pytest.raises(ValueError):
            bytes(kept)  # released: a later read may reuse its bytes
        assert first == blob(a)
        for _ in range(2):  # the second read of each lands in the same, reused arena
            assert _restored(cache, key_b) == blob(b)
            assert _restored(cache, key_a) == blob(a)


def test_a_shared_tier_keeps_chunks_its_rows_were_forgotten_or_promoted_from(
    moto_server: MotoServer,
) -> None:
    """TTL only makes this process forget an s3 row, and a promotion only moves its own copy:
    the chunks stay in the bucket for the other replicas, and the row restores again."""
    from tests.cache.facadekit import FakeClock
    from tests.s3kit import object_names

    clock = FakeClock(time.time())
    s3 = TierConfig("s3", 1 << 30, s3=moto_server.config(moto_server.new_bucket()))
    cfg = CacheConfig(
        tiers=(TierConfig("ram", 1 << 30), s3), ttl_seconds=(10.0, 10.0, 10.0), chunk_tokens=C
    )
    tokens = list(range(700))
    with Cache(cfg, clock=clock, background=False) as cache:
        key = cache.save(chunked_request(NS, tokens, tier="s3"), sync=True)
        assert key is not None
        listing = object_names(S3Tier(s3.s3, 1 << 30))  # type: ignore[arg-type]
        # The row's 3 chunks in one pack (s3 has packs), no chunk object of its own.
        assert sum(name.endswith(".kvp") for name in listing) == 1
        assert not any(name.endswith(".kvk") for name in listing)
        clock.advance(1000)
        cache.gc()
        assert cache.rows() == []
        assert object_names(S3Tier(s3.s3, 1 << 30)) == listing  # type: ignore[arg-type]
        assert cache.lookup_exact(key) is not None  # found again by probing
        assert _restored(cache, key) == blob(tokens)  # and promoted to ram
        assert cache.flush()
        assert cache.rows()[0].tier == "ram"
        assert object_names(S3Tier(s3.s3, 1 << 30)) == listing  # type: ignore[arg-type]
        assert _restored(cache, key) == blob(tokens)


def test_a_blob_the_codec_cannot_cut_is_stored_whole(make_cache: CacheFactory) -> None:
    from kvwarm.errors import StateRestoreError

    def refuse(data: object, bounds: object) -> list[bytes]:
        raise StateRestoreError("several KV streams")

    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = list(range(1000))
    request = replace(chunked_request(NS, tokens, tier=tier), split=refuse)
    key = cache.save(request, sync=True)
    assert key == cache_key(NS, tokens)
    with cache.open_row(key) as row:
        assert row.chunks == () and bytes(row.payload) == blob(tokens)
    assert cache.counters()["save_failures"] == 0


def test_rows_report_logical_and_exclusive_bytes(make_cache: CacheFactory) -> None:
    cache = make_cache()
    tokens = list(range(2048))
    long_key = _save(cache, tokens)  # 8 chunks
    short_key = _save(cache, tokens[:1024])  # names the long row's first 4
    rows = {r.key: r for r in cache.rows()}
    long, short = rows[long_key], rows[short_key]
    assert long.logical_bytes == long.size + _chunk_bytes(8, cache)
    assert long.exclusive_bytes == long.size + _chunk_bytes(4, cache)  # its last 4 alone
    assert short.logical_bytes == short.size + _chunk_bytes(4, cache)
    assert short.exclusive_bytes == short.size  # every chunk it names, the long row does too
    tier = cache.tier_names()[0]
    snap = cache.counters()
    assert snap[f"tier_{tier}_chunks"] == 8
    physical = long.size + short.size + _chunk_bytes(8, cache)
    assert snap[f"tier_{tier}_bytes"] == physical
    assert snap[f"tier_{tier}_logical_bytes"] == long.logical_bytes + short.logical_bytes
    assert snap[f"tier_{tier}_dedup_ratio"] == pytest.approx(
        (long.logical_bytes + short.logical_bytes) / physical
    )
    cache.evict_bytes(1)  # the long row: the short one now holds its 4 chunks alone
    (short,) = cache.rows()
    assert short.exclusive_bytes == short.logical_bytes
    assert cache.counters()[f"tier_{tier}_chunks"] == 4


def test_a_two_part_memory_keeps_its_rest_in_the_row_and_shares_its_chunks(
    make_cache: CacheFactory,
) -> None:
    """An iSWA window or a hybrid's recurrent state cannot be cut: each row keeps its own as
    its payload, while the full-attention cache before it is chunks shared like any other
    (a checkpoint costs its rest plus its new chunks, not its whole blob)."""
    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = list(range(1100))
    keys, starts = {}, []
    for n in (1000, 1100, 768):  # the 768 row's chunks all exist: it writes its rest alone
        keys[n] = cache.save(two_part_request(NS, tokens[:n], starts, tier=tier), sync=True)
    assert starts == [0, 1000, 768]  # the packer was asked even when every chunk was there
    snap = cache.counters()
    assert snap["chunks_written"] == 4 + 1 + 0  # [0, 256, 512, 768, 1000, 1100)
    assert snap["chunks_reused"] == 0 + 4 + 3
    for n, key in keys.items():
        with cache.open_row(key) as row:
            assert row.chunks and bytes(row.payload) == rest_of(tokens[:n])
            assert join(row.chunks) + bytes(row.payload) == blob(tokens[:n]) + rest_of(tokens[:n])
    rows = {r.n_tokens: r for r in cache.rows()}
    assert rows[768].exclusive_bytes == rows[768].size  # its chunks are the others' too
    assert rows[768].size >= len(rest_of(tokens))


def test_a_rest_the_codec_refuses_stores_the_row_whole(make_cache: CacheFactory) -> None:
    def refuse(data: object) -> memoryview:
        raise StateRestoreError("the first cache does not hold positions from 0")

    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = list(range(600))
    request = replace(two_part_request(NS, tokens, [], tier=tier), rest=refuse)
    key = cache.save(request, sync=True)
    assert key is not None
    with cache.open_row(key) as row:
        assert row.chunks == ()
        assert bytes(row.payload) == blob(tokens) + rest_of(tokens)
    assert cache.counters()["chunks_written"] == 0


def test_a_promoted_row_keeps_its_rest(moto_server: MotoServer) -> None:
    """A hit on a shared tier copies a manifest to the local tier with its chunks and its
    rest: the local copy restores to the same blob."""
    from tests.cache.facadekit import FakeClock

    clock = FakeClock(time.time())
    s3 = TierConfig("s3", 1 << 30, s3=moto_server.config(moto_server.new_bucket()))
    cfg = CacheConfig(
        tiers=(TierConfig("ram", 1 << 30), s3), ttl_seconds=(10.0, 10.0, 10.0), chunk_tokens=C
    )
    tokens = list(range(700))
    whole = blob(tokens) + rest_of(tokens)
    with Cache(cfg, clock=clock, background=False) as cache:
        key = cache.save(two_part_request(NS, tokens, [], tier="s3"), sync=True)
        assert key is not None
        clock.advance(1000)
        cache.gc()  # forgotten here, still in the bucket
        assert cache.lookup_exact(key) is not None
        for tier in ("s3", "ram"):  # read from s3 (and promoted), then from ram
            with cache.open_row(key) as row:
                assert row.info.tier == tier
                assert join(row.chunks) + bytes(row.payload) == whole
            assert cache.flush()


def test_a_rows_metadata_is_read_alone(make_cache: CacheFactory) -> None:
    """An exact hit needs only a row's final logits: ``payload=False`` returns its tokens and
    logits with nothing after the metadata (no payload, no chunks), in every tier."""
    cache = make_cache()
    tier = cache.tier_names()[0]
    tokens = list(range(600))
    logits = bytes(range(256)) * 4
    request = replace(two_part_request(NS, tokens, [], tier=tier), logits=logits)
    key = cache.save(request, sync=True)
    assert key is not None
    with cache.open_row(key, payload=False) as row:
        assert tuple(row.tokens) == tuple(tokens) and row.logits == logits
        assert row.payload.nbytes == 0 and row.chunks == ()
    with cache.open_row(key) as row:  # the whole row is still there and whole
        assert join(row.chunks) + bytes(row.payload) == blob(tokens) + rest_of(tokens)


def test_metadata_read_alone_is_verified_and_ignores_the_payload(tmp_path: Path) -> None:
    """The metadata's own CRC and key replay guard a metadata read: a flipped bit in the
    logits is refused, while a damaged payload (not read) is caught by the next full read."""
    from kvwarm.cache.formats import kvc

    root = tmp_path / "kvc"
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)
    logits = bytes(range(256)) * 4
    with Cache(cfg, background=False) as cache:
        keys = []
        for n in (600, 601):
            request = replace(two_part_request(NS, list(range(n)), [], tier="disk"), logits=logits)
            keys.append(cache.save(request, sync=True))
        files = [next(root.rglob(f"{k.hex()}.kvc")) for k in keys if k is not None]
        assert len(files) == 2
        damaged_payload, damaged_meta = (bytearray(f.read_bytes()) for f in files)
        offset = kvc.parse_meta(damaged_payload).payload_offset
        damaged_payload[offset + 10] ^= 1
        files[0].write_bytes(damaged_payload)
        damaged_meta[damaged_meta.index(logits) + 5] ^= 1
        files[1].write_bytes(damaged_meta)
        with cache.open_row(keys[0], payload=False) as row:
            assert row.logits == logits
        with pytest.raises(CacheFormatError), cache.open_row(keys[0]):
            pass
        with pytest.raises(CacheFormatError), cache.open_row(keys[1], payload=False):
            pass


def test_a_tail_read_returns_the_chunks_from_a_boundary(make_cache: CacheFactory) -> None:
    """``open_row(from_token=)`` reads the chunks from the last boundary at or before it
    (the caller holds the KV before it live), never the last chunk's start past it; a
    two-part row (a payload belongs to the whole row) and metadata reads stay whole."""
    cache = make_cache()
    tokens = list(range(900))  # chunks [0, 256), [256, 512), [512, 768), [768, 900)
    key = _save(cache, tokens)
    assert cache.chunk_lens(key) == (C, C, C, 900 - 3 * C)
    for from_token, start in ((0, 0), (255, 0), (256, 256), (700, 512), (899, 768), (5000, 768)):
        with cache.open_row(key, from_token=from_token) as row:
            assert row.chunks_from == start
            assert join(row.chunks) == blob(tokens)[start * PER_TOKEN :]
            assert tuple(row.tokens) == tuple(tokens)
    with cache.open_row(key) as row:  # the whole row is still there and whole
        assert row.chunks_from == 0 and join(row.chunks) == blob(tokens)
    tier = cache.tier_names()[0]
    two = cache.save(two_part_request(NS, list(range(600)), [], tier=tier), sync=True)
    assert two is not None
    with cache.open_row(two, from_token=300) as row:
        assert row.chunks_from == 0 and len(row.chunks) == 3 and row.payload.nbytes == REST
    assert cache.chunk_lens(b"\0" * 32) == ()


def _computed(tokens: list[int], differ_from: int, *, plain_to: int, canonical: int | None):
    """A save of ``tokens`` whose KV from ``differ_from`` on has other bits than ``blob``'s
    (another pass computed them: a partial last pass, an unaligned restore, decoding)."""
    data = bytearray(blob(tokens))
    for i in range(differ_from * PER_TOKEN, len(data)):
        data[i] ^= 0x5A
    return replace(
        chunked_request(NS, tokens),
        payload=bytes(data),
        plain_to=plain_to,
        canonical_tokens=canonical,
    )


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_chunks_past_a_rows_aligned_canonical_prefix_are_never_shared_as_canonical(
    store: str, tmp_path: Path
) -> None:
    """Deterministic restores trust a row's bits up to its canonical length, and chunks are
    content-addressed by tokens alone. Found on Gemma (deterministic, n_batch 512): X[:513]
    computed position 512 in a pass of its own; its 553-token sibling, in a pass of 41; the
    sibling's row reused X[:513]'s chunk [512, 513), so an exact hit on it differed from a
    cold run. Past a row's aligned canonical prefix (``plain_to``) its chunks are keyed
    apart: by its length when all its tokens are canonical, else shared only with other
    rows nobody relies on there."""
    root = tmp_path / "kvc" if store == "disk" else None
    cfg = CacheConfig(tiers=(TierConfig(store, 1 << 30, root=root),), chunk_tokens=C)
    tokens = list(range(1000, 1600))
    with Cache(cfg, background=False) as cache:
        tier = cache.tier_names()[0]
        # X[:513] and its sibling (553 tokens), each canonical in full, each with the bits of
        # its own last pass [512, n): they differ at 512.
        short = _computed(tokens[:513], 512, plain_to=512, canonical=None)
        long = _computed(tokens[:553], 512, plain_to=512, canonical=None)
        long = replace(
            long,
            payload=blob(tokens[:553])[: 512 * PER_TOKEN] + long.payload[512 * PER_TOKEN :][::-1],
        )
        for req in (short, long):
            assert cache.save(replace(req, tier=tier), sync=True) == cache_key(NS, req.tokens)
        for req in (short, long):
            assert _restored(cache, cache_key(NS, req.tokens)) == req.payload
        # A row nobody relies on past 256 (its canonical prefix is 300 tokens) does not put
        # its bits under the canonical keys a later canonical row of the same tokens uses.
        loose = _computed(tokens, 256, plain_to=256, canonical=300)
        assert cache.save(replace(loose, tier=tier), sync=True)
        exact = replace(chunked_request(NS, tokens[:580], tier=tier), plain_to=512)
        assert cache.save(exact, sync=True)
        assert _restored(cache, cache_key(NS, exact.tokens)) == exact.payload
        # Rows nobody relies on past their canonical prefix still share their chunks there.
        written = cache.counters()["chunks_written"]
        again = _computed(tokens[:590], 256, plain_to=256, canonical=300)
        assert cache.save(replace(again, tier=tier), sync=True)
        assert cache.counters()["chunks_written"] == written + 1  # only [512, 590) is new
