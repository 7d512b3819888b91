"""Content-addressed KV chunks: their keys and their object format (bytes only; no I/O).

A chunk holds ``C`` consecutive tokens' KV (an opaque payload the backend's codec cut out of a
sequence blob). Its key chains its parent's::

    chunk_key = sha256("kvwarm-chunk-v1\\0" ‖ fingerprint ‖ quant ‖ ctx_hash ‖ parent key ‖
                       its tokens as u32 LE)

with the first chunk's parent 32 zero bytes, so equal prefixes give equal chunk keys in every
row, tier and process, and a chunk is never shared across namespaces (model, quant, context
parameters incl. KV cell types and the cache salt) or across different earlier tokens.

Object layout, little-endian::

    [0..]    head     magic "KVK", u8 version=1, u32 token count, u32 payload CRC32C,
                      u64 payload length, u8[32] key, u8[32] parent key, u8[65] namespace
    [..]     tokens   u32 x count
    [..]     u32      CRC32C of every byte before it
    [..end]  payload  opaque KV bytes

Invariants: the key replays from the recorded namespace, parent and tokens, so an object can
never sit under a key its contents do not produce; ``parse`` checks every length before
slicing, both CRCs and the key, and raises ``CacheFormatError`` and nothing else. The payload
is returned as a zero-copy view. See docs/architecture.md ("Chunks").
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvwarm.cache.key import encode_tokens, namespace_prefix
from kvwarm.cache.kvc import Buffer, crc32c
from kvwarm.cache.types import Namespace
from kvwarm.errors import CacheFormatError

__all__ = [
    "ROOT_PARENT",
    "ChunkHead",
    "build_head",
    "chunk_key",
    "chunk_keys",
    "head_size",
    "parse",
    "parse_head",
]

MAGIC = b"KVK"
VERSION = 1
_DOMAIN = b"kvwarm-chunk-v1\x00"
_HEAD = struct.Struct("<3sBIIQ32s32s65s")
_U32 = struct.Struct("<I")
ROOT_PARENT = bytes(32)
# A chunk covers at most this many tokens (its token list is read before its CRC is known).
MAX_CHUNK_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class ChunkHead:
    """A chunk object's checked head: its key, parent, tokens and where its payload lies."""

    key: bytes
    parent: bytes
    namespace: Namespace
    tokens: tuple[int, ...]
    payload_offset: int
    payload_length: int
    payload_crc: int


def chunk_key(ns: Namespace, parent: bytes, tokens: Sequence[int] | bytes) -> bytes:
    """The key of the chunk holding ``tokens`` (or their u32 LE encoding) after ``parent``."""
    h = hashlib.sha256(_DOMAIN)
    h.update(namespace_prefix(ns))
    h.update(parent)
    h.update(tokens if isinstance(tokens, bytes) else encode_tokens(tokens))
    return h.digest()


def chunk_keys(ns: Namespace, tokens: Sequence[int], lens: Sequence[int]) -> tuple[bytes, ...]:
    """Keys of the chunks cutting ``tokens`` into consecutive runs of ``lens`` tokens (which
    may cover only a prefix of them)."""
    encoded = memoryview(encode_tokens(tokens))
    if any(n <= 0 for n in lens) or 4 * sum(lens) > encoded.nbytes:
        raise ValueError("chunk lengths must be positive and fit the tokens")
    prefix = namespace_prefix(ns)
    keys: list[bytes] = []
    parent = ROOT_PARENT
    start = 0
    for n in lens:
        h = hashlib.sha256(_DOMAIN)
        h.update(prefix)
        h.update(parent)
        h.update(encoded[start : start + 4 * n])
        start += 4 * n
        parent = h.digest()
        keys.append(parent)
    return tuple(keys)


def head_size(n_tokens: int) -> int:
    return _HEAD.size + 4 * n_tokens + 4


def build_head(
    ns: Namespace, parent: bytes, tokens: Sequence[int], payload: Buffer
) -> tuple[bytes, bytes]:
    """(key, the bytes before ``payload`` in its object)."""
    token_bytes = encode_tokens(tokens)
    key = chunk_key(ns, parent, token_bytes)
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        len(tokens),
        crc32c(payload),
        memoryview(payload).nbytes,
        key,
        parent,
        namespace_prefix(ns),
    )
    body = head + token_bytes
    return key, body + _U32.pack(crc32c(body))


def _bad(msg: str) -> CacheFormatError:
    return CacheFormatError(f"malformed KV chunk: {msg}")


def parse_head(buf: Buffer, *, size: int | None = None) -> ChunkHead:
    """The head of a chunk object (``buf`` may hold just the head; ``size`` is then the whole
    object's size). Checks the head CRC, the key and the payload length; not the payload."""
    try:
        return _parse_head(memoryview(buf).cast("B"), size)
    except CacheFormatError:
        raise
    except (struct.error, ValueError, TypeError, IndexError) as exc:
        raise _bad(f"{type(exc).__name__}: {exc}") from None


def _parse_head(mv: memoryview, size: int | None) -> ChunkHead:
    total = mv.nbytes if size is None else size
    if mv.nbytes < _HEAD.size:
        raise _bad(f"{mv.nbytes} bytes is shorter than its head")
    magic, version, count, pcrc, plen, key, parent, ns_b = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise _bad("bad magic")
    if version != VERSION:
        raise _bad(f"unsupported chunk version {version}")
    if count == 0 or count > MAX_CHUNK_TOKENS:
        raise _bad(f"token count {count} out of range")
    offset = head_size(count)
    if offset > mv.nbytes:
        raise _bad(f"head of {offset} bytes but only {mv.nbytes} present")
    if offset + plen != total:
        raise _bad(f"payload {offset}+{plen} does not end at object size {total}")
    (crc,) = _U32.unpack_from(mv, offset - 4)
    if crc32c(mv[: offset - 4]) != crc:
        raise _bad("head CRC32C mismatch")
    ns = Namespace(fingerprint=bytes(ns_b[:32]), quant=ns_b[32], ctx_hash=bytes(ns_b[33:]))
    token_bytes = bytes(mv[_HEAD.size : offset - 4])
    if chunk_key(ns, parent, token_bytes) != key:
        raise _bad("key does not replay from namespace, parent and tokens")
    tokens = struct.unpack(f"<{count}I", token_bytes)
    return ChunkHead(key, parent, ns, tokens, offset, plen, pcrc)


def parse(buf: Buffer, expected_key: bytes) -> memoryview:
    """The payload of a whole chunk object (a view of ``buf``), after checking everything."""
    mv = memoryview(buf).cast("B")
    head = parse_head(mv)
    if head.key != expected_key:
        raise _bad("object is for another key")
    payload = mv[head.payload_offset :]
    if crc32c(payload) != head.payload_crc:
        raise _bad("payload CRC32C mismatch")
    return payload
