"""Chunks of llama.cpp sequence-state blobs: ``split`` a blob by token ranges, ``join`` it back.

A chunk body (``kv_chunk.FLAG_BLOB``, what ``split`` writes) is itself a complete
``llama_state_seq_get_data`` blob of the range's cells alone, in canonical form::

    u32 magic, i32 0, u32 1, u32 n              the blob head: sequence id 0, one stream
    n x (i32 pos, u32 1, i32 0)                 metadata: positions start.., sequence id 0
    u32 v_trans, u32 n_layer, then each section's 12-byte header before its cells:
    for each K layer:  n x row                  the range's rows
    for each V layer:  n x row, or (transposed) n_embd x (n x elem)

behind the envelope of ``kv_chunk`` whose descriptor is the blob's structure
(``llama_kv_layout``), so the context restores a chunk straight from the buffer it was read
into (``blobs``; ``_kv_state.unpack_chunks``), with no join copy. Chunks of the first format
(no flag: the metadata and sections' cells without any header) are still read, by ``join``.
Cells come out in position order whatever their order in the blob, and the sequence id is
dropped, so a chunk depends only on the KV it holds.

A blob of a two-part memory (``with_rest``: an iSWA model's full-attention cache then its
window, a hybrid's attention cache then its recurrent state) is cut in its first cache only;
``rest`` returns what follows it, which a row keeps whole, and ``join(chunks) ‖ rest`` is the
blob again. That first cache has fewer layers than the model (an iSWA model's full-attention
layers only, none at all when every layer slides: cells and no section), a count llama.cpp
does not publish: the codec then accepts any count up to the
model's, and llama.cpp's own check refuses another at restore (``StateRestoreError``).

An iSWA window (``rest_cells``) is itself a KV cache of the last positions' cells in the other
layers, and is cut the same way (``split_rest``): chunks flagged ``kv_chunk.FLAG_REST`` whose
body is the range's canonical metadata and every section's cells (no blob head: a window
restores only beside its first cache). ``join_rest`` writes the rest again from such chunks,
the first of which may start before the window (a wider chunk another row stored): cells
before ``first`` are skipped, so ``join(split(blob)) ‖ join_rest(split_rest(blob), first)`` is
the blob, its window's cells in position order.

Invariants: ``split`` copies each byte it emits once (a slice copy, or a gather when the cells
were out of order); ``join`` writes each byte once into one uninitialised ``bytearray``, or into the
caller's ``out`` buffer (the engine's reused, already-faulted one); both
check the layout against the context's cell types and layer count, and ``join`` and ``blobs``
check every chunk's envelope, place in the sequence, metadata and (in-place chunks) every
header llama.cpp will read before a byte is copied, so nothing malformed reaches
``llama_state_seq_set_data``. The cells a join writes are therefore always canonical
(``canonical_meta``: sequence 0, positions in order from 0, a window's from ``first``), and
its headers those of the chunks' checked descriptor: ``LlamaContext.kv_unpack_joined`` relies
on this and checks of such a blob only its positions against ``n_ctx``
(``kv_layout.check_joined``).
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias, cast, overload

import numpy as np
import numpy.typing as npt

from kvwarm.backends import kv_chunk
from kvwarm.backends.base import Buffer, WritableBuffer
from kvwarm.backends.llama.kv_layout import (
    CACHE_HEAD,
    CELL,
    HEAD,
    IO_MAGIC,
    BlobLayout,
    Structure,
    canonical_meta,
    parse_blob,
    parse_descriptor,
    parse_second_cache,
)
from kvwarm.backends.llama.native import GGML_TYPES
from kvwarm.buffers import U8, Held, Staging, fresh_bytes, held_of, join_target, staging_of, u8
from kvwarm.errors import KvwarmError, StateRestoreError

_TYPE_NAMES = {code: name for name, code in GGML_TYPES.items()}
_SECTION_HEAD = 12


def _type_name(code: int) -> str:
    return _TYPE_NAMES.get(code, f"ggml type {code}")


class LlamaKvCodec:
    """``KvCodec`` for one context's blobs: its cell types, the model's layer count and, when
    flash attention was set explicitly, whether V is transposed.

    With ``flash_attn="auto"`` llama.cpp decides per device and does not say what it chose,
    so ``v_trans`` is None and a chunk of the other orientation is refused by llama.cpp's own
    check at ``kv_unpack`` (a ``StateRestoreError`` too). Row sizes are checked there as well.
    """

    __slots__ = (
        "_fits",
        "_n_layer",
        "_rest_cells",
        "_type_k",
        "_type_v",
        "_v_trans",
        "_with_rest",
    )

    def __init__(
        self,
        *,
        type_k: int,
        type_v: int,
        n_layer: int,
        v_trans: bool | None,
        with_rest: bool = False,
        rest_cells: bool = False,
    ) -> None:
        self._type_k = type_k
        self._type_v = type_v
        self._n_layer = n_layer
        self._v_trans = v_trans
        self._with_rest = with_rest or rest_cells
        # The rest is a KV cache of cells (an iSWA window), not a recurrent state: its bytes
        # are parsed only then, since a recurrent state may happen to parse as one.
        self._rest_cells = rest_cells
        # Structures ``_check`` passed (it depends on nothing else), so a restore's chunks,
        # which share one or two, are not walked section by section on every restore.
        self._fits: set[Structure] = set()

    def split(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        data = u8(blob)
        layout = self._first_cache(data)
        cuts = kv_chunk.check_bounds(bounds, layout.n_cells, layout.first)
        if layout.n_cells == 0:
            return []
        self._check(layout.structure, "KV blob")
        sources = _sections(data, layout.structure, layout.n_cells)
        return [self._cut(layout, sources, a, b) for a, b in itertools.pairwise(cuts)]

    def rest(self, blob: Buffer) -> memoryview:
        if not self._with_rest:
            raise StateRestoreError("this context's KV blobs are one cache: they have no rest")
        data = u8(blob)
        return data[self._first_cache(data).end :].data

    def rest_span(self, blob: Buffer) -> tuple[int, int]:
        data = u8(blob)
        _, window = self._two_caches(data)
        return window.first, window.first + window.n_cells

    def split_rest(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        data = u8(blob)
        first, window = self._two_caches(data)
        cuts = kv_chunk.check_bounds(bounds, window.n_cells, window.first)
        sources = _sections(data[first.end :], window.structure, window.n_cells, CACHE_HEAD)
        return [self._cut(window, sources, a, b, rest=True) for a, b in itertools.pairwise(cuts)]

    def rest_size(self, chunks: Sequence[Buffer], first: int) -> int:
        _, _, structure, end = self._checked_rest(chunks, first)
        return structure.blob_size(end - first, CACHE_HEAD)

    def join_apart(
        self, chunks: Sequence[Buffer], rest_chunks: Sequence[Buffer], first: int
    ) -> WindowJoin:
        """A window row (``chunks`` of its first cache, ``rest_chunks`` of its window from
        position ``first``), every chunk checked as ``join`` and ``join_rest`` check them,
        to be joined one cache at a time (``WindowJoin``)."""
        if not self._rest_cells:
            raise StateRestoreError("this context's KV blobs have no window cache to join")
        main = self._checked(chunks)
        if main is None:
            raise StateRestoreError("a window row needs at least one chunk of its first cache")
        return WindowJoin(main, self._checked_rest(rest_chunks, first), first)

    @overload
    def join_rest(self, chunks: Sequence[Buffer], first: int, out: None = None) -> bytearray: ...
    @overload
    def join_rest(
        self, chunks: Sequence[Buffer], first: int, out: WritableBuffer
    ) -> memoryview: ...
    def join_rest(
        self, chunks: Sequence[Buffer], first: int, out: WritableBuffer | None = None
    ) -> bytearray | memoryview:
        return self._join_rest(self._checked_rest(chunks, first), first, out)

    def _join_rest(
        self, checked: _Checked, first: int, out: WritableBuffer | None
    ) -> bytearray | memoryview:
        plan = _plan_rest(checked, first)
        dst, result = join_target(plan.size, out)
        pairs = _stage(dst, checked, plan, staging_of(out))
        _write_rest_head(dst, plan, first)
        _copy_all(pairs)
        return result

    def _two_caches(self, data: U8) -> tuple[BlobLayout, BlobLayout]:
        """A window's blob: its first cache (positions from 0) and its window, which ends
        where the first cache does."""
        if not self._rest_cells:
            raise StateRestoreError("this context's KV blobs have no window cache to cut")
        first = self._first_cache(data)
        window = parse_second_cache(data, first.end)
        if window.first + window.n_cells != first.n_cells:
            raise StateRestoreError(
                f"the blob's window holds positions [{window.first}, "
                f"{window.first + window.n_cells}); its first cache ends at {first.n_cells}"
            )
        self._check(window.structure, "KV blob window")
        return first, window

    def _checked_rest(self, chunks: Sequence[Buffer], first: int) -> _Checked:
        """Rest chunks' views, their memos (``_Known``: held chunks only), layout and end
        position, every one checked: they tile positions in order from the first one's start,
        which holds ``first``."""
        views, known, todo = _parse_all(chunks)
        if not views:
            raise StateRestoreError("a window needs at least one chunk")
        if any(view.flags != kv_chunk.FLAG_REST for view in views):
            raise StateRestoreError("a window's chunks must all be window chunks")
        if not views[0].start <= first < views[0].end:
            raise StateRestoreError(
                f"the window starts at {first}, outside its first chunk "
                f"[{views[0].start}, {views[0].end})"
            )
        end = kv_chunk.check_sequence(views, views[0].start)
        structure = parse_descriptor(views[0].descriptor)
        self._check(structure, "KV window chunk")
        _check_bodies(views, known, todo, structure)
        return views, known, structure, end

    def _first_cache(self, data: U8) -> BlobLayout:
        """The blob's layout (a two-part blob's first cache, which must hold positions from 0:
        its rest is the state at the blob's end, nowhere else)."""
        if not self._with_rest:
            return parse_blob(data, tail=True)
        layout = parse_blob(data, rest=True)
        if layout.end >= data.size:
            raise StateRestoreError("KV blob has no state after its first KV cache")
        return layout

    @overload
    def join(self, chunks: Sequence[Buffer], out: None = None) -> bytearray: ...
    @overload
    def join(self, chunks: Sequence[Buffer], out: WritableBuffer) -> memoryview: ...
    def join(
        self, chunks: Sequence[Buffer], out: WritableBuffer | None = None
    ) -> bytearray | memoryview:
        return self._join(self._checked(chunks), out)

    def _join(self, checked: _Checked | None, out: WritableBuffer | None) -> bytearray | memoryview:
        if checked is None:
            dst, result = join_target(HEAD.size, out)
            HEAD.pack_into(dst.data, 0, IO_MAGIC, 0, 1, 0)
            return result
        plan = _plan_main(checked)
        dst, result = join_target(plan.size, out)
        pairs = _stage(dst, checked, plan, staging_of(out))
        dst[plan.header_at] = plan.headers
        _copy_all(pairs)
        return result

    def blobs(self, chunks: Sequence[Buffer], start: int = 0) -> list[U8] | None:
        """Each chunk's body, a blob ``llama_state_seq_set_data`` restores as it is, after the
        checks of ``join`` (the chunks tile positions from ``start``: 0, or where a tail
        restore's live prefix ends); None when a chunk is of the first format (join those
        instead)."""
        checked = self._checked(chunks, start)
        if checked is None:
            return []
        views = checked[0]
        if any(not view.flags & kv_chunk.FLAG_BLOB for view in views):
            return None
        return [view.body for view in views]

    def joined_size(self, chunks: Sequence[Buffer]) -> int:
        checked = self._checked(chunks)
        return HEAD.size if checked is None else checked[2].blob_size(checked[3])

    def _checked(self, chunks: Sequence[Buffer], start: int = 0) -> _Checked | None:
        """The chunks' views, their memos (``_Known``: held chunks only), layout and end
        position, every one checked; None for no chunks."""
        views, known, todo = _parse_all(chunks)
        if not views:
            return None
        if any(view.flags & kv_chunk.FLAG_REST for view in views):
            raise StateRestoreError("a window chunk is not a chunk of the first KV cache")
        n_cells = kv_chunk.check_sequence(views, start)
        structure = parse_descriptor(views[0].descriptor)
        self._check(structure, "KV chunk")
        _check_bodies(views, known, todo, structure)
        return views, known, structure, n_cells

    def chunk_range(self, chunk: Buffer) -> tuple[int, int]:
        view = kv_chunk.parse(u8(chunk, "KV chunk"), kv_chunk.CODEC_LLAMA)
        structure = parse_descriptor(view.descriptor)
        self._check(structure, "KV chunk")
        _check_body(view, structure, 0)
        return view.start, view.n_cells

    def _check(self, structure: Structure, what: str) -> None:
        """Refuse a layout this context cannot restore (another cell type or model shape)."""
        if structure in self._fits:
            return
        if structure.n_layer > self._n_layer or (
            structure.n_layer != self._n_layer and not self._with_rest
        ):
            raise StateRestoreError(
                f"{what} has {structure.n_layer} layers; this model has {self._n_layer}"
            )
        if self._v_trans is not None and structure.v_trans != self._v_trans:
            raise StateRestoreError(
                f"{what} stores V {'transposed' if structure.v_trans else 'by cell'}; this "
                f"context's flash attention setting stores it the other way"
            )
        n = structure.n_layer
        for i, section in enumerate(structure.sections):
            want = self._type_k if i < n else self._type_v
            if section.ggml_type != want:
                kind = "K" if i < n else "V"
                raise StateRestoreError(
                    f"{what} holds {_type_name(section.ggml_type)} {kind} cells; this context "
                    f"uses {_type_name(want)}"
                )
        if len(self._fits) >= _FITS_MAX:
            self._fits.clear()
        self._fits.add(structure)

    @staticmethod
    def _cut(layout: BlobLayout, sources: list[U8], a: int, b: int, *, rest: bool = False) -> bytes:
        """The chunk of positions ``[a, b)``; cells ``[a - first, b - first)`` of the blob
        (with ``rest``, of its window: a ``FLAG_REST`` chunk with no blob head)."""
        n = b - a
        lo, hi = a - layout.first, b - layout.first
        structure = layout.structure
        body_len = n * structure.cell_bytes if rest else structure.blob_size(n)
        out, view = fresh_bytes(kv_chunk.header_size(layout.descriptor) + body_len)
        at = kv_chunk.write_header(
            view,
            codec=kv_chunk.CODEC_LLAMA,
            start=a,
            n_cells=n,
            descriptor=layout.descriptor,
            body_len=body_len,
            flags=kv_chunk.FLAG_REST if rest else kv_chunk.FLAG_BLOB,
        )
        body = view[at:]
        meta_at = 0 if rest else HEAD.size
        if not rest:
            where, skeleton = _skeleton_bytes(layout.descriptor, n)
            body[where] = skeleton
        meta = body[meta_at : meta_at + n * CELL].view("<i4").reshape(n, 3)
        meta[:, 0] = np.arange(a, b, dtype=np.int32)
        meta[:, 1] = 1
        meta[:, 2] = 0
        cells = None if layout.order is None else layout.order[lo:hi]
        if rest:
            targets = [
                body[o : o + n * s.cell_bytes].reshape(s.groups, n, s.unit)
                for s, o in zip(structure.sections, _cell_offsets(structure, n), strict=True)
            ]
        else:
            targets = _sections(body, structure, n)
        for source, dst in zip(sources, targets, strict=True):
            if cells is None:
                dst[...] = source[:, lo:hi, :]
            else:
                # mode="clip" writes straight into ``out`` (numpy buffers mode="raise");
                # ``cells`` is a permutation of valid indices, checked by parse_blob.
                np.take(source, cells, axis=1, out=dst, mode="clip")
        return out


