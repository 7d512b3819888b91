"""The published rows of one cache: entries, per-tier byte and row totals, the prefix tree and
the eviction policy's order, kept as one set.

Invariants:

- ``insert`` and ``remove`` are the only mutators of membership, and each changes the entry,
  the tier totals, the prefix tree, the policy and the chunk references (``chunkrefs.py``)
  together, so all five always describe the same set of published rows. A tier's bytes are
  its rows' own bytes plus each stored chunk once. Each change is told to ``events`` (when
  set), in order, so a listener replaying them holds the same set of rows.
- A pinned row (refcount > 0, checked out for a read) is never offered as a victim or as an
  expired row; ``remove`` is the only way it leaves.
- ``evict`` returns each key at most once and only keys present, whatever the policy
  yields.
- Not locked: ``Index`` calls every method under its lock, except the lock-free reads marked
  as such (single dict lookups, atomic under the GIL, and ``try_longest``, which validates
  its tree walk with the seqlock in ``prefix.py``). Entries are mutated in place only under
  that lock; a lock-free reader reads ``info``, one reference.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from kvwarm.cache.eviction.base import EvictionPolicy
from kvwarm.cache.index.chunkrefs import ChunkRefs
from kvwarm.cache.index.prefix import PrefixIndex
from kvwarm.cache.protocols import RowEvents, StoredRow
from kvwarm.cache.types import (
    Namespace,
    PackLoc,
    PrefixMatch,
    RestChunks,
    RowInfo,
    TierName,
    TierSizes,
)

__all__ = ["EvictionPlan", "RowTable"]


@dataclass(slots=True)
class EvictionPlan:
    """What an eviction would free (``RowTable.plan_eviction``): orphan chunks, then rows in
    the policy's order, and their bytes."""

    orphans: list[tuple[TierName, bytes]] = field(default_factory=list)
    rows: list[bytes] = field(default_factory=list)
    freed: int = 0
    seen: set[bytes] = field(default_factory=set)


@dataclass(slots=True)
class _Entry:
    info: RowInfo
    location: str | None
    refcount: int = 0
    chunks: tuple[bytes, ...] = ()
    chunk_lens: tuple[int, ...] = ()
    rest: RestChunks | None = None
    locs: tuple[PackLoc | None, ...] = ()  # where its chunks lie in packs (StoredRow.locs)
    # Which stored copy the pins count: a reader's check-in of a copy since removed must not
    # release the pin of a copy published later under the same key.
    gen: int = 0


