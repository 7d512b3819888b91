"""A GGUF file's metadata, read without llama.cpp: its key/value section walked once.

Used where a file must be judged before anything native opens it: the model fingerprint's
``gguf_chunked`` mode (``engine/fingerprint.py``: where the tensor table and data start) and
the settings' check that a configured LoRA adapter is an adapter made for its model's
architecture (``settings/model.py``), and the shapes and types of a LoRA adapter's tensors,
which llama.cpp does not check before its graph asserts on them (``read_tensors``,
``backends/llama/adapter.py``), and the values a model or projector file is checked by before
llama.cpp loads it (``read_values``, ``backends/llama/model_file.py``), and whether a model
will generate, which its pooling and attention say before it loads (``arch_values``,
``engine/speculating.py``). Imports nothing of kvwarm.

Invariant: only the values of the keys asked for are decoded (strings and unsigned ints);
every other value is skipped by its declared size, and a size that points past the file's end
is a ``ValueError``, never a read of gigabytes; so is an array of arrays, which gguf.cpp
refuses (the walk never recurses).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
# Byte sizes of fixed-size GGUF metadata value types (uint8 … float64, bool).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32, _STRING, _ARRAY = 4, 8, 9
#: GGUF's value types by id (``gguf_type``), for messages.
TYPE_NAMES = {
    0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
    7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64",
}  # fmt: skip
#: ggml's GGML_MAX_DIMS: a tensor of more dimensions is no GGUF llama.cpp reads.
_MAX_DIMS = 4
#: ggml's GGML_MAX_NAME: llama.cpp's GGUF reader refuses a tensor name this long or longer.
_MAX_NAME = 64
#: The fewest bytes a tensor table entry takes: name length, dimension count, one
#: dimension, type, offset.
_MIN_TENSOR_ENTRY = 8 + 4 + 8 + 4 + 8


@dataclass(frozen=True, slots=True)
class Metadata:
    """What ``read_metadata`` found: the version, the tensor count, and the values of the keys
    asked for that are strings or uint32 (others are absent). The file is left positioned at
    the tensor table."""

    version: int
    n_tensors: int
    values: dict[str, str | int]


#: An array whose elements are arrays: gguf.cpp refuses the file ("invalid GGUF type"), and
#: walking one by recursion ended in a RecursionError (found by review: a key of arrays nested
#: a few thousand deep made loading the file a traceback, not a ``ModelLoadError``).
_NESTED = "an array of arrays (gguf.cpp refuses them)"


def unpack_from_file(f: BinaryIO, fmt: str) -> tuple[int, ...]:
    """The ``struct`` format ``fmt`` read at ``f``'s position; ``ValueError`` at the file's end."""
    n = struct.calcsize(fmt)
    raw = f.read(n)
    if len(raw) != n:
        raise ValueError("truncated header")
    return struct.unpack(fmt, raw)


def read_metadata(f: BinaryIO, size: int, keys: Collection[str]) -> Metadata:
    """Walk ``f``'s GGUF header (v2 or v3) from its start; ``ValueError`` if it is not one."""

    def read(fmt: str) -> tuple[int, ...]:
        return unpack_from_file(f, fmt)

    def read_string() -> bytes:
        (n,) = read("<Q")
        if n > size:
            raise ValueError("string length beyond file")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError("truncated header")
        return raw

    def skip_value(vtype: int) -> None:
        if vtype in _SCALAR_SIZES:
            f.seek(_SCALAR_SIZES[vtype], os.SEEK_CUR)
        elif vtype == _STRING:
            (n,) = read("<Q")
            if n > size:
                raise ValueError("string length beyond file")
            f.seek(n, os.SEEK_CUR)
        elif vtype == _ARRAY:
            (etype,) = read("<I")
            (count,) = read("<Q")
            if etype in _SCALAR_SIZES:
                if _SCALAR_SIZES[etype] * count > size:
                    raise ValueError("array beyond file")
                f.seek(_SCALAR_SIZES[etype] * count, os.SEEK_CUR)
            elif etype == _ARRAY:
                raise ValueError(_NESTED)
            else:
                if count > size:
                    raise ValueError("array beyond file")
                for _ in range(count):
                    skip_value(etype)
        else:
            raise ValueError(f"unknown metadata type {vtype}")

    if f.read(4) != MAGIC:
        raise ValueError("bad magic")
    (version,) = read("<I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = read("<QQ")
    wanted = {k.encode() for k in keys}
    values: dict[str, str | int] = {}
    for _ in range(n_kv):
        key = read_string()
        (vtype,) = read("<I")
        if key in wanted and vtype == _STRING:
            values[key.decode()] = read_string().decode("utf-8", "replace")
        elif key in wanted and vtype == _UINT32:
            (values[key.decode()],) = read("<I")
        else:
            skip_value(vtype)
    return Metadata(version, n_tensors, values)


def metadata_of(path: str | os.PathLike[str], keys: Collection[str]) -> dict[str, str | int]:
    """The values of ``keys`` in the GGUF file at ``path``; ``ValueError`` if it is not one,
    ``OSError`` if it cannot be read."""
    p = Path(path)
    with p.open("rb") as f:
        return read_metadata(f, p.stat().st_size, keys).values


#: ``struct`` formats of the fixed-size GGUF value types, for the values ``read_values`` decodes.
_SCALAR_FORMATS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip

#: What ``read_values`` gives for a value: a number, a string's bytes, or an array of either.
Value = int | float | bool | bytes | list[int] | list[float] | list[bool] | list[bytes]
#: What ``read_values`` walks: the file's bytes or an ``mmap`` of them.
Buffer = bytes | bytearray | memoryview | mmap.mmap
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Values:
    """What ``read_values`` found: the values decoded, and where the tensor table starts and
    how many entries it has (``read_tensors`` reads it from there); ``types``: each decoded
    value's GGUF type id (``GGUF_TYPE_*``: 6 float32, 8 string, 9 array ...), which its
    Python value does not tell (a float32 and a float64 are both floats)."""

    values: dict[str, Value]
    n_tensors: int
    tensors_at: int
    types: dict[str, int] = field(default_factory=dict)


def read_values(buf: Buffer, wanted: Callable[[str], bool]) -> Values:
    """The GGUF header (v2 or v3) at the start of ``buf`` (the file's bytes, or an ``mmap``
    of them) walked as ``read_metadata`` walks a file, decoding the value of every key
    ``wanted`` says yes to, whatever its type (strings as bytes, arrays as lists); every
    other value is skipped by its declared size. ``ValueError`` if it is not a GGUF header
    (a length past the end, an array of arrays included). Offsets into one buffer,
    not reads of a file: a vocabulary of 262,144 strings is walked in ~0.1 s."""
    view = memoryview(buf)
    size = len(view)
    pos = 0

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise ValueError("truncated header")
        out = struct.unpack_from(fmt, view, pos)
        pos += n
        return out

    def skip(n: int) -> None:
        nonlocal pos
        if n > size - pos:
            raise ValueError("value beyond file")
        pos += n

    def string() -> bytes:
        nonlocal pos
        (n,) = take("<Q")
        if n > size - pos:
            raise ValueError("string length beyond file")
        out = bytes(view[pos : pos + n])
        pos += n
        return out

    def strings(count: int) -> list[bytes]:
        nonlocal pos
        out: list[bytes] = []
        unpack, append = _U64.unpack_from, out.append
        for _ in range(count):
            if pos + 8 > size:
                raise ValueError("truncated header")
            (n,) = unpack(view, pos)
            pos += 8
            if n > size - pos:
                raise ValueError("string length beyond file")
            append(bytes(view[pos : pos + n]))
            pos += n
        return out

    def value(vtype: int, keep: bool) -> Value | None:
        if vtype in _SCALAR_FORMATS:
            if not keep:
                skip(_SCALAR_SIZES[vtype])
                return None
            return take("<" + _SCALAR_FORMATS[vtype])[0]
        if vtype == _STRING:
            if not keep:
                (n,) = take("<Q")
                skip(n)
                return None
            return string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata type {vtype}")
        etype, count = take("<IQ")
        if etype in _SCALAR_FORMATS:
            width = _SCALAR_SIZES[etype]
            if width * count > size - pos:
                raise ValueError("array beyond file")
            if not keep:
                skip(width * count)
                return None
            return list(take(f"<{count}{_SCALAR_FORMATS[etype]}"))
        if etype == _ARRAY:
            raise ValueError(_NESTED)
        if count > size - pos:  # every element takes a byte at least
            raise ValueError("array beyond file")
        if etype == _STRING and keep:
            return strings(count)
        for _ in range(count):
            value(etype, False)
        return None

    try:
        if bytes(view[:4]) != MAGIC:
            raise ValueError("bad magic")
        pos = 4
        (version,) = take("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = take("<QQ")
        values: dict[str, Value] = {}
        types: dict[str, int] = {}
        for _ in range(n_kv):
            key = string().decode("utf-8", "replace")
            (vtype,) = take("<I")
            keep = wanted(key)
            got = value(vtype, keep)
            if keep:
                types[key] = vtype
                if got is not None:
                    values[key] = got
        return Values(values, n_tensors, pos, types)
    finally:
        view.release()  # an mmap cannot close while a view of it lives


def mistyped(found: Values, types: Mapping[str, int]) -> str:
    """The first key of ``types`` (key: the GGUF type id a reader reads it as) that ``found``
    holds as another type, as "KEY is a GGUF FOUND, not the WANTED"; "" if none. gguf.cpp's
    typed getters assert the type, so such a key aborts the process that reads it."""
    for key, wanted in types.items():
        got = found.types.get(key)
        if got is not None and got != wanted:
            return f"{key} is a GGUF {TYPE_NAMES.get(got, str(got))}, not the {TYPE_NAMES[wanted]}"
    return ""


def values_of(path: str | os.PathLike[str], wanted: Callable[[str], bool]) -> Values:
    """``read_values`` of the GGUF file at ``path`` (mapped, not read); ``ValueError`` if it
    is not a GGUF, ``OSError`` if it cannot be read."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError("empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return read_values(buf, wanted)


def arch_values(path: str | os.PathLike[str], names: Collection[str]) -> dict[str, Value]:
    """The values of the keys ``ARCH.NAME`` of the GGUF file at ``path`` for ``names``, by
    ``NAME``, ``ARCH`` its ``general.architecture`` (none if it names none), as
    ``read_values`` decodes them; ``ValueError`` if it is not a GGUF, ``OSError`` if it
    cannot be read. The file is mapped, not read."""
    return architecture(path, names)[1]


def architecture(
    path: str | os.PathLike[str], names: Collection[str] = ()
) -> tuple[str | None, dict[str, Value]]:
    """The GGUF file's ``general.architecture`` (None if it names none) and ``arch_values``
    for ``names``, in one read."""
    ends = tuple(f".{name}" for name in names)
    found = values_of(path, lambda key: key == _ARCH or bool(ends and key.endswith(ends))).values
    arch = found.get(_ARCH)
    if not isinstance(arch, bytes):
        return None, {}
    name = arch.decode("utf-8", "replace")
    prefix = name + "."
    return name, {n: found[prefix + n] for n in names if prefix + n in found}


_ARCH = "general.architecture"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One entry of a GGUF tensor table: ``shape`` in ggml's order (``ne[0]`` first),
    ``ggml_type`` ggml's type id."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int


def read_tensors(f: BinaryIO, size: int, n_tensors: int) -> Iterator[TensorInfo]:
    """The tensor table at ``f``'s position (where ``read_metadata`` leaves it), one entry at
    a time as it is read, so a table of millions of entries is never held at once;
    ``ValueError`` for a table that is not one: a count of more entries than the rest of the
    file could hold, a name of ``GGML_MAX_NAME`` bytes or more (llama.cpp refuses those
    too; a length up to the file's size had it read that many bytes into one string), a
    dimension count llama.cpp does not take, or a table cut short."""
    if n_tensors > max(0, size - f.tell()) // _MIN_TENSOR_ENTRY:
        raise ValueError(f"tensor count {n_tensors} beyond file")
    for _ in range(n_tensors):
        (n,) = unpack_from_file(f, "<Q")
        if n >= _MAX_NAME:
            raise ValueError(f"tensor name of {n} bytes (llama.cpp takes under {_MAX_NAME})")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError("truncated tensor table")
        (n_dims,) = unpack_from_file(f, "<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {raw!r} has {n_dims} dimensions")
        shape = unpack_from_file(f, f"<{n_dims}Q")
        ggml_type, _offset = unpack_from_file(f, "<IQ")
        yield TensorInfo(raw.decode("utf-8", "replace"), tuple(shape), ggml_type)


@contextmanager
def tensors_of(path: str | os.PathLike[str]) -> Iterator[Iterator[TensorInfo]]:
    """The tensor table of the GGUF file at ``path``, read as it is iterated (within the
    ``with``); ``ValueError`` (at the header or while iterating) if it is not one,
    ``OSError`` if it cannot be read."""
    p = Path(path)
    with p.open("rb") as f:
        size = p.stat().st_size
        meta = read_metadata(f, size, ())
        yield read_tensors(f, size, meta.n_tensors)
