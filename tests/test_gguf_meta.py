"""``gguf_meta.read_tensors`` on hostile tensor tables (a LoRA adapter is checked with it
before llama.cpp loads it): every bad table is a ``ValueError`` at once, read without
allocating what a count or length claims, and a long table is never held whole."""

from __future__ import annotations

import io
import struct
import tracemalloc
from pathlib import Path

import pytest

from kvwarm import gguf_meta


def _header(n_tensors: int) -> bytes:
    return gguf_meta.MAGIC + struct.pack("<IQQ", 3, n_tensors, 0)


def _entry(name: bytes, shape: tuple[int, ...] = (16, 4), ggml_type: int = 0) -> bytes:
    return (
        struct.pack("<Q", len(name))
        + name
        + struct.pack(f"<I{len(shape)}Q", len(shape), *shape)
        + struct.pack("<IQ", ggml_type, 0)
    )


class _Reads(io.BytesIO):
    """A file that remembers the largest read asked of it."""

    largest = 0

    def read(self, n: int | None = -1) -> bytes:
        self.largest = max(self.largest, -1 if n is None else n)
        return super().read(n)


def _tensors(data: bytes) -> list[gguf_meta.TensorInfo]:
    f = io.BytesIO(data)
    meta = gguf_meta.read_metadata(f, len(data), ())
    return list(gguf_meta.read_tensors(f, len(data), meta.n_tensors))


def test_a_table_reads_back() -> None:
    data = _header(2) + _entry(b"blk.0.attn_q.weight.lora_a") + _entry(b"x", (3, 5, 7), 1)
    assert _tensors(data) == [
        gguf_meta.TensorInfo("blk.0.attn_q.weight.lora_a", (16, 4), 0),
        gguf_meta.TensorInfo("x", (3, 5, 7), 1),
    ]


@pytest.mark.parametrize("count", [2**64 - 1, 2**40, 1000])
def test_a_count_past_what_the_file_holds_is_refused_before_any_entry(count: int) -> None:
    """1,000 entries cannot fit in the bytes left (each takes 32 or more)."""
    data = _header(count) + _entry(b"a") * 3
    with pytest.raises(ValueError, match="tensor count"):
        _tensors(data)


def test_a_name_length_up_to_the_file_is_refused_without_reading_it() -> None:
    """llama.cpp refuses a name of GGML_MAX_NAME (64) bytes or more; the merged reader took
    any length up to the file's size and read it into one string (a 4 GB adapter: 4 GB)."""
    name = b"n" * (1 << 20)
    data = _header(1) + _entry(name)
    f = _Reads(data)
    meta = gguf_meta.read_metadata(f, len(data), ())
    with pytest.raises(ValueError, match="name"):
        list(gguf_meta.read_tensors(f, len(data), meta.n_tensors))
    assert f.largest < 4096
    # 63 bytes is a name llama.cpp takes.
    assert _tensors(_header(1) + _entry(b"n" * 63))[0].name == "n" * 63


@pytest.mark.parametrize(
    "tail",
    [
        b"",  # no entry at all
        struct.pack("<Q", 10) + b"abc",  # a name cut short
        _entry(b"a")[:-5],  # an offset cut short
        struct.pack("<Q", 1) + b"a" + struct.pack("<I", 0) + b"\0" * 40,  # no dimensions
        struct.pack("<Q", 1) + b"a" + struct.pack("<I", 2**32 - 1) + b"\0" * 40,  # 4 billion
    ],
)
def test_a_broken_table_is_a_value_error(tail: bytes) -> None:
    data = _header(1) + tail + b"\0" * 40 * (tail == b"")
    with pytest.raises(ValueError):
        _tensors(data)


def test_overflowing_dimensions_and_offsets_are_read_as_numbers() -> None:
    """A dimension or offset of 2**64 - 1 is llama.cpp's to refuse (its reader checks sizes
    and offsets against the file): read here as the number it is, never an exception of
    another type."""
    data = _header(1) + _entry(b"w.lora_a", (2**64 - 1, 2**63)).replace(
        struct.pack("<IQ", 0, 0), struct.pack("<IQ", 0, 2**64 - 1)
    )
    assert _tensors(data)[0].shape == (2**64 - 1, 2**63)


def test_a_long_table_is_never_held_whole(tmp_path: Path) -> None:
    """200,000 entries (a 7 MB file): read one at a time, a few hundred KB at most; the
    merged reader built the whole list first (some 40 MB)."""
    n = 200_000
    path = tmp_path / "many.gguf"
    path.write_bytes(_header(n) + _entry(b"blk.0.norm") * n)
    tracemalloc.start()
    try:
        with gguf_meta.tensors_of(path) as tensors:
            seen = sum(1 for _ in tensors)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seen == n
    assert peak < 2 << 20, peak


def _kv(key: bytes, vtype: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + payload


def _with_kvs(*kvs: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)


def test_read_values_decodes_what_is_wanted_and_skips_the_rest() -> None:
    strings = struct.pack("<IQ", 8, 2) + b"".join(
        struct.pack("<Q", len(s)) + s for s in (b"a", b"")
    )
    data = _with_kvs(
        _kv(b"x.block_count", 4, struct.pack("<I", 7)),
        _kv(b"tokenizer.ggml.tokens", 9, strings),
        _kv(b"skipped", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 0, 3) + b"abc"),
        _kv(b"x.scale", 6, struct.pack("<f", 0.5)),
    )
    got = gguf_meta.read_values(data, lambda key: key != "skipped")
    assert (got.n_tensors, got.tensors_at) == (0, len(data))
    assert got.values == {"x.block_count": 7, "tokenizer.ggml.tokens": [b"a", b""], "x.scale": 0.5}


@pytest.mark.parametrize(
    "kv",
    [
        _kv(b"s", 8, struct.pack("<Q", 1 << 40)),  # a string longer than the file
        _kv(b"a", 9, struct.pack("<IQ", 8, 1 << 40)),  # more strings than bytes left
        _kv(b"n", 9, struct.pack("<IQ", 4, 1 << 60)),  # an array of uint32 past the end
        _kv(b"t", 99, b""),  # no such type
    ],
)
def test_read_values_refuses_lengths_past_the_end(kv: bytes) -> None:
    with pytest.raises(ValueError):
        gguf_meta.read_values(_with_kvs(kv), lambda _key: True)
