"""Content-addressed KV chunks: their keys and their object format (bytes only; no I/O).

A chunk holds ``C`` consecutive tokens' KV (an opaque payload the backend's codec cut out of a
sequence blob). Its key chains its parent's::

    chunk_key = sha256("kvwarm-chunk-v1\\0" ‖ fingerprint ‖ quant ‖ ctx_hash ‖ parent key ‖
                       its tokens as u32 LE)

with the first chunk's parent 32 zero bytes, so equal prefixes give equal chunk keys in every
row, tier and process, and a chunk is never shared across namespaces (model, quant, context
parameters incl. KV cell types and the cache salt) or across different earlier tokens.
That sharing is exact only where the KV's bits are the same in every row: positions a prefill
computed in whole aligned passes (``kvwarm.alignment``). Past a row's aligned canonical prefix
the chain continues from a salted parent (``chunk_chain``): those chunks are shared only with
rows that rely on their bits no more than this one, never under the plain chain, where a
deterministic restore trusts them.

A rest in chunks (an iSWA window's cells: ``RestChunks``) is keyed from the same chain: the
rest chunk of positions ``[a, b)``, inside the first-cache chunk ``[c, d)`` whose parent is
``P``, chains from ``sha256("kvwarm-chunk-rest\0" ‖ P ‖ u32 (a - c) ‖ tokens [c, a))``, so its
key names every token before ``b``, its start ``a`` (a window's cells begin where its window
does) and the bits rule of the chunk it lies in (``rest_chain``); it is stored as any chunk
object, that digest as its parent.

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
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvwarm.cache.formats.key import encode_tokens, namespace_prefix
from kvwarm.cache.formats.kvc import Buffer, crc32c
from kvwarm.cache.types import Namespace
from kvwarm.errors import CacheFormatError, CacheNewerFormatError

__all__ = [
    "ROOT_PARENT",
    "ChunkHead",
    "build_head",
    "chunk_chain",
    "chunk_hasher",
    "chunk_key",
    "chunk_keys",
    "head_size",
    "own_parent",
    "parse",
    "parse_head",
    "recover_chain",
    "rest_chain",
    "rest_cuts",
]

MAGIC = b"KVK"
VERSION = 1
_DOMAIN = b"kvwarm-chunk-v1\x00"
_BITS = b"kvwarm-chunk-bits\x00"  # salts the chain where a row's bits stop being canonical
_REST = b"kvwarm-chunk-rest\x00"  # a rest chunk's parent, from the chunk it lies in
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
    token_bytes = tokens if isinstance(tokens, bytes) else encode_tokens(tokens)
    return _key_of(namespace_prefix(ns), parent, token_bytes)


def _key_of(prefix: Buffer, parent: Buffer, token_bytes: Buffer) -> bytes:
    """``chunk_key`` from a namespace's prefix bytes (``namespace_prefix``: a chunk's head
    records exactly these), its parent and its tokens' u32 LE encoding."""
    h = _prefix_hasher(prefix)
    h.update(parent)
    h.update(token_bytes)
    return h.digest()


def chunk_hasher(ns: Namespace) -> hashlib._Hash:
    """A hash of what every chunk key of ``ns`` starts with: ``chunk_key(ns, parent, t)`` is
    ``h = chunk_hasher(ns).copy(); h.update(parent); h.update(t's u32 LE)``, with
    ``h.digest()``, for a caller keying many chunks of one namespace."""
    return _prefix_hasher(namespace_prefix(ns))


def _prefix_hasher(prefix: Buffer) -> hashlib._Hash:
    h = hashlib.sha256(_DOMAIN)
    h.update(prefix)
    return h


def own_parent(parent: bytes, own: int) -> bytes:
    """The parent a chunk past a row's canonical bits chains from (``chunk_chain``)."""
    return hashlib.sha256(_BITS + parent + _U32.pack(own)).digest()


