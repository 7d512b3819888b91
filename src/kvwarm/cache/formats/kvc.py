"""The KVC file format (erllama's layout, kvwarm tags). Pure bytes in, bytes out; no I/O.

Layout, little-endian throughout::

    [0..47]   header   magic "KVC", u8 version=2 (3, 4), u8 quant_bits, u8 save_reason, u8[2] zero,
                       u32 token count, u32 hit count*, u32 context size, u8[4] zero,
                       u64 created (unix s), u64 last used* (unix s), u64 payload bytes
    [48..71]  trailer  u64 payload offset, u64 payload length, u32 payload CRC32C,
                       u32 meta CRC32C (erllama leaves this word reserved)
    [72..]    prompt   u32 length + UTF-8 (observability only; untrusted, decoded leniently;
                       empty unless the cache is configured to store prompt text)
    [..]      TLV      u32 length, then (u8 tag, u32 length, value) records (``kvc_tlv.py``)
    [..end]   payload  opaque KV bytes

A version-2 file is a *manifest* when its TLV lists chunk lengths and chunk keys: the row's KV
is those content-addressed chunks (``cache/formats/chunkfmt.py``) in order, their lengths summing to
the token count, and its payload is empty. Without them the payload is the whole KV blob. A
version-3 file is a manifest whose payload is the row's *rest*: the state after the chunked KV
cache that cannot be cut (an iSWA model's window, a hybrid model's recurrent state; the blob
is the joined chunks followed by it). Only such a manifest is written as version 3. A
version-4 file is a manifest whose rest is itself in chunks (an iSWA window: ``RestChunks``,
three tags: where the window starts and its first chunk starts, the chunks' lengths, their
keys); its payload is empty. A version-1 file (an older kvwarm) holds no chunk tags and is read
as such a whole-blob row; an older kvwarm refuses versions it does not know, so it never
mistakes a manifest for a row with no KV, nor restores chunks without their rest.

Invariants:
- The payload CRC covers the payload; the meta CRC covers every byte before the payload except
  the two fields marked * (hit count, last used), which are rewritten in place on hits. So a
  single flipped bit anywhere but those 12 bytes makes ``parse`` fail.
- The parser checks every declared length against the bytes present before slicing, and raises
  ``CacheFormatError`` -- never IndexError, struct.error, UnicodeDecodeError or MemoryError.
- ``build_prefix`` returns only the bytes before the payload, so a multi-MB payload is never
  concatenated into a bigger buffer; ``parse`` returns the payload as a zero-copy view.

The TLV section of a KVC file (``cache/formats/kvc.py``): its tags, their records and their checks.

A record is ``u8 tag, u32 length, value``. Tags 0x01..0x09 are erllama's; 0x0A.. are kvwarm's.
Unknown tags are skipped (a newer writer's business); a known tag twice, a record overrunning
its section, or a value of the wrong size is a ``CacheFormatError`` raised before the value is
used.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import struct
from dataclasses import dataclass

import crc32c as _crc32c

from kvwarm._version import __version__
from kvwarm.cache.formats.key import encode_tokens, namespace_prefix
from kvwarm.cache.types import (
    FingerprintMode,
    Namespace,
    PackLoc,
    RestChunks,
    SaveReason,
    SaveRequest,
    TtlClass,
)
from kvwarm.errors import CacheFormatError, CacheNewerFormatError

# --- The TLV section: its tags, their records and their checks.

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
TAG_REST_SPAN = 0x0F  # kvwarm v4: u32 the rest's first position, u32 its first chunk's start
TAG_REST_LENS = 0x10  # kvwarm v4: u32 token count of each of the rest's chunks
TAG_REST_CHUNKS = 0x11  # kvwarm v4: the rest's chunk keys, 32 bytes each, in token order
TAG_MEMORY = 0x12  # kvwarm: u8, the saving model's memory kind (``MEMORY_CODES``)
#: kvwarm, optional, in a manifest of a tier with packs: where its chunks lie in packs
#: (``pack_records``). A reader that does not know it skips it and looks for each chunk as
#: its own object: not there (a miss), or there and verified under its key (a chunk is
#: content-addressed: any object that verifies is its bytes). Never a wrong restore, so no
#: version bump.
TAG_PACKS = 0x13
#: Memory kinds by their ``TAG_MEMORY`` byte (``kvwarm.memory``); a code this table does not
#: know (a newer writer's kind) reads as "", as a row that does not say.
MEMORY_CODES = {1: "full", 2: "swa", 3: "recurrent", 4: "hybrid"}
_MEMORY_BYTES = {kind: code for code, kind in MEMORY_CODES.items()}
REQUIRED = (
    TAG_FINGERPRINT,
    TAG_FINGERPRINT_MODE,
    TAG_QUANT,
    TAG_CTX_HASH,
    TAG_TOKEN_COUNT,
    TAG_TOKENS,
)
_KNOWN = frozenset((*REQUIRED, TAG_HOSTNAME, TAG_VERSION, TAG_REASON_DETAIL, TAG_LOGITS,
                    TAG_TTL_CLASS, TAG_CANONICAL, TAG_CHUNK_LENS, TAG_CHUNKS, TAG_REST_SPAN,
                    TAG_REST_LENS, TAG_REST_CHUNKS, TAG_MEMORY, TAG_PACKS))  # fmt: skip
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


def memory_record(kind: str) -> list[bytes]:
    """The ``TAG_MEMORY`` record of a row saved by a model of ``kind`` (none for "")."""
    if not kind:
        return []
    if kind not in _MEMORY_BYTES:
        raise ValueError(f"unknown memory kind {kind!r}")
    return [record(TAG_MEMORY, bytes((_MEMORY_BYTES[kind],)))]


def memory_kind(tags: dict[int, memoryview]) -> str:
    """The memory kind a row records ("" when it does not say, or says one unknown here)."""
    v = tags.get(TAG_MEMORY)
    if v is None:
        return ""
    if v.nbytes != 1:
        raise bad("memory kind has the wrong size")
    return MEMORY_CODES.get(v[0], "")


def check_chunks(n_tokens: int, lens: tuple[int, ...], chunks: tuple[bytes, ...]) -> None:
    """``ValueError`` unless ``chunks`` (of ``lens`` tokens) cover the row's ``n_tokens``
    exactly (or there are no chunks at all)."""
    if len(lens) != len(chunks) or any(len(k) != 32 for k in chunks):
        raise ValueError("chunk lengths and 32-byte chunk keys must pair up")
    if not chunks:
        return
    if any(not 0 < n <= U32_MAX for n in lens) or sum(lens) != n_tokens:
        raise ValueError("chunk lengths do not cover the row's tokens")


def file_version(
    chunks: tuple[bytes, ...], payload_len: int, rest: RestChunks | None = None
) -> int:
    """The version a row is written as: 4 for a manifest with its rest in chunks, 3 for one
    with a rest in its payload, else 2."""
    if rest is not None:
        return 4
    return 3 if chunks and payload_len else VERSION


def chunk_records(
    lens: tuple[int, ...], chunks: tuple[bytes, ...], rest: RestChunks | None = None
) -> list[bytes]:
    """A manifest's records (none for a whole-blob row): its chunks, and its rest's."""
    if not chunks:
        return []
    packed = struct.pack(f"<{len(lens)}I", *lens)
    out = [record(TAG_CHUNK_LENS, packed), record(TAG_CHUNKS, b"".join(chunks))]
    if rest is not None:
        out += [
            record(TAG_REST_SPAN, struct.pack("<II", rest.first, rest.start)),
            record(TAG_REST_LENS, struct.pack(f"<{len(rest.lens)}I", *rest.lens)),
            record(TAG_REST_CHUNKS, b"".join(rest.keys)),
        ]
    return out


def rest_tags(
    tags: dict[int, memoryview], version: int, count: int, payload_len: int
) -> RestChunks | None:
    """A version-4 manifest's rest chunks, checked against the row; None for any other."""
    span, lens_v, keys_v = (tags.get(t) for t in (TAG_REST_SPAN, TAG_REST_LENS, TAG_REST_CHUNKS))
    if span is None and lens_v is None and keys_v is None:
        if version == 4:
            raise bad("a version-4 file names no rest chunks")
        return None
    if version != 4 or span is None or lens_v is None or keys_v is None:
        raise bad("a rest's span, chunk lengths and keys must come together, in version 4")
    if payload_len:
        raise bad(f"a version-4 manifest with a {payload_len}-byte payload")
    if span.nbytes != 8 or lens_v.nbytes % 4 or keys_v.nbytes % 32:
        raise bad("a rest's span, chunk lengths or chunk keys have the wrong size")
    if lens_v.nbytes // 4 != keys_v.nbytes // 32:
        raise bad("a rest's chunk lengths and keys do not pair up")
    first, start = struct.unpack_from("<II", span, 0)
    lens = struct.unpack(f"<{lens_v.nbytes // 4}I", lens_v)
    raw = bytes(keys_v)
    rest = RestChunks(first, start, lens, tuple(raw[i : i + 32] for i in range(0, len(raw), 32)))
    try:
        rest.check(count)
    except ValueError as exc:
        raise bad(str(exc)) from None
    return rest


