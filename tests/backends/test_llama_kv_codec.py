"""The KV chunk codec on the real model: the layout it assumes, every cell type, exactness.

What ``docs/architecture.md`` ("KV state layout") says about llama.cpp's sequence blobs is
asserted here, on the embedded SmolLM2-135M (30 layers, 3 KV heads of 64), for f16, q8_0 and
q4_0 cells, with V stored by cell (flash attention) and transposed (``flash_attn="off"``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from tests.backends.test_llama_exactness import N_BATCH, PARAMS, PROMPT

from kvwarm.backends import kv_chunk
from kvwarm.backends.base import BackendContext, BatchToken, ContextParams, FlashAttn, KvType
from kvwarm.backends.kv_chunk import header_size
from kvwarm.backends.llama import LlamaBackend, LlamaModel
from kvwarm.backends.llama.kv_layout import CELL, HEAD, parse_blob, parse_descriptor
from kvwarm.buffers import grown_staging, held, u8
from kvwarm.embedded import default_model_path
from kvwarm.errors import ConfigError, InvalidRequestError, StateRestoreError

pytestmark = pytest.mark.model

SHORT = (
    "In a small village by the sea, the fishermen woke before dawn. They mended nets, sang "
    "old songs and argued about the weather."
)
# (flash_attn, type_k, type_v): expected v_trans, K row bytes, V bytes per cell.
CONFIGS: list[tuple[FlashAttn, KvType, KvType, int, int, int]] = [
    ("auto", "f16", "f16", 0, 384, 384),
    ("off", "f16", "f16", 1, 384, 384),
    ("on", "q8_0", "q8_0", 0, 204, 204),
    ("on", "q4_0", "q4_0", 0, 108, 108),
    ("auto", "q8_0", "f16", 0, 204, 384),
    ("off", "q4_0", "f16", 1, 108, 384),
]


@pytest.fixture(scope="module")
def llama() -> Iterator[LlamaModel]:
    model = LlamaBackend().load_model(str(default_model_path()))
    yield model
    model.close()


@pytest.fixture(scope="module")
def short(llama: LlamaModel) -> list[int]:
    return llama.tokenize(SHORT)


def _params(flash: FlashAttn, type_k: KvType, type_v: KvType) -> ContextParams:
    return ContextParams(
        n_ctx=256,
        n_batch=N_BATCH,
        n_ubatch=N_BATCH,
        n_threads=2,
        n_seq_max=2,
        type_k=type_k,
        type_v=type_v,
        flash_attn=flash,
    )


def _next_logits(ctx: BackendContext, token: int, pos: int) -> tuple[bytes, bytes]:
    """Decode ``token`` at ``pos`` in seqs 0 and 1 together; both rows' logits."""
    ctx.decode([BatchToken(token, pos, 0, logits=True), BatchToken(token, pos, 1, logits=True)])
    return bytes(ctx.logits(0)), bytes(ctx.logits(1))


