"""Byte buffers shared by the KV codecs: zero-copy read views, and fresh ``bytes`` filled in place.

Invariants: ``u8`` never copies (a non-contiguous or non-buffer argument is a
``StateRestoreError``); ``fresh_bytes`` returns an unshared ``bytes`` with a writable view
onto it that is valid only until the ``bytes`` is handed out, so the content is written once
and never copied again (``bytes(bytearray)`` would copy it a second time).
"""

from __future__ import annotations

import ctypes
from typing import cast

import numpy as np
import numpy.typing as npt

from kvwarm.errors import StateRestoreError

U8 = npt.NDArray[np.uint8]

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def uninitialised_bytes(n: int) -> bytes:
    """A fresh, unshared ``bytes`` of ``n`` bytes whose content the caller must fill.

    CPython's ``PyBytes_FromStringAndSize(NULL, n)``: the documented way for native code to
    build a bytes object in place, skipping the zero-fill and the copy of ``bytes(bytearray)``.
    """
    return cast(bytes, _new_bytes(None, n))


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def uninitialised_bytearray(n: int) -> bytearray:
    """A new ``bytearray`` of ``n`` bytes, not zero-filled (``bytearray(n)`` writes every byte
    once before the caller writes it again); the caller must fill all of it."""
    return cast(bytearray, _new_bytearray(None, n))


def fresh_bytes(n: int) -> tuple[bytes, U8]:
    """``(out, view)``: a new ``bytes`` of ``n`` bytes and a writable uint8 view of its content.

    The caller fills ``view`` completely, drops it, then publishes ``out``; nobody else holds
    ``out`` before that, so writing into it is as safe as C filling a new bytes object.
    """
    out = uninitialised_bytes(n)
    if n == 0:
        return out, np.zeros(0, dtype=np.uint8)
    addr = ctypes.cast(ctypes.c_char_p(out), ctypes.c_void_p).value
    view: U8 = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(cast(int, addr)))
    return out, view


def u8(data: bytes | bytearray | memoryview, what: str = "KV blob") -> U8:
    """A zero-copy uint8 view of ``data`` (read-only unless ``data`` is writable)."""
    try:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        return np.frombuffer(view, dtype=np.uint8)
    except (ValueError, TypeError) as exc:
        raise StateRestoreError(f"{what} is not a contiguous buffer: {exc}") from exc
