"""The names every persistent tier uses: rows (``<hex key>.kvc``), chunks (``<hex key>.kvk``)
and a file store's temp files and ``quarantine/``.

Invariants:

- A row's file name is a pure function of its key, ``<hex key>.kvc``, in one flat directory
  (rows are MB-sized, so even a large quota holds thousands, not millions, of files), so
  another process sharing the directory finds a row it did not write.
- Temp files live in the same directory (``link(2)`` cannot cross file systems), named
  ``<hex>.kvc.<pid>.<token>.<n>.tmp`` so a scan knows whose they are and never mistakes one
  for a row.
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
    "tmp_name",
    "tmp_owner_pid",
]

ROW_SUFFIX = ".kvc"
CHUNK_SUFFIX = ".kvk"
PACK_SUFFIX = ".kvp"  # a pack of chunk objects (object tiers with packs: s3, redis)
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
    return f"{final}.{os.getpid()}.{token}.{next(_tmp_serial)}{TMP_SUFFIX}"


def tmp_owner_pid(name: str) -> int | None:
    """The pid that created temp file ``name``; None if the name does not say."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) == 6 and parts[2].isdigit() else None