class WindowJoin:
    """A window row's two caches, checked (``LlamaKvCodec.join_apart``), each to be written as
    a blob llama.cpp restores alone: the first is the blob head and the first cache followed
    by an empty window cache (``u32 n_stream = 1, u32 n_cells = 0``), which
    ``llama_state_seq_set_data`` restores leaving the window alone; the second is the blob
    head and the window cache, which ``llama_state_seq_set_data_ext`` restores with
    ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` leaving the first cache alone. Restored one after
    the other they are the joined row's state. ``stage`` makes every view both joins copy
    through before a byte is written (``StagedWindow``); each blob is then written into the
    caller's buffer just before its restore, so the bytes of one cache are joined and read
    back while they are still in the CPU's cache (the whole row at once is the chunks, the
    blob and the KV tensors of both caches: 31 MiB for a 1,000-token Gemma 3 270M row, as
    much as the L3 cache of the CPU it was measured on; docs/internals.md, "Each cache
    restored apart"), and no Python runs between a copy and its restore but the few
    writes of the blob's head. ``first_end`` and ``window_end``: the position after each
    cache's last cell; ``size``: the bytes the larger of the two blobs needs (the buffer
    both are written into), the first with the empty cache it ends with."""

    __slots__ = ("_first", "_main", "_main_plan", "_rest", "_rest_plan", "first_end", "size",
                 "window_end")  # fmt: skip

    def __init__(self, main: _Checked, rest: _Checked, first: int) -> None:
        self._main = main
        self._rest = rest
        self._first = first
        self._main_plan = _plan_main(main)
        self._rest_plan = _plan_rest(rest, first)
        self.first_end = main[3]
        self.window_end = rest[3]
        self.size = max(
            self._main_plan.size + _EMPTY_CACHE.size, _HEAD_PREFIX.size + self._rest_plan.size
        )

    def stage(self, out: WritableBuffer) -> StagedWindow:
        """Every copy of both joins into ``out`` (``size`` bytes at least: else
        ``JoinBufferTooSmallError``), as views; nothing is written yet."""
        dst, _ = join_target(self.size, out)
        staging = staging_of(out)
        at = _HEAD_PREFIX.size  # the window's cache, after its blob head
        return StagedWindow(
            self,
            dst,
            _stage(dst, self._main, self._main_plan, staging),
            _stage(dst[at:], self._rest, self._rest_plan, staging, at),
        )


