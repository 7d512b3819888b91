"""What every part of the ``Cache`` facade shares: the index, the tiers, the counters, and the
few primitives that turn index decisions into tier calls.

Invariants (the facade's, see ``facade.py`` and docs/architecture.md):

- The index decides, the tiers store: a row enters the index through the publish protocol or
  an adopt of bytes a tier vouched for, and leaves it *before* its bytes are deleted
  (``retire`` only deletes rows the index already forgot), so no lookup can return a row
  whose bytes are gone on purpose.
- Tiers are reached only through the ``Tier`` protocol; what a tier can do is read from its
  ``TierCapabilities``, never from its name.
- No tier I/O happens under the index lock.
- A tier that is not ``local`` (s3, a multi-host directory) is shared with processes whose
  rows this one does not know: its chunks are never deleted here, only forgotten (an explicit
  ``gc_shared`` mark-and-sweep reclaims them), and a row that fails to read there is only
  forgotten, never deleted (``drop_unreadable``). See docs/architecture.md ("Shared tiers").
  The same holds for chunks of a local directory once another process has used it
  (``Cotenanted``): they are swept, not deleted with this process's last row naming them.
- A tier's quota is enforced as its effective quota (``quota.py``: capped by the room on its
  filesystem), and a save its filesystem refuses for want of space (ENOSPC) evicts from that
  tier, in its policy's order, and is retried once (``store_row``): a full disk does not
  stay full until someone calls ``/cache/evict``.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Mapping, Sequence

from kvwarm.buffers import grown
from kvwarm.cache.counters import Counters
from kvwarm.cache.explain import MissReason
from kvwarm.cache.index.index import STATE_KINDS, Index, RoomHold
from kvwarm.cache.protocols import (
    Cotenanted,
    RowBytes,
    SetsAside,
    StoredRow,
    SyncsDeletes,
    Tier,
)
from kvwarm.cache.store.chunking import Freshness, HoldRoom, NoRoomError, store_row
from kvwarm.cache.store.quota import QuotaCaps
from kvwarm.cache.store.writer import WriterPool
from kvwarm.cache.types import (
    TIER_TOTALS,
    EvictResult,
    RowInfo,
    SaveRequest,
    TierName,
    TierSizes,
)
from kvwarm.errors import (
    CacheError,
    CacheIOError,
    CacheKeyError,
    CacheNewerFormatError,
    ChunkFormatError,
    ConfigError,
)

__all__ = ["CacheCore", "ScratchBuffers"]

log = logging.getLogger(__name__)


class ScratchBuffers:
    """Per-thread read buffers for file tiers: faulting in a fresh 50 MB buffer costs more
    than reading into one that is already mapped. A buffer is leased to one ``open_row`` at a
    time, so a nested open on the same thread reads into a fresh buffer."""

    MAX_BYTES = 1 << 30

    def __init__(self) -> None:
        self._local = threading.local()

    def take(self) -> bytearray | None:
        buf: bytearray | None = getattr(self._local, "buf", None)
        self._local.buf = None
        return buf

    def reclaim(self, leased: bytearray | None, data: RowBytes | None) -> None:
        """End of a lease. The payload view is released so that a caller who kept it past
        ``open_row`` gets ``ValueError`` instead of reading bytes a later load overwrote."""
        keep = leased
        if data is not None:
            try:
                data.payload.release()
            except BufferError:  # still exported by the caller (e.g. numpy): never reuse it
                keep = leased if leased is not data.buffer else None
            else:
                keep = data.buffer if data.buffer is not None else leased
        if keep is not None and len(keep) <= self.MAX_BYTES:
            self._local.buf = keep

    def take_arena(self, size: int) -> bytearray | None:
        """This thread's buffer for a manifest's chunks (already faulted in after the first
        restore), grown to ``size``; None if a nested read holds it or it would be too big."""
        if size > self.MAX_BYTES:
            return None
        arena: bytearray | None = getattr(self._local, "arena", None)
        self._local.arena = None
        if arena is None or len(arena) < size:
            old = 0 if arena is None else len(arena)
            arena = None  # the old one goes first: holding both would double the footprint
            arena = grown(size, old)
        return arena

    def reclaim_arena(self, arena: bytearray | None, views: tuple[memoryview, ...]) -> None:
        """End of a lease: release the chunk views first; an arena still exported by the
        caller is dropped, never reused under it."""
        try:
            for view in views:
                view.release()
        except BufferError:
            return
        if arena is not None:
            self._local.arena = arena


class CacheCore:
    """The index and the tiers, and the primitives that turn index decisions into tier calls
    (probe, adopt, retire, quota, store). One object; the facade's other collaborators
    (``upkeep``, ``shared``, ``sharedgc``, ``reads``, ``saves``) are handed it."""

    def __init__(
        self,
        index: Index,
        tiers: Mapping[TierName, Tier],
        counters: Counters,
        writer: WriterPool,
        quota_caps: QuotaCaps | None = None,
        *,
        quota_evictions: bool = True,
    ) -> None:
        self.index = index
        # False: nothing is evicted to meet a quota (a maintenance command's cache, whose
        # settings' quotas may not be those of the server writing the directory).
        self.quota_evictions = quota_evictions
        self.tiers: dict[TierName, Tier] = dict(tiers)
        self.counters = counters
        self.writer = writer
        self.quota_caps = quota_caps if quota_caps is not None else QuotaCaps()
        self.forgotten: set[bytes] = set()  # remote shared rows forgotten on purpose: the
        # rescans skip them, only discovery adopts them again
        self._warned_unreadable: set[TierName] = set()
        self.fresh = Freshness()  # chunks of swept tiers this process wrote or touched, when
        # When a save last found each local tier this process's alone (``swept_elsewhere``).
        self._sole_at: dict[TierName, float] = {}

    def shared_tiers(self) -> list[Tier]:
        """Tiers other processes may publish into: worth probing on a miss."""
        return [t for t in self.tiers.values() if t.capabilities.shared]

    def probe(self, key: bytes) -> RowInfo | None:
        """A row another process published in a shared tier, adopted on sight."""
        for tier in self.shared_tiers():
            try:
                row = tier.probe(key)
            except CacheError as exc:
                # A dead store is a miss; the tier warns once per outage, this counts each.
                self.counters.incr("store_errors")
                log.info("%s: probe failed: %s", tier.name, exc)
                continue
            if row is not None and self.adopt(tier, row):
                return self.index.get(key)
        return self.index.get(key)

    def adopt(self, tier: Tier, row: StoredRow) -> bool:
        try:
            adopted = self.index.adopt(row)
        except ValueError as exc:  # tokens out of range in a file that otherwise parsed
            log.warning("%s: not adopting %s: %s", tier.name, row.info.key.hex(), exc)
            return False
        if adopted:
            self.enforce_quota_later(tier)
        return adopted

    def enforce_quota_later(self, tier: Tier) -> None:
        """Quota enforcement after an adopt, on the writer pool: an adopt happens during a
        lookup (discovery, on the engine's tick path) and eviction may delete objects from a
        remote store. A full queue leaves it to the next save or adopt in that tier."""

        def job() -> bool:
            self.enforce_quota(tier)
            return True

        if not self.writer.submit(job):
            log.debug("%s: quota check deferred (writer queue full)", tier.name)

    # ------------------------------------------------------------------ counting

    def record_miss(self) -> None:
        self.counters.incr("misses")

    def record_admission_failure(self) -> None:
        self.counters.incr("admission_failures")

    def record_restore(self, tier: TierName, nbytes: int, seconds: float) -> None:
        self.counters.record_restore(tier, nbytes, seconds)

    def record_latency(self, name: str, seconds: float) -> None:
        self.counters.record_latency(name, seconds)

    def snapshot(self) -> dict[str, float]:
        """``Cache.counters``: the counters plus each tier's sizes and quota."""
        snap = self.counters.snapshot()
        sizes = self.index.sizes()
        for name, tier in self.tiers.items():
            size = sizes.get(name, TierSizes())
            snap[f"tier_{name}_bytes"] = float(size.physical_bytes)  # stored: each chunk once
            snap[f"tier_{name}_logical_bytes"] = float(size.logical_bytes)  # what rows restore
            snap[f"tier_{name}_dedup_ratio"] = size.dedup_ratio
            snap[f"tier_{name}_rows"] = float(size.rows)
            snap[f"tier_{name}_chunks"] = float(size.chunks)
            snap[f"tier_{name}_quota_bytes"] = float(tier.quota_bytes)
            effective, capped = self.quota_caps.effective(tier, int(size.physical_bytes))
            snap[f"tier_{name}_effective_quota_bytes"] = float(effective)
            snap[f"tier_{name}_quota_capped_by_filesystem"] = float(capped)
            for series in TIER_TOTALS:  # every tier's, at 0 before its first restore
                snap.setdefault(f"tier_{name}_{series}", 0.0)
        for kind, size in self.index.memory_sizes().items():
            snap[f"memory_{kind}_bytes"] = float(size.physical_bytes)
            snap[f"memory_{kind}_logical_bytes"] = float(size.logical_bytes)
            snap[f"memory_{kind}_dedup_ratio"] = size.dedup_ratio
            snap[f"memory_{kind}_chunks"] = float(size.chunks)
            snap[f"memory_{kind}_rows"] = float(size.rows)
        snap["rows"] = float(len(self.index))
        snap["reservations"] = float(self.index.pending_reservations())
        return snap

    def retire(
        self, rows: Sequence[StoredRow], *, count: bool = False, bad: bool = False
    ) -> EvictResult:
        """Delete the bytes of rows the index already forgot, then of the chunks no row
        names any more (manifests first, their unlinks made durable before a chunk's
        (``SyncsDeletes``): a crash or a power loss in between leaves orphans, never a
        manifest without its chunks; a chunk another retire's row names waits for that
        retire, ``Index.take_freed_chunks``). A chunk of a tier that is not local is only
        forgotten: rows of other processes we never indexed may name it.

        A row whose manifest cannot be deleted (EIO, EACCES) is still stored: it is indexed
        again (``Index.unretire``), its bytes counted and its chunks kept, and a later
        eviction tries again; forgotten, its file would stay uncounted against the quota
        until a restart, naming chunks this retire deleted. ``bad``: rows dropped as
        unreadable, forgotten whatever their delete does (never read again)."""
        freed = 0
        kept: list[StoredRow] = []
        try:
            for row in rows:
                try:
                    self.tiers[row.info.tier].delete(row.info.key)
                    freed += row.info.size
                except CacheError as exc:
                    log.warning(
                        "%s: deleting %s failed%s: %s",
                        row.info.tier,
                        row.info.key.hex(),
                        "" if bad else " (it stays indexed, to be retired again)",
                        exc,
                    )
                    if not bad:
                        kept.append(row)
        finally:
            # Their manifests are gone: the chunks they named may go (the index held them
            # back from every retire until now), and their keys may be indexed again.
            held = {id(k) for k in kept}
            rows = [r for r in rows if id(r) not in held]
            self.index.retired(rows)
            self.index.unretire(kept)
        sole: dict[TierName, bool] = {}
        synced: set[TierName] = set()
        for chunk in self.index.take_freed_chunks():
            try:
                if chunk.tier not in sole:
                    sole[chunk.tier] = self.sole_user(self.tiers[chunk.tier])
                # Another process's row may name it: only ``gc_shared`` may delete it.
                if not chunk.keep and sole[chunk.tier]:
                    if chunk.tier not in synced:
                        synced.add(chunk.tier)
                        self.sync_deletes(self.tiers[chunk.tier])
                    freed += chunk.size
                    self.tiers[chunk.tier].delete_chunk(chunk.key)
            except CacheError as exc:
                log.warning("%s: deleting chunk %s failed: %s", chunk.tier, chunk.key.hex(), exc)
            finally:
                self.index.chunk_deleted(chunk)
        if count and rows:
            self.counters.incr("evictions", len(rows))
            self.counters.incr("evicted_bytes", freed)
        return EvictResult(len(rows), freed)

    @staticmethod
    def sync_deletes(tier: Tier) -> None:
        """Before chunks are deleted (a retire, a sweep): make the unlinks of the manifests
        that named them durable (``SyncsDeletes``), so no power loss keeps a manifest and
        loses its chunk. A
        failed sync is logged and the chunks deleted all the same (kept, they would be
        uncounted files until a restart); the scan sets aside a manifest that lost a chunk."""
        if isinstance(tier, SyncsDeletes):
            try:
                tier.sync_deletes()
            except CacheError as exc:
                log.warning("%s: syncing deletes failed: %s", tier.name, exc)

    @staticmethod
    def sole_user(tier: Tier) -> bool:
        """Whether this process's chunk refcounts cover every row in ``tier``: a local tier
        no other process has used since we opened it. Otherwise chunks are swept instead
        (``sharedgc.py``)."""
        if not tier.capabilities.local:
            return False
        return not (isinstance(tier, Cotenanted) and tier.cotenanted())

    def set_aside_chunk(
        self, tier: Tier, exc: ChunkFormatError, others: Sequence[bytes] = ()
    ) -> None:
        """A chunk whose bytes a read found bad: every row naming it fails alike, and while
        its file stays a save of the same tokens reuses it (the index counts it stored; a
        head that is still valid is adopted by ``commit_chunk``), so its prefix would never
        be served again. In a local tier that sets aside it goes to ``quarantine/`` and the
        index stops counting it stored: the next save writes it afresh (the rows naming it
        then read again). ``others``: the rest of its row's chunks, read (the failure path
        only) and set aside too where bad, so one save heals a row whatever else was
        damaged. In a tier other processes share the object stays for them to judge
        (``drop_unreadable``), but the index stops counting it stored all the same: the
        next save writes it, replacing the object the tier saw fail (``ObjectTier``)."""
        aside = tier if isinstance(tier, SetsAside) and tier.capabilities.local else None
        bad = [exc]
        for key in others if aside is not None else ():
            if key != exc.key:
                try:
                    tier.load_chunk(key)
                except ChunkFormatError as other:
                    bad.append(other)
                except CacheError:
                    continue  # gone, or unreadable (EIO): nothing proves its bytes bad
        for found in bad:
            if aside is not None and not aside.set_aside_chunk(found.key, str(found)):
                continue  # a read-only open: changes nothing
            self.index.chunk_lost(tier.name, found.key)

    def drop_unreadable(self, tier: Tier, key: bytes, exc: CacheError) -> None:
        """A row could not be read (corrupt, a chunk missing, gone): never restore it again.
        In a local tier its bytes (and the chunks only it names) are deleted. In a tier other
        processes share, it is only forgotten: a missing chunk or a vanished file may be
        another process's doing or a transient view, and a row that fails its CRC32C here
        may be read fine by a newer kvwarm elsewhere; deleting would spread one process's
        failure to all. A truly dead object is left to ``gc_shared`` and lifecycle rules."""
        detail = "missing" if isinstance(exc, CacheKeyError) else "corrupt"
        if isinstance(exc, CacheNewerFormatError):
            # Not damage: a newer kvwarm's bytes (which it reads), so only forgotten, in a
            # local tier too, its chunks with it (none deleted).
            log.warning("%s: forgetting row %s: %s", tier.name, key.hex(), exc)
            self._forget_unreadable(tier, key, "newer format")
            return
        if tier.capabilities.local:
            log.warning("%s: dropping row %s: %s", tier.name, key.hex(), exc)
            removed = self.index.remove(key)
            if removed is not None:
                self.remember_unreadable(removed, detail)
                if isinstance(exc, CacheKeyError):
                    self._chunks_gone(tier, removed.chunk_refs)
            self.retire([r for r in (removed,) if r is not None], bad=True)
            return
        self.counters.incr("shared_rows_forgotten")
        if tier.name not in self._warned_unreadable:  # one line per tier; the count says more
            self._warned_unreadable.add(tier.name)
            log.warning(
                "%s: forgetting unreadable shared row %s (left in the store; further ones are "
                "counted in shared_rows_forgotten): %s",
                tier.name,
                key.hex(),
                exc,
            )
        else:
            log.info("%s: forgetting unreadable shared row %s: %s", tier.name, key.hex(), exc)
        self._forget_unreadable(tier, key, detail)

    def _forget_unreadable(self, tier: Tier, key: bytes, detail: str) -> None:
        """Forget the row of ``key`` (its bytes and chunks left where they are), remembered
        as unreadable (``detail``) and skipped by the rescans."""
        row = self.index.forget(key, tier.name)
        if row is not None:
            self.fresh.forget(tier.name, row.chunk_refs)
            self.remember_unreadable(row, detail)
            self.forgotten.add(key)  # the rescans skip it; only discovery adopts it again
            self.retire([])  # its chunks: forgotten, never deleted (see ``retire``)

    @staticmethod
    def stale(tier: Tier, indexed: StoredRow, data: RowBytes) -> bool:
        """Whether the manifest just read (``data``) names other chunks than the index's copy
        of its row: a persistent tier's key evicted and published again by another process,
        cut otherwise (another ``chunk_tokens``, another chunk base). Its tokens are the
        same (the key says so) and its chunks verify, so nothing is wrong with it; the copy's
        chunks may be swept, and reading them must not drop the row there now."""
        fields = data.fields
        if not tier.capabilities.persistent or fields is None:
            return False
        rest = fields.rest_chunks
        names = fields.chunks if rest is None else fields.chunks + rest.keys
        return names != indexed.chunk_refs

    def _chunks_gone(self, tier: Tier, refs: Sequence[bytes]) -> None:
        """A local row's read found something missing: each of its chunks that is not in
        the tier (removed behind our back: by hand, a tmp cleaner) is no longer counted
        stored, so the next save of its tokens writes it again. Counted, a save would reuse
        it and publish a manifest naming it, and every later save of that prefix alike,
        until each other row naming it had failed a read (found by review: a prefix never
        served again). The failure path only: one head read per chunk."""
        if not isinstance(tier, SetsAside):
            return
        for chunk in dict.fromkeys(refs):
            try:
                if tier.chunk_size(chunk) is not None:
                    continue
            except CacheError:
                continue  # unreadable (EIO): nothing proves it gone
            log.info("%s: chunk %s is gone: it is written again by the next save", tier.name,
                     chunk.hex())  # fmt: skip
            self.index.chunk_lost(tier.name, chunk)

    def replace_stale(self, tier: Tier, key: bytes) -> None:
        """The row of ``key`` in ``tier`` holds another manifest than the index's copy (a
        process sharing the tier evicted the key and published it again, cut otherwise): the
        copy is forgotten, never deleted (the bytes under the key are that other row), and
        its chunks only forgotten (the process that published the new manifest sweeps what
        none names); the row there now is adopted in its place."""
        log.info("%s: %s was published again since it was indexed: re-reading it", tier.name,
                 key.hex())  # fmt: skip
        row = self.index.forget(key, tier.name)
        if row is not None:
            self.fresh.forget(tier.name, row.chunk_refs)
            self.retire([])  # its chunks: forgotten, never deleted (see ``retire``)
        try:
            current = tier.probe(key)
        except CacheError as exc:
            log.info("%s: cannot re-read %s: %s", tier.name, key.hex(), exc)
            return
        if current is not None:
            self.adopt(tier, current)

    def resize_tier(self, name: TierName, quota_bytes: int) -> None:
        """Give the ram tier ``name`` a new quota and evict down to it now (the server's
        memory budget). ``ConfigError`` for a tier whose quota is fixed at construction."""
        tier = self.tiers.get(name)
        set_quota = getattr(tier, "set_quota", None)
        if tier is None or set_quota is None:
            raise ConfigError(f"tier {name!r} cannot be resized")
        set_quota(quota_bytes)
        self.enforce_quota(tier)

    #: A save asks whether a local tier is still this process's alone at most this often
    #: (``swept_elsewhere``): the answer lists the directory's registry of processes
    #: (``cotenants.py``: an open, two getdents, ten syscalls, ~10 us), which every save to
    #: a local disk or ram_file tier did once reused chunks came to be touched (found by
    #: review: mergerev2). Once another process is seen the answer is sticky, and free.
    SOLE_RECHECK_S = 1.0

    def swept_elsewhere(self, tier: Tier) -> bool:
        """Whether another process may sweep ``tier``'s chunks, so a save touches those it
        reuses (``chunking.Freshness``). For a local tier found this process's alone, the
        answer may be up to ``SOLE_RECHECK_S`` old. While this process is alone every chunk
        its index holds is named by a manifest of its own, which a sweep spares; a save in
        that second names a swept chunk only if a process that registered within it has
        also evicted those manifests and swept their chunks, and that row then reads as a
        miss (forgotten), never a wrong restore. ``retire`` still asks afresh before it
        deletes a chunk."""
        if not tier.capabilities.shared:
            return False
        if not tier.capabilities.local:
            return True
        now = time.monotonic()
        at = self._sole_at.get(tier.name)
        if at is not None and now - at < self.SOLE_RECHECK_S:
            return False
        if not self.sole_user(tier):
            return True
        self._sole_at[tier.name] = now
        return False

    def remember_unreadable(self, row: StoredRow, detail: str) -> None:
        info = row.info
        self.index.history.gone(
            info.namespace, info.key, row.tokens, MissReason.UNREADABLE, info.tier, detail
        )

    def retain(self, tier: Tier, row: StoredRow, keep: int) -> None:
        """A recurrent or hybrid model's state was just published in ``tier``: retire the
        states of its conversation it makes needless (``Index.retention_victims``). Only in
        a local tier this process alone writes: elsewhere another process's conversations
        may extend a row this index does not know to be shared. A row of any other memory
        has no states to retire: asked first, so a save of one does not list a local
        tier's registry of processes (``sole_user``) for nothing (found by review)."""
        if keep < 0 or row.info.memory not in STATE_KINDS:
            return
        if not tier.capabilities.local or not self.sole_user(tier):
            return
        victims = self.index.retention_victims(row.info.key, keep)
        if victims:
            freed = self.retire(victims)
            self.counters.incr("retention_drops", freed.rows)
            self.counters.incr("retention_bytes", freed.bytes)

    def enforce_quota(self, tier: Tier) -> None:
        if not self.quota_evictions:
            return
        used, _ = self.index.usage().get(tier.name, (0, 0))
        quota, _ = self.quota_caps.effective(tier, used)
        self.retire(self.index.enforce_quota(tier.name, quota), count=True)

    def limit(self, tier: Tier) -> int:
        """``tier``'s effective quota now: the most bytes one row there may occupy."""
        used, _ = self.index.usage().get(tier.name, (0, 0))
        return self.quota_caps.effective(tier, used)[0]

    def spill_tiers(self, tier: Tier) -> list[Tier]:
        """Where a row too large for ``tier``'s quota may be saved instead: the tiers
        configured after it, in order, that are local to this host (ram, ram_file, a disk
        directory). A tier that is not (s3, redis, a directory several hosts share) receives
        only the saves configured to go there: a spill into it would publish rows to every
        process sharing it and spend its shared quota, which that configuration did not ask
        for."""
        names = list(self.tiers)
        later = names[names.index(tier.name) + 1 :] if tier.name in self.tiers else []
        return [self.tiers[n] for n in later if self.tiers[n].capabilities.local]

    # Evicted beyond a refused save's payload and tokens: its header, a filesystem block.
    ENOSPC_SLACK_BYTES = 4096

    def store_row(
        self,
        key: bytes,
        request: SaveRequest,
        tier: Tier,
        chunk_tokens: int,
        *,
        count_chunks: bool = True,
    ) -> StoredRow | None:
        """``chunking.store_row``; on ENOSPC, evict from ``tier`` (its policy picks) about
        the save's size and retry once. With nothing freed the error stands. In a tier of
        this process's memory (``ram``) the bytes a save adds hold their room under its quota
        before they are copied in (``hold_room``), so saves stored at once cannot overshoot it;
        other tiers' quotas are enforced after each store."""
        counters = self.counters if count_chunks else None
        hold = None if tier.capabilities.persistent else self._holder(tier)
        limit = self.limit(tier)
        # Other processes sweep its chunks: reused ones are touched before a manifest.
        fresh = self.fresh if self.swept_elsewhere(tier) else None
        try:
            return store_row(
                key, request, tier, self.index, chunk_tokens, counters=counters, hold=hold,
                fresh=fresh, limit=limit,
            )  # fmt: skip
        except CacheIOError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            need = (
                memoryview(request.payload).nbytes
                + 4 * len(request.tokens)
                + len(request.logits or b"")
                + self.ENOSPC_SLACK_BYTES
            )
            freed = self.retire(self.index.evict(need, (tier.name,)), count=True)
            # Bytes, not rows: an eviction frees orphan chunks (a crash's leftovers) first,
            # and those alone may be the room (found by review: retried only after a row).
            if not freed.bytes:
                raise
            log.warning(
                "%s: filesystem full; evicted %d row(s) (%d bytes) and retrying the save of %s",
                tier.name,
                freed.rows,
                freed.bytes,
                key.hex(),
            )
        self.counters.incr("saves_retried_after_enospc")
        return store_row(
            key, request, tier, self.index, chunk_tokens, counters=counters, hold=hold,
            fresh=fresh, limit=limit,
        )  # fmt: skip

    def _holder(self, tier: Tier) -> HoldRoom:
        """Room in ``tier`` for a save's new bytes, evicting in policy order; a save that
        cannot have it (the rest is checked out, pinned or held for saves in flight, or it is
        larger than the quota) fails with ``NoRoomError``, evicting nothing (``Saves`` tries
        a later tier)."""

        def hold(n_bytes: int) -> RoomHold:
            used, _ = self.index.usage().get(tier.name, (0, 0))
            quota, _ = self.quota_caps.effective(tier, used)
            held, victims = self.index.hold_room(tier.name, n_bytes, quota)
            if victims:
                self.retire(victims, count=True)
            if held is None:
                raise NoRoomError(f"{tier.name}: no room for {n_bytes} bytes under its quota")
            return held

        return hold
