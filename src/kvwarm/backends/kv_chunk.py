"""The envelope every KV chunk carries, and the token bounds a blob is split at.

A chunk is ``head ‖ descriptor ‖ crc ‖ body`` (little-endian)::

    magic      4s   b"KVCK"
    version    u8   1
    codec      u8   which blob format the body slices (CODEC_LLAMA, CODEC_STUB)
    flags      u16  0, FLAG_BLOB or FLAG_REST (anything else is refused)
    start      u32  first token position the chunk holds
    n_cells    u32  how many positions (>= 1)
    desc_len   u32  length of the descriptor
    body_len   u64  length of the body; the chunk is exactly this long after the crc
    descriptor      the codec's layout description (cell types, layers, row sizes...)
    crc        u32  zlib CRC32 of every byte before it

``FLAG_BLOB`` says the body is itself a complete blob of the codec's format holding just the
chunk's cells (positions ``start..``), which the backend can restore straight from the chunk's
buffer; without it the body is the cells alone (the first chunk format, still read).
``FLAG_REST`` says the chunk holds cells of the blob's *second* KV cache (an iSWA model's
window: ``KvCodec.split_rest``), body as without ``FLAG_BLOB``: such a chunk is only ever
joined into a rest (``KvCodec.join_rest``), never taken for one of the first cache (and a
kvwarm that does not know the flag refuses it).

Invariants: ``parse`` checks every field and the CRC before returning anything, so a flipped
bit anywhere in the envelope, a truncated or extended chunk, or a chunk of another codec is a
``StateRestoreError``; the body is returned as a view (no copy). The body's own bytes are
checked by the codec that reads them (structure) and by the cache's CRC (values). The layout
behind each codec: ``docs/architecture.md``, "KV state layout".
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvwarm.buffers import U8
from kvwarm.errors import InvalidRequestError, StateRestoreError

MAGIC = b"KVCK"
VERSION = 1
CODEC_LLAMA = 1  # llama.cpp ``llama_state_seq_get_data``, one unified KV stream
CODEC_STUB = 2  # the stub backend's blob format
#: The body is a whole blob of the codec's format for the chunk's cells alone.
FLAG_BLOB = 1
#: The chunk holds cells of the blob's second KV cache (its rest), without a blob head.
FLAG_REST = 2
_HEAD = struct.Struct("<4sBBHIIIQ")
_CRC = struct.Struct("<I")
#: Descriptors describe layers, not cells: a megabyte would be a quarter-million layers.
MAX_DESCRIPTOR = 1 << 20
MAX_CELLS = 1 << 31


@dataclass(frozen=True, slots=True)
class ChunkView:
    """A parsed chunk: where it sits, the layout it claims, and its body (a view)."""

    start: int
    n_cells: int
    descriptor: bytes
    body: U8
    flags: int = 0

    @property
    def end(self) -> int:
        return self.start + self.n_cells


def header_size(descriptor: bytes) -> int:
    return _HEAD.size + len(descriptor) + _CRC.size


def write_header(
    dst: U8,
    *,
    codec: int,
    start: int,
    n_cells: int,
    descriptor: bytes,
    body_len: int,
    flags: int = 0,
) -> int:
    """Write the envelope at the start of ``dst`` (a chunk's whole buffer); its size."""
    head = _HEAD.pack(MAGIC, VERSION, codec, flags, start, n_cells, len(descriptor), body_len)
    sealed = head + descriptor
    sealed += _CRC.pack(zlib.crc32(sealed))
    dst[: len(sealed)] = memoryview(sealed)
    return len(sealed)


def parse(chunk: U8, codec: int) -> ChunkView:
    """Check ``chunk``'s envelope (``StateRestoreError`` if anything is off) and view it."""
    size = chunk.size
    if size < _HEAD.size + _CRC.size:
        raise StateRestoreError(f"KV chunk of {size} bytes is shorter than its envelope")
    raw = chunk.data  # a memoryview: what ``struct`` and ``zlib`` read
    magic, version, kind, flags, start, n_cells, desc_len, body_len = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC:
        raise StateRestoreError("not a KV chunk (bad magic)")
    if version != VERSION:
        raise StateRestoreError(f"KV chunk version {version} is not supported (want {VERSION})")
    if desc_len > MAX_DESCRIPTOR or _HEAD.size + desc_len + _CRC.size > size:
        raise StateRestoreError(f"KV chunk descriptor of {desc_len} bytes overruns the chunk")
    crc_at = _HEAD.size + desc_len
    (crc,) = _CRC.unpack_from(raw, crc_at)
    if zlib.crc32(raw[:crc_at]) != crc:
        raise StateRestoreError("KV chunk envelope is corrupt (CRC mismatch)")
    # Past the CRC, a mismatch below is a well-formed chunk that does not belong here.
    if kind != codec:
        raise StateRestoreError(f"KV chunk was made by codec {kind}, this context uses {codec}")
    if flags & ~(FLAG_BLOB | FLAG_REST) or flags == FLAG_BLOB | FLAG_REST:
        raise StateRestoreError(f"KV chunk has unknown flags {flags:#x}")
    if n_cells < 1 or start + n_cells > MAX_CELLS:
        raise StateRestoreError(f"KV chunk claims cells [{start}, {start + n_cells})")
    body_at = crc_at + _CRC.size
    if body_len != size - body_at:
        raise StateRestoreError(
            f"KV chunk body is {size - body_at} bytes, its envelope says {body_len}"
        )
    descriptor = chunk[_HEAD.size : crc_at].tobytes()
    return ChunkView(start, n_cells, descriptor, chunk[body_at:], flags)


def check_bounds(bounds: Sequence[int], n_cells: int, first: int = 0) -> list[int]:
    """``bounds`` as a list, if strictly increasing inside ``[first, first + n_cells]`` (the
    positions a blob holds: from 0, or from a tail's first position)."""
    out = [int(b) for b in bounds]
    if len(out) < 2 and n_cells > 0:
        raise InvalidRequestError("bounds need at least a start and an end", param="bounds")
    if out and (out[0] < first or out[-1] > first + n_cells):
        raise InvalidRequestError(
            f"bounds [{out[0]}, {out[-1]}] outside the blob's positions "
            f"[{first}, {first + n_cells}]",
            param="bounds",
        )
    for a, b in itertools.pairwise(out):
        if b <= a:
            raise InvalidRequestError(f"bounds not increasing at {a}, {b}", param="bounds")
    return out


def check_sequence(views: Sequence[ChunkView], start: int = 0) -> int:
    """The end position of chunks that tile ``[start, n)`` in order, all with one descriptor
    (``n``: the cell count of chunks from 0)."""
    end = start
    for i, view in enumerate(views):
        if view.start != end:
            raise StateRestoreError(
                f"KV chunk {i} starts at {view.start}, expected {end} (missing or out of order)"
            )
        if view.descriptor != views[0].descriptor:
            raise StateRestoreError(f"KV chunk {i} has another layout than chunk 0")
        end = view.end
    return end