def chunk_tags(
    tags: dict[int, memoryview], version: int, count: int, payload_len: int
) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
    """A manifest's chunk lengths and keys, checked against the row; ((), ()) for a blob row."""
    lens_v, keys_v = tags.get(TAG_CHUNK_LENS), tags.get(TAG_CHUNKS)
    if lens_v is None and keys_v is None:
        if version >= 3:
            raise bad(f"a version-{version} file names no chunks")
        return (), ()
    if version < 2 or lens_v is None or keys_v is None:
        raise bad("chunk lengths and chunk keys must come together, in a version-2+ file")
    if lens_v.nbytes % 4 or keys_v.nbytes % 32 or lens_v.nbytes // 4 != keys_v.nbytes // 32:
        raise bad("chunk length or chunk key list has the wrong size")
    if not lens_v.nbytes:
        raise bad("a manifest names no chunk")
    lens = struct.unpack(f"<{lens_v.nbytes // 4}I", lens_v)
    raw = bytes(keys_v)
    chunks = tuple(raw[i : i + 32] for i in range(0, len(raw), 32))
    try:
        check_chunks(count, lens, chunks)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if version < 4 and file_version(chunks, payload_len) != version:
        # A version-2 manifest holds its KV in its chunks alone; version 3 is one with a rest
        # (version 4's rest is in chunks: ``rest_tags`` checks it).
        raise bad(f"a version-{version} manifest with a {payload_len}-byte payload")
    return lens, chunks


