"""Images and audio in prompts: decoded in Python, under limits, before anything reaches C.

A client's file (PNG, JPEG, WAV ...) is never handed to llama.cpp: ``decode_image`` turns it
into raw RGB pixels with Pillow and ``decode_audio`` a WAV file into float32 mono samples, each
under ``MediaLimits`` (bytes, pixels, seconds, formats), so a truncated, oversized or hostile
file is a ``MediaError`` (a 400 naming the part) and a decompression bomb is refused from its
header, before its pixels are decoded. What one request's media take decoded, all items
together, is bounded too (``max_request_bytes``, counted by a ``MediaBudget``): an image past it
is refused from its header, a clip from its frame count, before their samples are made. The
projector (``mtmd``) then gets those pixels or samples (``mtmd_bitmap_init``), never the file.

Each decoded item carries its ``digest``: a sha-256 of its kind, size and content (pixels or
samples), the identity its prompt span is cached under (``kvwarm.tokens.span_ids``). Two files
that decode to the same pixels (a PNG and its re-encoding) share their KV; a one-pixel change
shares nothing past the span's start.

Invariant: pure; imports only ``kvwarm.errors`` (Pillow and numpy where decoding needs them).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from kvwarm.errors import MediaError

if TYPE_CHECKING:
    from PIL.Image import Image as PilPicture

__all__ = [
    "AUDIO_FORMATS",
    "IMAGE_FORMATS",
    "MAX_JPEG_SCANS",
    "MAX_WAV_CHUNKS",
    "MIN_AUDIO_SAMPLES",
    "Audio",
    "Image",
    "Media",
    "MediaBudget",
    "MediaError",
    "MediaKind",
    "MediaLimits",
    "decode_audio",
    "decode_data_uri",
    "decode_image",
    "load_media",
    "too_many",
]

MediaKind = Literal["image", "audio"]

#: The image formats Pillow decodes that a limit may allow (Pillow's format names, lower case).
IMAGE_FORMATS = ("png", "jpeg", "webp", "gif", "bmp")
#: The audio formats ``decode_audio`` reads.
AUDIO_FORMATS = ("wav",)
#: The fewest samples a clip may have: mtmd asserts (GGML_ASSERT, an abort) more than one.
MIN_AUDIO_SAMPLES = 2
#: The most scans (SOS markers) a JPEG may have. libjpeg goes over every block of the image
#: at each scan, so a file of many empty scans is a CPU bomb (found by review: 50,000 scans
#: of 10 bytes, a 1.4 MB file of 1024x1024 pixels, took 5 s to decode; 8 MB of them at 16M
#: pixels, minutes). Encoders write about 10 (progressive) or 1 (baseline).
MAX_JPEG_SCANS = 500


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What a request's media may be. ``max_bytes`` bounds each encoded file, ``max_pixels``
    each image's width x height (read from its header, before it is decoded: a decompression
    bomb never allocates), ``max_audio_s`` each clip's length, ``max_items`` the media of one
    request, ``max_request_bytes`` what they take decoded, together (RGB pixels, 3 bytes
    each; float32 samples, 4 bytes each); ``formats`` the image and audio formats allowed
    (``IMAGE_FORMATS``, ``AUDIO_FORMATS``)."""

    max_bytes: int = 20 << 20
    max_pixels: int = 32 << 20
    max_audio_s: float = 600.0
    max_items: int = 16
    formats: tuple[str, ...] = (*IMAGE_FORMATS, *AUDIO_FORMATS)
    max_request_bytes: int = 256 << 20

    def validate(self) -> None:
        from kvwarm.errors import ConfigError

        # Each named as its setting (media_<field>; found by review: "media limits must be
        # positive" named none of the three).
        for name, value, least in (
            ("media_max_bytes", self.max_bytes, 1),
            ("media_max_pixels", self.max_pixels, 1),
            ("media_max_items", self.max_items, 0),
        ):
            if value < least:
                raise ConfigError(f"{name} must be >= {least}, got {value}")
        if self.max_request_bytes < 1:
            raise ConfigError("media_max_request_bytes must be >= 1")
        if not self.max_audio_s > 0:
            raise ConfigError("media_max_audio_s must be > 0")
        unknown = sorted(set(self.formats) - set(IMAGE_FORMATS) - set(AUDIO_FORMATS))
        if unknown:
            raise ConfigError(
                f"media_formats: unknown formats {', '.join(unknown)} (known: "
                f"{', '.join((*IMAGE_FORMATS, *AUDIO_FORMATS))})"
            )


