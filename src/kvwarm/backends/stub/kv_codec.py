"""Chunks of the stub backend's KV blobs, with the guarantees of llama.cpp's codec.

A stub blob is ``header ‖ cells`` (``stub_context``): the header names the model, the cell
types and the cell size; each cell is ``(pos, token, h)`` padded to the cell size, sorted by
position. A chunk body is the range's cells verbatim; the descriptor is the header without
its cell count (model id, type codes, cell size), so a chunk of another model or cell type is
refused exactly as llama.cpp's codec refuses another layout.

Invariants: as ``llama_kv_codec``: every length is checked before it is used; ``split``
copies each emitted byte once; ``join`` writes each byte once into one ``bytearray`` (or
the caller's ``out``) and refuses chunks that are corrupt, out of order or of another
layout; the cells' hash chains are checked again by ``kv_unpack``, as llama.cpp checks its
own blobs.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import overload

import numpy as np

from kvwarm.backends import kv_chunk
from kvwarm.backends.base import Buffer, WritableBuffer
from kvwarm.buffers import U8, fresh_bytes, join_target, u8
from kvwarm.errors import StateRestoreError

MAGIC = b"KVSTUB01"
#: magic, model id, type_k code, type_v code, cell size, cell count
HEADER = struct.Struct("<8sQBBHI")
#: pos, token, h: the start of every cell (the rest is padding derived from h)
CELL = struct.Struct("<iiQ")
_DESCRIPTOR = struct.Struct("<QBBH")  # the header without magic and count


class StubKvCodec:
    """``KvCodec`` for one stub context's blobs."""

    __slots__ = ("_cell", "_descriptor")

    def __init__(self, *, model_id: int, type_k: int, type_v: int, cell_bytes: int) -> None:
        self._cell = cell_bytes
        self._descriptor = _DESCRIPTOR.pack(model_id, type_k, type_v, cell_bytes)

    def header(self, n_cells: int) -> bytes:
        """The blob header for ``n_cells`` cells of this context."""
        return MAGIC + self._descriptor + struct.pack("<I", n_cells)

    def split(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        data = u8(blob)
        first, n_cells = self._parse_blob(data)
        cuts = kv_chunk.check_bounds(bounds, n_cells, first)
        cells = data[HEADER.size :]
        return [self._cut(cells, first, a, b) for a, b in itertools.pairwise(cuts)]

    @overload
    def join(self, chunks: Sequence[Buffer], out: None = None) -> bytearray: ...
    @overload
    def join(self, chunks: Sequence[Buffer], out: WritableBuffer) -> memoryview: ...
    def join(
        self, chunks: Sequence[Buffer], out: WritableBuffer | None = None
    ) -> bytearray | memoryview:
        views = self._checked(chunks)
        n_cells = views[-1].end if views else 0
        dst, result = join_target(HEADER.size + n_cells * self._cell, out)
        dst[: HEADER.size] = np.frombuffer(self.header(n_cells), dtype=np.uint8)
        for view in views:
            dst[HEADER.size + view.start * self._cell : HEADER.size + view.end * self._cell] = (
                view.body
            )
        return result

    def join_tail(self, chunks: Sequence[Buffer], start: int) -> bytes:
        """Chunks tiling positions from ``start`` as one blob of those cells (a tail)."""
        views = self._checked(chunks, start)
        n_cells = (views[-1].end if views else start) - start
        return self.header(n_cells) + b"".join(bytes(view.body) for view in views)

    def joined_size(self, chunks: Sequence[Buffer]) -> int:
        views = self._checked(chunks)
        return HEADER.size + (views[-1].end if views else 0) * self._cell

    def _checked(self, chunks: Sequence[Buffer], start: int = 0) -> list[kv_chunk.ChunkView]:
        views = [kv_chunk.parse(u8(c, "KV chunk"), kv_chunk.CODEC_STUB) for c in chunks]
        kv_chunk.check_sequence(views, start)
        for i, view in enumerate(views):
            self._check_chunk(view, i)
        return views

    def rest(self, blob: Buffer) -> memoryview:
        # The stub keeps a window's or a recurrent state's cells alone, not a full-attention
        # cache beside them: its rows of those memories are stored whole.
        raise StateRestoreError("stub KV blobs are one part: they have no rest")

    def chunk_range(self, chunk: Buffer) -> tuple[int, int]:
        view = kv_chunk.parse(u8(chunk, "KV chunk"), kv_chunk.CODEC_STUB)
        self._check_chunk(view, 0)
        return view.start, view.n_cells

    def _parse_blob(self, data: U8) -> tuple[int, int]:
        """The blob's first position (0, or a tail's start) and cell count, after checking its
        header, size and positions."""
        if data.size < HEADER.size:
            raise StateRestoreError(f"KV blob of {data.size} bytes is shorter than its header")
        n_cells = int(struct.unpack_from("<I", data.data, HEADER.size - 4)[0])
        if data[: HEADER.size - 4].tobytes() != MAGIC + self._descriptor:
            raise StateRestoreError("KV blob is not this model's, or has other cell types")
        if data.size != HEADER.size + n_cells * self._cell:
            raise StateRestoreError(f"KV blob of {data.size} bytes does not hold {n_cells} cells")
        cells = data[HEADER.size :]
        first = int(cells[:4].copy().view("<i4")[0]) if n_cells else 0
        if first < 0:
            raise StateRestoreError(f"KV blob holds negative position {first}")
        _check_positions(cells, self._cell, first, n_cells, "KV blob")
        return first, n_cells

    def _check_chunk(self, view: kv_chunk.ChunkView, i: int) -> None:
        if view.flags:
            raise StateRestoreError(f"KV chunk {i} has unknown flags {view.flags:#x}")
        if view.descriptor != self._descriptor:
            raise StateRestoreError(f"KV chunk {i} is another model's, or has other cell types")
        if view.body.size != view.n_cells * self._cell:
            raise StateRestoreError(f"KV chunk {i} body does not hold {view.n_cells} cells")
        _check_positions(view.body, self._cell, view.start, view.n_cells, f"KV chunk {i}")

    def _cut(self, cells: U8, first: int, a: int, b: int) -> bytes:
        body = cells[(a - first) * self._cell : (b - first) * self._cell]
        out, view = fresh_bytes(kv_chunk.header_size(self._descriptor) + body.size)
        at = kv_chunk.write_header(
            view,
            codec=kv_chunk.CODEC_STUB,
            start=a,
            n_cells=b - a,
            descriptor=self._descriptor,
            body_len=body.size,
        )
        view[at:] = body
        return out


def _check_positions(cells: U8, cell: int, start: int, n: int, what: str) -> None:
    """Cell ``i`` holds position ``start + i``: the stub packs cells in position order."""
    pos = cells.reshape(n, cell)[:, :4].copy().view("<i4").ravel()
    if not np.array_equal(pos, np.arange(start, start + n, dtype=np.int32)):
        raise StateRestoreError(f"{what} cells are not positions {start}..{start + n - 1}")
