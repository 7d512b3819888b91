"""The names every persistent tier uses: rows (``<hex key>.kvc``), chunks (``<hex key>.kvk``)
and a file store's temp files and ``quarantine/``.

Invariants:

- A row's file name is a pure function of its key, ``<hex key>.kvc``, in one flat directory
  (rows are MB-sized, so even a large quota holds thousands, not millions, of files), so
  another process sharing the directory finds a row it did not write.
- Temp files live in the same directory (``link(2)`` cannot cross file systems), named
  ``<hex>.kvc.<pid>.<token>.<n>.p<ns>.tmp`` so a scan knows whose they are and never mistakes
  one for a row: ``<ns>`` is the writer's pid namespace (``PID_NAMESPACE``), since a pid means
  something only inside its own (two containers sharing a directory on one host each have a
  pid 1). A name without it (``<hex>.kvc.<pid>.<token>.<n>.tmp``, written by a kvwarm before
  it) is taken as this namespace's.
"""

from __future__ import annotations

import itertools
import os

__all__ = [
    "CHUNK_SUFFIX",
    "PACK_SUFFIX",
    "QUARANTINE",
    "ROW_SUFFIX",
    "TMP_SUFFIX",
    "chunk_key_of",
    "chunk_name",
    "key_of",
    "name_for",
    "pack_id_of",
    "pack_name",
    "PID_NAMESPACE",
    "tmp_name",
    "tmp_owner",
]

ROW_SUFFIX = ".kvc"
CHUNK_SUFFIX = ".kvk"
PACK_SUFFIX = ".kvp"  # a pack of chunk objects (object tiers with packs: s3, redis)
TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"  # subdirectory invalid files are moved to
_HEX = frozenset("0123456789abcdef")
_tmp_serial = itertools.count(1)  # next() on a count is atomic under the GIL


def _pid_namespace() -> str:
    """This process's pid namespace, as the hex inode of ``/proc/self/ns/pid`` (unique among
    the namespaces of one running kernel); "" where it cannot be read (no ``/proc``)."""
    try:
        return format(os.stat("/proc/self/ns/pid").st_ino, "x")
    except OSError:
        return ""


#: This process's pid namespace (``_pid_namespace``), written into its temp file names.
PID_NAMESPACE = _pid_namespace()


def name_for(key: bytes) -> str:
    return key.hex() + ROW_SUFFIX


def key_of(name: str) -> bytes | None:
    """The key a row file name stands for; None if ``name`` is not a row file name."""
    stem = name[: -len(ROW_SUFFIX)]
    if not name.endswith(ROW_SUFFIX) or len(stem) != 64 or not _HEX.issuperset(stem):
        return None
    return bytes.fromhex(stem)


def chunk_name(key: bytes) -> str:
    return key.hex() + CHUNK_SUFFIX


def chunk_key_of(name: str) -> bytes | None:
    """The key a chunk object name stands for; None if ``name`` is not a chunk name."""
    return _hex_stem(name, CHUNK_SUFFIX)


def pack_name(pack: bytes) -> str:
    return pack.hex() + PACK_SUFFIX


def pack_id_of(name: str) -> bytes | None:
    """The id a pack object name stands for; None if ``name`` is not a pack name."""
    return _hex_stem(name, PACK_SUFFIX)


def _hex_stem(name: str, suffix: str) -> bytes | None:
    stem = name[: -len(suffix)]
    if not name.endswith(suffix) or len(stem) != 64 or not _HEX.issuperset(stem):
        return None
    return bytes.fromhex(stem)


def tmp_name(final: str, token: int) -> str:
    """A temp name for ``final`` unique to this process, reservation and attempt."""
    return f"{final}.{os.getpid()}.{token}.{next(_tmp_serial)}.p{PID_NAMESPACE}{TMP_SUFFIX}"


def tmp_owner(name: str) -> tuple[int, str] | None:
    """The pid that created temp file ``name`` and its pid namespace (``PID_NAMESPACE``'s
    form; this process's for a name written before namespaces were named); None if the name
    does not say."""
    parts = name.split(".")
    if len(parts) == 6 and parts[2].isdigit():
        return int(parts[2]), PID_NAMESPACE
    if len(parts) == 7 and parts[2].isdigit() and parts[5].startswith("p"):
        return int(parts[2]), parts[5][1:]
    return None