def _digest(kind: bytes, header: bytes, data: bytes) -> bytes:
    h = hashlib.sha256(b"kvwarm-media\0" + kind + b"\0" + header)
    h.update(data)
    return h.digest()


@dataclass(frozen=True, slots=True, eq=False)
class Image:
    """Decoded pixels: ``rgb`` is ``width * height * 3`` bytes, row-major RGBRGB..."""

    width: int
    height: int
    rgb: bytes = field(repr=False)
    digest: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.width < 1 or self.height < 1 or len(self.rgb) != 3 * self.width * self.height:
            raise ValueError(f"an image of {self.width}x{self.height} has {len(self.rgb)} bytes")
        header = struct.pack("<II", self.width, self.height)
        object.__setattr__(self, "digest", _digest(b"image", header, self.rgb))

    @property
    def kind(self) -> MediaKind:
        return "image"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Image) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)


@dataclass(frozen=True, slots=True, eq=False)
class Audio:
    """Decoded audio: ``samples`` are float32 (little-endian) mono PCM at ``sample_rate``."""

    samples: bytes = field(repr=False)
    sample_rate: int
    digest: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.sample_rate < 1 or not self.samples or len(self.samples) % 4:
            raise ValueError("audio needs whole float32 samples and a positive sample rate")
        header = struct.pack("<I", self.sample_rate)
        object.__setattr__(self, "digest", _digest(b"audio", header, self.samples))

    @property
    def kind(self) -> MediaKind:
        return "audio"

    @property
    def n_samples(self) -> int:
        return len(self.samples) // 4

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Audio) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)


Media = Image | Audio


class MediaBudget:
    """The decoded bytes one request's media may still take (``max_request_bytes``). Not
    thread-safe: one request's media are read on one thread, in order."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limit = limits.max_request_bytes
        self.used = 0

    def take(self, n: int, where: str, what: str) -> None:
        """Count ``n`` more decoded bytes for ``where`` (``what`` it is, for the message);
        ``MediaError`` if they do not fit, before they are decoded."""
        if self.used + n > self.limit:
            raise MediaError(
                f"{where} ({what}) takes {n} bytes decoded; with the {self.used} this "
                f"request's earlier media take, that is above this server's limit of "
                f"{self.limit} per request (setting media_max_request_bytes)",
                param=where,
            )
        self.used += n


def too_many(where: str, limit: int) -> MediaError:
    """The error for a request's medium ``where`` past its ``limit`` (``max_items``)."""
    return MediaError(
        f"{where}: a request may hold at most {limit} images and audio clips (setting "
        "media_max_items)",
        param=where,
    )


def _check_size(data: bytes, limits: MediaLimits, where: str) -> None:
    if not data:
        raise MediaError(f"{where} is empty", param=where)
    if len(data) > limits.max_bytes:
        raise MediaError(
            f"{where} is {len(data)} bytes, above this server's limit of {limits.max_bytes} "
            "(setting media_max_bytes)",
            param=where,
        )


