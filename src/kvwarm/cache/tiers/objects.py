"""The generic object tier: the publish protocol, probes, scans, hit fields and chunk rules of
every tier whose storage is an object store (s3, redis), written once over ``ObjectStore``.

Two layers: ``ObjectTier`` implements ``protocols.Tier`` and owns every rule; an
``ObjectStore`` only moves named byte strings (put-if-absent, ranged get, list with sizes and
ages, delete, user metadata). A new store is one module implementing ``ObjectStore`` plus one
``tiers.registry.register_scheme`` call.

Invariants:
- An object holds exactly the bytes a file tier's ``.kvc`` file would (``cache/kvc.py``), so
  every ``load`` verifies the payload CRC32C and that the row replays to its key; a row that
  fails is ``CacheFormatError`` (the facade drops it and deletes the object).
- The startup scan deletes nothing: an object it cannot read may be another host's row.
- Publish once (``common.publish_row``): the object is written with ``put_if_absent`` after
  ``book.check``; a store makes a put visible whole or not at all, so no temp object exists.
  "Already there" means another writer published the key first: its object is *adopted* if
  its metadata parses as this key, replaced (delete, put again) if it is junk.
- Hit counts and last-used times live in the object's user metadata, outside the KVC bytes
  and their CRCs, like the file header's hit fields.
- Chunks are ``chunks/<hex>.kvk`` objects, content-addressed and put once; one already there
  is kept if its head is valid, replaced if not (``common.commit_chunk``); the payload CRC
  is checked on load (``chunkfmt.parse``).
- Network faults surface as ``CacheNetworkError`` from the store; nothing here retries.
See docs/architecture.md ("Shared tiers").
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

from kvwarm.cache import chunkfmt, kvc
from kvwarm.cache.protocols import ReservationBook, RowBytes, StoredRow, TierCapabilities
from kvwarm.cache.tiers import layout
from kvwarm.cache.tiers.common import commit_chunk, publish_row, row_info
from kvwarm.cache.tiers.layout import key_of, name_for
from kvwarm.cache.types import SaveRequest, TierName
from kvwarm.errors import (
    CacheFormatError,
    CacheIOError,
    CacheKeyError,
    CacheNetworkError,
    ConfigError,
)

__all__ = ["REMOTE_CAPABILITIES", "Breaker", "Got", "ObjectStore", "ObjectTier"]

log = logging.getLogger(__name__)

# Outlives us, other processes and hosts publish into it, and every byte crosses a network.
REMOTE_CAPABILITIES = TierCapabilities(persistent=True, shared=True, local=False)
CHUNK_DIR = "chunks/"  # chunk objects: chunks/<hex key>.kvk beside the <hex key>.kvc rows
# A probe reads this much first: a miss costs nothing more, and a hit's header, TLV, tokens
# and stored logits (4 B x vocab: 196 KiB for a 49k vocab) come in one round trip for most
# models; longer metadata (a 128k vocab's logits) takes a second ranged read.
HEAD_BYTES = 256 << 10
CHUNK_HEAD_BYTES = 1 << 16  # a chunk head is ~140 B + 4 B a token: 16k tokens fit
_SCAN_PARALLEL = 16
META_HITS = "kvwarm-hits"
META_LAST_USED = "kvwarm-last-used"


class Breaker:
    """The rule every remote store follows after a network fault: it is *down* for
    ``down_for_s`` and calls fail at once with ``CacheNetworkError`` instead of waiting out
    another timeout, so a dead store costs each lookup nothing and the process one timeout
    per interval. Thread-safe."""

    def __init__(self, label: str, down_for_s: float) -> None:
        self._label = label
        self._down_for_s = down_for_s
        self._lock = threading.Lock()
        self._down_until = 0.0

    def is_down(self) -> bool:
        with self._lock:
            return time.monotonic() < self._down_until

    def check(self) -> None:
        """``CacheNetworkError`` while the store is down."""
        if self.is_down():
            raise CacheNetworkError(f"{self._label}: store marked down after a network fault")

    def trip(self, err: CacheNetworkError) -> None:
        """A network fault: down from now for ``down_for_s`` (warned once per outage)."""
        with self._lock:
            first = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self._down_for_s
        if first:
            log.warning("%s; skipping the store for %.1fs", err, self._down_for_s)


@dataclass(frozen=True, slots=True)
class Got:
    """What ``ObjectStore.get`` read: ``data`` (the range asked for, or all of it), the
    object's whole ``size`` and its user metadata."""

    data: bytes
    size: int
    meta: Mapping[str, str]