_PACK_ENTRY = struct.Struct("<IIQ")  # pack index (``U32_MAX``: its own object), length, offset
_OWN = U32_MAX


def pack_records(locs: tuple[PackLoc | None, ...], n_refs: int) -> list[bytes]:
    """The ``TAG_PACKS`` record of a manifest naming ``n_refs`` chunks (none if no chunk is
    packed): u32 pack count, their 32-byte ids, then per chunk (the first cache's, then the
    rest's) u32 pack index (``U32_MAX``: stored as its own object), u32 length, u64 offset."""
    if not any(loc is not None for loc in locs):
        return []
    if len(locs) != n_refs:
        raise ValueError(f"{len(locs)} pack locations for {n_refs} chunks")
    ids: dict[bytes, int] = {}
    entries = []
    for loc in locs:
        if loc is None:
            entries.append(_PACK_ENTRY.pack(_OWN, 0, 0))
            continue
        if len(loc.pack) != 32 or not 0 < loc.length <= U32_MAX or not 0 <= loc.offset < 1 << 62:
            raise ValueError(f"bad pack location {loc}")
        entries.append(_PACK_ENTRY.pack(ids.setdefault(loc.pack, len(ids)), loc.length, loc.offset))
    value = _U32.pack(len(ids)) + b"".join(ids) + b"".join(entries)
    return [record(TAG_PACKS, value)]


def pack_tags(tags: dict[int, memoryview], n_refs: int) -> tuple[PackLoc | None, ...]:
    """A manifest's pack locations, checked against the ``n_refs`` chunks it names; () when
    it has none."""
    v = tags.get(TAG_PACKS)
    if v is None:
        return ()
    if not n_refs:
        raise bad("pack locations in a row that names no chunk")
    if v.nbytes < 4:
        raise bad("pack locations too short")
    (n_packs,) = _U32.unpack_from(v, 0)
    if not 0 < n_packs <= n_refs or v.nbytes != 4 + 32 * n_packs + _PACK_ENTRY.size * n_refs:
        raise bad("pack locations have the wrong size")
    raw = bytes(v[4 : 4 + 32 * n_packs])
    ids = [raw[i : i + 32] for i in range(0, len(raw), 32)]
    if len(set(ids)) != n_packs:
        raise bad("a pack listed twice")
    used: set[int] = set()
    locs: list[PackLoc | None] = []
    for at in range(4 + 32 * n_packs, v.nbytes, _PACK_ENTRY.size):
        index, length, offset = _PACK_ENTRY.unpack_from(v, at)
        if index == _OWN:
            if length or offset:
                raise bad("a chunk of its own object with a pack location")
            locs.append(None)
            continue
        if index >= n_packs or not length or offset >= 1 << 62:
            raise bad("a pack location out of range")
        used.add(index)
        locs.append(PackLoc(ids[index], offset, length))
    if len(used) != n_packs:
        raise bad("a pack no chunk lies in")
    return tuple(locs)