def decode_image(
    data: bytes, limits: MediaLimits, where: str, budget: MediaBudget | None = None
) -> Image:
    """The RGB pixels of an encoded image; ``MediaError`` naming ``where`` for anything that is
    not a whole image of an allowed format within the limits. Pillow reads the header first:
    an image over ``max_pixels``, or past what ``budget`` (its request's) has left, is refused
    before its pixels are decoded; a PNG must hold every row its header names
    (``_check_png_rows``). Alpha is dropped and
    a palette expanded (as llama.cpp's own loader does), an animation gives its first frame."""
    _check_size(data, limits, where)
    import warnings

    from PIL import Image as PilImage
    from PIL import UnidentifiedImageError

    allowed = [f for f in limits.formats if f in IMAGE_FORMATS]
    if not allowed:
        raise MediaError(f"{where}: this server accepts no images", param=where)
    try:
        with warnings.catch_warnings():
            # Pillow warns (and errs past 2x) on its own bomb limit; ours is checked below.
            warnings.simplefilter("ignore", PilImage.DecompressionBombWarning)
            with PilImage.open(io.BytesIO(data), formats=[f.upper() for f in allowed]) as img:
                width, height = img.size
                if width < 1 or height < 1:
                    raise MediaError(f"{where} has no pixels ({width}x{height})", param=where)
                if width * height > limits.max_pixels:
                    raise MediaError(
                        f"{where} is {width}x{height} pixels, above this server's limit of "
                        f"{limits.max_pixels} (setting media_max_pixels)",
                        param=where,
                    )
                if budget is not None:
                    budget.take(3 * width * height, where, f"{width}x{height} pixels")
                # Counted in the whole file: FF DA only ever starts a scan in entropy-coded
                # data (an FF there is written FF 00), so only a segment's payload (an
                # EXIF thumbnail's scans) can count more than the image has.
                scans = data.count(b"\xff\xda") if img.format in ("JPEG", "MPO") else 0
                if scans > MAX_JPEG_SCANS:
                    raise MediaError(
                        f"{where} is a JPEG of {scans} scans, more than the {MAX_JPEG_SCANS} "
                        "this server decodes (each scan goes over the whole image)",
                        param=where,
                    )
                img.load()  # decodes every byte now: a truncated file fails here
                if img.format == "PNG":
                    _check_png_rows(data, where)
                pixels = _rgb(img)
    except MediaError:
        raise
    except UnidentifiedImageError as exc:
        raise MediaError(
            f"{where} is not an image of an allowed format ({', '.join(allowed)})", param=where
        ) from exc
    except PilImage.DecompressionBombError as exc:
        raise MediaError(f"{where} is too large to decode: {exc}", param=where) from exc
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, MemoryError) as exc:
        raise MediaError(f"{where} is not a whole image: {exc}", param=where) from exc
    return Image(width, height, pixels)


#: Adam7's passes: (first column, first row, column step, row step).
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
          (0, 1, 1, 2))  # fmt: skip
