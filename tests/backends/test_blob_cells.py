"""A whole state blob's cells are checked before llama.cpp restores them (found by review).

``llama_state_seq_set_data`` trusts a blob's cell positions: a cell at a negative position or
at INT32_MAX was restored, and no ``llama_memory_seq_rm`` can remove it again (its range is
clamped to ``[0, INT32_MAX)``), so a failed restore left the sequence holding it for good; and
a recurrent state of two cells was a ``GGML_ASSERT``, an abort. Each case runs in a child
process, so an abort fails one test instead of the run.
"""

from __future__ import annotations

import struct

import numpy as np
import numpy.typing as npt
import pytest
from tests.childkit import assert_case_ok
from tests.tinymodels import write_tiny_model

from kvwarm.backends.llama.kv_layout import (
    IO_MAGIC,
    PLAIN,
    CellFormat,
    _canonical_first,
    _cell_order,
    check_cells,
    check_joined,
    one_stream,
    widen,
)
from kvwarm.embedded import default_model_path
from kvwarm.errors import StateRestoreError

#: Run in the child: load ``PATH``, pack seq 0, restore ``patch(blob)`` into seq 1; the restore
#: must fail typed and leave seq 1 empty and usable.
_CHILD = """
import struct, sys
from kvwarm.backends import get_backend
from kvwarm.backends.base import ContextParams
from kvwarm.errors import StateRestoreError
m = get_backend("llama_cpp").load_model(sys.argv[1])
ctx = m.new_context(ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2, n_threads=2))
tokens = [5, 6, 7, 8, 9, 10, 11]
ctx.prefill(0, tokens, 0)
blob = bytearray(ctx.kv_pack(0))
{patch}
try:
    ctx.kv_unpack(1, bytes(blob))
except StateRestoreError as exc:
    print("refused:", exc)
else:
    raise SystemExit("the blob was restored")
held = (ctx.seq_pos_min(1), ctx.seq_pos_max(1))
assert held == (-1, -1), held
ctx.prefill(1, tokens, 0)
assert ctx.kv_unpack(1, ctx.kv_pack(0)) == len(tokens)
print("CASE-OK")
"""


def _run(path: str, patch: str) -> None:
    assert_case_ok("-c", _CHILD.format(patch=patch), path)


@pytest.mark.model
@pytest.mark.parametrize("pos", [-5, 2**31 - 1])
def test_kv_cell_position_no_seq_rm_removes(pos: int) -> None:
    """SmolLM2: the last cell of the blob moved to ``pos``."""
    _run(str(default_model_path()), f"struct.pack_into('<i', blob, 16 + 12 * 6, {pos})")


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("mamba") / "mamba.gguf", "mamba"))


@pytest.mark.model
@pytest.mark.parametrize(
    "patch",
    [
        # Two cells (pos, n_seq_id) where one sequence's state has one: llama.cpp aborted.
        "blob[8:20] = struct.pack('<IiIiI', 2, 5, 0, 6, 0)",
        "struct.pack_into('<i', blob, 12, -5)",
        "struct.pack_into('<i', blob, 12, 2**31 - 1)",
    ],
    ids=["two-cells", "negative", "int32-max"],
)
def test_recurrent_state_cells(mamba: str, patch: str) -> None:
    _run(mamba, patch)


# --- check_cells alone, on synthetic blobs ---------------------------------------------------


def _cache(positions: list[int], *, seq: int = 0) -> bytes:
    """One KV cache: one stream of ``positions``' cells and one layer of 2-byte K and V rows."""
    n = len(positions)
    if not n:
        return struct.pack("<II", 1, 0)  # an empty cache: no layers follow
    meta = b"".join(struct.pack("<iIi", p, 1, seq) for p in positions)
    rows = struct.pack("<iQ", 1, 2) + bytes(2 * n)
    return struct.pack("<II", 1, n) + meta + struct.pack("<II", 0, 1) + rows + rows