# collections.abc.Buffer is 3.12+; these are the buffers the cache actually passes around.
Buffer = bytes | bytearray | memoryview

__all__ = [
    "HEADER_SIZE",
    "HIT_COUNT_OFFSET",
    "LAST_USED_OFFSET",
    "MAX_META_BYTES",
    "PREFIX_FIXED_SIZE",
    "TRAILER_SIZE",
    "KvcFields",
    "KvcFile",
    "KvcMeta",
    "build_prefix",
    "check_chunks",
    "crc32c",
    "fields_from_request",
    "meta_end",
    "pack_hit_fields",
    "parse",
    "parse_meta",
]

log = logging.getLogger(__name__)

# Hardware CRC32C runs at ~13 GB/s here, the package's software table path at well under 1/10
# of that -- a load would then cost several memcpys. That is slow, not wrong, so warn once
# rather than refuse to start (CRC32C_SW_MODE=force exists for debugging on purpose).
if not _crc32c.hardware_based:
    log.warning("crc32c: hardware acceleration unavailable; cache loads will be CPU-bound")


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C (Castagnoli) of ``data``, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


MAGIC = b"KVC"
VERSION = 2  # every row but a manifest with a rest (``file_version``)
_READABLE_VERSIONS = (1, 2, 3, 4)
_HEADER = struct.Struct("<3sBBB2sIII4sQQQ")
_TRAILER = struct.Struct("<QQII")
HEADER_SIZE = _HEADER.size  # 48
TRAILER_SIZE = _TRAILER.size  # 24
PREFIX_FIXED_SIZE = HEADER_SIZE + TRAILER_SIZE  # 72
HIT_COUNT_OFFSET = 12  # u32, outside the meta CRC
LAST_USED_OFFSET = 32  # u64, outside the meta CRC
_META_CRC_OFFSET = 68
# Metadata is tokens (4 B each), logits (4 B x vocab) and short strings; anything declaring
# more than this is junk, refused before any allocation proportional to it.
MAX_META_BYTES = 256 << 20
_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True, slots=True)
class KvcFields:
    """Everything a KVC file records besides the payload."""

    namespace: Namespace
    tokens: tuple[int, ...]
    reason: SaveReason
    created: int  # unix seconds
    last_used: int  # unix seconds
    hits: int = 0
    quant_bits: int = 0
    context_size: int = 0
    fingerprint_mode: FingerprintMode = FingerprintMode.SAFE
    ttl_class: TtlClass = TtlClass.SHORT
    logits: bytes | None = None
    prompt_text: str = ""
    reason_detail: str = ""
    hostname: str = ""
    version: str = __version__
    canonical_tokens: int | None = None  # see RowInfo.canonical_tokens; None: all tokens
    memory: str = ""  # see RowInfo.memory
    # A manifest's chunk lengths (tokens) and keys, in order (both (): the payload is the
    # whole blob).
    chunk_lens: tuple[int, ...] = ()
    chunks: tuple[bytes, ...] = ()
    # A version-4 manifest's rest, in chunks (None: in the payload, or no rest).
    rest_chunks: RestChunks | None = None
    # Where each chunk it names lies in a pack (``TAG_PACKS``; () if none does).
    chunk_locs: tuple[PackLoc | None, ...] = ()


@dataclass(frozen=True, slots=True)
class KvcMeta:
    """A parsed prefix: the recorded fields, the key they replay to, and the payload's place."""

    key: bytes
    fields: KvcFields
    payload_offset: int
    payload_length: int
    payload_crc: int


@dataclass(frozen=True, slots=True)
class KvcFile:
    meta: KvcMeta
    payload: memoryview  # zero-copy view into the parsed buffer


