"""``backends/_buffers.py``: fresh buffers filled in place, zero-copy views, the huge-page hint."""

from __future__ import annotations

import numpy as np
import pytest

from kvwarm.backends import _buffers
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
