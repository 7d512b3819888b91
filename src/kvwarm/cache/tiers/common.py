"""Helpers shared by every tier: request validation and row metadata.

Invariant: a tier only ever stores a request whose key replays from its own namespace and
tokens, so a row can never sit under a key its contents do not produce.
"""

from __future__ import annotations

from kvwarm.cache.key import KEY_BYTES, cache_key
from kvwarm.cache.kvc import KvcFields, check_chunks
from kvwarm.cache.types import RowInfo, SaveRequest, TierName

__all__ = ["check_request", "row_info"]


def check_request(key: bytes, request: SaveRequest) -> None:
    """``ValueError`` unless ``key`` is the key of ``request``'s namespace and tokens."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError("cache key must be 32 bytes")
    if cache_key(request.namespace, request.tokens) != key:
        raise ValueError("key does not match the request's namespace and tokens")
    if request.logits is not None and len(request.logits) % 4:
        raise ValueError("logits must be float32 (length a multiple of 4)")
    size = memoryview(request.payload).nbytes
    check_chunks(len(request.tokens), request.chunk_lens, request.chunk_keys, size)


def row_info(
    key: bytes,
    tier: TierName,
    fields: KvcFields,
    payload_len: int,
    *,
    stored_bytes: int | None = None,
    created: float | None = None,
    last_used: float | None = None,
) -> RowInfo:
    """``RowInfo`` for a row with these recorded fields (file times are whole seconds). Its
    size is ``stored_bytes``, the whole file or object (prefix and payload) where there is
    one; else (the ram tier) its payload plus its metadata (tokens, chunk list, logits). A
    manifest's chunks are not in it: they count once per tier in the index."""
    if stored_bytes is not None:
        payload_len = stored_bytes
    elif fields.chunks:
        payload_len += 4 * len(fields.tokens) + 36 * len(fields.chunks) + len(fields.logits or b"")
    return RowInfo(
        key=key,
        tier=tier,
        size=payload_len,
        n_tokens=len(fields.tokens),
        hits=fields.hits,
        last_used=float(fields.last_used) if last_used is None else last_used,
        created=float(fields.created) if created is None else created,
        reason=fields.reason,
        ttl_class=fields.ttl_class,
        has_logits=fields.logits is not None,
        namespace=fields.namespace,
        canonical_tokens=fields.canonical_tokens,
    )
