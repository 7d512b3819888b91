"""A sequence's KV state in and out of a ``llama_context`` (``llama_state_seq_*``).

Invariants: ``pack`` copies the state once (llama.cpp writes straight into the ``bytes``
returned); ``unpack`` reads the caller's buffer in place, checks the blob's structure before
llama.cpp trusts its counts, and leaves the sequence empty (``StateRestoreError``) when a blob
does not restore to positions ``[0, n)`` inside the context. ``unpack_chunks`` does the same
for a row's chunks, each read in place from its own buffer: the first into the sequence, every
later one into the context's scratch sequence and then shared into the sequence (``seq_cp``
shares cells in the unified KV buffer; it copies nothing), because ``llama_state_seq_set_data``
clears its destination first. The scratch sequence is empty before and after. A tail restore
(``base`` > 0) puts every chunk through the scratch sequence onto the live prefix ``[0, base)``
the sequence already holds.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwarm.backends.llama.kv_codec import StagedWindow, WindowJoin
from kvwarm.buffers import U8, u8, uninitialised_bytes
from kvwarm.errors import BackendError, StateRestoreError


def pack(lib: Any, ctx: object, seq: int) -> bytes:
    size = int(lib.llama_state_seq_get_size(ctx, seq))
    if size <= 0:
        raise BackendError(f"llama_state_seq_get_size returned {size}")
    out = uninitialised_bytes(size)
    dst = ctypes.cast(ctypes.c_char_p(out), ctypes.POINTER(ctypes.c_uint8))
    written = int(lib.llama_state_seq_get_data(ctx, dst, size, seq))
    if written != size:
        raise BackendError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    return out


def pack_tail(lib: Any, ctx: object, mem: object, seq: int, scratch: int, start: int) -> bytes:
    """Positions ``start..`` of ``seq`` as a blob, packed through the scratch sequence (in a
    unified KV stream ``seq_cp`` shares cells, it copies nothing); the scratch sequence is
    empty again on return, whatever happens."""
    lib.llama_memory_seq_rm(mem, scratch, -1, -1)
    try:
        lib.llama_memory_seq_cp(mem, seq, scratch, start, -1)
        return pack(lib, ctx, scratch)
    finally:
        lib.llama_memory_seq_rm(mem, scratch, -1, -1)


def unpack(
    lib: Any,
    ctx: object,
    mem: object,
    seq: int,
    data: bytes | bytearray | memoryview,
    n_ctx: int,
    *,
    from_zero: bool = True,
) -> int:
    """Restore ``data`` into ``seq``; the number of positions it now holds.

    ``from_zero``: the state must hold every position from 0 (full attention). A windowed or
    recurrent state holds only its last positions (``kvwarm.memory``); it is then checked to
    end inside the context, and what it can resume from is the planner's business."""
    # Zero-copy for bytes, bytearray and contiguous memoryviews, writable or not; anything
    # else (a strided view) is a StateRestoreError, not numpy's BufferError.
    buf = u8(data)
    size = buf.size
    try:
        _validate_blob(buf, n_ctx=n_ctx)
        # llama.cpp clears the sequence only when the blob holds cells: an empty blob would
        # otherwise leave the old KV in place, against kv_unpack's "cleared first".
        lib.llama_memory_seq_rm(mem, seq, -1, -1)
        src = ctypes.cast(ctypes.c_void_p(buf.ctypes.data), ctypes.POINTER(ctypes.c_uint8))
        read = int(lib.llama_state_seq_set_data(ctx, src, size, seq))
        if read == 0:
            raise StateRestoreError(
                "llama.cpp refused the KV blob (other model, KV type or context size?)"
            )
        if read != size:
            raise StateRestoreError(f"KV blob has {size - read} trailing bytes")
        pos_min = int(lib.llama_memory_seq_pos_min(mem, seq))
        pos_max = int(lib.llama_memory_seq_pos_max(mem, seq))
        if pos_max >= n_ctx or (pos_max >= 0 and (pos_min < 0 or (from_zero and pos_min != 0))):
            raise StateRestoreError(
                f"restored positions [{pos_min}, {pos_max}] do not fit [0, {n_ctx})"
            )
    except BaseException:
        lib.llama_memory_seq_rm(mem, seq, -1, -1)
        raise
    return pos_max + 1


