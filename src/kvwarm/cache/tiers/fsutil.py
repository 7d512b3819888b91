"""File-system primitives for the file store: private directories, no-follow opens, reads.

The cache directory is not trusted to be what we left there. Invariants:

- Every directory we create (the tier root, its missing parents, ``quarantine``) is made mode
  0700 explicitly, whatever the umask; the root and its missing parents are made durable
  (each one's parent fsync'ed) before the root is opened, so a power loss cannot take a
  directory whose saves were acknowledged.
- A tier root owned by another user is refused (``UnsafeCacheDirError``): its owner can always
  write it, so could swap a row for a link. A root that is ours but open to the group or the
  world is tightened to 0700 (and logged), since whoever made it so meant it to be ours.
- The root's parent (for the disk tier, the configured ``cache_dir`` itself) must not let
  others rename the root away and plant their own in its place: writable by the group or the
  world without the sticky bit, it loses those write bits if it is ours (logged) and is
  refused if it is not. A sticky parent (``/tmp``, ``/dev/shm``) is fine as it is. A parent
  owned by another user (not root) is refused whatever its mode: its owner can always swap
  the root, e.g. for a link to a directory of ours that the scans would then clean.
- A root that is itself a symlink is followed only if it is ours (or root's): one another
  user planted in a sticky directory (``/dev/shm/kvwarm`` made before we ran) is refused.
  Where it leads is checked as the way to a root is (below): every directory above the
  directory it names, and every link met on the way, must be one no other user can replace.
- Every other ancestor, from ``/`` down to the parent's parent, and every symlink met on the
  way there, must be one no other user can replace (``_guard_ancestors``, as ssh's
  StrictModes checks a key's path): owned by root or us, and writable by no one else unless
  sticky (others may add names there but not rename ours) or group-writable only for our
  own private group (a group named as we are, of no other member). Those are refused, never
  changed: they are not the cache's to tighten.
- All of these are checked before the root is opened, so a refused root is never changed.
- A read-only open (``create=False``: ``kvwarm cache stats``, ``ls``, ``verify``) creates and
  tightens nothing: a missing root is ``FileNotFoundError``, and a root or parent that is ours
  but too open is only logged (the refusals above still hold).
- A root with the sticky bit (``/dev/shm`` or ``/tmp`` given as the directory itself) is a
  directory many users share: refused, never tightened (as root it would lock them out).
- Every file below a root is opened relative to the root's directory fd with ``O_NOFOLLOW``
  and ``O_NONBLOCK``, and must be a regular file: a symlink is never followed and a FIFO
  planted in place of a row cannot hang a reader (both surface as ``CacheFormatError``).
- Reads use ``readinto`` into a buffer, never mmap: a mapping would turn an external truncation
  into SIGBUS.
- A directory is listed through a descriptor of its own (``list_dir``), never through the one
  the tier holds: ``os.scandir(fd)`` reads through a ``dup`` of it, which shares its offset
  with every other listing of that fd, so two threads listing at once each saw part of the
  directory, or none of it.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
import stat
from pathlib import Path, PurePosixPath

from kvwarm.buffers import grown
from kvwarm.cache.formats import kvc
from kvwarm.errors import CacheFormatError, UnsafeCacheDirError

__all__ = [
    "PRIVATE_DIR_MODE",
    "list_dir",
    "open_private_dir",
    "open_private_subdir",
    "open_regular",
    "read_exact",
    "read_file",
    "read_head",
    "read_prefix",
    "unlink_quiet",
]

log = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_private_dir(path: Path, *, create: bool = True) -> int:
    """Create ``path`` and its missing parents 0700, open it and make sure it is private.
    Returns a directory fd the caller owns. With ``create=False`` nothing is created or
    chmodded: a missing ``path`` raises ``FileNotFoundError``."""
    if not create and not os.path.lexists(path):
        raise FileNotFoundError(errno.ENOENT, "no such directory", str(path))
    missing: list[Path] = []
    p = path
    while create and not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # another process made it meanwhile; the root is checked below
        os.chmod(d, PRIVATE_DIR_MODE, follow_symlinks=False)  # the umask may have cut bits
        # Its name durable before any row in it is acknowledged: a power loss must not take
        # the directory and every save below it (the saves fsync only the root itself).
        _sync_dir(d.parent)
    # Before the root is opened (and perhaps tightened): a root someone else could have
    # swapped is refused untouched.
    _guard_ancestors(path)
    _guard_parent(path.parent, tighten=create)
    _guard_link(path)
    if os.path.islink(path):
        # Our own link, followed: the directories it leads through up to the one it names
        # are checked as ancestors (found by review: a link into a directory another user
        # owns was accepted, and they could swap its target for a directory of ours).
        _guard_ancestors(path, through_root=True)
    fd = os.open(path, _DIR_FLAGS)
    try:
        _make_private(fd, str(path), tighten=create)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sync_dir(path: Path) -> None:
    """fsync directory ``path``, so the names made in it are durable; a file system that
    cannot sync a directory (EINVAL) is left as it is."""
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _guard_link(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and not _trusted(st.st_uid):
        raise UnsafeCacheDirError(
            f"cache directory {path} is a symbolic link that belongs to uid {st.st_uid}, not "
            f"to us (uid {os.geteuid()}); not following it. Use a directory we own."
        )


#: Symlinks followed while walking a root's ancestors before giving up (Linux's own limit).
_MAX_LINKS = 40


def _guard_ancestors(root: Path, *, through_root: bool = False) -> None:
    """Refuse ``root`` when a directory above its parent, or a symlink on the way to the
    parent, could be replaced by another user (``UnsafeCacheDirError``). The path is walked
    from ``/`` a name at a time as the kernel resolves it, links followed (their target's
    directories are checked in turn), so what is checked is what the open will traverse. The
    parent itself is ``_guard_parent``'s (ours and too open: tightened; that rule stays).
    ``through_root``: walk the root's own name too (a link of ours), so that every directory
    above the one it finally names is checked, that one's parent included."""
    start = root if root.is_absolute() else Path.cwd() / root  # ".." kept: the kernel's
    walked = PurePosixPath(start) if through_root else PurePosixPath(start).parent
    pending = list(reversed(walked.parts[1:]))
    here = PurePosixPath("/")
    links = 0
    _check_ancestor(here, os.lstat(here), root)
    while pending:
        name = pending.pop()
        if name in ("", "."):
            continue
        if name == "..":
            here = here.parent
            continue
        step = here / name
        try:
            st = os.lstat(step)
        except FileNotFoundError:
            return  # open_private_dir made every missing one; a racing rename fails the open
        if stat.S_ISLNK(st.st_mode):
            if not _trusted(st.st_uid):
                raise UnsafeCacheDirError(
                    f"{step} on the way to the cache directory {root} is a symbolic link of uid "
                    f"{st.st_uid}, not ours (uid {os.geteuid()}) nor root's: its owner could "
                    "point it elsewhere. Use a path of directories we or root own."
                )
            links += 1
            if links > _MAX_LINKS:
                raise UnsafeCacheDirError(f"too many symbolic links on the way to {root}")
            target = PurePosixPath(os.readlink(step))
            if target.is_absolute():
                here = PurePosixPath("/")
                pending.extend(reversed(target.parts[1:]))
            else:
                pending.extend(reversed(target.parts))
            continue
        if pending:  # the parent itself is _guard_parent's
            _check_ancestor(step, st, root)
        here = step


