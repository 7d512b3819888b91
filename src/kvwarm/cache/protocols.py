"""The seam between the index (sole writer of rows and reservations) and the tiers (bytes).

A tier never decides *whether* a row exists; it asks the ``ReservationBook`` (the index) at each
step of the publish protocol and reports the outcome. The index never touches storage; the
facade asks a ``Tier`` to store, load, probe, list or delete. Both sides are thread-safe.

Invariant: the facade knows a tier only through ``Tier`` and its ``TierCapabilities`` -- never
its class, its name or its storage layout -- so a new tier (e.g. s3) is a class implementing
``Tier`` plus one ``tiers.registry.register_tier`` call. See docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvwarm.cache.formats.kvc import KvcFields
from kvwarm.cache.types import PackLoc, RestChunks, RowInfo, SaveRequest, TierName


@dataclass(frozen=True, slots=True)
class TierCapabilities:
    """What the facade may expect of a tier (instead of asking for its name)."""

    persistent: bool  # rows outlive this process: the startup scan finds them again
    shared: bool  # other processes publish into it: probe on a miss, rescan, adopt orphans
    local: bool  # bytes live on this machine (ram, /dev/shm, local disk); s3 does not, and a
    # hit in a tier that is not local is promoted (copied) to a local one
    packs: bool = False  # a save writes the chunks it lacks as one pack object, a restore
    # reads them in ranged GETs (``PacksChunks``): a tier that is neither local nor a
    # directory (s3, redis), where every object costs a request and this process never
    # deletes a chunk itself (``CacheCore.retire`` only forgets them; ``sharedgc`` sweeps)
    pack_writes: bool = False  # with ``packs``: this process's saves write packs. Off (the
    # tier option ``packs=0``) a save writes each chunk as its own object, which a kvwarm from
    # before packs reads, while packs other replicas wrote are still read and swept: a rolling
    # upgrade keeps the old replicas hitting until every one reads packs

    def __post_init__(self) -> None:
        if self.pack_writes and not self.packs:
            raise ValueError("a tier that writes packs reads them: pack_writes needs packs")


@dataclass(frozen=True, slots=True)
class StoredRow:
    """A row as a tier holds it. ``location`` is the file path for file tiers, the object's
    ``s3://`` URL for s3, None for RAM."""

    info: RowInfo
    tokens: tuple[int, ...]
    location: str | None
    # A manifest's chunk keys, in token order, stored in the same tier (() if unchunked),
    # and how many tokens each covers.
    chunks: tuple[bytes, ...] = ()
    chunk_lens: tuple[int, ...] = ()
    # A manifest's rest in chunks of the same tier (an iSWA window), or None.
    rest: RestChunks | None = None
    # Where each of ``chunk_refs`` lies in a pack (None: its own object); () if none does.
    locs: tuple[PackLoc | None, ...] = ()

    @property
    def chunk_refs(self) -> tuple[bytes, ...]:
        """Every chunk the row names: its first cache's, then its rest's."""
        return self.chunks if self.rest is None else self.chunks + self.rest.keys


@dataclass(frozen=True, slots=True)
class RowBytes:
    """What a tier returns from ``load``: payload is a zero-copy view of the read buffer."""

    tokens: tuple[int, ...]
    payload: memoryview
    logits: bytes | None
    buffer: bytearray | None = None  # the scratch buffer ``payload`` views, if reusable
    fields: KvcFields | None = None  # everything the row records (for promotion), if known


class RowEvents(Protocol):
    """Told whenever a row joins or leaves this cache's index (``Cache.watch_rows``): what
    ``kvwarm.cluster`` publishes to its router. ``RowTable.insert`` and ``remove`` are the
    only mutators of membership, so no path that publishes, adopts, promotes, evicts, expires
    or forgets a row is missed.

    Called under the index's lock, in index order: an implementation must be quick (append to
    a log) and must never call back into the cache."""

    def row_stored(self, row: StoredRow) -> None:
        """``row`` is indexed (published, adopted, or a copy replacing one in the same tier)."""
        ...

    def row_dropped(self, row: StoredRow, *, bytes_kept: bool) -> None:
        """``row`` left the index. ``bytes_kept``: only forgotten by this process (a shared
        tier's row after a TTL or a failed read, a copy left behind by a promotion), so its
        bytes stay for others; otherwise its bytes are being deleted."""
        ...