def chunk_keys(
    ns: Namespace,
    tokens: Sequence[int],
    lens: Sequence[int],
    *,
    plain_to: int | None = None,
    own: int = 0,
) -> tuple[bytes, ...]:
    """Keys of the chunks cutting ``tokens`` into consecutive runs of ``lens`` tokens (which
    may cover only a prefix of them); ``chunk_chain`` says what ``plain_to`` and ``own`` do."""
    return tuple(key for _, key in chunk_chain(ns, tokens, lens, plain_to=plain_to, own=own))


def chunk_chain(
    ns: Namespace,
    tokens: Sequence[int],
    lens: Sequence[int],
    *,
    plain_to: int | None = None,
    own: int = 0,
) -> list[tuple[bytes, bytes]]:
    """(parent, key) of each chunk cutting ``tokens`` into runs of ``lens`` tokens.

    ``plain_to`` (None: past every chunk): the chunks ending at or below it hold KV that any
    row of these tokens computed in whole aligned passes holds bit for bit, and chain as the
    module says. The first chunk ending past it, and so every chunk after it, chains from
    its parent salted with ``own``: its bits depend on how this row's KV was computed (a
    last partial pass, a restore at an unaligned point, decoding), so it is never shared
    with a row whose bits there are canonical. ``own`` is the row's length when those bits
    are still exact for it (a deterministic exact hit restores them), keeping them apart
    from every other length's; 0 when nobody relies on them, so such rows share them."""
    encoded = memoryview(encode_tokens(tokens))
    if any(n <= 0 for n in lens) or 4 * sum(lens) > encoded.nbytes:
        raise ValueError("chunk lengths must be positive and fit the tokens")
    prefix = namespace_prefix(ns)
    chain: list[tuple[bytes, bytes]] = []
    parent = ROOT_PARENT
    start = end = 0
    for n in lens:
        end += n
        if plain_to is not None and end > plain_to:
            parent = own_parent(parent, own)
            plain_to = None  # the chain stays apart from here on
        h = hashlib.sha256(_DOMAIN)
        h.update(prefix)
        h.update(parent)
        h.update(encoded[start : start + 4 * n])
        start += 4 * n
        key = h.digest()
        chain.append((parent, key))
        parent = key
    return chain


def recover_chain(
    ns: Namespace, tokens: Sequence[int], lens: Sequence[int], keys: Sequence[bytes]
) -> list[tuple[bytes, bytes]]:
    """The (parent, key) chain a manifest's ``keys`` were made with (``chunk_chain``), for a
    copy that rebuilds their heads: the plain chain up to the first key that differs, then
    the salted one (``own`` is 0 or the row's length). ``CacheFormatError`` if neither
    gives ``keys``."""
    plain = chunk_chain(ns, tokens, lens)
    split = next((i for i, (_, key) in enumerate(plain) if key != keys[i]), len(plain))
    if split == len(plain) and len(keys) == len(plain):
        return plain
    bound = sum(lens[:split])
    for own in (0, len(tokens)):
        chain = chunk_chain(ns, tokens, lens, plain_to=bound, own=own)
        if [key for _, key in chain] == list(keys):
            return chain
    raise CacheFormatError("a manifest's chunk keys are not the chain of its tokens")


