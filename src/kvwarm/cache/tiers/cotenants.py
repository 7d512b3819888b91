"""Whether other processes have used a file tier's directory (a registry of locked files).

Chunk refcounts are per process (docs/internals.md, "Refcounts and eviction"): a process knows
the rows it wrote or adopted, not rows another process published into the same directory
meanwhile.
So it may delete a chunk its own rows stopped naming only while nobody else has used the
directory since it opened it; from then on the chunks are only forgotten and the directory's
mark-and-sweep (``cache/upkeep/sharedgc.py``, which reads every manifest there) reclaims them.

Every ``FileTier`` on a local directory registers here when it opens:
``<root>/procs/<pid>-<random>.lock``, holding an exclusive ``flock`` on it for as long as
the tier is open (the kernel drops it when the process dies). ``seen()`` lists the registry:
any entry but ours (a live process's, locked; or a finished one's, unlocked) means another
process has used the directory since we opened it, rows we never indexed included. Files
left at open time belong to processes that are gone; their rows were on disk before our
startup scan and are indexed by it, so those files are removed then. A clean close leaves
its file (unlocked) for the others to see, and a later opener removes it. A registration
killed before its rename to its listed name leaves ``<pid>-<random>.lock.new``: an opener
removes it once that pid is gone (found by the crash harness: it stayed forever).

A maintenance process (``kvwarm cache gc``, ``verify --repair``: it writes no row and no
chunk) registers as ``<pid>-<random>.maint``, which the others do not count: no row of its
can name a chunk theirs stopped naming, so it changes nothing of theirs (found by review: one
``kvwarm cache gc`` turned a lone server's directory co-tenanted until it stopped, its evicted
chunks left to the hourly sweep, over its quota meanwhile). It counts them as any process does.

Invariants: every name is opened below the private directory fd without following links; a
registration holds one descriptor (its lock file); nothing blocks (``LOCK_NB``); ``seen()`` is
sticky: once true it stays true until close; an entry it cannot probe counts as a process.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import stat
import threading

from kvwarm.cache.tiers.fsutil import open_private_subdir, unlink_quiet

__all__ = ["PROCS", "Cotenants"]

log = logging.getLogger(__name__)

PROCS = "procs"
_SUFFIX = ".lock"
_MAINT = ".maint"  # a maintenance process's registration: not counted by the others
_FRESH = ".lock.new"  # a registration before its rename to its listed name
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class Cotenants:
    """This process's registration in one directory. Thread-safe."""

    def __init__(self, dir_fd: int, where: str, *, maintenance: bool = False) -> None:
        self._where = where
        self._lock = threading.Lock()
        suffix = _MAINT if maintenance else _SUFFIX
        self._name = f"{os.getpid()}-{secrets.token_hex(8)}{suffix}"
        self._fd: int | None = None  # our lock file: the only descriptor held
        procs = open_private_subdir(dir_fd, PROCS)
        try:
            # Locked before it gets its listed name: an opener removing finished processes'
            # files never sees ours unlocked.
            fresh = self._name + _FRESH
            fd = os.open(fresh, os.O_CREAT | os.O_EXCL | os.O_RDWR | _FLAGS, 0o600,
                         dir_fd=procs)  # fmt: skip
            self._fd = fd
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(fresh, self._name, src_dir_fd=procs, dst_dir_fd=procs)
            live = self._others(procs, remove_finished=True)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(procs)
        self._seen = live > 0
        if self._seen:
            log.info("%s: %d other live processes use this directory", where, live)

    def seen(self, dir_fd: int) -> bool:
        """Whether another process has used the directory (``dir_fd``, the one registered
        in) since this one registered."""
        with self._lock:
            if not self._seen and self._fd is not None and self._count(dir_fd):
                self._seen = True
                log.info(
                    "%s: another process uses this directory: its chunks are now freed by the "
                    "sweep, not deleted with their last row here",
                    self._where,
                )
            return self._seen

    def _count(self, dir_fd: int) -> int:
        try:
            procs = os.open(PROCS, os.O_RDONLY | os.O_DIRECTORY | _FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            log.warning("%s: cannot open %s (assuming other processes): %s", self._where,
                        PROCS, exc)  # fmt: skip
            return 1
        try:
            return self._others(procs, remove_finished=False)
        finally:
            os.close(procs)

    def _others(self, procs: int, *, remove_finished: bool) -> int:
        """How many entries but ours the registry holds (only live ones when
        ``remove_finished``: finished processes' files are removed then)."""
        count = 0
        try:
            listed = [e.name for e in os.scandir(procs)]
        except OSError as exc:
            log.warning("%s: cannot list %s (assuming other processes): %s", self._where,
                        PROCS, exc)  # fmt: skip
            return 1
        names = [n for n in listed if n.endswith(_SUFFIX)]
        if remove_finished:
            for name in listed:
                if name.endswith(_FRESH) and _dead(name) and not _held(procs, name):
                    unlink_quiet(procs, name)  # a registration killed before its rename
                elif name.endswith(_MAINT) and name != self._name and not _held(procs, name):
                    unlink_quiet(procs, name)  # a finished maintenance process's
        for name in names:
            if name == self._name:
                continue
            if not remove_finished:
                count += 1
                continue
            if _held(procs, name):
                count += 1
            else:
                unlink_quiet(procs, name)
        return count

    def close(self) -> None:
        """Give up the lock; the file stays for the others to see (a later opener removes it)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)  # closing drops the flock
                self._fd = None


def _dead(name: str) -> bool:
    """Whether the process whose pid starts ``name`` is gone (unknown: it is not)."""
    pid = name.partition("-")[0]
    if not pid.isascii() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # EPERM: alive, another user's; a pid out of range
        return False
    return False


def _held(dir_fd: int, name: str) -> bool:
    """Whether some process holds ``name``'s lock (unknown: assume it does)."""
    try:
        # O_NONBLOCK: opening a FIFO planted under that name must not wait for a writer.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True  # not a registration: cannot be probed, so counted (and kept)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