@pytest.mark.parametrize(("flash", "type_k", "type_v", "v_trans", "k_row", "v_cell"), CONFIGS)
def test_layout_round_trip_prefix_and_restore(
    llama: LlamaModel,
    short: list[int],
    flash: FlashAttn,
    type_k: KvType,
    type_v: KvType,
    v_trans: int,
    k_row: int,
    v_cell: int,
) -> None:
    ctx = llama.new_context(_params(flash, type_k, type_v))
    try:
        n = len(short)
        ctx.prefill(0, short, 0)
        blob = ctx.kv_pack(0)
        # The layout the codec assumes, field by field.
        assert struct.unpack_from("<IiII", blob) == (0xAF143CD8, 0, 1, n)
        assert struct.unpack_from("<iIi", blob, 16 + 12 * 5) == (5, 1, 0)
        layout = parse_blob(u8(blob))
        assert layout.order is None and layout.structure.v_trans == bool(v_trans)
        assert layout.structure.n_layer == llama.facts.n_layer == 30
        k, v = layout.structure.sections[0], layout.structure.sections[30]
        assert (k.groups, k.unit) == (1, k_row)
        assert (v.groups, v.unit) == ((192, 2) if v_trans else (1, v_cell))
        assert len(blob) == 16 + 8 + 60 * 12 + n * (12 + 30 * (k_row + v_cell))
        # Round trip, unaligned and one-token chunks included.
        bounds = [0, 1, 2, 13, 20, n]
        chunks = ctx.kv_split(blob, bounds)
        assert ctx.kv_join(chunks) == blob
        skeleton = 16 + 8 + 60 * 12  # every chunk body is a whole blob of its own cells
        want = header_size(layout.descriptor) + skeleton + 12 + 30 * (k_row + v_cell)
        assert len(chunks[1]) == want
        # A prefix of chunks is the blob of that prefix (V slices strided when transposed),
        # and the first chunk's body is the blob of its one token.
        prefix = ctx.kv_join(chunks[:3])
        ctx.seq_rm(0, 13)
        assert prefix == ctx.kv_pack(0)
        ctx.seq_rm(0, 1)
        assert chunks[0][-(skeleton + 12 + 30 * (k_row + v_cell)) :] == ctx.kv_pack(0)
        # Restoring the joined blob, or the chunks in place, decodes exactly like restoring
        # the packed one.
        for restore in ("joined", "in place"):
            ctx.clear()
            assert ctx.kv_unpack(0, blob) == n
            if restore == "joined":
                assert ctx.kv_unpack(1, ctx.kv_join(chunks)) == n
            else:
                assert ctx.kv_unpack_chunks(1, chunks) == n
                # the same cells, in position order (split + join canonicalises the seq id)
                assert ctx.kv_join(ctx.kv_split(ctx.kv_pack(1), [0, n])) == blob
            a, b = _next_logits(ctx, short[1], n)
            assert a == b
    finally:
        ctx.close()


def test_quantised_v_needs_flash_attention() -> None:
    with pytest.raises(ConfigError):
        _params("off", "f16", "q8_0").validate()
    assert _params("off", "f16", "f16").kv_hash() != _params("on", "f16", "f16").kv_hash()
    assert _params("auto", "f16", "f16").kv_hash() != _params("on", "f16", "f16").kv_hash()


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [
        (("auto", "f16", "f16"), ("on", "q4_0", "q4_0")),
        (("auto", "f16", "f16"), ("on", "f16", "q8_0")),
        (("on", "f16", "f16"), ("off", "f16", "f16")),
        (("off", "f16", "f16"), ("on", "f16", "f16")),
    ],
)
def test_chunks_of_another_layout_are_refused_before_llama_cpp(
    llama: LlamaModel,
    short: list[int],
    mine: tuple[FlashAttn, KvType, KvType],
    theirs: tuple[FlashAttn, KvType, KvType],
) -> None:
    ours, other = llama.new_context(_params(*mine)), llama.new_context(_params(*theirs))
    try:
        other.prefill(0, short[:5], 0)
        blob = other.kv_pack(0)
        with pytest.raises(StateRestoreError):
            ours.kv_join(other.kv_split(blob, [0, 2, 5]))
        with pytest.raises(StateRestoreError):
            ours.kv_unpack_chunks(0, other.kv_split(blob, [0, 2, 5]))
        with pytest.raises(StateRestoreError):
            ours.kv_split(blob, [0, 5])
    finally:
        ours.close()
        other.close()


