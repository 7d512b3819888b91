"""Images in chat requests on the stub backend: every chat-shaped API, the limits, the URL
rule (docs/server.md, "Images and audio")."""

from __future__ import annotations

import base64
import http.server
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tests.engine.mediakit import png
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.errors import ConfigError
from kvwarm.media import MediaError
from kvwarm.server import create_app, media
from kvwarm.server.errors import HTTPError
from kvwarm.settings import ModelSpec, Settings

MMPROJ = (("mmproj", Path("stub-audio-mmproj.gguf")),)  # reads images and audio


def data_uri(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def chat_body(image_url: str, question: str = "What is it?") -> dict[str, object]:
    return {
        "model": "eye",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "You describe pictures briefly."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": question},
                    {"type": "image_url", "image_url": {"url": image_url}},
                ],
            },
        ],
    }


class _PngHandler(http.server.BaseHTTPRequestHandler):
    hosts: ClassVar[list[str]] = []  # the Host header of each request, in order

    def do_GET(self) -> None:
        self.hosts.append(self.headers.get("Host", ""))
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "https://example.com/cat.png")
            self.end_headers()
            return
        body = png(1)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path == "/short":  # fewer bytes than its Content-Length, then closed
            self.wfile.write(body[: len(body) // 2])
            return
        if self.path == "/slow":  # a few bytes at a time: never a read timeout
            for at in range(0, len(body), 64):
                self.wfile.write(body[at : at + 64])
                self.wfile.flush()
                time.sleep(0.05)
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def png_port() -> Iterator[int]:
    """A port on 127.0.0.1 serving PNGs (_PngHandler)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PngHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def client(png_port: int) -> Iterator[TestClient]:
    settings = stub_settings(
        models=(
            ModelSpec(path="stub-eye", id="eye", options=MMPROJ),
            ModelSpec(path="stub-a", id="a"),
        ),
        media_max_items=2,
        media_fetch_hosts=(f"127.0.0.1:{png_port}",),
        max_body_bytes=1 << 20,
    )
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


def test_an_image_url_part_is_seen_and_cached_by_content(client: TestClient) -> None:
    first = client.post("/v1/chat/completions", json=chat_body(data_uri(png(1))))
    assert first.status_code == 200, first.json()
    other = client.post("/v1/chat/completions", json=chat_body(data_uri(png(2))))
    assert other.json()["choices"][0]["message"] != first.json()["choices"][0]["message"]
    # The same picture in another conversation: its KV is reused past the picture.
    again = client.post("/v1/chat/completions", json=chat_body(data_uri(png(1)), "Colours?"))
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 16 + 20, again.json()["usage"]


def test_the_models_list_names_the_projector(client: TestClient) -> None:
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    meta = models["eye"]["meta"]
    assert meta["mmproj"] == "stub-audio-mmproj.gguf" and meta["media"] == ["image", "audio"]
    assert meta["projector_bytes"] > 0
    assert meta["weights_bytes"] == meta["size"] + meta["projector_bytes"]


def test_anthropic_image_blocks_and_responses_input_image(client: TestClient) -> None:
    picture = base64.b64encode(png(3)).decode()
    msg = client.post(
        "/v1/messages",
        json={
            "model": "eye",
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is it?"},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": picture,
                            },
                        },
                    ],
                }
            ],
        },
    )
    assert msg.status_code == 200, msg.json()
    usage = msg.json()["usage"]
    total = sum(
        usage[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )
    assert total > 33 + 16, usage  # the text alone is 33 tokens; the picture 16 and its markers
    resp = client.post(
        "/v1/responses",
        json={
            "model": "eye",
            "max_output_tokens": 4,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is it?"},
                        {"type": "input_image", "image_url": data_uri(png(3))},
                    ],
                }
            ],
        },
    )
    assert resp.status_code == 200, resp.json()
    bad = client.post(
        "/v1/messages",
        json={
            "model": "eye",
            "max_tokens": 4,
            "system": "Be brief.",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "data": "bm90IGFuIGltYWdl"}}
                    ],
                }
            ],
        },
    )
    assert bad.status_code == 400
    assert "messages.0.content.0" in bad.json()["error"]["message"]  # as the client sent it
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": picture},
    }
    prefilled = client.post(
        "/v1/messages",
        json={
            "model": "eye",
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": "It is"},
            ],
        },
    )
    assert prefilled.status_code == 200, prefilled.json()


def test_an_anthropic_image_is_read_by_its_content_whatever_its_media_type(
    client: TestClient,
) -> None:
    """Without ``source.media_type`` (the schema's default) a valid PNG was a 400 "not a base64
    data: URI": the block became ``data:image/*;base64,...``, which no data: URI parser takes.
    The bytes decide, as for every other API's images."""

    def ask(source: dict[str, object]) -> int:
        image = {"type": "image", "source": {"type": "base64", "data": b64(png(4)), **source}}
        body = {
            "model": "eye",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "?"}]}],
        }
        out = client.post("/v1/messages", json=body)
        assert out.status_code in (200, 400), out.json()
        return out.status_code

    assert ask({}) == 200
    assert ask({"media_type": "png"}) == 200
    assert ask({"media_type": "image/png"}) == 200


