"""Decoding images and audio under limits (kvwarm.media): pixels and samples out, every bad
file a MediaError naming its part, before anything reaches C."""

from __future__ import annotations

import io
import os
import struct
import threading
import wave
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tests.engine.mediakit import png

from kvwarm.errors import MediaError
from kvwarm.media import (
    MAX_JPEG_SCANS,
    MAX_WAV_CHUNKS,
    Audio,
    Image,
    MediaBudget,
    MediaLimits,
    decode_audio,
    decode_data_uri,
    decode_image,
    load_media,
)

LIMITS = MediaLimits()


def wav(samples: np.ndarray, rate: int = 16000, width: int = 2, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return out.getvalue()


def float_wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    """A mono IEEE-float (format 3) WAV file, which ``wave`` cannot write."""
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, 4 * rate, 4, 32)
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_an_image_is_its_pixels_and_its_digest_names_them() -> None:
    from PIL import Image as Pil

    rgba = Pil.new("RGBA", (3, 2), (10, 20, 30, 0))
    for fmt in ("PNG", "WEBP", "BMP", "GIF"):
        out = io.BytesIO()
        rgba.convert("RGB" if fmt in ("BMP", "GIF") else "RGBA").save(
            out, format=fmt, lossless=True
        )
        img = decode_image(out.getvalue(), LIMITS, "part")
        assert (img.width, img.height) == (3, 2) and len(img.rgb) == 18, fmt
    a, b = decode_image(png(1), LIMITS, "a"), decode_image(png(1), LIMITS, "b")
    assert a == b and a.digest == b.digest
    assert decode_image(png(1, poke=True), LIMITS, "c").digest != a.digest
    # The digest is of the pixels and size, not the file: the same pixels in other bytes.
    assert Image(2, 1, bytes(6)).digest != Image(1, 2, bytes(6)).digest


def test_hostile_images_are_refused_before_their_pixels_are_decoded() -> None:
    # PNG headers claiming millions of pixels: refused from the header alone.
    def bomb(side: int) -> bytes:
        ihdr = b"IHDR" + struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + struct.pack(">I", 13)
            + ihdr
            + struct.pack(">I", zlib.crc32(ihdr))
            + b"\0\0\0\0IEND"
            + struct.pack(">I", zlib.crc32(b"IEND"))
        )

    with pytest.raises(MediaError, match="above this server's limit") as info:
        decode_image(bomb(4000), MediaLimits(max_pixels=1 << 20), "messages.0.content.1")
    assert info.value.param == "messages.0.content.1"
    with pytest.raises(MediaError, match="too large to decode"):  # past Pillow's own limit
        decode_image(bomb(100_000), MediaLimits(max_pixels=1 << 40), "p")
    for bad, needle in [
        (png(1)[:2000], "not a whole image"),  # cut inside its pixels
        (b"not an image at all", "not an image of an allowed format"),
        (b"", "is empty"),
    ]:
        with pytest.raises(MediaError, match=needle):
            decode_image(bad, LIMITS, "p")
    with pytest.raises(MediaError, match="allowed format"):
        decode_image(png(1), MediaLimits(formats=("jpeg",)), "p")


