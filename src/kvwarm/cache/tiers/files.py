"""File tiers (``ram_file`` on /dev/shm, ``disk``): one ``<root>/<hex key>.kvc`` per row.

Invariants:
- A ``.kvc`` name only ever appears through ``link(2)`` of a temp file whose bytes were already
  fdatasync'ed, so a visible row file is complete (the crash-safe publish protocol, erllama's
  five stages). Temp files live in the same directory, named ``<hex>.kvc.<pid>.<token>.<n>.tmp``.
- The path is a pure function of the key (flat directory: rows are MB-sized, so even a large
  quota holds thousands, not millions, of files), so another process sharing the directory
  finds a row it did not write.
- A failed fsync is never retried and a row whose sync failed is never announced: any OSError
  removes our temp file (and our link), abandons the reservation and raises ``CacheIOError``;
  files that existed before are left untouched.
- Every name is resolved against the root's directory fd, without following links, and the
  root is private (``fsutil``): a row swapped for a symlink is reported bad, never written
  through. Loads read into a buffer (no mmap) and verify everything.
- With ``repair=False`` nothing in the directory is moved or deleted by a scan: invalid files
  and interrupted temp files are only reported (``problems``), for ``kvwarm cache verify``.

See docs/architecture.md (the cache) for how the tiers and the index fit together.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvwarm.cache import kvc
from kvwarm.cache.protocols import ReservationBook, RowBytes, StoredRow, TierCapabilities
from kvwarm.cache.tiers.common import check_request, row_info
from kvwarm.cache.tiers.fsutil import (
    open_private_dir,
    open_private_subdir,
    open_regular,
    read_file,
    read_meta,
    unlink_quiet,
)
from kvwarm.cache.tiers.registry import tier_spec
from kvwarm.cache.types import SaveRequest, TierName
from kvwarm.errors import CacheFormatError, CacheIOError, CacheKeyError, ConfigError

__all__ = ["PUBLISH_STEPS", "FileTier", "StepHook"]

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

# Called after each publish step with its name. Exists for fault-injection tests (kill -9 at
# every step); None in production.
StepHook = Callable[[str], None]

_SUFFIX = ".kvc"
_TMP_SUFFIX = ".tmp"
_QUARANTINE = "quarantine"
_HEX = frozenset("0123456789abcdef")
_LINK_ATTEMPTS = 3
# Files outlive the process and other processes may share the directory.
FILE_CAPABILITIES = TierCapabilities(persistent=True, shared=True, local=True)
_tmp_serial = itertools.count(1)  # next() on a count is atomic under the GIL


class FileTier:
    """A directory of KVC files. Thread-safe; several processes may share one root."""

    def __init__(
        self,
        name: TierName,
        root: str | os.PathLike[str],
        quota_bytes: int,
        *,
        quarantine: bool = True,
        repair: bool = True,
        stale_tmp_s: float = 3600.0,
        on_step: StepHook | None = None,
        capabilities: TierCapabilities = FILE_CAPABILITIES,
    ) -> None:
        if not tier_spec(name).needs_root:
            raise ConfigError(f"tier {name!r} is not a file tier (it takes no root directory)")
        if quota_bytes < 0:
            raise ConfigError("file tier quota must be >= 0")
        self._name: TierName = name
        self._capabilities = capabilities
        self._root = Path(root)
        self._quota = quota_bytes
        self._quarantine = quarantine
        self._repair = repair
        self._problems: list[tuple[str, str]] = []
        self._stale_tmp_s = stale_tmp_s
        self._on_step = on_step
        self._lock = threading.Lock()
        self._inflight: set[str] = set()  # our temp files being written; scan keeps them
        try:
            self._dir = open_private_dir(self._root)
        except NotADirectoryError:
            raise ConfigError(f"cache root {self._root} is not a directory") from None
        except OSError as exc:
            raise ConfigError(f"cannot create cache root {self._root}: {exc}") from exc

    @property
    def name(self) -> TierName:
        return self._name

    @property
    def quota_bytes(self) -> int:
        return self._quota

    @property
    def capabilities(self) -> TierCapabilities:
        return self._capabilities

    @property
    def root(self) -> Path:
        return self._root

    def path_for(self, key: bytes) -> Path:
        return self._root / _name_for(key)

    def problems(self) -> tuple[tuple[str, str], ...]:
        """(path, reason) of every bad file the last scan left in place (``repair=False``)."""
        return tuple(self._problems)

    def _step(self, name: str) -> None:
        if self._on_step is not None:
            self._on_step(name)

    # ---- publish -------------------------------------------------------------------------

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        check_request(key, request)
        token = book.reserve(key, self._name)
        if token is None:
            return None
        self._step("reserved")
        final = _name_for(key)
        tmp = f"{final}.{os.getpid()}.{token}.{next(_tmp_serial)}{_TMP_SUFFIX}"
        linked_ours = False
        try:
            fields = kvc.fields_from_request(request, now=time.time())
            prefix = kvc.build_prefix(fields, request.payload)
            self._write_tmp(tmp, (prefix, request.payload))
            if not book.check(key, token):
                log.debug("reservation for %s lost before link; abandoning", key.hex())
                unlink_quiet(self._dir, tmp)
                book.abandon(key, token)
                return None
            self._step("checked")
            adopted = self._link(tmp, final, key)
            linked_ours = adopted is None
            self._step("linked" if linked_ours else "adopted")
            # The data is reachable through the final name now; dropping the temp name before
            # the directory fsync lets one fsync make both name changes durable.
            unlink_quiet(self._dir, tmp)
            self._step("tmp_unlinked")
            os.fsync(self._dir)
            self._step("dir_synced")
            location = str(self._root / final)
            if adopted is None:
                info = row_info(key, self._name, fields, memoryview(request.payload).nbytes)
                row = StoredRow(info, request.tokens, location)
            else:
                info = row_info(key, self._name, adopted.fields, adopted.payload_length)
                row = StoredRow(info, adopted.fields.tokens, location)
            book.mark_linked(key, token, location)
            self._step("marked_linked")
        except OSError as exc:
            self._fail(tmp, final if linked_ours else None, key, token, book)
            raise CacheIOError(
                f"{self._name}: saving {key.hex()} failed: {exc}", errno=exc.errno
            ) from exc
        except BaseException:
            self._fail(tmp, final if linked_ours else None, key, token, book)
            raise
        finally:
            with self._lock:
                self._inflight.discard(tmp)
        if not book.publish(key, token, row):
            # The reservation was reaped (and may have adopted our file) or the key deleted;
            # the file stays for the index/scan to decide, but we must not announce it.
            log.debug("reservation for %s lost at publish", key.hex())
            return None
        self._step("published")
        return row

    def _fail(
        self, tmp: str, our_final: str | None, key: bytes, token: int, book: ReservationBook
    ) -> None:
        unlink_quiet(self._dir, tmp)
        if our_final is not None:
            unlink_quiet(self._dir, our_final)  # linked but not durably: never leave it visible
        book.abandon(key, token)

    def _write_tmp(self, tmp: str, parts: Sequence[kvc.Buffer]) -> None:
        with self._lock:
            self._inflight.add(tmp)
        # O_EXCL never follows a link: a name planted in the way fails the save instead.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=self._dir)
        try:
            self._step("tmp_opened")
            _write_all(fd, parts)
            self._step("tmp_written")
            # Stage 2 ends durable: linking unsynced bytes could publish a zero-length row.
            os.fdatasync(fd)
            self._step("tmp_synced")
        finally:
            os.close(fd)

    def _link(self, tmp: str, final: str, key: bytes) -> kvc.KvcMeta | None:
        """Link ``tmp`` to ``final``. None if we created it; the existing file's metadata if
        one valid for ``key`` was there (adopt). Junk in the way is replaced."""
        for _ in range(_LINK_ATTEMPTS):
            try:
                os.link(
                    tmp, final, src_dir_fd=self._dir, dst_dir_fd=self._dir, follow_symlinks=False
                )
                return None
            except FileExistsError:
                pass
            existing = self._read_valid(final, key)
            if existing is not None:
                return existing
            log.warning("%s: replacing invalid file %s", self._name, final)
            unlink_quiet(self._dir, final)
        raise FileExistsError(17, "link target keeps reappearing invalid", final)

    def _read_valid(self, name: str, key: bytes) -> kvc.KvcMeta | None:
        try:
            # Metadata first (bounded read): junk in the way is not read in full.
            if read_meta(self._dir, name).key != key:
                raise CacheFormatError("holds another key")
            return kvc.parse(read_file(self._dir, name, None)[0], expected_key=key).meta
        except FileNotFoundError:
            return None
        except CacheFormatError as exc:
            log.info("%s: %s is invalid: %s", self._name, name, exc)
            return None

    # ---- read side -----------------------------------------------------------------------

    def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
        name = _name_for(row.info.key)  # a row's file name is a function of its key alone
        try:
            buf, backing = read_file(self._dir, name, buffer)
        except FileNotFoundError:
            raise CacheKeyError(f"{self._name} holds no row {row.info.key.hex()}") from None
        except OSError as exc:
            raise CacheIOError(
                f"{self._name}: reading {name} failed: {exc}", errno=exc.errno
            ) from exc
        f = kvc.parse(buf, expected_key=row.info.key, known_tokens=row.tokens)
        return RowBytes(f.meta.fields.tokens, f.payload, f.meta.fields.logits, backing)

    def delete(self, key: bytes) -> None:
        name = _name_for(key)
        try:
            os.unlink(name, dir_fd=self._dir)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CacheIOError(f"{self._name}: deleting {name} failed", errno=exc.errno) from exc

    def record_hit(self, row: StoredRow, hits: int, last_used: float) -> None:
        """Best effort, no fsync: these header fields are an eviction hint outside every CRC."""
        hits_b, last_b = kvc.pack_hit_fields(hits, last_used)
        name = _name_for(row.info.key)
        try:
            fd = open_regular(self._dir, name, os.O_WRONLY)
        except FileNotFoundError:
            return
        except (OSError, CacheFormatError) as exc:
            log.warning("%s: cannot record hit on %s: %s", self._name, name, exc)
            return
        try:
            if os.fstat(fd).st_size >= kvc.PREFIX_FIXED_SIZE:  # never extend a stranger
                os.pwrite(fd, hits_b, kvc.HIT_COUNT_OFFSET)
                os.pwrite(fd, last_b, kvc.LAST_USED_OFFSET)
        except OSError as exc:
            log.warning("%s: cannot record hit on %s: %s", self._name, name, exc)
        finally:
            os.close(fd)

    def probe(self, key: bytes) -> StoredRow | None:
        name = _name_for(key)
        try:
            return self._row_from_file(name, key)
        except FileNotFoundError:
            return None
        except (OSError, CacheFormatError) as exc:
            log.info("%s: probe of %s found an unusable file: %s", self._name, name, exc)
            return None

    def _row_from_file(self, name: str, key: bytes) -> StoredRow:
        meta = read_meta(self._dir, name)
        if meta.key != key:
            raise CacheFormatError(f"{name} holds another key")
        info = row_info(key, self._name, meta.fields, meta.payload_length)
        return StoredRow(info, meta.fields.tokens, str(self._root / name))

    def stored_keys(self) -> Iterator[bytes]:
        try:
            names = [e.name for e in os.scandir(self._dir)]
        except OSError as exc:
            log.warning("%s: cannot list %s: %s", self._name, self._root, exc)
            return
        for name in names:
            key = _key_of(name)
            if key is not None:
                yield key

    def scan(self) -> Iterator[StoredRow]:
        """Startup: reap temp files, yield valid rows (payload CRC deferred to ``load``),
        quarantine (or delete) invalid ones -- or, with ``repair=False``, only report both in
        ``problems()``. One bad file never stops the scan."""
        self._problems = []
        try:
            names = sorted(e.name for e in os.scandir(self._dir))
        except OSError as exc:
            log.error("%s: cannot list %s: %s", self._name, self._root, exc)
            return
        for name in names:
            try:
                if name.endswith(_TMP_SUFFIX):
                    self._reap_tmp(name)
                    continue
                if not name.endswith(_SUFFIX):
                    continue  # the quarantine dir, or files that are not ours
                key = _key_of(name)
                if key is None:
                    raise CacheFormatError("not a <hex key>.kvc name")
                yield self._row_from_file(name, key)
            except FileNotFoundError:
                continue  # removed by someone else meanwhile
            except (OSError, CacheFormatError) as exc:
                self._discard(name, exc)

    def _reap_tmp(self, name: str) -> None:
        with self._lock:
            if name in self._inflight:
                return
        parts = name.split(".")
        pid = int(parts[2]) if len(parts) == 6 and parts[2].isdigit() else None
        # Another live process may be mid-save in a shared root: only reap its file if stale.
        if (
            pid is not None
            and pid != os.getpid()
            and _pid_alive(pid)
            and time.time() - os.stat(name, dir_fd=self._dir, follow_symlinks=False).st_mtime
            < self._stale_tmp_s
        ):
            return
        if not self._repair:
            self._problems.append((str(self._root / name), "interrupted temp file"))
            return
        log.info("%s: removing interrupted temp file %s", self._name, name)
        unlink_quiet(self._dir, name)

    def _discard(self, name: str, why: Exception) -> None:
        if not self._repair:
            self._problems.append((str(self._root / name), str(why)))
            return
        log.warning("%s: invalid cache file %s: %s", self._name, name, why)
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=self._dir, follow_symlinks=False).st_mode):
                return  # e.g. a directory named like a row: not ours to remove
            if self._quarantine:
                qdir = open_private_subdir(self._dir, _QUARANTINE)
                try:
                    os.replace(name, name, src_dir_fd=self._dir, dst_dir_fd=qdir)
                finally:
                    os.close(qdir)
            else:
                os.unlink(name, dir_fd=self._dir)
        except OSError as exc:
            log.error("%s: cannot remove invalid file %s: %s", self._name, name, exc)

    def close(self) -> None:
        """Release the directory descriptor. Idempotent."""
        with self._lock:
            fd, self._dir = self._dir, -1
        if fd >= 0:
            os.close(fd)


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


def _name_for(key: bytes) -> str:
    return key.hex() + _SUFFIX


def _key_of(name: str) -> bytes | None:
    """The key a row file name stands for; None if ``name`` is not a row file name."""
    stem = name[: -len(_SUFFIX)]
    if not name.endswith(_SUFFIX) or len(stem) != 64 or not _HEX.issuperset(stem):
        return None
    return bytes.fromhex(stem)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
