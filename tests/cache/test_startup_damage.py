"""Damage is found at startup, not at the next read: the startup scan checks each row and
chunk file's length and its header/trailer CRC (not the payload's CRC), sets aside what fails
in ``quarantine/``, drops manifests whose chunks are gone, and ``verify`` then counts what was
set aside as fixed instead of reporting the manifests as bad."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
from tests.cache.chunkkit import blob, chunked_request, join
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.formats import chunkfmt, kvc
from kvwarm.cache.formats.key import cache_key

C = 256
N = 600  # three chunks: 256 + 256 + 88 tokens


def run(start: int) -> list[int]:
    return list(range(start, start + N))


def config(root: Path) -> CacheConfig:
    return CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=C)


def chunk_path(root: Path, tokens: list[int], index: int) -> Path:
    keys = chunkfmt.chunk_keys(NS, tokens, (C, C, N - 2 * C))
    return root / f"{keys[index].hex()}.kvk"


def row_path(root: Path, tokens: list[int]) -> Path:
    return root / f"{cache_key(NS, tokens).hex()}.kvc"


def damage(root: Path) -> dict[str, list[int]]:
    """Five rows saved as manifests over chunks, four of them then damaged on disk."""
    rows = {name: run(10_000 * i) for i, name in enumerate(
        ("truncated_chunk", "chunk_trailer", "manifest_trailer", "appended", "sound"))}  # fmt: skip
    with Cache(config(root), background=False) as cache:
        for tokens in rows.values():
            assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
    victim = chunk_path(root, rows["truncated_chunk"], 1)
    victim.write_bytes(victim.read_bytes()[:-100])
    victim = chunk_path(root, rows["chunk_trailer"], 0)  # the head CRC after the token list
    data = bytearray(victim.read_bytes())
    data[chunkfmt.head_size(C) - 2] ^= 0x01
    victim.write_bytes(bytes(data))
    victim = row_path(root, rows["manifest_trailer"])  # the trailer's payload CRC field
    data = bytearray(victim.read_bytes())
    data[64] ^= 0x01
    victim.write_bytes(bytes(data))
    victim = row_path(root, rows["appended"])
    victim.write_bytes(victim.read_bytes() + b"\x00" * 70)
    return rows


def test_a_restart_sets_aside_damaged_files_and_the_manifests_they_break(tmp_path: Path) -> None:
    root = tmp_path / "kvc"
    rows = damage(root)
    with Cache(config(root), background=False) as cache:  # the restart
        for name, tokens in rows.items():
            found = cache.lookup_exact(cache_key(NS, tokens)) is not None
            assert found == (name == "sound"), name
        with cache.open_row(cache_key(NS, rows["sound"])) as row:
            assert join(row.chunks) == blob(rows["sound"])
    quarantined = {p.name for p in (root / "quarantine").iterdir()}
    assert quarantined == {
        chunk_path(root, rows["truncated_chunk"], 1).name,
        chunk_path(root, rows["chunk_trailer"], 0).name,
        *(row_path(root, rows[n]).name for n in rows if n != "sound"),
    }
    # A read-only open (what `kvwarm cache verify` does) finds nothing bad left, and counts
    # what the startup scan fixed.
    with Cache(config(root), background=False, repair=False) as cache:
        report = cache.verify()
    assert report.bad == ()
    assert (report.checked, report.quarantined_rows, report.quarantined_chunks) == (1, 4, 2)


def test_a_read_only_open_reports_the_damage_and_moves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "kvc"
    rows = damage(root)
    listing = sorted(p.name for p in root.iterdir())
    with Cache(config(root), background=False, repair=False) as cache:
        report = cache.verify()
    assert sorted(p.name for p in root.iterdir()) == listing
    assert (report.quarantined_rows, report.quarantined_chunks) == (0, 0)
    bad = {Path(where).name for where, _ in report.bad}
    assert {row_path(root, rows[n]).name for n in ("manifest_trailer", "appended")} <= bad
    assert {chunk_path(root, rows["truncated_chunk"], 1).name} <= bad


def test_a_last_used_field_damaged_into_the_future_is_taken_as_now(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hit fields sit outside every CRC (rewritten in place on hits), so a flipped bit
    there reads as valid. A last use far in the future made ``kvwarm cache ls`` crash
    (``time.localtime``: value too large) and kept the row from LRU eviction and its TTL
    forever; it is now taken as the scan's time."""
    from kvwarm.cli import main

    top = tmp_path / "cache"
    root = top / "rows"
    rows = {name: run(10_000 * i) for i, name in enumerate(("far", "near", "sound"))}
    with Cache(config(root), background=False) as cache:
        for tokens in rows.values():
            assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
    for name, when in (("far", 1 << 62), ("near", int(time.time()) + 10 * 365 * 86400)):
        victim = row_path(root, rows[name])
        data = bytearray(victim.read_bytes())
        struct.pack_into("<Q", data, kvc.LAST_USED_OFFSET, when)
        victim.write_bytes(bytes(data))
    before = time.time()
    with Cache(config(root), background=False) as cache:
        listed = {info.key: info.last_used for info in cache.rows()}
        assert len(listed) == 3 and all(t <= time.time() for t in listed.values())
        assert listed[cache_key(NS, rows["far"])] >= before
    assert main(["cache", "ls", "--cache-dir", str(top)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4  # the header and three rows


def test_a_directory_named_like_a_row_or_chunk_is_reported_not_hidden(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory where a row or chunk file belongs was skipped by every listing without a
    word: ``verify`` said 0 bad while every save of that key failed on it (the link finds it
    in the way and cannot delete it). It is left where it is (not ours to remove), but each
    scan logs it and ``verify`` reports it, with and without ``--repair``."""
    root = tmp_path / "kvc"
    rows = {name: run(10_000 * i) for i, name in enumerate(("row_dir", "chunk_dir", "sound"))}
    with Cache(config(root), background=False) as cache:
        for tokens in rows.values():
            assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
    in_place = [row_path(root, rows["row_dir"]), chunk_path(root, rows["chunk_dir"], 1)]
    for path in in_place:
        path.unlink()
        path.mkdir()
    for repair in (False, True):
        caplog.clear()
        with Cache(config(root), background=False, repair=repair) as cache:
            report = cache.verify(repair=repair)
            with cache.open_row(cache_key(NS, rows["sound"])) as row:
                assert join(row.chunks) == blob(rows["sound"])
        assert {Path(where) for where, _ in report.bad} >= set(in_place), report
        assert all(path.is_dir() for path in in_place)
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert all(str(path) in logged for path in in_place), logged


def test_a_problem_removed_since_the_startup_scan_is_no_longer_reported(tmp_path: Path) -> None:
    """Found by review: what the startup scan reported and left in place stayed in every
    later ``verify`` of that process (a server's ``POST /cache/verify``), even after an
    operator removed it as the message said to: reported as bad until the server stopped."""
    root = tmp_path / "kvc"
    with Cache(config(root), background=False) as cache:
        assert cache.save(chunked_request(NS, run(0), tier="disk"), sync=True)
    in_the_way = root / f"{'cd' * 32}.kvc"
    in_the_way.mkdir()
    with Cache(config(root), background=False) as server:
        assert [Path(where) for where, _ in server.verify().bad] == [in_the_way]
        in_the_way.rmdir()
        report = server.verify()
    assert report.bad == () and report.checked == 1


def test_an_orphan_chunk_with_a_damaged_payload_is_set_aside_at_startup(tmp_path: Path) -> None:
    """A row's manifest and one of its chunks damaged together (a payload byte: the chunk's
    head is intact). The scan set the manifest aside and adopted the chunk as an orphan on
    its head alone, so the save of the same tokens reused it as stored and published a row
    that failed its first read. The scan now reads the orphans whole: a bad one is set aside
    (a read-only open reports it), and the save writes it afresh."""
    root = tmp_path / "kvc"
    tokens = run(0)
    with Cache(config(root), background=False) as cache:
        key = cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
        assert key is not None
    for path, at in ((row_path(root, tokens), 60), (chunk_path(root, tokens, 1), -1)):
        data = bytearray(path.read_bytes())
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
    with Cache(config(root), background=False, repair=False) as cache:
        bad = {where for where, _ in cache.verify().bad}
    assert f"chunk {chunk_path(root, tokens, 1).stem}" in bad
    with Cache(config(root), background=False) as cache:
        assert cache.lookup_exact(key) is None
        assert cache.save(chunked_request(NS, tokens, tier="disk"), sync=True) == key
        with cache.open_row(key) as row:
            assert join(row.chunks) == blob(tokens)
    assert {p.name for p in (root / "quarantine").iterdir()} == {
        row_path(root, tokens).name,
        chunk_path(root, tokens, 1).name,
    }
