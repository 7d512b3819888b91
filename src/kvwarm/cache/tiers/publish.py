"""The file tiers' side of the crash-safe publish protocol (``common.publish_row`` runs the
five stages for every tier; here is how a file tier stages and commits a row), step by step.

Invariants:

- A ``.kvc`` name only ever appears through ``link(2)`` of a temp file whose bytes were already
  fdatasync'ed, so a visible row file is complete whatever kills the writer.
- The index is asked at each step (``ReservationBook``): a reservation lost before the link is
  abandoned there; one lost at publish leaves the file for the index or the scan to decide, and
  the row is not announced.
- A failed fsync is never retried and a row whose sync failed is never announced: any OSError
  removes our temp file (and our link), abandons the reservation and raises ``CacheIOError``;
  files that existed before are left untouched.
- ``O_EXCL`` creates and no-follow links: a name planted in the way fails the save instead of
  being written through.

``PUBLISH_STEPS`` names the steps in order; fault-injection tests (tests/faults/) kill a writer
after each one. See docs/architecture.md ("Crash-safe publish").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvwarm.cache import kvc
from kvwarm.cache.protocols import ReservationBook, StoredRow
from kvwarm.cache.tiers.common import StepHook, publish_row, row_info
from kvwarm.cache.tiers.fsutil import read_file, read_meta, unlink_quiet
from kvwarm.cache.tiers.layout import name_for, tmp_name
from kvwarm.cache.types import SaveRequest, TierName
from kvwarm.errors import CacheFormatError, CacheIOError

__all__ = ["PUBLISH_STEPS", "Publisher", "StepHook"]

log = logging.getLogger(__name__)

# The steps of a fresh publish, in order; an EEXIST adoption reports "adopted" in place of
# "linked". Fault-injection tests kill a writer after each one.
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


@dataclass(slots=True)
class _Attempt:
    """One store's names, and whether the final name is ours to remove if a later step fails."""

    key: bytes
    token: int
    final: str
    tmp: str
    linked_ours: bool = False
    fields: kvc.KvcFields | None = None
    prefix_len: int = 0  # the row file's metadata prefix, before its payload


