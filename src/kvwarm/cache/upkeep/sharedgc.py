"""Mark-and-sweep of the chunks in shared tiers (``Cache.gc_shared``, ``kvwarm cache gc
--shared``, and every ``CHUNK_SWEEP_INTERVAL_S`` from the sweeper). A collaborator of
``Cache`` (facade.py), handed the ``CacheCore``.

Several processes or hosts publish into a tier that is not local (s3, a directory marked
shared), or into a local directory another process has used since we opened it
(``Cotenanted``); each knows only the rows it indexed, so none may delete a chunk because
*its* rows stopped naming it (``CacheCore.retire`` only forgets them). Unreferenced chunks are
reclaimed here instead, from what the store itself holds.

Invariants:

- Packs (a tier with ``TierCapabilities.packs``: a save's chunks in one object) follow the
  chunks' rules: listed with the chunks, marked by the pack locations of the manifests
  (``StoredRow.locs``), kept while a chunk this process uses lies in one, aged again right
  before the delete (a save reusing a packed chunk touches its pack).
- Order: list the chunks (with their ages) first, then mark every chunk any manifest in the
  store names, then list the manifests again and mark the ones published meanwhile, and
  only then delete. The publish protocol writes a manifest's chunks before the manifest, so
  a chunk written for a manifest not yet published is young: a chunk is deleted only if no
  manifest names it AND it is older than ``grace_s``. A manifest published during the sweep
  that reuses an old chunk is caught by the second listing.
- A listed manifest that cannot be read (corrupt, a newer format) may name chunks: the sweep
  of that tier then deletes nothing and says so (``SweepResult.refused``).
- A chunk this process has pinned or referenced (a save in progress, a row it indexes) is
  never deleted, whatever the listings say.
- A save reusing a chunk it did not just write touches it before its manifest
  (``chunking._refresh``; a chunk already there when it writes one is touched too), and the
  sweep asks each chunk's age again right before deleting it: a chunk a manifest about to
  be published names is young when the delete would come.
- Before the first chunk is deleted the store's deletes are synced (``SyncsDeletes``: a
  directory's fsync), so a power loss cannot bring back a deleted manifest without its chunks.
- Nothing runs under the index lock; no sleep: ``on_step`` (tests) sees each step.

Residual window: a save that touches a chunk between the sweep's last look at its age and
its delete (one round trip) publishes a manifest naming a deleted chunk; the row then reads
as a miss (forgotten, never a wrong restore), and a later save of its key replaces it.
See docs/architecture.md ("Shared tiers") and docs/internals.md ("Chunk garbage collection").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

from kvwarm.cache.protocols import ChunkAges, PacksChunks, Tier
from kvwarm.cache.store.chunking import REFRESH_AFTER_S
from kvwarm.cache.store.core import CacheCore
from kvwarm.cache.types import DEFAULT_GRACE_S, SweepResult, TierName
from kvwarm.errors import CacheError, ConfigError

__all__ = ["CHUNK_SWEEP_INTERVAL_S", "DEFAULT_GRACE_S", "SharedSweep", "SweepResult", "SweepStep"]

log = logging.getLogger(__name__)

SweepStep = Callable[[str, TierName], None]


#: How often the sweeper sweeps local directories other processes share (``sweep_local``).
CHUNK_SWEEP_INTERVAL_S = 600.0


class SharedSweep:
    """The chunk sweeps of one cache: its own clock of the last local sweep."""

    def __init__(self, core: CacheCore) -> None:
        self._core = core
        self._last_local_sweep: float | None = None

    def sweep_local(self, grace_s: float = DEFAULT_GRACE_S, *, force: bool = False) -> None:
        """Sweep the local tiers another process has used since we opened them, at most every
        ``CHUNK_SWEEP_INTERVAL_S`` (the sweeper calls this; ``force`` skips the wait). Remote
        shared tiers are swept only on request (``gc_shared``): listing them costs requests."""
        now = time.monotonic()
        last = self._last_local_sweep
        if not force and last is not None and now - last < CHUNK_SWEEP_INTERVAL_S:
            return
        self._last_local_sweep = now
        for tier in self._core.tiers.values():
            if not tier.capabilities.local or self._core.sole_user(tier):
                continue
            if not isinstance(tier, ChunkAges):
                continue
            try:
                self._sweep_tier(tier, tier, grace_s, None, None)
            except CacheError as exc:
                self._core.counters.incr("store_errors")
                log.warning("%s: chunk sweep stopped: %s", tier.name, exc)

    def gc_shared(
        self,
        grace_s: float = DEFAULT_GRACE_S,
        *,
        now: float | None = None,
        on_step: SweepStep | None = None,
    ) -> list[SweepResult]:
        """Delete the chunks of every shared tier this process is not the sole user of (not
        local, or a local directory another process has used) that no manifest in the store
        names and that are older than ``grace_s`` seconds (``now``: the time to age them
        against, default the wall clock)."""
        if not math.isfinite(grace_s) or grace_s < 0:
            # NaN compares false with every age: no chunk would count as young, and the
            # chunks of saves in flight (what the grace protects) would be deleted.
            raise ConfigError(f"grace_s must be a finite number >= 0, got {grace_s}")
        if grace_s < REFRESH_AFTER_S:
            log.warning(
                "chunk sweep with a grace of %.0fs, under the %.0fs a replica may go without "
                "touching a chunk it reuses: a save in progress elsewhere may lose chunks",
                grace_s,
                REFRESH_AFTER_S,
            )
        results = []
        for tier in self._core.tiers.values():
            if not tier.capabilities.shared or self._core.sole_user(tier):
                continue  # its chunks are freed with their last row (``retire``)
            if not isinstance(tier, ChunkAges):
                results.append(SweepResult(tier.name, refused="tier cannot list chunk ages"))
                continue
            try:
                results.append(self._sweep_tier(tier, tier, grace_s, now, on_step))
            except CacheError as exc:
                self._core.counters.incr("store_errors")
                log.warning("%s: chunk sweep stopped: %s", tier.name, exc)
                results.append(SweepResult(tier.name, refused=str(exc)))
        return results

    def _sweep_tier(
        self,
        tier: Tier,
        ages: ChunkAges,
        grace_s: float,
        now: float | None,
        on_step: SweepStep | None,
    ) -> SweepResult:
        step: SweepStep = on_step if on_step is not None else (lambda _s, _t: None)
        shift = 0.0 if now is None else now - time.time()  # ``now``: the clock, moved
        packs = tier if tier.capabilities.packs and isinstance(tier, PacksChunks) else None
        listed = list(ages.chunk_ages())  # first: any chunk written after this is not swept
        packs_listed = list(packs.pack_ages()) if packs is not None else []
        t_list = time.time() + shift
        step("chunks_listed", tier.name)
        marked: set[bytes] = set()
        marked_packs: set[bytes] = set()
        seen: set[bytes] = set()
        bad = self._mark(tier, tier.stored_keys(), seen, marked, marked_packs)
        step("manifests_marked", tier.name)
        # Manifests published since the first listing may reuse old chunks: mark them too.
        again = [k for k in tier.stored_keys() if k not in seen]
        bad |= self._mark(tier, again, seen, marked, marked_packs)
        bad &= set(tier.stored_keys())  # gone meanwhile: it names nothing any more
        if bad:
            log.warning(
                "%s: %d manifests cannot be read (e.g. %s): no chunk swept",
                tier.name,
                len(bad),
                next(iter(bad)).hex(),
            )
            return SweepResult(
                tier.name,
                len(listed),
                len(seen),
                refused="unreadable manifests",
                packs=len(packs_listed),
            )
        step("remarked", tier.name)
        deleted = freed = young = 0
        for key, size, mtime in listed:
            if key in marked or self._core.index.chunk_in_use(tier.name, key):
                continue
            if t_list - mtime < grace_s:
                young += 1
                continue
            # Asked again right before the delete: a save reusing the chunk touched it since
            # the listing (``chunking._refresh``) and will publish a manifest naming it.
            mtime_now = ages.chunk_age(key)
            if mtime_now is None:
                self._core.index.chunk_swept(tier.name, key)  # another sweep was first
                continue
            if time.time() + shift - mtime_now < grace_s:
                young += 1
                continue
            if not deleted:  # the unlinks of the manifests that named it stay done
                self._core.sync_deletes(tier)
            tier.delete_chunk(key)
            self._core.index.chunk_swept(tier.name, key)
            deleted += 1
            freed += size
        packs_deleted = 0
        if packs is not None and packs_listed:
            in_use = self._core.index.packs_in_use(tier.name)
            gone: set[bytes] = set()
            for pack, size, mtime in packs_listed:
                if pack in marked_packs or pack in in_use:
                    continue
                if t_list - mtime < grace_s:
                    young += 1
                    continue
                mtime_now = packs.pack_age(pack)  # as a chunk's: a save may have touched it
                if mtime_now is None:
                    gone.add(pack)
                    continue
                if time.time() + shift - mtime_now < grace_s:
                    young += 1
                    continue
                packs.delete_pack(pack)
                gone.add(pack)
                packs_deleted += 1
                freed += size
            self._core.index.packs_swept(tier.name, gone)
            self._core.counters.incr("shared_packs_swept", packs_deleted)
        self._core.counters.incr("shared_chunks_swept", deleted)
        log.info(
            "%s: swept %d unreferenced chunks and %d packs (%d bytes)",
            tier.name,
            deleted,
            packs_deleted,
            freed,
        )
        return SweepResult(
            tier.name,
            len(listed),
            len(seen),
            deleted,
            freed,
            young,
            packs=len(packs_listed),
            packs_deleted=packs_deleted,
        )

    def _mark(
        self,
        tier: Tier,
        keys: Iterable[bytes],
        seen: set[bytes],
        marked: set[bytes],
        marked_packs: set[bytes],
    ) -> set[bytes]:
        """Mark the chunks (and packs) of each manifest listed, as the store holds it now;
        the keys whose manifest could not be read."""
        bad: set[bytes] = set()
        for key in keys:
            seen.add(key)
            # Always the manifest in the store, never the index's copy: a manifest is
            # immutable, but its key may have been evicted and published again since by a
            # replica cutting it otherwise (another ``chunk_tokens``, another chunk base), and
            # the same count of chunks gives the same size, so no listing tells the two apart
            # (found by review: the new manifest's chunks were swept). The copy's own chunks
            # need no mark: the index references them (``chunk_in_use``).
            stored = tier.probe(key)
            if stored is None:
                bad.add(key)
                continue
            marked.update(stored.chunk_refs)
            marked_packs.update(loc.pack for loc in stored.locs if loc is not None)
        return bad
