"""The ``ram`` tier: rows held as in-process bytes.

Invariant: a row is visible to ``load``/``probe`` only between a successful ``book.check`` and
the end of ``store``, and stays only if ``book.publish`` accepted it -- the publish protocol
every tier runs (``common.publish_row``), so the index sees uniform semantics. Payloads are kept as
handed over (no copy) and loaded as zero-copy views. There is no CRC here: the bytes never
leave process memory, so nothing outside the process can damage them. Chunks are held as
``buffers.Held`` (read-only views of immutable bytes, with a memo): a codec parses and checks a
chunk's envelope on its first restore and remembers it, so later restores of the same chunk
skip those checks (a file tier's chunks are checked on every read).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from kvwarm.buffers import Held, held
from kvwarm.cache.formats.kvc import KvcFields
from kvwarm.cache.protocols import ReservationBook, RowBytes, StoredRow, TierCapabilities
from kvwarm.cache.tiers.common import publish_row, row_info
from kvwarm.cache.types import SaveRequest, TierName
from kvwarm.errors import CacheKeyError, ConfigError

__all__ = ["RamTier"]

# Private to this process and gone with it.
_CAPABILITIES = TierCapabilities(persistent=False, shared=False, local=True)


@dataclass(frozen=True, slots=True)
class _Entry:
    row: StoredRow
    payload: bytes
    logits: bytes | None


@dataclass(frozen=True, slots=True)
class _Staged:
    """A row held aside until commit: visible only between ``book.check`` and the end of the
    publish, and kept only if ``book.publish`` accepted it."""

    tier: RamTier
    key: bytes
    entry: _Entry

    def link(self) -> bool:
        self.tier._put(self.key, self.entry)  # the reservation makes the key ours
        return True

    def existing(self) -> StoredRow | None:
        return None  # never asked: ``link`` never finds the name taken

    def clear(self) -> None:
        pass

    def settle(self, adopted: StoredRow | None) -> StoredRow:
        return self.entry.row

    def undo(self) -> None:
        self.tier._drop(self.key, self.entry)

    def lost(self) -> None:
        self.tier._drop(self.key, self.entry)


class RamTier:
    """In-process tier; thread-safe. ``quota_bytes`` is enforced by the index, not here."""

    def __init__(self, quota_bytes: int, *, name: TierName = "ram") -> None:
        if quota_bytes < 0:
            raise ConfigError("ram tier quota must be >= 0")
        self._quota = quota_bytes
        self._name = name
        self._lock = threading.Lock()
        self._rows: dict[bytes, _Entry] = {}
        # chunk key -> payload, held with a memo: a codec parses and checks a chunk's
        # envelope on its first restore only (the bytes are immutable: ``buffers.Held``).
        self._chunks: dict[bytes, Held] = {}

    @property
    def name(self) -> TierName:
        return self._name

    @property
    def quota_bytes(self) -> int:
        return self._quota

    def set_quota(self, quota_bytes: int) -> None:
        """A new quota (the memory budget's remainder); the caller enforces it."""
        if quota_bytes < 0:
            raise ConfigError("ram tier quota must be >= 0")
        self._quota = quota_bytes

    @property
    def capabilities(self) -> TierCapabilities:
        return _CAPABILITIES

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        return publish_row(self._name, key, request, book, lambda _: self._stage(key, request))

    def _stage(self, key: bytes, request: SaveRequest) -> _Staged:
        now = time.time()
        fields = KvcFields(
            namespace=request.namespace,
            tokens=request.tokens,
            reason=request.reason,
            created=int(now),
            last_used=int(now),
            ttl_class=request.ttl_class,
            logits=request.logits,
            canonical_tokens=request.canonical_tokens,
            memory=request.memory,
            chunk_lens=request.chunk_lens,
            chunks=request.chunk_keys,
            rest_chunks=request.rest_chunks,
        )
        size = memoryview(request.payload).nbytes
        info = row_info(key, self._name, fields, size, created=now, last_used=now)
        stored = StoredRow(
            info, request.tokens, None, request.chunk_keys, request.chunk_lens, request.rest_chunks
        )
        return _Staged(self, key, _Entry(stored, request.payload, request.logits))

    def _put(self, key: bytes, entry: _Entry) -> None:
        with self._lock:
            self._rows[key] = entry

    def _drop(self, key: bytes, entry: _Entry) -> None:
        with self._lock:
            if self._rows.get(key) is entry:
                del self._rows[key]

    def _get(self, key: bytes) -> _Entry:
        with self._lock:
            entry = self._rows.get(key)
        if entry is None:
            raise CacheKeyError(f"ram tier holds no row {key.hex()}")
        return entry

    def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
        entry = self._get(row.info.key)  # the bytes are already in memory: no buffer needed
        return RowBytes(entry.row.tokens, memoryview(entry.payload), entry.logits)

    def load_meta(self, row: StoredRow) -> RowBytes:
        entry = self._get(row.info.key)
        return RowBytes(entry.row.tokens, memoryview(b""), entry.logits)

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._rows.pop(key, None)

    def record_hit(self, row: StoredRow, hits: int, last_used: float) -> None:
        with self._lock:
            entry = self._rows.get(row.info.key)
            if entry is None:
                return
            info = replace(entry.row.info, hits=hits, last_used=last_used)
            self._rows[row.info.key] = replace(entry, row=replace(entry.row, info=info))

    def scan(self) -> Iterator[StoredRow]:
        with self._lock:
            rows = [e.row for e in self._rows.values()]
        return iter(rows)

    def probe(self, key: bytes) -> StoredRow | None:
        with self._lock:
            entry = self._rows.get(key)
        return None if entry is None else entry.row

    def stored_keys(self) -> Iterator[bytes]:
        with self._lock:
            return iter(list(self._rows))

    def problems(self) -> tuple[tuple[str, str], ...]:
        return ()  # process memory holds nothing a scan could find bad

    def store_chunk(self, key: bytes, head: bytes, payload: bytes) -> int:
        with self._lock:
            if key not in self._chunks:
                self._chunks[key] = held(payload if type(payload) is bytes else bytes(payload))
        return len(payload)

    def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
        with self._lock:
            payload = self._chunks.get(key)
        if payload is None:
            raise CacheKeyError(f"ram tier holds no chunk {key.hex()}")
        return payload.data  # a view whose ``obj`` is the held chunk

    def delete_chunk(self, key: bytes) -> None:
        with self._lock:
            self._chunks.pop(key, None)

    def scan_chunks(self) -> Iterator[tuple[bytes, int]]:
        with self._lock:
            return iter([(k, v.nbytes) for k, v in self._chunks.items()])

    def close(self) -> None:
        with self._lock:
            self._rows.clear()
            self._chunks.clear()