#: Samples per pixel of each PNG colour type.
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _check_png_rows(data: bytes, where: str) -> None:
    """``MediaError`` if the pixel data (IDAT) of the PNG ``data``, which Pillow decoded,
    inflates to fewer bytes than its header's rows take. Found by review: Pillow takes a
    zlib stream that ends early as the image's end and leaves the rows it lacks black, a
    picture that is silently not the file's (llama.cpp's own loader refuses it: "not enough
    pixels"). An animated PNG's too (acTL; once skipped, found by review: a half-black first
    frame passed): Pillow's first frame is its IDAT image, which llama.cpp's loader reads as
    the whole canvas, so its rows are counted as this one's (a first fcTL smaller than the
    canvas, which the format forbids, is refused with it)."""
    width, height, depth, colour, interlace = struct.unpack_from(">IIBBxxB", data, 16)
    bits = _PNG_CHANNELS.get(colour, 0) * depth
    passes = _ADAM7 if interlace else ((0, 0, 1, 1),)
    wanted = 0
    for x0, y0, dx, dy in passes:
        cols, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if cols > 0 and rows > 0:
            wanted += rows * (1 + -(-cols * bits // 8))
    inflate = zlib.decompressobj()
    got, at = 0, 8
    while at + 8 <= len(data) and got < wanted:
        size, kind = struct.unpack_from(">I4s", data, at)
        if kind == b"IDAT":
            chunk = data[at + 8 : at + 8 + size]
            while chunk and got < wanted:  # a MiB at a time: counted, never all held
                try:
                    got += len(inflate.decompress(chunk, min(wanted - got, 1 << 20)))
                except zlib.error as exc:
                    raise MediaError(f"{where} is not a whole image: {exc}", param=where) from exc
                chunk = inflate.unconsumed_tail
        at += 12 + size
    if got < wanted:
        raise MediaError(
            f"{where} is not a whole image: its pixel data ends after {got} of the {wanted} "
            "bytes its rows take",
            param=where,
        )


def _rgb(img: PilPicture) -> bytes:
    """``img``'s pixels as RGB bytes. A 16-bit greyscale PNG (Pillow's mode ``I;16``, or
    ``I``) keeps each value's high byte, as llama.cpp's loader (stb_image) and Pillow's own
    16-bit colour modes do: Pillow's conversion of those modes to RGB clips every value above
    255, a picture all but white."""
    if img.mode.startswith("I"):
        wide = np.asarray(img, dtype=np.int64)
        grey = (np.clip(wide, 0, 0xFFFF) >> 8).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2).tobytes()
    return img.convert("RGB").tobytes()


def decode_audio(
    data: bytes,
    limits: MediaLimits,
    where: str,
    sample_rate: int,
    budget: MediaBudget | None = None,
) -> Audio:
    """float32 mono samples at ``sample_rate`` (the projector's) of a WAV file of integer or
    float PCM: channels are averaged, other rates resampled linearly. ``MediaError`` naming
    ``where`` for anything else, and for a clip too long or past what ``budget`` has left:
    both read from its header and its data chunk's size, before a sample is made."""
    _check_size(data, limits, where)
    if "wav" not in limits.formats:
        raise MediaError(f"{where}: this server accepts no audio", param=where)
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise MediaError(f"{where} is not a WAV file (the audio format read)", param=where)
    try:
        wav = _read_wav(data)
    except (ValueError, struct.error) as exc:
        raise MediaError(f"{where} is not a whole WAV file: {exc}", param=where) from exc
    frames, rate = wav.frames, wav.rate
    if frames == 0:
        raise MediaError(f"{where} holds no samples", param=where)
    if frames / rate > limits.max_audio_s:
        raise MediaError(
            f"{where} is {frames / rate:.1f} s long, above this server's limit of "
            f"{limits.max_audio_s:g} s (setting media_max_audio_s)",
            param=where,
        )
    if budget is not None:
        out = frames if rate == sample_rate else max(1, round(frames * sample_rate / rate))
        budget.take(4 * out, where, f"{frames / rate:.1f} s of audio")
    samples = wav.samples()
    if wav.channels == 1:  # a mean over one channel is that channel: no copy of it made
        mono = samples
    else:
        mono = samples.reshape(frames, wav.channels).mean(axis=1, dtype=np.float64)
    return _clip_at(mono, rate, sample_rate, where)


def _clip_at(mono: npt.NDArray[np.floating], rate: int, sample_rate: int, where: str) -> Audio:
    """The clip of samples ``mono`` (at ``rate``) at ``sample_rate``, resampled linearly;
    ``MediaError`` for one mtmd cannot take: a single sample (mtmd_tokenize asserts more, a
    GGML_ASSERT that aborts the process) or samples that are not finite numbers (NaN or
    infinite floats, or float64 ones past float32's range: the projector's embeddings would
    be NaN, and the reply nothing real)."""
    if rate != sample_rate:
        n_out = max(1, round(mono.size * sample_rate / rate))
        mono = np.interp(np.arange(n_out) * (rate / sample_rate), np.arange(mono.size), mono)
    if mono.size < MIN_AUDIO_SAMPLES:
        raise MediaError(
            f"{where} is too short: {mono.size} sample at {sample_rate} Hz (at least "
            f"{MIN_AUDIO_SAMPLES})",
            param=where,
        )
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(mono, dtype="<f4")
    if not np.isfinite(out).all():
        raise MediaError(f"{where} holds samples that are not finite numbers", param=where)
    return Audio(out.tobytes(), sample_rate)


#: The most chunks a WAV file may have. Found by review: every chunk was listed (a copy of
#: its bytes each) before the fmt was looked at, so 20 MB of empty chunks, 2.5M of them, took
#: seconds and 200 MB per clip. Tools write fmt, data and a few others (LIST, fact, bext,
#: cue, JUNK...).
MAX_WAV_CHUNKS = 1024


@dataclass(frozen=True, slots=True)
class _Wav:
    """A WAV file's header and its data chunk, its samples not yet made (``samples``).
    ``dtype`` is a numpy type of whole samples, or ``"<i3"`` for packed 24-bit ones."""

    payload: memoryview
    dtype: str
    channels: int
    rate: int

    @property
    def frame_bytes(self) -> int:
        return self.channels * (3 if self.dtype == "<i3" else np.dtype(self.dtype).itemsize)

    @property
    def frames(self) -> int:
        """Whole frames in the data chunk (a last frame cut short is dropped)."""
        return len(self.payload) // self.frame_bytes

    def samples(self) -> npt.NDArray[np.float64]:
        """Every sample of the whole frames, flat, as float in [-1, 1] (float data as is)."""
        raw = self.payload[: self.frames * self.frame_bytes]
        if self.dtype == "<i3":
            b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)
            packed = b[:, 0].astype(np.int64) | (b[:, 1].astype(np.int64) << 8)
            packed = packed | (b[:, 2].astype(np.int64) << 16)
            signed = np.where(packed >= 1 << 23, packed - (1 << 24), packed)
            return signed.astype(np.float64) / float(1 << 23)
        values = np.frombuffer(raw, dtype=self.dtype).astype(np.float64)
        if self.dtype == "u1":
            values -= 128.0
            values /= 128.0
        elif self.dtype in ("<i2", "<i4"):
            values /= 32768.0 if self.dtype == "<i2" else float(1 << 31)
        return values


