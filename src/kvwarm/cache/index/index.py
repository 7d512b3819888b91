"""The in-memory index: the one place that decides which rows exist, coordinating its rooms.

Rooms (each a plain, unlocked object; the index owns the one lock they all live under):

- ``rows.RowTable``: published rows, per-tier byte totals, the prefix tree and the eviction
  policy's order (``eviction/``), changed together;
- ``reservations.Reservations``: the publish protocol's state machine;
- ``inflight.InFlight``: saves under way and the threads waiting on them.

Invariants:

- One lock, ``_lock`` (not reentrant): every mutation of every room happens under it, and no
  method calls another public method while holding it. One lock rather than one per room
  because a waiter's condition spans three rooms (row published? save in flight? reservation
  live?) and must be checked atomically with the changes that end it; with one lock there is
  no lock order to get wrong. The policy runs under it too, so a new policy adds no locking.
- Plain lookups (``get``, ``longest``, ``in_flight``) never take the lock: they read dicts
  whose single-key operations are atomic under the GIL, and the prefix tree is copy-on-write
  for readers with a seqlock to detect a racing writer (see ``prefix.py``).
- Rows, per-tier bytes, the prefix tree and the eviction order always describe the same set
  of published rows (``RowTable`` changes them together).
- A checked-out row (refcount > 0) is never chosen for eviction, TTL expiry or promotion
  (``remove_unpinned``); ``remove`` (corruption, explicit delete) is the only way such a row
  leaves.
- TTLs count only time a row sat unused while this process ran: a row's idle time starts at
  its last use or at this index's creation, whichever is later, so downtime between a shutdown
  and a restart never expires rows (a disk tier is meant to outlive restarts of any length).
- Eviction never yields a key twice, whatever the caller's tier list or the policy: every row
  it drops is returned, so its bytes are deleted and no file outlives its index entry.
- Chunks (``chunkrefs.py``) are referenced by the rows naming them and pinned by the saves
  writing or reusing them; a chunk is freed only when neither holds it, and a save that needs
  a chunk being deleted waits for the delete before writing it again.
- Nothing here does I/O. Methods that retire rows return the ``StoredRow``s so the caller
  (the facade) deletes their bytes outside the lock; until it says their manifests are gone
  (``retired``) such a row is *retiring*: no adopt or reservation indexes its key again (its
  file is about to go), and the chunks it names are not handed out for deletion (a manifest
  goes before its chunks, whichever thread retires them).

Implements ``protocols.ReservationBook`` for the tiers. See docs/architecture.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence

from kvwarm.cache.eviction.base import EvictionPolicy
from kvwarm.cache.eviction.lru import LruPolicy
from kvwarm.cache.explain import TTL_NAMES, MissHistory, MissReason
from kvwarm.cache.index.chunkrefs import FreedChunk
from kvwarm.cache.index.inflight import InFlight
from kvwarm.cache.index.reservations import Orphan, Reservations
from kvwarm.cache.index.rows import RowTable
from kvwarm.cache.protocols import ReservationBook, RowEvents, StoredRow
from kvwarm.cache.types import Namespace, PackLoc, PrefixMatch, RowInfo, TierName, TierSizes

#: Memory kinds whose saved states are whole (a recurrent state, with a hybrid's attention
#: chunks): kept per conversation by ``retention_victims``, not every one ever written.
STATE_KINDS = frozenset({"recurrent", "hybrid"})

__all__ = ["Index", "Orphan", "RoomHold"]

log = logging.getLogger(__name__)


class RoomHold:
    """Room ``Index.hold_room`` holds in ``tier`` for one save, until ``Index.give_room``:
    what is ``left`` of it shrinks as the save's bytes land in the tier (``chunk_stored``,
    ``publish`` through ``Index.held``), so they never count twice against its quota.
    Changed only under the index's lock."""

    __slots__ = ("left", "tier")

    def __init__(self, tier: TierName, n_bytes: int) -> None:
        self.tier = tier
        self.left = n_bytes