class RowTable:
    __slots__ = (
        "_bytes",
        "_count",
        "_dirty_hits",
        "_entries",
        "_gens",
        "_policy",
        "_prefix",
        "chunks",
        "events",
    )

    def __init__(self, policy: EvictionPolicy) -> None:
        self._entries: dict[bytes, _Entry] = {}
        self._bytes: dict[TierName, int] = {}
        self._count: dict[TierName, int] = {}
        self._prefix = PrefixIndex()
        self._policy = policy
        self._dirty_hits: set[bytes] = set()  # hit counts not yet written to the tiers
        self.chunks = ChunkRefs()
        self._gens = itertools.count(1)
        self.events: RowEvents | None = None  # told of every insert and remove (``Index``)

    # ----------------------------------------------------------------- lock-free reads

    def get(self, key: bytes) -> RowInfo | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.info

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def refcount(self, key: bytes) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else entry.refcount

    def try_longest(
        self, namespace: Namespace, tokens: Sequence[int], min_shared: int
    ) -> tuple[bool, PrefixMatch | None]:
        """(True, answer) if no writer overlapped the walk; (False, None) to ask again under
        the lock (a split or merge raced us, or the row found was removed meanwhile)."""
        before = self._prefix.version
        hit = self._prefix.longest(namespace, tokens, min_shared)
        entry = None if hit is None else self._entries.get(hit[0])
        if before % 2 == 0 and self._prefix.version == before and (hit is None or entry):
            return True, None if hit is None or entry is None else PrefixMatch(entry.info, hit[1])
        return False, None

    # ----------------------------------------------------------------- reads (under the lock)

    def longest(
        self, namespace: Namespace, tokens: Sequence[int], min_shared: int
    ) -> PrefixMatch | None:
        hit = self._prefix.longest(namespace, tokens, min_shared)
        entry = None if hit is None else self._entries.get(hit[0])
        return None if hit is None or entry is None else PrefixMatch(entry.info, hit[1])

    def try_whole(
        self, namespace: Namespace, tokens: Sequence[int], limit: int
    ) -> tuple[bool, list[PrefixMatch]]:
        """``try_longest`` for the rows that are whole prefixes of ``tokens``."""
        before = self._prefix.version
        hits = self._prefix.whole(namespace, tokens, limit)
        entries = [self._entries.get(key) for key, _ in hits]
        if before % 2 == 0 and self._prefix.version == before and all(entries):
            pairs = zip(entries, hits, strict=True)
            return True, [PrefixMatch(e.info, n) for e, (_, n) in pairs if e]
        return False, []

    def whole(self, namespace: Namespace, tokens: Sequence[int], limit: int) -> list[PrefixMatch]:
        hits = self._prefix.whole(namespace, tokens, limit)
        entries = [(self._entries.get(key), n) for key, n in hits]
        return [PrefixMatch(e.info, n) for e, n in entries if e is not None]

    def chunk_lens(self, key: bytes) -> tuple[int, ...]:
        entry = self._entries.get(key)
        return () if entry is None else entry.chunk_lens

    def rest_starts(
        self, tier: TierName, namespace: Namespace, tokens: Sequence[int], limit: int
    ) -> set[int]:
        """Where the rest chunks of up to ``limit`` rows of ``tier`` that are whole prefixes
        of ``tokens`` start (their windows' first chunks)."""
        out = set()
        for key, _ in self._prefix.whole(namespace, tokens, limit):
            entry = self._entries.get(key)
            if entry is not None and entry.rest is not None and entry.info.tier == tier:
                out.add(entry.rest.start)
        return out

    def infos(self) -> list[RowInfo]:
        """Every row, with its ``logical_bytes`` and ``exclusive_bytes`` as of now."""
        out = []
        for e in self._entries.values():
            info = e.info
            refs = e.chunks if e.rest is None else e.chunks + e.rest.keys
            logical, exclusive = self.chunks.row_sizes(info.tier, refs)
            out.append(
                replace(
                    info,
                    logical_bytes=info.size + logical,
                    exclusive_bytes=info.size + exclusive,
                )
            )
        return out

    def unpinned(self) -> Iterator[RowInfo]:
        return (e.info for e in self._entries.values() if e.refcount == 0)

    def tokens(self, key: bytes) -> tuple[int, ...] | None:
        return self._prefix.tokens(key)

    def lineage(self, key: bytes) -> list[tuple[bytes, bool]]:
        """``PrefixIndex.lineage``: the rows ``key`` extends, nearest first, and whether
        another row outside that path extends each."""
        return self._prefix.lineage(key)

    def below(self, key: bytes) -> int:
        """``PrefixIndex.below``: how many rows extend ``key`` along one path."""
        return self._prefix.below(key)

    def usage(self) -> dict[TierName, tuple[int, int]]:
        """Per tier ever used: (bytes, rows); bytes include the tier's chunks, each once."""
        tiers = dict.fromkeys([*self._count, *self.chunks.tiers()])
        return {t: (self.tier_bytes(t), self._count.get(t, 0)) for t in tiers}

    def sizes(self) -> dict[TierName, TierSizes]:
        """Per tier ever used: what it stores (physical), what its rows restore (logical)."""
        tiers = dict.fromkeys([*self._count, *self.chunks.tiers()])
        return {
            t: TierSizes(
                physical_bytes=self.tier_bytes(t),
                logical_bytes=self._bytes.get(t, 0) + self.chunks.logical_bytes(t),
                rows=self._count.get(t, 0),
                chunks=self.chunks.count(t),
            )
            for t in tiers
        }

    def memory_sizes(self) -> dict[str, TierSizes]:
        """Per memory kind the rows record ("unknown" for those that do not say): their own
        bytes plus each chunk they name once (``physical_bytes``; a chunk is never shared
        across kinds, whose namespaces differ), and what they restore (``logical_bytes``)."""
        own: dict[str, int] = {}
        logical: dict[str, int] = {}
        rows: dict[str, int] = {}
        named: dict[str, set[tuple[TierName, bytes]]] = {}
        for e in self._entries.values():
            kind = e.info.memory or "unknown"
            refs = e.chunks if e.rest is None else e.chunks + e.rest.keys
            rows[kind] = rows.get(kind, 0) + 1
            own[kind] = own.get(kind, 0) + e.info.size
            logical[kind] = logical.get(kind, 0) + e.info.size
            logical[kind] += self.chunks.row_sizes(e.info.tier, refs)[0]
            named.setdefault(kind, set()).update((e.info.tier, k) for k in refs)
        out = {}
        for kind, n in rows.items():
            sizes = [self.chunks.size(tier, key) for tier, key in named[kind]]
            stored = [size for size in sizes if size is not None]
            out[kind] = TierSizes(own[kind] + sum(stored), logical[kind], n, len(stored))
        return out

    def tier_bytes(self, tier: TierName) -> int:
        return self._bytes.get(tier, 0) + self.chunks.tier_bytes(tier)

    def order(self, tier: TierName) -> list[bytes]:
        return self._policy.order(tier)

    def stored(self, key: bytes) -> StoredRow:
        entry = self._entries[key]
        tokens = self._prefix.tokens(key)
        assert tokens is not None, "row present without tokens"
        return StoredRow(
            entry.info,
            tokens,
            entry.location,
            entry.chunks,
            entry.chunk_lens,
            entry.rest,
            entry.locs,
        )

    # ----------------------------------------------------------------- membership

    def insert(self, row: StoredRow) -> None:
        """Publish ``row``. A row already present under its key is replaced, keeping its pins
        (e.g. a rescan adopted our own file before our publish landed)."""
        info = row.info
        key = info.key
        refcount, gen = 0, next(self._gens)
        old = self._entries.get(key)
        if old is not None:
            refcount, gen = old.refcount, old.gen  # the pins move to the new copy
            moved = old.info.tier != info.tier
            dropped = self._remove(key, keep_chunk_bytes=False)
            if moved and dropped is not None and self.events is not None:
                # Its bytes in the other tier are nobody's to delete here: only forgotten.
                self.events.row_dropped(dropped, bytes_kept=True)
        self._prefix.insert(info.namespace, key, row.tokens, info.size)
        self._entries[key] = _Entry(
            info, row.location, refcount, row.chunks, row.chunk_lens, row.rest, row.locs, gen
        )
        self.chunks.ref(info.tier, row.chunk_refs)
        if row.locs:  # a save reusing its chunks names the same places (``chunking``)
            self.chunks.learn(info.tier, row.chunk_refs, row.locs)
        self._bytes[info.tier] = self._bytes.get(info.tier, 0) + info.size
        self._count[info.tier] = self._count.get(info.tier, 0) + 1
        self._policy.insert(key, info)
        if self.events is not None:
            self.events.row_stored(row)

    def remove(self, key: bytes, *, keep_chunk_bytes: bool = False) -> StoredRow | None:
        """Forget a row, pinned or not; the row as it was, for the caller to delete its bytes
        (and the chunks no other row names: ``chunks.take_freed``, marked to be only
        forgotten with ``keep_chunk_bytes``)."""
        row = self._remove(key, keep_chunk_bytes=keep_chunk_bytes)
        if row is not None and self.events is not None:
            self.events.row_dropped(row, bytes_kept=keep_chunk_bytes)
        return row

    def _remove(self, key: bytes, *, keep_chunk_bytes: bool) -> StoredRow | None:
        if key not in self._entries:
            return None
        row = self.stored(key)
        tier = row.info.tier
        del self._entries[key]
        self.chunks.unref(tier, row.chunk_refs, keep=keep_chunk_bytes)
        self._bytes[tier] -= row.info.size
        self._count[tier] -= 1
        self._prefix.remove(key)
        self._policy.remove(key)
        self._dirty_hits.discard(key)
        return row

    def remove_all(self, keys: Iterable[bytes]) -> list[StoredRow]:
        return [row for row in map(self.remove, keys) if row is not None]

    def resort(self) -> None:
        self._policy.resort()

    # ----------------------------------------------------------------- use

    def pin(self, key: bytes, now: float | None) -> tuple[StoredRow, int] | None:
        """Count a reader; with ``now``, also a hit at that time (the policy is told). The
        row and the generation of the copy pinned (for ``unpin``)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.refcount += 1
        if now is not None:
            info = entry.info
            entry.info = replace(info, hits=info.hits + 1, last_used=now)
            self._policy.touch(key, entry.info)
            self._dirty_hits.add(key)
        return self.stored(key), entry.gen

    def unpin(self, key: bytes, gen: int | None = None) -> None:
        """A reader is done; with ``gen``, only if the copy it pinned is still the one stored
        (a copy removed meanwhile took its pins with it)."""
        entry = self._entries.get(key)
        if entry is not None and entry.refcount > 0 and (gen is None or gen == entry.gen):
            entry.refcount -= 1

    def take_dirty_hits(self) -> list[StoredRow]:
        keys, self._dirty_hits = self._dirty_hits, set()
        return [self.stored(k) for k in keys if k in self._entries]

    def evict(self, n_bytes: int, tiers: Sequence[TierName]) -> list[StoredRow]:
        """Free at least ``n_bytes`` of ``tiers`` if possible: orphan chunks first, then
        unpinned rows in policy order. A row frees its own bytes and the chunks no other row
        names, so a long row goes from the leaves and a prefix other rows share stays."""
        return self.apply_eviction(self.plan_eviction(n_bytes, tiers))

    def plan_eviction(self, n_bytes: int, tiers: Sequence[TierName]) -> EvictionPlan:
        """What ``evict(n_bytes, tiers)`` would do, changing nothing: the orphan chunks and
        rows it would free, in order, and the bytes they free (the chunks a save in flight
        pins stay, whoever names them). ``apply_eviction`` does it, before anything else
        changes the table (under the same lock hold): a caller that needs the bytes can
        first see whether it would get them (``Index.hold_room``)."""
        plan = EvictionPlan()
        for tier, key in self.chunks.orphans(tiers):
            if plan.freed >= n_bytes:
                return plan
            plan.orphans.append((tier, key))
            plan.freed += self.chunks.size(tier, key) or 0
        if plan.freed >= n_bytes:
            return plan
        dropped: dict[tuple[TierName, bytes], int] = {}
        for key in self._policy.victims(tiers, self._evictable):
            if plan.freed >= n_bytes:
                break
            entry = self._entries.get(key)
            if entry is None or entry.refcount or entry.info.tier not in tiers or key in plan.seen:
                continue  # a policy's mistake must not evict twice or evict a pinned row
            refs = entry.chunks if entry.rest is None else entry.chunks + entry.rest.keys
            plan.rows.append(key)
            plan.seen.add(key)
            plan.freed += entry.info.size + self.chunks.would_free(entry.info.tier, refs, dropped)
        return plan

    def apply_eviction(self, plan: EvictionPlan) -> list[StoredRow]:
        """Do what ``plan_eviction`` planned; the rows removed."""
        for tier, key in plan.orphans:
            self.chunks.free_orphan(tier, key)
        victims = [row for row in map(self.remove, plan.rows) if row is not None]
        assert len(victims) == len(plan.rows), "the table changed since its eviction plan"
        return victims

    def _evictable(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.refcount == 0
