"""What a cache holds, in bytes: the one summary ``/cache/stats``, the dashboard and
``kvwarm cache stats`` print, so they cannot disagree. Pure; no I/O.

Two measures (docs/internals.md, "Refcounts and eviction"):

- *physical* (``bytes``): what a tier stores, each chunk once: its rows' own files or objects
  (manifests, whole-blob rows) plus its chunks, orphans included. For a file tier, the sum of
  the apparent sizes of its ``.kvc`` and ``.kvk`` files (``du --apparent-size``, less temp
  files and the quarantine). In a tier with packs (s3, redis) a chunk counts its bytes in its
  pack, and the chunks of a pack no row this process indexes names are not counted (their
  pack stays until the sweep takes it whole). From the counters ``tier_<name>_bytes``, as
  ``/metrics`` reports them (``kvwarm_cache_tier_bytes{tier}``).
- *logical* (``logical_bytes``): what the rows restore, each row counting every chunk it names.
  ``dedup_ratio`` = logical / physical.

Both per tier and per memory kind (``memory_kinds``: the rows of full-attention,
sliding-window, recurrent and hybrid models apart, from the counters ``memory_<kind>_*``).

A row reports its logical bytes and its *exclusive* bytes: its own file plus the chunks no
other row of its tier names (what deleting it alone would free).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from kvwarm.cache.types import RowInfo, TierName

__all__ = ["memory_kinds", "row_sizes", "summary"]


def row_sizes(row: RowInfo) -> dict[str, int]:
    """A row's sizes as the server and the CLI list them (``rows()`` fills the last two)."""
    return {
        "bytes": row.logical_bytes,
        "exclusive_bytes": row.exclusive_bytes,
        "own_bytes": row.size,
    }


def _ratio(logical: float, physical: float) -> float:
    return round(logical / physical, 4) if physical else 0.0


def summary(
    counters: Mapping[str, float], rows: Sequence[RowInfo], tiers: Iterable[TierName]
) -> dict[str, object]:
    """Totals and per-tier sizes of a cache: ``rows``, ``bytes`` (physical), ``logical_bytes``,
    ``chunks``, ``dedup_ratio``, ``tokens`` and ``tiers`` (every configured tier, in order:
    rows, chunks, bytes, logical bytes, ratio, quota, effective quota and whether the room on
    its filesystem capped it (``cache/store/quota.py``), tokens, hits, rows per TTL class;
    and where ``counters`` has them, a server's, its restores, their bytes and seconds). Row
    counts and bytes come from ``counters`` (one snapshot); tokens and hits from ``rows``:
    a tier's ``hits`` are its rows' use counts (rows opened, which LFU eviction reads), its
    ``restores`` the rows it restored into a slot."""
    per: dict[str, dict[str, object]] = {}
    tokens: Counter[str] = Counter()
    hits: Counter[str] = Counter()
    ttl: dict[str, Counter[str]] = {}
    for row in rows:
        tokens[row.tier] += row.n_tokens
        hits[row.tier] += row.hits
        ttl.setdefault(row.tier, Counter())[row.ttl_class.name.lower()] += 1
    total = Counter[str]()
    for name in tiers:
        level = {
            k: int(counters.get(f"tier_{name}_{k}", 0))
            for k in ("rows", "chunks", "bytes", "logical_bytes", "quota_bytes")
        }
        total.update({k: v for k, v in level.items() if k != "quota_bytes"})
        effective = counters.get(f"tier_{name}_effective_quota_bytes")
        per[name] = {
            **level,
            "effective_quota_bytes": level["quota_bytes"] if effective is None else int(effective),
            "quota_capped_by_filesystem": bool(
                counters.get(f"tier_{name}_quota_capped_by_filesystem", 0.0)
            ),
            "dedup_ratio": _ratio(level["logical_bytes"], level["bytes"]),
            "tokens": tokens[name],
            "hits": hits[name],
            "ttl_classes": dict(ttl.get(name, {})),
        }
        if f"tier_{name}_restores" in counters:  # a server's counts (not kvwarm cache stats')
            per[name]["restores"] = int(counters[f"tier_{name}_restores"])
            per[name]["restored_bytes"] = int(counters[f"tier_{name}_restored_bytes"])
            per[name]["restore_seconds"] = round(counters[f"tier_{name}_restore_seconds"], 6)
    return {
        "rows": len(rows),
        "bytes": total["bytes"],
        "logical_bytes": total["logical_bytes"],
        "chunks": total["chunks"],
        "dedup_ratio": _ratio(total["logical_bytes"], total["bytes"]),
        "tokens": sum(r.n_tokens for r in rows),
        "tiers": per,
        "memory_kinds": memory_kinds(counters, rows),
    }


def memory_kinds(
    counters: Mapping[str, float], rows: Sequence[RowInfo]
) -> dict[str, dict[str, object]]:
    """Per memory kind of the rows held (``memory_<kind>_*`` counters): rows, stored
    ``bytes`` (their own files and each chunk once), ``logical_bytes`` (what they restore),
    their ratio and tokens, so a user sees what deduplication saves on their model: on a
    sliding-window model the windows of its checkpoints, stored once in chunks; on a recurrent
    one, nothing (each state is whole)."""
    tokens: Counter[str] = Counter()
    for row in rows:
        tokens[row.memory or "unknown"] += row.n_tokens
    kinds = sorted({key.split("_")[1] for key in counters if key.startswith("memory_")})
    out: dict[str, dict[str, object]] = {}
    for kind in kinds:
        level = {
            k: int(counters.get(f"memory_{kind}_{k}", 0))
            for k in ("rows", "chunks", "bytes", "logical_bytes")
        }
        out[kind] = {
            **level,
            "dedup_ratio": _ratio(level["logical_bytes"], level["bytes"]),
            "tokens": tokens[kind],
        }
    return out
