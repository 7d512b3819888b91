"""Images and audio in requests: the wire formats' parts as the engine's content parts, and the
one place the server may fetch an image.

Invariants:

- Every chat-shaped API's media become the same engine parts (``image``: a data: URI or the
  bytes; ``input_audio``), each carrying the path of the part as the client sent it, which a
  ``MediaError`` about it names (``engine/prompts.py`` decodes them under the limits).
- A local server fetches nothing a web page asks for: an ``http(s)`` image URL is a 400 unless
  its host and port are allowed by ``media_fetch_hosts``: a listed host (on 80/443, or the
  port its entry names) wherever it resolves, or under ``*`` any host on 80/443 whose every
  address is public (no loopback, private, link-local, cloud metadata..., nor an IPv6 form
  carrying one). The socket goes to an address that was checked (no second DNS lookup to
  rebind), with the URL's host in ``Host`` and TLS's server name. An allowed URL is fetched
  once, without redirects, within ``media_max_bytes`` and one deadline (``FETCH_TIMEOUT_S``,
  from the name's lookup to the last byte), and goes on as bytes.
  Nothing else is fetched (``file:`` and every other scheme are refused), and no environment
  proxy is used (the check must be of the address connected to). A request's media are
  counted before any of its URLs is fetched: past ``media_max_items`` nothing is.
- A fetch that fails tells the client only that (``invalid_media``, "could not fetch the
  image at <url>"); why (refused connection, timeout, status, what a name resolved to) is
  logged, so a client cannot map the server's network through error messages.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import ipaddress
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from urllib.parse import urlsplit

from starlette.concurrency import run_in_threadpool

from kvwarm.media import MediaError, too_many
from kvwarm.server.errors import HTTPError
from kvwarm.server.schemas import ChatMessage, ContentPart, ImageUrl
from kvwarm.settings import Settings

log = logging.getLogger(__name__)

#: A fetch's whole deadline: the name's lookup, connecting, the request and every read.
FETCH_TIMEOUT_S = 10.0
#: Name lookups running at once. Each runs on a daemon thread of its own, waited for until
#: the fetch's deadline: ``getaddrinfo`` cannot be cancelled, so a lookup a slow resolver
#: holds outlives the fetch that gave up on it (until the resolver's own timeout), and this
#: bounds how many such threads clients can pile up.
RESOLVE_THREADS = 16
_resolving = threading.BoundedSemaphore(RESOLVE_THREADS)

Part = dict[str, object]


def has_media(part: ContentPart) -> bool:
    return part.type in ("image_url", "input_audio", "image", "audio")


def _refusal_as_text(part: ContentPart) -> ContentPart:
    if part.type != "refusal" or part.refusal is None:
        return part
    text = ContentPart(type="text", text=part.refusal)
    text._where = part._where
    return text


def engine_parts(parts: Sequence[ContentPart], where: str) -> str | list[Part]:
    """A content list as the engine takes it: its text joined when it holds no media, else
    one engine part per part, each naming where the client put it. An assistant's ``refusal``
    part (OpenAI's assistant content holds text and refusal parts) is the text it said."""
    parts = [_refusal_as_text(p) for p in parts]
    if not any(has_media(p) for p in parts):
        out: list[str] = []
        for j, part in enumerate(parts):
            if part.type == "text" and part.text is None:
                raise _no_text(part._where or f"{where}.{j}")
            if part.type != "text" or part.text is None:
                raise HTTPError(
                    400,
                    f"content part of type {part.type!r} is not supported (text, image_url "
                    "or input_audio)",
                    code="unsupported_content",
                    param=part._where or f"{where}.{j}",
                )
            out.append(part.text)
        return "".join(out)
    items: list[Part] = []
    for j, part in enumerate(parts):
        at = part._where or f"{where}.{j}"
        if part.type == "text":
            if part.text is None:
                raise _no_text(at)
            items.append({"type": "text", "text": part.text})
        elif part.type == "image_url":
            url = (
                part.image_url.url
                if part.image_url is not None and not isinstance(part.image_url, str)
                else part.image_url
            )
            if not isinstance(url, str) or not url:
                raise HTTPError(
                    400,
                    f"{at}: an image_url part needs image_url.url",
                    param=at,
                    code="invalid_value",
                )
            items.append({"type": "image", "image": url, "param": at})
        elif part.type == "input_audio":
            if part.input_audio is None:
                raise HTTPError(
                    400,
                    f"{at}: an input_audio part needs input_audio",
                    param=at,
                    code="invalid_value",
                )
            data = part.input_audio.data
            if not data.startswith("data:"):
                # The bytes decide what the clip is (kvwarm.media): a format a data: URI
                # cannot carry ("mp3 ") is left out of it, never a "not a data: URI" 400.
                fmt = part.input_audio.format or "wav"
                fmt = fmt if re.fullmatch(r"[\w.+-]+", fmt) else "wav"
                data = f"data:audio/{fmt};base64,{data}"
            items.append({"type": "audio", "audio": data, "param": at})
        else:
            raise HTTPError(
                400,
                f"content part of type {part.type!r} is not supported (text, image_url or "
                "input_audio)",
                code="unsupported_content",
                param=at,
            )
    return items


def _no_text(at: str) -> HTTPError:
    """A ``text`` part without its ``text`` (found by review: its 400 said parts of type
    'text' were not supported)."""
    return HTTPError(400, f"{at}: a text part needs text", param=at, code="invalid_value")


def _url_of(part: ContentPart) -> str | None:
    """The URL of an ``image_url`` part that is not a data: URI (None for any other part)."""
    url = (
        part.image_url
        if isinstance(part.image_url, str)
        else (part.image_url.url if part.image_url is not None else None)
    )
    if part.type != "image_url" or url is None or url.startswith("data:"):
        return None
    return url


def _check_count(messages: Sequence[ChatMessage], limit: int) -> None:
    """400 for a request holding more than ``limit`` media (``media_max_items``), counted as
    the engine counts them, naming the first part past it: checked before anything is
    fetched. Found by review: every URL was fetched first (each up to ``media_max_bytes``,
    held as base64), and only the engine refused the request past its eighth image, so one
    body of thousands of URLs had the server fetch them all."""
    count = 0
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if has_media(part):
                if count >= limit:
                    raise too_many(part._where or f"messages.{i}.content.{j}", limit)
                count += 1


async def fetch_images(messages: Sequence[ChatMessage], settings: Settings) -> list[ChatMessage]:
    """``messages`` with each image given by an http(s) URL fetched (``media_fetch_hosts``
    must allow it, ``_target``) and put in as a data: URI; 400 for any other URL, and for
    more media than ``media_max_items`` before any is fetched."""
    if any(
        _url_of(part) is not None
        for message in messages
        if isinstance(message.content, list)
        for part in message.content
    ):
        _check_count(messages, settings.media_max_items)
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[ContentPart] = []
        changed = False
        for j, part in enumerate(content):
            url = _url_of(part)
            if url is None:
                parts.append(part)
                continue
            at = part._where or f"messages.{i}.content.{j}"
            data = await run_in_threadpool(_fetch, url, at, settings)
            uri = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
            fetched = ContentPart(type="image_url", image_url=ImageUrl(url=uri))
            fetched._where = at
            parts.append(fetched)
            changed = True
        out.append(message.model_copy(update={"content": parts}) if changed else message)
    return out


#: The ports a host may be fetched on when its ``media_fetch_hosts`` entry names none.
WEB_PORTS = frozenset({80, 443})
#: NAT64's well-known prefix (RFC 6052): its last 32 bits are the IPv4 address reached.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _refused(where: str, message: str) -> HTTPError:
    return HTTPError(400, f"{where}: {message}", param=where, code="media_fetch_refused")


class _FetchError(Exception):
    """Why a fetch failed, for the log only: the client is told no more than that it did
    (a message saying "connection refused" or "timed out" lets a client map ports)."""


def _unsafe_reason(address: str) -> str | None:
    """Why a ``*`` fetch must not connect to ``address`` (None: a public address). IPv6 forms
    that carry an IPv4 address (mapped, NAT64, 6to4) are judged by that address."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(
        address.split("%", 1)[0]
    )
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:
            why = _unsafe_reason(str(inner))
            return None if why is None else f"{why} (carried in {ip})"
    for name in (
        "loopback", "link_local", "private", "multicast", "reserved", "unspecified",
        "site_local",
    ):  # fmt: skip
        if getattr(ip, f"is_{name}", False):
            return f"{ip} is a {name.replace('_', '-')} address"
    if not ip.is_global:
        return f"{ip} is not a public address"
    return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _resolve(host: str, port: int) -> list[tuple[int, str]]:
    """(family, address) of every address ``host`` resolves to, for TCP (tests replace it)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [(family, str(sockaddr[0])) for family, _, _, _, sockaddr in found]


def _resolve_by(host: str, port: int, deadline: float) -> list[tuple[int, str]]:
    """``_resolve`` on a thread of its own, waited for until ``deadline``
    (``time.monotonic``): the system resolver's own timeouts (seconds a try, a few tries a
    nameserver) are not the fetch's. A lookup that cannot start or end in time, or fails, is
    a ``_FetchError``."""
    left = deadline - time.monotonic()
    if left <= 0 or not _resolving.acquire(timeout=left):
        raise _FetchError(f"cannot resolve {host}: {RESOLVE_THREADS} lookups still running")
    found: Future[list[tuple[int, str]]] = Future()

    def lookup() -> None:
        try:
            found.set_result(_resolve(host, port))
        except BaseException as exc:  # handed to the waiter, whatever it is
            found.set_exception(exc)
        finally:
            _resolving.release()

    try:
        threading.Thread(target=lookup, name="kvwarm-media-resolve", daemon=True).start()
    except BaseException:
        _resolving.release()
        raise
    try:
        return found.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise _FetchError(f"cannot resolve {host} in {FETCH_TIMEOUT_S:g} s") from None
    except (OSError, UnicodeError) as exc:
        raise _FetchError(f"cannot resolve {host}: {exc}") from exc


class _Cutoff:
    """Cuts a fetch's connection at its deadline (``time.monotonic``), whatever it is blocked
    in. A socket's timeout bounds each read, not a response: found by review, a host sending
    its status line and headers (or a chunked body's size lines) a byte every few seconds held
    ``getresponse`` (and a thread of the server's pool) for as long as it liked, past the
    10 s the docs promise. The connection's socket is shut down at the deadline (through a
    duplicate, so TLS's wrapping of it does not matter): every read blocked on it ends."""

    def __init__(self, deadline: float) -> None:
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self.expired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            if self._socket is not None:
                with contextlib.suppress(OSError):
                    self._socket.shutdown(socket.SHUT_RDWR)

    def watch(self, sock: socket.socket) -> None:
        """Cut ``sock`` at the deadline (at once if it has passed)."""
        with self._lock:
            if self.expired:
                sock.close()
                raise TimeoutError("the fetch's deadline passed while connecting")
            self._socket = sock.dup()

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None


def _connector(
    addresses: Sequence[str], deadline: float, cutoff: _Cutoff | None = None
) -> Callable[..., socket.socket]:
    """``http.client``'s ``_create_connection`` for addresses already checked: the socket goes
    to one of them whatever the name resolves to by now (no second lookup a rebinding DNS
    server could answer differently), while the Host header and TLS's server name stay the
    URL's host. All the tries end by ``deadline`` (``time.monotonic``); the socket made is
    handed to ``cutoff`` to be cut there."""

    def connect(
        address: tuple[str, int], timeout: float | None = None, source: object = None
    ) -> socket.socket:
        error: OSError | None = None
        for ip in addresses:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                sock = socket.create_connection((ip, address[1]), min(left, timeout or left))
            except OSError as exc:
                error = exc
                continue
            if cutoff is not None:
                cutoff.watch(sock)
            return sock
        raise error or TimeoutError(f"no connection to {address[0]} in time")

    return connect


def _target(
    url: str, where: str, settings: Settings, deadline: float
) -> tuple[str, int, list[str]]:
    """(host, port, addresses to connect to) of an allowed URL, else the 400 that refuses it.
    The name is looked up by ``deadline`` (``_resolve_by``).
    A host:port ``media_fetch_hosts`` lists (a bare host: on 80 or 443) is the operator's
    choice, connected to wherever it resolves; under ``*``, any other host on 80 or 443 is
    fetched only if every address it resolves to is public."""
    try:
        split = urlsplit(url)
    except ValueError:  # "http://[::1/": an IPv6 host not closed
        raise _refused(where, f"{url!r} is not a valid URL") from None
    if split.scheme not in ("http", "https"):
        raise HTTPError(
            400,
            f"{where}: an image is a base64 data: URI (or an http(s) URL from a host the "
            f"server's media_fetch_hosts lists), not a {split.scheme or 'bare'} URL",
            param=where,
            code="unsupported_content",
        )
    host = (split.hostname or "").lower()
    try:
        given = split.port  # ":0" is port 0, never the scheme's default
    except ValueError:
        raise _refused(where, f"{url!r} has no valid port") from None
    port = given if given is not None else 443 if split.scheme == "https" else 80
    rules = settings.media_fetch_rules()
    if not host:
        raise _refused(where, f"{url!r} names no host")
    listed = any(h == host and (port == p if p else port in WEB_PORTS) for h, p in rules)
    anywhere = any(h == "*" and (port == p if p else port in WEB_PORTS) for h, p in rules)
    if not listed and not anywhere:
        known = any(h in (host, "*") for h, _ in rules)
        raise _refused(
            where,
            f"this server does not fetch images from {host!r}"
            + (f" on port {port}" if known else "")
            + ": send the image as a base64 data: URI, or list the host (host:port for a port "
            "other than 80 or 443) in media_fetch_hosts",
        )
    literal_refused = None if listed or not _is_ip(host) else _unsafe_reason(host)
    if literal_refused is not None:
        # The URL as the client sent it, quoted (%r): found by review, its CR and LF, which
        # urlsplit drops before it parses, started lines of the client's own in the log.
        log.warning("refused to fetch an image from %r: %s", _logged(url), literal_refused)
        raise _refused(where, f"this server does not fetch images from {host!r}: not public")
    found = _resolve_by(host, port, deadline)
    addresses = [address for _, address in found]
    if not addresses:
        raise _FetchError(f"{host} resolves to no address")
    if not listed:
        for address in addresses:
            refused = _unsafe_reason(address)
            if refused is not None:
                # Not told to the client: what a name resolves to is the server's network's.
                log.warning(
                    "refused to fetch an image from %r: %s resolves to %s",
                    _logged(url),
                    host,
                    refused,
                )
                raise _FetchError(f"{host} resolves to a non-public address")
    return host, port, addresses


def _logged(url: str) -> str:
    """``url`` as the log shows it: its query and fragment as ``?…`` and its user part left
    out (found by review: a presigned URL's signature, a credential for as long as it lasts,
    went to the log whole when its fetch failed). The client gets its URL back as it sent it."""
    split = urlsplit(url)
    netloc = split.netloc.rpartition("@")[2]
    hidden = "?…" if split.query or split.fragment else ""
    return f"{split.scheme}://{netloc}{split.path}{hidden}"


def _fetch(url: str, where: str, settings: Settings) -> bytes:
    """The image at ``url`` (``_target`` decides whether it may be fetched), fetched once,
    without redirects, within ``media_max_bytes`` and ``FETCH_TIMEOUT_S`` (one deadline for
    the name's lookup, connecting and reading). A failure is a 400 ``invalid_media`` saying
    only that it could not be fetched; why goes to the log."""
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    try:
        host, port, addresses = _target(url, where, settings, deadline)
        data = _get(url, host, port, addresses, settings.media_max_bytes, deadline)
    except _FetchError as exc:
        log.info("could not fetch the image at %r: %s", _logged(url), exc)
        raise MediaError(f"{where}: could not fetch the image at {url}", param=where) from None
    log.info("fetched an image of %d bytes from %s", len(data), host)
    return data


def _get(
    url: str, host: str, port: int, addresses: Sequence[str], limit: int, deadline: float
) -> bytes:
    split = urlsplit(url)
    connection: http.client.HTTPConnection
    if split.scheme == "https":
        context = ssl.create_default_context()
        connection = http.client.HTTPSConnection(
            host, port, timeout=FETCH_TIMEOUT_S, context=context
        )
    else:
        connection = http.client.HTTPConnection(host, port, timeout=FETCH_TIMEOUT_S)
    # The deadline bounds the whole fetch (the name's lookup and connecting included), not
    # only each read: a host trickling its bytes never trips a read's timeout, so the
    # connection is cut at the deadline (_Cutoff), wherever http.client is reading.
    cutoff = _Cutoff(deadline)
    connection._create_connection = _connector(addresses, deadline, cutoff)  # type: ignore[attr-defined]
    target = split.path or "/"
    if split.query:
        target += "?" + split.query
    try:
        # One request, its answer taken as it is: a redirect is never followed.
        connection.request("GET", target, headers={"User-Agent": "kvwarm"})
        response = connection.getresponse()
        if response.status != 200:
            raise _FetchError(f"it answered {response.status}")
        announced = response.length
        if announced is not None and announced > limit:
            raise _FetchError(f"it announced {announced} bytes, over media_max_bytes ({limit})")
        parts: list[bytes] = []
        got = 0
        while got <= limit:
            if time.monotonic() > deadline:
                raise _FetchError(f"it took longer than {FETCH_TIMEOUT_S:g} s")
            part = response.read1(min(1 << 16, limit + 1 - got))
            if not part:
                break
            parts.append(part)
            got += len(part)
        if cutoff.expired:  # its reads ended as the deadline cut them: not the file's end
            raise _FetchError(f"it took longer than {FETCH_TIMEOUT_S:g} s")
        if announced is not None and got < announced <= limit:
            raise _FetchError(f"it sent {got} of the {announced} bytes it announced")
        if got > limit:
            raise _FetchError(f"it is over media_max_bytes ({limit})")
        return b"".join(parts)
    except (http.client.HTTPException, OSError, ValueError) as exc:
        # HTTPException: a response cut short (IncompleteRead) or malformed: no OSError.
        if cutoff.expired:
            raise _FetchError(f"it took longer than {FETCH_TIMEOUT_S:g} s") from exc
        raise _FetchError(str(exc) or repr(exc)) from exc
    finally:
        cutoff.close()
        connection.close()