def test_every_bit_flip_of_a_llama_envelope_is_refused(llama: LlamaModel, short: list[int]) -> None:
    ctx = llama.new_context(_params("auto", "f16", "f16"))
    try:
        ctx.prefill(0, short[:3], 0)
        blob = ctx.kv_pack(0)
        first, second = ctx.kv_split(blob, [0, 1, 3])
        envelope = header_size(parse_blob(u8(blob)).descriptor)
        assert envelope == 28 + 8 + 60 * 12 + 4
        for bit in range(envelope * 8):
            bad = bytearray(second)
            bad[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(StateRestoreError):
                ctx.kv_join([first, bad])
            with pytest.raises(StateRestoreError):
                ctx.kv_unpack_chunks(1, [first, bad])
        for cut in range(0, len(second), 97):
            with pytest.raises(StateRestoreError):
                ctx.kv_join([first, second[:cut]])
            with pytest.raises(StateRestoreError):
                ctx.kv_unpack_chunks(1, [first, second[:cut]])
        assert ctx.seq_pos_max(1) == -1
    finally:
        ctx.close()


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("bounds", [[0, N_BATCH, 2 * N_BATCH], [0, 50, N_BATCH, 100, 2 * N_BATCH]])
def test_restore_from_chunks_is_bit_identical_to_cold(
    llama: LlamaModel, bounds: list[int], in_place: bool
) -> None:
    # The exactness rule (kvwarm.alignment) through chunks: the blob of a cold run, cut at
    # boundaries that are and are not multiples of n_batch, joined up to an aligned one and
    # restored, then the rest prefilled, gives the cold run's logits bit for bit.
    tokens = llama.tokenize(PROMPT)
    ctx = llama.new_context(PARAMS)
    try:
        ctx.prefill(0, tokens, 0)
        cold = bytes(ctx.logits())
        chunks = ctx.kv_split(ctx.kv_pack(0), bounds)
        ctx.clear()
        boundary = bounds[-1]
        if in_place:
            assert ctx.kv_unpack_chunks(0, chunks) == boundary
        else:
            assert ctx.kv_unpack(0, ctx.kv_join(chunks)) == boundary
        ctx.prefill(0, tokens[boundary:], boundary)
        assert bytes(ctx.logits()) == cold
    finally:
        ctx.close()


def test_cells_out_of_position_order_are_chunked_by_position(
    llama: LlamaModel, short: list[int]
) -> None:
    # Two slots in one unified cache: trimming seq 0 frees cells that seq 1's next tokens
    # take, so seq 1's blob lists positions 20..23 before 0..19.
    ctx = llama.new_context(_params("auto", "f16", "f16"))
    fresh = llama.new_context(_params("auto", "f16", "f16"))
    try:
        ctx.prefill(0, short[:20], 0)
        ctx.prefill(1, short[:20], 0)
        ctx.seq_rm(0, 10)
        ctx.prefill(1, short[20:24], 20)
        blob = ctx.kv_pack(1)
        layout = parse_blob(u8(blob))
        assert layout.order is not None
        assert layout.order.tolist() == [*range(4, 24), *range(4)]
        chunks = ctx.kv_split(blob, [0, 10, 21, 24])
        joined = ctx.kv_join(chunks)
        # The joined blob is the same cells in position order: llama.cpp takes it, and
        # packing it again gives it back.
        assert joined != blob and len(joined) == len(blob)
        assert fresh.kv_unpack(0, joined) == 24
        assert fresh.kv_pack(0) == joined
        assert ctx.kv_split(joined, [0, 10, 21, 24]) == chunks
        # Positions 0..19 were computed in order, so their chunk is a cold run's.
        fresh.clear()
        fresh.prefill(0, short[:20], 0)
        assert ctx.kv_split(blob, [0, 20]) == fresh.kv_split(fresh.kv_pack(0), [0, 20])
    finally:
        ctx.close()
        fresh.close()


def test_cell_metadata_is_canonical_in_chunks(llama: LlamaModel, short: list[int]) -> None:
    ctx = llama.new_context(_params("auto", "f16", "f16"))
    try:
        ctx.prefill(1, short[:6], 0)
        blob = ctx.kv_pack(1)
        assert struct.unpack_from("<IiII", blob)[1] == 1  # the source seq id
        (chunk,) = ctx.kv_split(blob, [2, 6])
        body = len(chunk) - (16 + 8 + 60 * 12) - 4 * (12 + 60 * 384)  # the body is a blob
        head = struct.unpack_from("<IiII", chunk, body)
        assert head == (0xAF143CD8, 0, 1, 4)  # its own head: sequence 0, one stream, 4 cells
        meta = np.frombuffer(chunk, dtype="<i4", count=12, offset=body + 16).reshape(4, 3)
        assert meta.tolist() == [[2, 1, 0], [3, 1, 0], [4, 1, 0], [5, 1, 0]]
    finally:
        ctx.close()


def _first_format(chunk: bytes) -> bytes:
    """``chunk`` as the first chunk format wrote it: no flag, a body of the metadata and the
    sections' cells without any header."""
    view = kv_chunk.parse(u8(chunk), kv_chunk.CODEC_LLAMA)
    structure = parse_descriptor(view.descriptor)
    n = view.n_cells
    parts = [view.body[HEAD.size : HEAD.size + n * CELL].tobytes()]
    for section, at in zip(structure.sections, structure.offsets(n), strict=True):
        parts.append(view.body[at : at + n * section.cell_bytes].tobytes())
    body = b"".join(parts)
    out = np.zeros(header_size(view.descriptor) + len(body), dtype=np.uint8)
    at = kv_chunk.write_header(
        out,
        codec=kv_chunk.CODEC_LLAMA,
        start=view.start,
        n_cells=n,
        descriptor=view.descriptor,
        body_len=len(body),
    )
    out[at:] = np.frombuffer(body, dtype=np.uint8)
    return out.tobytes()


def test_chunks_of_the_first_format_are_joined_not_restored_in_place(
    llama: LlamaModel, short: list[int]
) -> None:
    ctx = llama.new_context(_params("auto", "f16", "f16"))
    try:
        n = len(short)
        ctx.prefill(0, short, 0)
        blob = ctx.kv_pack(0)
        chunks = ctx.kv_split(blob, [0, 7, 20, n])
        old = [_first_format(c) for c in chunks]
        assert len(old[0]) == len(chunks[0]) - (16 + 8 + 60 * 12)
        assert ctx.kv_join(old) == blob  # still read, never misread
        assert ctx.kv_codec.chunk_range(old[1]) == (7, 13)
        mixed = [old[0], *chunks[1:]]  # an old prefix chunk shared by a newer row
        assert ctx.kv_join(mixed) == blob
        ctx.prefill(1, short[:4], 0)
        for row in (old, mixed):
            assert ctx.kv_unpack_chunks(1, row) is None  # the caller joins instead
            assert ctx.seq_pos_max(1) == 3  # untouched
        assert ctx.kv_unpack(1, ctx.kv_join(mixed)) == n
    finally:
        ctx.close()


def test_a_corrupt_blob_head_inside_a_chunk_is_refused_before_llama_cpp(
    llama: LlamaModel, short: list[int]
) -> None:
    # The body's own blob head and section headers are what llama.cpp reads; the envelope's
    # CRC does not cover them, the codec compares them with the descriptor.
    ctx = llama.new_context(_params("auto", "f16", "f16"))
    try:
        ctx.prefill(0, short[:6], 0)
        (chunk,) = ctx.kv_split(ctx.kv_pack(0), [0, 6])
        body = len(chunk) - (16 + 8 + 60 * 12) - 6 * (12 + 60 * 384)
        heads = [body + i for i in range(16)]  # magic, seq id, n_stream, n_cells
        pair = body + 16 + 6 * 12
        heads += [pair + i for i in range(8 + 12)]  # v_trans, n_layer, section 0's header
        last_v = body + 16 + 6 * 12 + 8 + 59 * (12 + 6 * 384)
        heads += [last_v + i for i in range(12)]  # the last section's header
        for at in heads:
            bad = bytearray(chunk)
            bad[at] ^= 0x10
            with pytest.raises(StateRestoreError):
                ctx.kv_unpack_chunks(1, [bad])
            with pytest.raises(StateRestoreError):
                ctx.kv_join([bad])
        assert ctx.seq_pos_max(1) == -1
        assert ctx.kv_unpack_chunks(1, [chunk]) == 6
    finally:
        ctx.close()


def test_in_place_restore_uses_a_scratch_sequence_nobody_can_name(
    llama: LlamaModel, short: list[int]
) -> None:
    params = _params("auto", "f16", "f16")
    ctx = llama.new_context(params)
    try:
        ctx.prefill(0, short, 0)
        chunks = ctx.kv_split(ctx.kv_pack(0), [0, 9, 17, len(short)])
        assert ctx.kv_unpack_chunks(1, chunks) == len(short)
        scratch = params.n_seq_max
        with pytest.raises(InvalidRequestError):
            ctx.seq_rm(scratch)
        with pytest.raises(InvalidRequestError):
            ctx.kv_unpack_chunks(scratch, chunks)
        # Empty again: what the restore put there was shared into seq 1, then dropped.
        assert ctx._lib.llama_memory_seq_pos_max(ctx._mem, scratch) == -1
    finally:
        ctx.close()


def test_a_context_with_no_room_for_a_scratch_sequence_joins(
    llama: LlamaModel, short: list[int]
) -> None:
    params = replace(_params("auto", "f16", "f16"), n_seq_max=256)  # llama.cpp's limit
    ctx = llama.new_context(params)
    try:
        ctx.prefill(0, short[:10], 0)
        chunks = ctx.kv_split(ctx.kv_pack(0), [0, 4, 10])
        assert ctx.kv_unpack_chunks(1, chunks) is None
        assert ctx.kv_unpack(1, ctx.kv_join(chunks)) == 10
    finally:
        ctx.close()


def test_chunks_llama_cpp_cannot_place_leave_both_sequences_empty(
    llama: LlamaModel, short: list[int]
) -> None:
    # 256 cells: seq 0 takes 200, so seq 1's 60-token row fits only in part. The first chunk
    # restores, a later one finds no cells: a StateRestoreError, nothing half-restored.
    ctx = llama.new_context(_params("auto", "f16", "f16"))
    try:
        tokens = (short * 10)[:200]
        ctx.prefill(0, tokens, 0)
        chunks = ctx.kv_split(ctx.kv_pack(0), [0, 30, 60])
        with pytest.raises(StateRestoreError):
            ctx.kv_unpack_chunks(1, chunks)
        assert ctx.seq_pos_max(1) == -1
        assert ctx._lib.llama_memory_seq_pos_max(ctx._mem, 2) == -1  # the scratch sequence
        assert ctx.seq_pos_max(0) == 199  # the other slot is untouched
        assert ctx.kv_unpack_chunks(1, chunks[:1]) == 30
    finally:
        ctx.close()


@pytest.mark.parametrize("n_seq_max", [N_BATCH, N_BATCH + 1, 3 * N_BATCH])
def test_more_sequences_than_n_batch_do_not_abort(
    llama: LlamaModel, short: list[int], n_seq_max: int
) -> None:
    # llama.cpp reserves one token per sequence and asserted (aborting the process) when that
    # exceeded n_batch outputs: n_parallel > n_batch, or == n_batch with the scratch sequence.
    ctx = llama.new_context(replace(_params("auto", "f16", "f16"), n_seq_max=n_seq_max))
    try:
        ctx.prefill(n_seq_max - 1, short[:10], 0)
        ctx.decode([BatchToken(short[10], 10, n_seq_max - 1, logits=True)])
        assert len(ctx.logits()) == llama.n_vocab
    finally:
        ctx.close()


def test_a_tail_restored_onto_live_kv_is_the_whole_rows_state(
    llama: LlamaModel, short: list[int]
) -> None:
    """A row's chunks from 13 on, restored onto a copy of live KV of its first 13 tokens,
    give exactly the packed row and its next logits; a live prefix of another length and
    chunks that do not start where it ends are refused, and the scratch sequence is left
    empty."""
    ctx = llama.new_context(_params("auto", "f16", "f16"))
    try:
        assert ctx.restores_tails
        n = len(short)
        ctx.prefill(0, short, 0)
        blob = ctx.kv_pack(0)
        chunks = ctx.kv_split(blob, [0, 13, 20, n])
        ctx.seq_cp(0, 1, 0, 13)
        assert ctx.kv_unpack_chunks(1, chunks[1:], base=13) == n
        assert ctx.kv_join(ctx.kv_split(ctx.kv_pack(1), [0, n])) == blob
        a, b = _next_logits(ctx, short[1], n)
        assert a == b
        for live, tail in ((14, chunks[1:]), (13, chunks[2:]), (0, chunks[1:])):
            ctx.seq_rm(1)
            if live:
                ctx.seq_cp(0, 1, 0, live)
            with pytest.raises(StateRestoreError):
                ctx.kv_unpack_chunks(1, tail, base=13)
            scratch = ctx.params.n_seq_max  # kvwarm's own sequence past the caller's
            assert llama._lib.llama_memory_seq_pos_max(ctx._mem, scratch) == -1  # type: ignore[attr-defined]
    finally:
        ctx.close()
    streams = llama.new_context(replace(_params("auto", "f16", "f16"), kv_unified=False))
    try:
        assert not streams.restores_tails  # a stream per sequence: seq_cp copies whole streams
    finally:
        streams.close()


def test_held_chunks_are_checked_once_and_other_buffers_on_every_join(
    llama: LlamaModel, short: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``ram`` tier's chunks (``buffers.Held``: immutable) are parsed and checked on
    their first join only; any other buffer on every join, and a held chunk that fails a
    check is not remembered (refused again)."""
    ctx = llama.new_context(_params("off", "f16", "f16"))
    try:
        ctx.prefill(0, short[:12], 0)
        blob = ctx.kv_pack(0)
        chunks = ctx.kv_split(blob, [0, 4, 12])
        parses: list[int] = []
        real = kv_chunk.parse

        def counted(chunk: np.ndarray, codec: int) -> kv_chunk.ChunkView:
            parses.append(codec)
            return real(chunk, codec)

        monkeypatch.setattr(kv_chunk, "parse", counted)
        kept = [held(c) for c in chunks]
        for _ in range(3):
            assert bytes(ctx.kv_join([memoryview(h) for h in kept])) == blob
        assert len(parses) == 2  # once per held chunk
        for _ in range(2):
            assert bytes(ctx.kv_join(chunks)) == blob
        assert len(parses) == 6  # bytes: every time
        bad = bytearray(chunks[1])
        body = kv_chunk.parse(u8(bytes(bad)), kv_chunk.CODEC_LLAMA).body.size
        bad[len(bad) - body + HEAD.size] ^= 1  # the first cell's position: not in the CRC
        spoilt = held(bytes(bad))
        for _ in range(2):
            with pytest.raises(StateRestoreError, match="metadata"):
                ctx.kv_join([memoryview(kept[0]), memoryview(spoilt)])
        assert spoilt.memo == {}
    finally:
        ctx.close()


def test_joins_into_a_reused_staging_buffer_keep_each_plans_targets(
    llama: LlamaModel, short: list[int]
) -> None:
    """A join into a worker's ``Staging`` buffer makes its copies' target views once per
    plan and keeps them in the buffer's memo: rows of other geometries joined in turn into
    one buffer each come out as a join into a fresh buffer does, whatever was joined before
    (their plans' targets are told apart), and a join into a part of the buffer makes its
    own."""
    ctx = llama.new_context(_params("off", "f16", "f16"))
    try:
        ctx.prefill(0, short[:12], 0)
        blob = ctx.kv_pack(0)
        rows = [
            ctx.kv_split(blob, [0, 4, 12]),
            ctx.kv_split(blob, [0, 12]),
            ctx.kv_split(blob, [0, 4, 8]),
        ]
        alone = [bytes(ctx.kv_join(chunks)) for chunks in rows]
        staging = grown_staging(len(blob) + 64, 0)
        for _ in range(2):
            for chunks, want in zip(rows, alone, strict=True):
                assert bytes(ctx.kv_join(chunks, staging.data)) == want
                assert bytes(staging[: len(want)]) == want
        assert len(staging.memo) == 3  # one plan a geometry, made once
        kept = dict(staging.memo)
        assert bytes(ctx.kv_join(rows[0], staging.data)) == alone[0]
        assert all(staging.memo[k] is v for k, v in kept.items())  # reused, not remade
        part = staging.data[8:]  # not the buffer from its start: no memo
        assert bytes(ctx.kv_join(rows[1], part)) == alone[1]
        assert len(staging.memo) == 3
        staging.memo.clear()
        staging[:] = 0xAA  # nothing is left of an earlier join but what a join writes
        assert bytes(ctx.kv_join(rows[2], staging.data)) == alone[2]
    finally:
        ctx.close()
