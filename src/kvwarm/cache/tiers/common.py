"""What every tier shares: the publish protocol, request validation and row metadata.

Invariants:
- A tier only ever stores a request whose key replays from its own namespace and tokens, so
  a row can never sit under a key its contents do not produce.
- ``publish_row`` is the one publish protocol (erllama's five stages) for every tier: reserve
  in the index, *stage* the bytes where no reader sees them, ``book.check`` the reservation,
  *commit* (link them under the key; if the name is taken, adopt the valid row there or
  clear the junk and link again, ``COMMIT_ATTEMPTS`` in all), ``book.mark_linked``,
  ``book.publish``. A tier supplies only the staging (``Staged``): ``objects.ObjectTier``'s
  for every store (a file store's temp file and link(2), ``publish.py``; else one
  put-if-absent), a dict entry for ram. Any failure undoes what was staged or committed
  and abandons the reservation; a reservation lost at publish is never announced.
- ``commit_chunk`` is the one chunk rule: a valid chunk already under the name is kept (same
  content, by construction), junk is replaced.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Protocol

from kvwarm.cache.formats.key import KEY_BYTES, cache_key
from kvwarm.cache.formats.kvc import KvcFields, check_chunks
from kvwarm.cache.protocols import ReservationBook, StoredRow
from kvwarm.cache.types import RowInfo, SaveRequest, TierName
from kvwarm.errors import CacheIOError

__all__ = [
    "COMMIT_ATTEMPTS",
    "Staged",
    "StepHook",
    "check_request",
    "commit_chunk",
    "publish_row",
    "row_info",
]

log = logging.getLogger(__name__)

# Called after each publish step with its name (``publish.PUBLISH_STEPS`` for files). Exists
# for fault-injection tests (kill -9 at every step); None in production.
StepHook = Callable[[str], None]


# A name found taken by junk is cleared and the commit tried again this many times in all.
COMMIT_ATTEMPTS = 3


class Staged(Protocol):
    """One row's bytes staged by a tier: durable where the store needs it, invisible."""

    def link(self) -> bool:
        """Make the row visible under its key, atomically; False if the name is taken."""
        ...

    def existing(self) -> StoredRow | None:
        """The name is taken: the valid row of this key there (another writer's, adopted),
        or None if what is there is junk or already gone."""
        ...

    def clear(self) -> None:
        """Remove the junk in the way (``existing`` said None); missing is fine."""
        ...

    def settle(self, adopted: StoredRow | None) -> StoredRow:
        """After the link (``adopted`` None) or the adoption: what the store still needs
        done (files: drop the temp name, fsync the directory); the row now stored."""
        ...

    def undo(self) -> None:
        """Remove what was staged, and what ``link`` made visible, if the publish fails
        before ``book.publish``. Idempotent."""
        ...

    def lost(self) -> None:
        """``book.publish`` refused (the reservation was reaped or the key deleted): a tier
        whose rows die with the process drops its row; a persistent one leaves it for the
        index or the scan to decide."""
        ...


def publish_row(
    tier: TierName,
    key: bytes,
    request: SaveRequest,
    book: ReservationBook,
    stage: Callable[[int], Staged],
    on_step: StepHook | None = None,
) -> StoredRow | None:
    """The publish protocol (see ``protocols.Tier.store`` for the contract). ``stage(token)``
    stages the row; it cleans up after itself if it raises."""
    check_request(key, request)
    token = book.reserve(key, tier)
    if token is None:
        return None
    step = on_step if on_step is not None else _no_step
    step("reserved")
    staged: Staged | None = None
    try:
        staged = stage(token)
        if not book.check(key, token):
            log.debug("reservation for %s lost before commit; abandoning", key.hex())
            staged.undo()
            book.abandon(key, token)
            return None
        step("checked")
        row = _commit(tier, key, staged)
        if row.location is not None:  # a row that outlives us: the reaper may adopt it now
            book.mark_linked(key, token, row.location)
            step("marked_linked")
    except BaseException:
        if staged is not None:
            staged.undo()
        book.abandon(key, token)
        raise
    if not book.publish(key, token, row):
        log.debug("reservation for %s lost at publish", key.hex())
        staged.lost()
        return None
    step("published")
    return row


def _commit(tier: TierName, key: bytes, staged: Staged) -> StoredRow:
    """Link, or adopt a valid row already under the name, or clear junk and try again."""
    for _ in range(COMMIT_ATTEMPTS):
        if staged.link():
            return staged.settle(None)
        existing = staged.existing()
        if existing is not None:
            return staged.settle(existing)
        log.warning("%s: replacing an invalid row in the way of %s", tier, key.hex())
        staged.clear()
    raise CacheIOError(
        f"{tier}: the name of {key.hex()} keeps reappearing invalid", errno=errno.EEXIST
    )


def commit_chunk(
    tier: TierName,
    key: bytes,
    link: Callable[[], bool],
    valid: Callable[[], bool],
    clear: Callable[[], None],
) -> None:
    """The chunk rule of every tier: chunks are content-addressed and immutable, so a name
    already taken by a chunk whose head is valid for ``key`` holds the same bytes and is
    kept; junk under it is cleared and the link tried again (``COMMIT_ATTEMPTS`` in all).
    ``link``: make the staged chunk visible, False if the name is taken."""
    for _ in range(COMMIT_ATTEMPTS):
        if link() or valid():
            return
        log.warning("%s: replacing an invalid chunk %s", tier, key.hex())
        clear()
    raise CacheIOError(
        f"{tier}: the name of chunk {key.hex()} keeps reappearing invalid", errno=errno.EEXIST
    )


def _no_step(name: str) -> None:
    pass


def check_request(key: bytes, request: SaveRequest) -> None:
    """``ValueError`` unless ``key`` is the key of ``request``'s namespace and tokens."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError("cache key must be 32 bytes")
    if cache_key(request.namespace, request.tokens) != key:
        raise ValueError("key does not match the request's namespace and tokens")
    if request.logits is not None and len(request.logits) % 4:
        raise ValueError("logits must be float32 (length a multiple of 4)")
    check_chunks(len(request.tokens), request.chunk_lens, request.chunk_keys)
    if request.rest_chunks is not None:
        if not request.chunk_keys or memoryview(request.payload).nbytes:
            raise ValueError("a rest in chunks needs chunks of its own, and no payload")
        request.rest_chunks.check(len(request.tokens))


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
    one; else (the ram tier) its payload plus its logits, and a manifest's tokens and chunk
    list. A manifest's chunks are not in it: they count once per tier in the index."""
    if stored_bytes is not None:
        payload_len = stored_bytes
    elif fields.chunks:
        rest = fields.rest_chunks
        n_chunks = len(fields.chunks) + (0 if rest is None else len(rest.keys))
        payload_len += 4 * len(fields.tokens) + 36 * n_chunks + len(fields.logits or b"")
    else:
        # A whole row's logits too (found by review: only a manifest's were counted, so a
        # ram tier of whole rows held theirs, 1 MiB a row for a 262k vocabulary, uncounted
        # against its quota and the memory budget that sized it).
        payload_len += len(fields.logits or b"")
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
        memory=fields.memory,
    )