def _blob(*caches: bytes, rest: bytes = b"") -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
    data = struct.pack("<Ii", IO_MAGIC, 0) + b"".join(caches) + rest
    return np.frombuffer(data, dtype=np.uint8)


def test_check_cells_accepts_what_llama_writes() -> None:
    check_cells(_blob(_cache([0, 1, 2])), caches=1, recurrent=False, n_ctx=16)
    check_cells(_blob(_cache([0, 1]), _cache([1])), caches=2, recurrent=False, n_ctx=16)
    check_cells(_blob(_cache([]), _cache([])), caches=2, recurrent=False, n_ctx=16)
    recurrent = struct.pack("<IiI", 1, 2, 0) + b"state"
    check_cells(_blob(_cache([0, 1, 2]), rest=recurrent), caches=1, recurrent=True, n_ctx=16)
    check_cells(_blob(rest=struct.pack("<I", 0)), caches=0, recurrent=True, n_ctx=16)


@pytest.mark.parametrize(
    ("blob", "caches", "recurrent"),
    [
        (_blob(_cache([0, -1, 2])), 1, False),
        (_blob(_cache([0, 1, 2**31 - 1])), 1, False),
        (_blob(_cache([0, 1, 1])), 1, False),
        (_blob(_cache([14, 15, 16])), 1, False),  # past n_ctx
        (_blob(_cache([0, 1]), _cache([-3])), 2, False),
        (_blob(rest=struct.pack("<IiIiI", 2, 0, 0, 1, 0)), 0, True),
        (_blob(rest=struct.pack("<IiI", 1, -1, 0)), 0, True),
        (_blob(rest=struct.pack("<IiI", 1, 16, 0)), 0, True),
        (_blob(rest=struct.pack("<IiI", 1, 3, 1)), 0, True),
        (_blob(rest=struct.pack("<Ii", 1, 3)), 0, True),
        (_blob(_cache([0, 1])[:-3]), 1, False),
        (np.frombuffer(b"\0" * 32, dtype=np.uint8), 1, False),
    ],
)
def test_check_cells_refuses(
    blob: np.ndarray[tuple[int], np.dtype[np.uint8]], caches: int, recurrent: bool
) -> None:
    with pytest.raises(StateRestoreError):
        check_cells(blob, caches=caches, recurrent=recurrent, n_ctx=16)


def _table(cells: list[tuple[int, int, int]]) -> npt.NDArray[np.int32]:
    return np.array(cells, dtype="<i4").reshape(len(cells), 3)


@pytest.mark.parametrize(
    ("cells", "first"),
    [
        ([(p, 1, 0) for p in range(5)], 0),
        ([(p, 1, 0) for p in range(7, 12)], 7),
        ([(p, 1, 0) for p in range(2000)], 0),  # grows the ramp past the shorter ones
        ([(p, 1, 0) for p in range(3, 40)], 3),  # a slice of the grown ramp
        ([(p, 1, 3) for p in range(4, 9)], 4),  # one sequence's, not 0's (a slot's pack)
        ([(0, 1, 3), (1, 1, 0), (2, 1, 3)], None),  # two sequence ids
        ([(1, 1, 0), (0, 1, 0), (2, 1, 0)], None),  # out of position order
        ([(0, 1, 0), (1, 2, 0), (2, 1, 0)], None),  # two sequences
        ([(0, 1, 0), (2, 1, 0), (3, 1, 0)], None),  # a gap
        ([(-1, 1, 0), (0, 1, 0)], None),
        ([(2**31 - 2, 1, 0), (2**31 - 1, 1, 0)], 2**31 - 2),
        ([(2**31 - 1, 1, 0), (-(2**31), 1, 0)], None),  # i32 wraps past the last position
    ],
)
def test_only_canonical_cells_take_the_short_path(
    cells: list[tuple[int, int, int]], first: int | None
) -> None:
    """``_cell_order`` compares cells in the form llama.cpp packs one sequence's and kvwarm
    joins them with that form in one step; any other metadata gets the walk's checks, as
    every blob did before."""
    table = _table(cells)
    assert _canonical_first(table, PLAIN) == first
    meta = np.frombuffer(table.tobytes(), dtype=np.uint8)
    if first is not None:
        assert _cell_order(meta, len(cells)) == (first, None)


