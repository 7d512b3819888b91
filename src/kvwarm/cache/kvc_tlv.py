"""The TLV section of a KVC file (``cache/kvc.py``): its tags, their records and their checks.

A record is ``u8 tag, u32 length, value``. Tags 0x01..0x09 are erllama's; 0x0A.. are kvwarm's.
Unknown tags are skipped (a newer writer's business); a known tag twice, a record overrunning
its section, or a value of the wrong size is a ``CacheFormatError`` raised before the value is
used.
"""

from __future__ import annotations

import struct

from kvwarm.cache.types import TtlClass
from kvwarm.errors import CacheFormatError

TAG_FINGERPRINT = 0x01
TAG_FINGERPRINT_MODE = 0x02
TAG_QUANT = 0x03
TAG_CTX_HASH = 0x04
TAG_HOSTNAME = 0x05
TAG_VERSION = 0x06
TAG_REASON_DETAIL = 0x07
TAG_TOKEN_COUNT = 0x08
TAG_TOKENS = 0x09
TAG_LOGITS = 0x0A  # kvwarm: float32 LE logits after the last token
TAG_TTL_CLASS = 0x0B  # kvwarm: TtlClass byte
TAG_CANONICAL = 0x0C  # kvwarm: u32, leading tokens whose KV came from aligned prefill
TAG_CHUNK_LENS = 0x0D  # kvwarm v2: u32 token count of each chunk (the row is a manifest)
TAG_CHUNKS = 0x0E  # kvwarm v2: the chunk keys, 32 bytes each, in token order
REQUIRED = (
    TAG_FINGERPRINT,
    TAG_FINGERPRINT_MODE,
    TAG_QUANT,
    TAG_CTX_HASH,
    TAG_TOKEN_COUNT,
    TAG_TOKENS,
)
_KNOWN = frozenset((*REQUIRED, TAG_HOSTNAME, TAG_VERSION, TAG_REASON_DETAIL, TAG_LOGITS,
                    TAG_TTL_CLASS, TAG_CANONICAL, TAG_CHUNK_LENS, TAG_CHUNKS))  # fmt: skip
_HEAD = struct.Struct("<BI")
_U32 = struct.Struct("<I")
U32_MAX = 0xFFFF_FFFF


def bad(msg: str) -> CacheFormatError:
    """The error for a malformed file."""
    return CacheFormatError(f"malformed KVC: {msg}")


def record(tag: int, value: bytes | bytearray | memoryview) -> bytes:
    """One encoded record."""
    return _HEAD.pack(tag, memoryview(value).nbytes) + bytes(value)


def parse_records(mv: memoryview) -> dict[int, memoryview]:
    """The known tags of a TLV section, each a view of its value."""
    tags: dict[int, memoryview] = {}
    pos, end = 0, mv.nbytes
    while pos < end:
        if end - pos < _HEAD.size:
            raise bad("truncated TLV record header")
        tag, vlen = _HEAD.unpack_from(mv, pos)
        pos += _HEAD.size
        if vlen > end - pos:
            raise bad(f"TLV 0x{tag:02x} declares {vlen} bytes, {end - pos} left")
        if tag in _KNOWN:  # unknown tags: skipped, a newer writer's business
            if tag in tags:
                raise bad(f"duplicate TLV tag 0x{tag:02x}")
            tags[tag] = mv[pos : pos + vlen]
        pos += vlen
    return tags


def text(tags: dict[int, memoryview], tag: int) -> str:
    """A UTF-8 tag's value ("" when absent)."""
    v = tags.get(tag)
    if v is None:
        return ""
    try:
        return bytes(v).decode("utf-8")
    except UnicodeDecodeError:
        raise bad(f"TLV 0x{tag:02x} is not UTF-8") from None


def decode_tokens(v: memoryview) -> tuple[int, ...]:
    """The token ids of a ``TAG_TOKENS`` value (its length already checked)."""
    if not v.nbytes:
        return ()
    return struct.unpack(f"<{v.nbytes // 4}I", v)


def optional_fields(
    tags: dict[int, memoryview], count: int
) -> tuple[TtlClass, bytes | None, int | None]:
    """The TTL class, logits and canonical token count a row records, checked."""
    ttl = TtlClass.SHORT
    if TAG_TTL_CLASS in tags:
        ttl_v = tags[TAG_TTL_CLASS]
        if ttl_v.nbytes != 1 or ttl_v[0] not in TtlClass._value2member_map_:
            raise bad("bad TTL class")
        ttl = TtlClass(ttl_v[0])
    logits: bytes | None = None
    if TAG_LOGITS in tags:
        if tags[TAG_LOGITS].nbytes % 4:
            raise bad("logits length is not a multiple of 4")
        logits = bytes(tags[TAG_LOGITS])
    canonical: int | None = None
    if TAG_CANONICAL in tags:
        can_v = tags[TAG_CANONICAL]
        if can_v.nbytes != 4:
            raise bad("canonical token count has the wrong size")
        (canonical,) = _U32.unpack_from(can_v, 0)
        if canonical > count:
            raise bad("canonical token count exceeds token count")
    return ttl, logits, canonical


def check_chunks(
    n_tokens: int, lens: tuple[int, ...], chunks: tuple[bytes, ...], payload_len: int
) -> None:
    """``ValueError`` unless ``chunks`` (of ``lens`` tokens) cover the row's ``n_tokens``
    exactly and a manifest's payload is empty (or there are no chunks at all)."""
    if len(lens) != len(chunks) or any(len(k) != 32 for k in chunks):
        raise ValueError("chunk lengths and 32-byte chunk keys must pair up")
    if not chunks:
        return
    if any(not 0 < n <= U32_MAX for n in lens) or sum(lens) != n_tokens:
        raise ValueError("chunk lengths do not cover the row's tokens")
    if payload_len:
        raise ValueError("a manifest holds its KV in its chunks: its payload must be empty")


def chunk_records(lens: tuple[int, ...], chunks: tuple[bytes, ...]) -> list[bytes]:
    """A manifest's two records (none for a whole-blob row)."""
    if not chunks:
        return []
    packed = struct.pack(f"<{len(lens)}I", *lens)
    return [record(TAG_CHUNK_LENS, packed), record(TAG_CHUNKS, b"".join(chunks))]


def chunk_tags(
    tags: dict[int, memoryview], version: int, count: int, payload_len: int
) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
    """A manifest's chunk lengths and keys, checked against the row; ((), ()) for a blob row."""
    lens_v, keys_v = tags.get(TAG_CHUNK_LENS), tags.get(TAG_CHUNKS)
    if lens_v is None and keys_v is None:
        return (), ()
    if version < 2 or lens_v is None or keys_v is None:
        raise bad("chunk lengths and chunk keys must come together, in a version-2 file")
    if lens_v.nbytes % 4 or keys_v.nbytes % 32 or lens_v.nbytes // 4 != keys_v.nbytes // 32:
        raise bad("chunk length or chunk key list has the wrong size")
    if not lens_v.nbytes:
        raise bad("a manifest names no chunk")
    lens = struct.unpack(f"<{lens_v.nbytes // 4}I", lens_v)
    raw = bytes(keys_v)
    chunks = tuple(raw[i : i + 32] for i in range(0, len(raw), 32))
    try:
        check_chunks(count, lens, chunks, payload_len)
    except ValueError as exc:
        raise bad(str(exc)) from None
    return lens, chunks
