"""File tiers (``ram_file`` on /dev/shm, ``disk``, any ``file://`` URL): one
``<root>/<hex key>.kvc`` per row and ``<root>/<hex key>.kvk`` per chunk, a ``FileStore`` under
the generic ``ObjectTier`` (``objects.py``), which owns the publish protocol, probes, scans,
hit updates and chunk rules.

``FileStore`` is the directory: names to files, reads, listings, deletes, the header's hit
fields, and the store capabilities only files have -- staged puts (``publish.py``: temp file,
fdatasync, link(2), directory fsync), local reads into the caller's buffer, quarantine and
temp-file reaping (``filescan.py``), the registry of co-tenant processes (``cotenants.py``).
``FileTier`` builds one and surfaces what the cache asks a file tier (``Cotenanted``,
``SetsAside``, ``quota.FilesystemSpace``).

Invariants:
- A visible ``.kvc`` or ``.kvk`` file is complete (``publish.py``), and its path is a pure
  function of its key (``layout.py``), so another process sharing the directory finds a row
  it did not write. The bytes are a ``.kvc`` file's (``cache/formats/kvc.py``); a chunk object
  ``chunks/<hex>.kvk`` is the file ``<hex>.kvk`` beside the rows.
- Every name is resolved against the root's directory fd, without following links, and the
  root is private (``fsutil``): a row swapped for a symlink is reported bad, never written
  through. Loads read into a buffer (no mmap). A link, or a name that is not a regular file,
  is ``CacheFormatError`` (unusable: a scan sets it aside); a file that cannot be opened or
  read (EMFILE, ENOMEM, EIO, EACCES) is ``CacheIOError`` to a probe, a scan and a load alike:
  it proves nothing about its bytes, so it is left where it is.
- Hit counts and last-used times are the header's hit fields, rewritten in place without a
  sync (``set_meta``): outside every CRC, an eviction hint.
- With ``repair=False`` nothing in the directory is moved or deleted by a scan, and the tier
  does not register as a co-tenant; nor is the directory created or its mode (or its
  parent's) tightened: a missing root is ``CacheDirMissingError``.
- Every process that opens a local directory for writing registers in it (``cotenants.py``):
  once another one has, ``cotenanted()`` says our chunk refcounts no longer cover every row.
- A directory shared by several hosts (``shared_dir``: NFS, CephFS) is not local (hits are
  promoted to a local tier), nothing there is set aside (a file this kvwarm cannot read may be
  one a newer kvwarm on another host reads), and another writer's temp file is reaped only
  once it is stale: its pid names a process on some other host.

See docs/architecture.md (the cache) for how the tiers and the index fit together.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvwarm.cache.formats import kvc
from kvwarm.cache.protocols import TierCapabilities
from kvwarm.cache.tiers import filescan
from kvwarm.cache.tiers.cotenants import PROCS, Cotenants
from kvwarm.cache.tiers.fsutil import (
    list_dir,
    open_private_dir,
    open_regular,
    read_exact,
    read_file,
    read_head,
    read_prefix,
)
from kvwarm.cache.tiers.layout import CHUNK_SUFFIX, name_for
from kvwarm.cache.tiers.objects import CHUNK_DIR, META_HITS, META_LAST_USED, Got, ObjectTier
from kvwarm.cache.tiers.publish import PUBLISH_STEPS, FilePut, Publisher, StepHook
from kvwarm.cache.tiers.registry import registered_tiers, tier_spec
from kvwarm.cache.types import TierName
from kvwarm.errors import (
    CacheDirMissingError,
    CacheFormatError,
    CacheIOError,
    CacheKeyError,
    ConfigError,
)

__all__ = [
    "FILE_CAPABILITIES",
    "PUBLISH_STEPS",
    "SHARED_DIR_CAPABILITIES",
    "FileStore",
    "FileTier",
    "StepHook",
]

log = logging.getLogger(__name__)

# Files outlive the process and other processes may share the directory.
FILE_CAPABILITIES = TierCapabilities(persistent=True, shared=True, local=True)
# The same directory mounted on several hosts: its bytes cross a network.
SHARED_DIR_CAPABILITIES = TierCapabilities(persistent=True, shared=True, local=False)


class FileStore:
    """An ``ObjectStore`` over one private directory, with ``StagesPuts``, ``LocalReads``,
    ``Quarantines`` and ``ReapsTemps``. Thread-safe; several processes may share one root."""

    def __init__(
        self,
        tier: str,
        root: Path,
        *,
        quarantine: bool = True,
        stale_tmp_s: float = 3600.0,
        multi_host: bool = False,
        register: bool = True,
        maintenance: bool = False,
        create: bool = True,
        on_step: StepHook | None = None,
    ) -> None:
        self._tier = tier
        self._root = root
        self._quarantine = quarantine
        self._stale_tmp_s = stale_tmp_s
        self._multi_host = multi_host
        self._publisher = Publisher(tier, on_step)
        self._lock = threading.Lock()  # guards closing the directory fd
        try:
            self._dir = open_private_dir(root, create=create)
        except FileNotFoundError:
            if create:
                raise ConfigError(f"cannot create cache root {root}") from None
            raise CacheDirMissingError(
                f"{tier}: cache directory {root} does not exist (not created: opened read-only)",
                tier=tier,
                path=str(root),
            ) from None
        except NotADirectoryError:
            raise ConfigError(f"cache root {root} is not a directory") from None
        except OSError as exc:
            raise ConfigError(f"cannot create cache root {root}: {exc}") from exc
        # Registered before the startup scan, so a process already running sees us before we
        # adopt its rows. A read-only open deletes nothing and stays unseen.
        self._cotenants: Cotenants | None = None
        if register:
            try:
                self._cotenants = Cotenants(self._dir, f"{tier} {root}", maintenance=maintenance)
            except OSError as exc:
                os.close(self._dir)
                raise ConfigError(f"cannot register in {root}/{PROCS}: {exc}") from exc

    @property
    def label(self) -> str:
        return str(self._root)

    @property
    def root(self) -> Path:
        return self._root

    def location(self, name: str) -> str:
        return str(self._root / _file(name))

    # ---- puts (``publish.py``) -------------------------------------------------------------

    def stage(self, name: str, parts: Sequence[kvc.Buffer], token: int) -> FilePut:
        # The put owns a descriptor of its own: a save still running when the tier closes
        # (``Cache.close`` gives up waiting) must not link, unlink and fsync through a number
        # closed under it and reused by the next open (found by review).
        with self._lock:
            if self._dir < 0:
                raise CacheIOError(f"{self._tier}: {self._root} is closed", errno=errno.EBADF)
            dir_fd = os.dup(self._dir)
        return self._publisher.stage(dir_fd, _file(name), parts, token)

    def put_if_absent(self, name: str, body: bytes) -> bool:
        put = self.stage(name, (body,), 0)
        try:
            linked = put.link()
            if linked:
                put.settle(False)
            else:
                put.undo()
        except BaseException:
            put.undo()
            raise
        return linked

    # ---- reads -----------------------------------------------------------------------------

    def get(self, name: str, end: int | None = None) -> Got:
        with self._inspecting(name):
            data, size = read_head(self._dir, _file(name), end)
        return Got(data, size, {})

    def get_range(self, name: str, start: int, end: int) -> bytes:
        with self._inspecting(name):
            fd = open_regular(self._dir, _file(name), os.O_RDONLY)
            try:
                return os.pread(fd, end - start, start)
            finally:
                os.close(fd)

    def read_prefix(self, name: str) -> tuple[bytes, int]:
        with self._inspecting(name):
            return read_prefix(self._dir, _file(name))

    def read_into(self, name: str, buffer: bytearray | None) -> tuple[memoryview, bytearray]:
        try:  # the restore path: no context manager, no copy (``fsutil.read_file``)
            return read_file(self._dir, _file(name), buffer)
        except OSError as exc:
            raise self._load_error(name, exc) from exc

    def read_exact_into(self, name: str, into: memoryview) -> memoryview | None:
        try:
            return read_exact(self._dir, _file(name), into)
        except OSError as exc:
            raise self._load_error(name, exc) from exc

    @contextmanager
    def _inspecting(self, name: str) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError:
            raise CacheKeyError(f"{self._tier} holds no {name}") from None
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # a socket or a device where a file should be
                raise CacheFormatError(f"{name} is not a file: {exc}") from exc
            # EMFILE, ENOMEM, EIO, EACCES...: a failure of ours (or of the disk), not proof
            # that the bytes are bad: a scan leaves the file where it is.
            raise self._load_error(name, exc) from exc

    def _load_error(self, name: str, exc: OSError) -> CacheKeyError | CacheIOError:
        if isinstance(exc, FileNotFoundError):
            return CacheKeyError(f"{self._tier} holds no {name}")
        return CacheIOError(f"{self._tier}: reading {name} failed: {exc}", errno=exc.errno)

    # ---- listings, deletes, hit fields -------------------------------------------------------

    def names(self, prefix: str) -> list[str]:
        """Sorted; every entry but directories (``procs/``, ``quarantine/``: not objects), a
        chunk file ``<hex>.kvk`` as ``chunks/<hex>.kvk``."""
        try:
            files = [name for name, is_dir in list_dir(self._dir) if not is_dir]
        except OSError as exc:
            raise CacheIOError(f"{self._tier}: cannot list {self._root}: {exc}") from exc
        named = (CHUNK_DIR + f if f.endswith(CHUNK_SUFFIX) else f for f in files)
        return sorted(n for n in named if n.startswith(prefix))

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        out = []
        for name in self.names(prefix):
            try:
                st = os.stat(_file(name), dir_fd=self._dir, follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted since the listing
            except OSError as exc:
                raise CacheIOError(f"{self._tier}: cannot stat {name}: {exc}") from exc
            out.append((name, st.st_size, st.st_mtime))
        return out

    def delete(self, name: str) -> None:
        try:
            os.unlink(_file(name), dir_fd=self._dir)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CacheIOError(f"{self._tier}: deleting {name} failed", errno=exc.errno) from exc

    def sync_deletes(self) -> None:
        """The directory's fsync: the unlinks so far (and links) are durable."""
        try:
            os.fsync(self._dir)
        except OSError as exc:
            raise CacheIOError(
                f"{self._tier}: syncing {self._root} failed: {exc}", errno=exc.errno
            ) from exc

    def touch(self, name: str) -> bool:
        """Its mtime set to now; a file another user owns and we may not write (a directory
        replicas of several uids share) is only checked to be there."""
        try:
            os.utime(_file(name), dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except PermissionError:
            return self.age(name) is not None
        except OSError as exc:
            raise CacheIOError(f"{self._tier}: cannot touch {name}: {exc}") from exc
        return True

    def age(self, name: str) -> float | None:
        try:
            return os.stat(_file(name), dir_fd=self._dir, follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CacheIOError(f"{self._tier}: cannot stat {name}: {exc}") from exc

    def set_meta(self, name: str, meta: Mapping[str, str]) -> None:
        """The row's header hit fields, rewritten in place (no sync); a file too short to
        hold them is left alone (never extend a stranger)."""
        hits_b, last_b = kvc.pack_hit_fields(int(meta[META_HITS]), float(meta[META_LAST_USED]))
        try:
            fd = open_regular(self._dir, _file(name), os.O_WRONLY)
        except FileNotFoundError:
            raise CacheKeyError(f"{self._tier} holds no {name}") from None
        except (OSError, CacheFormatError) as exc:
            raise CacheIOError(f"{self._tier}: cannot open {name}: {exc}") from exc
        try:
            if os.fstat(fd).st_size >= kvc.PREFIX_FIXED_SIZE:
                os.pwrite(fd, hits_b, kvc.HIT_COUNT_OFFSET)
                os.pwrite(fd, last_b, kvc.LAST_USED_OFFSET)
        except OSError as exc:
            raise CacheIOError(f"{self._tier}: cannot write {name}: {exc}") from exc
        finally:
            os.close(fd)

    # ---- what only a directory has ----------------------------------------------------------

    def set_aside(self, name: str) -> bool:
        if self._multi_host:
            return False
        return filescan.set_aside(
            self._dir, _file(name), quarantine=self._quarantine, tier=self._tier
        )

    def quarantined(self) -> tuple[int, int]:
        return filescan.quarantined(self._dir, str(self._root))

    def reap_temps(self, names: Sequence[str], remove: bool) -> builtins.list[tuple[str, str]]:
        misplaced = filescan.misplaced_dirs(self._dir, self._root, self._tier)
        return misplaced + filescan.reap_temps(
            self._dir,
            names,
            self._root,
            self._tier,
            remove=remove,
            writing=self._publisher.writing,  # our temp files being written: kept
            stale_tmp_s=self._stale_tmp_s,
            multi_host=self._multi_host,
        )

    def cotenanted(self) -> bool:
        with self._lock:
            cotenants, dir_fd = self._cotenants, self._dir
        return cotenants is None or dir_fd < 0 or cotenants.seen(dir_fd)

    def filesystem_free_bytes(self) -> int:
        st = os.statvfs(self._root)
        return st.f_bavail * st.f_frsize

    def close(self) -> None:
        """Release the directory descriptor. Idempotent."""
        with self._lock:
            fd, self._dir = self._dir, -1
            cotenants, self._cotenants = self._cotenants, None
        if cotenants is not None:
            cotenants.close()
        if fd >= 0:
            os.close(fd)


class FileTier(ObjectTier):
    """The generic tier over a ``FileStore`` on ``root``, plus what the cache asks only of a
    file tier. Thread-safe; several processes may share one root."""

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
        maintenance: bool = False,
    ) -> None:
        if name in registered_tiers() and not tier_spec(name).needs_root:
            raise ConfigError(f"tier {name!r} is not a file tier (it takes no root directory)")
        if quota_bytes < 0:
            raise ConfigError("file tier quota must be >= 0")
        self._files = FileStore(
            name,
            Path(root),
            quarantine=quarantine,
            stale_tmp_s=stale_tmp_s,
            multi_host=shared_dir,
            register=repair and not shared_dir,
            maintenance=maintenance,
            create=repair,
            on_step=on_step,
        )
        capabilities = SHARED_DIR_CAPABILITIES if shared_dir else FILE_CAPABILITIES
        super().__init__(
            self._files,
            quota_bytes,
            name=name,
            repair=repair,
            capabilities=capabilities,
            on_step=on_step,
        )

    @property
    def root(self) -> Path:
        return self._files.root

    def path_for(self, key: bytes) -> Path:
        return self._files.root / name_for(key)

    def filesystem_free_bytes(self) -> int:
        """Bytes an unprivileged writer may still put on the root's filesystem
        (``quota.FilesystemSpace``: the quota is capped by what the tier holds plus this)."""
        return self._files.filesystem_free_bytes()

    def sync_deletes(self) -> None:
        """``protocols.SyncsDeletes``: the directory's fsync, so the manifests a retire
        unlinked stay gone through a power loss before it unlinks their chunks."""
        self._files.sync_deletes()

    def cotenanted(self) -> bool:
        """Whether another process has used this directory since we opened it (or we cannot
        tell): our chunk refcounts then do not cover every row, so chunks are swept, never
        deleted with their last row of ours (``cotenants.py``)."""
        return self._files.cotenanted()

    # ---- what the scans set aside (``protocols.SetsAside``) --------------------------------

    def chunk_size(self, key: bytes) -> int | None:
        """The size of chunk ``key`` if its file is there with a valid head, else None."""
        head = self._chunk_head(key)
        return None if head is None else head.payload_offset + head.payload_length

    def set_aside_row(self, key: bytes, why: str) -> bool:
        """Quarantine row ``key``'s file as the startup scan does an invalid one (a manifest
        whose chunks are gone). False if it is only reported (read-only, multi-host)."""
        return self._set_aside_row(key, why)

    def set_aside_chunk(self, key: bytes, why: str) -> bool:
        """Quarantine chunk ``key``'s file, whose bytes a read found bad (its head may be
        valid: a save would adopt it). False if it is only reported (read-only, multi-host)."""
        return self._set_aside_chunk(key, why)

    def quarantined(self) -> tuple[int, int]:
        """(row files, chunk files) in ``quarantine/``: what scans have set aside so far."""
        return self._files.quarantined()


def _file(name: str) -> str:
    """The file in the root that holds object ``name``: chunks sit beside the rows."""
    return name[len(CHUNK_DIR) :] if name.startswith(CHUNK_DIR) else name
