"""Cheap thread-safe counters and latency totals for the cache.

Invariant: every increment is applied exactly once and ``snapshot()`` returns one consistent
view (taken under the same lock the increments use). The lock is held for a dict update only,
so contention costs nanoseconds; nothing here does I/O or calls back into other code.

Names in the snapshot:

- plain counters: ``hits_exact``, ``hits_resume``, ``hits_longest_prefix``, ``hits_live``,
  ``misses``, ``admission_failures`` (``REQUEST_OUTCOMES``: each request a worker admits
  counts exactly one of them; a prewarm, the cache's upkeep, serves no request and counts
  none: ``engine.request.Request.upkeep``. Once it is seated, for what served its prompt's
  prefix once it was in the slot: a row restored, holding all of the prompt (``hits_exact``)
  or part of it (``hits_longest_prefix``), or for a request that named its previous turn
  (``parent_key``: ``hits_resume``); a slot's live KV kept or copied, nothing read from the
  cache (``hits_live``); nothing (``misses``, a refused or failed restore included). A request that
  failed before it was seated (its answer an error) counts ``admission_failures``: neither a
  hit nor a miss, since it was never served. Lookups, probes, reads of a row's metadata and
  waits for a save count none),
  ``hits_draft_prefix`` (a draft model's context restoring a row: not a request's outcome),
  ``saves_<reason>`` (one per ``SaveReason``), ``saves_dropped``, ``save_failures``,
  ``saves_retried_after_enospc``, ``saves_spilled``,
  ``evictions``, ``evicted_bytes``, ``hits_shared``, ``probes``, ``probe_rounds``,
  ``promotions``, ``promotions_dropped``, ``store_errors``, ``chunks_written``,
  ``chunk_bytes_written``, ``chunks_reused``, ``packs_written``, ``shared_rows_forgotten``,
  ``shared_chunks_swept``, ``shared_packs_swept``, ``retention_drops``, ``retention_bytes``,
  plus anything else ``incr`` was asked to count;
- latencies: ``latency_<name>_count`` and ``latency_<name>_seconds`` for ``pack``, ``unpack``,
  ``restore`` (a row read and unpacked), ``load``, ``lookup``, ``save`` and any other name
  recorded;
- per tier (``TIER_TOTALS``, ``record_restore``): ``tier_<name>_restores``,
  ``tier_<name>_restored_bytes`` and ``tier_<name>_restore_seconds``: the ``restore`` latency
  split by the tier each row was read from (their sums over the tiers are its count and
  seconds). Not the per-tier ``hits`` of ``/cache/stats``: those count a tier's rows opened
  (what LFU eviction reads), metadata reads included.
"""

from __future__ import annotations

import threading

from kvwarm.cache.types import SaveReason

__all__ = [
    "BASE_COUNTERS",
    "HIT_COUNTERS",
    "LATENCY_NAMES",
    "REQUEST_HITS",
    "REQUEST_OUTCOMES",
    "Counters",
]

#: A seated request's hits (what served its prompt's prefix, not what a lookup found).
REQUEST_HITS: tuple[str, ...] = (
    "hits_exact",  # a row restored that holds the whole prompt
    "hits_resume",  # a row restored for a request naming its previous turn (parent_key)
    "hits_longest_prefix",  # a row restored that holds part of the prompt
    "hits_live",  # a slot's live KV kept or copied (no cache read)
)
#: A request's one outcome (the engine counts it once the request is seated, or once its
#: admission failed before that).
REQUEST_OUTCOMES: tuple[str, ...] = (
    *REQUEST_HITS,
    "misses",  # nothing reused: no source, or its restore refused or failed
    "admission_failures",  # failed before it was seated: answered with an error, not served
)
#: What ``CacheApi.record_hit`` counts: a request's hits, and a draft model's context
#: restoring its prompt's KV (engine/worker/draftmodel.py), which is not a request's.
HIT_COUNTERS: tuple[str, ...] = (*REQUEST_HITS, "hits_draft_prefix")

