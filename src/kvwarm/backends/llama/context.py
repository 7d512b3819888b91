"""One ``llama_context``: decode, aligned prefill, logits, KV pack/unpack, sequence ops.

Invariants:

- Every argument is checked before llama.cpp sees it, by the code the stub runs too: a
  ``LlamaContext`` is a ``ContextFront`` (``backends/front.py``), whose public methods check
  each call (token / seq ids, positions that continue each sequence, batch sizes, positions
  < ``n_ctx``, logits rows that were requested) and then call the ``_``-methods here; the
  checks are what stand between a caller and a ``GGML_ASSERT``.
- One ``llama_batch`` is allocated per context (``llama_batch_init``), of the most tokens one
  call may hold (``min(n_batch, n_ctx)``; a non-causal model's: ``n_ubatch``), and freed
  exactly once, in ``_free``; decode and prefill refill it in place.
- ``logits()`` returns a zero-copy view of llama.cpp's buffer. The views handed out are released
  at the next decode and at close (``ContextFront``), so a stale view raises ``ValueError``
  instead of reading freed memory (unless the caller re-exported it, e.g. into numpy).
- ``kv_pack`` / ``kv_unpack`` / ``kv_unpack_chunks`` keep the invariants of ``_kv_state`` (one
  copy out, none in; a blob that does not restore leaves the sequence empty); a whole blob's
  cells are checked first (``kv_layout.check_cells``: none llama.cpp could not remove again,
  no recurrent state it would assert on). ``kv_unpack_joined`` restores a blob the codec
  joined from checked chunks, whose cells the join wrote canonical, so it checks only their
  positions against ``n_ctx`` (``kv_layout.check_joined``); a blob with stored bytes beside
  the join (a recurrent state), ext cells or another memory shape gets ``check_cells``.
  ``kv_split`` / ``kv_join`` are the pure ``LlamaKvCodec``: they take no lock and touch no
  native state.
- The native context has one sequence more than ``params.n_seq_max`` when llama.cpp allows it:
  the scratch sequence ``kv_unpack_chunks`` restores chunks through. No caller can name it
  (every seq id is checked against ``params.n_seq_max``) and it is empty between calls.
- The context holds its model (``acquire``) until ``_free`` has run ``llama_free``.

Reading a context's embeddings after a decode with ``embeddings=True`` (``LlamaContext.embed``).

Invariants: every pointer llama.cpp returns is checked before numpy reads it, and the values
are copied out before the next decode can overwrite them.
"""

from __future__ import annotations

import ctypes
import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvwarm.backends import _checks
from kvwarm.backends.base import (
    BatchToken,
    Buffer,
    ContextMemory,
    ContextParams,
    WritableBuffer,
    concrete_kv,
)
from kvwarm.backends.front import ContextFront
from kvwarm.backends.llama import kv_layout
from kvwarm.backends.llama import kv_state as _kv_state
from kvwarm.backends.llama import native as _native
from kvwarm.backends.llama import params as llama_params
from kvwarm.backends.llama.adapter import LlamaAdapter
from kvwarm.backends.llama.kv_codec import LlamaKvCodec
from kvwarm.backends.llama.kv_layout import HEAD
from kvwarm.buffers import U8, u8
from kvwarm.errors import (
    AdapterError,
    BackendError,
    ConfigError,
    ContextOverflowError,
    ModelLoadError,
    NoLogitsError,
    StateRestoreError,
)
from kvwarm.memory import MemoryKind

if TYPE_CHECKING:
    from kvwarm.backends.llama.model import LlamaModel


#: llama_rope_type values whose KV cells carry a 2-D position (M-RoPE, interleaved M-RoPE).
_EXT_ROPE = (8, 40)


