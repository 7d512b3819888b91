"""The layout of a llama.cpp sequence-state blob (``llama_state_seq_get_data``), parsed.

The pinned llama.cpp writes, for one sequence of a unified (one-stream) KV cache, all
little-endian (``docs/formats.md``, "KV state layout")::

    u32 io magic 0xAF143CD8, i32 seq id, u32 n_stream (1), u32 n_cells
    n_cells x (i32 pos, u32 n_seq_id (1), i32 seq id)          12 bytes of metadata per cell
    u32 v_trans, u32 n_layer
    n_layer x (i32 type, u64 row bytes, rows: n_cells x row)    K, one row per cell
    v_trans == 0: n_layer x (i32 type, u64 row bytes, rows)     V, one row per cell
    v_trans == 1: n_layer x (i32 type, u32 elem bytes, u32 n_embd,
                             n_embd x (n_cells x elem))         V transposed: one run per element

Cells are written in the order they sit in the KV buffer, which is position order unless
several sequences interleaved their cells; ``order`` then says which cell holds each position.
A model whose cells carry ``llama_kv_cell_ext`` (M-RoPE, PLE) writes 24 bytes of metadata a
cell instead (``CellFormat``): ``check_cells`` and the stream rewrites read those; the rest of
this module (the chunk codec's parsing) reads 12-byte cells only, and refuses such a blob.

Every section is a 3-D view ``(groups, n_cells, unit)``: ``(1, n, row)`` for K and plain V,
``(n_embd, n, elem)`` for transposed V, so a token range is ``[:, a:b, :]`` in both cases.
The *descriptor* is the blob's structure without its cells (v_trans, n_layer and every
section's 12-byte header): it rebuilds the offsets of a blob of any length.

A memory of two parts (``MemoryKind.has_rest``) writes a second part after the first KV
cache: an iSWA model's window cache (``u32 n_stream`` and its cells, as above without the
magic and sequence id), a hybrid model's recurrent state. ``parse_blob(rest=True)`` parses the
first cache and says where it ends; what follows is the blob's *rest*. A window's rest is itself
a KV cache (``parse_second_cache``): cells of the last positions, cut into chunks like the
first cache's. An iSWA model with no full-attention layer writes its first cache all the same,
with its cells and ``n_layer`` 0 (no section): a layer count of 0 is read as any other
(llama.cpp refuses a count that is not its cache's at restore).

Invariant: ``parse_blob`` checks every count and length against the blob's real size before
any offset is computed from it, and refuses a blob it does not fully account for (several
streams, a second cache after the first unless ``rest``, unknown cell metadata) with
``StateRestoreError``.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvwarm.buffers import U8
from kvwarm.errors import StateRestoreError

IO_MAGIC = 0xAF143CD8
HEAD = struct.Struct("<IiII")  # magic, seq id, n_stream, n_cells
CELL = 12  # i32 pos, u32 n_seq_id, i32 seq id
_PAIR = struct.Struct("<II")  # v_trans, n_layer
_ROWS = struct.Struct("<iQ")  # type, row bytes
_TRANS = struct.Struct("<iII")  # type, element bytes, n_embd
_SECTION_HEAD = 12
MAX_LAYERS = 4096
MAX_ROW = 1 << 24

#: ``llama_kv_cell_ext``: i32 x, i32 y (M-RoPE's 2-D position), i32 tok (the cell's token).
CELL_EXT = 12


@dataclass(frozen=True, slots=True)
class CellFormat:
    """What a model's KV cells carry in a blob, and what each may hold.

    llama.cpp writes a cell's ``llama_kv_cell_ext`` between its ``n_seq_id`` and its sequence
    id when the model needs it (``llama_kv_cache::has_cell_ext``: M-RoPE, whose rope types 8
    and 40 keep a 2-D position, or PLE heads, which hash the tokens before each cell), and
    restores it as it is. kvwarm only ever decodes text into such a model (an M-RoPE
    projector is refused), and a text cell's ``x`` and ``y`` are its position under M-RoPE
    (the batch broadcasts it to every rope section), 0 otherwise; its ``tok`` is the token
    decoded there (or, for a PLE model's media span, an id of its vocabulary)."""

    #: The cells carry ``llama_kv_cell_ext``.
    ext: bool = False
    #: M-RoPE: an ext cell's ``x`` and ``y`` are its position (else both 0).
    mrope: bool = False
    #: An ext cell's ``tok`` is below this (0: not checked).
    n_vocab: int = 0

    @property
    def size(self) -> int:
        """Bytes of one cell's metadata."""
        return CELL + (CELL_EXT if self.ext else 0)


#: The 12-byte cells of a model without ``llama_kv_cell_ext`` (the only ones ``parse_blob``
#: and the chunk codec read).
PLAIN = CellFormat()


@dataclass(frozen=True, slots=True)
class Section:
    """One layer's K or V: its ggml type and its cells as ``(groups, n, unit)`` bytes."""

    ggml_type: int
    groups: int
    unit: int

    @property
    def cell_bytes(self) -> int:
        return self.groups * self.unit


@dataclass(frozen=True, slots=True)
class Structure:
    """What a descriptor says: the sections, in blob order (K layers, then V layers)."""

    v_trans: bool
    n_layer: int
    sections: tuple[Section, ...]
    #: Bytes per cell: metadata plus every section's share (derived from ``sections``).
    cell_bytes: int = field(init=False, compare=False)

    #: The hash, computed once: structures key the codec's per-structure caches, and hashing
    #: every section again on each lookup cost more than the lookups saved.
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cell_bytes", CELL + sum(s.cell_bytes for s in self.sections))
        object.__setattr__(self, "_hash", hash((self.v_trans, self.n_layer, self.sections)))

    def __hash__(self) -> int:
        return self._hash

    def offsets(self, n_cells: int, head: int = HEAD.size) -> list[int]:
        """Where each section's cells start in a blob of ``n_cells`` cells (``head``: the
        bytes before its cell metadata: a blob's 16, a second cache's 8)."""
        at = head + n_cells * CELL + _PAIR.size
        out = []
        for section in self.sections:
            at += _SECTION_HEAD
            out.append(at)
            at += n_cells * section.cell_bytes
        return out

    def blob_size(self, n_cells: int, head: int = HEAD.size) -> int:
        return head + _PAIR.size + len(self.sections) * _SECTION_HEAD + n_cells * self.cell_bytes


@dataclass(frozen=True, slots=True)
class BlobLayout:
    """A parsed blob: its structure, descriptor, cell count and position order."""

    structure: Structure
    descriptor: bytes
    n_cells: int
    #: ``order[i]`` is the cell holding position ``first + i``; None when cell ``i`` does.
    order: npt.NDArray[np.intp] | None
    #: The first position the blob holds: 0, or where a tail (``kv_pack_tail``) starts.
    first: int = 0
    #: Where the first KV cache ends: the blob's size, or where its rest starts.
    end: int = 0


@functools.lru_cache(maxsize=32)
def parse_descriptor(descriptor: bytes) -> Structure:
    """The structure a descriptor describes; ``StateRestoreError`` if it is malformed
    (remembered per descriptor: every chunk of a context carries the same one)."""
    if len(descriptor) < _PAIR.size:
        raise StateRestoreError("KV layout descriptor is too short")
    v_trans, n_layer = _PAIR.unpack_from(descriptor, 0)
    if v_trans not in (0, 1) or n_layer > MAX_LAYERS:
        raise StateRestoreError(f"KV layout has v_trans={v_trans}, n_layer={n_layer}")
    if len(descriptor) != _PAIR.size + 2 * n_layer * _SECTION_HEAD:
        raise StateRestoreError(f"KV layout descriptor of {len(descriptor)} bytes is malformed")
    sections = tuple(
        _section(
            descriptor, _PAIR.size + i * _SECTION_HEAD, i, transposed=v_trans == 1 and i >= n_layer
        )
        for i in range(2 * n_layer)
    )
    return Structure(bool(v_trans), n_layer, sections)


def _section(data: bytes | memoryview, at: int, i: int, *, transposed: bool) -> Section:
    """Section ``i``'s 12-byte header at ``data[at:]``, its sizes checked."""
    if transposed:
        ggml_type, unit, groups = _TRANS.unpack_from(data, at)
    else:
        (ggml_type, unit), groups = _ROWS.unpack_from(data, at), 1
    if not (0 < unit <= MAX_ROW and 0 < groups <= MAX_ROW and groups * unit <= MAX_ROW):
        raise StateRestoreError(f"KV layout section {i} has {groups} x {unit} bytes per cell")
    return Section(ggml_type, groups, unit)


def parse_blob(blob: U8, *, tail: bool = False, rest: bool = False) -> BlobLayout:
    """Parse a sequence-state blob; ``StateRestoreError`` unless it is exactly as above: its
    cells hold positions ``0..n-1``, or with ``tail`` any ``first..first+n-1``; with ``rest``
    only its first KV cache is parsed (``end``: where the rest starts)."""
    size = blob.size
    if size < HEAD.size:
        raise StateRestoreError(f"KV blob of {size} bytes is shorter than its header")
    magic, _seq, _n_stream, _n_cells = HEAD.unpack_from(blob.data, 0)
    if magic != IO_MAGIC:
        raise StateRestoreError(f"KV blob magic {magic:#x} is not llama.cpp's {IO_MAGIC:#x}")
    layout = _parse_cache(blob, 8, positions="tail" if tail else "zero", trailing=rest)
    if layout.n_cells == 0 and size != HEAD.size and not rest:
        raise StateRestoreError(f"empty KV blob has {size - HEAD.size} trailing bytes")
    return layout


#: The bytes before a second KV cache's cell metadata: ``u32 n_stream, u32 n_cells``.
CACHE_HEAD = 8


def parse_second_cache(blob: U8, at: int) -> BlobLayout:
    """The KV cache that starts at ``blob[at:]`` (``u32 n_stream``, ``u32 n_cells``, its cells;
    no magic, no sequence id: an iSWA blob's window cache after its first) and must end the
    blob. Its cells hold any consecutive positions ``first..first+n-1`` (a window's); ``end``
    is the blob's size. ``StateRestoreError`` for anything else, or for an empty cache."""
    layout = _parse_cache(blob, at, positions="any", trailing=False)
    if layout.n_cells == 0:
        raise StateRestoreError("the blob's second KV cache holds no cells")
    return layout


def _parse_cache(blob: U8, at: int, *, positions: str, trailing: bool) -> BlobLayout:
    """One KV cache from its ``n_stream`` field at ``blob[at:]``. ``positions``: "zero" (from
    0), "tail" or "any" (any consecutive run); ``trailing``: bytes may follow it."""
    size = blob.size
    raw = blob.data  # a memoryview: what ``struct`` reads
    if at + 8 > size:
        raise StateRestoreError(f"KV blob of {size} bytes ends inside a cache header")
    n_stream, n_cells = struct.unpack_from("<II", raw, at)
    if n_stream != 1:
        raise StateRestoreError(f"KV blob has {n_stream} streams; chunks need a unified cache")
    head = at + 8
    if n_cells == 0:
        return BlobLayout(Structure(False, 0, ()), b"", 0, None, end=head)
    at = head + n_cells * CELL
    if at + _PAIR.size > size:
        raise StateRestoreError(f"KV blob of {size} bytes cannot hold {n_cells} cells")
    first, order = _cell_order(blob[head:at], n_cells)
    if first and positions == "zero":
        raise StateRestoreError(f"KV blob cells are not exactly positions 0..{n_cells - 1}")
    v_trans, n_layer = _PAIR.unpack_from(raw, at)
    if v_trans not in (0, 1) or n_layer > MAX_LAYERS:
        raise StateRestoreError(f"KV blob has v_trans={v_trans}, n_layer={n_layer}")
    heads = [blob[at : at + _PAIR.size].tobytes()]
    at += _PAIR.size
    for i in range(2 * n_layer):
        if at + _SECTION_HEAD > size:
            raise StateRestoreError(f"KV blob ends inside the header of section {i}")
        section = _section(raw, at, i, transposed=v_trans == 1 and i >= n_layer)
        heads.append(blob[at : at + _SECTION_HEAD].tobytes())
        at += _SECTION_HEAD + n_cells * section.cell_bytes
        if at > size:
            raise StateRestoreError(f"KV blob ends inside section {i}")
    if at != size and not trailing:
        raise StateRestoreError(f"KV blob has {size - at} bytes after its last section")
    descriptor = b"".join(heads)
    return BlobLayout(parse_descriptor(descriptor), descriptor, n_cells, order, first, at)


#: The most cells ``_cell_order`` compares with ``_canonical`` (3 MiB of them at most).
_CANONICAL_MAX = 1 << 18
_I32_MAX = (1 << 31) - 1
_ramp: npt.NDArray[np.int32] = np.zeros((0, 3), dtype="<i4")
#: ``_ramp``'s bytes: ``canonical_meta(0, len(_ramp))``, whose slice from ``12 * first`` is the
#: canonical metadata of sequence 0's cells from position ``first`` (replaced with the ramp).
_ramp_bytes = b""


def _canonical(first: int, n: int, seq: int) -> npt.NDArray[np.int32]:
    """The cells of positions ``first..first+n-1`` of sequence ``seq`` (``canonical_meta``'s
    form) as an ``(n, 3)`` table, from one read-only ramp of positions from 0 of sequence 0,
    grown (at least doubled, at most to ``_CANONICAL_MAX``) when a longer one is asked for
    (``first + n - 1`` must fit an i32)."""
    ramp = _grown_ramp(n)
    return ramp[:n] + np.array((first, 0, seq), dtype="<i4") if first or seq else ramp[:n]


def _grown_ramp(n: int) -> npt.NDArray[np.int32]:
    """The ramp, at least ``min(n, _CANONICAL_MAX)`` cells long (grown at least doubled)."""
    global _ramp, _ramp_bytes
    ramp = _ramp
    if len(ramp) < min(n, _CANONICAL_MAX):
        ramp = _cells_from(0, min(max(n, 2 * len(ramp)), _CANONICAL_MAX))
        ramp.flags.writeable = False
        # replaced whole, never changed in place: the bytes first, so a reader that sees
        # the new ramp never pairs it with shorter bytes (either pairing is correct anyway)
        _ramp_bytes = ramp.tobytes()
        _ramp = ramp
    return ramp


@functools.lru_cache(maxsize=256)
def canonical_meta(start: int, n: int) -> bytes:
    """The metadata of cells holding positions ``start..start+n-1`` of sequence 0: the form
    kvwarm writes (chunks, joins) and llama.cpp packs for sequence 0."""
    return _cells_from(start, n).tobytes()


def _cells_from(start: int, n: int) -> npt.NDArray[np.int32]:
    meta = np.zeros((n, 3), dtype="<i4")
    meta[:, 0] = np.arange(start, start + n, dtype=np.int32)
    meta[:, 1] = 1
    return meta


def _canonical_first(table: npt.NDArray[np.int32], cells: CellFormat) -> int | None:
    """The first position of cells (``table``: one row a cell) in the form llama.cpp packs
    one sequence's and kvwarm joins them (``canonical_meta``'s, of any one sequence id:
    positions in order from one at least 0), or None for any other (``_cell_order`` then
    walks them: its checks cost ~12 us a cache, this comparison ~3). Only 12-byte cells,
    and at most ``_CANONICAL_MAX`` of them."""
    n_cells = len(table)
    if cells.ext or not 0 < n_cells <= _CANONICAL_MAX:
        return None
    first, seq = int(table[0, 0]), int(table[0, 2])
    if not 0 <= first <= _I32_MAX - n_cells + 1:
        return None
    if seq == 0 and first + n_cells <= _CANONICAL_MAX:
        # Sequence 0's cells (every chunk's and join's, and llama.cpp's pack of sequence
        # 0) as bytes against the ramp's: one copy and one memcmp, ~1 us for 1,000 cells
        # where the comparison of tables below allocates two tables and reduces one.
        _grown_ramp(first + n_cells)
        at = first * CELL
        return first if _ramp_bytes.startswith(table.tobytes(), at) else None
    want = _canonical(first, n_cells, seq)
    return first if bool((table == want).all()) else None


def _cell_order(
    meta: U8, n_cells: int, cells: CellFormat = PLAIN
) -> tuple[int, npt.NDArray[np.intp] | None]:
    """The first position, and which cell holds each position from it (None: position
    order). Refuses anything but one sequence holding exactly ``first..first+n_cells-1``,
    and ext cells (``cells.ext``) that do not hold what ``CellFormat`` says."""
    table = meta.view("<i4").reshape(n_cells, cells.size // 4)
    canonical = _canonical_first(table, cells)
    if canonical is not None:
        return canonical, None
    if not np.all(table[:, 1] == 1):
        raise StateRestoreError("KV blob cells belong to several sequences")
    if not np.all(table[:, -1] == table[0, -1]):
        raise StateRestoreError("KV blob cells name different sequence ids")
    pos = table[:, 0]
    first = int(pos.min())
    want = np.arange(first, first + n_cells, dtype=pos.dtype)
    if first < 0:
        raise StateRestoreError(f"KV blob holds negative position {first}")
    order: npt.NDArray[np.intp] | None = None
    if not np.array_equal(pos, want):
        order = np.argsort(pos, kind="stable")
        if not np.array_equal(pos[order], want):
            raise StateRestoreError(
                f"KV blob cells are not exactly positions {first}..{first + n_cells - 1}"
            )
    if cells.ext:
        _check_ext(table, cells)
    return first, order


def _check_ext(table: npt.NDArray[np.int32], cells: CellFormat) -> None:
    """``StateRestoreError`` unless every ext cell of ``table`` (one row a cell: pos,
    n_seq_id, x, y, tok, seq id) holds what ``cells`` says a text cell holds."""
    pos, x, y, tok = table[:, 0], table[:, 2], table[:, 3], table[:, 4]
    want = pos if cells.mrope else 0
    if not (np.all(x == want) and np.all(y == want)):
        raise StateRestoreError(
            "KV blob cells carry a 2-D position that is not "
            + ("their position" if cells.mrope else "0")
        )
    if cells.n_vocab and not np.all((tok >= 0) & (tok < cells.n_vocab)):
        bad = int(tok[(tok < 0) | (tok >= cells.n_vocab)][0])
        raise StateRestoreError(f"a KV blob cell holds token {bad} (n_vocab={cells.n_vocab})")


# --- Cells a whole blob restores ------------------------------------------------------------


def check_cells(
    blob: U8, *, caches: int, recurrent: bool, n_ctx: int, cells: CellFormat = PLAIN
) -> None:
    """``StateRestoreError`` unless every cell a one-stream ``blob`` would restore is one that
    llama.cpp can hold and remove again: each of its first ``caches`` KV caches one sequence's
    consecutive positions inside ``[0, n_ctx)`` (its cells as ``cells`` says: with
    ``llama_kv_cell_ext``, that too as a text cell holds it), and (``recurrent``: a recurrent
    or hybrid memory) the recurrent state after them at most one cell, at a position inside
    it (a recurrent state's cells carry no ext).

    ``llama_state_seq_set_data`` checks none of this (found by review): it restored a cell at a
    negative position or at INT32_MAX, which ``llama_memory_seq_rm`` (its range clamped to
    ``[0, INT32_MAX)``) can never remove, so a failed restore left the sequence holding it for
    good; and a recurrent state of two cells was a ``GGML_ASSERT`` (an abort) in its restore."""
    raw = blob.data
    size = blob.size
    if size < 8 or _U32.unpack_from(raw, 0)[0] != IO_MAGIC:
        raise StateRestoreError("KV blob has no llama.cpp state header")
    at = 8
    for cache in range(caches):
        if at + 8 > size:
            raise StateRestoreError(f"KV blob ends before KV cache {cache}")
        n_stream, n_cells = struct.unpack_from("<II", raw, at)
        if n_stream != 1:
            raise StateRestoreError(f"KV cache {cache} of the blob has {n_stream} streams")
        at += 8
        if not n_cells:
            continue
        if at + n_cells * cells.size > size:
            raise StateRestoreError(f"KV blob of {size} bytes cannot hold {n_cells} cells")
        first, _ = _cell_order(blob[at : at + n_cells * cells.size], n_cells, cells)
        length = _stream_bytes(blob, at, n_cells, cells, meta_checked=True)
        if first + n_cells > n_ctx:
            raise StateRestoreError(
                f"KV cache {cache} of the blob holds positions up to {first + n_cells - 1}, "
                f"beyond the context (n_ctx={n_ctx})"
            )
        at += length
    if not recurrent:
        return
    if at + 4 > size:
        raise StateRestoreError("KV blob ends before its recurrent state")
    (n_cells,) = _U32.unpack_from(raw, at)
    if n_cells > 1:
        raise StateRestoreError(f"a sequence's recurrent state is one cell, not {n_cells}")
    if n_cells:
        if at + 12 > size:
            raise StateRestoreError("KV blob ends inside its recurrent state's cell")
        pos, n_seq_id = _REC_CELL.unpack_from(raw, at + 4)
        if not 0 <= pos < n_ctx or n_seq_id != 0:
            raise StateRestoreError(
                f"the blob's recurrent state is at position {pos} (n_ctx={n_ctx}) with "
                f"{n_seq_id} sequence ids"
            )


def check_joined(blob: U8, head: int, window: int | None, *, n_ctx: int) -> None:
    """``check_cells``'s rule for a blob ``LlamaKvCodec`` joined (``kv_codec.join_row``):
    its first cache (``head`` bytes) then, when ``window`` is a position, the window
    joined from it (``join_rest``). The joins write each cache's cells in canonical form
    (``canonical_meta``: sequence 0, positions in order, from 0 and from ``window``) and
    its headers from the chunks' checked descriptor, so what is left of the rule is the
    positions against the context: each cache's last one below ``n_ctx``. Only for a blob
    of 12-byte cells whose memory is exactly those caches (the context checks any other
    with ``check_cells``)."""
    raw = blob.data
    size = blob.size
    if size < HEAD.size or _U32.unpack_from(raw, 0)[0] != IO_MAGIC:
        raise StateRestoreError("KV blob has no llama.cpp state header")
    ends = [HEAD.unpack_from(raw, 0)[3]]
    if window is not None:
        if head + 8 > size:
            raise StateRestoreError("KV blob ends before its window cache")
        if window < 0:
            raise StateRestoreError(f"KV blob's window starts at position {window}")
        ends.append(window + struct.unpack_from("<II", raw, head)[1])
    check_ends(ends, n_ctx=n_ctx)


def check_ends(ends: Sequence[int], *, n_ctx: int) -> None:
    """Each KV cache's cells (the position after its last one: ``ends``, in the blob's
    order) lie inside the context."""
    for cache, end in enumerate(ends):
        if end > n_ctx:
            raise StateRestoreError(
                f"KV cache {cache} of the blob holds positions up to {end - 1}, "
                f"beyond the context (n_ctx={n_ctx})"
            )


#: A recurrent state's cell in a sequence's blob: i32 pos, u32 n_seq_id (0: the sequence's).
_REC_CELL = struct.Struct("<iI")


# --- Streams --------------------------------------------------------------------------------
#
# A context with per-sequence KV streams (``kv_unified=False``: deterministic mode) writes, for
# each of its KV caches, ``u32 n_stream`` and then one ``u32 n_cells`` per stream, followed by
# that stream's cells when it has any. One sequence lives in one stream, so at most one of them
# is non-empty; llama.cpp restores those cells into the stream of the sequence it is asked to
# fill, whatever their place in the blob. Rows are stored in the one-stream form a unified
# context writes (``one_stream``), so they restore into any context (``ContextParams.kv_hash``
# leaves the stream count out), and are widened to the reading context's count on the way in
# (``widen``). Memory after the KV caches (a hybrid model's recurrent state) has no streams
# and is copied as it is.

_U32 = struct.Struct("<I")


def one_stream(blob: U8, caches: int, cells: CellFormat = PLAIN) -> bytes:
    """``blob`` (from a context of several streams) with each of its first ``caches`` KV caches
    rewritten as one stream; ``StateRestoreError`` unless it is exactly as described above."""
    return _restream(blob, caches, 1, cells, from_streams=None)


def widen(blob: U8, caches: int, n_stream: int, cells: CellFormat = PLAIN) -> bytes:
    """A one-stream ``blob`` rewritten for a context of ``n_stream`` streams: its cells in the
    first stream, the others empty."""
    return _restream(blob, caches, n_stream, cells, from_streams=1)


def _restream(
    blob: U8, caches: int, n_stream: int, cells: CellFormat, *, from_streams: int | None
) -> bytes:
    raw = blob.data
    size = blob.size
    if size < 8 or _U32.unpack_from(raw, 0)[0] != IO_MAGIC:
        raise StateRestoreError("KV blob has no llama.cpp state header")
    parts: list[bytes | memoryview] = [raw[:8]]
    at = 8
    for cache in range(caches):
        if at + 4 > size:
            raise StateRestoreError(f"KV blob ends before KV cache {cache}")
        (have,) = _U32.unpack_from(raw, at)
        if have < 1 or (from_streams is not None and have != from_streams):
            raise StateRestoreError(f"KV cache {cache} of the blob has {have} streams")
        at += 4
        held: memoryview | None = None
        for stream in range(have):
            if at + 4 > size:
                raise StateRestoreError(f"KV blob ends before stream {stream} of cache {cache}")
            (n_cells,) = _U32.unpack_from(raw, at)
            end = at + 4 + (_stream_bytes(blob, at + 4, n_cells, cells) if n_cells else 0)
            if n_cells:
                if held is not None:
                    raise StateRestoreError(f"KV cache {cache} holds cells in two streams")
                held = raw[at:end]
            at = end
        parts.append(_U32.pack(n_stream))
        parts.append(held if held is not None else _U32.pack(0))
        parts.append(bytes(4 * (n_stream - 1)))
    parts.append(raw[at:])
    return b"".join(parts)


def _stream_bytes(
    blob: U8, at: int, n_cells: int, cells: CellFormat = PLAIN, *, meta_checked: bool = False
) -> int:
    """The length of one stream's cells (metadata as ``cells`` says, then every K and V
    section) from ``at``; ``meta_checked``: the caller has found the cells one sequence's
    (``_cell_order``)."""
    raw = blob.data
    size = blob.size
    end = at + n_cells * cells.size
    if end + _PAIR.size > size:
        raise StateRestoreError(f"KV blob of {size} bytes cannot hold {n_cells} cells")
    meta = blob[at:end].view("<i4").reshape(n_cells, cells.size // 4)
    if not meta_checked and (not np.all(meta[:, 1] == 1) or not np.all(meta[:, -1] == meta[0, -1])):
        raise StateRestoreError("KV blob cells are not one sequence's (or carry extra data)")
    v_trans, n_layer = _PAIR.unpack_from(raw, end)
    if v_trans not in (0, 1) or n_layer > MAX_LAYERS:
        raise StateRestoreError(f"KV blob has v_trans={v_trans}, n_layer={n_layer}")
    end += _PAIR.size
    for first in (0, n_layer):  # the K sections, then the V sections
        trans = v_trans == 1 and first > 0
        end = _sections_end(blob, end, first, n_layer, n_cells, transposed=trans)
    return end - at


def _sections_end(
    blob: U8, at: int, first: int, count: int, n_cells: int, *, transposed: bool
) -> int:
    """Where ``count`` sections of ``n_cells`` cells from ``at`` end (sections ``first..``),
    every header read and checked. Sections of one shape, as a model's layers mostly are, are
    checked together: their headers, one section's length apart, all equal to the first's
    (which is checked as any); a walk of one Python step a section cost ~1 us each, 36 of
    every Gemma restore's ~47 us in this check. Any other layout is walked section by
    section, with each section's own error."""
    raw = blob.data
    size = blob.size
    if count > 1 and at + _SECTION_HEAD <= size:
        head = _section(raw, at, first, transposed=transposed)
        step = _SECTION_HEAD + n_cells * head.cell_bytes
        if at + count * step <= size:
            # numpy checks these strides against the buffer's length; the headers compared
            # as bytes (a numpy comparison and reduction took 2 us of the 3.6 here)
            heads = np.ndarray((count, _SECTION_HEAD), np.uint8, raw, at, (step, 1))
            if heads.tobytes() == bytes(raw[at : at + _SECTION_HEAD]) * count:
                return at + count * step
    for i in range(first, first + count):
        if at + _SECTION_HEAD > size:
            raise StateRestoreError(f"KV blob ends inside the header of section {i}")
        section = _section(raw, at, i, transposed=transposed)
        at += _SECTION_HEAD + n_cells * section.cell_bytes
        if at > size:
            raise StateRestoreError(f"KV blob ends inside section {i}")
    return at
