"""A directory shared with a newer kvwarm (two versions side by side, or a rollback): its rows
and chunks in a format version this kvwarm does not read are a miss here, never set aside,
deleted or replaced. Before, the start-up scan moved them to ``quarantine/`` as damage (or
deleted them, without a quarantine), and a save of the same key replaced them."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.cache.chunkkit import chunked_request
from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import NS, request

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats import chunkfmt, kvc
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.tiers.files import FileTier
from kvwarm.errors import CacheFormatError, CacheNewerFormatError

C = 256
N = 600  # three chunks: 256 + 256 + 88 tokens
VERSION_BYTE = 3  # after the 3-byte magic, in a row's header and a chunk's head alike


def _config(root: Path) -> CacheConfig:
    return CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)


def _newer(path: Path, version: int) -> bytes:
    """Rewrite ``path`` as a newer kvwarm would have written it (its version byte raised)."""
    data = bytearray(path.read_bytes())
    data[VERSION_BYTE] = version
    path.write_bytes(bytes(data))
    return bytes(data)


def _chunk_path(root: Path, tokens: list[int], index: int) -> Path:
    keys = chunkfmt.chunk_keys(NS, tokens, (C, C, N - 2 * C))
    return root / f"{keys[index].hex()}.kvk"


def test_the_parsers_say_newer_apart_from_damage(tmp_path: Path) -> None:
    tier = FileTier("disk", tmp_path, 1 << 20)
    key, req = request((1, 2, 3))
    assert tier.store(key, req, FakeBook()) is not None
    path = tier.path_for(key)
    newer = _newer(path, max(kvc._READABLE_VERSIONS) + 1)
    with pytest.raises(CacheNewerFormatError, match="newer kvwarm"):
        kvc.parse(newer)
    damaged = bytearray(newer)
    damaged[VERSION_BYTE] = 0
    with pytest.raises(CacheFormatError) as info:
        kvc.parse(bytes(damaged))
    assert not isinstance(info.value, CacheNewerFormatError)


def test_a_restart_leaves_a_newer_kvwarms_rows_and_chunks_alone(tmp_path: Path) -> None:
    root = tmp_path / "kvc"
    newer_tokens, ours_tokens = list(range(N)), list(range(50_000, 50_000 + N))
    with Cache(_config(root), background=False) as cache:
        for tokens in (newer_tokens, ours_tokens):
            assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
    row = root / f"{cache_key(NS, newer_tokens).hex()}.kvc"
    kept = {
        row: _newer(row, 5),
        _chunk_path(root, newer_tokens, 1): _newer(_chunk_path(root, newer_tokens, 1), 2),
    }
    for repair in (True, False):  # a server's start, then `kvwarm cache verify`
        with Cache(_config(root), background=False, repair=repair) as cache:
            assert len(cache.rows()) == 1  # the scan went through, adopting ours alone
            assert cache.lookup_exact(cache_key(NS, newer_tokens)) is None  # a miss here
            assert cache.lookup_exact(cache_key(NS, ours_tokens)) is not None
            report = cache.verify()
        assert report.bad == ()  # nothing damaged
        assert (report.quarantined_rows, report.quarantined_chunks) == (0, 0)
        assert {p: p.read_bytes() for p in kept} == kept
        assert not (root / "quarantine").exists()


def test_a_save_does_not_replace_a_newer_kvwarms_row(tmp_path: Path) -> None:
    tier = FileTier("disk", tmp_path, 1 << 20)
    key, req = request((4, 5, 6))
    assert tier.store(key, req, FakeBook()) is not None
    newer = _newer(tier.path_for(key), 5)
    older = FileTier("disk", tmp_path, 1 << 20)  # this kvwarm, started beside the newer one
    assert older.probe(key) is None  # a miss
    with pytest.raises(CacheNewerFormatError):
        older.store(key, req, FakeBook())
    assert tier.path_for(key).read_bytes() == newer


def test_a_save_does_not_replace_a_newer_kvwarms_chunk(tmp_path: Path) -> None:
    root = tmp_path / "kvc"
    tokens = list(range(N))
    with Cache(_config(root), background=False) as cache:
        assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
    chunk = _chunk_path(root, tokens, 0)
    newer = _newer(chunk, 2)
    (root / f"{cache_key(NS, tokens).hex()}.kvc").unlink()  # the newer kvwarm evicted the row
    with Cache(_config(root), background=False) as cache:
        assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True) is None
        assert cache.lookup_exact(cache_key(NS, tokens)) is None
    assert chunk.read_bytes() == newer


def test_a_read_meeting_a_newer_kvwarms_chunk_forgets_the_row_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    """A chunk our row names, evicted and written again by a newer kvwarm in its format: the
    restore is a miss, and neither the chunk (set aside as damaged) nor the row (dropped as
    corrupt, its chunks with it) is removed; the newer kvwarm reads both."""
    root = tmp_path / "kvc"
    tokens = list(range(N))
    key = cache_key(NS, tokens)
    with Cache(_config(root), background=False) as cache:
        assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
        kept = {p: p.read_bytes() for p in root.iterdir() if p.is_file()}
        chunk = _chunk_path(root, tokens, 1)
        kept[chunk] = _newer(chunk, 2)
        with pytest.raises(CacheNewerFormatError), cache.open_row(key):
            pass
        assert key not in {r.key for r in cache.rows()}
    assert {p: p.read_bytes() for p in kept} == kept
    assert not (root / "quarantine").exists()
