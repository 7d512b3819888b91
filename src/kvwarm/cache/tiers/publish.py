"""How a file store puts a row or a chunk, crash-safely: the durable half (a temp file,
fdatasync) runs before the reservation check, the atomic half (link(2), the temp name
dropped, the directory fsync'ed) after it (``objects.StagesPuts``; ``common.publish_row``
runs the five stages for every tier).

Invariants:

- A ``.kvc`` or ``.kvk`` name only ever appears through ``link(2)`` of a temp file whose bytes
  were already fdatasync'ed, and the directory is fsync'ed before the put returns, so a
  visible file is complete whatever kills the writer, and a chunk a manifest names was
  durable before the manifest's own publish began: a crash leaves at worst chunks no manifest
  names (orphans), which the startup scan adopts with no references, evictable first.
- A failed fsync is never retried and a row whose sync failed is never announced: any
  OSError removes our temp file (and a row's link: linked but not durable, it is never left
  visible; a chunk's stays, content-addressed and maybe already named by another writer's
  manifest) and surfaces as ``CacheIOError`` with its errno; files that existed before are
  left untouched.
- ``O_EXCL`` creates and no-follow links: a name planted in the way fails the save instead of
  being written through.
- A put owns a ``dup`` of its directory's descriptor until it is settled or undone, so a save
  still running when its tier closes finishes (or is undone) in that directory, never through
  a closed number the next open reused. Undoing a settled put changes nothing: its file is
  durable and complete, left for the index or a scan to decide (as ``lost``).
- Temp names follow ``layout.tmp_name`` (a chunk's with token 0), and while one is being
  written the startup scan leaves it alone (``Publisher.writing``), whichever of this
  process's publishers writes it: two caches of one process may share a directory (two
  engines; a new engine opened while one dropped unclosed still writes its shutdown saves).

``PUBLISH_STEPS`` names a row's steps in order (an EEXIST adoption reports "adopted" in place
of "linked"), ``CHUNK_STEPS`` a chunk's; fault-injection tests (tests/faults/) kill a writer
after each one. See docs/architecture.md ("Crash-safe publish").
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvwarm.cache.formats import kvc
from kvwarm.cache.tiers.common import StepHook
from kvwarm.cache.tiers.fsutil import unlink_quiet
from kvwarm.cache.tiers.layout import CHUNK_SUFFIX, tmp_name
from kvwarm.errors import CacheIOError

__all__ = ["CHUNK_STEPS", "PUBLISH_STEPS", "FilePut", "Publisher", "StepHook"]

log = logging.getLogger(__name__)

PUBLISH_STEPS: tuple[str, ...] = (
    "reserved",
    "tmp_opened",
    "tmp_written",
    "tmp_synced",
    "checked",
    "linked",
    "tmp_unlinked",
    "dir_synced",
    "marked_linked",
    "published",
)
CHUNK_STEPS: tuple[str, ...] = ("chunk_tmp_synced", "chunk_linked", "chunk_dir_synced")


@dataclass(frozen=True, slots=True)
class _Steps:
    """The step names one kind of file reports (None: not reported), and whether its link
    survives a later failure."""

    opened: str | None
    written: str | None
    synced: str
    linked: str
    adopted: str
    unlinked: str | None
    dir_synced: str
    keeps_link: bool


_ROW = _Steps(
    "tmp_opened", "tmp_written", "tmp_synced", "linked", "adopted", "tmp_unlinked",
    "dir_synced", keeps_link=False,
)  # fmt: skip
_CHUNK = _Steps(
    None, None, "chunk_tmp_synced", "chunk_linked", "chunk_linked", None, "chunk_dir_synced",
    keeps_link=True,
)  # fmt: skip


#: The temp files this process is writing, every publisher's (``layout.tmp_name`` makes each
#: name unique in the process). Found by review: each publisher knew only its own, so a second
#: cache on the same directory in this process (another engine's; a new engine opened while one
#: dropped unclosed still wrote its shutdown saves) took the first's temp files in progress for
#: leftovers of an earlier process with this pid, removed them, and failed those saves.
_WRITING: set[str] = set()
_WRITING_LOCK = threading.Lock()


class Publisher:
    """Stages puts in one tier directory. Thread-safe: each put has its own temp file;
    ``writing`` tells the scan which temp files this process is still writing."""

    def __init__(self, tier: str, on_step: StepHook | None) -> None:
        self.tier = tier
        self._on_step = on_step

    def writing(self, name: str) -> bool:
        with _WRITING_LOCK:
            return name in _WRITING

    def step(self, name: str | None) -> None:
        if name is not None and self._on_step is not None:
            self._on_step(name)

    def stage(self, dir_fd: int, final: str, parts: Sequence[kvc.Buffer], token: int) -> FilePut:
        """Write ``parts`` to a durable temp file for ``final`` below ``dir_fd``; raises
        ``CacheIOError`` (after removing it) if that fails. The put owns ``dir_fd`` and
        closes it once settled or undone."""
        steps = _CHUNK if final.endswith(CHUNK_SUFFIX) else _ROW
        try:
            put = FilePut(self, dir_fd, final, tmp_name(final, token), steps)
        except BaseException:
            os.close(dir_fd)
            raise
        with _WRITING_LOCK:
            _WRITING.add(put.tmp)
        try:
            put.write(parts)
        except BaseException:
            put.undo()
            raise
        return put

    def done(self, tmp: str) -> None:
        with _WRITING_LOCK:
            _WRITING.discard(tmp)


class FilePut:
    """One staged file (``objects.StagedPut``): link(2) with no link followed makes it
    visible; settling drops the temp name and fsyncs the directory; undoing removes the temp
    file and, for a row, a link that was ours. It owns its directory descriptor (a ``dup``
    of the store's), closed once it is settled or undone."""

    def __init__(
        self, publisher: Publisher, dir_fd: int, final: str, tmp: str, steps: _Steps
    ) -> None:
        self._p = publisher
        self._dir = dir_fd
        self.final = final
        self.tmp = tmp
        self._steps = steps
        self._linked_ours = False

    def write(self, parts: Sequence[kvc.Buffer]) -> None:
        # O_EXCL never follows a link: a name planted in the way fails the save instead.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with self._errors("saving"):
            fd = os.open(self.tmp, flags, 0o600, dir_fd=self._dir)
            try:
                self._p.step(self._steps.opened)
                _write_all(fd, parts)
                self._p.step(self._steps.written)
                # Durable before the link: linking unsynced bytes could publish a zero-length
                # file.
                os.fdatasync(fd)
            finally:
                os.close(fd)
        self._p.step(self._steps.synced)

    def link(self) -> bool:
        d = self._dir
        with self._errors("linking"):
            try:
                os.link(self.tmp, self.final, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
            except FileExistsError:
                return False
        self._linked_ours = not self._steps.keeps_link
        return True

    def settle(self, adopted: bool) -> None:
        self._p.step(self._steps.adopted if adopted else self._steps.linked)
        # The data is reachable through the final name now; dropping the temp name before
        # the directory fsync lets one fsync make both name changes durable.
        unlink_quiet(self._dir, self.tmp)
        self._p.step(self._steps.unlinked)
        with self._errors("syncing the directory for"):
            os.fsync(self._dir)
        self._p.step(self._steps.dir_synced)
        self._p.done(self.tmp)
        self._release()

    def undo(self) -> None:
        if self._dir < 0:
            return  # settled or undone already
        unlink_quiet(self._dir, self.tmp)
        if self._linked_ours:
            unlink_quiet(self._dir, self.final)  # linked but not durably: never leave it visible
            self._linked_ours = False
        self._p.done(self.tmp)  # gone: no longer written (a failed save's name is not kept)
        self._release()

    def _release(self) -> None:
        fd, self._dir = self._dir, -1
        if fd >= 0:
            os.close(fd)

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            raise CacheIOError(
                f"{self._p.tier}: {doing} {self.final} failed: {exc}", errno=exc.errno
            ) from exc


def _write_all(fd: int, parts: Sequence[kvc.Buffer]) -> None:
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(5, "write made no progress")  # EIO; never loop forever
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