class ReservationBook(Protocol):
    """Implemented by the index. Tokens are positive ints unique per reservation."""

    def reserve(self, key: bytes, tier: TierName) -> int | None:
        """Stage 1. A fresh reservation token, or None if ``key`` is already published or
        reserved by a live writer (the caller then skips the save)."""
        ...

    def check(self, key: bytes, token: int) -> bool:
        """Stage 3. True if ``token`` is still the live reservation of ``key``."""
        ...

    def mark_linked(self, key: bytes, token: int, location: str) -> None:
        """Stage 4 done: the final file exists. Lets the reaper adopt it if we die now."""
        ...

    def publish(self, key: bytes, token: int, row: StoredRow) -> bool:
        """Stage 5. Flip the reservation to a published row and wake waiters. False if the
        reservation was lost meanwhile (the caller must then not announce the row)."""
        ...

    def abandon(self, key: bytes, token: int) -> None:
        """Drop the reservation (write failed, or lost the race). Idempotent."""
        ...

    def adopt(self, row: StoredRow) -> bool:
        """Insert a row found on storage (startup scan, EEXIST adopt, orphan adoption, another
        process's file). False if the key is already present."""
        ...


class Tier(Protocol):
    """One storage tier, e.g. ``ram`` (bytes in process) or a file tier (one file per row).
    Built by name through ``tiers.registry``."""

    @property
    def name(self) -> TierName: ...

    @property
    def quota_bytes(self) -> int: ...

    @property
    def capabilities(self) -> TierCapabilities: ...

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        """Run the publish protocol for one row. Returns the published row, or None if the
        reservation was refused or lost. ``CacheIOError`` if storage failed (nothing is
        announced, the reservation is abandoned, no partial file remains visible)."""
        ...

    def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
        """Read and fully verify (CRC32C, key replay). ``CacheFormatError`` if bad.

        ``buffer``: scratch space the tier may read into when it is large enough, instead of
        allocating; the returned ``RowBytes.buffer`` names whichever buffer ``payload`` views.
        """
        ...

    def load_meta(self, row: StoredRow) -> RowBytes:
        """The row's tokens and final logits alone: its metadata, verified (meta CRC32C, key
        replay), with an empty payload; nothing after the metadata is read or checked (an
        exact hit needs only the logits, and a window's row carries megabytes after them).
        ``CacheFormatError`` if bad."""
        ...

    def delete(self, key: bytes) -> None:
        """Remove whatever bytes are stored under ``key``, valid or not. Missing is fine."""
        ...

    def record_hit(self, row: StoredRow, hits: int, last_used: float) -> None:
        """Persist the hit counter and last-used time (file header) so the eviction
        order survives restarts."""
        ...

    def scan(self) -> Iterator[StoredRow]:
        """Startup: delete temp files, yield every valid row, remove or quarantine invalid ones.
        Never raises because of one bad file."""
        ...

    def probe(self, key: bytes) -> StoredRow | None:
        """Does ``key`` exist on storage? Its row (metadata checked, payload not read) if a
        valid one does -- e.g. a row another process published -- else None."""
        ...

    def stored_keys(self) -> Iterator[bytes]:
        """Keys stored right now, listed cheaply (no row is read): the rescan of a shared
        tier probes only the keys the index does not know."""
        ...

    def problems(self) -> tuple[tuple[str, str], ...]:
        """(where, why) of each bad item the last ``scan`` found and left in place."""
        ...

    # ---- chunks (content-addressed, immutable, shared by manifests; ``cache/formats/chunkfmt.py``)

    def store_chunk(self, key: bytes, head: bytes, payload: bytes) -> int:
        """Make chunk ``key`` (object ``head ‖ payload``) durable, crash-safely (a visible
        chunk is complete); idempotent: a valid chunk already there is kept. Returns the bytes
        it occupies. ``CacheIOError`` if storage failed."""
        ...

    def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
        """The verified payload of chunk ``key``. ``CacheKeyError`` if absent,
        ``CacheFormatError`` if corrupt (the caller deletes it). ``buffer``: space exactly
        the chunk's stored size that the tier may read the object into (the payload then
        views it) instead of allocating."""
        ...

    def delete_chunk(self, key: bytes) -> None:
        """Remove chunk ``key``; missing is fine."""
        ...

    def scan_chunks(self) -> Iterator[tuple[bytes, int]]:
        """Startup: (key, bytes) of every chunk whose head is valid (payload CRC checked on
        load); invalid ones are removed (or reported with ``repair=False``)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Cotenanted(Protocol):
    """A local tier other processes may share (file tiers): whether one has, since we opened
    it. While none has, this process's chunk refcounts cover every row in the tier."""

    def cotenanted(self) -> bool: ...


