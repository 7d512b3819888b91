"""The file system refuses a save (ENOSPC, EIO, ...): CacheIOError carrying the errno, the
reservation abandoned, no temp file left, no new row visible, existing rows byte-identical,
and a failed fsync is never retried."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import data_names, request
from tests.faults.test_kill9 import CHILD, child_env

from kvwarm.cache.tiers import files as files_mod
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.types import SaveRequest
from kvwarm.errors import CacheIOError


def _digest(root: Path) -> dict[str, str]:
    return {n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in data_names(root)}


def _setup(tmp_path: Path) -> tuple[FileTier, FakeBook, dict[str, str]]:
    tier, book = FileTier("disk", tmp_path, 1 << 30), FakeBook()
    for i in range(3):
        key, req = request((i, 40 + i))
        assert tier.store(key, req, book) is not None
    return tier, book, _digest(tmp_path)


def _fails_cleanly(
    tmp_path: Path,
    tier: FileTier,
    book: FakeBook,
    before: dict[str, str],
    code: int,
    *,
    probe_fails: bool = False,
) -> None:
    key, req = request((99, 98, 97), payload=b"x" * 100_000)
    with pytest.raises(CacheIOError) as info:
        tier.store(key, req, book)
    assert info.value.errno == code
    assert isinstance(info.value.__cause__, OSError)
    assert not book.reservations and key not in book.published
    assert book.calls[-1] == "abandon"
    assert _digest(tmp_path) == before  # no tmp, no new row, old rows untouched
    if not probe_fails:
        assert tier.probe(key) is None
    else:  # it cannot open the file either: it cannot say, which is no "there is none"
        with pytest.raises(CacheIOError):
            tier.probe(key)


class _Failing:
    """An ``os.*`` replacement that always fails with ``code`` and counts its calls."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls = 0

    def __call__(self, *args: object, **kwargs: object) -> int:
        self.calls += 1
        raise OSError(self.code, os.strerror(self.code))


def test_enospc_on_first_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, book, before = _setup(tmp_path)
    monkeypatch.setattr(files_mod.os, "writev", _Failing(errno.ENOSPC))
    _fails_cleanly(tmp_path, tier, book, before, errno.ENOSPC)


def test_enospc_after_a_short_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, book, before = _setup(tmp_path)
    real = os.writev

    def short_then_full(fd: int, bufs: list[memoryview]) -> int:
        if not getattr(short_then_full, "done", False):
            short_then_full.done = True  # type: ignore[attr-defined]
            return real(fd, [bufs[0][:10]])  # partial write, like a nearly full disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files_mod.os, "writev", short_then_full)
    _fails_cleanly(tmp_path, tier, book, before, errno.ENOSPC)


def test_fdatasync_failure_is_not_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, book, before = _setup(tmp_path)
    fake = _Failing(errno.EIO)
    monkeypatch.setattr(files_mod.os, "fdatasync", fake)
    _fails_cleanly(tmp_path, tier, book, before, errno.EIO)
    assert fake.calls == 1


def test_link_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, book, before = _setup(tmp_path)
    monkeypatch.setattr(files_mod.os, "link", _Failing(errno.EMLINK))
    _fails_cleanly(tmp_path, tier, book, before, errno.EMLINK)


def test_dir_fsync_failure_unlinks_our_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, book, before = _setup(tmp_path)
    fake = _Failing(errno.EIO)
    monkeypatch.setattr(files_mod.os, "fsync", fake)
    _fails_cleanly(tmp_path, tier, book, before, errno.EIO)  # linked, then removed again
    assert fake.calls == 1


def test_open_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, book, before = _setup(tmp_path)
    monkeypatch.setattr(files_mod.os, "open", _Failing(errno.EACCES))
    _fails_cleanly(tmp_path, tier, book, before, errno.EACCES, probe_fails=True)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs user+mount namespaces (unshare -Urm)")
def test_enospc_on_a_real_tiny_tmpfs(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = f'mount -t tmpfs -o size=256k tmpfs "{mnt}" && exec "$0" "$@"'
    proc = subprocess.run(
        # A directory of its own on the mount: a tmpfs root is 1777, shared, and refused.
        [
            *("unshare", "-Urm", "sh", "-c", script, sys.executable, str(CHILD)),
            *("enospc", str(mnt / "kvwarm")),
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["errno"] == errno.ENOSPC
    assert result["before"] == result["after"] and result["intact"]
    assert result["listing"] == [f"{result['small']}.kvc"]  # no temp file, no partial row
    assert result["reservations"] == 0
    assert os.listdir(mnt) == []  # the mount lived only in the child's namespace


def test_a_put_staged_before_close_finishes_in_its_own_directory(tmp_path: Path) -> None:
    """A save still running when its cache closes (``Cache.close`` gives up on it after its
    timeout, then closes the tiers): the put keeps its own descriptor of the tier's directory.
    It held the tier's number, closed under it and taken by the next open, so its link, temp
    unlink and directory fsync went to whatever that number then named (found by review:
    ENOENT in another directory, the temp file left behind in the tier's)."""
    root, other = tmp_path / "kvc", tmp_path / "other"
    other.mkdir(mode=0o700)
    entered, go = threading.Event(), threading.Event()

    def hold(step: str) -> None:
        if step == "tmp_synced":
            entered.set()
            assert go.wait(10)

    tier = FileTier("disk", root, 1 << 30, on_step=hold)
    key, req = request((7, 8, 9), payload=b"y" * 10_000)
    out: list[object] = []
    saver = threading.Thread(target=lambda: out.append(_store_or_error(tier, key, req)))
    saver.start()
    assert entered.wait(10)
    tier.close()
    fd = os.open(other, os.O_RDONLY | os.O_DIRECTORY)  # the lowest free number: likely its
    try:
        go.set()
        saver.join(10)
    finally:
        os.close(fd)
    assert not isinstance(out[0], BaseException), out[0]
    assert data_names(root) == [f"{key.hex()}.kvc"]  # published there, no temp file left
    assert os.listdir(other) == []


def _store_or_error(tier: FileTier, key: bytes, req: SaveRequest) -> object:
    try:
        return tier.store(key, req, FakeBook())
    except BaseException as exc:  # handed to the test's thread
        return exc
