"""Byte buffers shared by the KV codecs and the cache's readers: zero-copy read views, fresh
``bytes`` filled in place, and reusable buffers that grow with headroom.

Invariants: ``u8`` never copies (a non-contiguous or non-buffer argument is a
``StateRestoreError``); ``fresh_bytes`` returns an unshared ``bytes`` with a writable view
onto it that is valid only until the ``bytes`` is handed out, so the content is written once
and never copied again (``bytes(bytearray)`` would copy it a second time). Fresh buffers of
megabytes ask the kernel for huge pages first (``advise_huge``): filling 45 MiB of new 4 KiB
pages cost ~55 ms here, three times the copy itself (``bench/kv_chunks.py``). ``join_target``
lets a caller avoid that cost entirely by passing a buffer it keeps (already faulted in).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvwarm.errors import InvalidRequestError, JoinBufferTooSmallError, StateRestoreError

U8 = npt.NDArray[np.uint8]

_HUGE = 1 << 21  # a transparent huge page on x86-64 and arm64
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_madvise = None
if sys.platform == "linux" and _MADV_HUGEPAGE is not None:
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def advise_huge(address: int, size: int) -> None:
    """Ask for transparent huge pages on the 2 MiB-aligned inside of ``[address, +size)``,
    before it is first written (the kernel then maps it with a few hundred faults instead of
    thousands). Only whole pages inside the caller's own buffer are advised, so nothing else
    is affected; the hint is best effort and silently absent off Linux."""
    if _madvise is None or size < 2 * _HUGE:
        return
    lo = (address + _HUGE - 1) & ~(_HUGE - 1)
    hi = (address + size) & ~(_HUGE - 1)
    if hi > lo:
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)


def _address(buf: bytes | bytearray) -> int:
    if isinstance(buf, bytearray):
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return cast(int, ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value)


def uninitialised_bytes(n: int) -> bytes:
    """A fresh, unshared ``bytes`` of ``n`` bytes whose content the caller must fill.

    CPython's ``PyBytes_FromStringAndSize(NULL, n)``: the documented way for native code to
    build a bytes object in place, skipping the zero-fill and the copy of ``bytes(bytearray)``.
    """
    out = cast(bytes, _new_bytes(None, n))
    advise_huge(_address(out), n)
    return out


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.restype = ctypes.py_object
_new_bytearray.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def uninitialised_bytearray(n: int) -> bytearray:
    """A new ``bytearray`` of ``n`` bytes, not zero-filled (``bytearray(n)`` writes every byte
    once before the caller writes it again); the caller must fill all of it."""
    out = cast(bytearray, _new_bytearray(None, n))
    if n:
        advise_huge(_address(out), n)
    return out


#: Headroom a reused buffer grows by, so prompts creeping up by a few tokens (each turn of a
#: chat) do not allocate again on every restore.
GROWTH = 1.25


def grown(need: int, old: int) -> bytearray:
    """A new reusable buffer of at least ``need`` bytes, ``GROWTH`` times the ``old`` one's
    size if that is more, not zero-filled: the caller fills what it reads back. Zero-filling
    26 MiB of fresh pages took ~22 ms here; a chat whose row grew each turn paid it on every
    restore."""
    return uninitialised_bytearray(max(need, int(old * GROWTH)))


def fresh_bytes(n: int) -> tuple[bytes, U8]:
    """``(out, view)``: a new ``bytes`` of ``n`` bytes and a writable uint8 view of its content.

    The caller fills ``view`` completely, drops it, then publishes ``out``; nobody else holds
    ``out`` before that, so writing into it is as safe as C filling a new bytes object.
    """
    out = uninitialised_bytes(n)
    if n == 0:
        return out, np.zeros(0, dtype=np.uint8)
    view: U8 = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(_address(out)))
    return out, view


def u8(data: bytes | bytearray | memoryview, what: str = "KV blob") -> U8:
    """A zero-copy uint8 view of ``data`` (read-only unless ``data`` is writable)."""
    try:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        return np.frombuffer(view, dtype=np.uint8)
    except (ValueError, TypeError, BufferError) as exc:
        raise StateRestoreError(f"{what} is not a contiguous buffer: {exc}") from exc


def join_target(size: int, out: bytearray | memoryview | None) -> tuple[U8, bytearray | memoryview]:
    """``(dst, result)`` for a join of ``size`` bytes: a writable uint8 view to fill, and what
    ``join`` returns. Without ``out``, a fresh ``bytearray``; with it, ``out``'s first ``size``
    bytes (a ``memoryview`` onto the caller's buffer, which is refused if read-only or short:
    nothing is written then)."""
    if out is None:
        fresh = uninitialised_bytearray(size)
        return np.frombuffer(fresh, dtype=np.uint8), fresh
    view = memoryview(out)
    if view.readonly or not view.contiguous:
        raise InvalidRequestError("kv_join out= must be a writable contiguous buffer", param="out")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view.nbytes < size:
        raise JoinBufferTooSmallError(
            f"kv_join out= holds {view.nbytes} bytes; the joined blob needs {size}", needed=size
        )
    head = view[:size]
    return np.frombuffer(head, dtype=np.uint8), head


class Held(np.ndarray[Any, np.dtype[np.uint8]]):
    """Immutable bytes a process holds for readers (the ``ram`` tier's chunks), as a read-only
    uint8 array, with ``memo``: what a reader derived from these bytes once (a codec's parse
    and checks of a chunk's envelope), kept for the next read of the same object.

    ``held`` makes one over a ``bytes`` object, which no one can change, and numpy refuses to
    make the array writable again, so a memo stays true for the object's whole life. A memo
    must not reference the ``Held`` itself (that would be a reference cycle: the bytes would
    wait for the garbage collector instead of going when the tier drops them); views of
    ``plain`` are fine."""

    memo: dict[object, object]

    @property
    def plain(self) -> U8:
        """A plain read-only array over the same bytes, which does not reference this
        ``Held``: what a memo may keep views of (a codec's views of a chunk's runs)."""
        base = self.base
        assert type(base) is np.ndarray and not base.flags.writeable, "made by held()"
        return cast(U8, base)


def held(data: bytes) -> Held:
    """``data`` as a ``Held`` with an empty memo (no copy)."""
    out = np.frombuffer(data, dtype=np.uint8).view(Held)
    out.memo = {}
    return out


def held_of(chunk: object) -> Held | None:
    """The ``Held`` a buffer is or views whole (a ``memoryview`` of all of one), else None:
    a memo describes all of its bytes, so a view of a part of them (a slice of the
    ``memoryview``, or of the array: numpy makes that a ``Held`` without a memo) is not
    one."""
    return _memo_owner(chunk, Held)


class Staging(np.ndarray[Any, np.dtype[np.uint8]]):
    """A reusable writable buffer that joins are written into (a worker's ``JoinBuffer``), as
    a uint8 array, with ``memo``: views of its bytes a codec made once for a join plan (the
    targets of the plan's copies, which depend on nothing else), kept for the next join of
    that plan into the same buffer. As for ``Held``, a memo keeps views of ``plain`` only,
    never of the ``Staging``, so the buffer goes when its owner drops it."""

    memo: dict[object, object]

    @property
    def plain(self) -> U8:
        """A plain array over the same bytes, which does not reference this ``Staging``."""
        base = self.base
        assert type(base) is np.ndarray, "made by grown_staging()"
        return cast(U8, base)


def grown_staging(need: int, old: int) -> Staging:
    """``grown``'s buffer as a ``Staging`` with an empty memo."""
    out = np.frombuffer(grown(need, old), dtype=np.uint8).view(Staging)
    out.memo = {}
    return out


def staging_of(out: object) -> Staging | None:
    """The ``Staging`` a buffer is or views whole (a ``memoryview`` of all of one), else
    None: a memo's views lie at offsets from the buffer's start."""
    return _memo_owner(out, Staging)


_Owner = TypeVar("_Owner", Held, Staging)


def _memo_owner(buffer: object, kind: type[_Owner]) -> _Owner | None:
    """The array of ``kind`` with a memo that ``buffer`` is or views whole, else None."""
    if isinstance(buffer, memoryview):
        obj: object = buffer.obj
        if (
            type(obj) is kind
            and buffer.nbytes == obj.nbytes
            and buffer.c_contiguous  # its bytes in their order (not ``[::-1]``)
            and hasattr(obj, "memo")  # not a numpy slice's memo-less array
        ):
            return obj
    elif type(buffer) is kind and hasattr(buffer, "memo"):
        return buffer
    return None
