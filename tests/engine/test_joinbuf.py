"""The worker's reusable join buffer: grows once, then restores without reallocating."""

from __future__ import annotations

from kvwarm.backends import get_backend
from kvwarm.backends.base import ContextParams
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
