"""File-tier specifics: deterministic paths, protocol order, scan hygiene, verified loads."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import NS, data_names, request

from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.tiers.files import PUBLISH_STEPS, FileTier
from kvwarm.cache.tiers.layout import PID_NAMESPACE, tmp_name, tmp_owner
from kvwarm.errors import CacheFormatError, ConfigError

STEPS = list(PUBLISH_STEPS)


def _dead_pid() -> int:
    p = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(p.stdout)


def test_path_is_deterministic_and_visible_to_another_instance(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    tier = FileTier("disk", root, 1 << 20)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    key, req = request((1, 2, 3))
    row = tier.store(key, req, FakeBook())
    assert row is not None and row.location == str(root / f"{key.hex()}.kvc")
    assert data_names(root) == [f"{key.hex()}.kvc"]
    other = FileTier("disk", root, 1 << 20)  # e.g. another process sharing the directory
    seen = other.probe(key)
    assert seen is not None and seen.info == row.info
    assert bytes(other.load(seen).payload) == req.payload


def test_protocol_steps_in_order(tmp_path: Path) -> None:
    steps: list[str] = []
    tier = FileTier("disk", tmp_path, 1 << 20, on_step=steps.append)
    book = FakeBook()
    key, req = request((4, 5))
    assert tier.store(key, req, book) is not None
    assert steps == STEPS
    assert book.calls == ["reserve", "check", "mark_linked", "publish"]
    assert book.linked[key] == str(tier.path_for(key))


def test_bad_config_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        FileTier("ram", tmp_path, 1)
    with pytest.raises(ConfigError):
        FileTier("disk", tmp_path, -1)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError):
        FileTier("disk", tmp_path / "file", 1)


@pytest.mark.parametrize("where", ["payload", "truncate", "meta"])
def test_damaged_file_fails_load(tmp_path: Path, where: str) -> None:
    tier = FileTier("disk", tmp_path, 1 << 20)
    key, req = request((31, 32))
    row = tier.store(key, req, FakeBook())
    assert row is not None and row.location is not None
    data = bytearray(Path(row.location).read_bytes())
    if where == "payload":
        data[-1] ^= 0x40
    elif where == "meta":
        data[100] ^= 0x01
    else:
        del data[-3:]
    Path(row.location).write_bytes(data)
    with pytest.raises(CacheFormatError):
        tier.load(row)


def test_scan_reaps_temp_files_but_not_live_ones(tmp_path: Path) -> None:
    tier = FileTier("disk", tmp_path, 1 << 20, stale_tmp_s=60)
    k = "ab" * 32
    dead = tmp_path / f"{k}.kvc.{_dead_pid()}.1.1.tmp"
    live_other = tmp_path / f"{k}.kvc.{os.getppid()}.1.1.tmp"
    stale_other = tmp_path / f"{k}.kvc.{os.getppid()}.2.1.tmp"
    ours_leftover = tmp_path / f"{k}.kvc.{os.getpid()}.3.1.tmp"
    junk = tmp_path / "junk.tmp"
    for p in (dead, live_other, stale_other, ours_leftover, junk):
        p.write_bytes(b"partial")
    os.utime(stale_other, (1, 1))
    assert list(tier.scan()) == []
    assert sorted(data_names(tmp_path)) == [live_other.name]

    # A scan running while this tier is mid-save must leave that save's temp file alone.
    seen_during: list[list[str]] = []

    def hook(step: str) -> None:
        if step == "tmp_written":
            list(tier.scan())
            seen_during.append(data_names(tmp_path))

    tier = FileTier("disk", tmp_path, 1 << 20, on_step=hook)
    key, req = request((9,))
    assert tier.store(key, req, FakeBook()) is not None
    assert any(n.startswith(key.hex()) and n.endswith(".tmp") for n in seen_during[0])
    assert sorted(data_names(tmp_path)) == sorted([live_other.name, f"{key.hex()}.kvc"])


def test_a_scan_by_another_tier_of_this_process_leaves_its_saves_in_progress(
    tmp_path: Path,
) -> None:
    """Two caches of one process on one directory: two engines, or a new engine opened while
    one dropped unclosed still writes its shutdown saves. The second's start-up scan took the
    first's temp file in progress for a leftover of an earlier process with this pid (only its
    own publisher's files counted as being written), removed it, and the save failed at its
    link (found by the library review)."""
    seen_during: list[list[str]] = []

    def hook(step: str) -> None:
        if step == "tmp_written":
            assert list(FileTier("disk", tmp_path, 1 << 20).scan()) == []
            seen_during.append(data_names(tmp_path))

    tier = FileTier("disk", tmp_path, 1 << 20, on_step=hook)
    key, req = request((7, 8))
    assert tier.store(key, req, FakeBook()) is not None
    temps = [n for n in seen_during[0] if n.endswith(".tmp")]
    assert len(temps) == 1, seen_during
    assert data_names(tmp_path) == [f"{key.hex()}.kvc"]
    # Once published, the name is no longer being written: a leftover of it would be reaped.
    leftover = tmp_path / temps[0]
    leftover.write_bytes(b"partial")
    assert list(FileTier("disk", tmp_path, 1 << 20).scan())
    assert data_names(tmp_path) == [f"{key.hex()}.kvc"]


def test_scan_keeps_another_pid_namespaces_young_temp_files(tmp_path: Path) -> None:
    """A container beside ours on one host, sharing the directory, writes its pid namespace
    into its temp names: its pids mean nothing here (its pid may be dead here, or ours), so
    age alone decides whether its temp file is reaped. Before, a scan took such a file in
    progress for a dead process's and removed it, failing the other container's save. A name
    from this namespace, or one with no namespace (an older kvwarm's), is judged by its pid
    as before."""
    tier = FileTier("disk", tmp_path, 1 << 20, stale_tmp_s=60)
    k = "cd" * 32
    other = "0" if PID_NAMESPACE != "0" else "1"
    assert PID_NAMESPACE, "this machine names its pid namespace"
    foreign_dead = tmp_path / f"{k}.kvc.{_dead_pid()}.1.1.p{other}.tmp"
    foreign_ours = tmp_path / f"{k}.kvc.{os.getpid()}.2.1.p{other}.tmp"
    foreign_stale = tmp_path / f"{k}.kvc.{_dead_pid()}.3.1.p{other}.tmp"
    here_dead = tmp_path / f"{k}.kvc.{_dead_pid()}.4.1.p{PID_NAMESPACE}.tmp"
    here_live = tmp_path / f"{k}.kvc.{os.getppid()}.5.1.p{PID_NAMESPACE}.tmp"
    unnamed_dead = tmp_path / f"{k}.kvc.{_dead_pid()}.6.1.tmp"
    for p in (foreign_dead, foreign_ours, foreign_stale, here_dead, here_live, unnamed_dead):
        p.write_bytes(b"partial")
    os.utime(foreign_stale, (1, 1))
    assert list(tier.scan()) == []
    assert sorted(data_names(tmp_path)) == sorted(
        [foreign_dead.name, foreign_ours.name, here_live.name]
    )
    # What this process writes carries its namespace, and reads back as its own.
    written = tmp_name(f"{k}.kvc", 7)
    assert tmp_owner(written) == (os.getpid(), PID_NAMESPACE)
    assert tmp_owner(f"{k}.kvc.12.1.1.tmp") == (12, PID_NAMESPACE)
    assert tmp_owner(f"{k}.kvc.12.1.1.pab.tmp") == (12, "ab")
    assert tmp_owner("junk.tmp") is None


@pytest.mark.parametrize("quarantine", [True, False])
def test_scan_quarantines_invalid_files_and_keeps_going(tmp_path: Path, quarantine: bool) -> None:
    tier = FileTier("disk", tmp_path, 1 << 20, quarantine=quarantine)
    book = FakeBook()
    good = []
    for i in range(3):
        key, req = request((i, i + 1))
        assert tier.store(key, req, book) is not None
        good.append(key)
    k_junk, k_wrong = cache_key(NS, (77,)), cache_key(NS, (78,))
    (tmp_path / f"{k_junk.hex()}.kvc").write_bytes(b"KVC\x01 not really")
    os.link(tier.path_for(good[0]), tmp_path / f"{k_wrong.hex()}.kvc")  # valid, wrong name
    (tmp_path / "notakey.kvc").write_bytes(b"")
    (tmp_path / f"{'cd' * 32}.kvc").mkdir()  # unreadable as a file: must not stop the scan
    (tmp_path / "README").write_text("not ours")
    rows = list(FileTier("disk", tmp_path, 1 << 20, quarantine=quarantine).scan())
    assert sorted(r.info.key for r in rows) == sorted(good)
    bad = sorted([f"{k_junk.hex()}.kvc", f"{k_wrong.hex()}.kvc", "notakey.kvc"])
    left = set(data_names(tmp_path))
    assert not left & set(bad)
    if quarantine:
        assert sorted(os.listdir(tmp_path / "quarantine")) == bad
    else:
        assert "quarantine" not in left
    assert {"README", f"{'cd' * 32}.kvc"} <= left


def test_probe_of_junk_is_none_and_leaves_it(tmp_path: Path) -> None:
    tier = FileTier("disk", tmp_path, 1 << 20)
    key = cache_key(NS, (1,))
    tier.path_for(key).write_bytes(b"\0" * 200)
    assert tier.probe(key) is None
    assert tier.path_for(key).exists()


def test_record_hit_on_missing_or_tiny_file_is_harmless(tmp_path: Path) -> None:
    tier = FileTier("disk", tmp_path, 1 << 20)
    key, req = request((3, 3))
    row = tier.store(key, req, FakeBook())
    assert row is not None
    tier.delete(key)
    tier.record_hit(row, 1, 2.0)
    assert not tier.path_for(key).exists()
    tier.path_for(key).write_bytes(b"tiny")
    tier.record_hit(row, 1, 2.0)
    assert tier.path_for(key).read_bytes() == b"tiny"