def test_a_png_whose_pixel_data_ends_early_is_refused() -> None:
    """Found by review: a PNG whose zlib stream ended before its rows did (IDAT chunks whole,
    CRCs right) was decoded by Pillow with the missing rows black: a 200 for a picture that
    is not the file's, where llama.cpp's loader refuses it ("not enough pixels"). Every row
    must be there, interlaced (Adam7) or not; an image whose rows are all there passes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    def encoded(width: int, height: int, raw: bytes, interlace: int = 0) -> bytes:
        header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, interlace)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw))
            + chunk(b"IEND", b"")
        )

    rows = bytes(range(1, 49))  # each row: filter 0, then 4 RGB pixels
    whole = b"".join(b"\0" + rows[i * 12 : i * 12 + 12] for i in range(4))
    picture = decode_image(encoded(4, 4, whole), LIMITS, "p")
    assert picture.rgb == rows
    # The stream ends with a row: Pillow took the image, its last row black.
    with pytest.raises(MediaError, match="pixel data ends after 39 of the 52") as info:
        decode_image(encoded(4, 4, whole[:39]), LIMITS, "messages.0.content.1")
    assert info.value.param == "messages.0.content.1"
    for short in (whole[:40], whole[:1]):  # inside a row: Pillow finds it itself
        with pytest.raises(MediaError, match="not a whole image"):
            decode_image(encoded(4, 4, short), LIMITS, "p")
    # Adam7: a 3x2 image is passes 1 (pixel 0,0), 4 (2,0), 6 (1,0) and 7 (row 1), each row
    # of the pass behind its filter byte.
    pixels = bytes(range(18))  # row 0: p0 p1 p2, row 1: p3 p4 p5 (3 bytes each)
    interlaced = (
        b"\0" + pixels[0:3] + b"\0" + pixels[6:9] + b"\0" + pixels[3:6] + b"\0" + pixels[9:18]
    )
    assert decode_image(encoded(3, 2, interlaced, 1), LIMITS, "p").rgb == pixels
    with pytest.raises(MediaError, match="pixel data ends after 12 of the 22 bytes"):
        decode_image(encoded(3, 2, interlaced[:12], 1), LIMITS, "p")  # no pass 7


def test_an_animated_png_whose_first_frame_ends_early_is_refused() -> None:
    """The check above skipped animated PNGs (acTL), whose first frame Pillow decodes from the
    IDAT stream: found by review, an APNG whose IDAT stream ended half-way was a 200 for a
    first frame half black. Its IDAT must hold the canvas's rows too, as llama.cpp's loader
    (stb_image, which reads IDAT alone) wants them: a first fcTL smaller than the canvas,
    which the format forbids, is refused with it; a whole APNG still passes."""
    from PIL import Image as Pil

    rng = np.random.default_rng(3)
    frames = [Pil.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)) for _ in range(2)]
    out = io.BytesIO()
    frames[0].save(out, format="PNG", save_all=True, append_images=frames[1:])
    data = out.getvalue()
    assert b"acTL" in data and decode_image(data, LIMITS, "p").rgb == frames[0].tobytes()

    def rewritten(idat: Callable[[bytes], bytes], fctl: Callable[[bytes], bytes]) -> bytes:
        out, at = bytearray(data[:8]), 8
        while at < len(data):
            size, kind = struct.unpack_from(">I4s", data, at)
            body = data[at + 8 : at + 8 + size]
            body = idat(body) if kind == b"IDAT" else fctl(body) if kind == b"fcTL" else body
            out += struct.pack(">I", len(body)) + kind + body
            out += struct.pack(">I", zlib.crc32(kind + body))
            at += 12 + size
        return bytes(out)

    def half(body: bytes) -> bytes:
        raw = zlib.decompress(body)
        return zlib.compress(raw[: len(raw) // 2])

    with pytest.raises(MediaError, match="pixel data ends after"):
        decode_image(rewritten(half, lambda b: b), LIMITS, "p")
    # A first frame of 12x8 in a 24x16 canvas: Pillow draws it in a corner of a blank canvas.
    small = frames[0].crop((0, 0, 12, 8))
    raw = b"".join(b"\0" + small.tobytes()[r * 36 : r * 36 + 36] for r in range(8))
    first = {"seen": False}

    def smaller(body: bytes) -> bytes:
        if first["seen"]:
            return body
        first["seen"] = True
        return body[:4] + struct.pack(">II", 12, 8) + body[12:]

    with pytest.raises(MediaError, match="pixel data ends after"):
        decode_image(rewritten(lambda b: zlib.compress(raw), smaller), LIMITS, "p")


def test_a_jpeg_of_too_many_scans_is_refused_before_it_is_decoded() -> None:
    """Found by review: libjpeg goes over every block of the image at each scan, so a JPEG of
    many empty scans is a CPU bomb: 50,000 scans of 10 bytes (a 1.4 MB file, 1024x1024)
    took 5 s, 8 MB of them at 16M pixels minutes, on a thread of the server. Past
    ``MAX_JPEG_SCANS`` it is refused before a scan is decoded; what encoders write passes."""
    from PIL import Image as Pil

    rng = np.random.default_rng(5)
    out = io.BytesIO()
    Pil.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(
        out, "JPEG", progressive=True
    )
    progressive = out.getvalue()
    assert decode_image(progressive, LIMITS, "p").width == 64
    empty_scan = b"\xff\xda\x00\x08\x01\x01\x00\x00\x00\x10"  # a DC refinement of nothing
    assert progressive.endswith(b"\xff\xd9")
    for extra, refused in [(MAX_JPEG_SCANS - 20, False), (MAX_JPEG_SCANS + 1, True)]:
        bomb = progressive[:-2] + empty_scan * extra + b"\xff\xd9"
        if not refused:
            assert decode_image(bomb, LIMITS, "p").width == 64
            continue
        with pytest.raises(MediaError, match=r"JPEG of \d+ scans, more than the 500") as info:
            decode_image(bomb, LIMITS, "messages.0.content.1")
        assert info.value.param == "messages.0.content.1"


def test_a_requests_media_are_bounded_together_before_they_are_decoded() -> None:
    """Found by review: media were bounded per item only, so one request of 16 images of 32M
    pixels decoded ~1.5 GB. ``max_request_bytes`` bounds them together."""
    limits = MediaLimits(max_request_bytes=2 * 3 * 64 * 64 + 100)
    budget = MediaBudget(limits)
    decode_image(png(1), limits, "m.0", budget)
    decode_image(png(2), limits, "m.1", budget)
    assert budget.used == 2 * 3 * 64 * 64
    with pytest.raises(MediaError, match="media_max_request_bytes") as info:
        decode_image(png(3), limits, "m.2", budget)
    assert info.value.param == "m.2" and budget.used == 2 * 3 * 64 * 64
    # Refused from its header: a PNG that claims 4000x4000 pixels and holds none is past the
    # budget, not "not a whole image" (which decoding it would have found).
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", 4000, 4000, 8, 2, 0, 0, 0)
    claim = (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", 13)
        + ihdr
        + struct.pack(">I", zlib.crc32(ihdr))
        + b"\0\0\0\0IEND"
        + struct.pack(">I", zlib.crc32(b"IEND"))
    )
    with pytest.raises(MediaError, match=r"4000x4000 pixels.*media_max_request_bytes"):
        decode_image(claim, limits, "m.3", MediaBudget(limits))
    # A clip counts its samples at the rate it is resampled to, before it is resampled.
    clip = wav(np.zeros(8000, dtype="<i2"), rate=8000)  # 1 s: 16000 samples at 16 kHz
    audio_limits = MediaLimits(max_request_bytes=4 * 16000 + 4 * 8000)
    budget = MediaBudget(audio_limits)
    assert load_media(clip, "audio", audio_limits, "a.0", budget=budget).n_samples == 16000
    with pytest.raises(MediaError, match=r"1\.0 s of audio.*media_max_request_bytes"):
        load_media(clip, "audio", audio_limits, "a.1", budget=budget)
    assert budget.used == 4 * 16000


def test_audio_of_every_common_wav_shape_becomes_float_mono() -> None:
    tone = np.sin(np.arange(1600) / 10)
    cases = [
        wav((tone * 32767).astype("<i2")),
        wav(((tone + 1) * 127.5).astype(np.uint8), width=1),
        wav((tone * (2**31 - 1)).astype("<i4"), width=4),
        wav(np.repeat((tone * 32767).astype("<i2"), 2), channels=2),
    ]
    for data in cases:
        audio = decode_audio(data, LIMITS, "p", 16000)
        got = np.frombuffer(audio.samples, "<f4")
        assert got.shape == (1600,) and np.abs(got - tone).max() < 0.02
    resampled = decode_audio(wav((tone * 32767).astype("<i2"), rate=8000), LIMITS, "p", 16000)
    assert isinstance(resampled, Audio) and resampled.n_samples == 3200
    with pytest.raises(MediaError, match=r"above this server's limit of 0\.05 s"):
        decode_audio(cases[0], MediaLimits(max_audio_s=0.05), "p", 16000)
    with pytest.raises(MediaError, match="not a WAV file"):
        decode_audio(b"ID3" + bytes(100), LIMITS, "p", 16000)
    with pytest.raises(MediaError, match="not a whole WAV file"):
        decode_audio(cases[0][:30], LIMITS, "p", 16000)


def extensible_wav(raw: bytes, bits: int, channels: int, tag: int = 1) -> bytes:
    """A WAVE_FORMAT_EXTENSIBLE WAV of ``raw`` frames: its subformat's GUID starts with
    ``tag`` (1 integer PCM, 3 IEEE float)."""
    width = (bits + 7) // 8
    fmt = struct.pack(
        "<HHIIHH", 0xFFFE, channels, 16000, 16000 * channels * width, channels * width, bits
    )
    guid = struct.pack("<H", tag) + bytes.fromhex("000000001000800000aa00389b71")
    fmt += struct.pack("<HHI", 22, bits, 0) + guid
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(raw)) + raw
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_an_extensible_wav_is_read_whatever_its_samples() -> None:
    """Found by review: an extensible WAV of integer samples (what many tools write for
    24-bit or multichannel audio) was a 400 "not a whole WAV file: unknown format: 65534":
    it was read by Python's ``wave``, which before 3.12 (kvwarm runs on 3.11) knows no
    extensible format. Every such file is read as its plain twin is."""
    tone = np.sin(np.arange(1600) / 10)
    ints = (tone * 32767).astype("<i2")
    stereo24 = np.repeat((tone * (2**23 - 1)).astype("<i4"), 2)
    packed24 = b"".join(int(v).to_bytes(4, "little", signed=True)[:3] for v in stereo24)
    for data in [
        extensible_wav(ints.tobytes(), 16, 1),
        extensible_wav(packed24, 24, 2),
        extensible_wav((tone * (2**31 - 1)).astype("<i4").tobytes(), 32, 1),
        extensible_wav(((tone + 1) * 127.5).astype(np.uint8).tobytes(), 8, 1),
        extensible_wav(tone.astype("<f4").tobytes(), 32, 1, tag=3),
    ]:
        got = np.frombuffer(decode_audio(data, LIMITS, "p", 16000).samples, "<f4")
        assert got.shape == (1600,) and np.abs(got - tone).max() < 0.02
    plain = decode_audio(wav(ints), LIMITS, "p", 16000)
    assert decode_audio(extensible_wav(ints.tobytes(), 16, 1), LIMITS, "p", 16000) == plain
    with pytest.raises(MediaError, match=r"format 0x7 \(integer PCM and IEEE float"):
        decode_audio(extensible_wav(ints.tobytes(), 16, 1, tag=7), LIMITS, "p", 16000)  # mu-law


def test_a_16_bit_grey_png_is_read_as_llama_cpp_reads_it() -> None:
    """Pillow opens a 16-bit greyscale PNG as mode I;16, whose conversion to RGB clips every
    value above 255 (a picture all but white); llama.cpp's loader keeps each value's high
    byte, as Pillow itself does for 16-bit colour PNGs."""
    from PIL import Image as Pil

    grey = (np.arange(48 * 40, dtype=np.uint16).reshape(40, 48) * 34).astype(np.uint16)
    out = io.BytesIO()
    Pil.fromarray(grey).save(out, format="PNG")
    img = decode_image(out.getvalue(), LIMITS, "p")
    got = np.frombuffer(img.rgb, np.uint8).reshape(40, 48, 3)
    expected = (grey >> 8).astype(np.uint8)
    for channel in range(3):
        assert np.array_equal(got[:, :, channel], expected)


def test_audio_mtmd_cannot_take_is_refused() -> None:
    """A clip of one sample reached a GGML_ASSERT in mtmd_tokenize (it asserts more than one
    sample) and aborted the process; samples that are not finite numbers gave the model NaN
    embeddings and a reply of nothing real."""
    with pytest.raises(MediaError, match="too short") as info:
        decode_audio(wav(np.array([1000], "<i2")), LIMITS, "messages.0.content.1", 16000)
    assert info.value.param == "messages.0.content.1"
    with pytest.raises(MediaError, match="too short"):  # one sample once resampled
        decode_audio(wav(np.array([1000], "<i2"), rate=44100), LIMITS, "p", 16000)
    assert decode_audio(wav(np.array([1, 2], "<i2")), LIMITS, "p", 16000).n_samples == 2
    for bad in (np.nan, np.inf, -np.inf):
        samples = np.array([0.1, bad, 0.2], "<f4")
        with pytest.raises(MediaError, match="not finite"):
            decode_audio(float_wav(samples), LIMITS, "p", 16000)
    fine = decode_audio(float_wav(np.array([0.1, -0.5, 0.2])), LIMITS, "p", 16000)
    assert np.allclose(np.frombuffer(fine.samples, "<f4"), [0.1, -0.5, 0.2])
    # The Python API's decoded clips: the same rules, and the projector's rate (mtmd reads
    # samples at its own: a clip at another rate was heard slowed or sped up).
    with pytest.raises(MediaError, match="too short"):
        load_media(Audio(bytes(4), 16000), "audio", LIMITS, "p", sample_rate=16000)
    with pytest.raises(MediaError, match="not finite"):
        load_media(Audio(np.array([0, np.nan], "<f4").tobytes(), 16000), "audio", LIMITS, "p")
    tone = np.sin(np.arange(800) / 10).astype("<f4")
    clip = Audio(tone.tobytes(), 8000)
    heard = load_media(clip, "audio", LIMITS, "p", sample_rate=16000)
    assert isinstance(heard, Audio) and (heard.sample_rate, heard.n_samples) == (16000, 1600)
    assert load_media(heard, "audio", LIMITS, "p", sample_rate=16000) is heard


def plain_wav(payload: bytes, rate: int, bits: int = 8, chunks: bytes = b"") -> bytes:
    """A mono integer-PCM WAV of ``payload`` at ``rate``, with ``chunks`` before its fmt."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * bits // 8, bits // 8, bits)
    body = b"WAVE" + chunks + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_a_clip_too_long_or_past_the_budget_is_refused_before_its_samples_are_made() -> None:
    """Found by review: a clip's length and its request's budget were checked once every
    sample was made a float64 (8 bytes a sample of 8-bit audio) and mixed: a 16 MB WAV of
    8-bit samples at 1 Hz (16M s) took 288 MB and 3 s before its 400. Both are read from the
    data chunk's size now, before a sample is made: nothing the size of the file is."""
    import tracemalloc

    clip = plain_wav(bytes(4 << 20), rate=1)
    budget_clip = plain_wav(bytes(4 << 20), rate=16000)
    tight = MediaLimits(max_request_bytes=1000)
    for data, limits, budget, needle in [
        (clip, LIMITS, None, "media_max_audio_s"),
        (budget_clip, tight, MediaBudget(tight), "media_max_request_bytes"),
    ]:
        tracemalloc.start()
        try:
            with pytest.raises(MediaError, match=needle) as info:
                decode_audio(data, limits, "messages.0.content.1", 16000, budget)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert info.value.param == "messages.0.content.1"
        assert peak < len(data) // 4, peak
    # A clip within both is read as before: its samples, at the projector's rate.
    fine = decode_audio(plain_wav(bytes(range(256)) * 4, rate=8000), LIMITS, "p", 16000)
    got = np.frombuffer(fine.samples, "<f4")
    assert got.shape == (2048,) and got[0] == -1.0 and got[2] == (1 - 128) / 128


