"""Per-sequence KV streams (``ContextParams.kv_unified=False``, deterministic mode's layout) on
the real backend, for every memory kind: a sequence's saved state is stored in the one-stream
form, byte for byte what a one-slot unified context saves for the same tokens, so rows move
between the two; it restores into any stream; a copy between streams keeps exactly the range
asked for. A blob that is not one sequence's state in one stream is refused, never guessed at.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from tests.tinymodels import write_tiny_model

from kvwarm.backends.base import BackendContext, ContextParams, FlashAttn
from kvwarm.backends.llama import LlamaBackend
from kvwarm.backends.llama.kv_layout import one_stream, widen
from kvwarm.backends.llama.model import LlamaModel
from kvwarm.embedded import default_model_path
from kvwarm.errors import StateRestoreError

pytestmark = pytest.mark.model

N_BATCH = 32
STREAMS = 3


@pytest.fixture(scope="module", params=["full", "swa", "recurrent", "hybrid"])
def model(
    request: pytest.FixtureRequest, gemma_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaModel]:
    kind = str(request.param)
    if kind == "full":
        path = str(default_model_path())
    elif kind == "swa":
        path = gemma_path
    else:
        arch = {"recurrent": "mamba", "hybrid": "lfm2"}[kind]
        path = str(write_tiny_model(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch))
    loaded = LlamaBackend().load_model(path)
    assert loaded.facts.memory_kind == kind
    yield loaded
    loaded.close()


def _ctx(model: LlamaModel, *, unified: bool, flash: FlashAttn = "auto") -> BackendContext:
    n_seq = 1 if unified else STREAMS
    return model.new_context(
        ContextParams(
            n_ctx=256 * n_seq,
            n_batch=N_BATCH,
            n_ubatch=N_BATCH,
            n_threads=2,
            n_seq_max=n_seq,
            kv_unified=unified,
            flash_attn=flash,
        )
    )


def _tokens(model: LlamaModel, n: int) -> list[int]:
    return [1 + (i * 37) % min(model.n_vocab - 1, 2000) for i in range(n)]


def test_a_stream_saves_what_a_unified_context_saves(model: LlamaModel) -> None:
    tokens = _tokens(model, 70)
    unified = _ctx(model, unified=True)
    streams = _ctx(model, unified=False)
    try:
        unified.prefill(0, tokens, 0)
        expected = unified.kv_pack(0)
        streams.prefill(2, tokens[:20], 0)  # another stream holds cells of its own
        streams.prefill(0, tokens, 0)
        saved = streams.kv_pack(0)
        # Byte for byte after the header's magic (cells name their sequence: 0 in both).
        assert saved[4:] == expected[4:]
        if model.facts.memory_kind != "recurrent":
            assert struct.unpack_from("<I", saved, 8)[0] == 1  # one stream
        # Restored into another stream and back, it saves the same bytes again.
        assert streams.kv_unpack(1, saved) == len(tokens)
        streams.seq_rm(0)
        assert streams.kv_unpack(0, streams.kv_pack(1)) == len(tokens)
        assert streams.kv_pack(0)[4:] == expected[4:]
        # And the unified context restores the stream's row.
        unified.seq_rm(0)
        assert unified.kv_unpack(0, saved) == len(tokens)
        assert unified.kv_pack(0)[4:] == expected[4:]
    finally:
        streams.close()
        unified.close()


def test_a_copy_between_streams_keeps_the_range_asked_for(model: LlamaModel) -> None:
    tokens = _tokens(model, 70)  # inside Gemma's window: its state trims like full attention
    streams = _ctx(model, unified=False)
    unified = _ctx(model, unified=True)
    try:
        streams.prefill(0, tokens, 0)
        streams.seq_cp(0, 1)
        assert streams.seq_pos_max(1) == len(tokens) - 1
        assert streams.seq_pos_max(0) == len(tokens) - 1  # the source is untouched
        if model.facts.memory_kind in ("recurrent", "hybrid"):
            with pytest.raises(StateRestoreError):
                streams.seq_cp(0, 2, 0, 40)  # a rolled-back window or state: refused
            assert streams.seq_pos_max(2) == -1  # and nothing half-copied is left
            return
        streams.seq_cp(0, 2, 0, 40)
        assert (streams.seq_pos_min(2), streams.seq_pos_max(2)) == (0, 39)
        streams.seq_cp(2, 0)
        # The same 70 tokens cut to 40 in a unified context, not 40 prefilled: a GPU's kernels
        # round a position's KV differently in a batch of another size (seen on CUDA).
        unified.prefill(0, tokens, 0)
        unified.seq_rm(0, 40)
        assert streams.kv_pack(0)[4:] == unified.kv_pack(0)[4:]
    finally:
        unified.close()
        streams.close()


def _blob(model: LlamaModel) -> bytes:
    ctx = _ctx(model, unified=True)
    try:
        ctx.prefill(0, _tokens(model, 12), 0)
        return ctx.kv_pack(0)
    finally:
        ctx.close()


def test_widen_and_narrow_are_inverse_and_refuse_what_they_do_not_account_for(
    model: LlamaModel,
) -> None:
    caches = model.facts.memory_kind != "recurrent" and (2 if model.facts.n_swa > 0 else 1)
    caches = int(caches)
    blob = _blob(model)
    arr = np.frombuffer(blob, dtype=np.uint8)
    wide = widen(arr, caches, 4)
    assert len(wide) == len(blob) + 12 * caches  # three empty streams per cache
    assert one_stream(np.frombuffer(wide, dtype=np.uint8), caches) == blob
    if not caches:
        return
    with pytest.raises(StateRestoreError):
        one_stream(arr[:40], caches)  # cut short
    with pytest.raises(StateRestoreError):
        widen(np.frombuffer(wide, dtype=np.uint8), caches, 4)  # already four streams
    doubled = bytearray(blob[:8]) + struct.pack("<I", 2) + blob[12:] + blob[12:]
    with pytest.raises(StateRestoreError):
        one_stream(np.frombuffer(bytes(doubled), dtype=np.uint8), 1)  # cells in two streams


def test_a_deterministic_engine_context_uses_streams() -> None:
    from kvwarm.engine.api import Engine, EngineConfig, ModelConfig

    eng = Engine(EngineConfig())
    try:
        # Flash attention set alike: kvwarm's "auto" keeps it for a deterministic model and
        # turns it off on the CPU for a plain one, and rows never cross between those two.
        ctx = ContextParams(
            n_ctx=256, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=2, flash_attn="on"
        )
        det = eng.load_model(
            config=ModelConfig(context=ctx, n_parallel=2, deterministic=True), model_id="det"
        )
        one = eng.load_model(
            config=ModelConfig(context=ctx, n_parallel=1, deterministic=True), model_id="one"
        )
        plain = eng.load_model(config=ModelConfig(context=ctx, n_parallel=2), model_id="plain")
        assert det._ctx.params.kv_unified is False  # two slots
        assert one._ctx.params.kv_unified is True and plain._ctx.params.kv_unified is True
        assert det.namespace() == one.namespace()  # the same rows serve streams and one buffer
        # A deterministic model's keys name its threads (``LlamaModel.kv_tag``): a plain
        # model's rows, whose keys do not, may be another thread count's bits.
        assert det.namespace() != plain.namespace()
    finally:
        eng.close()


def test_a_tail_is_packed_only_where_cells_are_per_position(model: LlamaModel) -> None:
    # kv_pack_tail copies out only the positions from `start` through the scratch sequence
    # of a unified full-attention context; everywhere else (streams, a window, a recurrent
    # state) it is the whole state, and says so with first == 0.
    # Both V layouts: by cell (flash attention) and transposed (off: kvwarm's CPU default).
    tokens = _tokens(model, 40)
    for unified, flash in itertools.product((True, False), ("on", "off")):
        ctx = _ctx(model, unified=unified, flash=flash)
        try:
            ctx.prefill(0, tokens, 0)
            whole = ctx.kv_pack(0)
            tail, first = ctx.kv_pack_tail(0, 20)
            if unified and model.facts.memory_kind == "full":
                assert first == 20 and len(tail) < len(whole)
                assert ctx.kv_split(tail, [20, 40]) == ctx.kv_split(whole, [20, 40])
            else:
                assert (tail, first) == (whole, 0)
            assert ctx.kv_pack(0) == whole  # the sequence is untouched either way
        finally:
            ctx.close()


def test_a_copy_between_streams_refuses_a_window_cut_below_what_it_packed(
    gemma_path: str,
) -> None:
    """A live window past its size still holds its masked cells (its ``pos_min`` stays 0),
    but a copy between streams goes through a pack, which leaves them out: cut to fewer
    positions than the source holds, the copy would lack positions its next token attends to.
    Refused (found by review: it was a silent wrong state, max |dlogit| 0.28 on Gemma)."""
    model = LlamaBackend().load_model(gemma_path)
    n_swa = model.facts.n_swa
    ctx = model.new_context(
        ContextParams(
            n_ctx=2048, n_batch=256, n_ubatch=256, n_threads=2, n_seq_max=2, kv_unified=False
        )
    )
    try:
        tokens = _tokens(model, n_swa + 18)
        ctx.prefill(0, tokens, 0)
        assert ctx.seq_pos_min(0) == 0  # the live window still reaches back to 0
        with pytest.raises(StateRestoreError):
            ctx.seq_cp(0, 1, 0, 256)
        assert ctx.seq_pos_max(1) == -1  # nothing half-copied is left
        ctx.seq_cp(0, 1)  # whole, it is the saved state of every token: kept
        assert (ctx.seq_pos_min(1), ctx.seq_pos_max(1)) == (18, len(tokens) - 1)
        assert ctx.copies_by_pack  # so the planner gives such copies a saved state's floor
    finally:
        ctx.close()
        model.close()
