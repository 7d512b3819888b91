"""The index's room for chunks: per tier, each chunk's size, references and pins.

A chunk is referenced by every published manifest (row) of its tier that names it and pinned
by every save that is writing or reusing it. Its bytes count towards its tier's usage once,
however many rows share it.

Invariants:

- ``refs`` counts the published rows naming the chunk (``RowTable`` calls ``ref``/``unref``
  with every insert/remove), so a chunk a live row names is never freed; a checked-out row
  therefore keeps all its chunks.
- A chunk with no references and no pins is an *orphan* (left by a crash between chunk and
  manifest publish, or by a save that lost its race): evictable before any row.
- A chunk leaves in two steps: freed (``dying``: the caller deletes its bytes outside the
  lock) and then ``deleted``. A save that wants a dying chunk waits for the delete and writes
  it again, so a delete can never remove bytes a manifest published after it names. A chunk
  freed only to be forgotten (``keep``) and named again before the caller took it is alive
  again at once: nothing would ever delete it, and nobody need wait.
- Not locked: ``Index`` calls it under its lock. No I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from kvwarm.cache.types import PackLoc, TierName

__all__ = ["ChunkRefs", "FreedChunk"]


@dataclass(slots=True)
class _Chunk:
    size: int | None  # None: not (yet) known to be stored
    refs: int = 0
    pins: int = 0
    dying: bool = False
    loc: PackLoc | None = None  # where it lies in a pack (None: its own object), if stored


@dataclass(frozen=True, slots=True)
class FreedChunk:
    tier: TierName
    key: bytes
    size: int
    # Only forget it: its bytes stay for other processes (a remote shared row forgotten on
    # TTL, or left behind by a promotion), like the row that named it.
    keep: bool = False


class ChunkRefs:
    __slots__ = ("_bytes", "_chunks", "_count", "_freed", "_logical")

    def __init__(self) -> None:
        self._chunks: dict[tuple[TierName, bytes], _Chunk] = {}
        self._bytes: dict[TierName, int] = {}
        # Per tier: stored chunks (each once), and the sum over stored chunks of size times the
        # rows naming it (what the rows restore from chunks, before deduplication).
        self._count: dict[TierName, int] = {}
        self._logical: dict[TierName, int] = {}
        self._freed: list[FreedChunk] = []

    def tier_bytes(self, tier: TierName) -> int:
        return self._bytes.get(tier, 0)

    def tiers(self) -> Iterable[TierName]:
        return self._bytes.keys()

    def count(self, tier: TierName) -> int:
        """Chunks stored in ``tier`` (the ones ``tier_bytes`` counts)."""
        return self._count.get(tier, 0)

    def logical_bytes(self, tier: TierName) -> int:
        """Bytes the rows of ``tier`` name through chunks, a chunk counted once per row."""
        return self._logical.get(tier, 0)

    def row_sizes(self, tier: TierName, keys: Iterable[bytes]) -> tuple[int, int]:
        """(logical, exclusive) chunk bytes of a row naming ``keys``: all its stored chunks,
        and those no other row names."""
        logical = exclusive = 0
        for key in keys:
            c = self._chunks.get((tier, key))
            if c is None or c.size is None or c.dying:
                continue
            logical += c.size
            if c.refs <= 1:
                exclusive += c.size
        return logical, exclusive

    def _add(self, tier: TierName, size: int, n: int, logical: int) -> None:
        self._bytes[tier] = self._bytes.get(tier, 0) + size
        self._count[tier] = self._count.get(tier, 0) + n
        self._logical[tier] = self._logical.get(tier, 0) + logical

    def refs(self, tier: TierName, key: bytes) -> int:
        c = self._chunks.get((tier, key))
        return 0 if c is None else c.refs

    def size(self, tier: TierName, key: bytes) -> int | None:
        c = self._chunks.get((tier, key))
        return None if c is None or c.dying else c.size

    def loc(self, tier: TierName, key: bytes) -> PackLoc | None:
        """Where a stored chunk lies in a pack; None if it is its own object or not stored."""
        c = self._chunks.get((tier, key))
        return None if c is None or c.size is None or c.dying else c.loc

    def learn(self, tier: TierName, keys: Iterable[bytes], locs: Iterable[PackLoc | None]) -> None:
        """A row naming ``keys`` at ``locs`` is indexed (published, adopted): each packed
        chunk not known stored is taken as stored there (a save reusing it touches its pack
        first, and writes it again if the pack is gone: ``chunking._refresh``)."""
        for key, loc in zip(keys, locs, strict=True):
            if loc is not None:
                self.stored(tier, key, loc.length, loc)

    def known(self, tier: TierName, key: bytes) -> bool:
        c = self._chunks.get((tier, key))
        return c is not None and c.size is not None and not c.dying

    # ---- rows

    def ref(self, tier: TierName, keys: Iterable[bytes]) -> None:
        for key in keys:
            c = self._chunks.setdefault((tier, key), _Chunk(None))
            if c.dying:
                self._revive(tier, key, c)
            c.refs += 1
            if c.size is not None and not c.dying:
                self._logical[tier] = self._logical.get(tier, 0) + c.size

    def _revive(self, tier: TierName, key: bytes, c: _Chunk) -> None:
        """A freed chunk named again before anyone took it (to delete or to forget) is alive
        again, as before: a row adopted back after a failed promotion (its bytes only to be
        forgotten), or a row whose manifest could not be deleted, indexed again
        (``Index.unretire``; its chunks were held back from deletion meanwhile). One already
        taken stays dying: its deleter has it."""
        for i, freed in enumerate(self._freed):
            if freed.tier == tier and freed.key == key:
                if c.size is not None:
                    del self._freed[i]
                    c.dying = False
                    self._add(tier, c.size, 1, 0)
                return

    def unref(self, tier: TierName, keys: Iterable[bytes], *, keep: bool = False) -> int:
        """Drop one reference from each; returns the bytes of chunks freed by it (``keep``:
        to be forgotten, their bytes left in place)."""
        freed = 0
        for key in keys:
            c = self._chunks.get((tier, key))
            if c is None or c.refs == 0:
                continue
            c.refs -= 1
            if c.size is not None and not c.dying:
                self._logical[tier] -= c.size
            freed += self._maybe_free(tier, key, c, keep)
        return freed

    def would_free(
        self, tier: TierName, keys: Iterable[bytes], dropped: dict[tuple[TierName, bytes], int]
    ) -> int:
        """What ``unref(tier, keys)`` would free after the references ``dropped`` counts
        were dropped too, changing nothing but ``dropped`` (it counts these as well): an
        eviction planned before it is done (``RowTable.plan_eviction``). A chunk a save pins
        is never freed, whoever names it."""
        freed = 0
        for key in keys:
            c = self._chunks.get((tier, key))
            gone = dropped.get((tier, key), 0)
            if c is None or c.refs - gone <= 0:
                continue
            dropped[(tier, key)] = gone + 1
            if c.refs - gone == 1 and not (c.pins or c.dying) and c.size is not None:
                freed += c.size
        return freed

    def _maybe_free(self, tier: TierName, key: bytes, c: _Chunk, keep: bool = False) -> int:
        if c.refs or c.pins or c.dying:
            return 0
        if c.size is None:
            del self._chunks[(tier, key)]
            return 0
        c.dying = True
        self._add(tier, -c.size, -1, 0)
        self._freed.append(FreedChunk(tier, key, c.size, keep))
        return c.size

    # ---- saves

    def pin(self, tier: TierName, keys: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Pin each chunk for a save; (keys to write, of which those still being deleted)."""
        write: list[bytes] = []
        dying: list[bytes] = []
        for key in keys:
            c = self._chunks.setdefault((tier, key), _Chunk(None))
            c.pins += 1
            if c.size is None or c.dying:
                write.append(key)
            if c.dying:
                dying.append(key)
        return write, dying

    def is_dying(self, tier: TierName, key: bytes) -> bool:
        c = self._chunks.get((tier, key))
        return c is not None and c.dying

    def stored(self, tier: TierName, key: bytes, size: int, loc: PackLoc | None = None) -> None:
        """A chunk's bytes are durable in ``tier`` (written, or found by a scan), as its own
        object or at ``loc`` in a pack."""
        c = self._chunks.setdefault((tier, key), _Chunk(None))
        if c.size is None and not c.dying:
            c.size, c.loc = size, loc
            self._add(tier, size, 1, size * c.refs)

    def unpin(self, tier: TierName, keys: Iterable[bytes]) -> None:
        for key in keys:
            c = self._chunks.get((tier, key))
            if c is not None and c.pins:
                c.pins -= 1
                if c.refs == 0 and c.pins == 0 and c.size is None and not c.dying:
                    del self._chunks[(tier, key)]

    def deleted(self, tier: TierName, key: bytes) -> None:
        """A freed chunk's bytes are gone; a save waiting to write it may now do so."""
        c = self._chunks.get((tier, key))
        if c is None or not c.dying:
            return
        if c.pins or c.refs:
            c.dying, c.size, c.loc = False, None, None
        else:
            del self._chunks[(tier, key)]

    def in_use(self, tier: TierName, key: bytes) -> bool:
        c = self._chunks.get((tier, key))
        return c is not None and bool(c.refs or c.pins or c.dying)

    def lost(self, tier: TierName, key: bytes) -> None:
        """Its bytes are gone (another process swept them): not stored, however used."""
        c = self._chunks.get((tier, key))
        if c is None or c.size is None or c.dying:
            return
        self._add(tier, -c.size, -1, -c.size * c.refs)
        c.size, c.loc = None, None

    def forget_unused(self, tier: TierName, key: bytes) -> None:
        """Its bytes are gone (swept by ``gc_shared``); only an unused chunk is forgotten."""
        c = self._chunks.get((tier, key))
        if c is None or c.refs or c.pins or c.dying:
            return
        if c.size is not None:
            self._add(tier, -c.size, -1, 0)
        del self._chunks[(tier, key)]

    # ---- packs

    def packs_in_use(self, tier: TierName) -> set[bytes]:
        """The packs holding a chunk of ``tier`` a row names or a save pins."""
        return {
            c.loc.pack
            for (t, _), c in self._chunks.items()
            if t == tier and c.loc is not None and (c.refs or c.pins)
        }

    def packs_gone(self, tier: TierName, packs: Collection[bytes]) -> None:
        """``packs`` were deleted (swept): their chunks are not stored any more."""
        if not packs:
            return
        for (t, key), c in list(self._chunks.items()):
            if t == tier and c.loc is not None and c.loc.pack in packs:
                self.lost(tier, key)
                if not (c.refs or c.pins or c.dying):
                    del self._chunks[(tier, key)]

    # ---- eviction

    def orphans(self, tiers: Iterable[TierName]) -> Iterator[tuple[TierName, bytes]]:
        wanted = set(tiers)
        for (tier, key), c in list(self._chunks.items()):
            if tier in wanted and not (c.refs or c.pins or c.dying) and c.size is not None:
                yield tier, key

    def free_orphan(self, tier: TierName, key: bytes) -> int:
        c = self._chunks.get((tier, key))
        return 0 if c is None else self._maybe_free(tier, key, c)

    def take_freed(self, held: Collection[tuple[TierName, bytes]] = ()) -> list[FreedChunk]:
        """The freed chunks, but for those to be deleted that ``held`` names (tier, key):
        they stay freed, for a later call."""
        if not held:
            freed, self._freed = self._freed, []
            return freed
        freed = [c for c in self._freed if c.keep or (c.tier, c.key) not in held]
        self._freed = [c for c in self._freed if not c.keep and (c.tier, c.key) in held]
        return freed
