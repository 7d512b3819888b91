"""The stub backend's context: fake KV cells chained by hash, and blobs in a checked format.

Each KV cell of a sequence holds ``(pos, token, h)`` where ``h`` chains the previous cell's
``h`` with ``(token, pos)``, so a cell depends on the whole prefix, exactly as real KV does.
A sliding-window model keeps two caches, as llama.cpp's iSWA memory does: every position's
cell, and a window of the last ``n_swa`` positions' window cells (their hash derived from the
position's cell), dropped once the window moves past them; a token decoded without the window
cells it attends to, or beside window cells of other tokens, is poisoned.

Invariants: every check the llama.cpp context makes is made here too, by the same code: both
are a ``ContextFront`` (``backends/front.py``), which checks each call before the methods
below run; a context holds its model open until it is closed (``_lifetime``).
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvwarm.backends import _checks
from kvwarm.backends.base import BatchToken, Buffer, ContextMemory, ContextParams, concrete_kv
from kvwarm.backends.front import ContextFront
from kvwarm.backends.stub.adapter import StubAdapter
from kvwarm.backends.stub.kv_codec import (
    CELL,
    HEADER,
    MAGIC,
    WINDOW_HEAD,
    WINDOW_MAGIC,
    StubKvCodec,
)
from kvwarm.backends.stub.vocab import EOS, N_BYTE_TOKENS, N_EMBD, N_VOCAB, OFFSET
from kvwarm.buffers import u8
from kvwarm.errors import InvalidRequestError, ModelLoadError, StateRestoreError
from kvwarm.memory import MemoryKind

if TYPE_CHECKING:
    from kvwarm.backends.stub import StubModel


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
_WINDOW = 0x5749_4E44_4F57_4B56  # folded into a position's cell for its window cell


@dataclass(frozen=True, slots=True)
class _Cell:
    token: int
    h: int


def _window_cell(cell: _Cell, pos: int) -> _Cell:
    return _Cell(cell.token, _mix(cell.h, _WINDOW, pos))


class StubContext(ContextFront["StubModel", StubAdapter]):
    """Per-sequence dicts of cells; logits computed at decode for rows that ask for them."""

    def __init__(self, model: StubModel, params: ContextParams) -> None:
        facts = model.facts
        if not facts.causal and not params.embeddings:
            # As llama.cpp's: an encoder keeps no KV cache, so only a pooling context runs it.
            raise ModelLoadError(
                "this model keeps no KV cache (an encoder): it runs only pooled, as a "
                "reranker (pooling rank) or for embeddings"
            )
        self._n_cls_out = facts.n_cls_out
        # Each sequence's chain hash at its last position in the last decode.
        self._pooled_h: dict[int, int] = {}
        self._seqs: list[dict[int, _Cell]] = [{} for _ in range(params.n_seq_max)]
        # A sliding-window model's window cache, per sequence (empty for other kinds).
        self._windows: list[dict[int, _Cell]] = [{} for _ in range(params.n_seq_max)]
        self._row_logits: dict[int, npt.NDArray[np.float32]] = {}
        self._salt = 0
        self._kv_types = (
            _KV_TYPES.index(concrete_kv(params.type_k)),
            _KV_TYPES.index(concrete_kv(params.type_v)),
        )
        backend = model.backend
        self._memory = MemoryKind(backend.memory_kind, backend.n_swa, params.swa_full)
        self._codec = StubKvCodec(
            model_id=model.model_id,
            type_k=self._kv_types[0],
            type_v=self._kv_types[1],
            cell_bytes=model.backend.cell_bytes,
            with_rest=self._memory.rest_chunkable,
        )
        super().__init__(
            model,
            params,
            n_ctx=params.n_ctx,
            n_vocab=N_VOCAB,
            adapter=StubAdapter,
            n_embd=N_EMBD,
            causal=facts.causal,
            stateless=not facts.causal,
        )

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

    def _pos_max(self, seq: int) -> int:
        cells = self._seqs[seq]
        return max(cells) if cells else -1

    def _pos_min(self, seq: int) -> int:
        # As llama.cpp's iSWA memory: a window's lowest position (-1 once it is gone).
        cells = self._windows[seq] if self._memory.rest_chunkable else self._seqs[seq]
        return min(cells) if cells else -1

    def _decode(self, batch: Sequence[BatchToken]) -> None:
        self._invalidate_logits()
        windowed = self._memory.rest_chunkable
        for row, item in enumerate(batch):
            cells = self._seqs[item.seq]
            prev = cells.get(item.pos - 1)
            h = _mix(prev.h if prev is not None else _H0, item.token, item.pos)
            if not self._sees_what_it_needs(cells, self._windows[item.seq], item.pos):
                h = _mix(h, _POISON, item.pos)  # computed without cells it attends to
            cells[item.pos] = _Cell(item.token, h)
            if windowed:
                self._windows[item.seq][item.pos] = _window_cell(cells[item.pos], item.pos)
            if item.logits:
                self._rows.append(row)
                self._row_logits[row] = self._fake_logits(item.token, h)
                if self._model.copy_bias:
                    self._copy(self._row_logits[row], cells, item.pos)
            if self._params.embeddings:
                # A sequence's last position in the call; the adapters attached change its
                # score, as they change logits.
                self._pooled_h[item.seq] = h ^ self._salt
        for seq in {item.seq for item in batch}:
            self._forget(self._windows[seq] if windowed else self._seqs[seq])
            if self._stateless:
                self._seqs[seq].clear()  # an encoder keeps nothing after the call
        if self._model.backend.decode_delay_s:
            time.sleep(self._model.backend.decode_delay_s)

    def _decode_embd(
        self,
        seq: int,
        start_pos: int,
        embd: memoryview,
        n_tokens: int,
        non_causal: bool,
        logits: bool,
    ) -> None:
        """A span's cells: each holds a negative "token" from a hash of the whole span (it
        attends to all of it when ``non_causal``, as Gemma 3's images do) and chains on the
        cell before it like text."""
        self._invalidate_logits()
        row = 4 * N_EMBD
        whole = hashlib.sha256(bytes(embd)).digest()
        cells = self._seqs[seq]
        windowed = self._memory.rest_chunkable
        for i in range(n_tokens):
            pos = start_pos + i
            # Non-causal: every cell depends on the whole span; causal: on the rows up to it.
            seen = whole if non_causal else hashlib.sha256(bytes(embd[: row * (i + 1)])).digest()
            token = -1 - ((int.from_bytes(seen[:4], "little") + i) & 0x3FFFFFFF)
            prev = cells.get(pos - 1)
            h = _mix(prev.h if prev is not None else _H0, token, pos)
            if not self._sees_what_it_needs(cells, self._windows[seq], pos):
                h = _mix(h, _POISON, pos)
            cells[pos] = _Cell(token, h)
            if windowed:
                self._windows[seq][pos] = _window_cell(cells[pos], pos)
        self._forget(self._windows[seq] if windowed else cells)
        if logits:
            last = cells[start_pos + n_tokens - 1]
            self._rows.append(n_tokens - 1)
            self._row_logits[n_tokens - 1] = self._fake_logits(last.token, last.h)

    def _sees_what_it_needs(
        self, cells: dict[int, _Cell], window: dict[int, _Cell], pos: int
    ) -> bool:
        """Whether every position a token at ``pos`` attends to is held (kvwarm.memory): a
        window's cells must also be those of the tokens before it (their cells')."""
        mem = self._memory
        if pos == 0:
            return True
        if mem.kind in ("recurrent", "hybrid"):
            return pos - 1 in cells
        if not all(p in cells for p in range(pos)):
            return False
        if not mem.rest_chunkable:
            return True
        for p in range(max(0, pos - mem.n_swa + 1), pos):
            held = window.get(p)
            if held is None or held != _window_cell(cells[p], p):
                return False
        return True

    def _forget(self, cells: dict[int, _Cell]) -> None:
        """Drop what this memory kind does not keep: cells outside a sliding window (its
        window cache's), every cell of a recurrent state but its last."""
        mem = self._memory
        if mem.trimmable or mem.swa_full or not cells:
            return  # a full-size SWA cache keeps its cells (kv_pack still leaves masked out)
        top = max(cells)
        keep_from = top if mem.kind in ("recurrent", "hybrid") else top - mem.n_swa + 1
        for pos in [p for p in cells if p < keep_from]:
            del cells[pos]

    def _prefill(self, seq: int, tokens: Sequence[int], start_pos: int) -> None:
        toks = list(tokens)
        n = len(toks)
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

    def _logits(self, row: int) -> memoryview[float]:
        return self._row_logits[row].data.cast("B").cast("f")

    def _kv_pack(self, seq: int) -> bytes:
        blob = self._blob(self._seqs[seq])
        mem = self._memory
        if not mem.rest_chunkable:
            return blob
        window = self._windows[seq]
        if window:  # llama.cpp saves only the cells the window sees
            top = max(window)
            window = {p: c for p, c in window.items() if top - p < mem.n_swa}
        return blob + self._window_blob(window)

    def _kv_pack_tail(self, seq: int, start: int) -> tuple[bytes, int]:
        if start == 0 or not self._memory.chunkable:  # like llama.cpp's: no per-cell tail
            return self._kv_pack(seq), 0
        return self._blob({p: c for p, c in self._seqs[seq].items() if p >= start}), start

    def _blob(self, cells: dict[int, _Cell]) -> bytes:
        return self._codec.header(len(cells)) + self._cells(cells)

    def _window_blob(self, cells: dict[int, _Cell]) -> bytes:
        return self._codec.window_header(len(cells)) + self._cells(cells)

    def _cells(self, cells: dict[int, _Cell]) -> bytes:
        size = self._model.backend.cell_bytes
        pad = size - CELL.size
        out = bytearray()
        for pos in sorted(cells):
            cell = cells[pos]
            out += CELL.pack(pos, cell.token, cell.h)
            out += _pad(cell.h, pad)
        return bytes(out)

    def _kv_unpack(self, seq: int, data: bytes | bytearray | memoryview) -> int:
        # Like llama.cpp, the sequence is cleared first and stays empty if the blob is bad.
        self._seqs[seq] = {}
        self._windows[seq] = {}
        blob = u8(data).data
        cells, end = self._parse(blob)
        window: dict[int, _Cell] = {}
        if self._memory.rest_chunkable:
            window = self._parse_window(blob, end)
        elif end != len(blob):
            raise StateRestoreError(f"KV blob has {len(blob) - end} bytes after its cells")
        if cells and self._memory.chunkable and min(cells) != 0:
            # llama.cpp's check (kv_state.unpack): full attention restores from 0.
            raise StateRestoreError(f"restored positions start at {min(cells)}, not 0")
        self._seqs[seq] = cells
        self._windows[seq] = window
        return self._pos_max(seq) + 1

    def _parse_window(self, blob: memoryview, at: int) -> dict[int, _Cell]:
        """A window cache's cells from ``blob[at:]``, which they must end. Like llama.cpp's,
        they are taken as they are (a window of other tokens' cells poisons what is decoded
        beside it, as on a real model)."""
        if len(blob) < at + WINDOW_HEAD.size:
            raise StateRestoreError("KV blob has no window cache after its cells")
        magic, count = WINDOW_HEAD.unpack_from(blob, at)
        size = self._model.backend.cell_bytes
        at += WINDOW_HEAD.size
        if magic != WINDOW_MAGIC or len(blob) != at + count * size:
            raise StateRestoreError("KV blob's window cache is malformed")
        window: dict[int, _Cell] = {}
        prev_pos = -1
        for i in range(count):
            pos, token, h = CELL.unpack_from(blob, at + i * size)
            cell_at = at + i * size
            if not (prev_pos < pos < self._params.n_ctx and 0 <= token < N_VOCAB):
                raise StateRestoreError(f"KV blob window cell {i} is corrupt")
            if blob[cell_at + CELL.size : cell_at + size] != _pad(h, size - CELL.size):
                raise StateRestoreError(f"KV blob window cell {i} is corrupt")
            window[pos] = _Cell(token, h)
            prev_pos = pos
        return window

    def _parse(self, blob: memoryview) -> tuple[dict[int, _Cell], int]:
        """The first cache's cells, and where they end (a window's blob goes on)."""
        if len(blob) < HEADER.size:
            raise StateRestoreError(f"KV blob of {len(blob)} bytes is shorter than its header")
        magic, model_id, type_k, type_v, size, count = HEADER.unpack_from(blob, 0)
        if magic != MAGIC:
            raise StateRestoreError("not a stub KV blob")
        if model_id != self._model.model_id:
            raise StateRestoreError("KV blob belongs to another model")
        if (type_k, type_v) != self._kv_types:
            raise StateRestoreError("KV blob was made with different KV cache types")
        if size != self._model.backend.cell_bytes or len(blob) < HEADER.size + count * size:
            raise StateRestoreError(f"KV blob has the wrong size ({len(blob)} bytes)")
        if count > self._params.n_ctx:
            raise StateRestoreError(f"KV blob holds {count} cells; n_ctx={self._params.n_ctx}")
        cells: dict[int, _Cell] = {}
        prev_pos, prev_h = -1, _H0
        for i in range(count):
            at = HEADER.size + i * size
            pos, token, h = CELL.unpack_from(blob, at)
            # A negative token is a media span's cell (``_decode_embd``).
            if not (prev_pos < pos < self._params.n_ctx and token < N_VOCAB):
                raise StateRestoreError(f"KV blob cell {i} is corrupt")
            chained = _mix(prev_h, token, pos) == h if pos == prev_pos + 1 else True
            if not chained or blob[at + CELL.size : at + size] != _pad(h, size - CELL.size):
                raise StateRestoreError(f"KV blob cell {i} is corrupt")
            cells[pos] = _Cell(token, h)
            prev_pos, prev_h = pos, h
        return cells, HEADER.size + count * size

    def _kv_unpack_chunks(self, seq: int, chunks: Sequence[Buffer], base: int) -> int | None:
        # The stub has no native buffer to restore into in place: join, then unpack.
        if not base:
            return self._kv_unpack(seq, self._codec.join(chunks))
        if not self.restores_tails:
            return None
        live = self._seqs[seq]
        if sorted(live) != list(range(base)):
            raise StateRestoreError(
                f"a tail restore from {base} needs the sequence to hold [0, {base - 1}]"
            )
        tail, _ = self._parse(memoryview(self._codec.join_tail(chunks, base)))
        first = tail.get(base)
        # The cells chain through the whole prefix (as real KV depends on it): a tail put on
        # live KV of other tokens is refused here, where llama.cpp could not tell.
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

    def _seq_rm(self, seq: int, p0: int, p1: int) -> None:
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
        window = self._windows[seq]
        for pos in [p for p in window if p >= p0 and (p1 < 0 or p < p1)]:
            del window[pos]

    def _seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        # dst := src[p0:p1), as in the llama.cpp backend (both caches of a window's model).
        for caches in (self._seqs, self._windows):
            target = caches[dst] = {}
            for pos, cell in caches[src].items():
                if pos >= p0 and (p1 < 0 or pos < p1):
                    target[pos] = cell

    def _clear(self) -> None:
        for cells in (*self._seqs, *self._windows):
            cells.clear()

    def _embed(self, tokens: Sequence[int], *, normalize: bool) -> list[float]:
        if self._model.backend.prefill_delay_s:  # an embedding is a prefill
            time.sleep(self._model.backend.prefill_delay_s * len(tokens))
        vecs = np.stack(
            [np.random.default_rng(t * 7919 + 17).standard_normal(N_EMBD) for t in tokens]
        )
        vec = vecs.mean(axis=0)
        if self._salt:  # the adapters attached change the vector, as they change logits
            vec = vec + 0.5 * np.random.default_rng(self._salt).standard_normal(N_EMBD)
        if normalize:
            norm = math.sqrt(float(np.dot(vec, vec)))
            vec = vec / norm if norm > 0 else vec
        return [float(x) for x in vec]

    def _pooled(self, seq: int) -> tuple[float, ...] | None:
        if self._params.pooling != "rank":
            raise InvalidRequestError("this stub context pools only by rank")
        h = self._pooled_h.get(seq)
        if h is None:
            return None
        # A pure function of the chain hash: of every token up to the last position, so a
        # score read after a restore or a copy equals a cold one iff the KV is right.
        p = (h >> 40) / float(1 << 24)
        if self._n_cls_out == 1:
            return (4.0 * p - 2.0,)  # a raw score, as a cross-encoder's
        return (p, 1.0 - p)  # [p(yes), p(no)], as a decoder reranker's softmax

    def _attach(self, adapters: Sequence[tuple[StubAdapter, float]]) -> None:
        salt = 0
        for adapter, scale in adapters:
            digest = hashlib.sha256(adapter.sha256 + struct.pack("<d", scale)).digest()
            salt ^= int.from_bytes(digest[:8], "little")
        self._salt = salt

    def _invalidate_logits(self) -> None:
        self._drop_logits()
        self._row_logits.clear()
        self._pooled_h.clear()

    def _fake_logits(self, token: int, h: int) -> npt.NDArray[np.float32]:
        rng = np.random.default_rng(h ^ self._salt)
        logits = np.full(N_VOCAB, -30.0, dtype=np.float32)  # FIM tokens: never sampled
        logits[:N_BYTE_TOKENS] = rng.standard_normal(N_BYTE_TOKENS)
        logits[OFFSET + 32 : OFFSET + 127] += 3.0  # printable ASCII wins, so output is readable
        if token == OFFSET + ord("!"):
            logits[EOS] = 20.0
        return logits

    def _copy(self, logits: npt.NDArray[np.float32], cells: dict[int, _Cell], pos: int) -> None:
        """``copy_bias``: favour what followed the latest earlier occurrence of the two tokens
        ending at ``pos`` (a function of the prefix, as the rest of the logits are), within
        what the memory attends to (a sliding window's last ``n_swa`` positions: what a live
        state and a restored one both hold)."""
        prev = cells.get(pos - 1)
        key = (prev.token if prev is not None else -1, cells[pos].token)
        mem = self._memory
        low = 0 if mem.trimmable else max(0, pos - mem.n_swa + 1) if mem.kind == "swa" else pos
        for p in range(pos - 1, low, -1):
            here, before, after = cells.get(p), cells.get(p - 1), cells.get(p + 1)
            if here is None or before is None or after is None:
                continue
            if (before.token, here.token) == key:
                logits[after.token] += self._model.copy_bias
                return

    def _free(self) -> None:
        self._invalidate_logits()
        self._release_adapters()
        self._seqs = []
        self._windows = []
        self._model._release()


def _pad(h: int, n: int) -> bytes:
    if n <= 0:
        return b""
    unit = h.to_bytes(8, "little")
    return (unit * (n // 8 + 1))[:n]
