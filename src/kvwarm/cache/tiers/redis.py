"""The ``redis`` store: rows and chunks as Redis strings, under the generic ``ObjectTier``
(``tiers/objects.py``), which owns the publish protocol, probes, scans and chunk rules. A
shared, in-memory tier across hosts (what LMCache users know as its Redis backend).

Configured by URL: ``redis://[user:password@]host:port/db?prefix=kvwarm/&timeout_s=2&down_for_s=5``
(and ``min_bytes_per_s``, ``packs``).

Invariants:
- Object ``name`` is the string ``<prefix>o:<name>``; its metadata (creation time ``t``, hit
  fields) the hash ``<prefix>m:<name>``. ``SET NX`` makes a put visible whole or not at all;
  the same script replaces the hash with one stamped by the server's clock (``TIME``), so a
  hash left by an object redis evicted never ages the new one; ``touch`` restamps it.
- Reads run as a script or a plain pipeline, never in ``MULTI``: over ``maxmemory`` redis
  refuses every command queued in a transaction, and a full redis must still serve reads.
- Every call is bounded by the socket timeouts, and a reply by the speed floor
  (``min_bytes_per_s`` averaged over ``timeout_s``, ``objects.Pace``: redis-py's timeout bounds
  each socket read, not a reply, and a reply a few bytes at a time held its caller as long as
  it lasted); a connection fault, timeout or reply under the floor is
  ``CacheNetworkError`` and trips the remote stores' ``objects.Breaker`` (down for
  ``down_for_s``); any other refusal is ``CacheIOError``. Credentials the server refuses
  (``WRONGPASS``, ``NOAUTH``: redis-py's ``AuthenticationError``, a ``ConnectionError``) or a
  command the user may not run (``NOPERM``) are a refusal, as s3's 403 is: ``CacheIOError``,
  logged as an ERROR once until a call succeeds, never a trip of the breaker (the network is
  fine; waiting will not fix a password).
- The ``redis`` package is imported only when a tier is built (the ``kvwarm[redis]`` extra).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvwarm.cache.tiers.objects import Breaker, Got, Pace
from kvwarm.cache.tiers.registry import shown_url, url_switch
from kvwarm.cache.types import DEFAULT_MIN_BYTES_PER_S
from kvwarm.errors import (
    CacheFormatError,
    CacheIOError,
    CacheKeyError,
    CacheNetworkError,
    ConfigError,
)

if TYPE_CHECKING:
    import redis as redis_client

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_OURS = ("prefix", "timeout_s", "down_for_s", "packs", "min_bytes_per_s")
# Set the hit fields only while the object exists (a deleted row must not grow a hash back).
_SET_META = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV))
return 1
"""
# A read, atomic without MULTI: redis refuses every command queued in a transaction while it
# is over ``maxmemory`` (noeviction, or a volatile-* policy with no TTL to evict), which made
# a full redis refuse all reads; a script that writes nothing still runs then. ARGV[1]: the
# last byte wanted, or empty for all. Nil if the object is gone.
_GET = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local data
if ARGV[1] == '' then
  data = redis.call('GET', KEYS[1])
else
  data = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1]))
end
return {data, redis.call('STRLEN', KEYS[1]), redis.call('HGETALL', KEYS[2])}
"""
# The server's clock, as seconds: one clock for every writer, whatever their hosts' skew.
_NOW = """
local function now()
  local t = redis.call('TIME')
  return t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
end
"""
# Create the object if absent, with a fresh metadata hash stamped now: a hash left behind by
# an object redis evicted (maxmemory) must not lend its old stamp (nor hits) to the new one.
_PUT = (
    _NOW
    + """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 't', now())
return 1
"""
)
# Restamp an object that exists (a chunk a save reuses).
_TOUCH = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], 't', now())
return 1
"""
)


