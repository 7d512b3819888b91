"""Where a row lives in a file tier's directory, and how it is read back by name; the names
of rows (``<hex key>.kvc``) and chunks (``<hex key>.kvk``) every tier uses, object stores
included (``objects.py``).

Invariants:

- A row's file name is a pure function of its key, ``<hex key>.kvc``, in one flat directory
  (rows are MB-sized, so even a large quota holds thousands, not millions, of files), so
  another process sharing the directory finds a row it did not write.
- Temp files live in the same directory (``link(2)`` cannot cross file systems), named
  ``<hex>.kvc.<pid>.<token>.<n>.tmp`` so a scan knows whose they are and never mistakes one
  for a row.
- Every read goes through ``fsutil`` (relative to the root's fd, no link followed).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.tiers.common import row_info
from kvwarm.cache.tiers.fsutil import read_meta
from kvwarm.cache.types import TierName
from kvwarm.errors import CacheFormatError

__all__ = [
    "CHUNK_SUFFIX",
    "QUARANTINE",
    "ROW_SUFFIX",
    "TMP_SUFFIX",
    "chunk_key_of",
    "chunk_name",
    "key_of",
    "name_for",
    "row_from_file",
    "tmp_name",
    "tmp_owner_pid",
]

ROW_SUFFIX = ".kvc"
CHUNK_SUFFIX = ".kvk"
TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"  # subdirectory invalid files are moved to
_HEX = frozenset("0123456789abcdef")
_tmp_serial = itertools.count(1)  # next() on a count is atomic under the GIL


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
    stem = name[: -len(CHUNK_SUFFIX)]
    if not name.endswith(CHUNK_SUFFIX) or len(stem) != 64 or not _HEX.issuperset(stem):
        return None
    return bytes.fromhex(stem)


def tmp_name(final: str, token: int) -> str:
    """A temp name for ``final`` unique to this process, reservation and attempt."""
    return f"{final}.{os.getpid()}.{token}.{next(_tmp_serial)}{TMP_SUFFIX}"


def tmp_owner_pid(name: str) -> int | None:
    """The pid that created temp file ``name``; None if the name does not say."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) == 6 and parts[2].isdigit() else None


def row_from_file(dir_fd: int, root: Path, tier: TierName, name: str, key: bytes) -> StoredRow:
    """The row file ``name`` holds, from its metadata (the payload is checked on load).
    ``CacheFormatError`` if it is not a valid row of ``key``; ``OSError`` if unreadable."""
    meta = read_meta(dir_fd, name)
    if meta.key != key:
        raise CacheFormatError(f"{name} holds another key")
    size = meta.payload_offset + meta.payload_length  # the file's size (parse_meta checks it)
    info = row_info(key, tier, meta.fields, meta.payload_length, stored_bytes=size)
    return StoredRow(
        info, meta.fields.tokens, str(root / name), meta.fields.chunks, meta.fields.chunk_lens
    )
