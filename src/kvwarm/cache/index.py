"""The in-memory index: the sole writer of rows, reservations, in-flight marks and waiters.

Invariants:

- Every mutation happens under ``_lock``; plain lookups (``get``, ``longest``) never take it:
  they read dicts whose single-key operations are atomic under the GIL, and the prefix tree
  is copy-on-write for readers (see ``prefix.py``).
- ``_rows``, the per-tier LRU orders, the per-tier byte totals and the prefix tree always
  describe the same set of published rows: they are changed together in ``_insert``/``_drop``.
- A checked-out row (refcount > 0) is never chosen for eviction or TTL expiry; ``remove``
  (corruption, explicit delete) is the only way such a row leaves.
- TTLs count only time a row sat unused while this process ran: a row's idle time starts at
  its last use or at this index's creation, whichever is later, so downtime between a shutdown
  and a restart never expires rows (a disk tier is meant to outlive restarts of any length).
- Eviction never yields a key twice, whatever the caller's tier list: every row it drops is
  returned, so its bytes are deleted and no file outlives its index entry.
- Nothing here does I/O. Methods that retire rows return the ``StoredRow``s so the caller
  (the facade) deletes their bytes outside the lock.

Implements ``protocols.ReservationBook`` for the tiers.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from kvwarm.cache.prefix import PrefixIndex
from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.reservations import Orphan, Reservations
from kvwarm.cache.types import Namespace, PrefixMatch, RowInfo, TierName

__all__ = ["Index", "Orphan"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    """Mutable, but only under the index lock; readers only read ``info`` (one reference)."""

    info: RowInfo
    location: str | None
    refcount: int = 0


class Index:
    """Rows, LRU, byte accounting, reservations and waiters of one cache."""

    def __init__(
        self,
        *,
        reservation_ttl_s: float = 60.0,
        ttl_seconds: tuple[float, float, float] = (300.0, 3600.0, 86_400.0),
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # publish/abandon/in-flight changes
        self._clock = clock
        self._started = clock()  # TTL idle time is counted from here at the earliest
        self._ttl = ttl_seconds
        self._rows: dict[bytes, _Entry] = {}
        self._lru: dict[TierName, OrderedDict[bytes, None]] = {}
        self._bytes: dict[TierName, int] = {}
        self._prefix = PrefixIndex()
        self._res = Reservations(reservation_ttl_s, monotonic)
        self._inflight: dict[bytes, int] = {}
        self._dirty_hits: set[bytes] = set()

    # ----------------------------------------------------------------- lock-free reads

    def get(self, key: bytes) -> RowInfo | None:
        entry = self._rows.get(key)
        return None if entry is None else entry.info

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def longest(
        self, namespace: Namespace, tokens: Sequence[int], min_shared: int = 1
    ) -> PrefixMatch | None:
        """The row sharing the longest prefix with ``tokens`` (ties: fewest bytes)."""
        before = self._prefix.version
        hit = self._prefix.longest(namespace, tokens, min_shared)
        entry = None if hit is None else self._rows.get(hit[0])
        if before % 2 == 0 and self._prefix.version == before and (hit is None or entry):
            return None if hit is None or entry is None else PrefixMatch(entry.info, hit[1])
        # A writer overlapped the walk (or removed the row it found): ask again with the tree
        # quiescent. Readers only ever wait when a write really raced them.
        with self._lock:
            hit = self._prefix.longest(namespace, tokens, min_shared)
            entry = None if hit is None else self._rows.get(hit[0])
            return None if hit is None or entry is None else PrefixMatch(entry.info, hit[1])

    # ----------------------------------------------------------------- locked reads

    def wait_for(self, key: bytes, timeout_s: float) -> RowInfo | None:
        """The row of ``key``; if a save of it is in flight, park until it publishes, the save
        ends without publishing, or ``timeout_s`` passes."""
        entry = self._rows.get(key)
        if entry is not None:
            return entry.info
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._changed:
            while True:
                entry = self._rows.get(key)
                if entry is not None:
                    return entry.info
                if not self._inflight.get(key) and key not in self._res:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)

    def rows(self, namespace: Namespace | None = None) -> list[RowInfo]:
        with self._lock:
            infos = [e.info for e in self._rows.values()]
        if namespace is not None:
            infos = [i for i in infos if i.namespace == namespace]
        return infos

    def tokens(self, key: bytes) -> tuple[int, ...] | None:
        with self._lock:
            return self._prefix.tokens(key)

    def usage(self) -> dict[TierName, tuple[int, int]]:
        """Per tier: (bytes, rows)."""
        with self._lock:
            return {t: (self._bytes.get(t, 0), len(lru)) for t, lru in self._lru.items()}

    def lru_keys(self, tier: TierName) -> list[bytes]:
        """Oldest first."""
        with self._lock:
            return list(self._lru.get(tier, ()))

    def refcount(self, key: bytes) -> int:
        entry = self._rows.get(key)
        return 0 if entry is None else entry.refcount

    def pending_reservations(self) -> int:
        return len(self._res)

    # ----------------------------------------------------------------- ReservationBook

    def reserve(self, key: bytes, tier: TierName) -> int | None:
        with self._lock:
            if key in self._rows:
                return None
            return self._res.reserve(key, tier)

    def check(self, key: bytes, token: int) -> bool:
        with self._lock:
            return self._res.check(key, token)

    def mark_linked(self, key: bytes, token: int, location: str) -> None:
        with self._lock:
            if not self._res.mark_linked(key, token, location):
                log.debug("mark_linked for a reservation that is no longer live: %s", key.hex())

    def publish(self, key: bytes, token: int, row: StoredRow) -> bool:
        if row.info.key != key:
            raise ValueError("published row carries another key")
        with self._changed:
            if self._res.take(key, token) is None:
                return False
            self._insert(row)
            self._changed.notify_all()
            return True

    def abandon(self, key: bytes, token: int) -> None:
        with self._changed:
            if self._res.take(key, token) is not None:
                self._changed.notify_all()

    def adopt(self, row: StoredRow) -> bool:
        with self._changed:
            if row.info.key in self._rows:
                return False
            if len(row.tokens) != row.info.n_tokens:
                log.warning(
                    "not adopting %s: token count disagrees with header", row.info.key.hex()
                )
                return False
            self._insert(row)
            self._changed.notify_all()
            return True

    # ----------------------------------------------------------------- in-flight saves

    def mark_in_flight(self, key: bytes) -> None:
        with self._lock:
            self._inflight[key] = self._inflight.get(key, 0) + 1

    def clear_in_flight(self, key: bytes) -> None:
        with self._changed:
            n = self._inflight.get(key, 0) - 1
            if n > 0:
                self._inflight[key] = n
            else:
                self._inflight.pop(key, None)
            self._changed.notify_all()

    def clear_all_in_flight(self) -> None:
        """At close: jobs the writer dropped will never clear their marks; release waiters."""
        with self._changed:
            self._inflight.clear()
            self._changed.notify_all()

    def in_flight(self, key: bytes) -> bool:
        return bool(self._inflight.get(key))

    # ----------------------------------------------------------------- use

    def checkout(self, key: bytes, *, touch: bool = True) -> StoredRow | None:
        """Pin a row against eviction; with ``touch``, also count a hit and make it most
        recently used (``verify`` reads rows without pretending they were used)."""
        with self._lock:
            entry = self._rows.get(key)
            if entry is None:
                return None
            entry.refcount += 1
            if not touch:
                return self._stored(key, entry)
            info = entry.info
            entry.info = replace(info, hits=info.hits + 1, last_used=self._clock())
            self._lru[info.tier].move_to_end(key)
            self._dirty_hits.add(key)
            return self._stored(key, entry)

    def checkin(self, key: bytes) -> None:
        with self._lock:
            entry = self._rows.get(key)
            if entry is not None and entry.refcount > 0:
                entry.refcount -= 1

    def take_dirty_hits(self) -> list[StoredRow]:
        """Rows whose hit count changed since the last call (to persist in a batch)."""
        with self._lock:
            keys, self._dirty_hits = self._dirty_hits, set()
            return [self._stored(k, self._rows[k]) for k in keys if k in self._rows]

    # ----------------------------------------------------------------- retire

    def remove(self, key: bytes) -> StoredRow | None:
        """Drop a row even if checked out (corrupt, or deleted on purpose)."""
        with self._lock:
            entry = self._rows.get(key)
            if entry is None:
                return None
            row = self._stored(key, entry)
            self._drop(key, entry)
            return row

    def evict_lru(self, n_bytes: int, tiers: Iterable[TierName] | None = None) -> list[StoredRow]:
        """Retire least-recently-used, not-checked-out rows of ``tiers`` (all if None), oldest
        first across tiers, until at least ``n_bytes`` are freed or none is left."""
        if n_bytes <= 0:
            return []
        with self._lock:
            wanted = self._lru if tiers is None else dict.fromkeys(tiers)  # dedupe, keep order
            names = [t for t in wanted if t in self._lru]
            victims: list[bytes] = []
            freed = 0
            for key in self._oldest_first(names):
                if freed >= n_bytes:
                    break
                victims.append(key)
                freed += self._rows[key].info.size
            return self._drop_all(victims)

    def enforce_quota(self, tier: TierName, quota_bytes: int) -> list[StoredRow]:
        """Retire LRU rows of ``tier`` until it holds at most ``quota_bytes``."""
        with self._lock:
            excess = self._bytes.get(tier, 0) - quota_bytes
            return self.evict_lru(excess, (tier,)) if excess > 0 else []

    def expire(self) -> list[StoredRow]:
        """Retire every not-checked-out row unused for longer than its TTL class allows."""
        now = self._clock()
        with self._lock:
            victims = [
                k
                for k, e in self._rows.items()
                if e.refcount == 0
                and now - max(e.info.last_used, self._started) > self._ttl[e.info.ttl_class]
            ]
            return self._drop_all(victims)

    def reap_reservations(self) -> tuple[int, list[Orphan]]:
        """Two-stage reaping; linked orphans are returned for the caller to adopt or delete."""
        with self._changed:
            dropped, orphans = self._res.reap()
            if dropped or orphans:
                self._changed.notify_all()
            return dropped, orphans

    def resort_lru(self) -> None:
        """Order every tier's LRU by recorded last-used time (after a bulk adopt at startup)."""
        with self._lock:
            for tier, lru in self._lru.items():
                keys = sorted(lru, key=lambda k: self._rows[k].info.last_used)
                self._lru[tier] = OrderedDict.fromkeys(keys)

    # ----------------------------------------------------------------- internals

    def _stored(self, key: bytes, entry: _Entry) -> StoredRow:
        tokens = self._prefix.tokens(key)
        assert tokens is not None, "row present without tokens"
        return StoredRow(entry.info, tokens, entry.location)

    def _insert(self, row: StoredRow) -> None:
        info = row.info
        key = info.key
        old = self._rows.get(key)
        refcount = 0
        if old is not None:  # e.g. a rescan adopted our own file before our publish landed
            refcount = old.refcount
            self._drop(key, old)
        self._prefix.insert(info.namespace, key, row.tokens, info.size)
        self._rows[key] = _Entry(info, row.location, refcount)
        self._lru.setdefault(info.tier, OrderedDict())[key] = None
        self._bytes[info.tier] = self._bytes.get(info.tier, 0) + info.size

    def _drop(self, key: bytes, entry: _Entry) -> None:
        tier = entry.info.tier
        del self._rows[key]
        self._lru[tier].pop(key, None)
        self._bytes[tier] -= entry.info.size
        self._prefix.remove(key)
        self._dirty_hits.discard(key)

    def _drop_all(self, keys: list[bytes]) -> list[StoredRow]:
        out: list[StoredRow] = []
        for key in keys:
            entry = self._rows[key]
            out.append(self._stored(key, entry))
            self._drop(key, entry)
        return out

    def _oldest_first(self, tiers: list[TierName]) -> Iterator[bytes]:
        """Evictable keys of ``tiers``, merged oldest first (each tier's LRU is in order)."""

        def evictable(tier: TierName) -> Iterator[tuple[float, bytes]]:
            for key in self._lru[tier]:
                entry = self._rows[key]
                if entry.refcount == 0:
                    yield entry.info.last_used, key

        for _, key in heapq.merge(*(evictable(t) for t in tiers)):
            yield key
