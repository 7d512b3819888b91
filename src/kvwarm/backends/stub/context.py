"""The stub backend's context: fake KV cells chained by hash, and blobs in a checked format.

Each KV cell of a sequence holds ``(pos, token, h)`` where ``h`` chains the previous cell's
``h`` with ``(token, pos)``, so a cell depends on the whole prefix, exactly as real KV does.

Invariants: every check the llama.cpp context makes (``_checks``) is made here too, with the
same exception types; a context holds its model open until it is closed (``_lifetime``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast, overload

import numpy as np
import numpy.typing as npt

from kvwarm.backends import _checks
from kvwarm.backends.base import (
    Adapter,
    BatchToken,
    Buffer,
    ContextMemory,
    ContextParams,
    WritableBuffer,
)
from kvwarm.backends.lifetime import Lifetime
from kvwarm.backends.stub.adapter import StubAdapter
from kvwarm.backends.stub.kv_codec import CELL, HEADER, MAGIC, StubKvCodec
from kvwarm.backends.stub.vocab import EOS, N_BYTE_TOKENS, N_EMBD, N_VOCAB, OFFSET
from kvwarm.buffers import u8
from kvwarm.errors import (
    AdapterError,
    InvalidRequestError,
    ModelLoadError,
    NoLogitsError,
    StateRestoreError,
)
from kvwarm.memory import MemoryKind

if TYPE_CHECKING:
    from kvwarm.backends.stub import StubModel

log = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def _mix(h: int, token: int, pos: int) -> int:
    """splitmix64 of the previous cell's hash folded with this cell's (token, pos)."""
    z = (h ^ (token * 0x9E3779B97F4A7C15) ^ ((pos + 1) * 0xBF58476D1CE4E5B9)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


_H0 = 0x6B767761726D2121  # the hash "before" position 0
_POISON = 0x5752_4F4E_475F_4B56  # folded into a cell decoded without what it attends to


@dataclass(frozen=True, slots=True)
class _Cell:
    token: int
    h: int


class StubContext:
    """Per-sequence dicts of cells; logits computed at decode for rows that ask for them."""

    def __init__(self, model: StubModel, params: ContextParams) -> None:
        facts = model.facts
        if not facts.causal and not params.embeddings:
            # As llama.cpp's: an encoder keeps no KV cache, so only a pooling context runs it.
            raise ModelLoadError(
                "this model keeps no KV cache (an encoder): it runs only pooled, as a "
                "reranker (pooling rank) or for embeddings"
            )
        self._model = model
        self._params = params
        self._stateless = not facts.causal
        self._n_cls_out = facts.n_cls_out
        # Each sequence's chain hash at the last position the last decode gave it.
        self._pooled: dict[int, int] = {}
        self._seqs: list[dict[int, _Cell]] = [{} for _ in range(params.n_seq_max)]
        self._rows: list[int] = []
        self._logits: dict[int, npt.NDArray[np.float32]] = {}
        self._adapters: list[tuple[StubAdapter, float]] = []
        self._salt = 0
        self._views: list[memoryview[float]] = []
        self._kv_types = (_KV_TYPES.index(params.type_k), _KV_TYPES.index(params.type_v))
        self._codec = StubKvCodec(
            model_id=model.model_id,
            type_k=self._kv_types[0],
            type_v=self._kv_types[1],
            cell_bytes=model.backend.cell_bytes,
        )
        backend = model.backend
        self._memory = MemoryKind(backend.memory_kind, backend.n_swa, params.swa_full)
        self._life = Lifetime("context", self._free)

    @property
    def memory(self) -> MemoryKind:
        return self._memory

    @property
    def memory_bytes(self) -> ContextMemory:
        """Notional: ``cell_bytes`` for each of its ``n_ctx`` cells, one float32 row of
        logits per batch position besides."""
        params = self._params
        kv = self._model.backend.cell_bytes * params.n_ctx
        return ContextMemory(kv, 4 * N_VOCAB * params.n_batch)

    @property
    def params(self) -> ContextParams:
        return self._params

    @property
    def n_ctx(self) -> int:
        return self._params.n_ctx

    @property
    def n_batch(self) -> int:
        return self._params.n_batch

    @property
    def stateless(self) -> bool:
        return self._stateless

    def _pos_max(self, seq: int) -> int:
        cells = self._seqs[seq]
        return max(cells) if cells else -1

    def decode(self, batch: Sequence[BatchToken]) -> None:
        with self._life.using():
            _checks.check_batch(
                batch,
                n_batch=self._params.n_batch,
                n_ctx=self._params.n_ctx,
                n_vocab=N_VOCAB,
                n_seq_max=self._params.n_seq_max,
                pos_max=self._pos_max,
            )
            if self._stateless and len(batch) > self._params.n_ubatch:
                raise InvalidRequestError(  # llama.cpp's check, and message
                    f"{len(batch)} tokens exceed n_ubatch={self._params.n_ubatch}: this model's "
                    "attention is not causal, so a call must fit one ubatch",
                    param="batch",
                )
            self._invalidate_logits()
            for row, item in enumerate(batch):
                cells = self._seqs[item.seq]
                prev = cells.get(item.pos - 1)
                h = _mix(prev.h if prev is not None else _H0, item.token, item.pos)
                if not self._sees_what_it_needs(cells, item.pos):
                    h = _mix(h, _POISON, item.pos)  # computed without cells it attends to
                cells[item.pos] = _Cell(item.token, h)
                if item.logits:
                    self._rows.append(row)
                    self._logits[row] = self._fake_logits(item.token, h)
                if self._params.embeddings:
                    self._pooled[item.seq] = h  # a sequence's last position in the call
            for seq in {item.seq for item in batch}:
                self._forget(self._seqs[seq])
                if self._stateless:
                    self._seqs[seq].clear()  # an encoder keeps nothing after the call
            if self._model.backend.decode_delay_s:
                time.sleep(self._model.backend.decode_delay_s)

    def _sees_what_it_needs(self, cells: dict[int, _Cell], pos: int) -> bool:
        """Whether every position a token at ``pos`` attends to is held (kvwarm.memory)."""
        mem = self._memory
        if pos == 0:
            return True
        if mem.kind in ("recurrent", "hybrid"):
            return pos - 1 in cells
        lo = max(0, pos - mem.n_swa + 1) if not mem.trimmable else 0
        return all(p in cells for p in range(lo, pos))

    def _forget(self, cells: dict[int, _Cell]) -> None:
        """Drop what this memory kind does not keep: cells outside a sliding window, every
        cell of a recurrent state but its last."""
        mem = self._memory
        if mem.trimmable or mem.swa_full or not cells:
            return  # a full-size SWA cache keeps its cells (kv_pack still leaves masked out)
        top = max(cells)
        keep_from = top if mem.kind in ("recurrent", "hybrid") else top - mem.n_swa + 1
        for pos in [p for p in cells if p < keep_from]:
            del cells[pos]

    def prefill(self, seq: int, tokens: Sequence[int], start_pos: int) -> None:
        with self._life.using():
            _checks.check_prefill(
                seq,
                tokens,
                start_pos,
                n_ctx=self._params.n_ctx,
                n_vocab=N_VOCAB,
                n_seq_max=self._params.n_seq_max,
                pos_max=self._pos_max,
            )
            toks = list(tokens)
            n = len(toks)
            if self._stateless and n > self._params.n_batch:
                raise InvalidRequestError(
                    "this model's attention is not causal: a prompt is prefilled whole, "
                    f"from position 0, in one call of at most n_batch={self._params.n_batch}",
                    param="tokens",
                )
            for offset, length in _checks.aligned_chunks(start_pos, n, self._params.n_batch):
                last = offset + length == n
                self.decode(
                    [
                        BatchToken(toks[i], start_pos + i, seq, logits=last and i == n - 1)
                        for i in range(offset, offset + length)
                    ]
                )
            if self._model.backend.prefill_delay_s:
                time.sleep(self._model.backend.prefill_delay_s * n)

    def logits(self, index: int = -1) -> memoryview:
        with self._life.using():
            row = _checks.resolve_row(index, self._rows)
            if row < 0:
                raise NoLogitsError(f"no logits for batch row {index} (decode with logits first)")
            view = self._logits[row].data.cast("B").cast("f")
            self._views.append(view)
            # The protocol's plain ``memoryview``; its format is "f" (len == n_vocab).
            return cast(memoryview, view)

    def _stateful(self) -> None:
        if self._stateless:
            raise StateRestoreError("this context keeps no KV state (an encoder) to pack or set")

    def kv_pack(self, seq: int) -> bytes:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            self._stateful()
            cells = self._seqs[seq]
            mem = self._memory
            if mem.kind == "swa" and cells:  # llama.cpp saves only the cells the window sees
                top = max(cells)
                cells = {p: c for p, c in cells.items() if top - p < mem.n_swa}
            return self._blob(cells)

    def kv_pack_tail(self, seq: int, start: int) -> tuple[bytes, int]:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            _checks.check_range(start, -1)
            if start == 0 or not self._memory.chunkable:  # like llama.cpp's: no per-cell tail
                return self.kv_pack(seq), 0
            return self._blob({p: c for p, c in self._seqs[seq].items() if p >= start}), start

    def _blob(self, cells: dict[int, _Cell]) -> bytes:
        size = self._model.backend.cell_bytes
        pad = size - CELL.size
        out = bytearray(self._codec.header(len(cells)))
        for pos in sorted(cells):
            cell = cells[pos]
            out += CELL.pack(pos, cell.token, cell.h)
            out += _pad(cell.h, pad)
        return bytes(out)

    def kv_unpack(self, seq: int, data: bytes | bytearray | memoryview) -> int:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            self._stateful()
            # Like llama.cpp, the sequence is cleared first and stays empty if the blob is bad.
            self._seqs[seq] = {}
            cells = self._parse(u8(data).data)
            if cells and self._memory.chunkable and min(cells) != 0:
                # llama.cpp's check (kv_state.unpack): full attention restores from 0.
                raise StateRestoreError(f"restored positions start at {min(cells)}, not 0")
            self._seqs[seq] = cells
            return self._pos_max(seq) + 1

    def _parse(self, blob: memoryview) -> dict[int, _Cell]:
        if len(blob) < HEADER.size:
            raise StateRestoreError(f"KV blob of {len(blob)} bytes is shorter than its header")
        magic, model_id, type_k, type_v, size, count = HEADER.unpack_from(blob, 0)
        if magic != MAGIC:
            raise StateRestoreError("not a stub KV blob")
        if model_id != self._model.model_id:
            raise StateRestoreError("KV blob belongs to another model")
        if (type_k, type_v) != self._kv_types:
            raise StateRestoreError("KV blob was made with different KV cache types")
        if size != self._model.backend.cell_bytes or len(blob) != HEADER.size + count * size:
            raise StateRestoreError(f"KV blob has the wrong size ({len(blob)} bytes)")
        if count > self._params.n_ctx:
            raise StateRestoreError(f"KV blob holds {count} cells; n_ctx={self._params.n_ctx}")
        cells: dict[int, _Cell] = {}
        prev_pos, prev_h = -1, _H0
        for i in range(count):
            at = HEADER.size + i * size
            pos, token, h = CELL.unpack_from(blob, at)
            if not (prev_pos < pos < self._params.n_ctx and 0 <= token < N_VOCAB):
                raise StateRestoreError(f"KV blob cell {i} is corrupt")
            chained = _mix(prev_h, token, pos) == h if pos == prev_pos + 1 else True
            if not chained or blob[at + CELL.size : at + size] != _pad(h, size - CELL.size):
                raise StateRestoreError(f"KV blob cell {i} is corrupt")
            cells[pos] = _Cell(token, h)
            prev_pos, prev_h = pos, h
        return cells

    def kv_unpack_chunks(self, seq: int, chunks: Sequence[Buffer], *, base: int = 0) -> int | None:
        # The stub has no native buffer to restore into in place: join, then unpack.
        if not base:
            return self.kv_unpack(seq, self._codec.join(chunks))
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            _checks.check_range(base, -1)
            if not self.restores_tails:
                return None
            live = self._seqs[seq]
            if sorted(live) != list(range(base)):
                raise StateRestoreError(
                    f"a tail restore from {base} needs the sequence to hold [0, {base - 1}]"
                )
            tail = self._parse(memoryview(self._codec.join_tail(chunks, base)))
            first = tail.get(base)
            # The cells chain through the whole prefix (as real KV depends on it): a tail put
            # on live KV of other tokens is refused here, where llama.cpp could not tell.
            if first is None or first.h != _mix(live[base - 1].h, first.token, base):
                raise StateRestoreError(f"the tail from {base} does not continue the live KV")
            live.update(tail)
            return self._pos_max(seq) + 1

    @property
    def restores_tails(self) -> bool:
        # As llama.cpp's: full attention, one KV stream (the scratch sequence's condition).
        return self._memory.chunkable and self._params.kv_unified and not self._stateless

    @property
    def copies_by_pack(self) -> bool:
        # As llama.cpp's: a KV stream per sequence (the stub's window keeps no masked cells,
        # so its copies hold what its live states do either way).
        return not self._params.kv_unified

    @property
    def kv_codec(self) -> StubKvCodec:
        return self._codec

    def kv_split(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        self._life.check()
        return self._codec.split(blob, bounds)

    @overload
    def kv_join(self, chunks: Sequence[Buffer], out: None = None) -> bytearray: ...
    @overload
    def kv_join(self, chunks: Sequence[Buffer], out: WritableBuffer) -> memoryview: ...
    def kv_join(
        self, chunks: Sequence[Buffer], out: WritableBuffer | None = None
    ) -> bytearray | memoryview:
        self._life.check()
        return self._codec.join(chunks) if out is None else self._codec.join(chunks, out)

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            _checks.check_range(p0, p1)
            cells = self._seqs[seq]
            doomed = [p for p in cells if p >= p0 and (p1 < 0 or p < p1)]
            whole = p0 <= 0 and (p1 < 0 or p1 > self._pos_max(seq))
            if self._memory.kind in ("recurrent", "hybrid") and doomed and not whole:
                # llama.cpp's recurrent memory cannot roll its state back (returns false).
                raise StateRestoreError(
                    f"this model's memory ({self._memory.describe()}) cannot remove "
                    f"[{p0}, {p1}) of seq {seq}"
                )
            for pos in doomed:
                del cells[pos]

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        with self._life.using():
            _checks.check_seq(src, self._params.n_seq_max, param="src")
            _checks.check_seq(dst, self._params.n_seq_max, param="dst")
            _checks.check_range(p0, p1)
            if src == dst:
                return
            source = self._seqs[src]
            # dst := src[p0:p1), as in the llama.cpp backend.
            target = self._seqs[dst] = {}
            for pos, cell in source.items():
                if pos >= p0 and (p1 < 0 or pos < p1):
                    target[pos] = cell

    def seq_pos_max(self, seq: int) -> int:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            return self._pos_max(seq)

    def seq_pos_min(self, seq: int) -> int:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            cells = self._seqs[seq]
            return min(cells) if cells else -1

    def clear(self) -> None:
        with self._life.using():
            for cells in self._seqs:
                cells.clear()

    def embed(self, tokens: Sequence[int], *, normalize: bool = True) -> list[float]:
        with self._life.using():
            if not self._params.embeddings:
                raise InvalidRequestError(
                    "this context was not created with embeddings=True", param="input"
                )
            if not tokens:
                raise InvalidRequestError("cannot embed zero tokens", param="input")
            if len(tokens) > min(self._params.n_ubatch, self._params.n_ctx):
                raise InvalidRequestError(
                    f"{len(tokens)} tokens exceed n_ubatch={self._params.n_ubatch}",
                    param="input",
                )
            _checks.check_tokens(tokens, N_VOCAB)
            vecs = np.stack(
                [np.random.default_rng(t * 7919 + 17).standard_normal(N_EMBD) for t in tokens]
            )
            vec = vecs.mean(axis=0)
            if normalize:
                norm = math.sqrt(float(np.dot(vec, vec)))
                vec = vec / norm if norm > 0 else vec
            return [float(x) for x in vec]

    def pooled(self, seq: int) -> tuple[float, ...]:
        with self._life.using():
            _checks.check_seq(seq, self._params.n_seq_max)
            if not self._params.embeddings or self._params.pooling != "rank":
                raise InvalidRequestError("this stub context pools only by rank")
            h = self._pooled.get(seq)
            if h is None:
                raise NoLogitsError(f"no pooled output for seq {seq} from the last decode")
            # A pure function of the chain hash: of every token up to the last position, so
            # a score read after a restore or a copy equals a cold one iff the KV is right.
            p = (h >> 40) / float(1 << 24)
            if self._n_cls_out == 1:
                return (4.0 * p - 2.0,)  # a raw score, as a cross-encoder's
            return (p, 1.0 - p)  # [p(yes), p(no)], as a decoder reranker's softmax

    def set_adapters(self, adapters: Sequence[tuple[Adapter, float]]) -> None:
        with self._life.using():
            chosen: list[tuple[StubAdapter, float]] = []
            for adapter, scale in adapters:
                if not isinstance(adapter, StubAdapter) or adapter.model is not self._model:
                    raise AdapterError("adapter was not loaded by this context's model")
                if not math.isfinite(scale):
                    raise InvalidRequestError(f"adapter scale {scale} is not finite")
                chosen.append((adapter, scale))
            acquired: list[StubAdapter] = []
            try:
                for adapter, _ in chosen:
                    adapter.lifetime.acquire()
                    acquired.append(adapter)
            except BaseException:
                for adapter in acquired:
                    adapter.lifetime.release()
                raise
            for adapter, _ in self._adapters:
                adapter.lifetime.release()
            self._adapters = chosen
            salt = 0
            for adapter, scale in chosen:
                digest = hashlib.sha256(adapter.sha256 + struct.pack("<d", scale)).digest()
                salt ^= int.from_bytes(digest[:8], "little")
            self._salt = salt

    def close(self) -> None:
        self._life.close()

    def _invalidate_logits(self) -> None:
        for view in self._views:
            try:
                view.release()
            except BufferError:
                log.debug("a logits view is still exported; leaving it to the caller")
        self._views.clear()
        self._rows.clear()
        self._logits.clear()
        self._pooled.clear()

    def _fake_logits(self, token: int, h: int) -> npt.NDArray[np.float32]:
        rng = np.random.default_rng(h ^ self._salt)
        logits = np.full(N_VOCAB, -30.0, dtype=np.float32)  # FIM tokens: never sampled
        logits[:N_BYTE_TOKENS] = rng.standard_normal(N_BYTE_TOKENS)
        logits[OFFSET + 32 : OFFSET + 127] += 3.0  # printable ASCII wins, so output is readable
        if token == OFFSET + ord("!"):
            logits[EOS] = 20.0
        return logits

    def _free(self) -> None:
        self._invalidate_logits()
        for adapter, _ in self._adapters:
            adapter.lifetime.release()
        self._adapters = []
        self._seqs = []
        self._model._release()


def _pad(h: int, n: int) -> bytes:
    if n <= 0:
        return b""
    unit = h.to_bytes(8, "little")
    return (unit * (n // 8 + 1))[:n]
