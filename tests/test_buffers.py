"""``buffers.py``: fresh buffers filled in place, zero-copy views, the huge-page hint."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from kvwarm import buffers as _buffers
from kvwarm.errors import StateRestoreError

BIG = 9 << 20  # over the 4 MiB where the huge-page hint applies


@pytest.mark.parametrize("size", [0, 1, 4095, BIG])
def test_fresh_bytes_are_filled_in_place(size: int) -> None:
    out, view = _buffers.fresh_bytes(size)
    assert isinstance(out, bytes) and len(out) == view.size == size
    view[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    assert out == bytes(np.arange(size, dtype=np.uint64).astype(np.uint8))


@pytest.mark.parametrize("size", [1, BIG])
def test_uninitialised_bytearray_is_writable(size: int) -> None:
    out = _buffers.uninitialised_bytearray(size)
    assert isinstance(out, bytearray) and len(out) == size
    np.frombuffer(out, dtype=np.uint8)[:] = 7
    assert out == b"\7" * size


def test_huge_page_hint_never_touches_memory_outside_the_buffer() -> None:
    # Advising a range that holds no whole huge page does nothing; a big one is accepted.
    _buffers.advise_huge(4096, 4096)
    buf = bytearray(BIG)
    _buffers.advise_huge(np.frombuffer(buf, dtype=np.uint8).ctypes.data, BIG)
    assert buf == bytes(BIG)


def test_u8_views_without_copying() -> None:
    data = bytearray(b"abcdef")
    view = _buffers.u8(data)
    data[0] = ord("z")
    assert view[0] == ord("z")
    assert _buffers.u8(memoryview(np.arange(3, dtype=np.int32))).size == 12
    with pytest.raises(StateRestoreError):
        _buffers.u8(memoryview(b"abcdef")[::2])


def test_grown_buffers_leave_headroom_for_the_next_turn() -> None:
    first = _buffers.grown(1000, 0)
    assert len(first) == 1000
    # A row a few tokens longer than the last: one allocation with headroom, then reuse.
    second = _buffers.grown(1010, len(first))
    assert len(second) == int(1000 * _buffers.GROWTH) >= 1010
    assert len(_buffers.grown(5000, len(second))) == 5000  # a big jump gets what it needs


def test_cache_read_arena_is_reused_while_rows_grow_by_a_turn() -> None:
    from kvwarm.cache.store.core import ScratchBuffers

    scratch = ScratchBuffers()
    arena = scratch.take_arena(1 << 20)
    assert arena is not None and len(arena) == 1 << 20
    scratch.reclaim_arena(arena, ())
    bigger = scratch.take_arena((1 << 20) + 4096)  # the next turn's row
    assert bigger is not None and len(bigger) == int((1 << 20) * _buffers.GROWTH)
    scratch.reclaim_arena(bigger, ())
    assert scratch.take_arena((1 << 20) + 8192) is bigger  # no allocation this turn


def test_held_bytes_stay_immutable_and_are_found_through_their_views() -> None:
    """A memo on a ``Held`` is only sound if its bytes can never change."""
    data = bytes(range(16))
    kept = _buffers.held(data)
    assert kept.tobytes() == data and kept.memo == {}
    assert memoryview(kept).readonly
    with pytest.raises(ValueError):
        kept.flags.writeable = True
    assert _buffers.held_of(memoryview(kept)) is kept
    assert _buffers.held_of(kept) is kept
    assert _buffers.held_of(memoryview(data)) is None
    assert _buffers.held_of(np.frombuffer(data, dtype=np.uint8)) is None
    # A part of it is not it: its memo describes all of its bytes.
    assert _buffers.held_of(memoryview(kept)[1:]) is None
    assert _buffers.held_of(kept[1:]) is None
    # A view of a memo-less copy of its bytes (a numpy slice, even of all of them) or of
    # its bytes in another order is not it either: a codec would read ``memo`` off the one
    # or use the memo's view of the bytes in place of the other's.
    assert _buffers.held_of(memoryview(kept[1:])) is None
    assert _buffers.held_of(memoryview(kept[:])) is None
    assert _buffers.held_of(memoryview(kept)[::-1]) is None
    assert _buffers.held_of(memoryview(kept)[::1]) is kept
    plain = kept.plain  # what a memo may keep views of: the same bytes, not the Held
    assert type(plain) is np.ndarray and not plain.flags.writeable
    assert plain.ctypes.data == kept.ctypes.data and plain.tobytes() == data


def test_the_ram_tier_hands_out_its_chunks_held() -> None:
    from kvwarm.cache.tiers.ram import RamTier

    tier = RamTier(1 << 20)
    assert tier.store_chunk(b"k", b"head", b"chunk bytes") == 11
    view = tier.load_chunk(b"k")
    assert bytes(view) == b"chunk bytes"
    assert _buffers.held_of(view) is not None
    assert list(tier.scan_chunks()) == [(b"k", 11)]
    view.release()  # a lease releases its views: the held chunk stays
    assert bytes(tier.load_chunk(b"k")) == b"chunk bytes"


def test_a_staging_buffer_is_found_through_whole_views_and_its_memo_does_not_keep_it() -> None:
    """A codec keeps views of a ``Staging`` (a worker's join buffer) in its memo, made at
    offsets from its start: it is found through a view of all of it only, and a memo of
    views of ``plain`` does not keep it alive (no cycle: it goes when its owner drops it)."""
    staging = _buffers.grown_staging(64, 0)
    assert len(staging) == 64 and staging.memo == {} and staging.flags.writeable
    assert _buffers.staging_of(staging) is staging
    assert _buffers.staging_of(staging.data) is staging
    assert _buffers.staging_of(memoryview(staging.data)) is staging
    assert _buffers.staging_of(staging.data[1:]) is None
    assert _buffers.staging_of(staging[:]) is None  # a numpy slice has no memo
    assert _buffers.staging_of(bytearray(64)) is None
    assert _buffers.held_of(staging.data) is None
    plain = staging.plain
    assert type(plain) is np.ndarray and plain.ctypes.data == staging.ctypes.data
    staging.memo["views"] = [plain[8:16], plain[16:]]
    gone = weakref.ref(staging)
    gc.disable()
    try:
        del staging
        assert gone() is None  # freed at once, not by the collector
    finally:
        gc.enable()
    assert _buffers.grown_staging(100, 100).size == int(100 * _buffers.GROWTH)
