"""``ContextFront``: the half of a ``BackendContext`` every backend shares, written once.

Each public method holds the context's lifetime, checks its arguments (``_checks``) and only
then calls the backend's own ``_``-method; the stub (``stub/context.py``) and llama.cpp
(``llama/context.py``) implement those and nothing before them.

Invariants:

- Every argument is checked before a backend sees it, the same way for every backend: seq ids,
  position ranges, batches (sizes, token ids, positions that continue each sequence, positions
  < ``n_ctx``; at most ``n_batch`` tokens, and no more than ``n_ctx`` for a causal model, as
  llama.cpp clamps it), prefills, embedding inputs, logits rows that were requested, adapters (this
  model's, finite scales). So the stub refuses exactly what llama.cpp's context refuses, with
  the same error types and messages, and no argument reaches a llama.cpp ``GGML_ASSERT``.
- Every public method runs inside ``Lifetime.using()`` (``kv_split``/``kv_join``, and the
  join of ``kv_unpack_joined``, only check it: the codec is pure and takes no lock), so a
  close from another thread waits for the call in flight; ``_free`` runs once, after
  ``close()`` and the last dependent.
- The ``logits()`` views handed out are released before the next decode (``_drop_logits``)
  and at close, so a stale view raises ``ValueError`` instead of reading freed memory.
- A context holds each attached adapter (``acquire``); ``set_adapters`` acquires the new ones
  before the backend attaches them and releases the old ones only once it has.
- A model whose attention is not causal (an encoder) attends across a whole forward pass, which
  llama.cpp asserts fits one ubatch: a larger call is refused here, and a prefill must be one
  whole call from position 0. A *stateless* context (an encoder has no KV cache) keeps nothing
  after a decode: its sequence operations do nothing, and packing or setting its KV is a
  ``StateRestoreError``.
- ``pooled`` reads a sequence's pooled output (a reranker's scores) only from the last decode:
  a sequence that decode did not hold is ``NoLogitsError``, never an older number.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar, cast, overload

from kvwarm.backends import _checks
from kvwarm.backends.base import Adapter, BatchToken, Buffer, ContextParams, WritableBuffer
from kvwarm.backends.kv_codec import KvCodec, join_row
from kvwarm.backends.lifetime import Lifetime
from kvwarm.errors import AdapterError, InvalidRequestError, NoLogitsError, StateRestoreError

log = logging.getLogger(__name__)


class HeldAdapter(Adapter, Protocol):
    """A backend's adapter: it names its model and holds it open (``lifetime``)."""

    @property
    def model(self) -> object: ...

    @property
    def lifetime(self) -> Lifetime: ...


M = TypeVar("M")  # the backend's model
A = TypeVar("A", bound=HeldAdapter)  # the backend's adapter