def test_a_wav_of_too_many_chunks_is_refused_before_they_are_read() -> None:
    """Found by review: a WAV's chunks were all listed (each a copy of its bytes) before its
    fmt was looked at, so 20 MB of empty chunks (2.5M of them) held a server thread for
    seconds and took 200 MB, per clip. Past ``MAX_WAV_CHUNKS`` it is refused; what tools
    write (fmt, data and a few of LIST, fact, bext, cue...) passes."""
    tone = bytes(range(256)) * 4
    few = b"LIST\x04\0\0\0INFO" + b"JUNK\0\0\0\0" * (MAX_WAV_CHUNKS - 4)
    assert decode_audio(plain_wav(tone, 16000, chunks=few), LIMITS, "p", 16000).n_samples == 1024
    many = b"JUNK\0\0\0\0" * (MAX_WAV_CHUNKS + 1)
    with pytest.raises(MediaError, match=rf"more than the {MAX_WAV_CHUNKS} chunks") as info:
        decode_audio(plain_wav(tone, 16000, chunks=many), LIMITS, "messages.0.content.1", 16000)
    assert info.value.param == "messages.0.content.1"


def test_data_uris_and_their_size_limit() -> None:
    kind, data = decode_data_uri("data:image/png;base64,aGk=", "p", LIMITS)
    assert (kind, data) == ("image/png", b"hi")
    with pytest.raises(MediaError, match="not a base64 data: URI"):
        decode_data_uri("data:image/png,hi", "p", LIMITS)
    with pytest.raises(MediaError, match="over 4 bytes"):
        decode_data_uri("data:;base64," + "aGVsbG8gd29ybGQ=", "p", MediaLimits(max_bytes=4))