def test_cells_with_ext_never_take_the_short_path() -> None:
    """24-byte cells carry a 2-D position and a token the walk checks (``_check_ext``)."""
    table = np.zeros((3, 6), dtype="<i4")
    table[:, 0] = table[:, 2] = table[:, 3] = np.arange(3)
    table[:, 1] = 1
    assert _canonical_first(table, MROPE) is None


def _layers(positions: list[int], units: list[int], *, v_trans: bool = False) -> bytes:
    """One KV cache of ``positions``' cells and a layer per unit: K rows of ``unit`` bytes,
    and V rows alike or (``v_trans``) ``unit`` elements of 2 bytes per cell."""
    n = len(positions)
    meta = b"".join(struct.pack("<iIi", p, 1, 0) for p in positions)
    k = b"".join(struct.pack("<iQ", 1, u) + bytes(u * n) for u in units)
    if v_trans:
        v = b"".join(struct.pack("<iII", 1, 2, u) + bytes(2 * u * n) for u in units)
    else:
        v = b"".join(struct.pack("<iQ", 1, u) + bytes(u * n) for u in units)
    return struct.pack("<II", 1, n) + meta + struct.pack("<II", int(v_trans), len(units)) + k + v


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("units", [[4, 4, 4], [4, 8, 4], [8, 4, 4, 4]])
def test_check_cells_finds_the_second_cache_behind_layers_of_any_shapes(
    units: list[int], v_trans: bool
) -> None:
    """Sections of one shape are checked together, any other layout section by section: both
    must find where the first cache ends, or the second's cells go unchecked."""
    first = _layers([0, 1, 2], units, v_trans=v_trans)
    check_cells(_blob(first, _cache([1, 2])), caches=2, recurrent=False, n_ctx=16)
    with pytest.raises(StateRestoreError):
        check_cells(_blob(first, _cache([-5, -4])), caches=2, recurrent=False, n_ctx=16)
    with pytest.raises(StateRestoreError, match="ends inside"):
        check_cells(_blob(first[:-1]), caches=1, recurrent=False, n_ctx=16)


# --- Cells with llama_kv_cell_ext (M-RoPE, PLE) ---------------------------------------------
#
# Such a model writes 24 bytes a cell: i32 pos, u32 n_seq_id, i32 x, i32 y, i32 tok, i32 seq
# id. The guard was skipped for them: a cell at a negative position or at INT32_MAX was
# restored and stuck, and a 2-D position or a token no text cell holds was restored silently.

MROPE = CellFormat(ext=True, mrope=True, n_vocab=128)
PLE = CellFormat(ext=True, n_vocab=128)


def _ext_cache(
    positions: list[int],
    *,
    xy: list[int] | None = None,
    toks: list[int] | None = None,
    seqs: list[int] | None = None,
) -> bytes:
    """One KV cache of ext cells: ``x`` and ``y`` both ``xy`` (default: the positions),
    tokens ``toks`` (default 5), sequence ids ``seqs`` (default 0); one layer of 2-byte rows."""
    n = len(positions)
    xy = positions if xy is None else xy
    toks = [5] * n if toks is None else toks
    seqs = [0] * n if seqs is None else seqs
    meta = b"".join(
        struct.pack("<iIiiii", p, 1, c, c, t, s)
        for p, c, t, s in zip(positions, xy, toks, seqs, strict=True)
    )
    rows = struct.pack("<iQ", 1, 2) + bytes(2 * n)
    return struct.pack("<II", 1, n) + meta + struct.pack("<II", 0, 1) + rows + rows