class StagedWindow:
    """A ``WindowJoin`` staged into a buffer: ``first()`` writes the first cache's blob with
    an empty window cache, ``window()`` then the window's blob (the blob head, then the
    window cache) over it; each returns its blob's length from the buffer's start."""

    __slots__ = ("_dst", "_first_pairs", "_row", "_window_pairs")

    def __init__(
        self,
        row: WindowJoin,
        dst: U8,
        first_pairs: list[tuple[U8, U8]],
        window_pairs: list[tuple[U8, U8]],
    ) -> None:
        self._row = row
        self._dst = dst
        self._first_pairs = first_pairs
        self._window_pairs = window_pairs

    @property
    def address(self) -> int:
        """The buffer's address (both blobs start there)."""
        return int(self._dst.ctypes.data)

    def first(self) -> int:
        dst, plan = self._dst, self._row._main_plan
        dst[plan.header_at] = plan.headers
        _EMPTY_CACHE.pack_into(dst.data, plan.size, 1, 0)
        _copy_all(self._first_pairs)
        return plan.size + _EMPTY_CACHE.size

    def window(self) -> int:
        dst, row = self._dst, self._row
        plan = row._rest_plan
        _HEAD_PREFIX.pack_into(dst.data, 0, IO_MAGIC, 0)
        _write_rest_head(dst[_HEAD_PREFIX.size :], plan, row._first)
        _copy_all(self._window_pairs)
        return _HEAD_PREFIX.size + plan.size