class RedisStore:
    """Objects in one Redis database under one key prefix. Thread-safe (the client pools
    connections)."""

    def __init__(self, url: str) -> None:
        try:
            import redis as redis_client
        except ImportError:
            need = "the redis tier needs the redis client: pip install 'kvwarm[redis]'"
            raise ConfigError(need) from None
        shown = shown_url(url)  # never the password, in any message
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigError(f"a redis tier URL starts with redis:// or rediss://, got {shown!r}")
        ours = {k: v for k, v in parse_qsl(parts.query) if k in _OURS}
        rest = [(k, v) for k, v in parse_qsl(parts.query) if k not in _OURS]
        self._prefix = ours.get("prefix", "kvwarm/")
        # False: saves write each chunk as its own object (TierCapabilities.pack_writes)
        self.packs = url_switch(ours, "packs", f"redis tier URL {shown!r}", default=True)
        try:
            timeout = float(ours.get("timeout_s", "2"))
            self._down_for_s = float(ours.get("down_for_s", "5"))
            floor = int(ours.get("min_bytes_per_s", str(DEFAULT_MIN_BYTES_PER_S)))
        except ValueError as exc:
            raise ConfigError(f"redis tier URL {shown!r}: {exc}") from None
        if floor < 0:
            raise ConfigError(f"redis tier URL {shown!r}: min_bytes_per_s must be >= 0")
        # nan passes both comparisons (a socket refuses it on connect); inf down_for_s would
        # skip the store for good after one fault.
        finite = math.isfinite(timeout) and math.isfinite(self._down_for_s)
        if not finite or timeout <= 0 or self._down_for_s < 0:
            raise ConfigError(
                f"redis tier URL {shown!r}: timeout_s must be finite and > 0, down_for_s "
                "finite and >= 0"
            )
        if any(k == "decode_responses" for k, _ in rest):
            # redis-py hands unknown URL options to the client as strings: any value would
            # decode every reply to text, and every get would fail on it.
            raise ConfigError(f"redis tier URL {shown!r}: decode_responses is not an option here")
        plain = urlunsplit(parts._replace(query=urlencode(rest)))
        try:
            port = parts.port or 6379
        except ValueError as exc:  # urllib's message quotes only the port
            raise ConfigError(f"redis tier URL {shown!r}: {exc}") from None
        self._label = f"{parts.scheme}://{parts.hostname}:{port}{parts.path}"
        try:
            self._client: redis_client.Redis = redis_client.Redis.from_url(
                plain, socket_timeout=timeout, socket_connect_timeout=timeout
            )
        except ValueError:  # e.g. a bad db number; redis's message may quote the whole URL
            raise ConfigError(f"redis tier URL {shown!r}: the client refused it") from None
        pool = self._client.connection_pool
        pool.connection_class = _paced(pool.connection_class, floor, timeout)
        self._errors = redis_client.exceptions
        self._set_meta = self._client.register_script(_SET_META)
        self._put = self._client.register_script(_PUT)
        self._get = self._client.register_script(_GET)
        self._touch = self._client.register_script(_TOUCH)
        self._breaker = Breaker(self.label, self._down_for_s)
        self._refusal_logged = False  # an auth refusal logged since the last call that worked

    @property
    def label(self) -> str:
        return f"{self._label} ({self._prefix})"

    @property
    def client(self) -> redis_client.Redis:
        return self._client

    def _obj(self, name: str) -> str:
        return f"{self._prefix}o:{name}"

    def _meta(self, name: str) -> str:
        return f"{self._prefix}m:{name}"

    def location(self, name: str) -> str:
        return f"{self._label}/{self._obj(name)}"

    # ---- calls, translated once ----------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        self._breaker.check()
        try:
            result = self._translated(what, fn)
        except CacheNetworkError as err:
            self._breaker.trip(err)
            raise
        except BaseException:
            self._breaker.answered()  # a refusal or an error reply is an answer: it is up
            raise
        self._breaker.answered()
        self._refusal_logged = False
        return result

    def _translated(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, redis-py's errors as ours."""
        try:
            return fn()
        except CacheNetworkError as exc:  # a reply under the speed floor (``_PacedSocket``)
            raise CacheNetworkError(f"{self.label}: {what}: {exc}") from exc
        except (
            # Before ConnectionError: redis-py makes a refused AUTH one of those.
            self._errors.AuthenticationError,
            self._errors.AuthorizationError,
            self._errors.AuthenticationWrongNumberOfArgsError,
            self._errors.NoPermissionError,
        ) as exc:
            raise self._refused(what, exc) from exc
        except (self._errors.ConnectionError, self._errors.TimeoutError, OSError) as exc:
            raise CacheNetworkError(f"{self.label}: {what}: {type(exc).__name__}: {exc}") from exc
        except self._errors.ResponseError as exc:
            # Another client's value of another type under one of our names (alone, or in a
            # pipeline's "Command # 2 ... caused error: WRONGTYPE ..."): junk, like an unreadable
            # file (a publish replaces it), not a store failure.
            if "WRONGTYPE" in str(exc):
                raise CacheFormatError(f"{self.label}: {what}: not a string: {exc}") from exc
            raise CacheIOError(f"{self.label}: {what}: {type(exc).__name__}: {exc}") from exc
        except self._errors.RedisError as exc:
            raise CacheIOError(f"{self.label}: {what}: {type(exc).__name__}: {exc}") from exc

    def _refused(self, what: str, exc: Exception) -> CacheIOError:
        """The server refused our credentials or a command to our user: a configuration
        error of the tier URL (or of the server's ACL), reported as a refusal."""
        name = type(exc).__name__
        if isinstance(exc, self._errors.NoPermissionError | self._errors.AuthorizationError):
            why = "the server does not let this user run it (check the user's ACL)"
        else:
            why = "the server refused our credentials (check the user and password in the URL)"
        err = CacheIOError(f"{self.label}: {what}: {why}: {name}: {exc}")
        if not self._refusal_logged:
            self._refusal_logged = True
            log.error("%s; the tier answers nothing until this is fixed", err)
        return err

    # ---- ObjectStore ---------------------------------------------------------------------

    def put_if_absent(self, name: str, body: bytes) -> bool:
        keys = [self._obj(name), self._meta(name)]
        return bool(self._call(f"put {name}", lambda: self._put(keys=keys, args=[body])))

    def touch(self, name: str) -> bool:
        keys = [self._obj(name), self._meta(name)]
        return bool(self._call(f"touch {name}", lambda: self._touch(keys=keys)))

    def age(self, name: str) -> float | None:
        def age() -> float | None:
            pipe = self._client.pipeline(transaction=False)  # reads: allowed when full
            pipe.exists(self._obj(name))
            pipe.hget(self._meta(name), "t")
            exists, stamp = pipe.execute()
            return _stamp(stamp) if exists else None

        return self._call(f"age {name}", age)

    def get(self, name: str, end: int | None = None) -> Got:
        keys = [self._obj(name), self._meta(name)]
        last = "" if end is None else str(end - 1)
        found: object = self._call(f"get {name}", lambda: self._get(keys=keys, args=[last]))
        if found is None:
            raise CacheKeyError(f"{self.label}: no object {name}")
        assert isinstance(found, list) and len(found) == 3
        data, size, flat = found
        meta = dict(zip(flat[::2], flat[1::2], strict=True))
        return Got(bytes(data or b""), int(size), _decoded(meta))

    def get_range(self, name: str, start: int, end: int) -> bytes:
        obj = self._obj(name)
        data: object = self._call(f"get {name}", lambda: self._client.getrange(obj, start, end - 1))
        assert isinstance(data, bytes)  # the client does not decode responses
        return data

    def names(self, prefix: str) -> list[str]:
        base = self._obj("")
        return [key[len(base) :] for key in self._call("list", lambda: self._keys(prefix))]

    def _keys(self, prefix: str) -> list[str]:
        pattern = _glob_escape(self._obj(prefix)) + "*"
        names = []
        for raw in self._client.scan_iter(match=pattern, count=1000):
            try:
                names.append(bytes(raw).decode())
            except UnicodeDecodeError:
                continue  # another client's binary key: no name this cache writes
        return names

    def list(self, prefix: str) -> list[tuple[str, int, float]]:
        base = self._obj("")

        def scan() -> list[tuple[str, int, float]]:
            keys = self._keys(prefix)
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                name = key[len(base) :]
                pipe.strlen(key)
                pipe.hget(self._meta(name), "t")
            # One answer per command, an error in place (another client's hash under one of
            # our names): that key is skipped, not the whole listing.
            answers: list[Any] = pipe.execute(raise_on_error=False) if keys else []
            out = []
            for i, key in enumerate(keys):
                size, stamp = answers[2 * i], answers[2 * i + 1]
                if not isinstance(size, int):
                    continue  # not a string: junk, not an object of ours
                out.append((key[len(base) :], size, _stamp(stamp)))
            return out

        return self._call("list", scan)

    def delete(self, name: str) -> None:
        self._call(f"delete {name}", lambda: self._client.delete(self._obj(name), self._meta(name)))

    def set_meta(self, name: str, meta: Mapping[str, str]) -> None:
        args = [x for kv in meta.items() for x in kv]
        done = self._call(
            f"set metadata {name}",
            lambda: self._set_meta(keys=[self._obj(name), self._meta(name)], args=args),
        )
        if not done:
            raise CacheKeyError(f"{self.label}: no object {name}")

    def close(self) -> None:
        self._client.close()


class _PacedSocket:
    """A redis connection's socket whose replies are held to the speed floor: the pace
    restarts as each command is sent and counts a reply's bytes as they come. A reply under
    the floor raises ``TransferTooSlowError`` out of the read, and redis-py disconnects the
    connection (it does so for any error in a read), so no half-read reply is left on it.
    Sends are not paced: Python bounds a ``sendall`` as a whole by the socket timeout, and
    redis-py sends a value in one. Anything else is the socket's."""

    def __init__(self, sock: Any, pace: Pace) -> None:
        self._sock = sock
        self._pace = pace

    def sendall(self, data: Any, *args: Any) -> None:
        self._sock.sendall(data, *args)
        self._pace.restart()

    def recv(self, size: int, *args: Any) -> bytes:
        data: bytes = self._sock.recv(size, *args)
        if data:
            self._pace.moved(len(data))
        return data

    def recv_into(self, buffer: Any, *args: Any) -> int:
        n: int = self._sock.recv_into(buffer, *args)
        if n:
            self._pace.moved(n)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _paced(base: type[Any], min_bytes_per_s: int, window_s: float) -> type[Any]:
    """``base`` (the connection class redis-py chose for the URL: plain, TLS) with its
    sockets paced (``_PacedSocket``), a fresh pace each connection."""

    def _connect(self: Any) -> Any:
        return _PacedSocket(base._connect(self), Pace(min_bytes_per_s, window_s))

    return type(f"Paced{base.__name__}", (base,), {"_connect": _connect})


def _decoded(meta: Mapping[bytes, bytes]) -> dict[str, str]:
    """The hit fields as text; a field another client wrote that is not UTF-8 is dropped
    (hit counts are a hint: a row is never refused for its metadata)."""
    out = {}
    for k, v in meta.items():
        try:
            name, value = bytes(k).decode(), bytes(v).decode()
        except UnicodeDecodeError:
            continue
        if name != "t":
            out[name] = value
    return out


def _stamp(stamp: object) -> float:
    """A creation time from the metadata hash; none, or not a number (written by hand, or an
    error in its place): as young as can be, so it is never swept."""
    try:
        return float(stamp) if isinstance(stamp, (bytes, str)) else float("inf")
    except ValueError:
        return float("inf")


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