def _read_wav(data: bytes) -> _Wav:
    """The header and data chunk of integer PCM (8-bit unsigned, 16, 24 or 32-bit signed) or
    IEEE float (32, 64-bit) WAV data, plain or WAVE_FORMAT_EXTENSIBLE. Read from its chunks
    here, not by ``wave``: found by review, the ``wave`` of Python 3.11 (the oldest kvwarm
    runs on) refuses an extensible integer WAV ("unknown format: 65534"), what many tools
    write for 24-bit or multichannel audio, and refuses float WAVs on every version."""
    fmt: tuple[int, int, int, int] | None = None
    payload: memoryview | None = None
    for name, body in _chunks(memoryview(data)):
        if name == b"fmt " and fmt is None:
            if len(body) < 16:
                raise ValueError("fmt chunk too short")
            tag, channels, rate = struct.unpack_from("<HHI", body, 0)
            bits: int = struct.unpack_from("<H", body, 14)[0]
            if tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: its subformat's first two bytes
                if len(body) < 26:
                    raise ValueError("extensible fmt chunk too short")
                tag = struct.unpack_from("<H", body, 24)[0]
            fmt = (tag, channels, rate, bits)
        elif name == b"data" and payload is None:
            payload = body
    if fmt is None:
        raise ValueError("no fmt chunk")
    if payload is None:
        raise ValueError("no data chunk")
    tag, channels, rate, bits = fmt
    if rate < 1 or channels < 1:
        raise ValueError(f"{rate} Hz, {channels} channels")
    if tag == 3:
        dtype = {32: "<f4", 64: "<f8"}.get(bits)
        if dtype is None:
            raise ValueError(f"{bits}-bit float samples")
        return _Wav(payload, dtype, channels, rate)
    if tag != 1:
        raise ValueError(f"format {tag:#x} (integer PCM and IEEE float are read)")
    int_dtype = {1: "u1", 2: "<i2", 3: "<i3", 4: "<i4"}.get((bits + 7) // 8)
    if int_dtype is None:
        raise ValueError(f"{bits}-bit samples")
    return _Wav(payload, int_dtype, channels, rate)


def _chunks(data: memoryview) -> list[tuple[bytes, memoryview]]:
    """The (name, body) chunks of a RIFF file's ``data``, bodies as views (no copy); more
    than ``MAX_WAV_CHUNKS`` is a ``ValueError`` as soon as they are counted."""
    out: list[tuple[bytes, memoryview]] = []
    at = 12
    while at + 8 <= len(data):
        if len(out) == MAX_WAV_CHUNKS:
            raise ValueError(f"more than the {MAX_WAV_CHUNKS} chunks a WAV file may have")
        name, size = bytes(data[at : at + 4]), struct.unpack_from("<I", data, at + 4)[0]
        body = data[at + 8 : at + 8 + size]
        if len(body) != size:
            raise ValueError(f"chunk {name!r} is cut short")
        out.append((name, body))
        at += 8 + size + (size & 1)
    return out


_DATA_URI = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.I)