def test_check_cells_accepts_ext_cells_as_llama_writes_text() -> None:
    check_cells(_blob(_ext_cache([0, 1, 2])), caches=1, recurrent=False, n_ctx=16, cells=MROPE)
    check_cells(
        _blob(_ext_cache([2, 0, 1], toks=[0, 127, 9])),
        caches=1,
        recurrent=False,
        n_ctx=16,
        cells=MROPE,
    )
    ple = _blob(_ext_cache([0, 1, 2], xy=[0, 0, 0]))
    check_cells(ple, caches=1, recurrent=False, n_ctx=16, cells=PLE)
    # An iSWA model's two caches, both of ext cells.
    two = _blob(_ext_cache([0, 1, 2]), _ext_cache([1, 2]))
    check_cells(two, caches=2, recurrent=False, n_ctx=16, cells=MROPE)


@pytest.mark.parametrize(
    ("cache", "cells"),
    [
        (_ext_cache([0, -1, 2]), MROPE),
        (_ext_cache([0, 1, 2**31 - 1]), MROPE),
        (_ext_cache([0, 1, 1]), MROPE),
        (_ext_cache([14, 15, 16]), MROPE),  # past n_ctx
        (_ext_cache([0, 1, 2], seqs=[0, 0, 3]), MROPE),
        (_ext_cache([0, 1, 2], xy=[0, 1, 5]), MROPE),  # a 2-D position no text cell has
        (_ext_cache([0, 1, 2], xy=[0, 0, 0]), MROPE),
        (_ext_cache([0, 1, 2]), PLE),  # PLE alone keeps no 2-D position
        (_ext_cache([0, 1, 2], toks=[5, 128, 5]), MROPE),  # a token past the vocabulary
        (_ext_cache([0, 1, 2], toks=[5, -1, 5]), PLE),
        (_ext_cache([0, 1, 2]), PLAIN),  # ext cells read as plain ones do not add up
        (_cache([0, 1, 2]), MROPE),  # and plain cells as ext ones
        (_ext_cache([0, 1, 2])[:-3], MROPE),
    ],
)
def test_check_cells_refuses_ext_cells(cache: bytes, cells: CellFormat) -> None:
    with pytest.raises(StateRestoreError):
        check_cells(_blob(cache), caches=1, recurrent=False, n_ctx=16, cells=cells)


def test_check_cells_reads_an_ext_cells_own_2d_position_and_token() -> None:
    """Its x and y are both checked, and its token, each on its own."""
    base = bytearray(_blob(_ext_cache([0, 1, 2])).tobytes())
    last = 16 + 24 * 2
    for offset, value in [(8, 7), (12, 7), (16, 128), (20, 1)]:
        blob = bytearray(base)
        struct.pack_into("<i", blob, last + offset, value)
        with pytest.raises(StateRestoreError):
            check_cells(
                np.frombuffer(bytes(blob), dtype=np.uint8),
                caches=1,
                recurrent=False,
                n_ctx=16,
                cells=MROPE,
            )