class LlamaContext(ContextFront["LlamaModel", LlamaAdapter]):
    """``BackendContext`` over ``llama_init_from_model``; one thread drives it."""

    def __init__(self, model: LlamaModel, params: ContextParams) -> None:
        lib = model._lib
        self._lib = lib
        max_seq = int(lib.llama_max_parallel_sequences())
        if params.n_seq_max > max_seq:
            raise ConfigError(f"n_seq_max={params.n_seq_max} exceeds llama.cpp's limit")
        #: Streams, one per sequence (0: one unified KV buffer); see ``kv_layout.one_stream``.
        self._streams = 0 if params.kv_unified else params.n_seq_max
        #: The scratch sequence chunked restores go through (None: no room for one, or it
        #: would be a stream of its own, which seq_cp could only copy whole).
        self._scratch = (
            params.n_seq_max if params.n_seq_max < max_seq and not self._streams else None
        )
        cp = llama_params.context_params(
            lib, params, scratch_seqs=0 if self._scratch is None else 1
        )
        model.lifetime.acquire()
        _native.graphs_may_run()
        try:
            with model.lifetime.using(), _native.captured_log() as lines:
                ptr = lib.llama_init_from_model(model.native, cp)
            if not ptr:
                raise ModelLoadError(
                    f"llama.cpp could not create a context with {params!r} "
                    "(quantised V caches need flash attention; check the log)"
                )
            mem = lib.llama_get_memory(ptr)
            if not mem and not params.embeddings:
                # An encoder (BERT) keeps no KV cache: it has no state to generate from.
                lib.llama_free(ptr)
                raise ModelLoadError(
                    "this model keeps no KV cache (an encoder): it runs only pooled, as a "
                    "reranker (pooling rank) or for embeddings"
                )
        except BaseException:
            model.lifetime.release()
            raise
        self._ptr: object = ptr
        self._mem: object = mem or None  # None: stateless (no memory module)
        causal = bool(lib.llama_get_causal_attn(ptr))
        facts = model.facts
        self._memory = MemoryKind(facts.memory_kind, facts.n_swa, params.swa_full)
        #: The width of an output embedding (pooled or per token): the model's
        #: ``embedding_length_out`` where it has one (LFM2's dense projection), which is what
        #: llama.cpp stores per output. Found by review: n_embd was read, past the stored
        #: floats, where it was smaller.
        self._n_embd = int(lib.llama_model_n_embd_out(model.native))
        #: What a cell's metadata in a blob carries: the plain 12 bytes, or with M-RoPE (its
        #: 2-D position) or PLE heads (the token) llama.cpp's ``llama_kv_cell_ext`` too; a
        #: restore checks the cells either way (``kv_layout.check_cells``), and the stream
        #: rewrites (``one_stream``, ``widen``) walk them.
        rope = int(lib.llama_model_rope_type(model.native))
        ple = any(key.endswith(".ple.heads_per_ngram") for key in facts.metadata)
        self._cells = kv_layout.CellFormat(
            ext=rope in _EXT_ROPE or ple, mrope=rope in _EXT_ROPE, n_vocab=model.n_vocab
        )
        # llama.cpp rounds n_ctx up (to 256); positions are bounded by what was asked for.
        n_ctx = min(params.n_ctx, int(lib.llama_n_ctx_seq(ptr)), int(lib.llama_n_ctx(ptr)))
        #: Rows of the batches: the most tokens one call may hold (``ContextFront``'s checks:
        #: a causal model's positions stay below n_ctx, a non-causal call fits one ubatch),
        #: not n_batch as given. Found by review: n_batch 2**31 - 1 (inside validate's bound)
        #: over n_ctx 256 overflowed ``llama_batch_init``'s ``n_tokens_alloc + 1``, and it
        #: wrote through the NULL that malloc returned: a segfault as the context was made.
        self._batch_rows = min(params.n_batch, params.n_ctx) if causal else params.n_ubatch
        self._batch = lib.llama_batch_init(self._batch_rows, 0, params.n_seq_max)
        self._logits_at = _native.logits_at()
        self._row_type = ctypes.c_float * model.n_vocab  # one row of logits
        #: The batch media spans' embeddings go through, made on first use (``decode_embd``).
        self._embd_batch: Any = None
        n_embd_inp = int(lib.llama_model_n_embd_inp(model.native))
        self._codec = LlamaKvCodec(
            type_k=_native.GGML_TYPES[concrete_kv(params.type_k)],
            type_v=_native.GGML_TYPES[concrete_kv(params.type_v)],
            n_layer=model.facts.n_layer,
            v_trans={"auto": None, "on": False, "off": True}[params.flash_attn],
            with_rest=self._memory.has_rest,
            rest_cells=self._memory.rest_chunkable,
        )
        self._memory_bytes = buffer_sizes(lines)
        super().__init__(
            model,
            params,
            n_ctx=n_ctx,
            n_vocab=model.n_vocab,
            adapter=LlamaAdapter,
            n_embd=n_embd_inp,
            causal=causal,
            stateless=self._mem is None,
        )

    # -- properties ---------------------------------------------------------------------------

    @property
    def memory_bytes(self) -> ContextMemory:
        return self._memory_bytes

    @property
    def model(self) -> LlamaModel:
        return self._model

    # -- decoding -----------------------------------------------------------------------------

    def _pos_max(self, seq: int) -> int:
        if self._mem is None:
            return -1  # nothing kept: every sequence starts at position 0
        return int(self._lib.llama_memory_seq_pos_max(self._mem, seq))

    def _pos_min(self, seq: int) -> int:
        if self._mem is None:
            return -1
        return int(self._lib.llama_memory_seq_pos_min(self._mem, seq))

    def _forget(self, seq: int, p0: int) -> None:
        """Drop ``seq``'s positions from ``p0`` on (a failed call's); nothing if stateless."""
        if self._mem is not None:
            self._lib.llama_memory_seq_rm(self._mem, seq, p0, -1)

    def _decode(self, batch: Sequence[BatchToken]) -> None:
        # A pooling context outputs every position (llama.cpp overrides, and warns, if asked
        # for fewer); the rows asked for stay the ones ``logits`` answers for.
        every = 1 if self._params.embeddings else 0
        b = self._batch
        # One pass; the batch's arrays fetched once (each attribute read makes a pointer).
        token, pos, n_seq_id, seq_id, logits = b.token, b.pos, b.n_seq_id, b.seq_id, b.logits
        starts: dict[int, int] = {}
        rows: list[int] = []
        for i, item in enumerate(batch):
            token[i] = item.token
            pos[i] = item.pos
            n_seq_id[i] = 1
            seq_id[i][0] = item.seq
            if item.logits:
                logits[i] = 1
                rows.append(i)
            else:
                logits[i] = every
            if item.seq not in starts:
                starts[item.seq] = item.pos
        self._run(len(batch), starts)
        self._rows = rows

    def _prefill(self, seq: int, tokens: Sequence[int], start_pos: int) -> None:
        toks = list(tokens)
        total = len(toks)
        every = 1 if self._params.embeddings else 0
        b = self._batch
        for offset, length in _checks.aligned_chunks(start_pos, total, self._params.n_batch):
            pos0 = start_pos + offset
            ctypes.memmove(b.token, (ctypes.c_int32 * length)(*toks[offset : offset + length]),
                           4 * length)  # fmt: skip
            ctypes.memmove(b.pos, (ctypes.c_int32 * length)(*range(pos0, pos0 + length)),
                           4 * length)  # fmt: skip
            ctypes.memset(b.logits, every, length)
            for i in range(length):
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
            last = offset + length == total
            if last:
                b.logits[length - 1] = 1
            try:
                self._run(length, {seq: pos0})
            except BaseException:
                # Earlier chunks succeeded: undo them so the sequence is as before the call.
                self._forget(seq, start_pos)
                raise
            self._rows = [length - 1] if last else []

    def _decode_embd(
        self,
        seq: int,
        start_pos: int,
        embd: memoryview,
        n_tokens: int,
        non_causal: bool,
        logits: bool,
    ) -> None:
        lib = self._lib
        if self._embd_batch is None:
            # As many rows as a span may have (``check_embd``): a causal one fills up to
            # n_batch (llama_decode splits it into ubatches). One ubatch of rows, as this was,
            # had a longer causal span copied past the batch's end (a segfault).
            self._embd_batch = lib.llama_batch_init(self._batch_rows, self._n_embd_inp, 1)
        if n_tokens > self._batch_rows:
            raise BackendError(f"a span of {n_tokens} positions exceeds the embedding batch")
        b = self._embd_batch
        src = np.frombuffer(embd, dtype=np.uint8)
        ctypes.memmove(b.embd, src.ctypes.data, src.nbytes)
        for i in range(n_tokens):
            b.pos[i] = start_pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 0
        if logits:
            b.logits[n_tokens - 1] = 1
        # A span that attends to itself both ways (Gemma 3's images) is decoded with causal
        # attention off for this one call, alone: no other sequence's tokens share it.
        if non_causal:
            lib.llama_set_causal_attn(self._ptr, False)
        try:
            self._run(n_tokens, {seq: start_pos}, b)
        finally:
            if non_causal:
                lib.llama_set_causal_attn(self._ptr, True)
        self._rows = [n_tokens - 1] if logits else []

    def _run(self, n_tokens: int, starts: dict[int, int], batch: Any = None) -> None:
        """``llama_decode`` the first ``n_tokens`` rows of the batch (the token batch unless
        another is given); typed errors on failure."""
        self._drop_logits()
        batch = self._batch if batch is None else batch
        batch.n_tokens = n_tokens
        rc = int(self._lib.llama_decode(self._ptr, batch))
        if rc == 0:
            return
        # Fatal errors leave processed ubatches in memory; drop them so state is consistent.
        for seq, pos in starts.items():
            self._forget(seq, pos)
        if rc == 1:
            raise ContextOverflowError(
                "no KV cache slot for this batch (the context is full)",
                n_tokens=n_tokens,
                n_ctx=self._n_ctx,
            )
        if rc == 2:
            raise BackendError("llama_decode was aborted")
        raise BackendError(f"llama_decode failed with code {rc}")

    def _logits(self, row: int) -> memoryview[float]:
        address = self._logits_at(self._ptr, row)
        if not address:
            raise NoLogitsError(f"llama.cpp has no logits for batch row {row}")
        return memoryview(self._row_type.from_address(address)).cast("B").cast("f")

    def _logits_block(self, out: int, first: int, count: int) -> memoryview[float]:
        # llama.h: the logits of the rows that asked for them are stored contiguously, in
        # batch order; both ends are checked against that before one view spans them.
        start = self._logits_at(self._ptr, first)
        end = self._logits_at(self._ptr, first + count - 1)
        if not start or not end:
            raise NoLogitsError(f"llama.cpp has no logits for batch rows {first}..")
        if end - start != (count - 1) * self._n_vocab * 4:
            raise NoLogitsError(f"batch rows {first}.. do not hold their logits contiguously")
        array = (ctypes.c_float * (count * self._n_vocab)).from_address(start)
        return memoryview(array).cast("B").cast("f")

    def sample_with(self, chain: object, index: int) -> int:
        """``llama_sampler_sample`` on row ``index`` (for ``LlamaSampler``), under our lock."""
        with self._life.using():
            return int(self._lib.llama_sampler_sample(chain, self._ptr, self._row(index)))

    # -- KV state -----------------------------------------------------------------------------

    def _kv_pack(self, seq: int) -> bytes:
        blob = _kv_state.pack(self._lib, self._ptr, seq)
        if self._streams:
            return kv_layout.one_stream(u8(blob), self._memory.kv_caches, self._cells)
        return blob

    def _kv_pack_tail(self, seq: int, start: int) -> tuple[bytes, int]:
        if start == 0 or self._scratch is None or not self._memory.chunkable:
            return self._kv_pack(seq), 0
        tail = _kv_state.pack_tail(self._lib, self._ptr, self._mem, seq, self._scratch, start)
        return tail, start

    def _kv_unpack(self, seq: int, data: bytes | bytearray | memoryview) -> int:
        memory = self._memory
        return self._unpack_checked(
            seq,
            data,
            lambda blob: kv_layout.check_cells(
                blob,
                caches=memory.kv_caches,
                recurrent=memory.kind in ("recurrent", "hybrid"),
                n_ctx=self._n_ctx,
                cells=self._cells,
            ),
        )

    def _kv_unpack_joined(self, seq: int, blob: memoryview, head: int, window: int | None) -> int:
        # The codec's joins write only canonical cells (sequence 0, positions in order from 0,
        # a window's from ``window``: ``LlamaKvCodec``), so of ``check_cells``'s rule only the
        # positions against n_ctx are left to check; that holds for 12-byte cells of a KV
        # memory whose blob is exactly the caches joined. Anything else is checked whole.
        memory = self._memory
        caches = 1 if window is None else 2
        if self._cells.ext or memory.kind in ("recurrent", "hybrid") or memory.kv_caches != caches:
            return self._kv_unpack(seq, blob)
        return self._unpack_checked(
            seq,
            blob,
            lambda data: kv_layout.check_joined(data, head, window, n_ctx=self._n_ctx),
        )

    @property
    def _restores_apart(self) -> bool:
        # An iSWA memory (two caches of 12-byte cells, one stream) restores a window row one
        # cache at a time, each joined just before llama.cpp reads it (``WindowJoin``); any
        # other memory, per-sequence streams or ext cells restore the joined blob.
        memory = self._memory
        return (
            not self._streams
            and not self._cells.ext
            and memory.rest_chunkable
            and memory.kv_caches == 2
        )

    def _kv_unpack_apart(
        self,
        seq: int,
        chunks: Sequence[Buffer],
        out: WritableBuffer,
        rest_chunks: Sequence[Buffer],
        rest_from: int,
    ) -> int:
        row = self._codec.join_apart(chunks, rest_chunks, rest_from)  # refused: untouched
        staged = row.stage(out)  # too small: JoinBufferTooSmallError, untouched
        try:
            kv_layout.check_ends((row.first_end, row.window_end), n_ctx=self._n_ctx)
            if row.window_end != row.first_end:
                raise StateRestoreError(
                    f"the row's window ends at {row.window_end}, its first cache at {row.first_end}"
                )
        except StateRestoreError:
            self._forget(seq, 0)  # refused here as by check_joined: the sequence is left empty
            raise
        return _kv_state.unpack_apart(
            self._lib, self._ptr, self._mem, seq, row, staged, self._n_ctx
        )

    def _unpack_checked(
        self, seq: int, data: bytes | bytearray | memoryview, check: Callable[[U8], None]
    ) -> int:
        """``check`` the blob's cells, then restore it (widened to this context's streams);
        a blob refused here, as one llama.cpp refuses, leaves the sequence empty."""
        memory = self._memory
        try:
            check(u8(data))
            if self._streams:
                data = kv_layout.widen(u8(data), memory.kv_caches, self._streams, self._cells)
        except StateRestoreError:
            self._forget(seq, 0)  # refused here as by llama.cpp: the sequence is left empty
            raise
        return _kv_state.unpack(
            self._lib,
            self._ptr,
            self._mem,
            seq,
            data,
            self._n_ctx,
            from_zero=self._memory.chunkable,
        )

    def _kv_unpack_chunks(self, seq: int, chunks: Sequence[Buffer], base: int) -> int | None:
        parts = self._codec.blobs(chunks, base)
        if parts is None or self._scratch is None or not self._memory.chunkable:
            return None
        n = base + sum(int(HEAD.unpack_from(part.data, 0)[3]) for part in parts)
        if n > self._n_ctx:
            raise StateRestoreError(f"KV chunks hold {n} positions; n_ctx={self._n_ctx}")
        return _kv_state.unpack_chunks(
            self._lib,
            self._ptr,
            self._mem,
            seq,
            self._scratch,
            parts,
            self._n_ctx,
            base=base,
            n_end=n,
        )

    @property
    def restores_tails(self) -> bool:
        return self._scratch is not None and self._memory.chunkable and self._mem is not None

    @property
    def copies_by_pack(self) -> bool:
        return bool(self._streams)

    @property
    def kv_codec(self) -> LlamaKvCodec:
        return self._codec

    def _seq_rm(self, seq: int, p0: int, p1: int) -> None:
        if not self._lib.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise StateRestoreError(
                f"this model's memory ({self._memory.describe()}) cannot remove "
                f"[{p0}, {p1}) of seq {seq}"
            )

    def _seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if self._streams:
            self._copy_stream(src, dst, p0, p1)
            return
        lib, mem = self._lib, self._mem
        # dst := src[p0:p1). Clearing dst first keeps it free of duplicate positions, which
        # would make its next decode inconsistent. (Cells are shared, not copied: the context
        # has one unified KV stream. Across streams llama.cpp would GGML_ASSERT on a partial
        # range.)
        lib.llama_memory_seq_rm(mem, dst, -1, -1)
        lib.llama_memory_seq_cp(mem, src, dst, p0, p1)

    def _copy_stream(self, src: int, dst: int, p0: int, p1: int) -> None:
        """dst := src[p0:p1) across streams. llama.cpp's own cross-stream seq_cp copies whole
        streams only (a partial range is a GGML_ASSERT) and applies the copy at the next
        decode; a pack and an unpack through host memory is exact and done on return, and
        puts dst's cells where src's were (both streams hold one sequence each)."""
        blob = _kv_state.pack(self._lib, self._ptr, src)
        _kv_state.unpack(
            self._lib,
            self._ptr,
            self._mem,
            dst,
            blob,
            self._n_ctx,
            from_zero=self._memory.chunkable,
        )
        lib, mem = self._lib, self._mem
        trims = ([(p1, -1)] if p1 >= 0 else []) + ([(0, p0)] if p0 > 0 else [])
        for a, b in trims:
            if not lib.llama_memory_seq_rm(mem, dst, a, b) or not self._window_whole(dst):
                lib.llama_memory_seq_rm(mem, dst, -1, -1)
                raise StateRestoreError(
                    f"this model's memory ({self._memory.describe()}) cannot keep only "
                    f"[{p0}, {p1}) of a copy of seq {src}"
                )

    def _window_whole(self, seq: int) -> bool:
        """Whether ``seq``'s sliding window holds every position its next token attends to
        (llama-server's rule: ``pos_min <= max(0, n - n_swa)``). A packed window leaves out
        the masked cells a live one keeps, so a copy trimmed below its source's length may
        miss some: a wrong state, which llama.cpp's ``seq_rm`` does not refuse."""
        n_swa = self._memory.n_swa
        if self._memory.kind != "swa" or n_swa <= 0:
            return True
        n = int(self._lib.llama_memory_seq_pos_max(self._mem, seq)) + 1
        pos_min = int(self._lib.llama_memory_seq_pos_min(self._mem, seq))
        return n == 0 or 0 <= pos_min <= max(0, n - n_swa)

    @property
    def memory(self) -> MemoryKind:
        return self._memory

    def _clear(self) -> None:
        self._lib.llama_memory_clear(self._mem, True)

    def _reserve_outputs(self, rows: int) -> None:
        # llama.cpp's ``output_reserve`` grows the logits buffer (n_vocab floats a row) only
        # when a pass asks for more rows than any before: one pass of ``rows`` rows, its
        # logits written (so its pages are in), then the context emptied, and checked so.
        if rows <= 1:
            return
        try:
            self._decode([BatchToken(0, pos, 0, True) for pos in range(rows)])
        finally:
            self._drop_logits()
            self._clear()
        if self._pos_max(0) != -1:
            raise StateRestoreError("the context kept cells after it was emptied")

    # -- embeddings and adapters --------------------------------------------------------------

    def _embed(self, tokens: Sequence[int], *, normalize: bool) -> list[float]:
        n = len(tokens)
        lib, b = self._lib, self._batch
        self._forget(0, 0)
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        try:
            self._run(n, {0: 0})
            pooled = self._params.pooling != "none"
            vec = _read_embeddings(lib, self._ptr, n, self._n_embd, pooled=pooled)
        finally:
            self._forget(0, 0)
            self._rows = []
        return _embedding_list(vec, normalize=normalize)

    def _pooled(self, seq: int) -> tuple[float, ...] | None:
        n = self._model.facts.n_cls_out if self._params.pooling == "rank" else self._n_embd
        # NULL for a sequence the last decode held no position of (llama.cpp clears its map
        # at each decode), so a stale score is None here, never an old number.
        ptr = self._lib.llama_get_embeddings_seq(self._ptr, seq)
        if not ptr:
            return None
        return tuple(float(x) for x in ptr[:n])

    def _attach(self, adapters: Sequence[tuple[LlamaAdapter, float]]) -> None:
        n = len(adapters)
        lib = self._lib
        if n:
            ptrs = (lib.llama_adapter_lora_p_ctypes * n)(*(a.native for a, _ in adapters))
            scales = (ctypes.c_float * n)(*(s for _, s in adapters))
            rc = int(lib.llama_set_adapters_lora(self._ptr, ptrs, n, scales))
        else:
            rc = int(lib.llama_set_adapters_lora(self._ptr, None, 0, None))
        if rc != 0:
            raise AdapterError(f"llama_set_adapters_lora failed with code {rc}")

    # -- lifetime -----------------------------------------------------------------------------

    def _free(self) -> None:
        self._drop_logits()
        lib = self._lib
        lib.llama_batch_free(self._batch)
        if self._embd_batch is not None:
            lib.llama_batch_free(self._embd_batch)
            self._embd_batch = None
        lib.llama_free(self._ptr)
        self._ptr = None
        self._mem = None
        self._release_adapters()
        self._model.lifetime.release()