@runtime_checkable
class SyncsDeletes(Protocol):
    """A tier whose deletes reach the disk only once synced (file tiers: the directory's
    fsync). A power loss, unlike kill -9, may keep any unsynced unlink and lose another, so a
    retire syncs its manifests' unlinks before it deletes a chunk they named: else a manifest
    could come back naming a chunk that did not."""

    def sync_deletes(self) -> None:
        """Make every delete so far durable; ``CacheIOError`` if that fails."""
        ...


@runtime_checkable
class SetsAside(Protocol):
    """A tier whose startup scan quarantines what it rejects (file tiers): the cache asks it
    to set aside a manifest whose chunks are gone, and ``verify`` counts what was set aside."""

    def chunk_size(self, key: bytes) -> int | None:
        """The stored size of chunk ``key`` if it is there and its head is valid."""
        ...

    def set_aside_row(self, key: bytes, why: str) -> bool:
        """Quarantine row ``key``'s file; False if it is only reported (read-only open)."""
        ...

    def set_aside_chunk(self, key: bytes, why: str) -> bool:
        """Quarantine chunk ``key``'s file, found bad by a read; False as ``set_aside_row``."""
        ...

    def quarantined(self) -> tuple[int, int]:
        """(row files, chunk files) set aside so far."""
        ...


@runtime_checkable
class PacksChunks(Protocol):
    """A tier with ``TierCapabilities.packs``: a save's new chunks go into one *pack* object
    (``packs/<hex id>.kvp``, the chunk objects one after another), a restore reads each run of
    adjacent chunks with one ranged read; the sweep lists, ages and deletes packs as it does
    chunks (``cache/upkeep/sharedgc.py``)."""

    def store_pack(self, pack: bytes, parts: list[bytes]) -> int:
        """Put pack ``pack`` (the concatenation of ``parts``) once, visible whole or not at
        all; one already there (the same id: the same chunk heads, so the same offsets) is
        kept and touched, unless a read found it bad (then replaced). Returns its bytes;
        ``CacheIOError`` if storage failed."""
        ...

    def load_packed(self, pack: bytes, pieces: list[tuple[bytes, PackLoc]]) -> list[memoryview]:
        """The verified payloads of ``pieces`` (chunk key, location), adjacent in ``pack``
        and in offset order, read with one ranged read. ``CacheKeyError`` if the pack is
        gone, ``ChunkFormatError`` naming the first chunk whose bytes are bad."""
        ...

    def touch_pack(self, pack: bytes) -> bool:
        """Refresh the pack's last-modified time; False if it is gone."""
        ...

    def pack_ages(self) -> Iterator[tuple[bytes, int, float]]:
        """(id, stored bytes, last-modified epoch seconds) of every pack, listed."""
        ...

    def pack_age(self, pack: bytes) -> float | None:
        """The pack's last-modified time now; None if it is gone."""
        ...

    def delete_pack(self, pack: bytes) -> None:
        """Remove the pack; missing is fine."""
        ...


@runtime_checkable
class ChunkAges(Protocol):
    """A tier whose chunks can be listed with their ages, for the shared-tier chunk sweep
    (``cache/upkeep/sharedgc.py``): file tiers, s3 and redis."""

    def chunk_ages(self) -> Iterator[tuple[bytes, int, float]]:
        """(key, stored bytes, last-modified time in seconds since the epoch) of every chunk
        stored right now, listed cheaply (no chunk is read)."""
        ...

    def chunk_age(self, key: bytes) -> float | None:
        """Chunk ``key``'s last-modified time now (one request, no read); None if it is
        gone. The sweep asks again just before it deletes: a publish may have refreshed it
        (``touch_chunk``) since the listing."""
        ...

    def touch_chunk(self, key: bytes) -> bool:
        """Refresh chunk ``key``'s last-modified time to now, its bytes unchanged; False if
        it is gone. A save reusing a chunk it did not just write does this before its
        manifest, so a sweep's grace period covers the chunk until the manifest names it."""
        ...