#: The most structures a codec remembers as checked (a context's chunks have one or two).
_FITS_MAX = 16

#: A blob's head before its first cache: llama.cpp's magic and the sequence id it was read
#: from (``HEAD`` without the cache's own ``n_stream, n_cells``).
_HEAD_PREFIX = struct.Struct("<Ii")
#: A KV cache of one stream holding no cells.
_EMPTY_CACHE = struct.Struct("<II")


def _sections(data: U8, structure: Structure, n_cells: int, head: int = HEAD.size) -> list[U8]:
    """Each section of a blob of ``n_cells`` cells as a ``(groups, n_cells, unit)`` view
    (``head``: the bytes before its metadata; ``CACHE_HEAD`` for a window's cache)."""
    views = []
    for section, at in zip(structure.sections, structure.offsets(n_cells, head), strict=True):
        size = n_cells * section.cell_bytes
        views.append(data[at : at + size].reshape(section.groups, n_cells, section.unit))
    return views


#: Where a body's cells lie: a blob (``HEAD``, then metadata and sections with headers), a
#: window cache in a joined blob (``CACHE_HEAD``, likewise), or a headless chunk body
#: (metadata, then every section's cells: a window chunk or a chunk of the first format).
_BLOB, _CACHE, _CELLS = 0, 1, 2


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive sections of one shape in a body of ``n`` cells: ``count`` sections of
    ``groups`` rows of ``n`` cells of ``unit`` bytes, the first at ``offset``, each ``step``
    bytes after the one before."""

    offset: int
    step: int
    count: int
    groups: int
    unit: int


@dataclass(frozen=True, slots=True)
class _Geometry:
    """Where a body of ``n_cells`` cells of one structure holds its metadata and its runs."""

    n_cells: int
    meta_at: int
    runs: tuple[_Run, ...]
    size: int


def _body_kind(flags: int) -> int:
    """Where a chunk body with ``flags`` holds its cells: ``_BLOB`` or ``_CELLS``."""
    return _BLOB if flags & kv_chunk.FLAG_BLOB else _CELLS


@functools.lru_cache(maxsize=256)
def _geometry(structure: Structure, n_cells: int, kind: int) -> _Geometry:
    """A body's runs of consecutive sections of one shape (type, groups, unit), computed once
    per structure, cell count and kind (every chunk of a grid has one of a few counts).
    Within a run the sections lie at one spacing, each holding ``n_cells`` cells; this is
    checked, so runs never overlap."""
    if kind == _CELLS:
        meta_at, offsets = 0, _cell_offsets(structure, n_cells)
        size = n_cells * structure.cell_bytes
    else:
        head = HEAD.size if kind == _BLOB else CACHE_HEAD
        meta_at, offsets = head, structure.offsets(n_cells, head)
        size = structure.blob_size(n_cells, head)
    sections = structure.sections
    runs: list[_Run] = []
    i = 0
    while i < len(sections):
        j = i + 1
        while j < len(sections) and sections[j] == sections[i]:
            j += 1
        first = sections[i]
        span = first.groups * n_cells * first.unit
        step = offsets[i + 1] - offsets[i] if j - i > 1 else span
        if step < span or any(offsets[k + 1] - offsets[k] != step for k in range(i, j - 1)):
            raise StateRestoreError("KV sections of one shape overlap or are unevenly spaced")
        if offsets[j - 1] + span > size:
            raise StateRestoreError(f"KV sections run past their {size} bytes")
        runs.append(_Run(offsets[i], step, j - i, first.groups, first.unit))
        i = j
    return _Geometry(n_cells, meta_at, tuple(runs), size)


@functools.lru_cache(maxsize=512)
def _item(size: int) -> np.dtype[np.void]:
    """The numpy type of one opaque item of ``size`` bytes (made once per size)."""
    return np.dtype((np.void, size))


@dataclass(frozen=True, slots=True)
class _Copy:
    """One run of a chunk copied into a joined blob or window: ``shape`` items of type
    ``item``, at ``into`` with ``into_strides`` in the target and at ``source`` with
    ``source_strides`` in the chunk's body."""

    shape: tuple[int, int]
    item: np.dtype[np.void]
    into: int
    into_strides: tuple[int, int]
    source: int
    source_strides: tuple[int, int]


