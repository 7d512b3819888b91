"""The ``s3`` tier: one object ``<prefix><hex key>.kvc`` per row in an S3-compatible store.

Invariants:
- An object holds exactly the bytes a file tier's ``.kvc`` file would (``cache/kvc.py``), so
  every ``load`` verifies the payload CRC32C and that the row replays to its key; a row that
  fails is ``CacheFormatError`` (the facade drops it and deletes the object).
- The startup scan deletes nothing: an object it cannot read may be another host's row.
- Publish once: the object is written with ``put_object(IfNoneMatch="*")`` after
  ``book.check``; S3 makes a PUT visible whole or not at all, so no temp object exists. A
  412 means another writer published the key first: its object is *adopted* if its metadata
  parses as this key, replaced (delete, put again) if it is junk.
- Hit counts and last-used times live in the object's user metadata (rewritten by a
  server-side copy), outside the KVC bytes and their CRCs, like the file header's hit fields.
- Network faults surface as ``CacheNetworkError`` (``s3client``); nothing here retries beyond
  botocore's bounded attempts or waits longer than its timeouts.
See docs/architecture.md ("Shared tiers").
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import replace

from kvwarm.cache import chunkfmt, kvc
from kvwarm.cache.protocols import ReservationBook, RowBytes, StoredRow, TierCapabilities
from kvwarm.cache.tiers.common import check_request, row_info
from kvwarm.cache.tiers.s3client import (
    PublishRaceLost,
    S3Client,
    S3Wire,
    list_aged,
    list_names,
    make_client,
    read_body,
)
from kvwarm.cache.types import S3Config, SaveRequest, TierName
from kvwarm.errors import CacheFormatError, CacheIOError, CacheKeyError, ConfigError

__all__ = ["S3_CAPABILITIES", "S3Tier"]

log = logging.getLogger(__name__)

# Outlives us, other processes and hosts publish into it, and every byte crosses a network.
S3_CAPABILITIES = TierCapabilities(persistent=True, shared=True, local=False)
_SUFFIX = ".kvc"
_CHUNK_DIR = "chunks/"
_CHUNK_SUFFIX = ".kvk"
_HEX = frozenset("0123456789abcdef")
# A probe reads this much first: a miss costs nothing more (404), and a hit's header, TLV,
# tokens and stored logits (4 B x vocab: 196 KiB for a 49k vocab) come in one round trip for
# most models; longer metadata (a 128k vocab's logits) takes a second ranged read.
_HEAD_BYTES = 256 << 10
_PUT_ATTEMPTS = 3
_SCAN_PARALLEL = 16
_META_HITS = "kvwarm-hits"
_META_LAST_USED = "kvwarm-last-used"


class S3Tier:
    """Rows as objects in one bucket under one prefix. Thread-safe (boto3 clients are)."""

    def __init__(
        self,
        config: S3Config,
        quota_bytes: int,
        *,
        name: TierName = "s3",
        repair: bool = True,
        client: S3Client | None = None,
        max_connections: int = 32,
    ) -> None:
        if quota_bytes < 0:
            raise ConfigError("s3 tier quota must be >= 0")
        if not config.bucket:
            raise ConfigError("the s3 tier needs a bucket (setting s3_bucket)")
        if config.prefix and not config.prefix.endswith("/"):
            raise ConfigError(f"s3 prefix must end with '/', got {config.prefix!r}")
        self._cfg = config
        self._quota = quota_bytes
        self._name = name
        self._repair = repair
        self._problems: list[tuple[str, str]] = []
        label = f"{name} (s3://{config.bucket}/{config.prefix})"
        raw = client if client is not None else make_client(config, max_connections)
        self._wire = S3Wire(raw, label=label, down_for_s=config.down_for_s)

    @property
    def name(self) -> TierName:
        return self._name

    @property
    def quota_bytes(self) -> int:
        return self._quota

    @property
    def capabilities(self) -> TierCapabilities:
        return S3_CAPABILITIES

    @property
    def config(self) -> S3Config:
        return self._cfg

    @property
    def wire(self) -> S3Wire:
        return self._wire

    def object_name(self, key: bytes) -> str:
        return f"{self._cfg.prefix}{key.hex()}{_SUFFIX}"

    def location(self, key: bytes) -> str:
        return f"s3://{self._cfg.bucket}/{self.object_name(key)}"

    def problems(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._problems)

    # ---- publish -------------------------------------------------------------------------

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        check_request(key, request)
        token = book.reserve(key, self._name)
        if token is None:
            return None
        try:
            fields = kvc.fields_from_request(request, now=time.time())
            prefix = kvc.build_prefix(fields, request.payload)
            if not book.check(key, token):
                book.abandon(key, token)
                return None
            adopted = self._put_once(key, b"".join((prefix, request.payload)))
            if adopted is None:
                n = memoryview(request.payload).nbytes
                info = row_info(key, self._name, fields, n, stored_bytes=len(prefix) + n)
                row = StoredRow(
                    info, request.tokens, self.location(key), request.chunk_keys, request.chunk_lens
                )
            else:
                row = adopted
            book.mark_linked(key, token, self.location(key))
        except BaseException:
            book.abandon(key, token)
            raise
        if not book.publish(key, token, row):
            log.debug("reservation for %s lost at publish", key.hex())
            return None
        return row

    def _put_once(self, key: bytes, body: bytes) -> StoredRow | None:
        """Create the object. None if we did; the existing row if another writer published a
        valid object for ``key`` first. Junk in the way is replaced."""
        name = self.object_name(key)
        for _ in range(_PUT_ATTEMPTS):
            try:
                self._wire.call(
                    f"put {name}",
                    lambda: self._wire.client.put_object(
                        Bucket=self._cfg.bucket, Key=name, Body=body, IfNoneMatch="*"
                    ),
                )
                return None
            except PublishRaceLost:
                pass
            existing = self.probe(key)
            if existing is not None:
                return existing
            log.warning("%s: replacing invalid object %s", self._name, name)
            self.delete(key)
        raise CacheIOError(f"{self._name}: {name} keeps reappearing invalid")

    # ---- read side -----------------------------------------------------------------------

    def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
        """The whole object, fully verified. ``buffer`` is not used: the body arrives as one
        immutable bytes object, which a promotion may keep past the caller's lease."""
        key = row.info.key
        name = self.object_name(key)

        def get() -> bytes:
            resp = self._wire.client.get_object(Bucket=self._cfg.bucket, Key=name)
            return read_body(resp, f"{self._name}: get {name}")

        data = self._wire.call(f"get {name}", get)
        f = kvc.parse(data, expected_key=key, known_tokens=row.tokens)
        return RowBytes(f.meta.fields.tokens, f.payload, f.meta.fields.logits, None, f.meta.fields)

    def probe(self, key: bytes) -> StoredRow | None:
        """The row under ``key`` if a valid one exists (metadata read, payload not): one
        ranged GET, two if the metadata is longer than ``_HEAD_BYTES``. None if missing or
        invalid; ``CacheNetworkError`` if the store cannot say."""
        name = self.object_name(key)
        try:
            meta, user_meta = self._wire.call(f"probe {name}", lambda: self._read_meta(name))
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
        bucket = self._cfg.bucket
        label = f"{self._name}: probe {name}"
        resp = self._wire.client.get_object(
            Bucket=bucket, Key=name, Range=f"bytes=0-{_HEAD_BYTES - 1}"
        )
        head = read_body(resp, label)
        size = _total_size(resp, len(head))
        user_meta = resp.get("Metadata") or {}
        assert isinstance(user_meta, Mapping)
        if len(head) < kvc.PREFIX_FIXED_SIZE:
            raise CacheFormatError(f"{name}: {size} bytes is too short")
        (offset,) = struct.unpack_from("<Q", head, kvc.HEADER_SIZE)
        if not kvc.PREFIX_FIXED_SIZE <= offset <= min(size, kvc.MAX_META_BYTES):
            raise CacheFormatError(f"{name}: payload offset {offset} out of range")
        if offset > len(head):
            rest = self._wire.client.get_object(
                Bucket=bucket, Key=name, Range=f"bytes={len(head)}-{offset - 1}"
            )
            head += read_body(rest, label)
        return kvc.parse_meta(head[:offset], file_size=size), user_meta

    def _row(self, key: bytes, meta: kvc.KvcMeta, user_meta: Mapping[str, str]) -> StoredRow:
        size = meta.payload_offset + meta.payload_length  # the object's size
        info = row_info(key, self._name, meta.fields, meta.payload_length, stored_bytes=size)
        hits, last_used = _int_meta(user_meta, _META_HITS), _int_meta(user_meta, _META_LAST_USED)
        if hits is not None and last_used is not None:
            info = replace(info, hits=hits, last_used=float(last_used))
        return StoredRow(
            info, meta.fields.tokens, self.location(key), meta.fields.chunks, meta.fields.chunk_lens
        )

    def delete(self, key: bytes) -> None:
        name = self.object_name(key)
        self._wire.call(
            f"delete {name}",
            lambda: self._wire.client.delete_object(Bucket=self._cfg.bucket, Key=name),
        )

    def record_hit(self, row: StoredRow, hits: int, last_used: float) -> None:
        """Best effort: a server-side copy onto itself that replaces the user metadata (no
        payload crosses the network)."""
        name = self.object_name(row.info.key)
        meta = {_META_HITS: str(max(0, int(hits))), _META_LAST_USED: str(max(0, int(last_used)))}
        source = {"Bucket": self._cfg.bucket, "Key": name}
        try:
            self._wire.call(
                f"record hit {name}",
                lambda: self._wire.client.copy_object(
                    Bucket=self._cfg.bucket,
                    Key=name,
                    CopySource=source,
                    Metadata=meta,
                    MetadataDirective="REPLACE",
                ),
            )
        except CacheKeyError:
            return  # deleted meanwhile (another process evicted it)
        except CacheIOError as exc:
            log.info("%s: cannot record hit on %s: %s", self._name, name, exc)

    def stored_keys(self) -> Iterator[bytes]:
        prefix = self._cfg.prefix
        names = self._wire.call(
            "list", lambda: list(list_names(self._wire.client, self._cfg.bucket, prefix))
        )
        for name in names:
            key = _key_of(name[len(prefix) :])
            if key is not None:
                yield key

    def scan(self) -> Iterator[StoredRow]:
        """Every valid row under the prefix: one ranged GET each, ``_SCAN_PARALLEL`` at a time
        (a shared bucket may hold thousands). An object this process cannot read is reported
        (``problems``), never deleted: other hosts share the bucket, and it may be a row a
        newer kvwarm wrote and reads (or one deleted since the listing). An in-progress PUT is
        never visible, so there are no temp objects to reap."""
        self._problems = []
        keys = list(self.stored_keys())
        with ThreadPoolExecutor(_SCAN_PARALLEL, thread_name_prefix="kvwarm-s3-scan") as pool:
            rows = list(pool.map(self.probe, keys))
        for key, row in zip(keys, rows, strict=True):
            if row is not None:
                yield row
                continue
            self._problems.append((self.location(key), "unreadable or vanished object"))
            if self._repair:
                log.warning("%s: cannot read %s, leaving it", self._name, self.location(key))

    # ---- chunks: <prefix>chunks/<hex>.kvk, published once like rows ------------------------

    def _chunk_object(self, key: bytes) -> str:
        return f"{self._cfg.prefix}{_CHUNK_DIR}{key.hex()}{_CHUNK_SUFFIX}"

    def store_chunk(self, key: bytes, head: bytes, payload: bytes) -> int:
        """One PUT of the whole object (visible whole or not at all); a 412 means the same
        content-addressed chunk is there already (a corrupt one is caught on load)."""
        name = self._chunk_object(key)
        body = head + payload
        with suppress(PublishRaceLost):
            self._wire.call(
                f"put {name}",
                lambda: self._wire.client.put_object(
                    Bucket=self._cfg.bucket, Key=name, Body=body, IfNoneMatch="*"
                ),
            )
        return len(body)

    def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
        name = self._chunk_object(key)

        def get() -> bytes:
            resp = self._wire.client.get_object(Bucket=self._cfg.bucket, Key=name)
            return read_body(resp, f"{self._name}: get {name}")

        return chunkfmt.parse(self._wire.call(f"get {name}", get), key)

    def delete_chunk(self, key: bytes) -> None:
        name = self._chunk_object(key)
        self._wire.call(
            f"delete {name}",
            lambda: self._wire.client.delete_object(Bucket=self._cfg.bucket, Key=name),
        )

    def scan_chunks(self) -> Iterator[tuple[bytes, int]]:
        """Listed, not read: a chunk's CRC is checked when a restore loads it."""
        for key, size, _ in self.chunk_ages():
            yield key, size

    def chunk_ages(self) -> Iterator[tuple[bytes, int, float]]:
        prefix = f"{self._cfg.prefix}{_CHUNK_DIR}"
        items = self._wire.call(
            "list chunks", lambda: list(list_aged(self._wire.client, self._cfg.bucket, prefix))
        )
        for name, size, mtime in items:
            stem = name[len(prefix) :]
            hexpart = stem[: -len(_CHUNK_SUFFIX)]
            if stem.endswith(_CHUNK_SUFFIX) and len(hexpart) == 64 and _HEX.issuperset(hexpart):
                yield bytes.fromhex(hexpart), size, mtime

    def close(self) -> None:
        close = getattr(self._wire.client, "close", None)
        if callable(close):
            close()


def _total_size(resp: Mapping[str, object], got: int) -> int:
    """The object's full size from a ranged GET's Content-Range (``bytes a-b/total``)."""
    content_range = resp.get("ContentRange")
    if isinstance(content_range, str) and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        if total.isdigit():
            return int(total)
    return got  # the store ignored the range and sent the whole object


def _int_meta(meta: Mapping[str, str], name: str) -> int | None:
    value = meta.get(name)
    return int(value) if value is not None and value.isdigit() else None


def _key_of(stem: str) -> bytes | None:
    hexpart = stem[: -len(_SUFFIX)]
    if not stem.endswith(_SUFFIX) or len(hexpart) != 64 or not _HEX.issuperset(hexpart):
        return None
    return bytes.fromhex(hexpart)
