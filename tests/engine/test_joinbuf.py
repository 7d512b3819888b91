"""The worker's reusable join buffer: grows once, then restores without reallocating."""

from __future__ import annotations

import pytest

from kvwarm.backends import get_backend
from kvwarm.backends.base import BackendContext, ContextParams
from kvwarm.engine.worker.joinbuf import JoinBuffer

PARAMS = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2)


def test_join_buffer_grows_reuses_and_releases() -> None:
    model = get_backend("stub").load_model("stub-model")
    ctx = model.new_context(PARAMS)
    try:
        tokens = model.tokenize("a join buffer kept across restores, grown when needed " * 3)
        ctx.prefill(0, tokens, 0)
        blob = ctx.kv_pack(0)
        chunks = ctx.kv_split(blob, [0, 16, 32, len(tokens)])
        buf = JoinBuffer()
        assert buf.capacity == 0
        small = buf.join(ctx, chunks[:1])
        assert small.tobytes() == ctx.kv_join(chunks[:1])
        first = buf.capacity
        assert first == len(small)
        del small
        whole = buf.join(ctx, chunks)  # needs more: grows
        assert whole.tobytes() == blob
        grown = buf.capacity
        assert grown >= len(blob) > first
        assert ctx.kv_unpack(1, whole) == len(tokens)
        del whole
        for j in (2, 1, 3):  # smaller or equal joins reuse the same memory
            view = buf.join(ctx, chunks[:j])
            assert view.tobytes() == ctx.kv_join(chunks[:j])
            del view
        assert buf.capacity == grown
        buf.release()
        assert buf.capacity == 0
    finally:
        ctx.close()
        model.close()


def test_a_rest_follows_the_joined_chunks_and_grows_the_buffer_when_it_does_not_fit() -> None:
    """A two-part row (an iSWA window, a hybrid's recurrent state) restores from its joined
    chunks followed by its rest, in one buffer."""
    model = get_backend("stub").load_model("stub-model")
    ctx = model.new_context(PARAMS)
    try:
        tokens = model.tokenize("a row of two parts: chunks, then the state kept whole " * 3)
        ctx.prefill(0, tokens, 0)
        chunks = ctx.kv_split(ctx.kv_pack(0), [0, 16, len(tokens)])
        joined = bytes(ctx.kv_join(chunks))
        buf = JoinBuffer()
        view = buf.join(ctx, chunks)  # sized for the chunks alone
        assert buf.capacity == len(joined)
        del view
        rest = bytes(range(200))
        view = buf.join(ctx, chunks, rest)  # the chunks fit, the rest does not: grows
        assert view.tobytes() == joined + rest
        assert buf.capacity >= len(joined) + len(rest)
        del view
        for part in (chunks[:1], chunks):  # fits now: the same memory, the rest after the blob
            view = buf.join(ctx, part, memoryview(rest)[:50])
            assert view.tobytes() == bytes(ctx.kv_join(part)) + rest[:50]
            del view
    finally:
        ctx.close()
        model.close()


def _window_row(ctx: BackendContext, n: int) -> tuple[bytes, list[bytes], list[bytes], int]:
    """Sequence 0 prefilled with ``n`` tokens of a window model: its blob, its first cache in
    chunks (cut at 32), its window in chunks (cut at 48 where inside it), the window's start."""
    codec = ctx.kv_codec
    ctx.seq_rm(0)
    ctx.prefill(0, [1 + (i * 5) % 200 for i in range(n)], 0)
    blob = ctx.kv_pack(0)
    first, end = codec.rest_span(blob)
    main = codec.split(blob, [0, 32, n])
    rest = codec.split_rest(blob, [first, *(b for b in (48,) if first < b < end), end])
    return blob, main, rest, first


def test_a_window_row_joins_both_caches_and_the_buffer_grows_once() -> None:
    """A row whose window is in chunks: its first cache's chunks then its window's, joined
    into one blob the context restores, in a buffer that grows only when a row needs more."""
    from kvwarm.backends.stub import StubBackend

    model = StubBackend(memory_kind="swa", n_swa=24).load_model("stub-window")
    ctx = model.new_context(ContextParams(n_ctx=256, n_batch=16, n_ubatch=16))
    try:
        buf = JoinBuffer()
        sizes = []
        for n in (60, 40, 90):
            blob, main, rest, first = _window_row(ctx, n)
            got = buf.join(ctx, main, rest_chunks=rest, rest_from=first)
            assert bytes(got) == blob
            sizes.append(buf.capacity)
            got.release()
        assert sizes[0] == sizes[1] < sizes[2]  # the shorter row fit; the longer one grew it
    finally:
        ctx.close()
        model.close()


def test_restore_joins_into_the_buffer_and_restores_in_one_call() -> None:
    """``restore`` (``kv_unpack_joined``): the row joined into the buffer, grown only when a
    row needs more, and restored exactly; bad chunks are refused with the sequence as it
    was, a refused blob leaves it empty."""
    from kvwarm.backends.stub import StubBackend
    from kvwarm.errors import StateRestoreError

    model = StubBackend(memory_kind="swa", n_swa=24).load_model("stub-window")
    ctx = model.new_context(ContextParams(n_ctx=256, n_batch=16, n_ubatch=16, n_seq_max=2))
    try:
        buf = JoinBuffer()
        sizes = []
        for n in (60, 40, 90):
            blob, main, rest, first = _window_row(ctx, n)
            assert buf.restore(ctx, 1, main, rest_chunks=rest, rest_from=first) == n
            assert ctx.kv_pack(1) == blob
            sizes.append(buf.capacity)
        assert sizes[0] == sizes[1] < sizes[2]
        held = ctx.seq_pos_max(1)
        with pytest.raises(StateRestoreError):  # a window that does not start in its chunks
            buf.restore(ctx, 1, main, rest_chunks=rest, rest_from=first - 1)
        assert ctx.seq_pos_max(1) == held  # refused before the sequence was touched
        with pytest.raises(StateRestoreError):  # a payload that is no window cache
            buf.restore(ctx, 1, main, b"\x00" * 40)
        assert ctx.seq_pos_max(1) == -1  # a refused blob leaves the sequence empty
    finally:
        ctx.close()
        model.close()