# --- Reading embeddings after a decode with ``embeddings=True`` (``LlamaContext.embed``):
# every pointer llama.cpp returns is checked before numpy reads it, and the values are copied
# out before the next decode can overwrite them.


def _read_embeddings(
    lib: Any, ctx: object, n: int, n_embd: int, *, pooled: bool
) -> npt.NDArray[np.float64]:
    """Sequence 0's pooled embedding, or (no pooling) the mean of its ``n`` token rows."""
    if pooled:
        ptr = lib.llama_get_embeddings_seq(ctx, 0)
        if not ptr:
            raise BackendError("llama.cpp returned no pooled embedding")
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(np.float64)
    rows = []
    for i in range(n):
        ptr = lib.llama_get_embeddings_ith(ctx, i)
        if not ptr:
            raise BackendError("llama.cpp returned no token embeddings")
        rows.append(np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy())
    mean: npt.NDArray[np.float64] = np.mean(np.stack(rows), axis=0, dtype=np.float64)
    return mean


def _embedding_list(vec: npt.NDArray[np.float64], *, normalize: bool) -> list[float]:
    """``vec`` as floats, scaled to unit length when ``normalize`` (a zero vector stays)."""
    if normalize:
        norm = math.sqrt(float(np.dot(vec, vec)))
        if norm > 0:
            vec = vec / norm
    return [float(x) for x in np.asarray(vec, dtype=np.float64).ravel()]


# "llama_kv_cache:        CPU KV buffer size =    22.50 MiB", "... RS buffer size ...",
# "llama_context:        CPU  output buffer size = ...", "sched_reserve: CPU compute buffer ..."
_BUFFER_LINE = re.compile(r"\b(KV|RS|output|compute) buffer size =\s*([0-9.]+) MiB")


def buffer_sizes(lines: Sequence[str]) -> ContextMemory:
    """The buffers llama.cpp logged while creating a context (it has no API that returns
    them): KV and recurrent-state buffers, and the rest. MiB to 2 decimals: +-5 KiB each."""
    kv = other = 0
    for line in lines:
        for kind, mib in _BUFFER_LINE.findall(line):
            n = round(float(mib) * (1 << 20))
            if kind in ("KV", "RS"):
                kv += n
            else:
                other += n
    return ContextMemory(kv, other)
