"""Chunks of the stub backend's KV blobs, with the guarantees of llama.cpp's codec.

A stub blob is ``header ‖ cells`` (``stub_context``): the header names the model, the cell
types and the cell size; each cell is ``(pos, token, h)`` padded to the cell size, sorted by
position. A chunk body is the range's cells verbatim; the descriptor is the header without
its cell count (model id, type codes, cell size), so a chunk of another model or cell type is
refused exactly as llama.cpp's codec refuses another layout.

A sliding-window model's blob (``with_rest``), like llama.cpp's iSWA one, is two caches:
``header ‖ cells`` of every position, then its window ``WINDOW_MAGIC ‖ u32 count ‖ cells`` of
the last positions (each cell its position's window hash). The window is cut like the first
cache (``split_rest``: chunks flagged ``kv_chunk.FLAG_REST``) and joined back from any
chunk holding its first position (``join_rest``).

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
WINDOW_MAGIC = b"KVSTUBW1"
#: magic, cell count: a window cache's head, after the first cache's cells
WINDOW_HEAD = struct.Struct("<8sI")
#: magic, model id, type_k code, type_v code, cell size, cell count
HEADER = struct.Struct("<8sQBBHI")
#: pos, token, h: the start of every cell (the rest is padding derived from h)
CELL = struct.Struct("<iiQ")
_DESCRIPTOR = struct.Struct("<QBBH")  # the header without magic and count


class StubKvCodec:
    """``KvCodec`` for one stub context's blobs."""

    __slots__ = ("_cell", "_descriptor", "_with_rest")

    def __init__(
        self,
        *,
        model_id: int,
        type_k: int,
        type_v: int,
        cell_bytes: int,
        with_rest: bool = False,
    ) -> None:
        self._cell = cell_bytes
        self._descriptor = _DESCRIPTOR.pack(model_id, type_k, type_v, cell_bytes)
        self._with_rest = with_rest

    def header(self, n_cells: int) -> bytes:
        """The blob header for ``n_cells`` cells of this context."""
        return MAGIC + self._descriptor + struct.pack("<I", n_cells)

    def window_header(self, n_cells: int) -> bytes:
        """A window cache's head for ``n_cells`` cells (after the first cache's cells)."""
        return WINDOW_HEAD.pack(WINDOW_MAGIC, n_cells)

    def split(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        data = u8(blob)
        first, n_cells = self._parse_blob(data)
        cuts = kv_chunk.check_bounds(bounds, n_cells, first)
        cells = data[HEADER.size : HEADER.size + n_cells * self._cell]
        return [self._cut(cells, first, a, b) for a, b in itertools.pairwise(cuts)]

    def rest_span(self, blob: Buffer) -> tuple[int, int]:
        first, n_cells = self._parse_window(u8(blob))[1:]
        return first, first + n_cells

    def split_rest(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        cells, first, n_cells = self._parse_window(u8(blob))
        cuts = kv_chunk.check_bounds(bounds, n_cells, first)
        return [self._cut(cells, first, a, b, rest=True) for a, b in itertools.pairwise(cuts)]

    def rest_size(self, chunks: Sequence[Buffer], first: int) -> int:
        views = self._checked_rest(chunks, first)
        return WINDOW_HEAD.size + (views[-1].end - first) * self._cell

    @overload
    def join_rest(self, chunks: Sequence[Buffer], first: int, out: None = None) -> bytearray: ...
    @overload
    def join_rest(
        self, chunks: Sequence[Buffer], first: int, out: WritableBuffer
    ) -> memoryview: ...
    def join_rest(
        self, chunks: Sequence[Buffer], first: int, out: WritableBuffer | None = None
    ) -> bytearray | memoryview:
        views = self._checked_rest(chunks, first)
        n_cells = views[-1].end - first
        dst, result = join_target(WINDOW_HEAD.size + n_cells * self._cell, out)
        dst[: WINDOW_HEAD.size] = np.frombuffer(self.window_header(n_cells), dtype=np.uint8)
        for view in views:
            skip = max(0, first - view.start)  # cells of a wider chunk before the window
            at = WINDOW_HEAD.size + (view.start + skip - first) * self._cell
            dst[at : WINDOW_HEAD.size + (view.end - first) * self._cell] = view.body[
                skip * self._cell :
            ]
        return result

    def _checked_rest(self, chunks: Sequence[Buffer], first: int) -> list[kv_chunk.ChunkView]:
        views = [kv_chunk.parse(u8(c, "KV chunk"), kv_chunk.CODEC_STUB) for c in chunks]
        if not views:
            raise StateRestoreError("a window needs at least one chunk")
        if not views[0].start <= first < views[0].end:
            raise StateRestoreError(f"the window starts at {first}, outside its first chunk")
        kv_chunk.check_sequence(views, views[0].start)
        for i, view in enumerate(views):
            self._check_chunk(view, i, rest=True)
        return views

    def _parse_window(self, data: U8) -> tuple[U8, int, int]:
        """A two-part blob's window: its cells, first position and count (it ends where the
        first cache does)."""
        if not self._with_rest:
            raise StateRestoreError("stub KV blobs of this model have no window cache")
        first_at, n_first = self._parse_blob(data)
        if first_at:
            raise StateRestoreError("a window's blob holds positions from 0")
        at = HEADER.size + n_first * self._cell
        magic, n_cells = WINDOW_HEAD.unpack_from(data.data, at)
        if magic != WINDOW_MAGIC or n_cells == 0:
            raise StateRestoreError("KV blob has no window cache after its first")
        cells = data[at + WINDOW_HEAD.size :]
        if cells.size != n_cells * self._cell:
            raise StateRestoreError(f"KV blob window does not hold {n_cells} cells")
        first = n_first - n_cells
        if first < 0:
            raise StateRestoreError("KV blob window holds more cells than its first cache")
        _check_positions(cells, self._cell, first, n_cells, "KV blob window")
        return cells, first, n_cells

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
        """Chunks of the first cache, checked, tiling positions from ``start``."""
        views = [kv_chunk.parse(u8(c, "KV chunk"), kv_chunk.CODEC_STUB) for c in chunks]
        kv_chunk.check_sequence(views, start)
        for i, view in enumerate(views):
            self._check_chunk(view, i)
        return views

    def rest(self, blob: Buffer) -> memoryview:
        # A recurrent (or hybrid) stub keeps its state's cells alone, not an attention cache
        # beside them: its rows are stored whole. A window's blob has a first cache.
        if not self._with_rest:
            raise StateRestoreError("stub KV blobs of this model are one part: no rest")
        data = u8(blob)
        _, n_cells = self._parse_blob(data)
        return data[HEADER.size + n_cells * self._cell :].data

    def chunk_range(self, chunk: Buffer) -> tuple[int, int]:
        view = kv_chunk.parse(u8(chunk, "KV chunk"), kv_chunk.CODEC_STUB)
        self._check_chunk(view, 0, rest=bool(view.flags & kv_chunk.FLAG_REST))
        return view.start, view.n_cells

    def _parse_blob(self, data: U8) -> tuple[int, int]:
        """The blob's first position (0, or a tail's start) and cell count, after checking its
        header, size and positions."""
        if data.size < HEADER.size:
            raise StateRestoreError(f"KV blob of {data.size} bytes is shorter than its header")
        n_cells = int(struct.unpack_from("<I", data.data, HEADER.size - 4)[0])
        if data[: HEADER.size - 4].tobytes() != MAGIC + self._descriptor:
            raise StateRestoreError("KV blob is not this model's, or has other cell types")
        size = HEADER.size + n_cells * self._cell
        # A window's blob holds its window after the first cache (``_parse_window``).
        if data.size != size and not (self._with_rest and data.size > size):
            raise StateRestoreError(f"KV blob of {data.size} bytes does not hold {n_cells} cells")
        cells = data[HEADER.size : size]
        first = int(cells[:4].copy().view("<i4")[0]) if n_cells else 0
        if first < 0:
            raise StateRestoreError(f"KV blob holds negative position {first}")
        _check_positions(cells, self._cell, first, n_cells, "KV blob")
        return first, n_cells

    def _check_chunk(self, view: kv_chunk.ChunkView, i: int, *, rest: bool = False) -> None:
        if view.flags != (kv_chunk.FLAG_REST if rest else 0):
            what = "a window chunk" if rest else "a chunk of the first cache"
            raise StateRestoreError(f"KV chunk {i} (flags {view.flags:#x}) is not {what}")
        if view.descriptor != self._descriptor:
            raise StateRestoreError(f"KV chunk {i} is another model's, or has other cell types")
        if view.body.size != view.n_cells * self._cell:
            raise StateRestoreError(f"KV chunk {i} body does not hold {view.n_cells} cells")
        _check_positions(view.body, self._cell, view.start, view.n_cells, f"KV chunk {i}")

    def _cut(self, cells: U8, first: int, a: int, b: int, *, rest: bool = False) -> bytes:
        body = cells[(a - first) * self._cell : (b - first) * self._cell]
        out, view = fresh_bytes(kv_chunk.header_size(self._descriptor) + body.size)
        at = kv_chunk.write_header(
            view,
            codec=kv_chunk.CODEC_STUB,
            start=a,
            n_cells=b - a,
            descriptor=self._descriptor,
            body_len=body.size,
            flags=kv_chunk.FLAG_REST if rest else 0,
        )
        view[at:] = body
        return out


def _check_positions(cells: U8, cell: int, start: int, n: int, what: str) -> None:
    """Cell ``i`` holds position ``start + i``: the stub packs cells in position order."""
    pos = cells.reshape(n, cell)[:, :4].copy().view("<i4").ravel()
    if not np.array_equal(pos, np.arange(start, start + n, dtype=np.int32)):
        raise StateRestoreError(f"{what} cells are not positions {start}..{start + n - 1}")