def test_a_path_is_read_only_up_to_the_limit_and_a_bad_one_is_a_media_error(
    tmp_path: Path,
) -> None:
    """The Python API's image given by a path. Found by review: the file was read whole
    (``read_bytes``) once its ``stat`` size passed, and a device or pipe has none:
    ``/dev/zero`` was read until memory ran out. Now at most ``max_bytes`` + 1 bytes are read
    (a pipe's writer is cut off past them), and a path holding a NUL, a ``ValueError`` out of
    ``os.stat``, is a ``MediaError`` like every other unreadable path."""
    limits = MediaLimits(max_bytes=1000)
    fifo = tmp_path / "endless"
    os.mkfifo(fifo)
    cap = 1 << 20  # far past the limit and a pipe's buffer (64 KiB)
    written = 0
    failed: list[BaseException] = []

    def feed() -> None:
        nonlocal written
        try:
            with open(fifo, "wb", buffering=0) as out:
                while written < cap:
                    written += out.write(bytes(4096))
        except BrokenPipeError:  # the reader stopped reading: what the limit wants
            pass
        except BaseException as exc:  # pragma: no cover - reported below
            failed.append(exc)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        with pytest.raises(MediaError, match="is over 1000 bytes") as info:
            load_media(str(fifo), "image", limits, "p")
    finally:
        writer.join()
    assert not failed and written < cap, written
    assert info.value.param == "p"
    with pytest.raises(MediaError, match="cannot read") as info:
        load_media("a\0b.png", "image", limits, "p")
    assert info.value.param == "p"
