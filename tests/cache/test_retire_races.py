"""What other threads may do while a row is being retired: the index has forgotten it (evicted,
expired, deleted, dropped as unreadable, retired by retention) and ``CacheCore.retire`` is
deleting its manifest, then the chunks no row names any more.

Found by a stress of window rows (KVC version 4) on a small disk quota with three writer
threads and lookups beside them: a row the index named had no file, or named a chunk that
was gone. Each race is driven here by a hook that runs the other thread's call at the moment
the disk tier is about to delete the retired row's manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tests.cache.chunkkit import (
    blob,
    chunked_request,
    join,
    join_rest,
    window_cells,
    window_request,
)
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.types import SaveRequest

TOKENS = list(range(1000, 2200))


def _cache(root: Path) -> Cache:
    return Cache(
        CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=256),
        background=False,
    )


def _save(cache: Cache, request: SaveRequest) -> bytes:
    key = cache.save(request, sync=True)
    assert key is not None
    return key


def _window(tokens: list[int]) -> SaveRequest:
    return window_request(NS, tokens, [], tier="disk")


def _meanwhile(
    cache: Cache, monkeypatch: pytest.MonkeyPatch, key: bytes, call: Callable[[], None]
) -> None:
    """Run ``call`` when the disk tier is about to delete the manifest of ``key``."""
    tier = type(cache._tiers["disk"])
    real = tier.delete

    def delete(self: object, k: bytes) -> None:
        if k == key:
            call()
        real(self, k)  # type: ignore[arg-type]

    monkeypatch.setattr(tier, "delete", delete)


def _consistent(cache: Cache, root: Path) -> None:
    """Every row the index holds has its manifest and every chunk it names on disk, and the
    tier's bytes are its files'."""
    for info in cache.rows():
        stored = cache._index.stored_in(info.key, "disk")
        assert stored is not None and (root / f"{info.key.hex()}.kvc").exists()
        assert all((root / f"{k.hex()}.kvk").exists() for k in stored.chunk_refs)
    on_disk = sum(p.stat().st_size for p in [*root.glob("*.kvc"), *root.glob("*.kvk")])
    assert cache.counters()["tier_disk_bytes"] == on_disk
    assert cache.verify().bad == ()


def test_a_lookup_does_not_adopt_back_a_row_being_retired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup of a key the index does not hold probes the file tiers (another process may
    have published it there). It found the retired row's manifest not yet deleted and
    adopted it back, and the retire deleted its file and chunks a moment later: the index
    then named a row that was gone, counted in the tier's bytes."""
    root = tmp_path / "kvc"
    with _cache(root) as cache:
        key = _save(cache, _window(TOKENS[:600]))
        seen: list[object] = []
        _meanwhile(cache, monkeypatch, key, lambda: seen.append(cache.lookup_exact(key)))
        assert cache.delete(key)
        assert seen == [None]
        assert cache.lookup_exact(key) is None
        _consistent(cache, root)
        assert cache.counters()["tier_disk_bytes"] == 0


def test_a_save_does_not_publish_the_file_of_a_row_being_retired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save of the same tokens meanwhile found the old manifest under its name, adopted it
    (a valid row of its key) and published it; the retire then deleted that file. (Here
    every chunk of the row is another row's too, so the save did not wait for one being
    deleted.)"""
    root = tmp_path / "kvc"
    with _cache(root) as cache:
        key = _save(cache, chunked_request(NS, TOKENS[:512], tier="disk"))
        _save(cache, chunked_request(NS, TOKENS[:700], tier="disk"))  # names its chunks
        again: list[bytes | None] = []

        def save_again() -> None:
            request = chunked_request(NS, TOKENS[:512], tier="disk")
            again.append(cache.save(request, sync=True))

        _meanwhile(cache, monkeypatch, key, save_again)
        assert cache.delete(key)
        monkeypatch.undo()
        assert len(again) == 1
        if cache.lookup_exact(key) is not None:
            with cache.open_row(key) as row:
                assert join(row.chunks) == blob(TOKENS[:512])
        _consistent(cache, root)


def test_no_chunk_is_deleted_before_a_manifest_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two retires at once (two writers each enforcing the quota): the second took every
    chunk the index had freed, the first row's too, and deleted them before the first had
    deleted that row's manifest. Killed then, the process left a manifest naming chunks that
    were gone, against the publish order (chunks before the manifest naming them, and gone
    only after it); a lookup meanwhile adopted such a row."""
    root = tmp_path / "kvc"
    with _cache(root) as cache:
        first = _save(cache, _window(TOKENS[:600]))
        other = _save(cache, _window([7, *TOKENS[1:600]]))  # shares no chunk with it
        stored = cache._index.stored_in(first, "disk")
        assert stored is not None
        files = [root / f"{k.hex()}.kvk" for k in stored.chunk_refs]
        assert all(p.exists() for p in files)
        gone: list[list[Path]] = []
        seen: list[object] = []

        def another_retire() -> None:
            assert cache.delete(other)
            gone.append([p for p in files if not p.exists()])
            seen.append(cache.lookup_exact(first))

        _meanwhile(cache, monkeypatch, first, another_retire)
        assert cache.delete(first)
        assert gone == [[]] and seen == [None]
        # Once its manifest is gone its chunks go too, none kept for ever.
        assert not list(root.glob("*.kvk")) and not list(root.glob("*.kvc"))
        _consistent(cache, root)


def test_a_retired_row_may_be_saved_again_once_its_bytes_are_gone(tmp_path: Path) -> None:
    """What a retire holds back it gives back: the same tokens saved after it are a row
    again, with every byte."""
    root = tmp_path / "kvc"
    with _cache(root) as cache:
        tokens = TOKENS[:600]
        key = _save(cache, _window(tokens))
        assert cache.delete(key)
        assert _save(cache, _window(tokens)) == key
        with cache.open_row(key) as row:
            restored = join(row.chunks) + join_rest(row.rest_chunks, row.rest_from)
        assert restored == blob(tokens) + window_cells(tokens, 500, 600)
        _consistent(cache, root)


def test_a_row_whose_manifest_cannot_be_deleted_stays_indexed_with_its_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eviction whose delete of a manifest fails (EIO, EACCES): the row is still stored.
    It was forgotten, its bytes counted freed, and the chunks only it named deleted, so its
    file stayed, uncounted against the quota until a restart, naming chunks that were gone
    (against the publish order). Now it stays indexed with its chunks, and a later eviction,
    once the delete works, retires it as any other."""
    import errno

    from kvwarm.errors import CacheIOError

    root = tmp_path / "kvc"
    with _cache(root) as cache:
        key = _save(cache, chunked_request(NS, TOKENS[:512], tier="disk"))
        tier = type(cache._tiers["disk"])

        def refuse(self: object, k: bytes) -> None:
            raise CacheIOError(f"disk: deleting {k.hex()} failed", errno=errno.EACCES)

        monkeypatch.setattr(tier, "delete", refuse)
        result = cache.evict_bytes(1 << 40, ["disk"])
        assert (result.rows, result.bytes) == (0, 0)
        assert cache.lookup_exact(key) is not None
        _consistent(cache, root)
        with cache.open_row(key) as row:
            assert join(row.chunks) == blob(TOKENS[:512])
        monkeypatch.undo()
        assert cache.evict_bytes(1 << 40, ["disk"]).rows == 1
        assert cache.lookup_exact(key) is None
        assert not list(root.glob("*.kvc")) and not list(root.glob("*.kvk"))
        assert cache.counters()["tier_disk_bytes"] == 0
