"""The KV chunk codec (``kv_split`` / ``kv_join``), checked identically on both backends.

Runs on the stub and, with the ``model`` marker, on llama.cpp (the fixtures of
``tests/backends/conftest.py``): what the engine may rely on whichever backend it drives.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from tests.backends.conftest import running

from kvwarm.backends import kv_chunk
from kvwarm.backends.base import BackendContext, BackendModel, BatchToken, Buffer, KvCodec
from kvwarm.backends.llama.kv_layout import HEAD
from kvwarm.buffers import u8
from kvwarm.errors import (
    HandleClosedError,
    InvalidRequestError,
    JoinBufferTooSmallError,
    StateRestoreError,
)

TEXT = (
    "Chunks of KV: every token's keys and values, cut by position and glued back. The fishermen "
    "mended their nets, sang old songs and argued about the weather."
)


@pytest.fixture(scope="module")
def packed(model: BackendModel) -> tuple[list[int], bytes]:
    """TEXT's tokens and their blob, prefilled once per backend (prefill is the slow part)."""
    ctx = model.new_context(running(model))
    try:
        tokens = model.tokenize(TEXT)
        ctx.prefill(0, tokens, 0)
        return tokens, ctx.kv_pack(0)
    finally:
        ctx.close()


def _prefilled(
    packed: tuple[list[int], bytes], ctx: BackendContext, seq: int = 0
) -> tuple[list[int], bytes]:
    """``packed`` restored into ``seq``, and that sequence's own blob."""
    tokens, blob = packed
    assert ctx.kv_unpack(seq, blob) == len(tokens)
    return tokens, ctx.kv_pack(seq)


def _meta_at(chunk: bytes) -> int:
    """Where a chunk's cell metadata starts: its body, past the body's own blob head when
    the body is a whole blob (``FLAG_BLOB``)."""
    view = kv_chunk.parse(u8(chunk), chunk[5])  # byte 5 names the codec
    return len(chunk) - view.body.size + (HEAD.size if view.flags & kv_chunk.FLAG_BLOB else 0)


def _refused(ctx: BackendContext, chunks: list[Buffer]) -> None:
    """Every way of restoring ``chunks`` refuses them before touching the sequence: in
    place, and joined and restored in one call (``kv_unpack_joined``, which checks only the
    positions of what its join wrote, so the chunks' own checks are what refuse them)."""
    with pytest.raises(StateRestoreError):
        ctx.kv_join(chunks)
    before = ctx.kv_pack(1)
    with pytest.raises(StateRestoreError):
        ctx.kv_unpack_chunks(1, chunks)
    assert ctx.kv_pack(1) == before
    with pytest.raises(StateRestoreError):
        ctx.kv_unpack_joined(1, chunks, bytearray(1 << 22))
    assert ctx.kv_pack(1) == before


def _bounds(n: int) -> list[list[int]]:
    """Aligned (n_batch 32) and unaligned cuts, one-token chunks, a single chunk."""
    return [
        [0, n],
        [0, 32, n],
        [0, 7, 30, 31, n],
        list(range(n + 1)),
        [0, 1, n - 1, n],
    ]


def test_codec_satisfies_protocol(ctx: BackendContext) -> None:
    assert isinstance(ctx.kv_codec, KvCodec)