def fields_from_request(req: SaveRequest, *, now: float) -> KvcFields:
    t = int(now)
    return KvcFields(
        namespace=req.namespace,
        tokens=req.tokens,
        reason=req.reason,
        created=t,
        last_used=t,
        quant_bits=req.quant_bits,
        context_size=req.context_size,
        fingerprint_mode=req.fingerprint_mode,
        ttl_class=req.ttl_class,
        logits=req.logits,
        prompt_text=req.prompt_text,
        hostname=socket.gethostname(),
        canonical_tokens=req.canonical_tokens,
        memory=req.memory,
        chunk_lens=req.chunk_lens,
        chunks=req.chunk_keys,
        rest_chunks=req.rest_chunks,
        chunk_locs=req.chunk_locs,
    )


def build_prefix(fields: KvcFields, payload: Buffer) -> bytes:
    """The bytes preceding ``payload`` in its file. ``ValueError`` for unencodable fields."""
    ns = fields.namespace
    ns_bytes = namespace_prefix(ns)  # validates the namespace
    token_bytes = encode_tokens(fields.tokens)
    if not 0 <= fields.quant_bits <= 255 or not 0 <= fields.context_size <= U32_MAX:
        raise ValueError("quant_bits or context_size out of range")
    if len(fields.tokens) > U32_MAX or fields.hits < 0:
        raise ValueError("token count or hits out of range")
    canonical = fields.canonical_tokens
    if canonical is not None and not 0 <= canonical <= len(fields.tokens):
        raise ValueError("canonical_tokens outside 0..len(tokens)")
    if fields.logits is not None and len(fields.logits) % 4:
        raise ValueError("logits must be float32 (length a multiple of 4)")
    records = [
        record(TAG_FINGERPRINT, ns.fingerprint),
        record(TAG_FINGERPRINT_MODE, bytes((int(fields.fingerprint_mode),))),
        record(TAG_QUANT, ns_bytes[32:33]),
        record(TAG_CTX_HASH, ns.ctx_hash),
        record(TAG_HOSTNAME, fields.hostname.encode()),
        record(TAG_VERSION, fields.version.encode()),
        record(TAG_REASON_DETAIL, fields.reason_detail.encode()),
        record(TAG_TTL_CLASS, bytes((int(fields.ttl_class),))),
        record(TAG_TOKEN_COUNT, _U32.pack(len(fields.tokens))),
        record(TAG_TOKENS, token_bytes),
    ]
    if fields.logits is not None:
        records.append(record(TAG_LOGITS, fields.logits))
    if canonical is not None:
        records.append(record(TAG_CANONICAL, _U32.pack(canonical)))
    records += memory_record(fields.memory)
    check_chunks(len(fields.tokens), fields.chunk_lens, fields.chunks)
    rest = fields.rest_chunks
    if rest is not None:
        if not fields.chunks or memoryview(payload).nbytes:
            raise ValueError("a rest in chunks needs chunks of its own, and no payload")
        rest.check(len(fields.tokens))
    records += chunk_records(fields.chunk_lens, fields.chunks, rest)
    n_refs = len(fields.chunks) + (len(rest.keys) if rest is not None else 0)
    records += pack_records(fields.chunk_locs, n_refs)
    section = b"".join(records)
    prompt = fields.prompt_text.encode("utf-8", "replace")
    body = _U32.pack(len(prompt)) + prompt + _U32.pack(len(section)) + section
    payload_len = memoryview(payload).nbytes
    offset = PREFIX_FIXED_SIZE + len(body)
    if offset > MAX_META_BYTES:
        raise ValueError(f"metadata of {offset} bytes exceeds {MAX_META_BYTES}")
    header = _HEADER.pack(
        MAGIC,
        file_version(fields.chunks, payload_len, rest),
        fields.quant_bits,
        int(fields.reason),
        b"\0\0",
        len(fields.tokens),
        min(fields.hits, U32_MAX),
        fields.context_size,
        b"\0" * 4,
        max(0, min(fields.created, _U64_MAX)),
        max(0, min(fields.last_used, _U64_MAX)),
        payload_len,
    )
    trailer_head = _TRAILER.pack(offset, payload_len, crc32c(payload), 0)[:20]
    meta_crc = _meta_crc(header, trailer_head, body)
    return header + trailer_head + _U32.pack(meta_crc) + body


def _meta_crc(header: Buffer, trailer_head: Buffer, body: Buffer) -> int:
    h = memoryview(header)
    c = crc32c(h[:HIT_COUNT_OFFSET])
    c = crc32c(h[HIT_COUNT_OFFSET + 4 : LAST_USED_OFFSET], c)
    c = crc32c(h[LAST_USED_OFFSET + 8 :], c)
    c = crc32c(trailer_head, c)
    return crc32c(body, c)


