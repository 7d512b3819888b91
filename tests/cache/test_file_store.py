"""The ``FileStore`` seam itself (``cache/tiers/files.py``): object names to files, reads,
listings and metadata, below what the tier contract suite checks through ``FileTier``."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import request

from kvwarm.cache.tiers.files import FileStore, FileTier
from kvwarm.cache.tiers.objects import (
    META_HITS,
    META_LAST_USED,
    LocalReads,
    Quarantines,
    ReapsTemps,
    StagesPuts,
)
from kvwarm.errors import CacheFormatError, CacheKeyError


def test_names_map_chunks_beside_rows_and_skip_directories(tmp_path: Path) -> None:
    store = FileStore("disk", tmp_path, register=False)
    assert all(isinstance(store, c) for c in (StagesPuts, LocalReads, Quarantines, ReapsTemps))
    chunk, row = "chunks/" + "ab" * 32 + ".kvk", "cd" * 32 + ".kvc"
    assert store.put_if_absent(chunk, b"chunk bytes")
    assert store.put_if_absent(row, b"row bytes")
    assert not store.put_if_absent(row, b"other bytes")  # taken: nothing replaced
    (tmp_path / "quarantine").mkdir()
    assert (tmp_path / ("ab" * 32 + ".kvk")).read_bytes() == b"chunk bytes"
    assert store.names("") == sorted([chunk, row])
    assert store.names("chunks/") == [chunk]
    assert [(n, size) for n, size, _ in store.list("")] == sorted([(chunk, 11), (row, 9)])
    assert store.location(chunk) == str(tmp_path / ("ab" * 32 + ".kvk"))
    assert not [n for n in (p.name for p in tmp_path.iterdir()) if n.endswith(".tmp")]
    store.close()


def test_reads_and_ranges(tmp_path: Path) -> None:
    store = FileStore("disk", tmp_path, register=False)
    assert store.put_if_absent("x.kvc", b"0123456789")
    got = store.get("x.kvc", 4)
    assert (got.data, got.size, dict(got.meta)) == (b"0123", 10, {})
    assert store.get("x.kvc").data == b"0123456789"
    assert store.get_range("x.kvc", 3, 7) == b"3456"
    assert bytes(store.read_exact_into("x.kvc", memoryview(bytearray(10))) or b"") == b"0123456789"
    assert store.read_exact_into("x.kvc", memoryview(bytearray(9))) is None
    with pytest.raises(CacheKeyError):
        store.get("missing.kvc")
    with pytest.raises(CacheKeyError):
        store.read_into("missing.kvc", None)
    (tmp_path / "link.kvc").symlink_to(tmp_path / "x.kvc")
    with pytest.raises(CacheFormatError):
        store.get("link.kvc")
    store.delete("missing.kvc")  # missing is fine
    store.close()


def test_set_meta_rewrites_the_header_hit_fields(tmp_path: Path) -> None:
    tier = FileTier("disk", tmp_path, 1 << 20)
    key, req = request((5, 6, 7))
    row = tier.store(key, req, FakeBook())
    assert row is not None
    before = Path(tier.location(key)).read_bytes()
    tier.objects.set_meta(Path(tier.location(key)).name, {META_HITS: "9", META_LAST_USED: "77"})
    seen = tier.probe(key)
    assert seen is not None and (seen.info.hits, seen.info.last_used) == (9, 77.0)
    assert len(Path(tier.location(key)).read_bytes()) == len(before)
    with pytest.raises(CacheKeyError):
        tier.objects.set_meta("ee" * 32 + ".kvc", {META_HITS: "1", META_LAST_USED: "1"})
    tier.close()


def test_a_multi_host_store_sets_nothing_aside(tmp_path: Path) -> None:
    store = FileStore("disk", tmp_path, multi_host=True, register=False)
    (tmp_path / "junk.kvc").write_bytes(b"junk")
    assert not store.set_aside("junk.kvc")
    assert (tmp_path / "junk.kvc").exists() and store.quarantined() == (0, 0)
    local = FileStore("disk", tmp_path, register=False)
    assert local.set_aside("junk.kvc")
    assert not (tmp_path / "junk.kvc").exists() and local.quarantined() == (1, 0)
    store.close()
    local.close()
