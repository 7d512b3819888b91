"""A repairing startup scan sets aside only what proves bad: found by review, a read that
failed on our side (EIO, or a process out of descriptors: EMFILE) counted the row or chunk
as unusable, and the scan moved a sound file into ``quarantine/``. Now such a file is left
where it is, reported; out of descriptors or memory the scan stops there. The faults are
injected where the file store opens a file (``fsutil.open_regular``)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.cache.chunkkit import chunked_request
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats import chunkfmt
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.tiers import fsutil

C = 256
N = 600  # three chunks


def run(start: int) -> list[int]:
    return list(range(start, start + N))


def config(root: Path) -> CacheConfig:
    return CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)


def saved(root: Path, n: int) -> list[list[int]]:
    rows = [run(10_000 * i) for i in range(n)]
    with Cache(config(root), background=False) as cache:
        for tokens in rows:
            assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
    return rows


def failing(monkeypatch: pytest.MonkeyPatch, code: int, fails: Callable[[str], bool]) -> list[str]:
    """Make ``open_regular`` fail with ``code`` for the names ``fails`` picks; the names it
    failed are listed in the returned list."""
    real = fsutil.open_regular
    failed: list[str] = []

    def open_regular(dir_fd: int, name: str, flags: int) -> int:
        if fails(name):
            failed.append(name)
            raise OSError(code, os.strerror(code), name)
        return real(dir_fd, name, flags)

    monkeypatch.setattr(fsutil, "open_regular", open_regular)
    return failed


def row_name(tokens: list[int]) -> str:
    return f"{cache_key(NS, tokens).hex()}.kvc"


def quarantined(root: Path) -> list[str]:
    q = root / "quarantine"
    return sorted(os.listdir(q)) if q.exists() else []


def test_a_row_that_cannot_be_read_is_left_in_place_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "rows"
    rows = saved(root, 3)
    victim = row_name(rows[1])
    failed = failing(monkeypatch, errno.EIO, lambda name: name == victim)
    with Cache(config(root), background=False) as cache:
        keys = {r.key for r in cache.rows()}
        report = cache.verify()
    assert failed and quarantined(root) == []
    assert (root / victim).exists()
    assert keys == {cache_key(NS, rows[0]), cache_key(NS, rows[2])}
    assert [(where, why.split(":")[0]) for where, why in report.bad] == [
        (str(root / victim), "unreadable")
    ]
    # A rescan passes over the file it cannot read and adopts those after it.
    late = next(t for t in map(run, range(30_000, 10**6, 10_000)) if row_name(t) > victim)
    with Cache(config(root), background=False) as cache:
        with Cache(config(root), background=False) as other:  # another process's save
            assert other.save(chunked_request(NS, late, tier="disk"), sync=True)
        assert cache.rescan() == 1
        assert cache_key(NS, late) in {r.key for r in cache.rows()}
    monkeypatch.undo()  # the disk answers again: the next start adopts it
    with Cache(config(root), background=False) as cache:
        assert len(cache.rows()) == 4


def test_a_chunk_that_cannot_be_read_costs_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "rows"
    rows = saved(root, 2)
    keys = chunkfmt.chunk_keys(NS, rows[0], (C, C, N - 2 * C))
    victim = f"{keys[1].hex()}.kvk"
    failing(monkeypatch, errno.EIO, lambda name: name == victim)
    with Cache(config(root), background=False) as cache:
        adopted = {r.key for r in cache.rows()}
        report = cache.verify()
    assert quarantined(root) == []  # neither the chunk nor the manifest naming it
    assert (root / victim).exists() and (root / row_name(rows[0])).exists()
    assert adopted == {cache_key(NS, rows[1])}
    assert {why.split(":")[0] for _, why in report.bad} == {"unreadable"}


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOMEM])
def test_out_of_descriptors_or_memory_the_scan_stops_and_moves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    root = tmp_path / "rows"
    rows = saved(root, 3)
    before = sorted(os.listdir(root))
    victim = row_name(rows[1])
    failed = failing(monkeypatch, code, lambda name: name.endswith(".kvc") and name >= victim)
    with Cache(config(root), background=False) as cache:
        assert cache.counters()["store_errors"] >= 1  # the scan stopped early
    assert len(failed) == 1  # stopped at the first: no file after it was tried
    assert quarantined(root) == [] and sorted(os.listdir(root)) == before
    monkeypatch.undo()
    with Cache(config(root), background=False) as cache:
        assert len(cache.rows()) == 3


def test_a_file_whose_bytes_are_bad_is_still_set_aside(tmp_path: Path) -> None:
    root = tmp_path / "rows"
    rows = saved(root, 2)
    (root / row_name(rows[0])).write_bytes(b"garbage")
    with Cache(config(root), background=False) as cache:
        assert len(cache.rows()) == 1
    assert quarantined(root) == [row_name(rows[0])]