def pack_hit_fields(hits: int, last_used: float) -> tuple[bytes, bytes]:
    """Encoded (hit count, last used) for in-place rewrite at their offsets."""
    return (
        _U32.pack(max(0, min(int(hits), U32_MAX))),
        struct.pack("<Q", max(0, min(int(last_used), _U64_MAX))),
    )


def _as_bytes_view(buf: Buffer) -> memoryview:
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.itemsize != 1 or not mv.contiguous:
        raise bad("buffer must be contiguous bytes")
    return mv if mv.format == "B" else mv.cast("B")


def meta_end(head: Buffer, size: int, name: str) -> int:
    """Where the payload of row ``name`` (``size`` bytes in all) starts, read from the first
    ``PREFIX_FIXED_SIZE`` bytes of ``head``: its metadata prefix is ``[0, meta_end)``."""
    if len(head) < PREFIX_FIXED_SIZE:
        raise bad(f"{name}: {size} bytes is too short")
    (offset,) = struct.unpack_from("<Q", head, HEADER_SIZE)
    if not PREFIX_FIXED_SIZE <= offset <= min(size, MAX_META_BYTES):
        raise bad(f"{name}: payload offset {offset} out of range")
    return int(offset)


def parse_meta(buf: Buffer, *, file_size: int | None = None) -> KvcMeta:
    """Header, trailer, prompt and TLV (meta CRC checked; payload CRC not).

    ``buf`` may hold just the prefix (``file_size`` then gives the real file size) or the whole
    file. Any inconsistency is a ``CacheFormatError``.
    """
    try:
        return _parse_meta(_as_bytes_view(buf), file_size, None)
    except CacheFormatError:
        raise
    except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError,
            MemoryError, TypeError) as exc:  # fmt: skip
        # Belt and braces: every length is checked explicitly below, but the contract is that
        # nothing but CacheFormatError escapes a parse, whatever the bytes.
        raise bad(f"{type(exc).__name__}: {exc}") from None