def unpack_chunks(
    lib: Any,
    ctx: object,
    mem: object,
    seq: int,
    scratch: int,
    parts: Sequence[U8],
    n_ctx: int,
    *,
    base: int = 0,
    n_end: int = 0,
) -> int:
    """Restore ``parts`` (checked blobs holding consecutive positions from ``base``, as
    ``LlamaKvCodec.blobs`` returns them) into ``seq``; the number of positions it now holds.
    With ``base`` > 0 ``seq`` must hold exactly positions ``[0, base)`` (the caller's live
    prefix, which it keeps) and then holds ``[0, n_end)``; every part goes through the
    scratch sequence."""
    lib.llama_memory_seq_rm(mem, scratch, -1, -1)
    if base:
        held = (
            int(lib.llama_memory_seq_pos_min(mem, seq)),
            int(lib.llama_memory_seq_pos_max(mem, seq)),
        )
        if held != (0, base - 1):
            raise StateRestoreError(
                f"a tail restore from {base} needs the sequence to hold [0, {base - 1}], "
                f"not {list(held)}"
            )
    else:
        lib.llama_memory_seq_rm(mem, seq, -1, -1)
    try:
        for i, part in enumerate(parts):
            size = part.size
            src = ctypes.cast(ctypes.c_void_p(part.ctypes.data), ctypes.POINTER(ctypes.c_uint8))
            via = scratch if i or base else seq
            read = int(lib.llama_state_seq_set_data(ctx, src, size, via))
            if read != size:
                raise StateRestoreError(
                    f"llama.cpp refused KV chunk {i} (read {read} of {size} bytes; is the "
                    "context full?)"
                )
            if via == scratch:  # the next set_data clears the scratch sequence itself
                lib.llama_memory_seq_cp(mem, scratch, seq, -1, -1)
        lib.llama_memory_seq_rm(mem, scratch, -1, -1)
        pos_min = int(lib.llama_memory_seq_pos_min(mem, seq))
        pos_max = int(lib.llama_memory_seq_pos_max(mem, seq))
        if pos_max >= n_ctx or (pos_max >= 0 and pos_min != 0):
            raise StateRestoreError(
                f"restored positions [{pos_min}, {pos_max}] do not fit [0, {n_ctx})"
            )
        if base and pos_max + 1 != n_end:
            raise StateRestoreError(
                f"a tail restore from {base} ended at {pos_max + 1}, not {n_end}"
            )
    except BaseException:
        lib.llama_memory_seq_rm(mem, seq, -1, -1)
        lib.llama_memory_seq_rm(mem, scratch, -1, -1)
        raise
    return pos_max + 1


def unpack_apart(
    lib: Any, ctx: object, mem: object, seq: int, row: WindowJoin, staged: StagedWindow, n_ctx: int
) -> int:
    """Restore a window row into ``seq`` one cache at a time through the buffer it is staged
    in (``WindowJoin.stage``): its first cache with an empty window
    (``llama_state_seq_set_data``'s read of an iSWA memory then restores no window cell), then
    its window alone (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: llama.cpp's iSWA memory then
    reads only its window cache, clearing only that cache's cells of the sequence first).
    The result is the state the joined row restores whole, cell for cell. The number of
    positions the sequence holds; a refusal leaves it empty."""
    src = ctypes.cast(ctypes.c_void_p(staged.address), ctypes.POINTER(ctypes.c_uint8))
    lib.llama_memory_seq_rm(mem, seq, -1, -1)
    try:
        for what, write, flags in (
            ("first KV cache", staged.first, lib.LLAMA_STATE_SEQ_FLAGS_NONE),
            ("window", staged.window, lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY),
        ):
            size = write()
            read = int(lib.llama_state_seq_set_data_ext(ctx, src, size, seq, flags))
            if read != size:
                raise StateRestoreError(
                    f"llama.cpp refused the row's {what} (read {read} of {size} bytes; other "
                    "model, KV type or context size?)"
                )
        pos_min = int(lib.llama_memory_seq_pos_min(mem, seq))
        pos_max = int(lib.llama_memory_seq_pos_max(mem, seq))
        if pos_max >= n_ctx or pos_min < 0 or pos_max + 1 != row.first_end:
            raise StateRestoreError(
                f"restored positions [{pos_min}, {pos_max}] are not the row's "
                f"[.., {row.first_end}) inside [0, {n_ctx})"
            )
    except BaseException:
        lib.llama_memory_seq_rm(mem, seq, -1, -1)
        raise
    return pos_max + 1


def _validate_blob(buf: np.ndarray[tuple[int], np.dtype[np.uint8]], *, n_ctx: int) -> None:
    """Cheap structural checks llama.cpp does not make before trusting a blob's counts."""
    if buf.size < 16:
        raise StateRestoreError(f"KV blob of {buf.size} bytes is too short")
