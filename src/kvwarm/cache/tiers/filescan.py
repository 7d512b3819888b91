"""The file store's part of a startup scan (the generic part, adopting valid rows and
rejecting invalid ones, is ``objects.ObjectTier.scan``): reap interrupted temp files, and move
what the scan rejects into ``quarantine/``.

Invariants:

- A temp file is reaped only if nobody may still be writing it: not one of ours in progress,
  and not another live process's younger than ``stale_tmp_s`` (a shared root); on a directory
  several hosts share (``multi_host``), and for a temp file another pid namespace wrote (a
  container beside ours on one host), a pid says nothing about liveness, so age decides.
- With ``remove=False`` (``repair=False``: ``kvwarm cache verify``) no temp file is removed;
  each is reported.
- ``set_aside`` moves an invalid file to ``quarantine/`` (or deletes it), never a directory
  named like a cache file, so ``kvwarm cache verify`` later counts what the scans fixed; a
  file it cannot move (``quarantine/`` unusable) is left and reported, the scan goes on.
- A directory named like a cache file (``<hex>.kvc``, ``<hex>.kvk``) is never
  moved or removed, but every scan logs and reports it (``misplaced_dirs``): it stands where a
  save of that key must link its file, so every such save fails until it is gone.
- One bad file never stops a scan: every error is confined to its file.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvwarm.cache.tiers.fsutil import list_dir, open_private_subdir, unlink_quiet
from kvwarm.cache.tiers.layout import (
    CHUNK_SUFFIX,
    PID_NAMESPACE,
    QUARANTINE,
    ROW_SUFFIX,
    TMP_SUFFIX,
    tmp_owner,
)
from kvwarm.errors import UnsafeCacheDirError

__all__ = ["misplaced_dirs", "quarantined", "reap_temps", "set_aside"]

log = logging.getLogger(__name__)


def reap_temps(
    dir_fd: int,
    listed: Sequence[str],
    root: Path,
    tier: str,
    *,
    remove: bool,
    writing: Callable[[str], bool],
    stale_tmp_s: float,
    multi_host: bool,
) -> list[tuple[str, str]]:
    """Remove the interrupted temp files among ``listed`` (names below ``dir_fd``;
    ``writing(name)``: ours, still being written); (path, why) of those left in place
    because ``remove`` is False."""
    problems: list[tuple[str, str]] = []
    for name in (n for n in listed if n.endswith(TMP_SUFFIX)):
        try:
            if writing(name) or _live(dir_fd, name, stale_tmp_s, multi_host):
                continue
        except FileNotFoundError:
            continue  # removed by someone else meanwhile
        except OSError as exc:
            log.warning("%s: cannot stat %s: %s", tier, name, exc)
            continue
        if not remove:
            problems.append((str(root / name), "interrupted temp file"))
            continue
        log.info("%s: removing interrupted temp file %s", tier, name)
        unlink_quiet(dir_fd, name)
    return problems


def misplaced_dirs(dir_fd: int, root: Path, tier: str) -> list[tuple[str, str]]:
    """(path, why) of each directory below ``dir_fd`` named like a row or chunk file,
    each logged: left where it is (not ours to remove), yet never silent."""
    problems: list[tuple[str, str]] = []
    try:
        names = sorted(
            name
            for name, is_dir in list_dir(dir_fd)
            if is_dir and name.endswith((ROW_SUFFIX, CHUNK_SUFFIX))
        )
    except OSError as exc:
        log.warning("%s: cannot list %s: %s", tier, root, exc)
        return problems
    for name in names:
        why = "a directory where a cache file belongs: saves of this key fail until it is removed"
        log.warning("%s: %s is %s", tier, root / name, why)
        problems.append((str(root / name), why))
    return problems


def _live(dir_fd: int, name: str, stale_tmp_s: float, multi_host: bool) -> bool:
    """Whether another process may still be writing temp file ``name``: its owner is alive
    (any owner, on a directory several hosts mount, or from another pid namespace) and it is
    younger than ``stale_tmp_s``. A pid is another process's only in our namespace: two
    containers sharing a directory each reaped the other's temp files in progress, found
    dead by a pid that meant another process here, or none, or ours (found by review: the
    other's save then failed)."""
    owner = tmp_owner(name)
    if owner is None:
        return False
    pid, namespace = owner
    foreign = multi_host or namespace != PID_NAMESPACE
    return (foreign or (pid != os.getpid() and _pid_alive(pid))) and time.time() - os.stat(
        name, dir_fd=dir_fd, follow_symlinks=False
    ).st_mtime < stale_tmp_s


def quarantined(dir_fd: int, where: str) -> tuple[int, int]:
    """(row files, chunk files) in ``quarantine/`` below ``dir_fd``."""
    try:
        qdir = os.open(QUARANTINE, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return 0, 0
    except OSError as exc:
        log.warning("cannot list %s/%s: %s", where, QUARANTINE, exc)
        return 0, 0
    try:
        names = os.listdir(qdir)
    finally:
        os.close(qdir)
    rows = sum(1 for n in names if n.endswith(ROW_SUFFIX))
    return rows, sum(1 for n in names if n.endswith(CHUNK_SUFFIX))


def set_aside(dir_fd: int, name: str, *, quarantine: bool, tier: str) -> bool:
    """Move the invalid file ``name`` into ``quarantine/`` (or delete it); a directory named
    like a cache file is left alone. Errors are logged, never raised: False when the file is
    still there (``quarantine/`` unusable, e.g. refused as not private), for the caller to
    report."""
    try:
        if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return True  # e.g. a directory named like a row: not ours to remove
        if quarantine:
            qdir = open_private_subdir(dir_fd, QUARANTINE)
            try:
                os.replace(name, name, src_dir_fd=dir_fd, dst_dir_fd=qdir)
            finally:
                os.close(qdir)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass  # removed by someone else meanwhile
    except (OSError, UnsafeCacheDirError) as exc:
        log.error("%s: cannot remove invalid file %s: %s", tier, name, exc)
        return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