def _check_ancestor(path: PurePosixPath, st: os.stat_result, root: Path) -> None:
    mode = stat.S_IMODE(st.st_mode)
    why = None
    if not _trusted(st.st_uid):
        why = f"belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}) nor to root"
    elif mode & 0o022 and not mode & stat.S_ISVTX:
        if mode & 0o002:
            why = f"is writable by every user (mode {mode:o})"
        elif not _own_private_group(st.st_gid):
            why = f"is writable by group {st.st_gid} (mode {mode:o})"
    if why is not None:
        raise UnsafeCacheDirError(
            f"{path}, above the cache directory {root}, {why}: another user could replace "
            "the directories below it. Use a path only we and root can change (or remove "
            "those write bits)."
        )


def _own_private_group(gid: int) -> bool:
    """``gid`` is our own private group (named as we are, no other member), so its write
    bit lets no one else in: the "user private group" layout where a home is 0775."""
    if gid != os.getegid():
        return False
    try:
        me = pwd.getpwuid(os.geteuid()).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return group.gr_name == me and set(group.gr_mem) <= {me}


def _guard_parent(parent: Path, *, tighten: bool = True) -> None:
    fd = os.open(parent, _DIR_FLAGS)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        others_write = bool(mode & 0o022) and not mode & stat.S_ISVTX
        if others_write and st.st_uid != os.geteuid():
            raise UnsafeCacheDirError(
                f"{parent} (mode {mode:o}, uid {st.st_uid}) lets other users replace the cache "
                "directory in it. Use a directory only we can write."
            )
        if not _trusted(st.st_uid):
            raise UnsafeCacheDirError(
                f"{parent} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}): its "
                "owner could replace the cache directory in it. Use a directory we own."
            )
        if not others_write:
            return
        if not tighten:
            log.warning(
                "%s is mode %o: others could replace the cache directory in it (left as it is: "
                "opened read-only)",
                parent,
                mode,
            )
            return
        log.warning(
            "%s was mode %o: others could replace the cache directory in it; now %o",
            parent,
            mode,
            mode & ~0o022,
        )
        os.fchmod(fd, mode & ~0o022)
    finally:
        os.close(fd)