class Index:
    """Rows, eviction order, byte accounting, reservations and waiters of one cache."""

    def __init__(
        self,
        *,
        reservation_ttl_s: float = 60.0,
        ttl_seconds: tuple[float, float, float] = (300.0, 3600.0, 86_400.0),
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        eviction: EvictionPolicy | None = None,
        eviction_name: str = "lru",
        history: MissHistory | None = None,
    ) -> None:
        """``eviction``: a fresh policy for this index alone (default LRU), named
        ``eviction_name``; ``history``: where rows that leave are remembered, so a later lookup
        can say why it missed (``explain.py``)."""
        self._lock = threading.Lock()
        self._clock = clock
        self._started = clock()  # TTL idle time is counted from here at the earliest
        self._ttl = ttl_seconds
        self._rows = RowTable(eviction if eviction is not None else LruPolicy())
        self._res = Reservations(reservation_ttl_s, monotonic)
        self._inflight = InFlight(self._lock)
        self._chunk_gone = threading.Condition(self._lock)
        self._eviction_name = eviction_name
        self.history = history if history is not None else MissHistory(clock=clock)
        # Bytes promised to saves not yet in the tier, per tier (``hold_room``; the sum of
        # their ``RoomHold.left``): counted with the tier's own, so saves in flight together
        # cannot overshoot its quota.
        self._room: dict[TierName, int] = {}
        # Rows forgotten for their bytes to be deleted, by key, until ``retired``: their
        # manifests are still in their tiers.
        self._retiring: dict[bytes, StoredRow] = {}

    # ----------------------------------------------------------------- lock-free reads

    def get(self, key: bytes) -> RowInfo | None:
        return self._rows.get(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def longest(
        self, namespace: Namespace, tokens: Sequence[int], min_shared: int = 1
    ) -> PrefixMatch | None:
        """The row sharing the longest prefix with ``tokens`` (ties: fewest bytes)."""
        settled, match = self._rows.try_longest(namespace, tokens, min_shared)
        if settled:
            return match
        # A writer overlapped the walk: ask again with the tree quiescent. Readers only ever
        # wait when a write really raced them.
        with self._lock:
            return self._rows.longest(namespace, tokens, min_shared)

    def whole_prefixes(
        self, namespace: Namespace, tokens: Sequence[int], limit: int
    ) -> list[PrefixMatch]:
        """Up to ``limit`` rows whose tokens are all a prefix of ``tokens``, longest first (a
        state that cannot be trimmed is usable only whole)."""
        settled, matches = self._rows.try_whole(namespace, tokens, limit)
        if settled:
            return matches
        with self._lock:
            return self._rows.whole(namespace, tokens, limit)

    def refcount(self, key: bytes) -> int:
        return self._rows.refcount(key)

    def pending_reservations(self) -> int:
        return len(self._res)

    def in_flight(self, key: bytes) -> bool:
        return key in self._inflight

    # ----------------------------------------------------------------- locked reads

    def wait_for(self, key: bytes, timeout_s: float) -> RowInfo | None:
        """The row of ``key``; if a save of it is in flight, park until it publishes, the save
        ends without publishing, or ``timeout_s`` passes."""
        info = self._rows.get(key)
        if info is not None:
            return info
        with self._lock:
            return self._inflight.wait(
                lambda: self._rows.get(key),
                lambda: key in self._inflight or key in self._res,
                timeout_s,
            )

    def rows(self, namespace: Namespace | None = None) -> list[RowInfo]:
        with self._lock:
            infos = self._rows.infos()
        if namespace is not None:
            infos = [i for i in infos if i.namespace == namespace]
        return infos

    def tokens(self, key: bytes) -> tuple[int, ...] | None:
        with self._lock:
            return self._rows.tokens(key)

    def usage(self) -> dict[TierName, tuple[int, int]]:
        """Per tier: (bytes, rows)."""
        with self._lock:
            return self._rows.usage()

    def sizes(self) -> dict[TierName, TierSizes]:
        """Per tier: physical and logical bytes, rows, chunks (``RowTable.sizes``)."""
        with self._lock:
            return self._rows.sizes()

    def eviction_order(self, tier: TierName) -> list[bytes]:
        """Every key of ``tier``, first victim first (checked-out rows included)."""
        with self._lock:
            return self._rows.order(tier)

    # ----------------------------------------------------------------- ReservationBook

    def reserve(self, key: bytes, tier: TierName) -> int | None:
        with self._lock:
            # A retiring row's file is still under this key: the publish would take it for a
            # row another writer published, and the retire delete it under the new entry.
            if key in self._rows or key in self._retiring:
                return None
            return self._res.reserve(key, tier)

    def check(self, key: bytes, token: int) -> bool:
        with self._lock:
            return self._res.check(key, token)

    def mark_linked(self, key: bytes, token: int, location: str) -> None:
        with self._lock:
            if not self._res.mark_linked(key, token, location):
                log.debug("mark_linked for a reservation that is no longer live: %s", key.hex())

    def publish(self, key: bytes, token: int, row: StoredRow, hold: RoomHold | None = None) -> bool:
        """``hold``: the room held for the save publishing ``row`` (``held``): what its bytes
        add to the tier is taken out of it."""
        if row.info.key != key:
            raise ValueError("published row carries another key")
        with self._lock:
            if self._res.take(key, token) is None:
                return False
            before = None if hold is None else self._rows.tier_bytes(hold.tier)
            self._rows.insert(row)
            self._landed(hold, before)
            self._inflight.wake()
            self.history.republished(key)
            return True

    def abandon(self, key: bytes, token: int) -> None:
        with self._lock:
            if self._res.take(key, token) is not None:
                self._inflight.wake()

    def adopt(self, row: StoredRow) -> bool:
        with self._lock:
            if row.info.key in self._rows or row.info.key in self._retiring:
                return False  # indexed, or its bytes are being deleted (``_retiring``)
            if len(row.tokens) != row.info.n_tokens:
                log.warning(
                    "not adopting %s: token count disagrees with header", row.info.key.hex()
                )
                return False
            self._rows.insert(row)
            self._inflight.wake()
            self.history.republished(row.info.key)
            return True

    # ----------------------------------------------------------------- in-flight saves

    def mark_in_flight(self, key: bytes) -> None:
        with self._lock:
            self._inflight.mark(key)

    def clear_in_flight(self, key: bytes) -> None:
        with self._lock:
            self._inflight.clear(key)

    def clear_all_in_flight(self) -> None:
        """At close: jobs the writer dropped will never clear their marks; release waiters."""
        with self._lock:
            self._inflight.clear_all()

    def watch_rows(self, events: RowEvents | None) -> None:
        """Tell ``events`` of every row indexed now (``row_stored``, one call each), then of
        every row that joins or leaves from here on, under the lock, so the listener misses
        nothing and sees nothing twice. None stops telling."""
        with self._lock:
            if events is not None:
                for info in self._rows.infos():
                    events.row_stored(self._rows.stored(info.key))
            self._rows.events = events

    # ----------------------------------------------------------------- use

    def checkout(self, key: bytes, *, touch: bool = True) -> StoredRow | None:
        """Pin a row against eviction; with ``touch``, also count a hit and tell the eviction
        policy (``verify`` reads rows without pretending they were used)."""
        leased = self.lease(key, touch=touch)
        return None if leased is None else leased[0]

    def lease(self, key: bytes, *, touch: bool = True) -> tuple[StoredRow, int] | None:
        """``checkout``, plus the generation of the copy pinned: give it back to ``checkin``
        so that a copy published after this one was removed keeps its own pins."""
        with self._lock:
            return self._rows.pin(key, self._clock() if touch else None)

    def checkin(self, key: bytes, gen: int | None = None) -> None:
        with self._lock:
            self._rows.unpin(key, gen)

    def take_dirty_hits(self) -> list[StoredRow]:
        """Rows whose hit count changed since the last call (to persist in a batch)."""
        with self._lock:
            return self._rows.take_dirty_hits()

    # ----------------------------------------------------------------- retire

    def remove(self, key: bytes) -> StoredRow | None:
        """Drop a row even if checked out (corrupt, or deleted on purpose); the caller
        deletes its bytes, then calls ``retired``."""
        with self._lock:
            row = self._rows.remove(key)
            if row is not None:
                self._to_retire([row])
            return row

    def forget(self, key: bytes, tier: TierName) -> StoredRow | None:
        """Drop the row of ``key`` if it lives in ``tier``, even if checked out, leaving its
        bytes and its chunks' bytes in place (a shared tier's row that failed to read)."""
        with self._lock:
            info = self._rows.get(key)
            if info is None or info.tier != tier:
                return None
            return self._rows.remove(key, keep_chunk_bytes=True)

    def remove_unpinned(self, key: bytes, tier: TierName) -> StoredRow | None:
        """Drop the row of ``key`` only if it lives in ``tier`` and nobody has it checked out
        (a promotion moving it to another tier); None, changing nothing, otherwise."""
        with self._lock:
            info = self._rows.get(key)
            if info is None or info.tier != tier or self._rows.refcount(key):
                return None
            # The copy stays in its store, and so do its chunks: they are only forgotten.
            return self._rows.remove(key, keep_chunk_bytes=True)

    def evict(self, n_bytes: int, tiers: Iterable[TierName] | None = None) -> list[StoredRow]:
        """Retire not-checked-out rows of ``tiers`` (all if None) in the eviction policy's
        order across tiers, until at least ``n_bytes`` are freed or none is left."""
        if n_bytes <= 0:
            return []
        with self._lock:
            return self._evict(n_bytes, tiers)

    def enforce_quota(self, tier: TierName, quota_bytes: int) -> list[StoredRow]:
        """Retire rows of ``tier``, in policy order, until it holds at most ``quota_bytes``
        besides the room held for saves in flight."""
        with self._lock:
            excess = self._rows.tier_bytes(tier) + self._room.get(tier, 0) - quota_bytes
            return self._evict(excess, (tier,)) if excess > 0 else []

    def hold_room(
        self, tier: TierName, n_bytes: int, quota_bytes: int
    ) -> tuple[RoomHold | None, list[StoredRow]]:
        """Room for a save of ``n_bytes`` in ``tier`` before it is stored: the rows it
        evicts (in policy order; the caller retires them) and the room held (None: refused).
        The room counts against the quota until its bytes land in the tier (``chunk_stored``
        and ``publish`` given the hold take them out of it) or ``give_room``, so N saves in
        flight at once cannot overshoot it by N rows, and a save's bytes never count twice
        (found by review: a row published, or chunks written, still counted as room held
        until the save returned, so a concurrent save evicted rows it need not, that row
        among them, or was refused). A save that cannot have it (what eviction can free
        is too little: the rest is checked out, pinned by saves in flight or held for them,
        or it is larger than the quota) is refused evicting nothing: the eviction is planned
        first and done only where it makes the room. Found by review, the rows it could
        evict went first, then the save was refused all the same (the chunks a save in
        flight pins stay, whoever names them)."""
        with self._lock:
            held = self._room.get(tier, 0)
            excess = self._rows.tier_bytes(tier) + held + n_bytes - quota_bytes
            victims: list[StoredRow] = []
            if excess > 0:
                plan = self._rows.plan_eviction(excess, (tier,))
                if plan.freed < excess:
                    return None, []
                victims = self._evicted(self._rows.apply_eviction(plan))
            self._room[tier] = held + n_bytes
            return RoomHold(tier, n_bytes), victims

    def give_room(self, hold: RoomHold) -> None:
        """End what ``hold_room`` held: the save is stored (what landed counts as the tier's
        own already) or was dropped; what is left of the room is given back."""
        with self._lock:
            self._unhold(hold, hold.left)

    def held(self, hold: RoomHold) -> ReservationBook:
        """This index as the book of a save holding ``hold``: its ``publish`` takes what the
        row adds to the tier out of the room held."""
        return _HeldBook(self, hold)

    def _landed(self, hold: RoomHold | None, before: int | None) -> None:
        """Bytes of the save holding ``hold`` entered its tier (``before``: the tier's bytes
        just before): they count there now, no longer as room held."""
        if hold is not None and before is not None:
            self._unhold(hold, self._rows.tier_bytes(hold.tier) - before)

    def _unhold(self, hold: RoomHold, n_bytes: int) -> None:
        n = min(max(n_bytes, 0), hold.left)
        hold.left -= n
        left = self._room.get(hold.tier, 0) - n
        if left > 0:
            self._room[hold.tier] = left
        else:
            self._room.pop(hold.tier, None)

    def expire(
        self, forget_only: Collection[TierName] = (), *, count_downtime: bool = False
    ) -> list[StoredRow]:
        """Retire every not-checked-out row unused for longer than its TTL class allows.
        Rows of ``forget_only`` tiers are only forgotten: their chunks' bytes are not freed
        (``FreedChunk.keep``), other processes may still use them. Idle time is counted from
        a row's last use, but no earlier than this index's creation unless ``count_downtime``
        (a restart after downtime expires nothing at once; ``kvwarm cache gc``, a process of
        its own, would otherwise never expire anything)."""
        now = self._clock()
        since = 0.0 if count_downtime else self._started
        with self._lock:
            victims = [
                i
                for i in self._rows.unpinned()
                if now - max(i.last_used, since) > self._ttl[i.ttl_class]
            ]
            removed = [
                self._rows.remove(i.key, keep_chunk_bytes=i.tier in forget_only) for i in victims
            ]
            gone = [r for r in removed if r is not None]
            self._to_retire([r for r in gone if r.info.tier not in forget_only])
            for r in gone:
                self._remember(r, MissReason.EXPIRED, TTL_NAMES[r.info.ttl_class])
            return gone

    def retention_victims(self, key: bytes, keep: int) -> list[StoredRow]:
        """Retire the saved states a conversation no longer needs, now that row ``key``
        (a recurrent or hybrid model's state: each is whole, nothing shared) extends them:
        of the rows of its tier whose tokens are a prefix of its own, all but the ``keep``
        nearest, except those another conversation also extends (a system prompt's
        checkpoint), those checked out, and those of other memory kinds. Rows already
        extending ``key`` count towards ``keep``: saves of one conversation may publish out of
        order (a checkpoint after the finish save above it)."""
        with self._lock:
            info = self._rows.get(key)
            if info is None or info.memory not in STATE_KINDS:
                return []
            keep = max(0, keep - self._rows.below(key))
            victims = []
            for i, (other, shared) in enumerate(self._rows.lineage(key)):
                row = self._rows.get(other)
                if i < keep or shared or row is None or row.tier != info.tier:
                    continue
                if row.memory in STATE_KINDS and not self._rows.refcount(other):
                    victims.append(other)
            gone = self._to_retire([r for r in map(self._rows.remove, victims) if r is not None])
            for r in gone:
                self._remember(r, MissReason.EVICTED, "retention")
            return gone

    def reap_reservations(self) -> tuple[int, list[Orphan]]:
        """Two-stage reaping; linked orphans are returned for the caller to adopt or delete."""
        with self._lock:
            dropped, orphans = self._res.reap()
            if dropped or orphans:
                self._inflight.wake()
            return dropped, orphans

    def resort(self) -> None:
        """Let the eviction policy order rows by what they recorded (after a bulk adopt at
        startup, whose arrival order is directory order)."""
        with self._lock:
            self._rows.resort()

    def _evict(self, n_bytes: int, tiers: Iterable[TierName] | None) -> list[StoredRow]:
        names = list(self._rows.usage() if tiers is None else dict.fromkeys(tiers))
        return self._evicted(self._rows.evict(n_bytes, names))

    def _evicted(self, rows: list[StoredRow]) -> list[StoredRow]:
        """Rows just evicted: retiring, and remembered as evicted by the policy."""
        evicted = self._to_retire(rows)
        for r in evicted:
            self._remember(r, MissReason.EVICTED, self._eviction_name)
        return evicted

    def _to_retire(self, rows: list[StoredRow]) -> list[StoredRow]:
        """Mark ``rows`` (just removed, their bytes to be deleted) retiring until ``retired``."""
        for row in rows:
            self._retiring[row.info.key] = row
        return rows

    def retired(self, rows: Iterable[StoredRow]) -> None:
        """The manifests of ``rows`` are deleted (or failed to be: nothing more will try):
        their keys may be indexed again, and the chunks only they named may now go."""
        with self._lock:
            for row in rows:
                if self._retiring.get(row.info.key) is row:
                    del self._retiring[row.info.key]

    def unretire(self, rows: Iterable[StoredRow]) -> None:
        """The manifests of ``rows`` could not be deleted: they are still stored, so they are
        indexed again, under the same lock that ends their retiring, so no chunk they name
        is taken for deletion in between (``RowTable.insert`` names them again)."""
        with self._lock:
            for row in rows:
                key = row.info.key
                if self._retiring.get(key) is row:
                    del self._retiring[key]
                    if key not in self._rows:
                        self._rows.insert(row)
                        self.history.republished(key)
            self._inflight.wake()

    def _remember(self, row: StoredRow, reason: MissReason, detail: str) -> None:
        info = row.info
        self.history.gone(info.namespace, info.key, row.tokens, reason, info.tier, detail)

    # ----------------------------------------------------------------- chunks

    def pin_chunks(
        self, tier: TierName, keys: Sequence[bytes], timeout_s: float
    ) -> list[bytes] | None:
        """Pin a save's chunks (none can be freed until ``unpin_chunks``); the keys it must
        write. Waits for chunks being deleted right now to be gone; None (nothing pinned) if
        that takes longer than ``timeout_s``."""
        with self._lock:
            write, dying = self._rows.chunks.pin(tier, keys)
            if dying:
                ok = self._chunk_gone.wait_for(
                    lambda: not any(self._rows.chunks.is_dying(tier, k) for k in dying),
                    timeout_s,
                )
                if not ok:
                    self._rows.chunks.unpin(tier, keys)
                    return None
            return write

    def chunk_stored(
        self,
        tier: TierName,
        key: bytes,
        size: int,
        loc: PackLoc | None = None,
        hold: RoomHold | None = None,
    ) -> None:
        """Chunk ``key`` is durable in ``tier``: its own object, or at ``loc`` in a pack.
        ``hold``: the room held for the save that wrote it, which its bytes now leave."""
        with self._lock:
            before = None if hold is None else self._rows.tier_bytes(hold.tier)
            self._rows.chunks.stored(tier, key, size, loc)
            self._landed(hold, before)

    def chunk_locs(self, tier: TierName, keys: Sequence[bytes]) -> list[PackLoc | None]:
        """Where each stored chunk lies in a pack (None: its own object, or not stored)."""
        with self._lock:
            return [self._rows.chunks.loc(tier, k) for k in keys]

    def unpin_chunks(self, tier: TierName, keys: Sequence[bytes]) -> None:
        """End of a save. A chunk no published row names is left as an orphan (evictable)."""
        with self._lock:
            self._rows.chunks.unpin(tier, keys)

    def chunk_in_use(self, tier: TierName, key: bytes) -> bool:
        """Does a row this process indexes name the chunk, or a save pin it?"""
        with self._lock:
            return self._rows.chunks.in_use(tier, key)

    def chunk_lost(self, tier: TierName, key: bytes) -> None:
        """Another process deleted the chunk (a save found it gone): not stored any more,
        whoever names or pins it; a save may write it again."""
        with self._lock:
            self._rows.chunks.lost(tier, key)

    def orphan_chunks(self, tier: TierName) -> list[bytes]:
        """The chunks stored in ``tier`` that no row names and no save pins: left by an
        interrupted save, or by a manifest a scan set aside."""
        with self._lock:
            return [key for _, key in self._rows.chunks.orphans((tier,))]

    def packs_in_use(self, tier: TierName) -> set[bytes]:
        """The packs of ``tier`` holding a chunk a row this process indexes names, or a save
        pins: never swept."""
        with self._lock:
            return self._rows.chunks.packs_in_use(tier)

    def packs_swept(self, tier: TierName, packs: Collection[bytes]) -> None:
        """The shared-tier sweep deleted ``packs`` (or found them gone): the chunks in them
        are not stored any more."""
        with self._lock:
            self._rows.chunks.packs_gone(tier, packs)

    def chunk_swept(self, tier: TierName, key: bytes) -> None:
        """The shared-tier sweep deleted an unreferenced chunk: stop counting it stored."""
        with self._lock:
            self._rows.chunks.forget_unused(tier, key)

    def stored_in(self, key: bytes, tier: TierName) -> StoredRow | None:
        """The indexed row of ``key`` if it lives in ``tier``."""
        with self._lock:
            info = self._rows.get(key)
            return self._rows.stored(key) if info is not None and info.tier == tier else None

    def take_freed_chunks(self) -> list[FreedChunk]:
        """Chunks no row names any more, for the caller to delete (then ``chunk_deleted``),
        but for those a retiring row names: they wait until its manifest is gone (``retired``),
        whichever thread retires it, so no manifest ever names a deleted chunk."""
        with self._lock:
            held = {(r.info.tier, k) for r in self._retiring.values() for k in r.chunk_refs}
            return self._rows.chunks.take_freed(held)

    def chunk_deleted(self, chunk: FreedChunk) -> None:
        with self._lock:
            self._rows.chunks.deleted(chunk.tier, chunk.key)
            self._chunk_gone.notify_all()

    def memory_sizes(self) -> dict[str, TierSizes]:
        """What the rows of each memory kind store and restore (``RowTable.memory_sizes``)."""
        with self._lock:
            return self._rows.memory_sizes()

    def chunk_base(
        self, namespace: Namespace, tokens: Sequence[int]
    ) -> tuple[tuple[int, ...], int]:
        """(chunk lengths, shared tokens) of the published row sharing the longest prefix
        with ``tokens`` (((), 0) if none): where a new row's chunks can line up with it."""
        match = self.longest(namespace, tokens)
        if match is None:
            return (), 0
        return self._rows.chunk_lens(match.row.key), match.n_shared

    def rest_starts(self, tier: TierName, namespace: Namespace, tokens: Sequence[int]) -> set[int]:
        """Where the windows of the rows of ``tier`` that ``tokens`` extend begin in chunks
        (``RowTable.rest_starts``, the 8 longest): a save's window may begin in one of those."""
        with self._lock:
            return self._rows.rest_starts(tier, namespace, tokens, 8)

    def chunk_lens(self, key: bytes) -> tuple[int, ...]:
        """How many tokens each chunk of row ``key`` covers (() if none, or no row)."""
        with self._lock:
            return self._rows.chunk_lens(key)

    def chunk_sizes(self, tier: TierName, keys: Sequence[bytes]) -> list[int | None]:
        """The stored size of each chunk (None: not known to be stored)."""
        with self._lock:
            return [self._rows.chunks.size(tier, k) for k in keys]

    def chunk_refs(self, tier: TierName, key: bytes) -> int:
        with self._lock:
            return self._rows.chunks.refs(tier, key)


class _HeldBook:
    """``Index.held``: the index's ``ReservationBook``, its ``publish`` landing a save's row
    in the room it holds."""

    __slots__ = ("_hold", "_index")

    def __init__(self, index: Index, hold: RoomHold) -> None:
        self._index = index
        self._hold = hold

    def reserve(self, key: bytes, tier: TierName) -> int | None:
        return self._index.reserve(key, tier)

    def check(self, key: bytes, token: int) -> bool:
        return self._index.check(key, token)

    def mark_linked(self, key: bytes, token: int, location: str) -> None:
        self._index.mark_linked(key, token, location)

    def publish(self, key: bytes, token: int, row: StoredRow) -> bool:
        return self._index.publish(key, token, row, self._hold)

    def abandon(self, key: bytes, token: int) -> None:
        self._index.abandon(key, token)

    def adopt(self, row: StoredRow) -> bool:
        return self._index.adopt(row)
