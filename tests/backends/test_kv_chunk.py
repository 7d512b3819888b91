"""The chunk envelope (``backends/kv_chunk.py``) on stub chunks: nothing corrupt gets through.

Every single-bit flip of the envelope, every truncation and random damage anywhere in it must
be a ``StateRestoreError`` from ``join`` and ``chunk_range``, never another exception and never
a blob. (The same sweep on llama.cpp chunks: ``test_llama_kv_codec.py``.)
"""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwarm.backends import kv_chunk
from kvwarm.backends.base import ContextParams
from kvwarm.backends.stub import OFFSET, StubBackend, StubContext
from kvwarm.backends.stub.kv_codec import HEADER
from kvwarm.errors import InvalidRequestError, StateRestoreError

P = ContextParams(n_ctx=128, n_batch=16, n_ubatch=16, n_seq_max=2)
TOKENS = [OFFSET + b for b in b"stub chunks, every bit checked"]


def _ctx(**backend: int) -> StubContext:
    return StubBackend(**backend).load_model("m").new_context(P)


CTX = _ctx()
CTX.prefill(0, TOKENS, 0)
BLOB = CTX.kv_pack(0)
CHUNKS = CTX.kv_split(BLOB, [0, 5, 12, len(TOKENS)])
ENVELOPE = kv_chunk.header_size(b"\0" * 12)  # the stub's descriptor is 12 bytes


def _refused(chunks: list[bytes | bytearray]) -> None:
    with pytest.raises(StateRestoreError):
        CTX.kv_join(chunks)


def test_envelope_size_and_fields() -> None:
    chunk = CHUNKS[1]
    magic, version, codec, flags, start, n, desc_len, body_len = struct.unpack_from(
        "<4sBBHIIIQ", chunk
    )
    assert (magic, version, codec, flags) == (b"KVCK", 1, kv_chunk.CODEC_STUB, 0)
    assert (start, n, desc_len) == (5, 7, 12)
    assert len(chunk) == ENVELOPE + body_len == ENVELOPE + 7 * 32
    (crc,) = struct.unpack_from("<I", chunk, ENVELOPE - 4)
    assert crc == zlib.crc32(chunk[: ENVELOPE - 4])
    # The body is the blob's cells verbatim.
    assert chunk[ENVELOPE:] == BLOB[HEADER.size + 5 * 32 : HEADER.size + 12 * 32]


@pytest.mark.parametrize("which", range(3))
def test_every_bit_flip_of_an_envelope_is_refused(which: int) -> None:
    for bit in range(ENVELOPE * 8):
        bad = bytearray(CHUNKS[which])
        bad[bit // 8] ^= 1 << (bit % 8)
        chunks: list[bytes | bytearray] = list(CHUNKS)
        chunks[which] = bad
        _refused(chunks)
        with pytest.raises(StateRestoreError):
            CTX.kv_codec.chunk_range(bad)


def test_every_truncation_is_refused() -> None:
    for cut in range(len(CHUNKS[0])):
        _refused([CHUNKS[0][:cut], *CHUNKS[1:]])


@settings(max_examples=300, deadline=None)
@given(
    which=st.integers(0, 2),
    at=st.integers(0, ENVELOPE - 1),
    junk=st.binary(min_size=1, max_size=16),
)
def test_random_damage_to_an_envelope_is_refused(which: int, at: int, junk: bytes) -> None:
    bad = bytearray(CHUNKS[which])
    end = min(at + len(junk), ENVELOPE)
    patch = bytes(b ^ j for b, j in zip(bad[at:end], junk, strict=False))
    if patch == bytes(bad[at:end]):
        return  # all-zero junk changes nothing
    bad[at:end] = patch
    chunks: list[bytes | bytearray] = list(CHUNKS)
    chunks[which] = bad
    _refused(chunks)


@settings(max_examples=100, deadline=None)
@given(cuts=st.sets(st.integers(1, len(TOKENS) - 1), max_size=len(TOKENS) - 1))
def test_any_bounds_round_trip(cuts: set[int]) -> None:
    bounds = [0, *sorted(cuts), len(TOKENS)]
    assert CTX.kv_join(CTX.kv_split(BLOB, bounds)) == BLOB


def test_a_resealed_envelope_with_wrong_fields_is_still_refused() -> None:
    # Someone who recomputes the CRC still cannot move a chunk, resize it or relabel it.
    chunk = CHUNKS[1]
    body = chunk[ENVELOPE:]
    descriptor = chunk[28 : ENVELOPE - 4]

    def seal(start: int, n: int, codec: int = kv_chunk.CODEC_STUB, flags: int = 0) -> bytes:
        head = struct.pack("<4sBBHIIIQ", b"KVCK", 1, codec, flags, start, n, 12, len(body))
        head += descriptor
        return head + struct.pack("<I", zlib.crc32(head)) + body

    assert seal(5, 7) == chunk
    for bad in (seal(4, 7), seal(5, 6), seal(5, 7, codec=kv_chunk.CODEC_LLAMA), seal(5, 7, 0, 1)):
        _refused([CHUNKS[0], bad, CHUNKS[2]])


def test_chunks_of_another_model_or_cell_size_are_refused() -> None:
    other = StubBackend().load_model("another").new_context(P)
    other.prefill(0, TOKENS, 0)
    _refused(other.kv_split(other.kv_pack(0), [0, len(TOKENS)]))
    wide = _ctx(cell_bytes=48)
    wide.prefill(0, TOKENS, 0)
    _refused(wide.kv_split(wide.kv_pack(0), [0, len(TOKENS)]))
    with pytest.raises(StateRestoreError):
        CTX.kv_split(wide.kv_pack(0), [0, len(TOKENS)])
    # One foreign chunk among ours, in its right place, is refused too.
    theirs = other.kv_split(other.kv_pack(0), [0, 5, 12, len(TOKENS)])
    _refused([CHUNKS[0], theirs[1], CHUNKS[2]])
    _refused([theirs[0], CHUNKS[1], CHUNKS[2]])


def test_check_bounds() -> None:
    assert kv_chunk.check_bounds([0, 3, 9], 9) == [0, 3, 9]
    assert kv_chunk.check_bounds([4, 9], 9) == [4, 9]
    assert kv_chunk.check_bounds([], 0) == []
    for bad in ([3], [0, 10], [-1, 2], [2, 2], [0, 5, 3, 9]):
        with pytest.raises(InvalidRequestError):
            kv_chunk.check_bounds(bad, 9)