def _parse_meta(
    mv: memoryview, file_size: int | None, known: tuple[bytes, tuple[int, ...]] | None
) -> KvcMeta:
    n = mv.nbytes
    total = n if file_size is None else file_size
    if n < PREFIX_FIXED_SIZE:
        raise bad(f"{n} bytes is shorter than header + trailer")
    (magic, version, quant_bits, reason, res1, n_tok, hits, ctx_size, res2, created, last_used,
     payload_bytes) = _HEADER.unpack_from(mv, 0)  # fmt: skip
    if magic != MAGIC:
        raise bad("bad magic")
    if version > max(_READABLE_VERSIONS):  # a newer kvwarm's row: not damage, not ours
        raise CacheNewerFormatError(
            f"unsupported version {version} (this kvwarm reads 1 to "
            f"{max(_READABLE_VERSIONS)}): written by a newer kvwarm"
        )
    if version not in _READABLE_VERSIONS:
        raise bad(f"unsupported version {version} (this kvwarm reads 1 to 4)")
    if res1 != b"\0\0" or res2 != b"\0\0\0\0":
        raise bad("reserved header bytes are not zero")
    if reason not in SaveReason._value2member_map_:
        raise bad(f"unknown save reason {reason}")
    offset, length, payload_crc, meta_crc = _TRAILER.unpack_from(mv, HEADER_SIZE)
    if length != payload_bytes:
        raise bad("header and trailer disagree on payload length")
    if not PREFIX_FIXED_SIZE + 8 <= offset <= MAX_META_BYTES:
        raise bad(f"payload offset {offset} out of range")
    if offset > n:
        raise bad(f"prefix of {offset} bytes but only {n} present")
    if offset + length != total:
        raise bad(f"payload {offset}+{length} does not end at file size {total}")
    if _meta_crc(mv[:HEADER_SIZE], mv[HEADER_SIZE:_META_CRC_OFFSET],
                 mv[PREFIX_FIXED_SIZE:offset]) != meta_crc:  # fmt: skip
        raise bad("metadata CRC32C mismatch")

    pos = PREFIX_FIXED_SIZE
    (plen,) = _U32.unpack_from(mv, pos)
    pos += 4
    if plen > offset - pos - 4:
        raise bad("prompt section overruns the prefix")
    prompt = bytes(mv[pos : pos + plen]).decode("utf-8", "replace")
    pos += plen
    (tlv_len,) = _U32.unpack_from(mv, pos)
    pos += 4
    if pos + tlv_len != offset:
        raise bad("TLV section does not end at the payload offset")
    tags = parse_records(mv[pos:offset])

    for tag in REQUIRED:
        if tag not in tags:
            raise bad(f"missing required TLV tag 0x{tag:02x}")
    fp, ctx = tags[TAG_FINGERPRINT], tags[TAG_CTX_HASH]
    if fp.nbytes != 32 or ctx.nbytes != 32:
        raise bad("fingerprint / ctx hash must be 32 bytes")
    mode_v, quant_v, count_v = (
        tags[TAG_FINGERPRINT_MODE],
        tags[TAG_QUANT],
        tags[TAG_TOKEN_COUNT],
    )
    if mode_v.nbytes != 1 or quant_v.nbytes != 1 or count_v.nbytes != 4:
        raise bad("fingerprint mode / quant / token count has the wrong size")
    if mode_v[0] not in FingerprintMode._value2member_map_:
        raise bad(f"unknown fingerprint mode {mode_v[0]}")
    (count,) = _U32.unpack_from(count_v, 0)
    if count != n_tok:
        raise bad("header and TLV disagree on token count")
    tok_v = tags[TAG_TOKENS]
    if tok_v.nbytes != 4 * count:
        raise bad("token list length does not match token count")
    ttl, logits, canonical = optional_fields(tags, count)
    chunk_lens, chunks = chunk_tags(tags, version, count, length)
    rest_chunks = rest_tags(tags, version, count, length)
    n_refs = len(chunks) + (len(rest_chunks.keys) if rest_chunks is not None else 0)
    chunk_locs = pack_tags(tags, n_refs)
    ns = Namespace(fingerprint=bytes(fp), quant=quant_v[0], ctx_hash=bytes(ctx))
    key_hash = hashlib.sha256(namespace_prefix(ns))
    key_hash.update(tok_v)
    key = key_hash.digest()
    if known is not None and known[0] == key and len(known[1]) == count:
        # sha256 equality means the file's token bytes are the caller's tokens: skip the
        # decode, which dominates metadata parsing for long prompts (~15 us per 1k tokens).
        tokens = known[1]
    else:
        tokens = decode_tokens(tok_v)
    fields = KvcFields(
        namespace=ns,
        tokens=tokens,
        reason=SaveReason(reason),
        created=created,
        last_used=last_used,
        hits=hits,
        quant_bits=quant_bits,
        context_size=ctx_size,
        fingerprint_mode=FingerprintMode(mode_v[0]),
        ttl_class=ttl,
        logits=logits,
        prompt_text=prompt,
        reason_detail=text(tags, TAG_REASON_DETAIL),
        hostname=text(tags, TAG_HOSTNAME),
        version=text(tags, TAG_VERSION),
        canonical_tokens=canonical,
        memory=memory_kind(tags),
        chunk_lens=chunk_lens,
        chunks=chunks,
        rest_chunks=rest_chunks,
        chunk_locs=chunk_locs,
    )
    return KvcMeta(key, fields, offset, length, payload_crc)


def parse(
    buf: Buffer,
    expected_key: bytes | None = None,
    *,
    known_tokens: tuple[int, ...] | None = None,
) -> KvcFile:
    """Full validation of a whole file: metadata, payload CRC32C and, if given, that the
    recorded namespace + tokens replay to ``expected_key``. The payload is a view of ``buf``.

    ``known_tokens``: the tokens the caller already holds for ``expected_key`` (the index's
    row); returned instead of decoding the file's list once the key has replayed.
    """
    mv = _as_bytes_view(buf)
    known = None
    if known_tokens is not None and expected_key is not None:
        known = (expected_key, known_tokens)
    try:
        meta = _parse_meta(mv, None, known)
    except CacheFormatError:
        raise
    except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError,
            MemoryError, TypeError) as exc:  # fmt: skip
        raise bad(f"{type(exc).__name__}: {exc}") from None
    payload = mv[meta.payload_offset : meta.payload_offset + meta.payload_length]
    if crc32c(payload) != meta.payload_crc:
        raise bad("payload CRC32C mismatch")
    if expected_key is not None and meta.key != expected_key:
        raise bad("file is for another key")
    return KvcFile(meta, payload)
