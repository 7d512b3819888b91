"""The ``s3`` store: one object ``<prefix><name>`` per row or chunk in an S3-compatible store
(AWS, MinIO, Ceph), under the generic ``ObjectTier`` (``tiers/objects.py``), which owns the
publish protocol, probes, scans and chunk rules.

Invariants:
- Put once: ``put_object(IfNoneMatch="*")``; S3 makes a PUT visible whole or not at all, and
  a 412 means the object exists (``ObjectStore.put_if_absent`` answers False).
- User metadata (hit counts) is rewritten by a server-side copy onto itself: no payload
  crosses the network.
- Every call goes through ``S3Wire.call`` (``s3client``), so boto3's errors are translated
  once and a dead store is skipped for ``down_for_s``.
See docs/architecture.md ("Shared tiers").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from urllib.parse import parse_qsl, urlsplit

from kvwarm.cache.tiers.objects import (
    REMOTE_CAPABILITIES,
    Got,
    ObjectTier,
    remote_capabilities,
)
from kvwarm.cache.tiers.registry import shown_url, url_switch
from kvwarm.cache.tiers.s3client import (
    LeanGets,
    PacedBody,
    PublishRaceLost,
    S3Client,
    S3Wire,
    list_aged,
    make_client,
    read_body,
)
from kvwarm.cache.types import DEFAULT_MIN_BYTES_PER_S, S3Config, TierName
from kvwarm.cache.validate import validate_s3_config
from kvwarm.errors import CacheIOError, CacheKeyError, CacheNetworkError, ConfigError

__all__ = ["S3_CAPABILITIES", "S3Store", "S3Tier"]

S3_CAPABILITIES = REMOTE_CAPABILITIES


log = logging.getLogger(__name__)


class S3Store:
    """Objects in one bucket under one prefix. Thread-safe (boto3 clients are)."""

    def __init__(self, config: S3Config, wire: S3Wire) -> None:
        self._cfg = config
        self.wire = wire
        self._touch_refused = False  # warned that the store refuses a copy onto itself

    @property
    def label(self) -> str:
        return f"s3://{self._cfg.bucket}/{self._cfg.prefix}"

    def _key(self, name: str) -> str:
        return f"{self._cfg.prefix}{name}"

    def location(self, name: str) -> str:
        return f"s3://{self._cfg.bucket}/{self._key(name)}"

    def put_if_absent(self, name: str, body: bytes) -> bool:
        key = self._key(name)
        try:
            self.wire.call(
                f"put {key}",
                lambda: self.wire.client.put_object(
                    Bucket=self._cfg.bucket,
                    Key=key,
                    Body=PacedBody(body, self.wire.pace()),
                    IfNoneMatch="*",
                ),
            )
        except PublishRaceLost:
            return False
        return True

    def get(self, name: str, end: int | None = None) -> Got:
        key = self._key(name)
        byte_range = None if end is None else f"bytes=0-{end - 1}"

        def get() -> Got:
            resp = self.wire.get_object(self._cfg.bucket, key, byte_range)
            where = f"{self.label}: get {key}"
            data = read_body(resp, where, self.wire.pace())
            meta = resp.get("Metadata") or {}
            assert isinstance(meta, Mapping)
            if end is None:
                return Got(data, len(data), meta)
            size = _total_size(resp, len(data))
            return Got(_in_range(resp, data, 0, end, where), size, meta)

        return self.wire.call(f"get {key}", get)

    def get_range(self, name: str, start: int, end: int) -> bytes:
        key = self._key(name)

        def get() -> bytes:
            resp = self.wire.get_object(self._cfg.bucket, key, f"bytes={start}-{end - 1}")
            where = f"{self.label}: get {key}"
            return _in_range(resp, read_body(resp, where, self.wire.pace()), start, end, where)

        return self.wire.call(f"get {key}", get)

    def names(self, prefix: str) -> list[str]:
        return [name for name, _, _ in self.list(prefix)]  # a listing names sizes anyway

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        full = self._key(prefix)
        items = self.wire.call(
            "list", lambda: list(list_aged(self.wire.client, self._cfg.bucket, full))
        )
        cut = len(self._cfg.prefix)
        return [(name[cut:], size, mtime) for name, size, mtime in items]

    def delete(self, name: str) -> None:
        key = self._key(name)
        self.wire.call(
            f"delete {key}",
            lambda: self.wire.client.delete_object(Bucket=self._cfg.bucket, Key=key),
        )

    def set_meta(self, name: str, meta: Mapping[str, str]) -> None:
        self._copy_onto_itself(name, meta, "set metadata")

    def _copy_onto_itself(self, name: str, meta: Mapping[str, str], what: str) -> None:
        """A server-side copy of ``name`` onto itself with ``meta`` as its user metadata:
        the bytes never leave the store, and S3 stamps a new ``LastModified``."""
        key = self._key(name)
        source = {"Bucket": self._cfg.bucket, "Key": key}
        self.wire.call(
            f"{what} {key}",
            lambda: self.wire.client.copy_object(
                Bucket=self._cfg.bucket,
                Key=key,
                CopySource=source,
                Metadata=dict(meta),
                MetadataDirective="REPLACE",
            ),
        )

    def touch(self, name: str) -> bool:
        """A copy onto itself (server-side, the bytes never leave the store): S3 stamps a
        new ``LastModified``; the user metadata is replaced by none. A store that refuses
        the copy (an S3-compatible one, a policy without it) leaves the time as it is: the
        object is only checked to be there (warned once; the sweep's grace must then cover
        the chunk's whole life, as before touches)."""
        try:
            self._copy_onto_itself(name, {}, "touch")
        except CacheKeyError:
            return False
        except CacheNetworkError:
            raise
        except CacheIOError as exc:
            if not self._touch_refused:
                self._touch_refused = True
                log.warning(
                    "%s: cannot restamp chunks (%s); only checking they exist", self.label, exc
                )
            return self.age(name) is not None
        return True

    def age(self, name: str) -> float | None:
        key = self._key(name)
        try:
            resp = self.wire.call(
                f"head {key}",
                lambda: self.wire.client.head_object(Bucket=self._cfg.bucket, Key=key),
            )
        except CacheKeyError:
            return None
        stamp = resp.get("LastModified")
        return stamp.timestamp() if hasattr(stamp, "timestamp") else float("inf")

    def close(self) -> None:
        close = getattr(self.wire.client, "close", None)
        if callable(close):
            close()


class S3Tier(ObjectTier):
    """The generic object tier over an ``S3Store`` (the constructor tests and the registry
    call), with the S3 names tests look at."""

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
        if not config.bucket:
            raise ConfigError("the s3 tier needs a bucket (setting s3_bucket)")
        if config.prefix and not config.prefix.endswith("/"):
            raise ConfigError(f"s3 prefix must end with '/', got {config.prefix!r}")
        if quota_bytes < 0:
            raise ConfigError("s3 tier quota must be >= 0")
        label = f"{name} (s3://{config.bucket}/{config.prefix})"
        # A client given (tests wrap one to inject faults) is called as it is; one built
        # here GETs the lean way (s3client.LeanGets).
        raw = client if client is not None else make_client(config, max_connections)
        lean = LeanGets.of(raw) if client is None else None
        wire = S3Wire(
            raw,
            label=label,
            down_for_s=config.down_for_s,
            lean=lean,
            min_bytes_per_s=config.min_bytes_per_s,
            window_s=config.read_timeout_s,
        )
        self._s3 = S3Store(config, wire)
        self._cfg = config
        super().__init__(
            self._s3,
            quota_bytes,
            name=name,
            repair=repair,
            capabilities=remote_capabilities(packs=config.packs),
        )

    @property
    def config(self) -> S3Config:
        return self._cfg

    @property
    def wire(self) -> S3Wire:
        return self._s3.wire

    def object_name(self, key: bytes) -> str:
        return f"{self._cfg.prefix}{key.hex()}.kvc"


def _in_range(resp: Mapping[str, object], data: bytes, start: int, end: int, where: str) -> bytes:
    """Bytes ``[start, end)`` of an answer to a GET of that range. A store may answer it
    with the whole object (200, no Content-Range; HTTP allows it and boto3 hands it on as
    it came): cut from that. A Content-Range that starts elsewhere is not those bytes."""
    content_range = resp.get("ContentRange")
    if not isinstance(content_range, str):
        return data[start:end]
    first = content_range.removeprefix("bytes ").split("-", 1)[0].strip()
    if not first.isdigit() or int(first) != start:
        raise CacheIOError(f"{where}: asked for bytes {start}- and got {content_range!r}")
    return data[: end - start]


def _total_size(resp: Mapping[str, object], got: int) -> int:
    """The object's full size from a ranged GET's Content-Range (``bytes a-b/total``)."""
    content_range = resp.get("ContentRange")
    if isinstance(content_range, str) and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        if total.isdigit():
            return int(total)
    return got  # the store ignored the range and sent the whole object


def s3_config_from_url(url: str) -> S3Config:
    """``s3://bucket/prefix/?endpoint=http://minio:9000&region=...&connect_timeout_s=...
    &read_timeout_s=...&max_attempts=...&down_for_s=...&min_bytes_per_s=...`` as an
    ``S3Config``. Its messages show the URL as ``shown_url`` does: found by review, a
    credential put in it (an option such as ``secret_access_key``, which is none of ours, or a
    ``key:secret@`` user part) was shown whole in the error that refused it."""
    shown = shown_url(url)
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ConfigError(f"an s3 tier URL is s3://bucket/prefix/, got {shown!r}")
    if "@" in parts.netloc:
        # Taken for the bucket's name, the user part went into every log line naming the
        # tier (found by review: a scan's warning showed the secret).
        raise ConfigError(
            f"s3 tier URL {shown!r}: no credentials in the URL; boto3 reads them from its "
            "own sources (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile, a role)"
        )
    query = dict(parse_qsl(parts.query))
    known = {
        "endpoint",
        "region",
        "connect_timeout_s",
        "read_timeout_s",
        "max_attempts",
        "packs",
        "min_bytes_per_s",
    }
    unknown = set(query) - known - {"down_for_s"}
    if unknown:
        raise ConfigError(f"s3 tier URL {shown!r}: unknown options {', '.join(sorted(unknown))}")
    prefix = parts.path.lstrip("/")
    try:
        cfg = S3Config(
            bucket=parts.netloc,
            prefix=prefix if not prefix or prefix.endswith("/") else prefix + "/",
            endpoint_url=query.get("endpoint"),
            region=query.get("region"),
            connect_timeout_s=float(query.get("connect_timeout_s", 2.0)),
            read_timeout_s=float(query.get("read_timeout_s", 10.0)),
            max_attempts=int(query.get("max_attempts", 2)),
            down_for_s=float(query.get("down_for_s", 5.0)),
            min_bytes_per_s=int(query.get("min_bytes_per_s", DEFAULT_MIN_BYTES_PER_S)),
            packs=url_switch(query, "packs", f"s3 tier URL {shown!r}", default=True),
        )
    except ValueError as exc:
        raise ConfigError(f"s3 tier URL {shown!r}: {exc}") from None
    try:
        validate_s3_config(cfg)
    except ConfigError as exc:
        raise ConfigError(f"s3 tier URL {shown!r}: {exc}") from None
    return cfg
