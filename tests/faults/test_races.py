"""Concurrent writers of one key, and the EEXIST adopt-or-replace rule at link time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import NS, data_names, request
from tests.faults.test_kill9 import CHILD, child_env

from kvwarm.cache.formats import kvc
from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.tiers.files import FileTier

WAIT = 30.0


def _no_tmp(root: Path) -> bool:
    return not [n for n in os.listdir(root) if n.endswith(".tmp")]


def test_threads_sharing_an_index_one_publishes(tmp_path: Path) -> None:
    tier, book = FileTier("disk", tmp_path, 1 << 30), FakeBook()
    n = 8
    start = threading.Barrier(n, timeout=WAIT)

    def save(i: int) -> StoredRow | None:
        key, req = request((5, 6, 7), payload=bytes([i]) * 50_000)
        start.wait()
        return tier.store(key, req, book)

    with ThreadPoolExecutor(n) as ex:
        results = list(ex.map(save, range(n)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    key = winners[0].info.key
    assert book.published == {key: winners[0]}
    assert data_names(tmp_path) == [f"{key.hex()}.kvc"]
    payload = bytes(tier.load(winners[0]).payload)
    assert payload == payload[:1] * 50_000


def test_threads_with_separate_indexes_link_once(tmp_path: Path) -> None:
    """Every writer gets past reserve/check (separate books); all reach link(2) together."""
    n = 4
    at_link = threading.Barrier(n, timeout=WAIT)
    steps: list[list[str]] = [[] for _ in range(n)]

    def save(i: int) -> StoredRow | None:
        def hook(step: str) -> None:
            steps[i].append(step)
            if step == "checked":
                at_link.wait()

        tier = FileTier("disk", tmp_path, 1 << 30, on_step=hook)
        key, req = request((8, 9), payload=bytes([i]) * 50_000)
        return tier.store(key, req, FakeBook())

    with ThreadPoolExecutor(n) as ex:
        rows = list(ex.map(save, range(n)))
    linked = [i for i in range(n) if "linked" in steps[i]]
    adopted = [i for i in range(n) if "adopted" in steps[i]]
    assert len(linked) == 1 and sorted(linked + adopted) == list(range(n))
    assert all(r is not None for r in rows)
    tier = FileTier("disk", tmp_path, 1 << 30)
    (row,) = list(tier.scan())
    assert bytes(tier.load(row).payload) == bytes([linked[0]]) * 50_000
    assert _no_tmp(tmp_path)


def test_two_processes_race_on_one_key(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, str(CHILD), "race", str(tmp_path), "disk", str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for i in range(2)
    ]
    try:
        for p in procs:  # both have written and synced their temp file, neither linked
            assert p.stdout is not None and p.stdout.readline().strip() == "READY"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("GO\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=WAIT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    outcomes = sorted(o[0].split()[0] for o in outs)
    assert outcomes == ["ADOPTED", "LINKED"]
    winner = next(i for i, o in enumerate(outs) if o[0].startswith("LINKED"))
    tier = FileTier("disk", tmp_path, 1 << 30)
    (row,) = list(tier.scan())
    assert bytes(tier.load(row).payload) == f"writer {winner} ".encode() * 1000
    assert _no_tmp(tmp_path)


def test_eexist_adopts_a_valid_file(tmp_path: Path) -> None:
    first = FileTier("disk", tmp_path, 1 << 30)
    key, old = request((1, 2, 3), payload=b"old bytes" * 100)
    assert first.store(key, old, FakeBook()) is not None  # e.g. a writer that died unannounced
    path = first.path_for(key)
    before, inode = path.read_bytes(), path.stat().st_ino

    steps: list[str] = []
    book = FakeBook()
    second = FileTier("disk", tmp_path, 1 << 30, on_step=steps.append)
    _, new = request((1, 2, 3), payload=b"new bytes" * 50)
    row = second.store(key, new, book)
    assert "adopted" in steps and "linked" not in steps
    assert row is not None and book.published[key] == row
    assert row.info.size == len(before)  # the adopted file's row (its size on disk), not ours
    assert path.read_bytes() == before and path.stat().st_ino == inode
    assert bytes(second.load(row).payload) == old.payload
    assert data_names(tmp_path) == [path.name]


def _replaced(tmp_path: Path, junk: bytes) -> None:
    key, req = request((4, 5, 6), payload=b"fresh" * 300)
    tier = FileTier("disk", tmp_path, 1 << 30)
    tier.path_for(key).write_bytes(junk)
    steps: list[str] = []
    tier = FileTier("disk", tmp_path, 1 << 30, on_step=steps.append)
    row = tier.store(key, req, FakeBook())
    assert "linked" in steps and "adopted" not in steps
    assert row is not None and bytes(tier.load(row).payload) == req.payload
    assert data_names(tmp_path) == [tier.path_for(key).name]


def test_eexist_replaces_junk(tmp_path: Path) -> None:
    _replaced(tmp_path, b"definitely not a KVC file")


def test_eexist_replaces_a_valid_file_of_another_key(tmp_path: Path) -> None:
    other_key, other = request((7, 7, 7))
    fields = kvc.fields_from_request(other, now=0)
    assert cache_key(NS, other.tokens) == other_key
    _replaced(tmp_path, kvc.build_prefix(fields, other.payload) + other.payload)


def test_eexist_replaces_a_truncated_file_of_this_key(tmp_path: Path) -> None:
    _, req = request((4, 5, 6), payload=b"fresh" * 300)
    whole = kvc.build_prefix(kvc.fields_from_request(req, now=0), req.payload) + req.payload
    _replaced(tmp_path, whole[:-7])