def _copies(target: _Geometry, at: int, source: _Geometry, skip: int, n: int) -> tuple[_Copy, ...]:
    """How cells ``[skip, skip + n)`` of every section of a ``source`` body go to cells
    ``[at, at + n)`` of the same section of a ``target`` body: one copy a run. Each section
    row's ``n`` cells are contiguous on both sides, so they are viewed as one item of
    ``n * unit`` bytes: numpy then copies a row with one ``memcpy`` from its C loop over the
    run's rows (a 64-cell chunk of a window of transposed V is 3,840 rows of 128 bytes),
    instead of iterating every row through its general iterator. The source side depends
    only on the source geometry, ``skip`` and ``n`` (``_Known`` keeps a held chunk's)."""
    if not 0 <= skip <= skip + n <= source.n_cells or not 0 <= at <= at + n <= target.n_cells:
        raise StateRestoreError(f"KV cells [{skip}, {skip + n}) do not fit their bodies")
    if n == 0:
        return ()
    return tuple(
        _Copy(
            (s.count, s.groups),
            _item(n * s.unit),
            t.offset + at * t.unit,
            (t.step, target.n_cells * t.unit),
            s.offset + skip * s.unit,
            (s.step, source.n_cells * s.unit),
        )
        for t, s in zip(target.runs, source.runs, strict=True)
    )