@pytest.mark.parametrize("cut", range(5))
def test_split_join_round_trip_is_byte_identical(
    packed: tuple[list[int], bytes], ctx: BackendContext, cut: int
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    n = len(tokens)
    assert n > 33
    bounds = _bounds(n)[cut]
    chunks = ctx.kv_split(blob, bounds)
    assert len(chunks) == len(bounds) - 1
    assert all(isinstance(c, bytes) for c in chunks)
    for chunk, (a, b) in zip(chunks, itertools.pairwise(bounds), strict=True):
        assert ctx.kv_codec.chunk_range(chunk) == (a, b - a)
    joined = ctx.kv_join(chunks)
    assert isinstance(joined, bytearray)
    assert joined == blob
    # Any buffer type is accepted on the way in.
    assert ctx.kv_join([memoryview(c) for c in chunks]) == blob
    assert ctx.kv_split(memoryview(blob), bounds) == chunks


def test_chunk_bytes_depend_only_on_content(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    # The same tokens in another sequence give the same chunks; a chunk is cut the same
    # whether the split asked for every range or only the later ones.
    tokens, blob0 = _prefilled(packed, ctx, seq=0)
    _, blob1 = _prefilled(packed, ctx, seq=1)
    n = len(tokens)
    full = ctx.kv_split(blob0, [0, 10, 20, n])
    assert ctx.kv_split(blob1, [0, 10, 20, n]) == full
    assert ctx.kv_split(blob0, [10, 20, n]) == full[1:]
    assert ctx.kv_split(blob0, [0, 10]) == full[:1]
    assert ctx.kv_join(ctx.kv_split(blob1, [0, n])) == blob0


@pytest.mark.parametrize("start", [1, 10, 32])
def test_a_packed_tail_cuts_into_the_whole_blobs_chunks(
    packed: tuple[list[int], bytes], ctx: BackendContext, start: int
) -> None:
    # A save packs only the positions its tier lacks: the tail's chunks are byte for byte
    # those of the whole sequence's blob, so rows sharing them stay deduplicated.
    tokens, blob = _prefilled(packed, ctx)
    n = len(tokens)
    mid = (start + n) // 2
    tail, first = ctx.kv_pack_tail(0, start)
    assert first == start and len(tail) < len(blob)
    whole = ctx.kv_split(blob, [start, mid, n])
    assert ctx.kv_split(tail, [start, mid, n]) == whole
    assert ctx.kv_split(tail, [mid, n]) == whole[1:]
    assert ctx.kv_join(ctx.kv_split(blob, [0, start]) + whole) == blob
    with pytest.raises(InvalidRequestError):
        ctx.kv_split(tail, [start - 1, n])  # the tail does not hold start - 1
    # Packing the tail left the sequence (and the scratch it went through) as they were.
    assert ctx.kv_pack(0) == blob
    assert ctx.kv_pack_tail(0, start) == (tail, start)


def test_a_tail_is_never_restored_as_a_sequence(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    _, blob = _prefilled(packed, ctx)
    assert ctx.kv_pack_tail(0, 0) == (blob, 0)
    tail, _ = ctx.kv_pack_tail(0, 10)
    with pytest.raises(StateRestoreError):
        ctx.kv_unpack(1, tail)  # positions 10.. without 0..9: never a prefix
    assert ctx.seq_pos_max(1) == -1
    with pytest.raises(InvalidRequestError):
        ctx.kv_pack_tail(0, -1)


@pytest.mark.parametrize("j", [1, 2, 3])
def test_join_of_a_prefix_equals_pack_of_that_prefix(
    packed: tuple[list[int], bytes], ctx: BackendContext, j: int
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    bounds = [0, 5, 32, len(tokens)]
    chunks = ctx.kv_split(blob, bounds)
    prefix = ctx.kv_join(chunks[:j])
    ctx.seq_rm(0, bounds[j])
    assert prefix == ctx.kv_pack(0)


def test_joined_blob_restores_like_the_packed_one(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    n = len(tokens)
    joined = ctx.kv_join(ctx.kv_split(blob, [0, 3, 17, 32, n]))
    ctx.clear()
    assert ctx.kv_unpack(0, blob) == n
    assert ctx.kv_unpack(1, joined) == n
    nxt = tokens[2]
    ctx.decode([BatchToken(nxt, n, 0, logits=True), BatchToken(nxt, n, 1, logits=True)])
    assert bytes(ctx.logits(0)) == bytes(ctx.logits(1))


@pytest.mark.parametrize("cut", range(5))
def test_chunks_restore_in_place_like_the_joined_blob(
    packed: tuple[list[int], bytes], ctx: BackendContext, cut: int
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    n = len(tokens)
    chunks = ctx.kv_split(blob, _bounds(n)[cut])
    ctx.clear()
    assert ctx.kv_unpack(0, blob) == n
    ctx.prefill(1, tokens[:3], 0)  # stale KV the restore must clear first
    assert ctx.kv_unpack_chunks(1, [memoryview(c) for c in chunks]) == n
    assert ctx.seq_pos_max(1) == n - 1
    # The same cells (split + join gives seq 1's blob with the seq id as 0), decoding alike.
    assert ctx.kv_join(ctx.kv_split(ctx.kv_pack(1), [0, n])) == blob
    nxt = tokens[2]
    ctx.decode([BatchToken(nxt, n, 0, logits=True), BatchToken(nxt, n, 1, logits=True)])
    assert bytes(ctx.logits(0)) == bytes(ctx.logits(1))
    # A prefix of the chunks restores that prefix.
    assert ctx.kv_unpack_chunks(1, chunks[:1]) == _bounds(n)[cut][1]
    assert ctx.kv_unpack_chunks(1, []) == 0
    assert ctx.seq_pos_max(1) == -1


def test_empty_sequence(ctx: BackendContext) -> None:
    empty = ctx.kv_pack(0)
    assert ctx.kv_split(empty, [0]) == []
    joined = ctx.kv_join([])
    assert ctx.kv_unpack(1, joined) == 0
    assert ctx.seq_pos_max(1) == -1


def test_bad_bounds_are_invalid_requests(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    n = len(tokens)
    for bounds in ([0], [0, n + 1], [-1, n], [0, 5, 5, n], [0, 9, 4, n], []):
        with pytest.raises(InvalidRequestError):
            ctx.kv_split(blob, bounds)


def test_chunks_out_of_order_missing_or_repeated_are_refused(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    a, b, c = ctx.kv_split(blob, [0, 10, 20, len(tokens)])
    ctx.prefill(1, tokens[:5], 0)
    for chunks in ([b, a, c], [a, c], [b, c], [a, a, b, c], [a, b, b, c]):
        _refused(ctx, list(chunks))


def test_truncated_or_extended_chunks_are_refused(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    _, blob = _prefilled(packed, ctx)
    (chunk,) = ctx.kv_split(blob, [0, 4])
    for bad in (chunk[:-1], chunk + b"\0", chunk[: len(chunk) // 2], chunk[:8], b""):
        _refused(ctx, [bad])
        with pytest.raises(StateRestoreError):
            ctx.kv_codec.chunk_range(bad)


def test_corrupt_cell_metadata_is_refused(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    # The body's first bytes are cell 0's position: the envelope's CRC does not cover them,
    # the codec's own check does.
    _, blob = _prefilled(packed, ctx)
    (chunk,) = ctx.kv_split(blob, [0, 4])
    bad = bytearray(chunk)
    bad[_meta_at(chunk)] ^= 1
    _refused(ctx, [bad])


def test_chunks_of_other_cell_types_are_refused(
    packed: tuple[list[int], bytes], model: BackendModel, ctx: BackendContext
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    other = model.new_context(replace(ctx.params, type_k="q8_0"))
    try:
        other.prefill(0, tokens[:6], 0)
        foreign = other.kv_split(other.kv_pack(0), [0, 6])
        _refused(ctx, list(foreign))
        with pytest.raises(StateRestoreError):
            ctx.kv_split(other.kv_pack(0), [0, 6])
        mine = ctx.kv_split(blob, [0, 10, len(tokens)])
        _refused(other, list(mine))
    finally:
        other.close()


def test_blobs_that_are_not_blobs_are_refused(ctx: BackendContext) -> None:
    for bad in (b"", b"\0" * 15, b"\0" * 4096, b"\xff" * 64):
        with pytest.raises(StateRestoreError):
            ctx.kv_split(bad, [0, 1])


def test_codec_outlives_its_context(packed: tuple[list[int], bytes], model: BackendModel) -> None:
    ctx = model.new_context(running(model))
    tokens, blob = _prefilled(packed, ctx)
    codec = ctx.kv_codec
    ctx.close()
    with pytest.raises(HandleClosedError):
        ctx.kv_split(blob, [0, len(tokens)])
    with pytest.raises(HandleClosedError):
        ctx.kv_join([])
    with pytest.raises(HandleClosedError):
        ctx.kv_unpack_chunks(0, [])
    assert codec.join(codec.split(blob, [0, 9, len(tokens)])) == blob


def test_strided_buffers_are_refused_not_crashed(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    _, blob = _prefilled(packed, ctx)
    strided = memoryview(blob)[::2]
    with pytest.raises(StateRestoreError):
        ctx.kv_unpack(1, strided)
    with pytest.raises(StateRestoreError):
        ctx.kv_split(strided, [0, 1])
    (chunk,) = ctx.kv_split(blob, [0, 1])
    _refused(ctx, [memoryview(chunk)[::2]])


# ---- join into a caller's buffer (out=): the engine's reused restore buffer ---------------


@pytest.mark.parametrize("cut", range(5))
def test_join_into_a_supplied_buffer_equals_a_fresh_join(
    packed: tuple[list[int], bytes], ctx: BackendContext, cut: int
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    chunks = ctx.kv_split(blob, _bounds(len(tokens))[cut])
    assert ctx.kv_codec.joined_size(chunks) == len(blob)
    out = bytearray(b"\xaa" * (len(blob) + 100))
    joined = ctx.kv_join(chunks, out=out)
    assert isinstance(joined, memoryview)
    assert joined.nbytes == len(blob)
    assert joined.tobytes() == ctx.kv_join(chunks) == blob
    assert out[len(blob) :] == b"\xaa" * 100  # nothing written past the joined blob
    # A writable memoryview is as good as a bytearray, and the view restores in place.
    again = ctx.kv_join(chunks, out=memoryview(bytearray(len(blob))))
    assert again.tobytes() == blob
    assert ctx.kv_unpack(1, joined) == len(tokens)
    assert ctx.seq_pos_max(1) == len(tokens) - 1


def test_too_small_or_read_only_buffers_are_refused_untouched(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    chunks = ctx.kv_split(blob, [0, 10, len(tokens)])
    short = bytearray(b"\x55" * (len(blob) - 1))
    with pytest.raises(JoinBufferTooSmallError) as info:
        ctx.kv_join(chunks, out=short)
    assert info.value.needed == len(blob)
    assert short == b"\x55" * (len(blob) - 1)
    with pytest.raises(JoinBufferTooSmallError):
        ctx.kv_join([], out=bytearray(0))
    with pytest.raises(InvalidRequestError):
        ctx.kv_join(chunks, out=memoryview(bytes(len(blob))))
    # A bad chunk is refused before the buffer is looked at, as without out=.
    with pytest.raises(StateRestoreError):
        ctx.kv_join([chunks[1], chunks[0]], out=bytearray(len(blob)))


def test_one_buffer_reused_across_joins_of_different_sizes(
    packed: tuple[list[int], bytes], ctx: BackendContext
) -> None:
    tokens, blob = _prefilled(packed, ctx)
    bounds = [0, 7, 30, 31, len(tokens)]
    chunks = ctx.kv_split(blob, bounds)
    out = bytearray(len(blob))
    for j in (len(chunks), 1, 3, 0, len(chunks), 2):
        joined = ctx.kv_join(chunks[:j], out=out)
        assert joined.tobytes() == ctx.kv_join(chunks[:j])
        assert joined.nbytes == ctx.kv_codec.joined_size(chunks[:j])
        assert ctx.kv_unpack(1, joined) == (bounds[j] if j else 0)
        del joined
