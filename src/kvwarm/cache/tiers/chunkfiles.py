"""Chunk objects in a file tier's directory: ``<hex chunk key>.kvk`` beside the ``.kvc`` rows.

Invariants:

- A ``.kvk`` name appears only through ``link(2)`` of a temp file whose bytes were already
  fdatasync'ed, and the directory is fsync'ed before ``store`` returns, so a chunk a manifest
  names was durable before the manifest's own publish began (``publish.py``): a crash leaves
  at worst chunks no manifest names (orphans), which the startup scan adopts with no
  references, evictable first.
- Chunks are content-addressed and immutable: ``EEXIST`` on link keeps the existing chunk if
  its head is valid for the key (identical bytes by construction), else replaces it (the
  rule every tier follows, ``common.commit_chunk``).
- Temp names follow ``layout.tmp_name`` (token 0), so the directory scan reaps interrupted
  ones exactly like a row's.
- ``load`` verifies the head, the key replay and the payload CRC32C (``chunkfmt.parse``); the
  startup scan checks each file's head (its CRC32C, the key) and its length (head plus
  payload must end exactly at the file's size), not the payload's CRC, and a repairing scan
  moves a chunk that fails to ``quarantine/`` (``filescan.set_aside``).

Steps (``CHUNK_STEPS``) are reported to the tier's step hook, for the kill -9 tests.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from kvwarm.cache import chunkfmt
from kvwarm.cache.tiers.common import commit_chunk
from kvwarm.cache.tiers.filescan import set_aside
from kvwarm.cache.tiers.fsutil import open_regular, read_file, unlink_quiet
from kvwarm.cache.tiers.layout import CHUNK_SUFFIX, chunk_key_of, chunk_name, tmp_name
from kvwarm.cache.types import TierName
from kvwarm.errors import CacheFormatError, CacheIOError, CacheKeyError

__all__ = ["CHUNK_STEPS", "CHUNK_SUFFIX", "ChunkFiles", "chunk_key_of", "chunk_name"]

log = logging.getLogger(__name__)

CHUNK_STEPS: tuple[str, ...] = ("chunk_tmp_synced", "chunk_linked", "chunk_dir_synced")
_HEAD_READ = 1 << 16  # a chunk head is ~140 B + 4 B a token: 16k tokens fit


class ChunkFiles:
    """The chunk half of one ``FileTier``; thread-safe."""

    def __init__(
        self,
        tier: TierName,
        root: Path,
        *,
        repair: bool,
        quarantine: bool = True,
        on_step: Callable[[str], None] | None,
        writing: Callable[[str], None],
        done: Callable[[str], None],
    ) -> None:
        self._tier = tier
        self._root = root
        self._repair = repair
        self._quarantine = quarantine
        self._on_step = on_step
        self._writing = writing  # tell the scan a temp file is ours and live
        self._done = done
        self._lock = threading.Lock()
        self.problems: list[tuple[str, str]] = []

    def _step(self, name: str) -> None:
        if self._on_step is not None:
            self._on_step(name)

    def store(self, dir_fd: int, key: bytes, head: bytes, payload: bytes) -> int:
        final = chunk_name(key)
        tmp = tmp_name(final, 0)
        size = len(head) + len(payload)
        self._writing(tmp)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            try:
                _write_all(fd, head, payload)
                os.fdatasync(fd)  # never link bytes that are not on disk yet
            finally:
                os.close(fd)
            self._step("chunk_tmp_synced")
            commit_chunk(
                self._tier,
                key,
                lambda: _link(dir_fd, tmp, final),
                lambda: self._head(dir_fd, final) is not None,
                lambda: unlink_quiet(dir_fd, final),
            )
            self._step("chunk_linked")
            unlink_quiet(dir_fd, tmp)
            os.fsync(dir_fd)
            self._step("chunk_dir_synced")
        except OSError as exc:
            unlink_quiet(dir_fd, tmp)
            raise CacheIOError(
                f"{self._tier}: saving chunk {key.hex()} failed: {exc}", errno=exc.errno
            ) from exc
        except BaseException:
            unlink_quiet(dir_fd, tmp)
            raise
        finally:
            self._done(tmp)
        return size

    def _head(self, dir_fd: int, name: str) -> chunkfmt.ChunkHead | None:
        """The valid head of chunk file ``name`` (payload not read), else None."""
        key = chunk_key_of(name)
        try:
            with open(open_regular(dir_fd, name, os.O_RDONLY), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                head = chunkfmt.parse_head(f.read(_HEAD_READ), size=size)
        except (OSError, CacheFormatError) as exc:
            log.info("%s: chunk %s is unusable: %s", self._tier, name, exc)
            return None
        return head if head.key == key else None

    def load(self, dir_fd: int, key: bytes, into: memoryview | None = None) -> memoryview:
        """The verified payload; read into ``into`` when the file is exactly that long."""
        name = chunk_name(key)
        try:
            buf = _read_exact(dir_fd, name, into) if into is not None else None
            if buf is None:
                buf, _ = read_file(dir_fd, name, None)
        except FileNotFoundError:
            raise CacheKeyError(f"{self._tier} holds no chunk {key.hex()}") from None
        except OSError as exc:
            raise CacheIOError(f"{self._tier}: reading {name} failed", errno=exc.errno) from exc
        return chunkfmt.parse(buf, key)

    def delete(self, dir_fd: int, key: bytes) -> None:
        try:
            os.unlink(chunk_name(key), dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CacheIOError(f"{self._tier}: deleting chunk failed", errno=exc.errno) from exc

    def ages(self, dir_fd: int) -> Iterator[tuple[bytes, int, float]]:
        """(key, size, mtime) of every chunk file, stat'ed only (the shared-tier sweep)."""
        try:
            entries = [e for e in os.scandir(dir_fd) if e.name.endswith(CHUNK_SUFFIX)]
        except OSError as exc:
            raise CacheIOError(f"{self._tier}: cannot list {self._root}: {exc}") from exc
        for entry in entries:
            key = chunk_key_of(entry.name)
            if key is None:
                continue
            try:
                st = os.stat(entry.name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted since the listing
            except OSError as exc:
                raise CacheIOError(f"{self._tier}: cannot stat {entry.name}: {exc}") from exc
            yield key, st.st_size, st.st_mtime

    def scan(self, dir_fd: int) -> Iterator[tuple[bytes, int]]:
        self.problems = []
        try:
            names = sorted(e.name for e in os.scandir(dir_fd) if e.name.endswith(CHUNK_SUFFIX))
        except OSError as exc:
            log.error("%s: cannot list %s: %s", self._tier, self._root, exc)
            return
        for name in names:
            key = chunk_key_of(name)
            head = None if key is None else self._head(dir_fd, name)
            if key is not None and head is not None:
                yield key, head.payload_offset + head.payload_length
            elif not self._repair:
                self.problems.append((str(self._root / name), "invalid chunk"))
            else:
                log.warning("%s: setting aside invalid chunk %s", self._tier, name)
                set_aside(dir_fd, name, quarantine=self._quarantine, tier=self._tier)

    def size(self, dir_fd: int, key: bytes) -> int | None:
        """The size of chunk ``key``'s file if its head is valid (payload not read)."""
        head = self._head(dir_fd, chunk_name(key))
        return None if head is None else head.payload_offset + head.payload_length


def _link(dir_fd: int, tmp: str, final: str) -> bool:
    """link(2) ``tmp`` to ``final``, no link followed; False if ``final`` exists."""
    try:
        os.link(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        return False
    return True


def _read_exact(dir_fd: int, name: str, into: memoryview) -> memoryview | None:
    """The whole file read into ``into`` if it is exactly ``len(into)`` bytes, else None."""
    with open(open_regular(dir_fd, name, os.O_RDONLY), "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size != into.nbytes:
            return None
        got = 0
        while got < into.nbytes:
            n = f.readinto(into[got:])
            if not n:
                raise CacheFormatError(f"{name} shrank while being read")
            got += n
    return into


def _write_all(fd: int, head: bytes, payload: bytes) -> None:
    views = [memoryview(head), memoryview(payload).cast("B")]
    views = [v for v in views if v.nbytes]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(5, "write made no progress")
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