def rest_cuts(lens: Sequence[int], first: int, end: int, grid: int) -> list[int]:
    """Where a rest holding positions ``[first, end)`` is cut: at ``first``, at every multiple
    of ``grid`` and every cut of the first cache's chunks (of ``lens`` tokens) inside it, and
    at ``end``. Cutting at fixed positions is what lets two windows share chunks: a later
    checkpoint's window starts elsewhere, but its cells past the next grid point lie in the
    same chunks as an earlier one's."""
    if not 0 <= first < end or grid <= 0:
        raise ValueError(f"a rest of [{first}, {end}) cut every {grid}")
    cuts = {first, end}
    cuts.update(range((first // grid + 1) * grid, end, grid))
    at = 0
    for n in lens:
        at += n
        if first < at < end:
            cuts.add(at)
    return sorted(cuts)


def rest_chain(
    ns: Namespace,
    tokens: Sequence[int],
    lens: Sequence[int],
    chain: Sequence[tuple[bytes, bytes]],
    bounds: Sequence[int],
) -> list[tuple[bytes, bytes]]:
    """(parent, key) of each rest chunk ``[bounds[i], bounds[i+1])`` of a row whose first
    cache is cut at ``lens`` with ``chain`` (``chunk_chain``); ``ValueError`` for a rest
    chunk that does not lie within one chunk of the first cache."""
    encoded = memoryview(encode_tokens(tokens))
    if len(bounds) < 2 or bounds[-1] > sum(lens) or len(chain) != len(lens):
        raise ValueError("a rest's bounds must lie within the row's chunks")
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    out: list[tuple[bytes, bytes]] = []
    i = 0
    for a, b in itertools.pairwise(bounds):
        while starts[i + 1] <= a:
            i += 1
        c, d = starts[i], starts[i + 1]
        if not c <= a < b <= d:
            raise ValueError(f"rest chunk [{a}, {b}) crosses a chunk boundary at {d}")
        h = hashlib.sha256(_REST)
        h.update(chain[i][0])
        h.update(_U32.pack(a - c))
        h.update(encoded[4 * c : 4 * a])
        parent = h.digest()
        out.append((parent, chunk_key(ns, parent, bytes(encoded[4 * a : 4 * b]))))
    return out


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
    mv, count, offset, plen, pcrc, key, parent, ns_b = _check_head(buf, size)
    ns = Namespace(fingerprint=bytes(ns_b[:32]), quant=ns_b[32], ctx_hash=bytes(ns_b[33:]))
    tokens = struct.unpack_from(f"<{count}I", mv, _HEAD.size)  # in bounds: checked
    return ChunkHead(key, parent, ns, tokens, offset, plen, pcrc)


def _check_head(
    buf: Buffer, size: int | None
) -> tuple[memoryview, int, int, int, int, bytes, bytes, bytes]:
    """The object as bytes and its head's fields, every one checked (CRC, key replay,
    lengths): its token count, payload offset, length and CRC, key, parent and namespace
    bytes. ``CacheFormatError`` for anything wrong, whatever part of the head it trips over."""
    try:
        mv = memoryview(buf).cast("B")
        return (mv, *_head_fields(mv, size))
    except CacheFormatError:
        raise
    except (struct.error, ValueError, TypeError, IndexError) as exc:
        raise _bad(f"{type(exc).__name__}: {exc}") from None


def _head_fields(
    mv: memoryview, size: int | None
) -> tuple[int, int, int, int, bytes, bytes, bytes]:
    total = mv.nbytes if size is None else size
    if mv.nbytes < _HEAD.size:
        raise _bad(f"{mv.nbytes} bytes is shorter than its head")
    magic, version, count, pcrc, plen, key, parent, ns_b = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise _bad("bad magic")
    if version > VERSION:  # a newer kvwarm's chunk: not damage, not ours to set aside
        raise CacheNewerFormatError(
            f"unsupported chunk version {version} (this kvwarm reads {VERSION}): "
            "written by a newer kvwarm"
        )
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
    # ``chunk_key`` replayed from the head's own bytes: the namespace as recorded is exactly
    # what ``namespace_prefix`` hashes (fixed-length digests and a quant byte).
    if _key_of(ns_b, parent, mv[_HEAD.size : offset - 4]) != key:
        raise _bad("key does not replay from namespace, parent and tokens")
    return count, offset, plen, pcrc, key, parent, ns_b


def parse(buf: Buffer, expected_key: bytes) -> memoryview:
    """The payload of a whole chunk object (a view of ``buf``), after checking everything."""
    # The restore path: the head checked as ``parse_head`` does, no tokens decoded.
    mv, _, offset, _, payload_crc, key, _, _ = _check_head(buf, None)
    if key != expected_key:
        raise _bad("object is for another key")
    payload = mv[offset:]
    if crc32c(payload) != payload_crc:
        raise _bad("payload CRC32C mismatch")
    return payload
