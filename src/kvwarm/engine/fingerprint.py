"""Model fingerprints: the cache key is bound to a model file's *content*, never its path.

Modes (``FingerprintMode``):

- ``safe``: sha256 of the whole file.
- ``gguf_chunked``: sha256 of the GGUF header, metadata, tensor table and the first tensor's
  bytes, plus the file size. Catches accidental corruption and different files, not tampering.
- ``fast_unsafe``: the caller supplies the 32-byte digest and is trusted.

A model split into parts (``NAME-00001-of-0000N.gguf``, llama.cpp opens the others by name
beside the first) is every part's content: each part is hashed as the first is and folded in
(``model_fingerprint``).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from kvwarm import models_dir
from kvwarm.cache.types import FingerprintMode
from kvwarm.errors import ConfigError, InvalidModelFileError
from kvwarm.gguf_meta import read_metadata, unpack_from_file

_CHUNK = 4 << 20

Progress = Callable[[int, int], None]

#: The ``fingerprint_mode`` names a configuration may use (``FingerprintMode``, lower case).
MODE_NAMES: tuple[str, ...] = tuple(m.name.lower() for m in FingerprintMode)


def parse_mode(mode: str | FingerprintMode) -> FingerprintMode:
    if isinstance(mode, FingerprintMode):
        return mode
    try:
        return FingerprintMode[mode.upper()]
    except KeyError:
        names = ", ".join(MODE_NAMES)
        raise ConfigError(f"fingerprint_mode must be one of {names}; got {mode!r}") from None


def model_fingerprint(
    path: Path, mode: FingerprintMode, supplied: bytes | None, progress: Progress | None = None
) -> bytes:
    """The fingerprint of the model at ``path``. A model without a weights file (a backend that
    needs none, like the stub; ``Backend.locate`` refuses a missing file for the others) is
    identified by its path; the prefix keeps existing rows' keys.

    A split model's other parts are hashed as its first is and folded in (a model in one
    file keeps its key). Found by review: only the first part was hashed, so a model whose
    later parts changed (a first part of metadata alone, ``gguf-split
    --no-tensor-first-split``, is the same for every fine-tune of one base) restored KV
    another model's weights made."""
    if not path.is_file():
        return hashlib.sha256(b"stub:" + str(path).encode()).digest()
    first = fingerprint(path, mode, supplied, progress)
    others = [p for p in models_dir.parts(path) if p.is_file()]  # one missing: the load says
    if not others or mode is FingerprintMode.FAST_UNSAFE:  # a supplied digest is the model's
        return first
    digest = hashlib.sha256(b"kvwarm-split\0" + first)
    for part in others:
        digest.update(fingerprint(part, mode))
    return digest.digest()


FileIdentity = tuple[tuple[int, int, int, int], ...]


def file_identity(path: Path) -> FileIdentity:
    """Which files ``path`` (and a split model's other parts) are now: each one's device,
    inode, size and modification time; () for a model without a file. The same before its
    fingerprint and after its weights were read: the fingerprint is of what was read."""
    out = []
    for part in (path, *models_dir.parts(path)):
        try:
            st = part.stat()
        except OSError:
            continue  # no file (the stub's), or a part missing: the load says so
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def with_projector(model_fp: bytes, path: Path, mode: FingerprintMode) -> bytes:
    """``model_fp`` with the multimodal projector at ``path`` folded in: an image's KV depends
    on the projector that encoded it (``companion_fingerprint``)."""
    proj = companion_fingerprint(path, mode)
    return hashlib.sha256(b"kvwarm-mmproj\0" + model_fp + proj).digest()


def companion_fingerprint(path: Path, mode: FingerprintMode) -> bytes:
    """The fingerprint of a file loaded beside a model (its projector, its draft model):
    hashed as the model is, but for ``fast_unsafe``, which supplies the model's fingerprint
    only: the file is then hashed whole (found by review: a draft model asked for a supplied
    fingerprint, so no model of that mode could load one). A backend that needs no file (the
    stub): its path names it. A split file is every part's content, as a model's is
    (``model_fingerprint``; found by review: a split draft model's first part alone was
    hashed)."""
    chunked = mode is FingerprintMode.GGUF_CHUNKED
    return model_fingerprint(
        path, FingerprintMode.GGUF_CHUNKED if chunked else FingerprintMode.SAFE, None
    )


def fingerprint(
    path: str | os.PathLike[str],
    mode: FingerprintMode,
    supplied: bytes | None = None,
    progress: Progress | None = None,
) -> bytes:
    """The 32-byte fingerprint of ``path`` under ``mode``."""
    if mode is FingerprintMode.FAST_UNSAFE:
        if supplied is None or len(supplied) != 32:
            raise ConfigError("fingerprint_mode 'fast_unsafe' needs a 32-byte fingerprint")
        return bytes(supplied)
    if supplied is not None:
        raise ConfigError("a supplied fingerprint is only used with fingerprint_mode 'fast_unsafe'")
    path = Path(path)
    if mode is FingerprintMode.SAFE:
        return _sha256_file(path, progress)
    return _gguf_chunked(path)


def _sha256_file(path: Path, progress: Progress | None) -> bytes:
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            done += n
            if progress is not None:
                progress(done, total)
    return digest.digest()


def _gguf_chunked(path: Path) -> bytes:
    size = path.stat().st_size
    with path.open("rb") as f:
        try:
            data_start, first_tensor_len = _gguf_layout(f, size)
        except (struct.error, ValueError) as exc:
            raise InvalidModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
        digest = hashlib.sha256(b"kvwarm-gguf-chunked-v1\0")
        digest.update(size.to_bytes(8, "little"))
        f.seek(0)
        remaining = data_start + first_tensor_len
        while remaining > 0:
            chunk = f.read(min(_CHUNK, remaining))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.digest()


def _gguf_layout(f: BinaryIO, size: int) -> tuple[int, int]:
    """(offset of tensor data, byte length of the first tensor) of a GGUF v2/v3 file."""

    def read(fmt: str) -> tuple[int, ...]:
        return unpack_from_file(f, fmt)

    meta = read_metadata(f, size, ("general.alignment",))
    alignment = int(meta.values.get("general.alignment", 32))
    offsets: list[int] = []
    for _ in range(meta.n_tensors):
        (n,) = read("<Q")
        if n > size:
            raise ValueError("string length beyond file")
        f.seek(n, os.SEEK_CUR)
        (n_dims,) = read("<I")
        f.seek(8 * n_dims + 4, os.SEEK_CUR)
        (offset,) = read("<Q")
        offsets.append(offset)
    header_end = f.tell()
    data_start = (header_end + alignment - 1) // alignment * alignment
    if not offsets:
        return data_start, 0
    offsets.sort()
    end = offsets[1] if len(offsets) > 1 else size - data_start
    return data_start, max(0, min(end - offsets[0], size - data_start))
