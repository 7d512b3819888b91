"""A fake KV codec for chunk tests: ``PER_TOKEN`` bytes a token, each position's bytes
depending on every token before it (like real KV), split by slicing and joined by concat."""

from __future__ import annotations

import hashlib
import itertools
import struct
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


WINDOW = 100  # positions a fake window holds
WINDOW_PER_TOKEN = 2048  # a window cell: more layers than the first cache's (as Gemma's)
_START = struct.Struct("<I")


def window_cells(tokens: Sequence[int], a: int, b: int) -> bytes:
    """The window's cells of positions ``[a, b)``: each depends on every token up to it."""
    out = bytearray()
    h = hashlib.sha256(b"window")
    for i, t in enumerate(tokens[:b]):
        h.update(t.to_bytes(4, "little"))
        if i >= a:
            out += (h.digest() * (WINDOW_PER_TOKEN // 32 + 1))[:WINDOW_PER_TOKEN]
    return bytes(out)


def window_request(
    ns: Namespace,
    tokens: Sequence[int],
    starts: list[int],
    *,
    tier: TierName = "ram",
    reason: SaveReason = SaveReason.FINISH,
    window: int = WINDOW,
) -> SaveRequest:
    """A save of an iSWA-like memory: the chunkable cache, then a window of the last
    ``window`` positions' cells, which the cache cuts into chunks of its own
    (``rest_span``, ``split_rest``). Each fake rest chunk starts with its first position, as
    the real ones' envelopes say it (``join_rest`` reads it). Like llama.cpp's, every pack
    is whole (each start asked for is appended to ``starts``)."""
    n = len(tokens)
    first = max(0, n - window)
    whole = blob(tokens) + window_cells(tokens, first, n)

    def pack(start: int) -> tuple[bytes, int]:
        starts.append(start)
        return whole, 0

    def rest(data: bytes | bytearray | memoryview) -> memoryview:
        return memoryview(data)[n * PER_TOKEN :]

    def rest_span(data: bytes | bytearray | memoryview) -> tuple[int, int]:
        return first, n

    def split_rest(data: bytes | bytearray | memoryview, bounds: Sequence[int]) -> list[bytes]:
        assert bounds[0] >= first and bounds[-1] <= n, "a rest cut outside its window"
        cells = memoryview(data)[n * PER_TOKEN :]
        return [
            _START.pack(a)
            + bytes(cells[(a - first) * WINDOW_PER_TOKEN : (b - first) * WINDOW_PER_TOKEN])
            for a, b in itertools.pairwise(bounds)
        ]

    return SaveRequest(
        ns, tuple(tokens), b"", reason, tier, split=split, rest=rest, pack=pack,
        rest_span=rest_span, split_rest=split_rest,
    )  # fmt: skip


def join_rest(parts: Sequence[memoryview | bytes], first: int) -> bytes:
    """The window again from its chunks, from position ``first`` (``split_rest``'s format)."""
    out = bytearray()
    for part in parts:
        (start,) = _START.unpack_from(part, 0)
        skip = max(0, first - start)
        out += bytes(part)[_START.size + skip * WINDOW_PER_TOKEN :]
    return bytes(out)
