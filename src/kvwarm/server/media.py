"""Images and audio in requests: the wire formats' parts as the engine's content parts, and the
one place the server may fetch an image.

Invariants:

- Every chat-shaped API's media become the same engine parts (``image``: a data: URI or the
  bytes; ``input_audio``), each carrying the path of the part as the client sent it, which a
  ``MediaError`` about it names (``engine/prompts.py`` decodes them under the limits).
- A local server fetches nothing a web page asks for: an ``http(s)`` image URL is a 400 unless
  its host is listed in ``media_fetch_hosts``; a listed one is fetched once, without redirects,
  within ``media_max_bytes`` and a timeout, and goes on as bytes. Nothing else is fetched
  (``file:`` and every other scheme are refused).
"""

from __future__ import annotations

import base64
import http.client
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.concurrency import run_in_threadpool

from kvwarm.media import MediaError
from kvwarm.server.errors import HTTPError
from kvwarm.server.schemas import ChatMessage, ContentPart, ImageUrl
from kvwarm.settings import Settings

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 10.0

Part = dict[str, object]


def has_media(part: ContentPart) -> bool:
    return part.type in ("image_url", "input_audio", "image", "audio")


def engine_parts(parts: Sequence[ContentPart], where: str) -> str | list[Part]:
    """A content list as the engine takes it: its text joined when it holds no media, else
    one engine part per part, each naming where the client put it."""
    if not any(has_media(p) for p in parts):
        out: list[str] = []
        for j, part in enumerate(parts):
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
            items.append({"type": "text", "text": part.text or ""})
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


async def fetch_images(messages: Sequence[ChatMessage], settings: Settings) -> list[ChatMessage]:
    """``messages`` with each image given by an http(s) URL fetched (its host must be in
    ``media_fetch_hosts``) and put in as a data: URI; 400 for any other URL."""
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[ContentPart] = []
        changed = False
        for j, part in enumerate(content):
            url = (
                part.image_url
                if isinstance(part.image_url, str)
                else (part.image_url.url if part.image_url is not None else None)
            )
            if part.type != "image_url" or url is None or url.startswith("data:"):
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


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a redirect is the answer, never followed to another host


def _fetch(url: str, where: str, settings: Settings) -> bytes:
    split = urlsplit(url)
    if split.scheme not in ("http", "https"):
        raise HTTPError(
            400,
            f"{where}: an image is a base64 data: URI (or an http(s) URL from a host the "
            "server's media_fetch_hosts lists), not a {split.scheme or 'bare'} URL",
            param=where,
            code="unsupported_content",
        )
    host = (split.hostname or "").lower()
    allowed = {h.lower() for h in settings.media_fetch_hosts}
    if not host or (host not in allowed and "*" not in allowed):
        raise HTTPError(
            400,
            f"{where}: this server does not fetch images from {host or url!r}: send the image "
            "as a base64 data: URI, or list the host in media_fetch_hosts",
            param=where,
            code="media_fetch_refused",
        )
    limit = settings.media_max_bytes
    opener = urllib.request.build_opener(_NoRedirects)
    request = urllib.request.Request(url, headers={"User-Agent": "kvwarm"})
    # FETCH_TIMEOUT_S bounds the whole fetch, not only each read: a host trickling its bytes
    # never trips a read's timeout. (The last read may take up to that long once more.)
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    try:
        with opener.open(request, timeout=FETCH_TIMEOUT_S) as response:
            if response.status != 200:
                raise MediaError(f"{where}: {url} answered {response.status}", param=where)
            announced = response.length
            if announced is not None and announced > limit:
                raise MediaError(
                    f"{where}: {url} is over {limit} bytes (setting media_max_bytes)",
                    param=where,
                )
            parts: list[bytes] = []
            got = 0
            while got <= limit:
                if time.monotonic() > deadline:
                    raise MediaError(
                        f"{where}: {url} took longer than {FETCH_TIMEOUT_S:g} s to send the image",
                        param=where,
                    )
                part = response.read1(min(1 << 16, limit + 1 - got))
                if not part:
                    break
                parts.append(part)
                got += len(part)
            if announced is not None and got < announced <= limit:
                raise MediaError(
                    f"{where}: cannot fetch {url}: it sent {got} of the {announced} bytes "
                    "it announced",
                    param=where,
                )
            data = b"".join(parts)
    except urllib.error.HTTPError as exc:
        raise MediaError(f"{where}: {url} answered {exc.code}", param=where) from exc
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        # HTTPException: a response cut short (IncompleteRead), a malformed one, a URL
        # http.client cannot parse (InvalidURL): none of them an OSError.
        why = str(exc) or repr(exc)
        raise MediaError(f"{where}: cannot fetch {url}: {why}", param=where) from exc
    if len(data) > limit:
        raise MediaError(
            f"{where}: {url} is over {limit} bytes (setting media_max_bytes)", param=where
        )
    log.info("fetched an image of %d bytes from %s", len(data), host)
    return data
