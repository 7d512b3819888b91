"""The KV codec protocol: cutting a context's KV blobs into per-token-range chunks and back.

Implementations: ``backends/llama/kv_codec.py`` (llama.cpp's sequence-state layout) and
``backends/stub/kv_codec.py``; the chunk envelope both write is ``backends/kv_chunk.py``.
``backends/base.py`` re-exports ``KvCodec`` with the rest of the backend protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, overload, runtime_checkable

from kvwarm.backends.params import Buffer, WritableBuffer
from kvwarm.errors import JoinBufferTooSmallError

__all__ = ["KvCodec", "join_row"]


@runtime_checkable
class KvCodec(Protocol):
    """Cuts one context's KV blobs (``kv_pack``) into per-token-range chunks and back.

    A *chunk* covers the token positions ``[start, start + n_cells)`` of one sequence: every
    layer's K and V for those positions and their per-cell metadata, behind a small envelope
    that names the codec, the cell layout (cell types, layers, row sizes, V transposed or not),
    ``start`` and ``n_cells``, sealed by a CRC32 of the envelope (``backends/kv_chunk.py``).
    Chunk bytes depend only on the cells' content, not on the sequence id or on where the cells
    sat in the context (so equal prefixes give equal chunks in every process). Layouts:
    ``docs/formats.md``, "KV state layout".

    Guarantees:

    - ``join(split(blob, [0, b1, ..., n]))`` is byte-identical to ``blob`` when ``blob`` came
      from ``kv_pack(0)`` of a sequence whose cells are in position order (always the case for
      a sequence prefilled alone or restored from a blob); from another seq id, the result is
      that blob with the id set to 0. ``join`` of the first ``j`` chunks equals ``kv_pack(0)``
      of the same sequence trimmed (``seq_rm``) to the end of chunk ``j``.
    - Every length and count is checked before it is used; anything malformed, truncated,
      reordered or made with another layout (cell type, model shape, backend) raises
      ``StateRestoreError`` and nothing reaches the native library.
    - Pure and thread-safe: a codec reads no native state, so the cache's writer threads may
      split and join while the worker decodes, and it stays usable after its context closed.
    - Chunk payloads are fresh, contiguous ``bytes`` (each byte copied once from the blob);
      ``join`` writes each byte once into one preallocated ``bytearray`` that ``kv_unpack``
      reads in place, or into the caller's ``out`` buffer (a view of its first
      ``joined_size`` bytes comes back; a shorter buffer is ``JoinBufferTooSmallError``,
      raised before a byte is written). K/V values themselves are opaque here: the cache's
      CRC guards them.
    """

    def split(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        """One chunk per range ``[bounds[i], bounds[i+1])`` of token positions.

        The blob holds positions ``[first, first + n)``: ``first`` is 0 for ``kv_pack``, the
        tail's start for ``kv_pack_tail`` (its chunks are byte-identical to those the whole
        sequence's blob gives for the same ranges). ``bounds`` is strictly increasing with
        ``first <= bounds[0]`` and ``bounds[-1] <= first + n``; ``[0, ..., n]`` covers a whole
        blob, a later first bound emits only the chunks a store lacks. ``StateRestoreError``
        for a blob whose structure this codec does not know (e.g. several KV streams, a
        sliding-window model) or whose cells are not exactly consecutive positions;
        ``InvalidRequestError`` for bad ``bounds``.
        """
        ...

    @overload
    def join(self, chunks: Sequence[Buffer], out: None = None) -> bytearray: ...
    @overload
    def join(self, chunks: Sequence[Buffer], out: WritableBuffer) -> memoryview: ...
    def join(
        self, chunks: Sequence[Buffer], out: WritableBuffer | None = None
    ) -> bytearray | memoryview:
        """A blob ``kv_unpack`` accepts, from chunks covering ``[0, n)`` in order
        (``[]``: an empty sequence): a fresh ``bytearray``, or with ``out`` a ``memoryview``
        of ``out``'s first ``joined_size(chunks)`` bytes, written in place."""
        ...

    def joined_size(self, chunks: Sequence[Buffer]) -> int:
        """How many bytes ``join(chunks)`` writes, after the same checks as ``join``."""
        ...

    def rest(self, blob: Buffer) -> memoryview:
        """The bytes of ``blob`` after the KV cache ``split`` cuts, a view of ``blob``: the
        part of a two-part memory (``MemoryKind.has_rest``: an iSWA window, a hybrid's
        recurrent state) that a row keeps whole, so that ``join(split(blob, [0, ..., n]))``
        followed by ``rest(blob)`` is ``blob``. ``StateRestoreError`` when this context's blobs
        have no such part, or ``blob`` is not of that shape (its first cache does not hold
        positions from 0, or nothing follows it): the row is then stored whole."""
        ...

    def rest_span(self, blob: Buffer) -> tuple[int, int]:
        """``(first, end)``: the positions the rest of ``blob`` holds when that rest is itself
        a KV cache of cells (an iSWA window: the last ``n_swa`` positions, ``end`` being where
        the first cache ends), so ``split_rest`` can cut it. ``StateRestoreError`` when this
        context's rest is no such cache (a recurrent state; no rest at all) or ``blob`` is not
        of that shape: the rest is then kept whole."""
        ...

    def split_rest(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        """The rest's cells cut like ``split`` cuts the first cache: one chunk per range
        ``[bounds[i], bounds[i+1])`` within ``rest_span(blob)``, each depending only on the
        cells it holds, marked as a rest's (``join`` refuses it, ``join_rest`` accepts only
        such chunks). Errors as ``split``."""
        ...

    def rest_size(self, chunks: Sequence[Buffer], first: int) -> int:
        """How many bytes ``join_rest(chunks, first)`` writes, after the same checks."""
        ...

    @overload
    def join_rest(self, chunks: Sequence[Buffer], first: int, out: None = None) -> bytearray: ...
    @overload
    def join_rest(
        self, chunks: Sequence[Buffer], first: int, out: WritableBuffer
    ) -> memoryview: ...
    def join_rest(
        self, chunks: Sequence[Buffer], first: int, out: WritableBuffer | None = None
    ) -> bytearray | memoryview:
        """The rest again, its cells from position ``first`` on, from rest chunks tiling the
        positions from the first chunk's start (which may lie before ``first``: a wider chunk
        another row stored; its earlier cells are skipped) to the end, in order: so
        ``join(split(blob, b)) ‖ join_rest(split_rest(blob, r), rest_span(blob)[0])`` is
        ``blob`` (from seq 0, its cells in position order). ``out`` as for ``join``."""
        ...

    def chunk_range(self, chunk: Buffer) -> tuple[int, int]:
        """``(start, n_cells)`` of one chunk, after checking its envelope and layout."""
        ...


def join_row(
    codec: KvCodec,
    chunks: Sequence[Buffer],
    out: WritableBuffer,
    *,
    rest: Buffer = b"",
    rest_chunks: Sequence[Buffer] = (),
    rest_from: int = 0,
) -> tuple[memoryview, int]:
    """A row's blob written into ``out``: ``codec.join(chunks)`` followed by ``rest`` (a row's
    state after its chunked first cache, kept whole: ``KvCodec.rest``) or by the window
    joined from ``rest_chunks`` from position ``rest_from`` (``join_rest``). Returns a view of
    the blob in ``out`` and the first cache's length (where the rest starts).
    ``JoinBufferTooSmallError`` with the whole blob's size when it does not fit (``out``'s
    bytes are then unspecified); ``StateRestoreError`` for bad chunks."""
    view = memoryview(out)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    extra = memoryview(rest).cast("B")
    try:
        head = codec.join(chunks, view).nbytes
        if rest_chunks:
            tail = codec.join_rest(rest_chunks, rest_from, view[head:]).nbytes
            return view[: head + tail], head
        if head + extra.nbytes <= view.nbytes:
            view[head : head + extra.nbytes] = extra
            return view[: head + extra.nbytes], head
    except JoinBufferTooSmallError:
        pass
    rest_bytes = codec.rest_size(rest_chunks, rest_from) if rest_chunks else extra.nbytes
    need = codec.joined_size(chunks) + rest_bytes
    raise JoinBufferTooSmallError(
        f"the buffer holds {view.nbytes} bytes; the joined row needs {need}", needed=need
    )
