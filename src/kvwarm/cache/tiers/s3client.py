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
- A GET of a tier-built client goes the lean way (``LeanGets``): signed by the client's own
  signer and sent through its own HTTP session, with botocore's standard retry policy, so a
  restore's dozen chunk GETs do not each pay botocore's whole request pipeline. What comes
  back is typed exactly as a ``get_object`` answer would be.
- No transfer goes on under the store's speed floor (``S3Config.min_bytes_per_s``, averaged
  over ``read_timeout_s``; ``objects.Pace``): a GET's body is read as it arrives and a PUT's
  body is counted as the connection takes it, and one slower is abandoned as a network fault
  (botocore's timeouts bound each socket read or send, not a body).
- boto3 is imported only here and only when a tier is built (the ``kvwarm[s3]`` extra).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

from kvwarm.cache.tiers.objects import Breaker, Pace
from kvwarm.cache.types import S3Config
from kvwarm.errors import (
    CacheFormatError,
    CacheIOError,
    CacheKeyError,
    CacheNetworkError,
    ConfigError,
)

__all__ = [
    "LeanGets",
    "PacedBody",
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
    raw = session.client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region, config=config)
    # A PUT's body is a file (``PacedBody``), for which botocore asks for "100-continue": a
    # round trip before every body, and a second's wait where a store never answers it. Sent
    # at once, as a bytes body is. (On botocore's own event, after its handler: one on
    # ``before-call.s3.PutObject`` would run before it.)
    raw.meta.events.register_last("before-call.s3", _no_expect)
    client: S3Client = raw
    return client


def _no_expect(params: dict[str, Any], **_: object) -> None:
    params.get("headers", {}).pop("Expect", None)


class S3Wire:
    """A client plus the translation of its errors and the down-for-a-while breaker."""

    def __init__(
        self,
        client: S3Client,
        *,
        label: str,
        down_for_s: float,
        lean: LeanGets | None = None,
        min_bytes_per_s: int = 0,
        window_s: float = 1.0,
    ) -> None:
        self.client = client
        self.lean = lean
        self._label = label
        self._breaker = Breaker(label, down_for_s)
        self._min_bytes_per_s = min_bytes_per_s
        self._window_s = window_s

    def pace(self) -> Pace:
        """The speed floor of one transfer."""
        return Pace(self._min_bytes_per_s, self._window_s)

    def is_down(self) -> bool:
        return self._breaker.is_down()

    def get_object(self, bucket: str, key: str, byte_range: str | None) -> Mapping[str, object]:
        """``get_object(Bucket=bucket, Key=key[, Range=byte_range])``, the lean way where
        the wire has one (run it inside ``call``, like any client call; ``read_body`` reads
        what the client answers)."""
        if self.lean is not None:
            return self.lean.get_object(self.client, bucket, key, byte_range, self.pace())
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if byte_range is not None:
            kwargs["Range"] = byte_range
        return self.client.get_object(**kwargs)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one or more client calls and body reads) with errors translated."""
        self._breaker.check()
        try:
            result = fn()
        except PublishRaceLost:
            self._breaker.answered()
            raise
        except Exception as exc:
            err = self._translate(what, exc)
            if isinstance(err, CacheNetworkError):
                self._breaker.trip(err)
            else:
                self._breaker.answered()  # a refusal, a missing object: the store is up
            raise err from exc
        self._breaker.answered()
        return result

    def _translate(self, what: str, exc: Exception) -> Exception:
        from botocore import exceptions as bexc

        where = f"{self._label}: {what}"
        if isinstance(exc, CacheNetworkError):  # a transfer under the speed floor
            return CacheNetworkError(f"{where}: {exc}")
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


@dataclass(frozen=True)
class _Route:
    """Where and how one bucket's GETs go, as the client itself sent one: the URL up to the
    key (endpoint, addressing style) and after it, and what it signed with."""

    head: str
    tail: str
    region: str
    signing_name: str
    user_agent: str | None


class _Body:
    """A body already read whole (what ``read_body`` takes)."""

    read_whole = True

    def __init__(self, data: bytes) -> None:
        self._data = data

    def read(self, amt: int | None = None) -> bytes:
        data, self._data = self._data, b""
        return data

    def close(self) -> None:
        self._data = b""


# Signing context keys of a plain SigV4 request; any other (an identity cache, as S3
# Express uses, request credentials, a SigV4a region set) leaves GETs to the client.
_PLAIN_SIGNING = frozenset(("region", "signing_name", "disableDoubleEncoding"))
_META = "x-amz-meta-"  # an object's user metadata, one header a name


class LeanGets:
    """GETs of a botocore S3 client without its per-call pipeline (parameter validation,
    a dozen event hooks, endpoint rules, response parsing: ~0.5 ms of Python a GET, the
    most of one small GET's client time).

    A bucket's first GET goes through the client (``get_object``); a hook on the client's
    own ``before-sign`` event records where it went (the resolved URL, so the endpoint and
    addressing style are the client's) and what it signed with (region, signing name).
    Later GETs build that URL, sign it with the client's own signer (``get_auth_instance``:
    its credentials, refreshed as they expire, session token included) and send it through
    the client's own HTTP session (its TLS verification, proxies, timeouts and pool).
    What comes back is treated as the client treats it:
    - 200/206: the body, its ``ContentLength``, ``ContentRange`` and user metadata, shaped
      as ``get_object``'s answer (``read_body`` checks the length).
    - An error answer is parsed by the client's protocol parser and raised as the
      ``ClientError`` the client raises (``S3Wire`` types it: 404 a miss, and so on).
    - botocore's standard retry policy, with the client's attempt count, decides retries
      (throttling, 5xx, connection errors; the same jittered backoff). Its retry quota is
      not shared: the wire's breaker stops calls after a network fault anyway.
    - A redirect (3xx) or 400 (a region mismatch answers one), or any other status under
      400, goes again through the client, which follows it or hands it on; the hook then
      records where it went.
    - Every botocore name it uses is imported as it is built: a botocore without one
      leaves GETs to the client (``of`` answers None).
    Only SigV4 GETs of a client in standard retry mode go this way; anything else (another
    signature version, S3 Express, a route the hook could not read) stays on the client.
    """

    def __init__(self, client: Any) -> None:
        # Every botocore name the lean way uses is imported here, once, so a botocore without
        # one leaves GETs to the client (``of``) instead of failing each GET.
        from botocore.awsrequest import AWSRequest  # noqa: F401
        from botocore.exceptions import ResponseStreamingError  # noqa: F401
        from botocore.parsers import create_parser
        from botocore.retries import standard
        from botocore.retries.standard import RetryContext  # noqa: F401
        from botocore.utils import percent_encode  # noqa: F401

        self._signer = client._request_signer
        self._http = client._endpoint.http_session
        if not (callable(self._signer.get_auth_instance) and callable(self._http.send)):
            raise TypeError("the client's signer or HTTP session is not botocore's")
        self._op = client.meta.service_model.operation_model("GetObject")
        self._parser = create_parser(client.meta.service_model.protocol)
        attempts = client.meta.config.retries.get("total_max_attempts")
        detector = standard.ThrottlingErrorDetector(standard.RetryEventAdapter())
        self._policy = standard.RetryPolicy(
            retry_checker=standard.StandardRetryConditions(
                max_attempts=attempts or standard.DEFAULT_MAX_ATTEMPTS
            ),
            retry_backoff=standard.ExponentialBackoff(
                service_name="s3", throttling_detector=detector
            ),
        )
        self._routes: dict[str, _Route] = {}
        self._learning = threading.local()
        client.meta.events.register(
            "before-sign.s3.GetObject", self._learn, unique_id=f"kvwarm-lean-{id(self)}"
        )

    @classmethod
    def of(cls, client: object) -> LeanGets | None:
        """Lean GETs for ``client``, or None where it is not a botocore S3 client in standard
        retry mode with the parts they use (a wrapper, another botocore)."""
        try:
            from botocore.client import BaseClient
        except ImportError:
            return None
        if not isinstance(client, BaseClient):
            return None
        try:
            if client.meta.service_model.service_name != "s3":
                return None
            if client.meta.config.retries.get("mode", "standard") != "standard":
                return None
            return cls(client)
        except (AttributeError, KeyError, TypeError, ImportError) as exc:
            log.info("s3: GETs go through boto3's whole pipeline (%s)", exc)
            return None

    def routed(self, bucket: str) -> bool:
        """Whether ``bucket``'s GETs go the lean way now."""
        return bucket in self._routes

    def get_object(
        self, client: S3Client, bucket: str, key: str, byte_range: str | None, pace: Pace
    ) -> Mapping[str, object]:
        route = self._routes.get(bucket)
        if route is not None:
            got = self._get(route, key, byte_range, pace)
            if got is not None:
                return got
            self._routes.pop(bucket, None)  # redirected: the client finds the way again
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if byte_range is not None:
            kwargs["Range"] = byte_range
        self._learning.want = (bucket, key)
        try:
            return client.get_object(**kwargs)
        finally:
            self._learning.want = None

    def _learn(
        self,
        request: Any,
        signing_name: str,
        region_name: str,
        signature_version: object,
        **_: object,
    ) -> None:
        """``before-sign`` of the client's GetObject: record the route of a GET this object
        sent (another thread's or caller's GETs are left alone)."""
        from botocore.utils import percent_encode

        want = getattr(self._learning, "want", None)
        if want is None:
            return
        bucket, key = want
        signing = request.context.get("signing") or {}
        if signature_version != "s3v4" or not set(signing) <= _PLAIN_SIGNING:
            self._routes.pop(bucket, None)
            return
        parts = urlsplit(request.url)
        quoted = percent_encode(key, safe="/~")
        if not parts.path.endswith(quoted):
            self._routes.pop(bucket, None)
            return
        head = urlunsplit((parts.scheme, parts.netloc, parts.path[: -len(quoted)], "", ""))
        self._routes[bucket] = _Route(
            head=head,
            tail=f"?{parts.query}" if parts.query else "",
            region=str(signing.get("region") or region_name),
            signing_name=str(signing.get("signing_name") or signing_name),
            user_agent=request.headers.get("User-Agent"),
        )

    def _get(
        self, route: _Route, key: str, byte_range: str | None, pace: Pace
    ) -> Mapping[str, object] | None:
        """One GET with retries: the answer, None to go through the client, or the
        exception the client would raise (a body under the speed floor: ``TransferTooSlowError``,
        not retried)."""
        from botocore.awsrequest import AWSRequest
        from botocore.exceptions import (
            ClientError,
            ConnectionError,
            HTTPClientError,
            ResponseStreamingError,
        )
        from botocore.retries.standard import RetryContext
        from botocore.utils import percent_encode

        url = f"{route.head}{percent_encode(key, safe='/~')}{route.tail}"
        headers: dict[str, str] = {}
        if route.user_agent is not None:
            headers["User-Agent"] = route.user_agent
        if byte_range is not None:
            headers["Range"] = byte_range
        attempt = 1
        while True:
            # Signed afresh each attempt: a new date, the credentials as they are now.
            request = AWSRequest("GET", url, headers=dict(headers), stream_output=True)
            auth = self._signer.get_auth_instance(route.signing_name, route.region, "s3v4")
            auth.add_auth(request)
            response: Any = None
            parsed: dict[str, Any] | None = None
            caught: Exception | None = None
            try:
                response = self._http.send(request.prepare())
            except (ConnectionError, HTTPClientError) as exc:
                caught = exc
            if response is not None:
                status = response.status_code
                if status in (200, 206):
                    return _answer(response, pace)
                if status <= 400:
                    # A redirect, a 400 (a region mismatch answers one), or another answer
                    # botocore takes as success: the client's to follow or to hand on.
                    response.raw.close()
                    return None
                try:  # an error's body is read before it is answered, as the client does
                    pace.restart()
                    body = _read(response.raw, pace)
                except ResponseStreamingError as exc:
                    response, caught = None, exc
                else:
                    parsed = self._parser.parse(
                        {"status_code": status, "headers": response.headers, "body": body},
                        self._op.output_shape,
                    )
            context = RetryContext(
                attempt_number=attempt,
                operation_model=self._op,
                parsed_response=parsed,
                http_response=response,
                caught_exception=caught,
                request_context={},
            )
            if not self._policy.should_retry(context):
                if caught is not None:
                    raise caught
                assert parsed is not None
                raise ClientError(parsed, "GetObject")
            time.sleep(self._policy.compute_retry_delay(context))
            attempt += 1


# A body is read in pieces of at most this: each is what one socket read brings (read1).
_PIECE = 1 << 20


def _read(raw: Any, pace: Pace) -> bytes:
    """A GET's whole body from its urllib3 response ``raw``, sent unread, as it arrives: each
    read takes what one socket read brings (``read1``, bounded by the read timeout), and
    ``pace`` abandons a body coming slower than the floor (``TransferTooSlowError``; found by
    review: one ``read()`` of a body 100 bytes every 0.3 s took as long as the body
    lasted). A connection that fails mid-body raises as botocore's body reads do (not
    retried, as the client does not retry a body it already handed out)."""
    from botocore.exceptions import ResponseStreamingError
    from urllib3.exceptions import HTTPError

    pieces = []
    try:
        while piece := raw.read1(_PIECE):  # to its end: urllib3 then pools the connection
            pieces.append(piece)
            pace.moved(len(piece))
    except (HTTPError, OSError) as exc:
        raw.close()
        raise ResponseStreamingError(error=exc) from exc
    except BaseException:
        raw.close()  # abandoned mid-body: the connection cannot serve another request
        raise
    return b"".join(pieces)


def _answer(response: Any, pace: Pace) -> Mapping[str, object]:
    """A lean GET's 200/206 shaped as ``get_object``'s answer."""
    headers = response.headers
    out: dict[str, object] = {"Body": _Body(_read(response.raw, pace))}
    length = headers.get("Content-Length")
    if length is not None and length.isdigit():
        out["ContentLength"] = int(length)
    content_range = headers.get("Content-Range")
    if content_range is not None:
        out["ContentRange"] = content_range
    out["Metadata"] = {
        name[len(_META) :]: value
        for name, value in headers.items()
        if name.lower().startswith(_META)
    }
    return out


def read_body(response: Mapping[str, object], label: str, pace: Pace) -> bytes:
    """The whole body of a get_object response; ``CacheNetworkError`` if it came short (a
    connection cut mid-transfer must not look like a corrupt object). A botocore body (the
    client's own GET: a bucket's first, a redirect) is read as it arrives, held to ``pace``
    as a lean GET's is; a lean GET's was read so already; another (a test's client) whole."""
    body = response["Body"]
    assert isinstance(body, S3Body)
    # botocore's StreamingBody reads whole or by blocking amounts: its urllib3 response,
    # which reads what comes (read1), is the only way to a rate between socket reads.
    raw = getattr(body, "_raw_stream", None)
    try:
        if getattr(body, "read_whole", False) or not callable(getattr(raw, "read1", None)):
            data: bytes = body.read()
        else:
            data = _read(raw, pace)
    finally:
        body.close()
    expected = response.get("ContentLength")
    if isinstance(expected, int) and len(data) != expected:
        raise CacheNetworkError(f"{label}: body ended after {len(data)} of {expected} bytes")
    return data


class PacedBody(io.BytesIO):
    """A PUT's body as the HTTP connection sends it: a block read, then sent (``sendall``,
    bounded by the socket timeout), then the next; each block read is counted by ``pace``,
    so a store that takes the bytes slower than the floor has the PUT abandoned (found by
    review: it held the thread and its payload as long as it trickled). Read again from its
    start (signing, a retry) the pace restarts; once abandoned, a retry fails at once."""

    def __init__(self, data: bytes, pace: Pace) -> None:
        super().__init__(data)  # shares ``data``'s buffer until written to (never)
        self._pace = pace

    def read(self, size: int | None = -1, /) -> bytes:
        data = super().read(size)
        self._pace.moved(len(data))
        return data

    def seek(self, pos: int, whence: int = 0, /) -> int:
        self._pace.restart()
        return super().seek(pos, whence)


def list_names(client: S3Client, bucket: str, prefix: str) -> Iterator[str]:
    """Every object name under ``prefix`` (paginated; the caller translates errors)."""
    for name, _ in list_sized(client, bucket, prefix):
        yield name


def list_sized(client: S3Client, bucket: str, prefix: str) -> Iterator[tuple[str, int]]:
    """(name, size) of every object under ``prefix`` (paginated)."""
    for name, size, _ in list_aged(client, bucket, prefix):
        yield name, size


def list_aged(client: S3Client, bucket: str, prefix: str) -> Iterator[tuple[str, int, float]]:
    """(name, size, LastModified as epoch seconds) of every object under ``prefix``. A page
    not shaped as S3's is ``CacheFormatError``: an entry without a name or size, or a listing
    said to go on without a new continuation token (found by review: a ``KeyError`` escaped
    the startup scan, which takes cache errors, and stopped the process; a token handed back
    again would have listed for ever)."""
    token: str | None = None
    while True:
        kwargs: dict[str, object] = {"Bucket": bucket, "Prefix": prefix}
        if token is not None:
            kwargs["ContinuationToken"] = token
        page = client.list_objects_v2(**kwargs)
        contents = page.get("Contents", [])
        if not isinstance(contents, list):
            raise CacheFormatError(f"{bucket}: a listing's Contents is not a list")
        for item in contents:
            key = item.get("Key") if isinstance(item, Mapping) else None
            size = item.get("Size", 0) if isinstance(item, Mapping) else None
            if not isinstance(key, str) or not isinstance(size, int):
                raise CacheFormatError(f"{bucket}: a listing's entry has no name or size")
            stamp = item.get("LastModified")
            # No stamp (a store that omits it): as young as can be, so it is never swept.
            mtime = stamp.timestamp() if hasattr(stamp, "timestamp") else float("inf")
            yield key, size, mtime
        if not page.get("IsTruncated"):
            return
        following = page.get("NextContinuationToken")
        if not isinstance(following, str) or not following or following == token:
            raise CacheFormatError(
                f"{bucket}: a listing said to go on has no new continuation token"
            )
        token = following
