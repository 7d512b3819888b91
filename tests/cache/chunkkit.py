"""A fake KV codec for chunk tests: ``PER_TOKEN`` bytes a token, each position's bytes
depending on every token before it (like real KV), split by slicing and joined by concat."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

from kvwarm.cache.types import Namespace, SaveReason, SaveRequest, TierName

PER_TOKEN = 1024  # a real model holds far more (23 KB a token for 135M f16)


def blob(tokens: Sequence[int]) -> bytes:
    out = bytearray()
    h = hashlib.sha256()
    for t in tokens:
        h.update(t.to_bytes(4, "little"))
        out += (h.digest() * (PER_TOKEN // 32 + 1))[:PER_TOKEN]
    return bytes(out)


def split(data: bytes | bytearray | memoryview, bounds: Sequence[int]) -> list[bytes]:
    mv = memoryview(data)
    assert list(bounds) == sorted(set(bounds)) and len(bounds) >= 2
    assert bounds[-1] * PER_TOKEN <= mv.nbytes
    return [bytes(mv[a * PER_TOKEN : b * PER_TOKEN]) for a, b in itertools.pairwise(bounds)]


def join(parts: Sequence[memoryview | bytes]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def chunked_request(
    ns: Namespace,
    tokens: Sequence[int],
    *,
    tier: TierName = "ram",
    reason: SaveReason = SaveReason.CONTINUED,
) -> SaveRequest:
    return SaveRequest(ns, tuple(tokens), blob(tokens), reason, tier, split=split)


def tail_request(
    ns: Namespace,
    tokens: Sequence[int],
    starts: list[int],
    *,
    tier: TierName = "ram",
    reason: SaveReason = SaveReason.FINISH,
) -> SaveRequest:
    """A save the cache packs itself (``pack``), like the engine's: each start it asks for is
    appended to ``starts``. The fake blob holds no positions, so its splitter reads where a
    tail starts from its length (the real codecs read it from the blob's cells)."""
    n = len(tokens)

    def pack(start: int) -> tuple[bytes, int]:
        starts.append(start)
        return blob(tokens)[start * PER_TOKEN :], start

    def split_tail(data: bytes | bytearray | memoryview, bounds: Sequence[int]) -> list[bytes]:
        first = n - memoryview(data).nbytes // PER_TOKEN
        assert bounds[0] >= first, "a tail cut below its first position"
        return split(bytes(blob(tokens)[: first * PER_TOKEN]) + bytes(data), bounds)

    return SaveRequest(ns, tuple(tokens), b"", reason, tier, split=split_tail, pack=pack)


REST = 3000  # bytes of a two-part memory's rest (a window, a recurrent state), kept whole


def rest_of(tokens: Sequence[int]) -> bytes:
    """The state after the chunked cache: it depends on every token, as a window does."""
    digest = hashlib.sha256(repr(tuple(tokens)).encode()).digest()
    return (digest * (REST // 32 + 1))[:REST]


def two_part_request(
    ns: Namespace,
    tokens: Sequence[int],
    starts: list[int],
    *,
    tier: TierName = "ram",
    reason: SaveReason = SaveReason.FINISH,
) -> SaveRequest:
    """A save of a two-part memory (``SaveRequest.rest``) that the cache packs itself: the
    blob is the chunkable cache, then the rest; like llama.cpp's, such a memory has no tail
    pack, so every pack is whole (each start asked for is appended to ``starts``)."""
    whole = blob(tokens) + rest_of(tokens)
    n = len(tokens)

    def pack(start: int) -> tuple[bytes, int]:
        starts.append(start)
        return whole, 0

    def rest(data: bytes | bytearray | memoryview) -> memoryview:
        return memoryview(data)[n * PER_TOKEN :]

    return SaveRequest(ns, tuple(tokens), b"", reason, tier, split=split, rest=rest, pack=pack)