class ObjectStore(Protocol):
    """Named, immutable byte strings plus a little mutable user metadata. Names are relative
    (``<hex>.kvc``, ``chunks/<hex>.kvk``); the store adds its own prefix. Thread-safe.
    Errors: a missing object is ``CacheKeyError``; a store that cannot be reached is
    ``CacheNetworkError``; anything else it refuses is ``CacheIOError``."""

    @property
    def label(self) -> str:
        """Where, for messages: e.g. ``s3://bucket/prefix``."""
        ...

    def location(self, name: str) -> str:
        """The object's address, recorded as the row's location (e.g. an ``s3://`` URL)."""
        ...

    def put_if_absent(self, name: str, body: bytes) -> bool:
        """Create ``name`` whole, atomically. False if an object of that name exists."""
        ...

    def get(self, name: str, end: int | None = None) -> Got:
        """Bytes ``[0, end)`` of ``name`` (all of it if ``end`` is None or past its end)."""
        ...

    def get_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``name``."""
        ...

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        """(name, size, age as last-modified epoch seconds; ``inf`` if unknown) of every
        object whose name starts with ``prefix``."""
        ...

    def delete(self, name: str) -> None:
        """Remove ``name`` and its metadata; missing is fine."""
        ...

    def set_meta(self, name: str, meta: Mapping[str, str]) -> None:
        """Replace ``name``'s user metadata. ``CacheKeyError`` if it is gone."""
        ...

    def close(self) -> None: ...


class _Staged:
    """An object put once at commit: a store makes a put visible whole or not at all, so
    there is nothing to stage before it and nothing to undo after it but the object."""

    def __init__(self, tier: ObjectTier, key: bytes, request: SaveRequest) -> None:
        self._tier = tier
        self._key = key
        self._request = request
        self._fields = kvc.fields_from_request(request, now=time.time())
        self._prefix = kvc.build_prefix(self._fields, request.payload)

    def link(self) -> bool:
        body = b"".join((self._prefix, self._request.payload))
        return self._tier.objects.put_if_absent(row_name(self._key), body)

    def existing(self) -> StoredRow | None:
        return self._tier.probe(self._key)

    def clear(self) -> None:
        self._tier.delete(self._key)

    def settle(self, adopted: StoredRow | None) -> StoredRow:
        if adopted is not None:
            return adopted
        tier, key, request = self._tier, self._key, self._request
        n = memoryview(request.payload).nbytes
        info = row_info(key, tier.name, self._fields, n, stored_bytes=len(self._prefix) + n)
        location = tier.location(key)
        return StoredRow(info, request.tokens, location, request.chunk_keys, request.chunk_lens)

    def undo(self) -> None:
        """Nothing was visible before the put; after it, the row is complete and the index
        (mark_linked) or a scan decides, as for a reservation lost at publish."""

    def lost(self) -> None:
        pass