def open_private_subdir(dir_fd: int, name: str) -> int:
    """``name`` below ``dir_fd``, created 0700 if missing, never through a symlink."""
    try:
        os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=dir_fd)
        os.chmod(name, PRIVATE_DIR_MODE, dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        pass
    fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        _make_private(fd, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_private(fd: int, where: str, *, tighten: bool = True) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise UnsafeCacheDirError(
            f"cache directory {where} belongs to uid {st.st_uid}, not to us "
            f"(uid {os.geteuid()}); its owner could replace rows. Use a directory we own."
        )
    if st.st_mode & stat.S_ISVTX:
        # A sticky directory is one many users share (/tmp, /dev/shm itself): tightening it
        # would lock everyone else out of it.
        raise UnsafeCacheDirError(
            f"cache directory {where} is a shared directory (mode {stat.S_IMODE(st.st_mode):o}, "
            f"sticky); use a directory of its own below it, e.g. {where.rstrip('/')}/kvwarm"
        )
    if stat.S_IMODE(st.st_mode) & 0o077 and not tighten:
        log.warning(
            "cache directory %s is mode %o (left as it is: opened read-only)",
            where,
            stat.S_IMODE(st.st_mode),
        )
    elif stat.S_IMODE(st.st_mode) & 0o077:
        log.warning(
            "cache directory %s was mode %o; tightening it to %o",
            where,
            stat.S_IMODE(st.st_mode),
            PRIVATE_DIR_MODE,
        )
        os.fchmod(fd, PRIVATE_DIR_MODE)


def list_dir(dir_fd: int) -> list[tuple[str, bool]]:
    """(name, is a directory, not through a link) of every entry below ``dir_fd``, read
    through a descriptor of this listing's own. Found by review: ``os.scandir(dir_fd)``
    reads through a ``dup``, whose offset is shared with every other listing of the same
    fd, so a listing another thread had under way (the sweeper's rescan beside a
    ``gc_shared``) left this one at the end of the directory: a sweep that saw no manifest
    deleted the chunks of other processes' rows."""
    fd = os.open(".", _DIR_FLAGS, dir_fd=dir_fd)
    try:
        with os.scandir(fd) as entries:
            return [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    finally:
        os.close(fd)


def open_regular(dir_fd: int, name: str, flags: int) -> int:
    """Open the regular file ``name`` below ``dir_fd`` without following a link.
    ``CacheFormatError`` if it is a symlink or not a regular file; other ``OSError``s
    (``FileNotFoundError`` included) pass through."""
    return _open_regular(dir_fd, name, flags)[0]


def _open_regular(dir_fd: int, name: str, flags: int) -> tuple[int, int]:
    """``open_regular``, and the file's size from the same ``fstat``."""
    try:
        fd = os.open(name, flags | _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CacheFormatError(f"{name} is a symbolic link; not following it") from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CacheFormatError(f"{name} is not a regular file")
    return fd, st.st_size


def read_file(dir_fd: int, name: str, scratch: bytearray | None) -> tuple[memoryview, bytearray]:
    """The whole file, read once from the page cache into ``scratch`` if it is large enough
    (reused memory is already faulted in: ~2.5x faster for 50 MB on /dev/shm) or else into a
    fresh buffer. Returns (a view of exactly the file's bytes, the buffer behind it)."""
    with open(open_regular(dir_fd, name, os.O_RDONLY), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if scratch is not None and len(scratch) >= size:
            buf = scratch
        else:  # filled below, or refused as shrunk: never read back unwritten
            buf = grown(size, 0 if scratch is None else len(scratch))
        view = memoryview(buf)[:size]
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    if got != size:
        raise CacheFormatError(f"{name} shrank while being read")
    return view, buf


def read_prefix(dir_fd: int, name: str) -> tuple[bytes, int]:
    """Row ``name``'s metadata prefix (header, trailer, TLV; never the payload) and the
    file's size, in one open."""
    with open(open_regular(dir_fd, name, os.O_RDONLY), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(kvc.PREFIX_FIXED_SIZE)
        offset = kvc.meta_end(head, size, name)
        rest = f.read(offset - kvc.PREFIX_FIXED_SIZE)
    return head + rest, size


def read_head(dir_fd: int, name: str, end: int | None) -> tuple[bytes, int]:
    """Bytes ``[0, end)`` of ``name`` (all of it if ``end`` is None) and the file's size."""
    with open(open_regular(dir_fd, name, os.O_RDONLY), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        return f.read(size if end is None else min(end, size)), size


def read_exact(dir_fd: int, name: str, into: memoryview) -> memoryview | None:
    """The whole file read into ``into`` if it is exactly ``len(into)`` bytes, else None
    (the restore path of every chunk: one open, one ``fstat``, one read, no file object)."""
    fd, size = _open_regular(dir_fd, name, os.O_RDONLY)
    try:
        if size != into.nbytes:
            return None
        got = 0
        while got < size:
            n = os.preadv(fd, [into[got:]], got)
            if not n:
                raise CacheFormatError(f"{name} shrank while being read")
            got += n
    finally:
        os.close(fd)
    return into


def unlink_quiet(dir_fd: int, name: str) -> None:
    """Remove ``name`` (a link is removed itself, never its target); missing is fine."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", name, exc)
