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
import pytest
from tests.childkit import assert_case_ok
from tests.tinymodels import write_tiny_model

from kvwarm.backends.llama.kv_layout import IO_MAGIC, check_cells
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
