"""File tiers (``ram_file`` on /dev/shm, ``disk``): one ``<root>/<hex key>.kvc`` per row.

``FileTier`` is the ``Tier`` a registry builds; its parts are the publish protocol
(``publish.py``: how a row file comes to exist, crash-safely), the startup scan
(``filescan.py``: adopt, reap, quarantine), the naming (``layout.py``) and, here, the reads,
deletes and hit updates.

Invariants:
- A visible ``.kvc`` file is complete (``publish.py``), and its path is a pure function of its
  key (``layout.py``), so another process sharing the directory finds a row it did not write.
- Every name is resolved against the root's directory fd, without following links, and the
  root is private (``fsutil``): a row swapped for a symlink is reported bad, never written
  through. Loads read into a buffer (no mmap) and verify everything.
- With ``repair=False`` nothing in the directory is moved or deleted by a scan (``filescan``).
- Every process that opens a local directory for writing registers in it (``cotenants.py``):
  once another one has, ``cotenanted()`` says our chunk refcounts no longer cover every row.
- A directory shared by several hosts (``shared_dir``: NFS, CephFS) is not local (hits are
  promoted to a local tier) and another writer's temp file is reaped only once it is stale:
  its pid names a process on some other host.

See docs/architecture.md (the cache) for how the tiers and the index fit together.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from kvwarm.cache import kvc
from kvwarm.cache.protocols import ReservationBook, RowBytes, StoredRow, TierCapabilities
from kvwarm.cache.tiers.chunkfiles import CHUNK_SUFFIX, ChunkFiles
from kvwarm.cache.tiers.cotenants import PROCS, Cotenants
from kvwarm.cache.tiers.filescan import DirScan
from kvwarm.cache.tiers.fsutil import open_private_dir, open_regular, read_file
from kvwarm.cache.tiers.layout import QUARANTINE, ROW_SUFFIX, key_of, name_for, row_from_file
from kvwarm.cache.tiers.publish import PUBLISH_STEPS, Publisher, StepHook
from kvwarm.cache.tiers.registry import registered_tiers, tier_spec
from kvwarm.cache.types import SaveRequest, TierName
from kvwarm.errors import CacheFormatError, CacheIOError, CacheKeyError, ConfigError

__all__ = [
    "FILE_CAPABILITIES",
    "PUBLISH_STEPS",
    "SHARED_DIR_CAPABILITIES",
    "FileTier",
    "StepHook",
]

log = logging.getLogger(__name__)

# Files outlive the process and other processes may share the directory.
FILE_CAPABILITIES = TierCapabilities(persistent=True, shared=True, local=True)
# The same directory mounted on several hosts: its bytes cross a network.
SHARED_DIR_CAPABILITIES = TierCapabilities(persistent=True, shared=True, local=False)


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
        shared_dir: bool = False,
    ) -> None:
        if name in registered_tiers() and not tier_spec(name).needs_root:
            raise ConfigError(f"tier {name!r} is not a file tier (it takes no root directory)")
        if quota_bytes < 0:
            raise ConfigError("file tier quota must be >= 0")
        self._name: TierName = name
        self._capabilities = SHARED_DIR_CAPABILITIES if shared_dir else FILE_CAPABILITIES
        self._root = Path(root)
        self._quota = quota_bytes
        self._lock = threading.Lock()  # guards closing the directory fd
        self._publisher = Publisher(name, self._root, on_step)
        self._chunks = ChunkFiles(
            name,
            self._root,
            repair=repair,
            quarantine=quarantine,
            on_step=on_step,
            writing=self._publisher.begin_writing,
            done=self._publisher.end_writing,
        )
        self._scanner = DirScan(
            name,
            self._root,
            repair=repair,
            quarantine=quarantine,
            stale_tmp_s=stale_tmp_s,
            multi_host=shared_dir,
            writing=self._publisher.writing,  # our temp files being written: the scan keeps them
        )
        try:
            self._dir = open_private_dir(self._root)
        except NotADirectoryError:
            raise ConfigError(f"cache root {self._root} is not a directory") from None
        except OSError as exc:
            raise ConfigError(f"cannot create cache root {self._root}: {exc}") from exc
        # Registered before the startup scan, so a process already running sees us before we
        # adopt its rows. A read-only open (repair=False) deletes nothing and stays unseen.
        self._cotenants: Cotenants | None = None
        if repair and not shared_dir:
            try:
                self._cotenants = Cotenants(self._dir, f"{name} {self._root}")
            except OSError as exc:
                os.close(self._dir)
                raise ConfigError(f"cannot register in {self._root}/{PROCS}: {exc}") from exc

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

    def filesystem_free_bytes(self) -> int:
        """Bytes an unprivileged writer may still put on the root's filesystem
        (``quota.FilesystemSpace``: the quota is capped by what the tier holds plus this)."""
        st = os.statvfs(self._root)
        return st.f_bavail * st.f_frsize

    def cotenanted(self) -> bool:
        """Whether another process has used this directory since we opened it (or we cannot
        tell): our chunk refcounts then do not cover every row, so chunks are swept, never
        deleted with their last row of ours (``cotenants.py``)."""
        with self._lock:
            cotenants, dir_fd = self._cotenants, self._dir
        return cotenants is None or dir_fd < 0 or cotenants.seen(dir_fd)

    def path_for(self, key: bytes) -> Path:
        return self._root / name_for(key)

    def problems(self) -> tuple[tuple[str, str], ...]:
        """(path, reason) of every bad file the last scan left in place (``repair=False``)."""
        return tuple(self._scanner.problems) + tuple(self._chunks.problems)

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        return self._publisher.store(self._dir, key, request, book)

    # ---- read side -----------------------------------------------------------------------

    def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
        name = name_for(row.info.key)  # a row's file name is a function of its key alone
        try:
            buf, backing = read_file(self._dir, name, buffer)
        except FileNotFoundError:
            raise CacheKeyError(f"{self._name} holds no row {row.info.key.hex()}") from None
        except OSError as exc:
            raise CacheIOError(
                f"{self._name}: reading {name} failed: {exc}", errno=exc.errno
            ) from exc
        f = kvc.parse(buf, expected_key=row.info.key, known_tokens=row.tokens)
        fields = f.meta.fields
        return RowBytes(fields.tokens, f.payload, fields.logits, backing, fields)

    def delete(self, key: bytes) -> None:
        name = name_for(key)
        try:
            os.unlink(name, dir_fd=self._dir)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CacheIOError(f"{self._name}: deleting {name} failed", errno=exc.errno) from exc

    def record_hit(self, row: StoredRow, hits: int, last_used: float) -> None:
        """Best effort, no fsync: these header fields are an eviction hint outside every CRC."""
        hits_b, last_b = kvc.pack_hit_fields(hits, last_used)
        name = name_for(row.info.key)
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
        name = name_for(key)
        try:
            return row_from_file(self._dir, self._root, self._name, name, key)
        except FileNotFoundError:
            return None
        except (OSError, CacheFormatError) as exc:
            log.info("%s: probe of %s found an unusable file: %s", self._name, name, exc)
            return None

    def stored_keys(self) -> Iterator[bytes]:
        try:
            names = [e.name for e in os.scandir(self._dir)]
        except OSError as exc:
            log.warning("%s: cannot list %s: %s", self._name, self._root, exc)
            return
        for name in names:
            key = key_of(name)
            if key is not None:
                yield key

    def scan(self) -> Iterator[StoredRow]:
        """Startup: reap temp files, yield valid rows (payload CRC deferred to ``load``),
        quarantine (or delete) invalid ones -- or, with ``repair=False``, only report both in
        ``problems()``. One bad file never stops the scan."""
        return self._scanner.scan(self._dir)

    # ---- chunks (``chunkfiles.py``) --------------------------------------------------------

    def store_chunk(self, key: bytes, head: bytes, payload: bytes) -> int:
        return self._chunks.store(self._dir, key, head, payload)

    def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
        return self._chunks.load(self._dir, key, buffer)

    def delete_chunk(self, key: bytes) -> None:
        self._chunks.delete(self._dir, key)

    def scan_chunks(self) -> Iterator[tuple[bytes, int]]:
        return self._chunks.scan(self._dir)

    # ---- what the scans set aside (``protocols.SetsAside``) --------------------------------

    def chunk_size(self, key: bytes) -> int | None:
        """The size of chunk ``key`` if its file is there with a valid head, else None."""
        return self._chunks.size(self._dir, key)

    def set_aside_row(self, key: bytes, why: str) -> bool:
        """Quarantine row ``key``'s file as the startup scan does an invalid one (a manifest
        whose chunks are gone). False if it is only reported (read-only, multi-host)."""
        return self._scanner.drop(self._dir, name_for(key), CacheFormatError(why))

    def quarantined(self) -> tuple[int, int]:
        """(row files, chunk files) in ``quarantine/``: what scans have set aside so far."""
        try:
            qdir = os.open(
                QUARANTINE, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self._dir
            )
        except FileNotFoundError:
            return 0, 0
        except OSError as exc:
            log.warning("%s: cannot list %s/%s: %s", self._name, self._root, QUARANTINE, exc)
            return 0, 0
        try:
            names = os.listdir(qdir)
        finally:
            os.close(qdir)
        rows = sum(1 for n in names if n.endswith(ROW_SUFFIX))
        return rows, sum(1 for n in names if n.endswith(CHUNK_SUFFIX))

    def chunk_ages(self) -> Iterator[tuple[bytes, int, float]]:
        return self._chunks.ages(self._dir)

    def close(self) -> None:
        """Release the directory descriptor. Idempotent."""
        with self._lock:
            fd, self._dir = self._dir, -1
            cotenants, self._cotenants = self._cotenants, None
        if cotenants is not None:
            cotenants.close()
        if fd >= 0:
            os.close(fd)