class _Known:
    """A held chunk's memo (``buffers.Held``), made when its first join checked it: its
    envelope's view, its body a view of ``Held.plain`` (a memo must not reference the
    ``Held``), and ``made``: the source views of its whole body's copies (``_copies`` with
    ``skip`` 0) with the geometry they were made for, so a later join makes only the target
    views. ``made`` is replaced whole, never changed in place: workers may join one held chunk
    at once (their views are equal anyway: one chunk has one geometry)."""

    __slots__ = ("made", "view")

    def __init__(self, view: kv_chunk.ChunkView) -> None:
        self.view = view
        self.made: tuple[_Geometry, tuple[U8, ...]] | None = None


#: Chunks' views, their memos (``_Known``: held chunks only), their layout and the position
#: after their last cell, every one checked (``LlamaKvCodec._checked``, ``_checked_rest``).
_Checked: TypeAlias = tuple[list[kv_chunk.ChunkView], list[_Known | None], Structure, int]


def _chunk_sources(
    body: U8, copies: Sequence[_Copy], known: _Known | None, whole: _Geometry | None
) -> tuple[U8, ...]:
    """The source views of ``copies`` in ``body``, each bounds-checked by numpy against it.
    ``whole``: the body's geometry when the copies take all its cells (``skip`` 0), whose
    source views a held chunk (``known``) keeps."""
    if known is not None and whole is not None:
        made = known.made
        if made is None or made[0] is not whole:
            made = known.made = (whole, _sources(known.view.body, copies))
        return made[1]
    return _sources(body, copies)


def _targets(buffer: U8, at: int, copies: Sequence[tuple[_Copy, ...]]) -> list[U8]:
    """The target views of every chunk's ``copies`` in ``buffer``, the join starting ``at``
    bytes into it, each bounds-checked by numpy against it."""
    return [
        np.ndarray(c.shape, c.item, buffer=buffer, offset=at + c.into, strides=c.into_strides)
        for chunk_copies in copies
        for c in chunk_copies
    ]


def _sources(body: U8, copies: Sequence[_Copy]) -> tuple[U8, ...]:
    return tuple(
        np.ndarray(c.shape, c.item, buffer=body, offset=c.source, strides=c.source_strides)
        for c in copies
    )


def _copy_all(pairs: Sequence[tuple[U8, U8]]) -> None:
    """Make every (target, source) copy of a join; one that fails (none should: views of
    one shape and type) is a ``StateRestoreError``, so the restore is a miss."""
    try:
        for into, frm in pairs:
            into[...] = frm
    except KvwarmError:
        raise
    except Exception as exc:
        raise StateRestoreError(f"copying KV cells failed: {exc!r}") from exc


def _stage(
    dst: U8,
    checked: _Checked,
    plan: _MainPlan | _RestPlan,
    staging: Staging | None = None,
    at: int = 0,
) -> list[tuple[U8, U8]]:
    """Every copy of ``plan``'s join of ``checked`` into ``dst`` as (target, source) views.
    With ``staging`` (the reused buffer ``dst`` lies ``at`` bytes into), the targets are made
    once per plan and kept in its memo: they depend on nothing else, and making them was
    most of a restore's Python (a 13-chunk Gemma 3 270M window row: 31 views)."""
    if staging is None:
        targets = _targets(dst, 0, plan.copies)
    else:
        key = (_TARGETS, id(plan), at)
        # The entry keeps its plan, so no other plan can have the id while it is there.
        entry = cast("tuple[object, list[U8]] | None", staging.memo.get(key))
        if entry is None:
            # The oldest goes: a chat's row grows each turn, a new plan a turn.
            if len(staging.memo) >= _STAGED_PLANS:
                del staging.memo[next(iter(staging.memo))]
            entry = (plan, _targets(staging.plain, at, plan.copies))
            staging.memo[key] = entry
        targets = entry[1]
    views, known, _, _ = checked
    sources: list[U8] = []
    for view, memo, copies, whole in zip(views, known, plan.copies, plan.wholes, strict=True):
        sources.extend(_chunk_sources(view.body, copies, memo, whole))
    if len(targets) != len(sources):  # none should differ: one plan made both
        raise StateRestoreError(
            f"a join has {len(sources)} copies' sources, {len(targets)} targets"
        )
    return list(zip(targets, sources, strict=True))


#: A ``Staging`` memo's key for a plan's targets, and the most plans one keeps (a worker's
#: rows join a few plans: one per row geometry).
_TARGETS = "llama-kv-targets"
_STAGED_PLANS = 64


def _spans(checked: _Checked, first: int = 0) -> tuple[tuple[int, int, int], ...]:
    """Each checked chunk's start (relative to ``first``), cell count and flags."""
    return tuple((view.start - first, view.n_cells, view.flags) for view in checked[0])


