"""The registry of processes using a cache directory (``cache/tiers/cotenants.py``): who is
seen, when, and what a process killed with SIGKILL or closed cleanly leaves behind.

Each ``Cotenants`` opens its own lock file, so two in one process behave like two processes
(``flock`` locks belong to open file descriptions)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwarm.cache.tiers.cotenants import PROCS, Cotenants
from kvwarm.cache.tiers.fsutil import open_private_dir

CHILD = """
import os, sys
from kvwarm.cache.tiers.cotenants import Cotenants
from kvwarm.cache.tiers.fsutil import open_private_dir
reg = Cotenants(open_private_dir(__import__("pathlib").Path(sys.argv[1])), "child")
sys.stdout.write("registered\\n")
sys.stdout.flush()
sys.stdin.readline()
os.kill(os.getpid(), 9)
"""


@pytest.fixture()
def root(tmp_path: Path) -> Iterator[int]:
    fd = open_private_dir(tmp_path / "cache")
    yield fd
    os.close(fd)


def _entries(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "cache" / PROCS).iterdir())


def test_processes_see_each_other_once_both_registered(root: int, tmp_path: Path) -> None:
    a = Cotenants(root, "a")
    assert not a.seen(root)
    assert len(_entries(tmp_path)) == 1
    b = Cotenants(root, "b")
    assert b.seen(root)  # a is alive when b opens
    assert a.seen(root)  # b registered after a
    b.close()
    assert a.seen(root)  # sticky: b's rows may still be in the directory
    a.close()


def test_a_clean_close_is_seen_by_those_running_and_cleared_by_the_next_opener(
    root: int, tmp_path: Path
) -> None:
    a = Cotenants(root, "a")
    b = Cotenants(root, "b")
    b.close()
    a.close()
    assert len(_entries(tmp_path)) == 2  # both files stay, unlocked
    c = Cotenants(root, "c")
    assert not c.seen(root)  # both are gone: their rows were there before c's startup scan
    assert len(_entries(tmp_path)) == 1
    c.close()


def test_a_maintenance_process_is_not_counted_but_counts_the_others(
    root: int, tmp_path: Path
) -> None:
    """``kvwarm cache gc`` and ``verify --repair`` write no row: a server alone in its
    directory stays alone while they run (found by review: one ``gc`` made it co-tenanted
    until it stopped), while they see the server, as any process does."""
    server = Cotenants(root, "server")
    gc = Cotenants(root, "gc", maintenance=True)
    assert gc.seen(root)
    assert not server.seen(root)
    gc.close()
    assert not server.seen(root)
    assert len(_entries(tmp_path)) == 2  # gc's file stays, unlocked, until the next opener
    server.close()
    later = Cotenants(root, "later")
    assert not later.seen(root)
    assert len(_entries(tmp_path)) == 1  # both finished registrations cleared
    later.close()
    alone = Cotenants(root, "gc again", maintenance=True)
    assert not alone.seen(root)  # nobody else: it decides as a lone process
    alone.close()


def test_a_process_killed_with_sigkill_drops_its_lock(root: int, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "cache")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline() == "registered\n"
    live = Cotenants(root, "live")
    assert live.seen(root)  # the child holds its lock
    live.close()
    child.stdin.write("die\n")
    child.stdin.flush()
    assert child.wait(timeout=30) == -signal.SIGKILL
    after = Cotenants(root, "after")
    assert not after.seen(root)  # the kernel dropped the dead child's lock; its file is removed
    assert len(_entries(tmp_path)) == 1
    after.close()


def test_a_symlink_in_the_registry_is_not_followed(root: int, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    (tmp_path / "cache" / PROCS).mkdir(mode=0o700)
    (tmp_path / "cache" / PROCS / "1-abc.lock").symlink_to(target)
    reg = Cotenants(root, "a")
    assert reg.seen(root)  # cannot tell whose it is: counted as another process
    assert target.read_bytes() == b"keep"
    reg.close()


def test_a_fifo_in_the_registry_is_counted_without_waiting_for_a_writer(
    root: int, tmp_path: Path
) -> None:
    """Opening a FIFO read-only blocks until a writer comes: the probe must not."""
    first = Cotenants(root, "a")  # creates the registry
    first.close()
    os.mkfifo(tmp_path / "cache" / PROCS / "planted.lock")
    reg = Cotenants(root, "c")  # hung in os.open before
    assert reg.seen(root)  # an entry it cannot probe counts as a process
    assert "planted.lock" in _entries(tmp_path)  # and is not removed as a finished one
    reg.close()
