"""A sliding window's cells in chunks (``KvCodec.rest_span``, ``split_rest``, ``join_rest``):
an iSWA blob is its first cache then its window, and the window is cut by position like the
first cache, so ``join(split(blob)) ‖ join_rest(split_rest(blob), first) == blob``. Checked
on the stub's window model and on Gemma 3 270M (n_swa 512, marked ``model``)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from kvwarm.backends import get_backend, kv_chunk
from kvwarm.backends.base import BackendContext, BackendModel, ContextParams
from kvwarm.backends.llama import kv_codec as llama_kv_codec
from kvwarm.backends.llama.kv_codec import _MEMO, _Known, _rest_plan
from kvwarm.backends.stub import StubBackend
from kvwarm.buffers import Held, held, u8
from kvwarm.engine.worker.joinbuf import JoinBuffer
from kvwarm.errors import JoinBufferTooSmallError, StateRestoreError

N_SWA = 24


@pytest.fixture(scope="module")
def stub() -> Iterator[BackendModel]:
    model = StubBackend(memory_kind="swa", n_swa=N_SWA).load_model("stub-window")
    yield model
    model.close()


@pytest.fixture
def ctx(stub: BackendModel) -> Iterator[BackendContext]:
    context = stub.new_context(ContextParams(n_ctx=256, n_batch=16, n_ubatch=16, n_seq_max=2))
    yield context
    context.close()


def _state(ctx: BackendContext, n: int, seq: int = 0) -> bytes:
    ctx.prefill(seq, [1 + (i * 7) % 200 for i in range(n)], 0)
    return ctx.kv_pack(seq)


def _cuts(first: int, end: int, step: int) -> list[int]:
    return sorted({first, end, *range((first // step + 1) * step, end, step)})


def test_a_window_is_cut_and_joined_back_to_the_blob(ctx: BackendContext) -> None:
    blob = _state(ctx, 60)
    codec = ctx.kv_codec
    first, end = codec.rest_span(blob)
    assert (first, end) == (60 - N_SWA, 60)
    for step in (1, 5, 16, 100):
        main = codec.split(blob, _cuts(0, end, step))
        rest = codec.split_rest(blob, _cuts(first, end, step))
        assert bytes(codec.join(main)) + bytes(codec.join_rest(rest, first)) == blob
        assert codec.rest_size(rest, first) == len(blob) - codec.joined_size(main)
    assert bytes(codec.rest(blob)) == bytes(
        codec.join_rest(codec.split_rest(blob, [first, end]), first)
    )


def test_a_wider_first_chunk_is_read_from_the_window_start(ctx: BackendContext) -> None:
    """A later window starts inside a chunk an earlier, lower window stored: its cells
    before the window are skipped, and the result is the later blob exactly."""
    codec = ctx.kv_codec
    early = _state(ctx, 50)
    late = _state(ctx, 60, seq=1)  # the same tokens, ten more
    wide = codec.split_rest(early, [32, 48])  # [32, 48) of the earlier window [26, 50)
    tail = codec.split_rest(late, [48, 60])
    first = codec.rest_span(late)[0]
    assert first == 36
    joined = codec.join_rest([*wide, *tail], first)
    assert bytes(joined) == bytes(codec.rest(late))
    restored = bytes(codec.join(codec.split(late, [0, 60]))) + bytes(joined)
    assert ctx.kv_unpack(0, restored) == 60 and ctx.kv_pack(0) == late


def test_window_chunks_and_first_cache_chunks_never_mix(ctx: BackendContext) -> None:
    blob = _state(ctx, 60)
    codec = ctx.kv_codec
    first, _ = codec.rest_span(blob)
    main = codec.split(blob, [0, 40, 60])
    rest = codec.split_rest(blob, [first, 48, 60])
    assert all(kv_chunk.parse(u8(c), c[5]).flags == kv_chunk.FLAG_REST for c in rest)
    with pytest.raises(StateRestoreError):
        codec.join([*main[:1], *rest])
    with pytest.raises(StateRestoreError):
        codec.join_rest(main[1:], 40)
    with pytest.raises(StateRestoreError):  # out of order, missing, or not holding first
        codec.join_rest(rest[::-1], first)
    with pytest.raises(StateRestoreError):
        codec.join_rest(rest[1:], first)
    with pytest.raises(StateRestoreError):
        codec.join_rest(rest, first - 1)
    with pytest.raises(StateRestoreError):
        codec.join_rest([], first)


def test_a_short_output_buffer_is_refused_before_a_byte_is_written(ctx: BackendContext) -> None:
    blob = _state(ctx, 60)
    codec = ctx.kv_codec
    first, end = codec.rest_span(blob)
    rest = codec.split_rest(blob, [first, end])
    need = codec.rest_size(rest, first)
    buf = bytearray(b"\xaa" * (need - 1))
    with pytest.raises(JoinBufferTooSmallError) as caught:
        codec.join_rest(rest, first, out=buf)
    assert caught.value.needed == need and buf == bytearray(b"\xaa" * (need - 1))
    out = bytearray(need + 10)
    assert bytes(codec.join_rest(rest, first, out=out)) == bytes(codec.rest(blob))


def test_a_model_without_a_window_has_no_rest_to_cut() -> None:
    for kind, n_swa in (("full", 0), ("hybrid", 0)):
        model = StubBackend(memory_kind=kind, n_swa=n_swa).load_model("stub")  # type: ignore[arg-type]
        context = model.new_context(ContextParams(n_ctx=64, n_batch=16, n_ubatch=16))
        try:
            blob = _state(context, 20)
            with pytest.raises(StateRestoreError):
                context.kv_codec.rest_span(blob)
            with pytest.raises(StateRestoreError):
                context.kv_codec.split_rest(blob, [0, 20])
        finally:
            context.close()
            model.close()


def test_a_window_of_other_tokens_poisons_what_is_decoded_beside_it(
    ctx: BackendContext,
) -> None:
    """The stub takes a window as llama.cpp does, unchecked: joined to another prompt's first
    cache it restores, and the next token's logits differ from the true state's, as on a
    real model (what the cache's keys must prevent)."""
    codec = ctx.kv_codec
    blob = _state(ctx, 60)
    ctx.prefill(1, [2 + (i * 7) % 200 for i in range(60)], 0)
    other = ctx.kv_pack(1)
    first = codec.rest_span(blob)[0]
    good = bytes(codec.join(codec.split(blob, [0, 60]))) + bytes(codec.rest(blob))
    bad = bytes(codec.join(codec.split(blob, [0, 60]))) + bytes(codec.rest(other))
    assert codec.rest_span(other)[0] == first
    answers = []
    for state in (good, bad):
        ctx.kv_unpack(0, state)
        ctx.prefill(0, [5], 60)
        answers.append(list(ctx.logits(0))[:8])
    assert answers[0] != answers[1]


@pytest.fixture(scope="module")
def gemma(gemma_path: str) -> Iterator[tuple[BackendContext, bytes, bytes]]:
    """Gemma 3 270M's context and two states: the first 520 tokens' (``lower``) and all 530's,
    computed with the same passes (the lower one alone as the 530 are below), so their
    shared cells have the same bits."""
    model = get_backend("llama_cpp").load_model(gemma_path)
    params = model.context_params(
        ContextParams(n_ctx=1280, n_batch=128, n_ubatch=128, n_seq_max=2, n_threads=2),
        deterministic=False,
    )
    ctx = model.new_context(params)
    try:
        tokens = model.tokenize("The harbour keeper wrote down every ship. " * 70)[:530]
        ctx.prefill(0, tokens[:520], 0)
        lower = ctx.kv_pack(0)
        ctx.seq_rm(0, 0, -1)
        ctx.prefill(0, tokens, 0)
        yield ctx, lower, ctx.kv_pack(0)
    finally:
        ctx.close()
        model.close()


@pytest.mark.model
@pytest.mark.slow
def test_gemmas_window_is_cut_and_joined_back_and_restores(
    gemma: tuple[BackendContext, bytes, bytes],
) -> None:
    ctx, lower, blob = gemma
    codec = ctx.kv_codec
    first, end = codec.rest_span(blob)
    assert (first, end) == (530 - 512, 530)  # Gemma 3 270M's window: 512 positions
    main = codec.split(blob, [0, 256, 512, 530])
    rest = codec.split_rest(blob, [first, 32, 256, 512, 530])
    joined = bytes(codec.join(main)) + bytes(codec.join_rest(rest, first))
    assert joined == blob
    # A wider first chunk from that lower window is read from 18.
    wide = codec.split_rest(lower, [8, 32])
    assert bytes(codec.join_rest([*wide, *rest[1:]], first)) == bytes(codec.rest(blob))
    ctx.seq_rm(1, 0, -1)
    assert ctx.kv_unpack(1, joined) == 530
    again = ctx.kv_pack(1)  # seq 1's: the same cells, under its own sequence id
    rejoined = bytes(codec.join(codec.split(again, [0, 530])))
    assert rejoined + bytes(codec.join_rest(codec.split_rest(again, [first, 530]), first)) == blob


@pytest.mark.model
@pytest.mark.slow
def test_a_window_join_plan_serves_only_its_own_geometry(
    gemma: tuple[BackendContext, bytes, bytes],
) -> None:
    """``join_rest`` keeps one plan per window geometry (chunk spans relative to the window's
    start): the same geometry reuses it, wherever the window starts, any other gets its own,
    and every join writes every byte (the output buffer is filled with junk before each)."""
    ctx, lower, blob = gemma
    codec = ctx.kv_codec
    first, low_first = codec.rest_span(blob)[0], codec.rest_span(lower)[0]
    want, want_low = bytes(codec.rest(blob)), bytes(codec.rest(lower))
    fine = codec.split_rest(blob, [first, 32, 256, 512, 530])
    cases = [
        (fine, first, want),
        (codec.split_rest(blob, [first, 100, 530]), first, want),  # other cuts
        (codec.split_rest(lower, [low_first, 64, 520]), low_first, want_low),  # shorter
        ([*codec.split_rest(lower, [8, 32]), *fine[1:]], first, want),  # a wider first chunk
        (codec.split_rest(blob, [first, 82, 530]), first, want),
        # The same geometry 10 positions lower: the same plan, other positions.
        (codec.split_rest(lower, [low_first, 72, 520]), low_first, want_low),
    ]
    out = bytearray(len(want) + 64)
    _rest_plan.cache_clear()
    for round_ in range(2):
        for chunks, start, expected in cases:
            out[:] = b"\xa5" * len(out)
            assert bytes(codec.join_rest(chunks, start, out=out)) == expected
        assert _rest_plan.cache_info().misses == len(cases) - 1, round_  # one per geometry
    assert _rest_plan.cache_info().hits == len(cases) + 1


def _known(chunk: Held) -> _Known:
    memo = chunk.memo[_MEMO]
    assert isinstance(memo, _Known)
    return memo


@pytest.mark.model
@pytest.mark.slow
def test_held_chunks_keep_their_copies_sources_and_still_join_every_byte(
    gemma: tuple[BackendContext, bytes, bytes],
) -> None:
    """The ram tier's chunks (``buffers.Held``) keep what their first join made (``_Known``:
    the checked view and the source views of their copies), and later joins reuse it: both
    caches still come out byte for byte (the output is junk before each join), a wider first
    chunk's skipped cells included, and the memo holds nothing that keeps its chunk alive."""
    ctx, lower, blob = gemma
    codec = ctx.kv_codec
    first = codec.rest_span(blob)[0]
    want_main, want_rest = bytes(codec.join(codec.split(blob, [0, 530]))), bytes(codec.rest(blob))
    main = [held(c) for c in codec.split(blob, [0, 256, 512, 530])]
    fine = [held(c) for c in codec.split_rest(blob, [first, 64, 128, 192, 256, 512, 530])]
    wide = held(codec.split_rest(lower, [8, 64])[0])  # from 8: its first 10 cells skipped
    cases = [(fine, first), ([wide, *fine[1:]], first)]
    out = bytearray(len(want_main) + len(want_rest) + 64)
    made = []
    for round_ in range(3):
        out[:] = b"\xa5" * len(out)
        assert bytes(codec.join([memoryview(c) for c in main], out=out)) == want_main, round_
        for chunks, start in cases:
            out[:] = b"\xa5" * len(out)
            joined = codec.join_rest([memoryview(c) for c in chunks], start, out=out)
            assert bytes(joined) == want_rest, round_
        now = [_known(c).made for c in (*main, *fine)]
        assert all(m is not None for m in now)
        if made:  # made on the first join, never again
            assert all(m is n for m, n in zip(made, now, strict=True)), round_
        made = now
    assert _known(wide).made is None  # read from its middle: its views are made per join

    # Nothing in the memo refers to the chunk: the tier dropping it frees it at once.
    gone = held(codec.split_rest(blob, [first, 530])[0])
    codec.join_rest([memoryview(gone)], first, out=out)
    memo = _known(gone)
    ref = weakref.ref(gone)
    gc.disable()
    try:
        del gone
        assert ref() is None
    finally:
        gc.enable()
    assert memo.made is not None  # its views keep the bytes, not the Held


@pytest.mark.model
@pytest.mark.slow
def test_a_copy_that_fails_is_a_restore_error(
    gemma: tuple[BackendContext, bytes, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No copy of a join should fail (views of one shape and type, bounds-checked when made),
    nor should a join's sources and targets differ in number; if either did, the join raises
    ``StateRestoreError`` (the engine's restore is then a miss and prefills cold), not
    numpy's or Python's error."""
    ctx, _, blob = gemma
    codec = ctx.kv_codec
    first = codec.rest_span(blob)[0]
    chunks = codec.split_rest(blob, [first, 64, 530])

    def misshapen(body: np.ndarray, copies: Sequence[object]) -> tuple[np.ndarray, ...]:
        return (np.zeros((1, 1, 3), dtype=np.uint8),) * len(copies)

    monkeypatch.setattr(llama_kv_codec, "_sources", misshapen)
    with pytest.raises(StateRestoreError, match="copying KV cells failed"):
        codec.join_rest(chunks, first)
    with pytest.raises(StateRestoreError, match="copying KV cells failed"):
        codec.join(codec.split(blob, [0, 256, 530]))

    def short(body: np.ndarray, copies: Sequence[object]) -> tuple[np.ndarray, ...]:
        return misshapen(body, copies)[1:]  # one source fewer than the plan's targets

    monkeypatch.setattr(llama_kv_codec, "_sources", short)
    with pytest.raises(StateRestoreError, match="copies' sources"):
        codec.join(codec.split(blob, [0, 256, 530]))


def test_a_view_of_a_memoless_part_of_a_held_chunk_is_parsed_as_any_buffer() -> None:
    """A numpy slice of a ``Held`` is a ``Held`` with no memo: a view of it is read as any
    buffer (its envelope parsed and refused here), not asked for a memo it lacks."""
    chunk = held(b"\0" * 64)
    for view in (memoryview(chunk[:]), memoryview(chunk[8:]), memoryview(chunk)[::-1]):
        with pytest.raises(StateRestoreError):
            llama_kv_codec._parse_all([view])


@pytest.mark.model
@pytest.mark.slow
def test_a_window_row_is_joined_and_restored_in_one_call(
    gemma: tuple[BackendContext, bytes, bytes], gemma_path: str
) -> None:
    """``kv_unpack_joined`` (the engine's restore of a window row through its ``JoinBuffer``)
    restores exactly the saved state; since the join writes only canonical cells it checks
    only their positions against ``n_ctx``, and a context too short for either cache still
    refuses the row, leaving the sequence empty and usable. A payload beside the join (stored
    bytes, not the join's) is checked whole, as ``kv_unpack`` checks any blob."""
    from kvwarm.engine.worker.joinbuf import JoinBuffer

    ctx, _, blob = gemma
    codec = ctx.kv_codec
    first = codec.rest_span(blob)[0]
    main = codec.split(blob, [0, 256, 512, 530])
    rest = codec.split_rest(blob, [first, 32, 256, 512, 530])
    buf = JoinBuffer()
    ctx.seq_rm(1, 0, -1)
    assert buf.restore(ctx, 1, main, rest_chunks=rest, rest_from=first) == 530
    again = ctx.kv_pack(1)
    rejoined = bytes(codec.join(codec.split(again, [0, 530])))
    assert rejoined + bytes(codec.join_rest(codec.split_rest(again, [first, 530]), first)) == blob
    # The window whole as a payload, one of its cells moved to a position past n_ctx.
    window = bytearray(codec.rest(blob))
    window[8 : 8 + 4] = (5000).to_bytes(4, "little")  # the window's first cell's position
    with pytest.raises(StateRestoreError):
        buf.restore(ctx, 1, main, bytes(window))
    assert (ctx.seq_pos_min(1), ctx.seq_pos_max(1)) == (-1, -1)

    model = get_backend("llama_cpp").load_model(gemma_path)
    small = model.new_context(
        model.context_params(
            ContextParams(n_ctx=512, n_batch=128, n_ubatch=128, n_threads=2), deterministic=False
        )
    )
    try:
        cases = [
            (main, rest),  # both caches past n_ctx = 512
            (main[:1], rest),  # the first cache [0, 256) inside it, the window [18, 530) not
        ]
        for head, window_chunks in cases:
            small.prefill(0, [5, 6, 7], 0)
            with pytest.raises(StateRestoreError, match="beyond the context"):
                buf.restore(small, 0, head, rest_chunks=window_chunks, rest_from=first)
            assert (small.seq_pos_min(0), small.seq_pos_max(0)) == (-1, -1)
        small.prefill(0, [5, 6, 7], 0)  # still usable
        assert small.seq_pos_max(0) == 2
    finally:
        small.close()
        model.close()


class _RefusesWindows:
    """llama.cpp's bindings, except that a restore of a window alone
    (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``) reads nothing: a window llama.cpp refuses after
    the first cache restored."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)

    def llama_state_seq_set_data_ext(
        self, ctx: object, src: object, size: int, seq: int, flags: int
    ) -> int:
        if flags == self._lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY:
            return 0
        return int(self._lib.llama_state_seq_set_data_ext(ctx, src, size, seq, flags))


def _pos(ctx: BackendContext, seq: int) -> tuple[int, int]:
    return ctx.seq_pos_min(seq), ctx.seq_pos_max(seq)


@pytest.mark.model
@pytest.mark.slow
def test_a_window_row_restores_one_cache_at_a_time_or_not_at_all(
    gemma: tuple[BackendContext, bytes, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An iSWA context restores a window row one cache at a time (``WindowJoin``: the first
    cache with an empty window, then the window alone), each joined into the buffer just
    before llama.cpp reads it: the state is the one the whole blob restores, from a buffer
    that holds only the larger of the two blobs. Chunks that are refused, and a buffer too
    small, leave the sequence untouched; a window that does not end where the first cache
    does, or that llama.cpp refuses once the first cache is in, leaves it empty and usable."""
    ctx, _, blob = gemma
    codec = ctx.kv_codec
    first = codec.rest_span(blob)[0]
    main = codec.split(blob, [0, 256, 512, 530])
    rest = codec.split_rest(blob, [first, 32, 256, 512, 530])
    assert isinstance(codec, llama_kv_codec.LlamaKvCodec)
    row = codec.join_apart(main, rest, first)
    assert (row.first_end, row.window_end) == (530, 530)
    assert max(len(blob) - len(codec.rest(blob)), len(codec.rest(blob))) < row.size < len(blob)
    ctx.seq_rm(1, 0, -1)
    assert (
        ctx.kv_unpack_joined(1, main, bytearray(row.size), rest_chunks=rest, rest_from=first) == 530
    )
    apart = ctx.kv_pack(1)
    ctx.seq_rm(1, 0, -1)
    assert ctx.kv_unpack(1, blob) == 530
    assert ctx.kv_pack(1) == apart  # cell for cell the whole blob's state

    with pytest.raises(JoinBufferTooSmallError) as small:
        ctx.kv_unpack_joined(1, main, bytearray(row.size - 1), rest_chunks=rest, rest_from=first)
    assert small.value.needed == row.size
    assert ctx.kv_pack(1) == apart
    bad = bytearray(rest[2])
    meta = len(bad) - kv_chunk.parse(u8(rest[2]), bad[5]).body.size  # a window chunk: no head
    bad[meta : meta + 4] = (10_000).to_bytes(4, "little")  # its first cell's position
    with pytest.raises(StateRestoreError, match="corrupt cell metadata"):
        ctx.kv_unpack_joined(
            1,
            main,
            bytearray(row.size),
            rest_chunks=[*rest[:2], bytes(bad), *rest[3:]],
            rest_from=first,
        )
    assert ctx.kv_pack(1) == apart

    with pytest.raises(StateRestoreError, match="window ends at 530, its first cache at 512"):
        ctx.kv_unpack_joined(1, main[:2], bytearray(row.size), rest_chunks=rest, rest_from=first)
    assert _pos(ctx, 1) == (-1, -1)

    assert ctx.kv_unpack(1, blob) == 530
    monkeypatch.setattr(ctx, "_lib", _RefusesWindows(ctx._lib))
    with pytest.raises(StateRestoreError, match="refused the row's window"):
        ctx.kv_unpack_joined(1, main, bytearray(row.size), rest_chunks=rest, rest_from=first)
    assert _pos(ctx, 1) == (-1, -1)  # its first cache, restored, is gone again
    monkeypatch.undo()
    assert (
        ctx.kv_unpack_joined(1, main, bytearray(row.size), rest_chunks=rest, rest_from=first) == 530
    )
    assert ctx.kv_pack(1) == apart


@pytest.mark.model
@pytest.mark.slow
def test_window_rows_restored_through_a_workers_join_buffer_keep_each_plans_targets(
    gemma: tuple[BackendContext, bytes, bytes],
) -> None:
    """A worker's ``JoinBuffer`` is a ``Staging`` whose memo keeps each join plan's target
    views. Rows restored through it in turn, the buffer poisoned before each, are each the
    state their whole blob restores: two rows whose windows share one plan from other
    first positions (8 and 18) included. A row that needs more grows a new buffer, whose
    memo holds the plans used since only; a plan used again keeps its views."""
    ctx, lower, blob = gemma
    codec = ctx.kv_codec
    rows = []
    for state, n in ((lower, 520), (blob, 530)):
        first = codec.rest_span(state)[0]
        main = codec.split(state, [0, 256, 512, n])
        rest = codec.split_rest(state, [first, first + 32, first + 256, n])  # cut alike
        ctx.seq_rm(1, 0, -1)
        assert ctx.kv_unpack(1, state) == n
        rows.append((main, rest, first, n, ctx.kv_pack(1)))
    buf = JoinBuffer()

    def restore(i: int) -> None:
        main, rest, first, n, want = rows[i]
        if buf._buf is not None:
            buf._buf[:] = 0xAA  # nothing left of an earlier restore but what this one writes
        ctx.seq_rm(1, 0, -1)
        assert buf.restore(ctx, 1, main, rest_chunks=rest, rest_from=first) == n
        assert ctx.kv_pack(1) == want

    buf.join(ctx, rows[0][0][:1]).release()  # a one-chunk blob: a small buffer
    small = buf._buf
    assert small is not None and len(small.memo) == 1
    restore(0)  # needs more: a new, larger buffer
    assert buf._buf is not small and buf.capacity > len(small)
    assert len(buf._buf.memo) == 2  # this row's first cache and its window
    kept = dict(buf._buf.memo)
    for i in (1, 0, 1):
        restore(i)
    assert len(buf._buf.memo) == 3  # one window plan for both rows
    assert all(buf._buf.memo[k] is v for k, v in kept.items())  # reused, not remade
    buf.release()


@pytest.mark.model
@pytest.mark.slow
def test_a_window_row_of_transposed_v_restores_one_cache_at_a_time(gemma_path: str) -> None:
    """Without flash attention (V transposed in both caches) the two restores are the whole
    blob's state too."""
    model = get_backend("llama_cpp").load_model(gemma_path)
    ctx = model.new_context(
        model.context_params(
            ContextParams(n_ctx=1024, n_batch=128, n_ubatch=128, n_threads=2, flash_attn="off"),
            deterministic=False,
        )
    )
    try:
        ctx.prefill(
            0, model.tokenize("A lamp in every window, a ship on every tide. " * 50)[:530], 0
        )
        blob = ctx.kv_pack(0)
        codec = ctx.kv_codec
        first = codec.rest_span(blob)[0]
        main = codec.split(blob, [0, 256, 530])
        rest = codec.split_rest(blob, [first, 64, 128, 192, 256, 320, 384, 448, 512, 530])
        ctx.seq_rm(0, 0, -1)
        assert (
            ctx.kv_unpack_joined(0, main, bytearray(len(blob)), rest_chunks=rest, rest_from=first)
            == 530
        )
        assert ctx.kv_pack(0) == blob
    finally:
        ctx.close()
        model.close()


@pytest.mark.model
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_model_with_no_full_attention_layer_packs_cuts_and_restores(
    tmp_path_factory: pytest.TempPathFactory, deterministic: bool
) -> None:
    """A Gemma 3 of two layers, both sliding-window ones: its iSWA memory's first KV cache
    holds every cell and no layer (``n_layer`` 0, no section) and its window all the KV.
    Such a blob restores as it is (deterministic mode's per-sequence streams, widened and
    narrowed, too), is cut into chunks of cell metadata alone beside the window's and joins
    back to itself. Each of these was refused with ``n_layer=0`` (every deterministic
    request past one batch failed on it)."""
    from tests.tinymodels import gemma3_keys, write_tiny_model

    path = tmp_path_factory.mktemp("allswa") / "gemma3-allswa.gguf"
    write_tiny_model(path, "gemma3", keys=gemma3_keys(16, n_layer=2))
    model = get_backend("llama_cpp").load_model(str(path))
    ctx = model.new_context(
        model.context_params(
            ContextParams(n_ctx=128, n_batch=8, n_ubatch=8, n_seq_max=2, n_threads=2),
            deterministic=deterministic,
        )
    )
    try:
        ctx.prefill(0, [1 + (i * 7) % 100 for i in range(40)], 0)
        blob = ctx.kv_pack(0)
        ctx.seq_rm(0, 0, -1)
        assert ctx.kv_unpack(0, blob) == 40 and ctx.kv_pack(0) == blob
        codec = ctx.kv_codec
        first, end = codec.rest_span(blob)
        assert (first, end) == (40 - 16, 40)
        main = codec.split(blob, [0, 16, 40])
        rest = codec.split_rest(blob, [first, 32, 40])
        assert bytes(codec.join(main)) + bytes(codec.join_rest(rest, first)) == blob
        ctx.seq_rm(0, 0, -1)
        out = bytearray(len(blob))
        assert ctx.kv_unpack_joined(0, main, out, rest_chunks=rest, rest_from=first) == 40
        assert ctx.kv_pack(0) == blob
    finally:
        ctx.close()
        model.close()
