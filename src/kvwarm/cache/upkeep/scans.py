"""The cache's upkeep: startup scan, TTL/reservation sweeps, rescans of shared tiers, hit
persistence and verification. A collaborator of ``Cache`` (facade.py), handed the
``CacheCore`` and the chunk sweeps it runs on each pass.

Invariants:

- One bad row never stops a scan, a sweep or a verify.
- ``verify`` reports every bad file, the ones a startup scan rejected and left in place
  included (less those whose path is gone since: removed by hand), and
  deletes nothing unless asked to ``repair``; what repairing scans already set aside
  (``quarantine/``) it counts apart, as fixed. Repairing drops a bad row as a failed read
  does (``CacheCore.drop_unreadable``): its bytes are deleted in a local tier, and in one
  other processes share (a shared directory, s3, redis) it is only forgotten.
- A repairing startup scan adopts no manifest whose chunks are gone: chunks are scanned first
  (a damaged one is set aside), and a manifest naming one that is neither indexed nor on disk
  with a valid head is quarantined, so a damaged chunk costs its rows at startup, not at
  their next read (``_adopt_scanned``).
- A row or chunk in a newer kvwarm's format (``CacheNewerFormatError``) is not bad: left
  where it is, neither adopted nor set aside, nor reported by ``verify`` (a newer kvwarm
  sharing the directory, or the one before a rollback, reads it).
- Only bytes proven bad are set aside: a read that failed on our side (``CacheIOError``:
  EIO, EACCES; EMFILE or ENOMEM stop the scan) leaves the row or chunk where it is, logged
  and reported, for a later scan.
- An orphan (a writer linked its file and vanished) is adopted if its tier vouches for the
  bytes, and deleted only if they are unusable and no row of its key is indexed.
- TTL expiry deletes bytes only in local tiers; an expired row of a remote shared tier is
  forgotten, its bytes left for the other processes (see ``gc``), and stays forgotten by the
  rescans: only a lookup that needs it (discovery) adopts it again, so no sweep reads it
  just for the next gc to forget it.
See docs/architecture.md.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from kvwarm.cache.api import VerifyReport
from kvwarm.cache.index.index import Orphan
from kvwarm.cache.protocols import SetsAside, StoredRow, Tier
from kvwarm.cache.store.chunking import chunk_reads
from kvwarm.cache.store.core import CacheCore
from kvwarm.cache.types import EvictResult
from kvwarm.cache.upkeep.periodic import run_every
from kvwarm.cache.upkeep.sharedgc import SharedSweep
from kvwarm.errors import (
    CacheError,
    CacheFormatError,
    CacheIOError,
    CacheKeyError,
    CacheNewerFormatError,
    ChunkFormatError,
)

__all__ = ["CacheUpkeep"]

log = logging.getLogger(__name__)


def _still_there(where: str) -> bool:
    """Whether a problem a scan reported at ``where`` may still stand: not if ``where`` is a
    file path where nothing is any longer. An object's URL or a chunk's key is kept."""
    return not os.path.isabs(where) or os.path.lexists(where)


class CacheUpkeep:
    """Scans, sweeps, verification and hit persistence of one cache. ``sweep``: the chunk
    sweeps it runs on each pass (``sharedgc.SharedSweep``); ``stop`` ends ``sweep_loop``."""

    def __init__(
        self,
        core: CacheCore,
        sweep: SharedSweep,
        *,
        sweep_interval_s: float,
        stop: threading.Event,
    ) -> None:
        self._core = core
        self._sweeper = sweep
        self._sweep_interval_s = sweep_interval_s
        self._stop = stop
        self._scan_problems: list[tuple[str, str]] = []
        # Tiers whose last scan stopped before the end (a store down, no descriptors left):
        # rows of theirs may be unindexed, so unchecked. Until a scan completes (a rescan).
        self._unscanned: dict[str, str] = {}

    def scan(self, tier: Tier) -> None:
        """Adopt every valid row a tier already holds; one bad file never stops the scan."""
        adopted = 0
        try:
            # Chunks first, so the rows naming them find them stored; those no row names are
            # orphans of an interrupted save, adopted unreferenced (evicted first).
            for chunk_key, size in tier.scan_chunks():
                self._core.index.chunk_stored(tier.name, chunk_key, size)
            for row in tier.scan():
                try:
                    adopted += self._adopt_scanned(tier, row)
                except CacheNewerFormatError as exc:
                    # A chunk it names is a newer kvwarm's (which may read the row): left
                    # alone, neither adopted nor set aside, and not reported as bad.
                    log.info("%s: leaving %s alone: %s", tier.name, row.info.key.hex(), exc)
                except ValueError as exc:
                    log.warning("%s: skipping %s: %s", tier.name, row.info.key.hex(), exc)
                    self._scan_problems.append((row.location or row.info.key.hex(), str(exc)))
                except CacheIOError as exc:
                    if exc.exhausted:
                        raise  # every other row would fail alike: the scan stops, below
                    # A chunk it names could not be read: nothing proves the row bad, so it
                    # is neither set aside nor adopted now (a rescan finds it again).
                    where = row.location or row.info.key.hex()
                    log.warning(
                        "%s: cannot read a chunk of %s, leaving it: %s", tier.name, where, exc
                    )
                    self._scan_problems.append((where, f"unreadable: {exc}"))
            if isinstance(tier, SetsAside) and tier.capabilities.local:
                # The orphans' payloads: the chunk scan read only heads, and a save of an
                # orphan's tokens reuses it as stored. Orphans are few (crash leftovers, the
                # chunks of a manifest set aside above, often damaged with it): read whole.
                for key in self._core.index.orphan_chunks(tier.name):
                    try:
                        tier.load_chunk(key)
                    except ChunkFormatError as bad:
                        if tier.set_aside_chunk(key, str(bad)):
                            self._core.index.chunk_swept(tier.name, key)
                        else:  # a read-only open: reported
                            self._scan_problems.append((f"chunk {key.hex()}", str(bad)))
                    except CacheKeyError:
                        continue  # deleted meanwhile (another process's sweep)
                    except CacheIOError as failed:
                        if failed.exhausted:
                            raise
                        self._scan_problems.append((f"chunk {key.hex()}", f"unreadable: {failed}"))
        except CacheError as exc:  # e.g. an s3 store down at start: its rows come by probing
            self._core.counters.incr("store_errors")
            log.warning("%s: scan stopped early: %s", tier.name, exc)
            self._unscanned[tier.name] = str(exc)
        except Exception:
            log.exception("%s: scan stopped early", tier.name)
        self._scan_problems.extend(tier.problems())
        if adopted:
            log.info("%s: adopted %d rows", tier.name, adopted)

    def _adopt_scanned(self, tier: Tier, row: StoredRow) -> bool:
        """Adopt a row the scan found, unless it is a manifest naming a chunk that is gone
        (set aside instead, in a tier that sets aside). A chunk not seen by the chunk scan
        but on disk now (another process's save since) is counted stored, not missing."""
        if row.chunks and isinstance(tier, SetsAside) and tier.capabilities.local:
            refs = row.chunk_refs  # a window's chunks too
            sizes = self._core.index.chunk_sizes(tier.name, refs)
            gone = []
            for chunk, size in zip(refs, sizes, strict=True):
                if size is not None:
                    continue
                found = tier.chunk_size(chunk)
                if found is None:
                    gone.append(chunk)
                else:
                    self._core.index.chunk_stored(tier.name, chunk, found)
            if gone:
                why = f"names {len(gone)} chunk(s) missing or damaged, first {gone[0].hex()}"
                if tier.set_aside_row(row.info.key, why):
                    return False
        return self._core.index.adopt(row)

    def gc(self, *, count_downtime: bool = False) -> EvictResult:
        _, orphans = self._core.index.reap_reservations()
        for orphan in orphans:
            self._adopt_orphan(orphan)
        remote = [n for n, t in self._core.tiers.items() if not t.capabilities.local]
        expired = self._core.index.expire(forget_only=remote, count_downtime=count_downtime)
        # A remote shared tier (s3, a multi-host directory) serves other processes too: our
        # idle timer only makes us forget its rows (discovery finds them again); deleting
        # them is left to the quota's eviction and to the store's own lifecycle rules.
        mine: list[StoredRow] = []
        for row in expired:
            if self._core.tiers[row.info.tier].capabilities.local:
                mine.append(row)
            else:
                self._core.forgotten.add(row.info.key)
        return self._core.retire(mine, count=True)

    def _adopt_orphan(self, orphan: Orphan) -> None:
        """Stage-2 reap: the writer linked its file and vanished. Keep the bytes if they parse."""
        tier = self._core.tiers.get(orphan.tier)
        if tier is None:
            return
        try:
            row = tier.probe(orphan.key)
        except CacheError as exc:  # an unreachable store: its orphan waits for the next sweep
            self._core.counters.incr("store_errors")
            log.info("%s: cannot look at orphan %s: %s", tier.name, orphan.location, exc)
            return
        if row is not None and self._core.adopt(tier, row):
            log.info("%s: adopted orphaned row %s", tier.name, orphan.key.hex())
        elif row is None and orphan.key not in self._core.index:
            try:
                tier.delete(orphan.key)  # unparseable and unannounced: nobody can use it
            except CacheError as exc:
                log.warning("%s: cannot remove orphan %s: %s", tier.name, orphan.location, exc)

    def verify(self, *, repair: bool = False) -> VerifyReport:
        # What the startup scan left in place and reported, less the files removed since (an
        # operator deleting the directory a message said to delete; found by review: a
        # server's /cache/verify reported it as bad until the server stopped).
        self._scan_problems = [p for p in self._scan_problems if _still_there(p[0])]
        checked = len(self._scan_problems)
        bad = list(self._scan_problems)
        # Found by review: a tier the scan could not read whole (a store down) was checked
        # as far as it got, and "0 bad" said all was well of rows it never saw.
        bad += [
            (name, f"unreadable: the scan stopped early, its rows unchecked: {why}")
            for name, why in self._unscanned.items()
        ]
        good_chunks: set[tuple[str, bytes]] = set()  # a chunk many rows share is read once
        failed: list[tuple[Tier, bytes, CacheError, tuple[bytes, ...]]] = []
        for info in self._core.index.rows():
            leased = self._core.index.lease(info.key, touch=False)
            if leased is None:
                continue  # removed meanwhile
            stored, gen = leased
            try:
                checked += 1
                tier = self._core.tiers[info.tier]
                data = tier.load(stored)
                if data.tokens != stored.tokens:
                    raise CacheFormatError("tokens differ from the index")
                if self._core.stale(tier, stored, data):
                    # Published again by another process, cut otherwise: the copy is not
                    # what is stored, and its chunks failing to read proves nothing bad
                    # (a repair would delete the row there now). Indexed afresh, unchecked.
                    checked -= 1
                    self._core.replace_stale(tier, info.key)
                    continue
                refs, locs = stored.chunk_refs, stored.locs or (None,) * len(stored.chunk_refs)
                todo = [i for i, k in enumerate(refs) if (tier.name, k) not in good_chunks]
                # Head, key replay and payload CRC32C; a pack's run in one ranged read.
                for read in chunk_reads(
                    tier, [refs[i] for i in todo], [locs[i] for i in todo] if stored.locs else ()
                ):
                    good_chunks.update((tier.name, refs[todo[i]]) for i, _ in read())
            except (CacheFormatError, CacheKeyError) as exc:
                if isinstance(exc, CacheKeyError) and self._gone(tier, info.key):
                    # Removed meanwhile, manifest and all (another process's eviction beside
                    # a read-only verify; found by review: reported as a bad file, exit 1):
                    # no file is bad, so it is neither checked nor reported.
                    checked -= 1
                    if repair:
                        failed.append((tier, info.key, exc, stored.chunk_refs))
                    continue
                why = str(exc)
                if isinstance(exc, ChunkFormatError):  # say which file is bad
                    why = f"chunk {exc.key.hex()}: {why}"
                bad.append((stored.location or info.key.hex(), why))
                if repair:
                    failed.append((tier, info.key, exc, stored.chunk_refs))
            except CacheIOError as exc:
                # Could not be read at all (EIO, EACCES, a store down): reported, the verify
                # goes on to the other rows, and nothing is repaired on an I/O failure.
                bad.append((stored.location or info.key.hex(), f"unreadable: {exc}"))
            finally:
                self._core.index.checkin(info.key, gen)
        aside: set[tuple[str, bytes]] = set()
        for tier, key, error, refs in failed:  # as a failed read: deleted if local, else forgotten
            if isinstance(error, ChunkFormatError) and (tier.name, error.key) not in aside:
                aside.add((tier.name, error.key))
                self._core.set_aside_chunk(tier, error, refs)
            self._core.drop_unreadable(tier, key, error)
        rows = chunks = 0
        for tier in self._core.tiers.values():
            if isinstance(tier, SetsAside):
                tier_rows, tier_chunks = tier.quarantined()
                rows, chunks = rows + tier_rows, chunks + tier_chunks
        return VerifyReport(checked, tuple(bad), rows, chunks)

    def _gone(self, tier: Tier, key: bytes) -> bool:
        """Whether the row of ``key`` is no longer stored in ``tier`` (a file or chunk its
        verify found missing went with it). A store that cannot say: not gone (reported)."""
        try:
            return tier.probe(key) is None
        except CacheError:
            return False

    def rescan(self) -> int:
        """Adopt rows other processes published in shared tiers since we last looked.
        Cheap: lists keys and reads only rows whose key the index does not know."""
        adopted = 0
        listed: set[bytes] | None = set()
        for tier in self._core.shared_tiers():
            try:
                for key in tier.stored_keys():
                    if listed is not None:
                        listed.add(key)
                    index = self._core.index
                    if key in index or index.in_flight(key) or key in self._core.forgotten:
                        continue
                    try:
                        row = tier.probe(key)
                    except CacheIOError as exc:
                        if not tier.capabilities.local or exc.exhausted:
                            raise  # a store down, or no descriptors: every key would fail
                        # One local file that cannot be read (EIO, EACCES): the others can.
                        log.info("%s: rescan cannot read %s: %s", tier.name, key.hex(), exc)
                        continue
                    if row is not None and self._core.adopt(tier, row):
                        adopted += 1
                self._unscanned.pop(tier.name, None)  # listed whole: none unseen
            except CacheError as exc:  # e.g. the s3 store is down: try again next sweep
                self._core.counters.incr("store_errors")
                log.info("%s: rescan stopped: %s", tier.name, exc)
                listed = None  # a partial listing: keep every forgotten key
        if listed is not None:
            self._core.forgotten.intersection_update(listed)  # deleted meanwhile: no need to keep
        return adopted

    def persist_hits(self) -> None:
        """Write batched hit counts / last-used times to the tiers (the eviction order survives
        restarts)."""
        for row in self._core.index.take_dirty_hits():
            try:
                self._core.tiers[row.info.tier].record_hit(row, row.info.hits, row.info.last_used)
            except CacheError as exc:
                log.info("%s: cannot record hit: %s", row.info.tier, exc)

    def sweep(self) -> None:
        """One sweeper pass: TTL + reservations, hit persistence, rescan of shared tiers, and
        (when due) the chunk sweep of local directories other processes use. A step that
        fails skips none of the others; the first failure is raised once all have run (found
        by review: a step that kept failing skipped the rest on every pass, so the chunks of
        a directory other processes share were never swept), a later one's is logged."""
        steps: tuple[tuple[str, Callable[[], object]], ...] = (
            ("the TTL sweep", self.gc),
            ("hit persistence", self.persist_hits),
            ("the rescan", self.rescan),
            ("the chunk sweep", self._sweeper.sweep_local),
        )
        failed: Exception | None = None
        for name, step in steps:
            try:
                step()
            except Exception as exc:
                if failed is None:
                    failed = exc
                else:
                    log.warning("cache sweep: %s failed too: %r", name, exc)
        if failed is not None:
            raise failed

    def sweep_loop(self) -> None:
        run_every(self._stop, self._sweep_interval_s, self.sweep, "cache sweep", log)