class ObjectTier:
    """A ``Tier`` over an ``ObjectStore``. Thread-safe when the store is."""

    def __init__(
        self,
        store: ObjectStore,
        quota_bytes: int,
        *,
        name: TierName,
        repair: bool = True,
        capabilities: TierCapabilities = REMOTE_CAPABILITIES,
    ) -> None:
        if quota_bytes < 0:
            raise ConfigError(f"{name} tier quota must be >= 0")
        self._store = store
        self._quota = quota_bytes
        self._name = name
        self._repair = repair
        self._capabilities = capabilities
        self._problems: list[tuple[str, str]] = []

    @property
    def name(self) -> TierName:
        return self._name

    @property
    def quota_bytes(self) -> int:
        return self._quota

    @property
    def capabilities(self) -> TierCapabilities:
        return self._capabilities

    @property
    def objects(self) -> ObjectStore:
        """The store under this tier."""
        return self._store

    def location(self, key: bytes) -> str:
        return self._store.location(row_name(key))

    def problems(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._problems)

    # ---- publish -------------------------------------------------------------------------

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        return publish_row(self._name, key, request, book, lambda _: _Staged(self, key, request))

    # ---- read side -----------------------------------------------------------------------

    def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
        """The whole object, fully verified. ``buffer`` is not used: the body arrives as one
        immutable bytes object, which a promotion may keep past the caller's lease."""
        key = row.info.key
        data = self._store.get(row_name(key)).data
        f = kvc.parse(data, expected_key=key, known_tokens=row.tokens)
        return RowBytes(f.meta.fields.tokens, f.payload, f.meta.fields.logits, None, f.meta.fields)

    def probe(self, key: bytes) -> StoredRow | None:
        """The row under ``key`` if a valid one exists (metadata read, payload not): one
        ranged read, two if the metadata is longer than ``HEAD_BYTES``. None if missing or
        invalid; ``CacheNetworkError`` if the store cannot say."""
        name = row_name(key)
        try:
            meta, user_meta = self._read_meta(name)
        except CacheKeyError:
            return None
        except CacheFormatError as exc:
            log.info("%s: probe of %s found an unusable object: %s", self._name, name, exc)
            return None
        if meta.key != key:
            log.info("%s: %s holds another key", self._name, name)
            return None
        return self._row(key, meta, user_meta)

    def _read_meta(self, name: str) -> tuple[kvc.KvcMeta, Mapping[str, str]]:
        got = self._store.get(name, HEAD_BYTES)
        head, size = got.data, got.size
        if len(head) < kvc.PREFIX_FIXED_SIZE:
            raise CacheFormatError(f"{name}: {size} bytes is too short")
        (offset,) = struct.unpack_from("<Q", head, kvc.HEADER_SIZE)
        if not kvc.PREFIX_FIXED_SIZE <= offset <= min(size, kvc.MAX_META_BYTES):
            raise CacheFormatError(f"{name}: payload offset {offset} out of range")
        if offset > len(head):
            head += self._store.get_range(name, len(head), offset)
        return kvc.parse_meta(head[:offset], file_size=size), got.meta

    def _row(self, key: bytes, meta: kvc.KvcMeta, user_meta: Mapping[str, str]) -> StoredRow:
        stored = meta.payload_offset + meta.payload_length
        info = row_info(key, self._name, meta.fields, meta.payload_length, stored_bytes=stored)
        hits, last_used = _int_meta(user_meta, META_HITS), _int_meta(user_meta, META_LAST_USED)
        if hits is not None and last_used is not None:
            info = replace(info, hits=hits, last_used=float(last_used))
        return StoredRow(
            info, meta.fields.tokens, self.location(key), meta.fields.chunks, meta.fields.chunk_lens
        )

    def delete(self, key: bytes) -> None:
        self._store.delete(row_name(key))

    def record_hit(self, row: StoredRow, hits: int, last_used: float) -> None:
        """Best effort: the object's user metadata is replaced (its bytes are not touched)."""
        name = row_name(row.info.key)
        meta = {META_HITS: str(max(0, int(hits))), META_LAST_USED: str(max(0, int(last_used)))}
        try:
            self._store.set_meta(name, meta)
        except CacheKeyError:
            return  # deleted meanwhile (another process evicted it)
        except CacheIOError as exc:
            log.info("%s: cannot record hit on %s: %s", self._name, name, exc)

    def stored_keys(self) -> Iterator[bytes]:
        for name, _, _ in self._store.list(""):
            key = key_of(name)
            if key is not None:
                yield key

    def scan(self) -> Iterator[StoredRow]:
        """Every valid row: one ranged read each, ``_SCAN_PARALLEL`` at a time (a shared store
        may hold thousands). An object this process cannot read is reported (``problems``),
        never deleted: other hosts share the store, and it may be a row a newer kvwarm wrote
        and reads (or one deleted since the listing). An in-progress put is never visible, so
        there are no temp objects to reap."""
        self._problems = []
        keys = list(self.stored_keys())
        with ThreadPoolExecutor(_SCAN_PARALLEL, thread_name_prefix="kvwarm-obj-scan") as pool:
            rows = list(pool.map(self.probe, keys))
        for key, row in zip(keys, rows, strict=True):
            if row is not None:
                yield row
                continue
            self._problems.append((self.location(key), "unreadable or vanished object"))
            if self._repair:
                log.warning("%s: cannot read %s, leaving it", self._name, self.location(key))

    # ---- chunks: chunks/<hex>.kvk, published once like rows -------------------------------

    def store_chunk(self, key: bytes, head: bytes, payload: bytes) -> int:
        """One put of the whole object (visible whole or not at all); a chunk already there
        is kept if its head is valid for ``key``, replaced if not (``commit_chunk``)."""
        body = head + payload
        name = chunk_name(key)
        commit_chunk(
            self._name,
            key,
            lambda: self._store.put_if_absent(name, body),
            lambda: self._chunk_head_valid(key),
            lambda: self._store.delete(name),
        )
        return len(body)

    def _chunk_head_valid(self, key: bytes) -> bool:
        try:
            got = self._store.get(chunk_name(key), CHUNK_HEAD_BYTES)
            return chunkfmt.parse_head(got.data, size=got.size).key == key
        except CacheKeyError:
            return False  # gone meanwhile: link again
        except CacheFormatError as exc:
            log.info("%s: chunk %s is unusable: %s", self._name, key.hex(), exc)
            return False

    def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
        return chunkfmt.parse(self._store.get(chunk_name(key)).data, key)

    def delete_chunk(self, key: bytes) -> None:
        self._store.delete(chunk_name(key))

    def scan_chunks(self) -> Iterator[tuple[bytes, int]]:
        """Listed, not read: a chunk's CRC is checked when a restore loads it."""
        for key, size, _ in self.chunk_ages():
            yield key, size

    def chunk_ages(self) -> Iterator[tuple[bytes, int, float]]:
        for name, size, mtime in self._store.list(CHUNK_DIR):
            key = layout.chunk_key_of(name[len(CHUNK_DIR) :])
            if key is not None:
                yield key, size, mtime

    def close(self) -> None:
        self._store.close()


def row_name(key: bytes) -> str:
    return name_for(key)


def chunk_name(key: bytes) -> str:
    return CHUNK_DIR + layout.chunk_name(key)


def _int_meta(meta: Mapping[str, str], name: str) -> int | None:
    value = meta.get(name)
    return int(value) if value is not None and value.isdigit() else None