def test_streams_rewrite_ext_cells() -> None:
    """A context of several streams (deterministic mode) packs and restores ext cells: they
    were read as 12-byte cells, and every such pack was refused."""
    cache = _ext_cache([0, 1, 2])
    blob = _blob(cache)
    wide = widen(blob, 1, 3, MROPE)
    assert wide == struct.pack("<Ii", IO_MAGIC, 0) + struct.pack("<I", 3) + cache[4:] + bytes(8)
    assert one_stream(np.frombuffer(wide, dtype=np.uint8), 1, MROPE) == blob.tobytes()
    with pytest.raises(StateRestoreError):
        one_stream(np.frombuffer(wide, dtype=np.uint8), 1)


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2-VL text model: M-RoPE, so its cells carry ``llama_kv_cell_ext``."""
    return str(write_tiny_model(tmp_path_factory.mktemp("qwen2vl") / "qwen2vl.gguf", "qwen2vl"))


#: The last of the 7 cells the child packs: pos at +0, x +8, y +12, tok +16, seq id +20.
_LAST = 16 + 24 * 6


@pytest.mark.model
@pytest.mark.parametrize(
    "patch",
    [
        # A cell no seq_rm removes, its 2-D position alike: restored and stuck on the old code.
        *(
            f"struct.pack_into('<iIii', blob, {_LAST}, {pos}, 1, {pos}, {pos})"
            for pos in (-5, 2**31 - 1)
        ),
        f"struct.pack_into('<iIii', blob, {_LAST}, 5, 1, 5, 5)",  # position 5 twice, no 6
        f"struct.pack_into('<i', blob, {_LAST} + 8, -7)",
        f"struct.pack_into('<i', blob, {_LAST} + 12, 2**31 - 1)",
        f"struct.pack_into('<i', blob, {_LAST} + 16, 10**9)",
        f"struct.pack_into('<i', blob, {_LAST} + 20, 5)",
    ],
    ids=["negative", "int32-max", "duplicate", "x", "y", "token", "seq-id"],
)
def test_mrope_cells(qwen2vl: str, patch: str) -> None:
    """Qwen2-VL: each crafted blob is refused typed, the sequence left empty and usable (on
    the old code: restored, or refused with its stuck cell left in the sequence; none of these
    aborts llama.cpp, which restores an ext cell as it is)."""
    _run(qwen2vl, patch)


_ROUND_TRIP = """
import sys
from kvwarm.backends import get_backend
from kvwarm.backends.base import BatchToken, ContextParams
m = get_backend("llama_cpp").load_model(sys.argv[1])
for unified in (True, False):
    ctx = m.new_context(ContextParams(
        n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2, n_threads=2, kv_unified=unified))
    tokens = [5, 6, 7, 8, 9, 10, 11]
    ctx.prefill(0, tokens, 0)
    assert ctx.kv_unpack(1, ctx.kv_pack(0)) == len(tokens)
    rows = []
    for seq in (0, 1):
        ctx.decode([BatchToken(12, len(tokens), seq, True)])
        rows.append(bytes(ctx.logits(-1)))
    assert rows[0] == rows[1], unified
    ctx.close()
print("CASE-OK")
"""


@pytest.mark.model
def test_mrope_blob_round_trips(qwen2vl: str) -> None:
    """A Qwen2-VL blob restores into another sequence, unified or one stream a sequence, and
    the next token's logits are the packed sequence's."""
    assert_case_ok("-c", _ROUND_TRIP, qwen2vl)


def test_a_joined_blob_is_checked_for_its_positions_against_n_ctx() -> None:
    """``check_joined``: what is left of ``check_cells``'s rule for a blob the codec joined
    (its cells canonical by construction): each cache's positions below ``n_ctx``."""
    first = _cache(list(range(6)))
    blob = _blob(first, _cache(list(range(2, 6))))
    head = 8 + len(first)  # where the window cache starts
    check_joined(blob, head, 2, n_ctx=6)
    check_joined(_blob(first), len(blob), None, n_ctx=6)
    check_joined(_blob(_cache([])), 16, None, n_ctx=1)
    for joined, window, n_ctx in [
        (_blob(first), None, 5),  # the first cache past n_ctx
        (blob, 2, 5),
        (blob, 3, 6),  # the window [3, 7) past n_ctx, the first cache inside it
        (blob, -1, 6),
        (_blob(first), 2, 6),  # no window cache where one is said to start
        (np.frombuffer(b"\0" * 32, dtype=np.uint8), None, 6),
    ]:
        with pytest.raises(StateRestoreError):
            check_joined(joined, head, window, n_ctx=n_ctx)