def decode_data_uri(uri: str, where: str, limits: MediaLimits) -> tuple[str, bytes]:
    """(media type, bytes) of a base64 ``data:`` URI; ``MediaError`` if it is not one or its
    payload is over ``max_bytes`` (checked before decoding: base64 is 4/3 the size)."""
    found = _DATA_URI.match(uri)
    if found is None:
        raise MediaError(f"{where} is not a base64 data: URI", param=where)
    return found["type"] or "", decode_base64(uri[found.end() :], where, limits)


def decode_base64(text: str, where: str, limits: MediaLimits) -> bytes:
    """The bytes of base64 ``text`` (standard alphabet, whitespace allowed); ``MediaError``
    if it is not base64 or decodes to more than ``max_bytes``."""
    compact = "".join(text.split())
    if len(compact) * 3 // 4 > limits.max_bytes + 3:
        raise MediaError(
            f"{where} is over {limits.max_bytes} bytes (setting media_max_bytes)", param=where
        )
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{where} is not valid base64: {exc}", param=where) from exc


def load_media(
    value: object,
    kind: MediaKind,
    limits: MediaLimits,
    where: str,
    *,
    sample_rate: int = 16000,
    budget: MediaBudget | None = None,
) -> Media:
    """The Python API's media: a decoded ``Image`` as given, a decoded ``Audio`` at
    ``sample_rate`` (resampled from another rate: mtmd reads samples at its own), else
    encoded bytes, a path to a file, or a base64 ``data:`` URI, decoded under ``limits``
    and counted against ``budget`` (its request's; what the caller decoded is its own)."""
    if isinstance(value, Image | Audio):
        if value.kind != kind:
            raise MediaError(f"{where} is {value.kind}, not {kind}", param=where)
        if isinstance(value, Audio):
            samples = np.frombuffer(value.samples, dtype="<f4")
            clip = _clip_at(samples, value.sample_rate, sample_rate, where)
            return value if clip == value else clip
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
    elif isinstance(value, str) and value.startswith("data:"):
        data = decode_data_uri(value, where, limits)[1]
    elif isinstance(value, str | os.PathLike):
        path = Path(value)
        over = MediaError(
            f"{where}: {str(path)!r} is over {limits.max_bytes} bytes (media_max_bytes)",
            param=where,
        )
        try:
            if path.stat().st_size > limits.max_bytes:
                raise over
            # At most one byte past the limit: a device or pipe has no stat size, and
            # /dev/zero read whole never ended (found by review).
            with path.open("rb") as file:
                data = file.read(limits.max_bytes + 1)
        except (OSError, ValueError) as exc:  # ValueError: a path holding a NUL
            raise MediaError(f"{where}: cannot read {str(path)!r}: {exc}", param=where) from exc
        if len(data) > limits.max_bytes:
            raise over
    else:
        raise MediaError(
            f"{where} must be bytes, a path, a data: URI or a decoded kvwarm.media.{kind.title()}"
            f", not {type(value).__name__}",
            param=where,
        )
    if kind == "image":
        return decode_image(data, limits, where, budget)
    return decode_audio(data, limits, where, sample_rate, budget)


def media_kinds(items: Sequence[Media]) -> list[str]:
    """The kinds among ``items``, sorted, each once (for messages)."""
    return sorted({m.kind for m in items})