def test_an_anthropic_prefill_after_an_image_continues_it(client: TestClient) -> None:
    """A trailing assistant message after an image: the reply continues it (it is appended
    after the picture's span and the generation prompt), and a second request with the same
    picture restores past the span."""
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(png(8))},
    }

    def ask(prefill: str) -> dict[str, object]:
        body = {
            "model": "eye",
            "max_tokens": 4,
            "temperature": 0,
            "messages": [
                {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": prefill},
            ],
        }
        out = client.post("/v1/messages", json=body)
        assert out.status_code == 200, out.json()
        reply: dict[str, object] = out.json()
        return reply

    plain = ask("It is")
    other = ask("It is not")
    # The prefill reached the model: on the stub the reply depends on every prompt token.
    assert plain["content"] != other["content"]
    usage = other["usage"]
    assert isinstance(usage, dict)
    # The second request restored the picture's span and the text up to where they differ.
    assert usage["cache_read_input_tokens"] > 16, usage
    count = client.post(
        "/v1/messages/count_tokens",
        json={
            "model": "eye",
            "messages": [
                {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": "It is not"},
            ],
        },
    )
    assert count.status_code == 200, count.json()
    prompt = sum(
        int(usage[k])
        for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )
    assert count.json()["input_tokens"] == prompt


@pytest.mark.parametrize(
    ("url", "code", "param"),
    [
        (data_uri(png(1)[:-30]), "invalid_media", "messages.1.content.1"),  # truncated
        (data_uri(b"\x89PNG\r\n\x1a\n" + bytes(64)), "invalid_media", "messages.1.content.1"),
        ("data:image/png;base64,@@@@", "invalid_media", "messages.1.content.1"),
        ("https://example.com/cat.png", "media_fetch_refused", "messages.1.content.1"),
        ("file:///etc/passwd", "unsupported_content", "messages.1.content.1"),
    ],
)
def test_bad_images_are_a_400_naming_the_part(
    client: TestClient, url: str, code: str, param: str
) -> None:
    response = client.post("/v1/chat/completions", json=chat_body(url))
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert client.get("/health").status_code == 200


def test_input_audio_parts(client: TestClient) -> None:
    from tests.test_media import wav

    tone = (np.sin(np.arange(8000) / 7) * 20000).astype("<i2")
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav(tone)).decode()}}
    body = {
        "model": "eye",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hear:"}, part]}],
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.json()
    assert response.json()["usage"]["prompt_tokens"] > 2 * 4  # half a second: 2 positions + marks
    part["input_audio"] = {"data": base64.b64encode(b"RIFF....WAVEjunk").decode()}
    bad = client.post("/v1/chat/completions", json=body)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_media"
    assert bad.json()["error"]["param"] == "messages.0.content.1"
    # The bytes decide: a format no data: URI carries was "not a base64 data: URI".
    part["input_audio"] = {"data": base64.b64encode(wav(tone)).decode(), "format": "x wav"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    part["input_audio"] = {"data": base64.b64encode(b"ID3" + bytes(64)).decode(), "format": "mp3"}
    mp3 = client.post("/v1/chat/completions", json=body).json()["error"]
    assert mp3["code"] == "invalid_media" and "not a WAV file" in mp3["message"], mp3


def test_a_hostile_wav_is_a_400_naming_its_part(client: TestClient) -> None:
    """A WAV of more chunks than any tool writes (``MAX_WAV_CHUNKS``: each was listed before
    the fmt was read, seconds of a server thread for 20 MB of them) and one whose header says
    it is days long (refused from its data chunk's size) are each a 400 ``invalid_media``
    naming the part; the server answers the next request."""
    from tests.test_media import plain_wav

    from kvwarm.media import MAX_WAV_CHUNKS

    tone = bytes(range(256)) * 4
    for clip, needle in [
        (plain_wav(tone, 16000, chunks=b"JUNK\0\0\0\0" * (MAX_WAV_CHUNKS + 1)), "chunks"),
        (plain_wav(bytes(600_000), rate=1), "media_max_audio_s"),
    ]:
        part = {"type": "input_audio", "input_audio": {"data": b64(clip), "format": "wav"}}
        body = {"model": "eye", "max_tokens": 4, "messages": [{"role": "user", "content": [part]}]}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.json()
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_media", "messages.0.content.0")
        assert needle in error["message"], error
    part = {"type": "input_audio", "input_audio": {"data": b64(plain_wav(tone, 16000))}}
    body = {"model": "eye", "max_tokens": 4, "messages": [{"role": "user", "content": [part]}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_too_many_images_and_a_text_model_are_refused(client: TestClient) -> None:
    body = chat_body(data_uri(png(1)))
    parts = body["messages"][1]["content"]  # type: ignore[index]
    parts += [{"type": "image_url", "image_url": {"url": data_uri(png(2))}}] * 2
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "at most 2" in response.json()["error"]["message"]
    text_model = client.post(
        "/v1/chat/completions", json={**chat_body(data_uri(png(1))), "model": "a"}
    )
    assert text_model.status_code == 400
    assert "no multimodal projector" in text_model.json()["error"]["message"]


def test_an_allowed_host_is_fetched_once_without_redirects(
    client: TestClient, png_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    base = f"http://127.0.0.1:{png_port}"
    fetched = client.post("/v1/chat/completions", json=chat_body(f"{base}/cat.png"))
    inline = client.post("/v1/chat/completions", json=chat_body(data_uri(png(1))))
    assert fetched.status_code == 200, fetched.json()
    assert fetched.json()["choices"] == inline.json()["choices"]  # the same pixels
    with caplog.at_level(logging.INFO, logger="kvwarm.server.media"):
        moved = client.post("/v1/chat/completions", json=chat_body(f"{base}/moved"))
    assert moved.status_code == 400
    error = moved.json()["error"]
    assert error["code"] == "invalid_media", error
    assert error["message"] == f"messages.1.content.1: could not fetch the image at {base}/moved"
    assert "answered 302" in caplog.text  # why: in the log, not in the answer


def test_a_request_past_media_max_items_fetches_nothing(client: TestClient, png_port: int) -> None:
    """Found by review: every image URL of a request was fetched (each up to media_max_bytes,
    held as base64) before the engine refused the request past media_max_items, so one body
    of thousands of URLs had the server fetch them all. The media are counted first, as the
    engine counts them (a data: URI and a clip too), and nothing is fetched."""
    url = f"http://127.0.0.1:{png_port}/many.png"
    body = chat_body(url)
    parts = body["messages"][1]["content"]  # type: ignore[index]
    parts += [{"type": "image_url", "image_url": {"url": data_uri(png(2))}}]
    parts += [{"type": "image_url", "image_url": {"url": url}}] * 40
    before = len(_PngHandler.hosts)
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_media", "messages.1.content.3"), error
    assert "at most 2 images" in error["message"], error
    assert len(_PngHandler.hosts) == before  # not one fetch
    # Within the limit, the URL is fetched (once) as before.
    del parts[3:]
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert len(_PngHandler.hosts) == before + 1


def test_a_fetch_that_fails_or_drags_on_is_a_400_that_says_no_more(
    client: TestClient,
    png_port: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A host that sent fewer bytes than its Content-Length (http.client's IncompleteRead)
    raised out of the fetch as a 500; a host trickling its bytes never tripped the per-read
    timeout and held the request for as long as it liked, where the docs promise 10 s. Both
    are a 400 that says only that the image could not be fetched (found by review: the
    error's details, "connection refused" among them, let a client map ports): the log says
    why."""
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 0.5)
    base = f"http://127.0.0.1:{png_port}"
    for url, why in [(f"{base}/short", "bytes it announced"), (f"{base}/slow", "0.5 s")]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvwarm.server.media"):
            response = client.post("/v1/chat/completions", json=chat_body(url))
        assert response.status_code == 400, (url, response.json())
        error = response.json()["error"]
        assert error["code"] == "invalid_media", error
        assert error["message"] == f"messages.1.content.1: could not fetch the image at {url}"
        assert why in caplog.text, caplog.text
    # A port that is no number: refused as a URL, before anything is fetched.
    for bad_url in ("http://127.0.0.1:port/cat.png", "http://[::1/cat.png"):
        bad = client.post("/v1/chat/completions", json=chat_body(bad_url))
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "media_fetch_refused"
    assert client.get("/health").status_code == 200


def test_a_listed_host_is_fetched_only_on_its_port(client: TestClient) -> None:
    """Listing a host let a client fetch from it on any port (found by review): a host listed
    with a port is fetched on that port alone, one listed bare on 80 and 443."""
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PngHandler)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{other.server_address[1]}/cat.png"
        response = client.post("/v1/chat/completions", json=chat_body(url))
        assert response.status_code == 400, response.json()
        error = response.json()["error"]
        assert error["code"] == "media_fetch_refused" and "on port" in error["message"]
    finally:
        other.shutdown()
        other.server_close()


def _settings(*hosts: str) -> Settings:
    return Settings(media_fetch_hosts=hosts)


def _refused_code(url: str, settings: Settings) -> str:
    with pytest.raises((HTTPError, MediaError)) as caught:
        media._fetch(url, "image", settings)
    exc = caught.value
    return exc.code if isinstance(exc, HTTPError) else "invalid_media"  # type: ignore[return-value]


def test_any_host_is_only_a_public_one_on_a_web_port(
    png_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``*`` fetched from loopback, the LAN and the cloud's metadata address, on any port
    (found by review): it now allows ports 80 and 443 only, and an address that is public."""
    url = f"http://127.0.0.1:{png_port}/cat.png"
    assert media._fetch(url, "image", _settings(f"127.0.0.1:{png_port}")) == png(1)
    assert _refused_code(url, _settings("*")) == "media_fetch_refused"  # the port
    assert _refused_code("http://example.com:0/a.png", _settings("*")) == "media_fetch_refused"
    # On a port it allows (the test server's), loopback is refused for being loopback.
    monkeypatch.setattr(media, "WEB_PORTS", frozenset({80, 443, png_port}))
    assert _refused_code(url, _settings("*")) == "media_fetch_refused"
    mapped = f"http://[::ffff:127.0.0.1]:{png_port}/cat.png"
    assert _refused_code(mapped, _settings("*")) == "media_fetch_refused"
    # The operator's own entry still wins over '*' for that host and port.
    assert media._fetch(url, "image", _settings("*", f"127.0.0.1:{png_port}")) == png(1)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1", "127.1.2.3", "0.0.0.0", "10.1.2.3", "172.16.0.1", "192.168.1.1",
        "169.254.169.254", "100.64.0.1", "224.0.0.1", "240.0.0.1", "255.255.255.255",
        "[::1]", "[::]", "[fe80::1]", "[fd00::1]", "[ff02::1]", "[::ffff:10.0.0.1]",
        "[::ffff:169.254.169.254]", "[64:ff9b::7f00:1]", "[2002:a9fe:a9fe::]",
    ],
)  # fmt: skip
def test_any_host_refuses_addresses_that_are_not_public(host: str) -> None:
    assert _refused_code(f"http://{host}/latest/meta-data/", _settings("*")) == (
        "media_fetch_refused"
    )


def test_a_refused_url_cannot_forge_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: a refused or failed fetch logged the client's URL as it came, and a
    URL's CR and LF (which ``urlsplit`` drops before it parses, so the host still passed its
    checks) started a line of the client's own in the server's log, as the request log's
    ``user=`` is kept from doing. The URL is logged quoted, its control characters escaped."""
    forged = "2026-01-01 00:00:00 ERROR kvwarm.server: forged"
    url = f"http://127.0.0.1/cat.png\r\n{forged}"
    with caplog.at_level(logging.INFO, logger="kvwarm.server.media"):
        assert _refused_code(url, _settings("*")) == "media_fetch_refused"
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all("\n" not in line and "\r" not in line for line in lines), lines
    assert any(forged in line for line in lines), lines  # still said, on the same line


def test_unsafe_reason_passes_public_addresses() -> None:
    for address in ("93.184.216.34", "2606:4700::1", "64:ff9b::5db8:d822", "2002:5db8:d822::"):
        assert media._unsafe_reason(address) is None, address


@pytest.fixture
def images_test(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name ``images.test`` resolves to ``127.0.0.1`` once, then to nothing: a second
    lookup (one a rebinding DNS server could answer differently) fails the fetch. Returns the
    names looked up."""
    lookups: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host: object, *args: object, **kwargs: object) -> object:
        lookups.append(str(host))
        if host == "images.test":
            if lookups.count("images.test") > 1:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            host = "127.0.0.1"
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return lookups


def test_a_name_resolving_to_loopback_is_refused_under_any_host(
    images_test: list[str],
    png_port: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(media, "WEB_PORTS", frozenset({80, 443, png_port}))
    url = f"http://images.test:{png_port}/cat.png"
    with (
        caplog.at_level(logging.WARNING, logger="kvwarm.server.media"),
        pytest.raises(MediaError) as caught,
    ):
        media._fetch(url, "image", _settings("*"))
    assert str(caught.value) == f"image: could not fetch the image at {url}"
    assert "127.0.0.1 is a loopback address" in caplog.text  # logged, not answered


def test_a_listed_name_is_connected_to_the_address_looked_up(
    images_test: list[str], png_port: int
) -> None:
    """The name is looked up once and the socket goes to that address, so DNS cannot change
    between the check and the connection; the Host header is still the URL's name."""
    _PngHandler.hosts.clear()
    url = f"http://images.test:{png_port}/cat.png"
    assert media._fetch(url, "image", _settings(f"images.test:{png_port}")) == png(1)
    assert images_test.count("images.test") == 1
    assert _PngHandler.hosts == [f"images.test:{png_port}"]


def _self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A certificate for ``name`` (and its key), signed by itself."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.mark.parametrize("served_name", ["images.test", "other.test"])
def test_https_to_the_address_looked_up_checks_the_certificate_of_the_name(
    images_test: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    served_name: str,
) -> None:
    """The socket goes to the pinned address, while TLS sends the URL's name (SNI) and checks
    the certificate against it: a server whose certificate is another name's is refused."""
    cert, key = _self_signed(tmp_path, served_name)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PngHandler)
    server.socket = server_tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    trusting = ssl.create_default_context(cafile=str(cert))
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: trusting)
    try:
        port = server.server_address[1]
        url = f"https://images.test:{port}/cat.png"
        settings = _settings(f"images.test:{port}")
        if served_name == "images.test":
            assert media._fetch(url, "image", settings) == png(1)
        else:
            with pytest.raises(MediaError):
                media._fetch(url, "image", settings)
        assert images_test.count("images.test") == 1
    finally:
        server.shutdown()
        server.server_close()


class _SlowResolver:
    """``socket.getaddrinfo`` for ``slow.test`` blocks until ``release`` is set (then fails,
    as a resolver that gave up); other names resolve as usual. Records the threads that
    looked it up, so the teardown can wait for them."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: list[threading.Thread] = []
        self.real = socket.getaddrinfo

    def __call__(self, host: object, *args: object, **kwargs: object) -> object:
        if host != "slow.test":
            return self.real(host, *args, **kwargs)  # type: ignore[arg-type]
        self.threads.append(threading.current_thread())
        self.release.wait(60)  # bounded only so a broken test cannot hang the run for ever
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")


@pytest.fixture
def slow_resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[_SlowResolver]:
    resolver = _SlowResolver()
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 0.3)
    try:
        yield resolver
    finally:
        resolver.release.set()
        for thread in resolver.threads:
            if thread is not threading.current_thread():  # the old code looked up inline
                thread.join(10)


def test_a_slow_name_lookup_ends_within_the_fetch_deadline(
    slow_resolver: _SlowResolver, caplog: pytest.LogCaptureFixture
) -> None:
    """The name was looked up outside the fetch's 10 s (found by review): a resolver that
    does not answer held the request for as long as the system resolver's own timeouts. It
    is now looked up on a thread of its own and given up on at the deadline, with the same
    short 400 as any failed fetch; why is logged."""
    url = "http://slow.test/cat.png"
    began = time.monotonic()
    with (
        caplog.at_level(logging.INFO, logger="kvwarm.server.media"),
        pytest.raises(MediaError) as caught,
    ):
        media._fetch(url, "image", _settings("slow.test"))
    assert time.monotonic() - began < 5  # the deadline (0.3 s here), not the resolver's
    assert str(caught.value) == f"image: could not fetch the image at {url}"  # invalid_media
    assert "cannot resolve slow.test in 0.3 s" in caplog.text
    assert len(slow_resolver.threads) == 1 and not slow_resolver.release.is_set()


def test_lookups_a_slow_resolver_holds_are_bounded(
    slow_resolver: _SlowResolver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A lookup given up on still runs (getaddrinfo cannot be cancelled); fetches past
    ``RESOLVE_THREADS`` of them wait for one to end, until their own deadline, and start no
    thread of their own."""
    monkeypatch.setattr(media, "_resolving", threading.BoundedSemaphore(1))
    url = "http://slow.test/cat.png"
    for _ in range(2):
        with caplog.at_level(logging.INFO, logger="kvwarm.server.media"), pytest.raises(MediaError):
            media._fetch(url, "image", _settings("slow.test"))
    assert len(slow_resolver.threads) == 1  # the second fetch found no free lookup
    assert "lookups still running" in caplog.text
    slow_resolver.release.set()
    slow_resolver.threads[0].join(10)
    # The slot is free again once the stuck lookup ended: a name that resolves is fetched.
    assert media._resolve_by("127.0.0.1", 80, time.monotonic() + 10) == [
        (socket.AF_INET, "127.0.0.1")
    ]


def test_a_refused_connection_is_not_told_to_the_client(caplog: pytest.LogCaptureFixture) -> None:
    """Nor is a URL's query string or user part logged (found by review: a presigned URL's
    signature, a credential while it lasts, went to the log whole when its fetch failed);
    the client gets its URL back as it sent it."""
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        url = f"http://user:pw@127.0.0.1:{port}/cat.png?X-Amz-Signature=s3cr3t#frag"
        with (
            caplog.at_level(logging.INFO, logger="kvwarm.server.media"),
            pytest.raises(MediaError) as caught,
        ):
            media._fetch(url, "image", _settings(f"127.0.0.1:{port}"))
    assert str(caught.value) == f"image: could not fetch the image at {url}"
    assert "refused" in caplog.text
    assert f"http://127.0.0.1:{port}/cat.png?…" in caplog.text
    assert "s3cr3t" not in caplog.text and "pw@" not in caplog.text


@pytest.mark.parametrize(
    ("head", "drip"),
    [
        (b"HTTP/1.1 200 OK\r\nX-Slow: ", b"a"),  # its headers, a byte at a time
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1", b"0"),  # a chunk's size
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"a"),  # a body of no length: cut,
        # it is not taken for a whole file
    ],
)
def test_a_host_trickling_its_headers_is_cut_at_the_deadline(
    head: bytes, drip: bytes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The deadline was checked between a body's reads only: a host sending its headers (or a
    chunked body's size line) a byte at a time, each well within a read's timeout, held the
    fetch, and a thread of the server's pool, for as long as it kept sending (found by
    review: 4 s of a 0.5 s deadline, the host's choice). The connection is now cut at the
    deadline wherever the fetch is reading."""
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 0.5)
    stop = threading.Event()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def serve() -> None:
            connection, _ = listener.accept()
            with connection:
                connection.recv(65536)
                connection.sendall(head)
                give_up = time.monotonic() + 5.0  # the old code's fetch ended only here
                while not stop.wait(0.02) and time.monotonic() < give_up:  # pacing the drip
                    try:
                        connection.sendall(drip)
                    except OSError:
                        return

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}/cat.png"
        started = time.monotonic()
        try:
            with (
                caplog.at_level(logging.INFO, logger="kvwarm.server.media"),
                pytest.raises(MediaError),
            ):
                media._fetch(url, "image", _settings(f"127.0.0.1:{port}"))
            took = time.monotonic() - started
        finally:
            stop.set()
            thread.join(10)
    assert took < 3.0, took  # the deadline's 0.5 s and some slack; it dripped until stopped
    assert "took longer than 0.5 s" in caplog.text, caplog.text


@pytest.mark.parametrize(
    ("entry", "rule"),
    [
        ("Example.com", ("example.com", None)),
        ("example.com:8080", ("example.com", 8080)),
        ("[::1]:8080", ("::1", 8080)),
        ("[::1]", ("::1", None)),
        ("::1", ("::1", None)),
        ("*", ("*", None)),
    ],
)
def test_media_fetch_host_entries(entry: str, rule: tuple[str, int | None]) -> None:
    assert _settings(entry).media_fetch_rules() == (rule,)


@pytest.mark.parametrize("entry", ["example.com:http", "example.com:0", "[::1", ":80", "a/b"])
def test_a_bad_media_fetch_host_entry_is_a_config_error(entry: str) -> None:
    with pytest.raises(ConfigError, match="media_fetch_hosts"):
        _settings(entry).check()


def test_a_prewarmed_chat_with_an_image_is_restored_past_it_and_kept_warm(
    client: TestClient,
) -> None:
    """``/cache/prewarm`` takes a chat's image parts (cached by content, as a chat's): a later
    chat that starts with the same messages restores past the picture, and keep-alive
    re-warms the chat from its messages (ids alone cannot carry a picture)."""
    head = chat_body(data_uri(png(9)), "Remember this picture.")["messages"]
    assert isinstance(head, list)
    warm = client.post("/cache/prewarm", json={"model": "eye", "messages": head})
    assert warm.status_code == 200, warm.json()
    n_warm = warm.json()["prompt_tokens"]
    assert n_warm > 16 and warm.json()["keep_alive"] is True
    follow = [*head, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "?"}]
    body = {"model": "eye", "max_tokens": 2, "messages": follow}
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    # All of the prewarmed prefix, the picture's 16 positions among them.
    assert usage["prompt_tokens_details"]["cached_tokens"] == n_warm, (usage, n_warm)
    state = client.app.state.kvwarm  # type: ignore[attr-defined]
    (entry,) = [e for e in state.keepalive.entries() if e.model_id == "eye"]
    warms = entry.warms
    entry.last_warm -= 1e9  # due now
    assert state.keepalive.tick(state.ready_model) >= 1
    assert entry.warms == warms + 1 and entry.failures == 0
    # The same chat again is the same entry (keyed by its messages), not a second one.
    again = client.post("/cache/prewarm", json={"model": "eye", "messages": head})
    assert again.status_code == 200 and again.json()["cached_tokens"] == n_warm
    assert len([e for e in state.keepalive.entries() if e.model_id == "eye"]) == 1
    fetched = client.post(
        "/cache/prewarm",
        json={"model": "eye", "messages": chat_body("https://example.com/a.png")["messages"]},
    )
    assert fetched.status_code == 400 and fetched.json()["error"]["code"] == "media_fetch_refused"


def test_an_anthropic_tool_result_may_hold_images(client: TestClient) -> None:
    """Claude Code sends the image file a tool read as an image block inside the tool_result:
    that was a 400 ("an image in a tool result is not supported"). The image reaches the
    model as any other image does; a model without a projector gives the same 400 as for one
    in a user turn."""
    from anthropic import Anthropic, BadRequestError

    claude = Anthropic(base_url="http://testserver", api_key="-", http_client=client)
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(png(5))},
    }

    def ask(model: str, content: list[dict[str, object]]) -> int:
        reply = claude.messages.create(
            model=model,
            max_tokens=2,
            tools=[{"name": "read", "input_schema": {"type": "object"}}],
            messages=[
                {"role": "user", "content": "Show me cat.png"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}  # type: ignore[list-item, typeddict-item]
                    ],
                },
            ],
        )
        usage = reply.usage
        return (
            usage.input_tokens
            + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0)
        )

    text = {"type": "text", "text": "cat.png:"}
    with_image = ask("eye", [text, image])
    assert with_image >= ask("eye", [text]) + 16  # the picture's span is in the prompt
    with pytest.raises(BadRequestError) as caught:
        ask("a", [text, image])
    message = str(caught.value)
    assert "messages.2.content.0.content.1" in message and "no multimodal projector" in message


def test_a_responses_function_call_output_may_hold_images(client: TestClient) -> None:
    """OpenAI's function_call_output may be a list of input_text and input_image parts (as
    chat's tool messages and Anthropic's tool_result blocks may hold images): that was a 400
    ("images and audio belong in a message, not here")."""

    def ask(model: str, output: list[dict[str, object]]) -> tuple[int, dict[str, object]]:
        response = client.post(
            "/v1/responses",
            json={
                "model": model,
                "store": False,
                "max_output_tokens": 2,
                "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}],
                "input": [
                    {"role": "user", "content": "Show me cat.png"},
                    {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": output},
                ],
            },
        )
        return response.status_code, response.json()

    text = {"type": "input_text", "text": "cat.png:"}
    image = {"type": "input_image", "image_url": data_uri(png(6))}
    status, body = ask("eye", [text, image])
    assert status == 200, body
    _, plain = ask("eye", [text])
    usage, plain_usage = body["usage"], plain["usage"]
    assert isinstance(usage, dict) and isinstance(plain_usage, dict)
    assert usage["input_tokens"] >= plain_usage["input_tokens"] + 16  # the picture's span
    status, body = ask("a", [text, image])
    error = body["error"]
    assert status == 400 and isinstance(error, dict)
    assert error["param"] == "input.2.output.1" and "no multimodal projector" in error["message"]
