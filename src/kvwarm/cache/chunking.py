"""Saving and reading rows as manifests over content-addressed chunks (tier I/O; no lock).

A save of ``n`` tokens with chunk size ``C`` names the ``n // C`` full chunks by their chained
keys (``chunkfmt.chunk_keys``), pins them in the index, asks the backend's codec
(``SaveRequest.split``) for only the chunks the tier lacks and the tail (the last ``n % C``
tokens), writes those chunks, then publishes the manifest through the tier's row protocol.

Invariants:

- No manifest is published before every chunk it names is durable in its tier: chunks are
  stored (each through the tier's crash-safe ``store_chunk``) before ``tier.store`` of the
  manifest begins, and stay pinned until it ends, so no eviction frees them in between.
- A chunk the index knows is stored in the tier is never written again: the 100th row over
  a shared prefix writes only its own chunks, its tail and a small manifest.
- A row with no full chunk is stored whole (no split, no copy).
See docs/architecture.md ("Chunks").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvwarm.cache.chunkfmt import ROOT_PARENT, build_head, chunk_keys
from kvwarm.cache.counters import Counters
from kvwarm.cache.index import Index
from kvwarm.cache.protocols import StoredRow, Tier
from kvwarm.cache.types import SaveRequest
from kvwarm.errors import CacheIOError

__all__ = ["load_chunks", "store_row"]


def store_row(
    key: bytes,
    request: SaveRequest,
    tier: Tier,
    index: Index,
    chunk_tokens: int,
    *,
    counters: Counters | None = None,
    wait_s: float = 30.0,
) -> StoredRow | None:
    """Store ``request`` in ``tier`` as a manifest over chunks when it comes with a splitter
    and holds at least one full chunk, else whole. Returns the published row, or None."""
    size = request.chunk_tokens or chunk_tokens
    split = request.split
    if split is None or size <= 0 or len(request.tokens) < size:
        return tier.store(key, replace(request, split=None, chunk_tokens=None), index)
    ns, tokens = request.namespace, request.tokens
    keys = chunk_keys(ns, tokens, size)
    write = index.pin_chunks(tier.name, keys, wait_s)
    if write is None:
        raise CacheIOError(f"{tier.name}: chunks of {key.hex()} are still being deleted")
    try:
        need = set(write)
        first = next((i for i, k in enumerate(keys) if k in need), len(keys))
        bounds = [i * size for i in range(first, len(keys) + 1)]
        has_tail = len(tokens) > len(keys) * size
        if has_tail:
            bounds.append(len(tokens))
        parts = split(request.payload, bounds) if len(bounds) > 1 else []
        if len(parts) != len(bounds) - 1:
            raise ValueError(f"splitter returned {len(parts)} parts for {len(bounds) - 1}")
        for i, part in enumerate(parts[: len(keys) - first], start=first):
            if keys[i] not in need:
                continue
            parent = keys[i - 1] if i else ROOT_PARENT
            _, head = build_head(ns, parent, tokens[i * size : (i + 1) * size], part)
            stored = tier.store_chunk(keys[i], head, part)
            index.chunk_stored(tier.name, keys[i], stored)
            if counters is not None:
                counters.incr("chunks_written")
                counters.incr("chunk_bytes_written", stored)
        if counters is not None:
            counters.incr("chunks_reused", len(keys) - len(need))
        manifest = replace(
            request,
            payload=parts[-1] if has_tail else b"",
            split=None,
            chunk_tokens=size,
            chunk_keys=keys,
        )
        return tier.store(key, manifest, index)
    finally:
        index.unpin_chunks(tier.name, keys)


def load_chunks(tier: Tier, keys: Sequence[bytes]) -> list[memoryview]:
    """The verified payloads of ``keys``, in order (``CacheKeyError``/``CacheFormatError``
    from the first that is missing or bad)."""
    return [tier.load_chunk(k) for k in keys]