class ContextFront(ABC, Generic[M, A]):
    """The checked, lifetime-holding front of one backend context. See the module invariants."""

    def __init__(
        self,
        model: M,
        params: ContextParams,
        *,
        n_ctx: int,
        n_vocab: int,
        adapter: type[A],
        n_embd: int = 0,
        causal: bool = True,
        stateless: bool = False,
    ) -> None:
        """Last in a backend context's ``__init__``, once its resources exist: from here on
        ``close()`` frees them (``_free``). ``n_ctx`` bounds positions (llama.cpp rounds its
        own up); ``adapter`` is the only adapter type ``set_adapters`` accepts; ``n_embd`` the
        width of the embeddings ``decode_embd`` takes (the model's input width); ``causal``:
        the model's attention; ``stateless``: the context keeps no KV (module invariants)."""
        self._model = model
        self._n_embd_inp = n_embd
        self._params = params
        self._n_ctx = n_ctx
        self._n_vocab = n_vocab
        self._causal = causal
        self._stateless = stateless
        self._adapter_type = adapter
        self._rows: list[int] = []  # batch rows of the last decode that asked for logits
        self._views: list[memoryview[float]] = []
        self._adapters: list[tuple[A, float]] = []
        #: The most tokens one decode may hold: llama.cpp clamps a causal context's n_batch to
        #: its n_ctx and GGML_ASSERTs on a larger batch (found by review: n_ctx 16, n_batch 64
        #: and two sequences' 16 tokens each aborted the process).
        self._max_batch = min(params.n_batch, params.n_ctx) if causal else params.n_batch
        self._life = Lifetime("context", self._free)

    @property
    def params(self) -> ContextParams:
        return self._params

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_batch(self) -> int:
        return self._params.n_batch

    @property
    def lifetime(self) -> Lifetime:
        return self._life

    @property
    def stateless(self) -> bool:
        return self._stateless

    @property
    @abstractmethod
    def kv_codec(self) -> KvCodec: ...

    # -- decoding -----------------------------------------------------------------------------

    def decode(self, batch: Sequence[BatchToken]) -> None:
        with self._life.using():
            params = self._params
            _checks.check_batch(
                batch,
                n_batch=self._max_batch,
                n_ctx=self._n_ctx,
                n_vocab=self._n_vocab,
                n_seq_max=params.n_seq_max,
                pos_max=self._pos_max,
            )
            if not self._causal:
                self._check_whole(len(batch))
            self._decode(batch)

    def prefill(self, seq: int, tokens: Sequence[int], start_pos: int) -> None:
        with self._life.using():
            _checks.check_prefill(
                seq,
                tokens,
                start_pos,
                n_ctx=self._n_ctx,
                n_vocab=self._n_vocab,
                n_seq_max=self._params.n_seq_max,
                pos_max=self._pos_max,
            )
            if not self._causal and (start_pos or len(tokens) > self._params.n_batch):
                raise InvalidRequestError(
                    "this model's attention is not causal: a prompt is prefilled whole, "
                    f"from position 0, in one call of at most n_batch={self._params.n_batch}",
                    param="tokens",
                )
            self._check_whole(len(tokens))
            self._prefill(seq, tokens, start_pos)

    def decode_embd(
        self,
        seq: int,
        start_pos: int,
        embd: Buffer,
        n_tokens: int,
        *,
        non_causal: bool,
        logits: bool = False,
    ) -> None:
        with self._life.using():
            view = memoryview(embd)
            _checks.check_embd(
                seq,
                start_pos,
                view.nbytes,
                n_tokens,
                n_embd=self._n_embd_inp,
                room=(
                    min(self._params.n_ubatch, self._params.n_batch)
                    if non_causal
                    else self._params.n_batch
                ),
                n_ctx=self._n_ctx,
                n_seq_max=self._params.n_seq_max,
                pos_max=self._pos_max,
            )
            self._decode_embd(seq, start_pos, view.cast("B"), n_tokens, bool(non_causal), logits)

    def _check_whole(self, n_tokens: int) -> None:
        """A non-causal call attends across all of it: llama.cpp asserts it fits one ubatch."""
        if not self._causal and n_tokens > self._params.n_ubatch:
            raise InvalidRequestError(
                f"{n_tokens} tokens exceed n_ubatch={self._params.n_ubatch}: this model's "
                "attention is not causal, so a call must fit one ubatch",
                param="batch",
            )

    def logits(self, index: int = -1) -> memoryview:
        with self._life.using():
            view = self._logits(self._row(index))
            self._views.append(view)
            # The protocol's plain ``memoryview``; its format is "f" (len == n_vocab).
            return cast(memoryview, view)

    def logits_block(self, first: int, count: int) -> memoryview:
        with self._life.using():
            j = _checks.resolve_block(first, count, self._rows)
            if j < 0:
                raise NoLogitsError(
                    f"no logits for all of batch rows {first}..{first + count - 1} "
                    "(decode with logits first)"
                )
            view = self._logits_block(j, first, count)
            self._views.append(view)
            return cast(memoryview, view)

    def _logits_block(self, out: int, first: int, count: int) -> memoryview[float]:
        """The logits of batch rows ``first ..`` (``count``, all with logits; ``out``: the
        first one's index among the rows that have them) as one view. By default a copy of
        the rows; a backend whose rows lie one after another overrides it with a view."""
        block = b"".join(bytes(self._logits(first + i)) for i in range(count))
        return memoryview(block).cast("f")

    def _row(self, index: int) -> int:
        """The batch row holding the logits of the caller's ``index`` (-1: the last);
        ``NoLogitsError`` if the last decode asked for none there."""
        row = _checks.resolve_row(index, self._rows)
        if row < 0:
            raise NoLogitsError(f"no logits for batch row {index} (decode with logits first)")
        return row

    def _drop_logits(self) -> None:
        """The last pass's logits gone: every view of them released, no row readable."""
        self._rows = []
        for view in self._views:
            try:
                view.release()
            except BufferError:
                log.debug("a logits view is still exported; it now reads stale logits")
        self._views.clear()

    # -- KV state -----------------------------------------------------------------------------

    def _stateful(self) -> None:
        if self._stateless:
            raise StateRestoreError("this context keeps no KV state (an encoder) to pack or set")

    def kv_pack(self, seq: int) -> bytes:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            self._stateful()
            return self._kv_pack(seq)

    def kv_pack_tail(self, seq: int, start: int) -> tuple[bytes, int]:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            _checks.check_range(start, -1)
            self._stateful()
            return self._kv_pack_tail(seq, start)

    def kv_unpack(self, seq: int, data: bytes | bytearray | memoryview) -> int:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            self._stateful()
            return self._kv_unpack(seq, data)

    def kv_unpack_chunks(self, seq: int, chunks: Sequence[Buffer], *, base: int = 0) -> int | None:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            _checks.check_range(base, -1)
            self._stateful()
            return self._kv_unpack_chunks(seq, chunks, base)

    def kv_unpack_joined(
        self,
        seq: int,
        chunks: Sequence[Buffer],
        out: WritableBuffer,
        *,
        rest: Buffer = b"",
        rest_chunks: Sequence[Buffer] = (),
        rest_from: int = 0,
    ) -> int:
        _checks.check_seq(seq, self._params.n_seq_max)
        self._life.check()
        if rest_chunks and not memoryview(rest).nbytes and self._restores_apart:
            # A window row restored one cache at a time is joined under the lock, each cache
            # between the restores.
            with self._life.using():
                self._stateful()
                return self._kv_unpack_apart(seq, chunks, out, rest_chunks, rest_from)
        # The join is pure and takes no lock (as kv_join); the restore holds it.
        blob, head = join_row(
            self.kv_codec, chunks, out, rest=rest, rest_chunks=rest_chunks, rest_from=rest_from
        )
        with self._life.using():
            self._stateful()
            if memoryview(rest).nbytes:  # stored bytes besides the join's: checked as any blob
                return self._kv_unpack(seq, blob)
            return self._kv_unpack_joined(seq, blob, head, rest_from if rest_chunks else None)

    def kv_split(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        # No lock: the codec is pure, so a writer thread never waits for a decode.
        self._life.check()
        return self.kv_codec.split(blob, bounds)

    @overload
    def kv_join(self, chunks: Sequence[Buffer], out: None = None) -> bytearray: ...
    @overload
    def kv_join(self, chunks: Sequence[Buffer], out: WritableBuffer) -> memoryview: ...
    def kv_join(
        self, chunks: Sequence[Buffer], out: WritableBuffer | None = None
    ) -> bytearray | memoryview:
        self._life.check()
        codec = self.kv_codec
        return codec.join(chunks) if out is None else codec.join(chunks, out)

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            _checks.check_range(p0, p1)
            if not self._stateless:  # nothing is held to remove
                self._seq_rm(seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        with self._life.using():
            _checks.check_seq(src, self._params.n_seq_max, param="src")
            _checks.check_seq(dst, self._params.n_seq_max, param="dst")
            _checks.check_range(p0, p1)
            if src != dst and not self._stateless:  # nothing is held to share
                self._seq_cp(src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            return self._pos_max(seq)

    def seq_pos_min(self, seq: int) -> int:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            return self._pos_min(seq)

    def clear(self) -> None:
        with self._life.using():
            if not self._stateless:
                self._clear()

    def reserve_outputs(self, rows: int) -> None:
        with self._life.using():
            if not self._stateless and self._causal:
                self._reserve_outputs(min(rows, self._max_batch, self._n_ctx))

    def _reserve_outputs(self, rows: int) -> None:
        """``reserve_outputs`` (``rows`` within n_batch and n_ctx): nothing to do unless the
        backend grows a buffer by a pass's rows."""

    # -- embeddings and adapters --------------------------------------------------------------

    def embed(self, tokens: Sequence[int], *, normalize: bool = True) -> list[float]:
        with self._life.using():
            if not self._params.embeddings:
                raise InvalidRequestError(
                    "this context was not created with embeddings=True", param="input"
                )
            if self._params.pooling == "rank":
                # Found by review: llama.cpp keeps a rank-pooled sequence's classifier outputs
                # alone (n_cls_out floats), and n_embd were read from there, past their end.
                raise InvalidRequestError(
                    "a context pooling by rank scores its sequences (pooled); it has no "
                    "embedding to return",
                    param="input",
                )
            if not tokens:
                raise InvalidRequestError("cannot embed zero tokens", param="input")
            # Pooling needs the whole sequence in one ubatch.
            if len(tokens) > min(self._params.n_ubatch, self._n_ctx):
                raise InvalidRequestError(
                    f"{len(tokens)} tokens exceed n_ubatch={self._params.n_ubatch}",
                    param="input",
                )
            _checks.check_tokens(tokens, self._n_vocab)
            return self._embed(tokens, normalize=normalize)

    def pooled(self, seq: int) -> tuple[float, ...]:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            if not self._params.embeddings or self._params.pooling == "none":
                raise InvalidRequestError("this context does not pool its sequences")
            values = self._pooled(seq)
            if values is None:
                raise NoLogitsError(f"no pooled output for seq {seq} from the last decode")
            return values

    def set_adapters(self, adapters: Sequence[tuple[Adapter, float]]) -> None:
        with self._life.using():
            chosen: list[tuple[A, float]] = []
            for adapter, scale in adapters:
                if not isinstance(adapter, self._adapter_type) or adapter.model is not self._model:
                    raise AdapterError("adapter was not loaded by this context's model")
                if not math.isfinite(scale):
                    raise InvalidRequestError(f"adapter scale {scale} is not finite")
                chosen.append((adapter, float(scale)))
            acquired: list[A] = []
            try:
                for adapter, _ in chosen:
                    adapter.lifetime.acquire()
                    acquired.append(adapter)
                self._attach(chosen)
            except BaseException:
                for adapter in acquired:
                    adapter.lifetime.release()
                raise
            self._release_adapters()
            self._adapters = chosen

    def _release_adapters(self) -> None:
        for adapter, _ in self._adapters:
            adapter.lifetime.release()
        self._adapters = []

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        self._life.close()

    # -- what a backend implements: called under the lifetime, with checked arguments ---------

    @abstractmethod
    def _pos_max(self, seq: int) -> int:
        """Largest position ``seq`` holds, -1 if empty (no lifetime: checks call it too)."""

    @abstractmethod
    def _pos_min(self, seq: int) -> int: ...

    @abstractmethod
    def _decode(self, batch: Sequence[BatchToken]) -> None:
        """One forward pass; ``_rows`` then names the rows that asked for logits."""

    @abstractmethod
    def _prefill(self, seq: int, tokens: Sequence[int], start_pos: int) -> None: ...

    @abstractmethod
    def _decode_embd(
        self,
        seq: int,
        start_pos: int,
        embd: memoryview,
        n_tokens: int,
        non_causal: bool,
        logits: bool,
    ) -> None:
        """One pass over a span's embeddings (checked); ``_rows`` then names the last row if
        ``logits``."""

    @abstractmethod
    def _logits(self, row: int) -> memoryview[float]:
        """A view of batch row ``row``'s logits (one of ``_rows``)."""

    @abstractmethod
    def _kv_pack(self, seq: int) -> bytes: ...

    @abstractmethod
    def _kv_pack_tail(self, seq: int, start: int) -> tuple[bytes, int]: ...

    @abstractmethod
    def _kv_unpack(self, seq: int, data: bytes | bytearray | memoryview) -> int: ...

    @abstractmethod
    def _kv_unpack_chunks(self, seq: int, chunks: Sequence[Buffer], base: int) -> int | None: ...

    def _kv_unpack_joined(self, seq: int, blob: memoryview, head: int, window: int | None) -> int:
        """Restore ``blob``, written by this context's codec alone (``join_row``: its first
        cache's ``head`` bytes, then, when ``window`` is a position, the window joined from
        it). By default as any blob (``_kv_unpack``); a backend whose codec's joins are
        known to write only cells it accepts may check less."""
        return self._kv_unpack(seq, blob)

    @property
    def _restores_apart(self) -> bool:
        """Whether this context restores a window row one cache at a time
        (``_kv_unpack_apart``); by default it joins the row and restores the blob."""
        return False

    def _kv_unpack_apart(
        self,
        seq: int,
        chunks: Sequence[Buffer],
        out: WritableBuffer,
        rest_chunks: Sequence[Buffer],
        rest_from: int,
    ) -> int:
        """Restore a window row (``chunks`` of its first cache, ``rest_chunks`` of its window
        from ``rest_from``) one cache at a time through ``out``, as ``kv_unpack_joined``
        promises: chunks refused before the sequence is touched, ``JoinBufferTooSmallError``
        before anything is restored. Called only where ``_restores_apart``."""
        raise NotImplementedError

    @abstractmethod
    def _seq_rm(self, seq: int, p0: int, p1: int) -> None: ...

    @abstractmethod
    def _seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """dst := src[p0:p1) (``src != dst``)."""

    @abstractmethod
    def _clear(self) -> None: ...

    @abstractmethod
    def _embed(self, tokens: Sequence[int], *, normalize: bool) -> list[float]: ...

    @abstractmethod
    def _pooled(self, seq: int) -> tuple[float, ...] | None:
        """``seq``'s pooled output from the last decode (a rank pooling: its classifier's
        values), or None if that decode held no position of it."""

    @abstractmethod
    def _attach(self, adapters: Sequence[tuple[A, float]]) -> None:
        """Attach exactly ``adapters`` (already held) in place of the ones attached now."""

    @abstractmethod
    def _free(self) -> None:
        """Free the backend's resources, once (``Lifetime``); release the adapters
        (``_release_adapters``) and views (``_drop_logits``) where the backend must."""