def _plan_main(checked: _Checked) -> _MainPlan:
    views, _, structure, _ = checked
    return _main_plan(views[0].descriptor, structure, _spans(checked))


def _plan_rest(checked: _Checked, first: int) -> _RestPlan:
    # Spans relative to the window: rows whose ends lie alike on the chunk grid share one.
    views, _, structure, _ = checked
    return _rest_plan(views[0].descriptor, structure, _spans(checked, first))


def _write_rest_head(dst: U8, plan: _RestPlan, first: int) -> None:
    """A joined window's head, metadata (positions from ``first``) and section headers."""
    dst[: plan.head.size] = plan.head
    positions = dst[CACHE_HEAD : CACHE_HEAD + plan.n_cells * CELL].view("<i4")[::3]
    np.add(positions, first, out=positions)  # the head holds positions from 0
    dst[plan.header_at] = plan.headers


@dataclass(frozen=True, slots=True)
class _MainPlan:
    """How ``join`` writes a blob from chunks of one geometry: its size, where its head and
    section headers go and their bytes, and each chunk's copies (its metadata first: the
    chunks' metadata, checked canonical, is the blob's) with its geometry."""

    size: int
    header_at: npt.NDArray[np.intp]
    headers: U8
    copies: tuple[tuple[_Copy, ...], ...]
    wholes: tuple[_Geometry, ...]


@functools.lru_cache(maxsize=256)
def _main_plan(
    descriptor: bytes, structure: Structure, spans: tuple[tuple[int, int, int], ...]
) -> _MainPlan:
    """The plan of a blob joined from chunks of ``spans`` (each chunk's start, cell count and
    flags, already checked to tile positions from 0: ``_checked``), computed once per row
    length (chunks lie on a grid), so a row restored again builds only its numpy views, or
    none when joined into a ``Staging`` (``_stage``). The metadata is copied from the
    chunks, not kept here: a plan's size does not grow with its row's."""
    n_cells = spans[-1][0] + spans[-1][1]
    target = _geometry(structure, n_cells, _BLOB)
    header_at, headers = _skeleton_bytes(descriptor, n_cells)
    copies, wholes = [], []
    for start, cells, flags in spans:
        source = _geometry(structure, cells, _body_kind(flags))
        meta = _Copy(
            (1, 1),
            _item(cells * CELL),
            HEAD.size + start * CELL,
            (0, 0),
            source.meta_at,
            (0, 0),
        )
        copies.append((meta, *_copies(target, start, source, 0, cells)))
        wholes.append(source)
    return _MainPlan(target.size, header_at, headers, tuple(copies), tuple(wholes))


def _scatter(pieces: Sequence[tuple[int, bytes]]) -> tuple[npt.NDArray[np.intp], U8]:
    """(offset, bytes) pieces as the indices and bytes of one read-only scatter."""
    where = np.concatenate([np.arange(at, at + len(piece)) for at, piece in pieces])
    where.flags.writeable = False
    return where, _frozen(b"".join(piece for _, piece in pieces))


@dataclass(frozen=True, slots=True)
class _RestPlan:
    """How ``join_rest`` writes a window of ``n_cells`` cells from chunks of one geometry:
    its size, the bytes before its first section (cache head, the cells' canonical metadata
    with positions from 0, v_trans and layer count), where the section headers go and their
    bytes, and each chunk's copies and geometry."""

    n_cells: int
    size: int
    head: U8
    header_at: npt.NDArray[np.intp]
    headers: U8
    copies: tuple[tuple[_Copy, ...], ...]
    #: Each chunk's geometry where its copies take all its cells (``_pairs``'s ``whole``);
    #: None for a wider first chunk.
    wholes: tuple[_Geometry | None, ...]


@functools.lru_cache(maxsize=256)
def _rest_plan(
    descriptor: bytes, structure: Structure, spans: tuple[tuple[int, int, int], ...]
) -> _RestPlan:
    """The plan of a window joined from chunks of ``spans`` (each chunk's start relative to
    the window's first position, cell count and flags, already checked to tile the
    positions: ``_checked_rest``). Computed once per geometry, which does not depend on
    where the window starts: a window is ``n_swa`` cells once a prompt is longer, and
    chunks lie on a grid, so every row whose end falls at the same place in a grid step
    joins the same plan, and a restore builds only its numpy views. The metadata is
    written in its canonical form, which ``_check_body`` found in every chunk."""
    n_cells = spans[-1][0] + spans[-1][1]
    target = _geometry(structure, n_cells, _CACHE)
    pieces = _skeleton(descriptor, structure, n_cells, CACHE_HEAD)
    head = pieces[0][1] + canonical_meta(0, n_cells) + pieces[1][1]
    header_at, headers = _scatter(pieces[2:])
    copies, wholes = [], []
    for start, cells, flags in spans:
        skip = max(0, -start)  # cells of a wider chunk before the window
        a, n = start + skip, cells - skip  # where in the window, how many
        source = _geometry(structure, cells, _body_kind(flags))
        copies.append(_copies(target, a, source, skip, n))
        wholes.append(None if skip else source)
    return _RestPlan(
        n_cells,
        target.size,
        _frozen(head),
        header_at,
        headers,
        tuple(copies),
        tuple(wholes),
    )


