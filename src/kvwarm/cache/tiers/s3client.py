"""The ``s3`` tier's wire: a boto3 client with bounded timeouts, and errors translated once.

Invariants:
- Every call goes through ``S3Wire.call``, so no botocore exception leaves this module: a
  missing object is ``CacheKeyError``, a store that cannot be reached, times out, throttles
  (429, SlowDown) or answers 5xx (after botocore's bounded retries) is ``CacheNetworkError``,
  anything else the store refuses (403, no such bucket, bad credentials, 501 not
  implemented) is ``CacheIOError``; a lost publish race
  (412, or 409 ConditionalRequestConflict) is ``PublishRaceLost``, a signal to the tier,
  not an error.
- After a network fault the wire is *down* for ``down_for_s``: calls fail at once with
  ``CacheNetworkError`` instead of waiting out another timeout, so a dead store costs each
  lookup nothing and the process one timeout per interval (``docs/architecture.md``,
  "Shared tiers").
- boto3 is imported only here and only when a tier is built (the ``kvwarm[s3]`` extra).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, TypeVar, runtime_checkable

from kvwarm.cache.tiers.objects import Breaker
from kvwarm.cache.types import S3Config
from kvwarm.errors import (
    CacheFormatError,
    CacheIOError,
    CacheKeyError,
    CacheNetworkError,
    ConfigError,
)

__all__ = [
    "PublishRaceLost",
    "S3Body",
    "S3Client",
    "S3Wire",
    "list_names",
    "list_sized",
    "make_client",
    "read_body",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Codes an S3-compatible store uses for "try again later": treated like a dead connection.
# Throttling (botocore's own throttling codes, and HTTP 429 whatever the code) is one too.
_RETRYABLE_CODES = frozenset(
    (
        "SlowDown",
        "RequestTimeout",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeTooSkewed",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
    )
)
# 5xx answers that are a refusal, not an outage: the store does not implement the request
# (e.g. a conditional PUT); marking the store down would fail its reads too.
_REFUSED_5XX = frozenset(("NotImplemented",))
_MISSING_CODES = frozenset(("NoSuchKey", "404", "NotFound"))
# A conditional put that lost: 412, or 409 ConditionalRequestConflict (AWS: another
# conditional write of the name was in flight; its outcome is unknown yet). Either way the
# tier looks at what is there (adopt, or clear and put again), as for any lost race.
_RACE_CODES = frozenset(("PreconditionFailed", "ConditionalRequestConflict"))


class PublishRaceLost(Exception):  # noqa: N818 - a signal between wire and tier, not an error
    """``put_object(IfNoneMatch="*")`` answered 412: another writer published this key."""


@runtime_checkable
class S3Body(Protocol):
    def read(self, amt: int | None = None) -> bytes: ...

    def close(self) -> None: ...


class S3Client(Protocol):
    """The slice of boto3's S3 client the tier uses (keyword arguments, as boto3 takes them).
    Tests wrap a real client in one that injects faults."""

    def put_object(self, **kwargs: object) -> Mapping[str, object]: ...

    def get_object(self, **kwargs: object) -> Mapping[str, object]: ...

    def delete_object(self, **kwargs: object) -> Mapping[str, object]: ...

    def copy_object(self, **kwargs: object) -> Mapping[str, object]: ...

    def head_object(self, **kwargs: object) -> Mapping[str, object]: ...

    def list_objects_v2(self, **kwargs: object) -> Mapping[str, object]: ...


def make_client(cfg: S3Config, max_connections: int) -> S3Client:
    """A boto3 client for ``cfg``: credentials from boto3's normal chain, bounded connect and
    read timeouts, botocore's "standard" retry mode with ``cfg.max_attempts`` attempts."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ConfigError("the s3 tier needs boto3: pip install 'kvwarm[s3]'") from None
    config = Config(
        connect_timeout=cfg.connect_timeout_s,
        read_timeout=cfg.read_timeout_s,
        retries={"max_attempts": cfg.max_attempts, "mode": "standard"},
        max_pool_connections=max_connections,
        # Rows carry their own CRC32C, checked on every get. botocore's default checksums
        # (since 1.36) add headers that several S3-compatible stores reject.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session = boto3.session.Session()
    client: S3Client = session.client(
        "s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region, config=config
    )
    return client


class S3Wire:
    """A client plus the translation of its errors and the down-for-a-while breaker."""

    def __init__(self, client: S3Client, *, label: str, down_for_s: float) -> None:
        self.client = client
        self._label = label
        self._breaker = Breaker(label, down_for_s)

    def is_down(self) -> bool:
        return self._breaker.is_down()

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one or more client calls and body reads) with errors translated."""
        self._breaker.check()
        try:
            return fn()
        except PublishRaceLost:
            raise
        except Exception as exc:
            err = self._translate(what, exc)
            if isinstance(err, CacheNetworkError):
                self._breaker.trip(err)
            raise err from exc

    def _translate(self, what: str, exc: Exception) -> Exception:
        from botocore import exceptions as bexc

        where = f"{self._label}: {what}"
        if isinstance(exc, bexc.ClientError):
            meta = exc.response.get("ResponseMetadata", {})
            status = int(meta.get("HTTPStatusCode", 0) or 0)
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _RACE_CODES or status == 412:
                return PublishRaceLost(where)
            if code == "NoSuchBucket":  # a configuration error, not a missing row
                return CacheIOError(f"{where}: no such bucket")
            if code in _MISSING_CODES or status == 404:
                return CacheKeyError(f"{where}: no such object")
            if code == "InvalidRange" or status == 416:
                # A ranged read past the object's end: it is empty or shorter than any row's
                # or chunk's head, so junk (replaced by a publish), not a store failure.
                return CacheFormatError(f"{where}: object shorter than its head")
            if code in _REFUSED_5XX or status == 501:
                return CacheIOError(f"{where}: store does not implement it ({status} {code})")
            if status >= 500 or status == 429 or code in _RETRYABLE_CODES:
                return CacheNetworkError(f"{where}: store answered {status} {code}")
            return CacheIOError(f"{where}: store refused ({status} {code}): {exc}")
        if isinstance(
            exc, (bexc.ConnectionError, bexc.HTTPClientError, bexc.IncompleteReadError, OSError)
        ):
            return CacheNetworkError(f"{where}: {type(exc).__name__}: {exc}")
        if isinstance(exc, bexc.BotoCoreError):
            return CacheIOError(f"{where}: {type(exc).__name__}: {exc}")
        return exc  # a programming error: not ours to disguise


def read_body(response: Mapping[str, object], label: str) -> bytes:
    """The whole body of a get_object response; ``CacheNetworkError`` if it came short (a
    connection cut mid-transfer must not look like a corrupt object)."""
    body = response["Body"]
    assert isinstance(body, S3Body)
    try:
        data: bytes = body.read()
    finally:
        body.close()
    expected = response.get("ContentLength")
    if isinstance(expected, int) and len(data) != expected:
        raise CacheNetworkError(f"{label}: body ended after {len(data)} of {expected} bytes")
    return data


def list_names(client: S3Client, bucket: str, prefix: str) -> Iterator[str]:
    """Every object name under ``prefix`` (paginated; the caller translates errors)."""
    for name, _ in list_sized(client, bucket, prefix):
        yield name


def list_sized(client: S3Client, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:
    """(name, size) of every object under ``prefix`` (paginated)."""
    for name, size, _ in list_aged(client, bucket, prefix):
        yield name, size


def list_aged(client: S3Client, bucket: str, prefix: str) -> Iterator[tuple[str, int, float]]:
    """(name, size, LastModified as epoch seconds) of every object under ``prefix``."""
    token: str | None = None
    while True:
        kwargs: dict[str, object] = {"Bucket": bucket, "Prefix": prefix}
        if token is not None:
            kwargs["ContinuationToken"] = token
        page = client.list_objects_v2(**kwargs)
        contents = page.get("Contents", [])
        assert isinstance(contents, list)
        for item in contents:
            stamp = item.get("LastModified")
            # No stamp (a store that omits it): as young as can be, so it is never swept.
            mtime = stamp.timestamp() if hasattr(stamp, "timestamp") else float("inf")
            yield str(item["Key"]), int(item.get("Size", 0)), mtime
        if not page.get("IsTruncated"):
            return
        token = str(page["NextContinuationToken"])