BASE_COUNTERS: tuple[str, ...] = (
    *REQUEST_OUTCOMES,
    "hits_draft_prefix",
    *(f"saves_{r.name.lower()}" for r in SaveReason),
    "saves_dropped",
    "save_failures",
    "evictions",
    "evicted_bytes",
    # saves a full filesystem (ENOSPC) refused, retried once after evicting from their tier
    "saves_retried_after_enospc",
    # rows larger than their save tier's quota, or for which it had no room, saved to a later
    # tier instead (store/saves.py)
    "saves_spilled",
    # shared tiers (cache/upkeep/shared.py): rows found by probing, keys probed, rounds of probes,
    # remote hits copied to a local tier (or not: writer queue full), unreachable stores
    "hits_shared",
    "probes",
    "probe_rounds",
    "promotions",
    "promotions_dropped",
    "store_errors",
    # chunked rows (cache/store/chunking.py): chunks written (and their bytes), chunks a save
    # found already stored and did not write again
    "chunks_written",
    "chunk_bytes_written",
    "chunks_reused",
    # packs written (a tier with packs: a save's new chunks in one object)
    "packs_written",
    # shared tiers: rows forgotten (not deleted) after a failed read, chunks and packs
    # gc_shared deleted
    "shared_rows_forgotten",
    "shared_chunks_swept",
    "shared_packs_swept",
    # recurrent and hybrid states a conversation no longer needs, retired when a newer one
    # of it was saved (``CacheConfig.state_history``), and their bytes
    "retention_drops",
    "retention_bytes",
)
LATENCY_NAMES: tuple[str, ...] = ("pack", "unpack", "restore", "load", "lookup", "save")


class Counters:
    """Monotonic counters and (count, total seconds) latency pairs."""

    __slots__ = ("_counts", "_lat_n", "_lat_s", "_lock", "_restores")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Pre-seeded so a snapshot always shows every documented name, even at zero.
        self._counts: dict[str, int] = dict.fromkeys(BASE_COUNTERS, 0)
        self._lat_n: dict[str, int] = dict.fromkeys(LATENCY_NAMES, 0)
        self._lat_s: dict[str, float] = dict.fromkeys(LATENCY_NAMES, 0.0)
        # Per tier: restores, bytes read for them, seconds they took.
        self._restores: dict[str, tuple[int, int, float]] = {}

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def record_save(self, reason: SaveReason) -> None:
        self.incr(f"saves_{reason.name.lower()}")

    def record_latency(self, name: str, seconds: float) -> None:
        if not name.isidentifier():
            # The name becomes part of a metrics key; refuse anything that would garble it.
            raise ValueError(f"latency name must be an identifier, got {name!r}")
        with self._lock:
            self._lat_n[name] = self._lat_n.get(name, 0) + 1
            self._lat_s[name] = self._lat_s.get(name, 0.0) + max(0.0, seconds)

    def record_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        """A row of ``tier`` restored into a slot: ``nbytes`` read, ``seconds`` from opening
        it to its KV in the slot (also the ``restore`` latency, recorded here)."""
        seconds = max(0.0, seconds)
        with self._lock:
            n, b, s = self._restores.get(tier, (0, 0, 0.0))
            self._restores[tier] = (n + 1, b + max(0, nbytes), s + seconds)
            self._lat_n["restore"] = self._lat_n.get("restore", 0) + 1
            self._lat_s["restore"] = self._lat_s.get("restore", 0.0) + seconds

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {k: float(v) for k, v in self._counts.items()}
            for name, n in self._lat_n.items():
                out[f"latency_{name}_count"] = float(n)
                out[f"latency_{name}_seconds"] = self._lat_s[name]
            for tier, (n, b, s) in self._restores.items():
                out[f"tier_{tier}_restores"] = float(n)
                out[f"tier_{tier}_restored_bytes"] = float(b)
                out[f"tier_{tier}_restore_seconds"] = s
        return out