def _frozen(data: bytes) -> U8:
    view = np.frombuffer(data, dtype=np.uint8)
    view.flags.writeable = False
    return view


def _cell_offsets(structure: Structure, n: int) -> list[int]:
    """Where each section's cells start in a headless body: ``n`` cells' metadata, then
    every section's cells (a chunk of the first format, or of a window)."""
    offsets, at = [], n * CELL
    for section in structure.sections:
        offsets.append(at)
        at += n * section.cell_bytes
    return offsets


#: The key of this codec's entry in a held chunk's memo (``buffers.Held``).
_MEMO = "llama-kv-chunk"


def _parse_all(
    chunks: Sequence[Buffer],
) -> tuple[list[kv_chunk.ChunkView], list[_Known | None], list[tuple[int, Held | None]]]:
    """Each chunk's envelope, parsed and checked (``kv_chunk.parse``), each held chunk's
    memo (``_Known``; None for the others) and the chunks whose bodies are still to check
    (``_check_bodies``), each with the ``Held`` it views when it is one (the ``ram`` tier's).
    A held chunk whose memo says it passed both checks before is not checked again: its
    bytes cannot have changed, so the memo's view of them is used as it is."""
    views: list[kv_chunk.ChunkView] = []
    known: list[_Known | None] = []
    todo: list[tuple[int, Held | None]] = []
    for i, chunk in enumerate(chunks):
        held = held_of(chunk)
        memo = None if held is None else held.memo.get(_MEMO)
        if isinstance(memo, _Known):
            views.append(memo.view)
            known.append(memo)
        else:
            views.append(kv_chunk.parse(u8(chunk, "KV chunk"), kv_chunk.CODEC_LLAMA))
            known.append(None)
            todo.append((i, held))
    return views, known, todo


def _check_bodies(
    views: list[kv_chunk.ChunkView],
    known: list[_Known | None],
    todo: Sequence[tuple[int, Held | None]],
    structure: Structure,
) -> None:
    """``_check_body`` for each chunk of ``todo``; a held chunk that passes is remembered
    (``_Known``: a view of ``Held.plain``, no reference to the ``Held``), and its view and
    memo in ``views`` and ``known`` become the remembered ones."""
    for i, held in todo:
        view = views[i]
        _check_body(view, structure, i)
        if held is not None:
            body = held.plain[held.nbytes - view.body.size :]
            memo = _Known(
                kv_chunk.ChunkView(view.start, view.n_cells, view.descriptor, body, view.flags)
            )
            held.memo[_MEMO] = memo
            views[i], known[i] = memo.view, memo


def _check_body(view: kv_chunk.ChunkView, structure: Structure, i: int) -> None:
    """The body is as long as its cells need, with canonical metadata for its positions; an
    in-place chunk's blob head and section headers are exactly what its descriptor says."""
    n = view.n_cells
    blob = bool(view.flags & kv_chunk.FLAG_BLOB)
    need = structure.blob_size(n) if blob else n * structure.cell_bytes
    if view.body.size != need:
        raise StateRestoreError(
            f"KV chunk {i} body is {view.body.size} bytes; {n} cells need {need}"
        )
    meta_at = HEAD.size if blob else 0
    if view.body[meta_at : meta_at + n * CELL].tobytes() != canonical_meta(view.start, n):
        raise StateRestoreError(f"KV chunk {i} has corrupt cell metadata")
    if blob:
        where, expected = _skeleton_bytes(view.descriptor, n)
        if not np.array_equal(view.body[where], expected):
            raise StateRestoreError(f"KV chunk {i} has a corrupt blob header")


def _skeleton(
    descriptor: bytes, structure: Structure, n_cells: int, head: int = HEAD.size
) -> list[tuple[int, bytes]]:
    """A blob of ``n_cells`` cells' head and section headers, as (offset, bytes) pieces
    (with ``head`` ``CACHE_HEAD``: a window cache's, ``u32 n_stream = 1, u32 n_cells``)."""
    first = (
        HEAD.pack(IO_MAGIC, 0, 1, n_cells) if head == HEAD.size else struct.pack("<II", 1, n_cells)
    )
    pieces = [(0, first), (head + n_cells * CELL, descriptor[:8])]
    for i, offset in enumerate(structure.offsets(n_cells, head)):
        head = 8 + i * _SECTION_HEAD
        pieces.append((offset - _SECTION_HEAD, descriptor[head : head + _SECTION_HEAD]))
    return pieces


@functools.lru_cache(maxsize=64)
def _skeleton_bytes(descriptor: bytes, n_cells: int) -> tuple[npt.NDArray[np.intp], U8]:
    """Where a blob of ``n_cells`` cells' head and section headers lie, and their bytes (both
    read-only: shared by every chunk and joined blob of that length): what ``split`` writes
    into a chunk, ``_check_body`` finds in one, and a join plan writes (``_main_plan``)."""
    return _scatter(_skeleton(descriptor, parse_descriptor(descriptor), n_cells))
