"""The startup scan of a file tier: adopt valid rows, reap interrupted temp files, quarantine
(or delete) invalid files.

Invariants:

- One bad file never stops the scan: every error is confined to its file.
- A temp file is reaped only if nobody may still be writing it: not one of ours in progress,
  and not another live process's younger than ``stale_tmp_s`` (a shared root).
- With ``repair=False`` nothing in the directory is moved or deleted: invalid files and
  interrupted temp files are only reported (``problems``), for ``kvwarm cache verify``.
- On a directory several hosts share (``multi_host``) a file this process cannot read is only
  reported, never quarantined: it may be a row another host's (newer) kvwarm reads.
- A directory named like a row is never removed.
- Rows are yielded from their metadata, checked by length (header, trailer and payload must
  end exactly at the file's size: a truncated or extended file fails) and by the metadata
  CRC32C over header, trailer and TLV (a flipped trailer byte fails); the payload CRC is
  checked when the row is loaded (a full read of every file would make startup slow).
- What a repairing scan rejects is moved to ``quarantine/`` (``set_aside``), chunks included
  (``chunkfiles.py``), so ``kvwarm cache verify`` later counts what the scans fixed.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.tiers.fsutil import open_private_subdir, unlink_quiet
from kvwarm.cache.tiers.layout import (
    QUARANTINE,
    ROW_SUFFIX,
    TMP_SUFFIX,
    key_of,
    row_from_file,
    tmp_owner_pid,
)
from kvwarm.cache.types import TierName
from kvwarm.errors import CacheFormatError

__all__ = ["DirScan", "set_aside"]

log = logging.getLogger(__name__)


class DirScan:
    """Scans one tier directory; ``writing(name)`` says whether a temp file is ours and still
    being written (the publisher's answer)."""

    def __init__(
        self,
        tier: TierName,
        root: Path,
        *,
        repair: bool,
        quarantine: bool,
        stale_tmp_s: float,
        writing: Callable[[str], bool],
        multi_host: bool = False,
    ) -> None:
        self._tier = tier
        self._root = root
        self._repair = repair
        self._quarantine = quarantine
        self._stale_tmp_s = stale_tmp_s
        self._writing = writing
        self._multi_host = multi_host
        self.problems: list[tuple[str, str]] = []  # (path, why) left in place by the last scan

    def scan(self, dir_fd: int) -> Iterator[StoredRow]:
        self.problems = []
        try:
            names = sorted(e.name for e in os.scandir(dir_fd))
        except OSError as exc:
            log.error("%s: cannot list %s: %s", self._tier, self._root, exc)
            return
        for name in names:
            try:
                if name.endswith(TMP_SUFFIX):
                    self._reap_tmp(dir_fd, name)
                    continue
                if not name.endswith(ROW_SUFFIX):
                    continue  # the quarantine dir, or files that are not ours
                key = key_of(name)
                if key is None:
                    raise CacheFormatError("not a <hex key>.kvc name")
                yield row_from_file(dir_fd, self._root, self._tier, name, key)
            except FileNotFoundError:
                continue  # removed by someone else meanwhile
            except (OSError, CacheFormatError) as exc:
                self._discard(dir_fd, name, exc)

    def _reap_tmp(self, dir_fd: int, name: str) -> None:
        if self._writing(name):
            return
        pid = tmp_owner_pid(name)
        # Another live process may be mid-save in a shared root: only reap its file if stale.
        # On a directory several hosts mount a pid says nothing about liveness: age decides.
        if (
            pid is not None
            and (self._multi_host or (pid != os.getpid() and _pid_alive(pid)))
            and time.time() - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime
            < self._stale_tmp_s
        ):
            return
        if not self._repair:
            self.problems.append((str(self._root / name), "interrupted temp file"))
            return
        log.info("%s: removing interrupted temp file %s", self._tier, name)
        unlink_quiet(dir_fd, name)

    def _discard(self, dir_fd: int, name: str, why: Exception) -> None:
        if not self._repair or self._multi_host:
            # Other hosts share the directory: a file this kvwarm cannot read may be one a
            # newer kvwarm wrote and still reads. Reported (``kvwarm cache verify``), kept.
            self.problems.append((str(self._root / name), str(why)))
            if self._repair:
                log.warning("%s: cannot read %s, leaving it: %s", self._tier, name, why)
            return
        log.warning("%s: invalid cache file %s: %s", self._tier, name, why)
        set_aside(dir_fd, name, quarantine=self._quarantine, tier=self._tier)

    def drop(self, dir_fd: int, name: str, why: Exception) -> bool:
        """Reject a row file the cache found unusable after the scan yielded it (a manifest
        naming chunks that are gone), as the scan rejects an invalid one. False, changing and
        reporting nothing, on a read-only open or a multi-host directory: the row is adopted
        and its first read (or ``verify``) finds the chunk missing."""
        if not self._repair or self._multi_host:
            return False
        self._discard(dir_fd, name, why)
        return True


def set_aside(dir_fd: int, name: str, *, quarantine: bool, tier: TierName) -> None:
    """Move the invalid file ``name`` into ``quarantine/`` (or delete it); a directory named
    like a cache file is left alone. Errors are logged, never raised."""
    try:
        if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return  # e.g. a directory named like a row: not ours to remove
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
    except OSError as exc:
        log.error("%s: cannot remove invalid file %s: %s", tier, name, exc)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