class _FileStaged:
    """Stage: the durable temp file (steps 2-3). Link: link(2) with no-follow; a name taken
    by a valid file of the key is adopted (read in full, CRC checked), junk is unlinked
    (``common.publish_row`` decides). Settle: drop the temp name, fsync the directory (step
    4). Undo: remove our temp file and, if the link was ours, the final name."""

    def __init__(
        self, publisher: Publisher, dir_fd: int, att: _Attempt, request: SaveRequest
    ) -> None:
        self._p = publisher
        self._dir = dir_fd
        self.att = att
        self._request = request

    def write(self) -> None:
        att, request = self.att, self._request
        att.fields = kvc.fields_from_request(request, now=time.time())
        prefix = kvc.build_prefix(att.fields, request.payload)
        att.prefix_len = len(prefix)
        try:
            self._p._write_tmp(self._dir, att.tmp, (prefix, request.payload))
        except BaseException:
            unlink_quiet(self._dir, att.tmp)
            raise

    def link(self) -> bool:
        att = self.att
        try:
            d = self._dir
            os.link(att.tmp, att.final, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
        except FileExistsError:
            return False
        att.linked_ours = True
        return True

    def existing(self) -> StoredRow | None:
        meta = self._p._read_valid(self._dir, self.att.final, self.att.key)
        if meta is None:
            return None
        info = row_info(
            self.att.key,
            self._p._tier,
            meta.fields,
            meta.payload_length,
            stored_bytes=meta.payload_offset + meta.payload_length,
        )
        location = str(self._p._root / self.att.final)
        fields = meta.fields
        return StoredRow(info, fields.tokens, location, fields.chunks, fields.chunk_lens)

    def clear(self) -> None:
        unlink_quiet(self._dir, self.att.final)

    def settle(self, adopted: StoredRow | None) -> StoredRow:
        return self._p._settle(self._dir, self.att, self._request, adopted)

    def undo(self) -> None:
        self._p._undo(self._dir, self.att)

    def lost(self) -> None:
        """The file stays for the index (which may have adopted it) or the scan to decide."""


class Publisher:
    """Runs the protocol for one tier directory. Thread-safe: each store has its own temp file;
    ``writing`` tells the scan which temp files are ours and still being written."""

    def __init__(self, tier: TierName, root: Path, on_step: StepHook | None) -> None:
        self._tier = tier
        self._root = root
        self._on_step = on_step
        self._lock = threading.Lock()
        self._writing: set[str] = set()

    def writing(self, name: str) -> bool:
        with self._lock:
            return name in self._writing

    def begin_writing(self, name: str) -> None:
        """A temp file of ours (e.g. a chunk's) that the scan must leave alone."""
        with self._lock:
            self._writing.add(name)

    def end_writing(self, name: str) -> None:
        with self._lock:
            self._writing.discard(name)

    def _step(self, name: str) -> None:
        if self._on_step is not None:
            self._on_step(name)

    def store(
        self, dir_fd: int, key: bytes, request: SaveRequest, book: ReservationBook
    ) -> StoredRow | None:
        """The whole protocol (``common.publish_row``) over a temp file and link(2); see
        ``Tier.store`` for the contract."""
        staged: list[_FileStaged] = []

        def stage(token: int) -> _FileStaged:
            final = name_for(key)
            att = _Attempt(key, token, final, tmp_name(final, token))
            staged.append(_FileStaged(self, dir_fd, att, request))
            staged[-1].write()
            return staged[-1]

        try:
            return publish_row(self._tier, key, request, book, stage, self._on_step)
        except OSError as exc:
            raise CacheIOError(
                f"{self._tier}: saving {key.hex()} failed: {exc}", errno=exc.errno
            ) from exc
        finally:
            for one in staged:
                self.end_writing(one.att.tmp)

    def _settle(
        self, dir_fd: int, att: _Attempt, request: SaveRequest, adopted: StoredRow | None
    ) -> StoredRow:
        """After the link (or the adoption of a valid file already there): the temp name
        dropped and the directory made durable."""
        self._step("linked" if adopted is None else "adopted")
        # The data is reachable through the final name now; dropping the temp name before
        # the directory fsync lets one fsync make both name changes durable.
        unlink_quiet(dir_fd, att.tmp)
        self._step("tmp_unlinked")
        os.fsync(dir_fd)
        self._step("dir_synced")
        if adopted is not None:
            return adopted
        assert att.fields is not None
        location = str(self._root / att.final)
        n = memoryview(request.payload).nbytes
        info = row_info(att.key, self._tier, att.fields, n, stored_bytes=att.prefix_len + n)
        return StoredRow(info, request.tokens, location, request.chunk_keys, request.chunk_lens)

    def _undo(self, dir_fd: int, att: _Attempt) -> None:
        unlink_quiet(dir_fd, att.tmp)
        if att.linked_ours:
            unlink_quiet(dir_fd, att.final)  # linked but not durably: never leave it visible
            att.linked_ours = False

    def _write_tmp(self, dir_fd: int, tmp: str, parts: Sequence[kvc.Buffer]) -> None:
        with self._lock:
            self._writing.add(tmp)
        # O_EXCL never follows a link: a name planted in the way fails the save instead.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            self._step("tmp_opened")
            _write_all(fd, parts)
            self._step("tmp_written")
            # Stage 2 ends durable: linking unsynced bytes could publish a zero-length row.
            os.fdatasync(fd)
            self._step("tmp_synced")
        finally:
            os.close(fd)

    def _read_valid(self, dir_fd: int, name: str, key: bytes) -> kvc.KvcMeta | None:
        try:
            # Metadata first (bounded read): junk in the way is not read in full.
            if read_meta(dir_fd, name).key != key:
                raise CacheFormatError("holds another key")
            return kvc.parse(read_file(dir_fd, name, None)[0], expected_key=key).meta
        except FileNotFoundError:
            return None
        except CacheFormatError as exc:
            log.info("%s: %s is invalid: %s", self._tier, name, exc)
            return None


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
