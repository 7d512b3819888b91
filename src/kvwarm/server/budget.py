"""One memory budget (issue 25): what a server takes of memory, and the RAM tier sized to fit.

A server holds, in memory: each loaded model's weights (``ModelInfo.size_bytes``, llama.cpp's
``llama_model_size``, its projector's, ``ModelInfo.projector_bytes``, and its LoRA adapters',
``ModelInfo.adapter_bytes``) and context
(``ModelInfo.context_bytes``: its KV buffers and the rest llama.cpp allocated for it), the RAM
tier, the ``ram_file`` tier (files on /dev/shm are memory) and any tier added as a ``ram://``
URL. With ``memory_budget`` set, the RAM tier's quota is what the others leave:

    ram = budget - sum(weights) - sum(contexts) - ram_file quota - ram:// tiers' quotas

and a configuration that leaves less than nothing is refused with ``MemoryBudgetError``,
whose message shows that sum. Pure arithmetic; the server applies it at startup and after
every load and unload (``ServerState``). Quotas of tiers on disk or in s3 are not memory.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvwarm.cache.types import Namespace, RowInfo, TierConfig, TierName
from kvwarm.errors import MemoryBudgetError

if TYPE_CHECKING:
    from kvwarm.cache.facade import Cache
    from kvwarm.server.served import ServedModel

log = logging.getLogger(__name__)

__all__ = [
    "MEMORY_TIERS",
    "CacheOwner",
    "MemoryPlan",
    "ModelMemory",
    "cache_shares",
    "fmt_bytes",
    "overcommitted",
    "plan",
]

# Tiers whose bytes are memory besides the RAM tier itself (the one the budget sizes): the
# built-in ram_file tier, and any tier added by a ``ram://`` URL (``in_memory``).
MEMORY_TIERS: tuple[TierName, ...] = ("ram_file",)
_MEMORY_SCHEMES = ("ram",)
_LABELS = {"ram_file": "shm"}


def in_memory(tier: TierConfig) -> bool:
    """Whether ``tier``'s bytes are memory the budget counts at its quota (the RAM tier
    aside, which it sizes): ``ram_file``, or a tier by URL whose store is process memory
    (``ram://``). Found by review: a ``ram://`` tier was counted nowhere, so the budget
    planned less memory than the cache could hold."""
    if tier.url is not None:
        return urlsplit(tier.url).scheme.lower() in _MEMORY_SCHEMES
    return tier.name in MEMORY_TIERS


@dataclass(frozen=True, slots=True)
class ModelMemory:
    """One loaded model: its weights, its context's KV buffers, all its context's buffers."""

    model: str
    weights_bytes: int
    kv_bytes: int
    context_bytes: int


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What the server takes of memory: ``budget_bytes`` (0: none set), the models, the
    in-memory tiers' quotas, and the RAM tier's quota (the budget's remainder when set)."""

    budget_bytes: int
    models: tuple[ModelMemory, ...]
    tiers: Mapping[TierName, int]  # in-memory tiers other than ram: quota
    ram_quota_bytes: int

    @property
    def total_bytes(self) -> int:
        """Weights + contexts + every in-memory tier's quota (the RAM tier's included)."""
        return _fixed(self.models, self.tiers) + self.ram_quota_bytes

    def report(
        self,
        used: Mapping[TierName, int] | None = None,
        shares: Mapping[str, Mapping[TierName, int]] | None = None,
    ) -> dict[str, object]:
        """The JSON ``/cache/stats`` answers as ``memory``; ``used``: tier bytes stored now;
        ``shares``: each model's part of them (``cache_shares``). A model's ``cache_bytes``
        is its part of the in-memory tiers (ram, ram_file), ``total_bytes`` that plus its
        weights and context."""
        tiers = {"ram": self.ram_quota_bytes, **self.tiers}
        memory_tiers = ("ram", *self.tiers)
        shares = shares or {}

        def cache_bytes(model: str) -> int:
            return sum(n for t, n in shares.get(model, {}).items() if t in memory_tiers)

        return {
            "budget_bytes": self.budget_bytes,
            "total_bytes": self.total_bytes,
            "weights_bytes": sum(m.weights_bytes for m in self.models),
            "kv_bytes": sum(m.kv_bytes for m in self.models),
            "context_bytes": sum(m.context_bytes for m in self.models),
            "models": {
                m.model: {
                    "weights_bytes": m.weights_bytes,
                    "kv_bytes": m.kv_bytes,
                    "context_bytes": m.context_bytes,
                    "cache_bytes": cache_bytes(m.model),
                    "cache_tiers": dict(shares.get(m.model, {})),
                    "total_bytes": m.weights_bytes + m.context_bytes + cache_bytes(m.model),
                }
                for m in self.models
            },
            "tiers": {
                name: {"quota_bytes": quota, "bytes": int((used or {}).get(name, 0))}
                for name, quota in tiers.items()
            },
        }


def _others(tiers: Sequence[TierConfig]) -> dict[TierName, int]:
    """The in-memory tiers' quotas, the RAM tier's aside."""
    return {t.name: t.quota_bytes for t in tiers if t.name != "ram" and in_memory(t)}


def _fixed(models: Iterable[ModelMemory], tiers: Mapping[TierName, int]) -> int:
    return sum(m.weights_bytes + m.context_bytes for m in models) + sum(tiers.values())


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def plan(
    budget_bytes: int, models: Sequence[ModelMemory], tiers: Sequence[TierConfig]
) -> MemoryPlan:
    """The memory plan for these models and tiers. With a budget (> 0) the RAM tier gets
    what is left, and ``MemoryBudgetError`` says why nothing is; without one, the RAM tier
    keeps its configured quota."""
    quotas = {t.name: t.quota_bytes for t in tiers}
    others = _others(tiers)
    ram = quotas.get("ram", 0)
    if budget_bytes > 0:
        fixed = _fixed(models, others)
        if fixed > budget_bytes:
            raise MemoryBudgetError(_arithmetic(budget_bytes, models, others, fixed))
        ram = budget_bytes - fixed if "ram" in quotas else 0
    return MemoryPlan(budget_bytes, tuple(models), others, ram)


def overcommitted(
    budget_bytes: int, models: Sequence[ModelMemory], tiers: Sequence[TierConfig]
) -> MemoryPlan:
    """The plan of a server already past its budget (memory a loaded model allocated since it
    was admitted): the RAM tier gets nothing, and ``total_bytes`` shows the excess."""
    return MemoryPlan(budget_bytes, tuple(models), _others(tiers), 0)


def _arithmetic(
    budget: int, models: Sequence[ModelMemory], tiers: Mapping[TierName, int], fixed: int
) -> str:
    parts = [
        f"weights {fmt_bytes(sum(m.weights_bytes for m in models))}",
        f"KV {fmt_bytes(sum(m.kv_bytes for m in models))}",
    ]
    other = sum(m.context_bytes - m.kv_bytes for m in models)
    if other:
        parts.append(f"context buffers {fmt_bytes(other)}")
    parts += [f"{_LABELS.get(n, n)} tier {fmt_bytes(q)}" for n, q in tiers.items()]
    names = ", ".join(m.model for m in models) or "no model"
    return (
        f"memory budget {fmt_bytes(budget)} < {' + '.join(parts)} = {fmt_bytes(fixed)} "
        f"({names}); raise memory_budget, lower shm_quota_bytes, or load fewer or smaller "
        "models or LoRA adapters (a smaller n_ctx or n_parallel, a quantised KV cache)"
    )


@dataclass(frozen=True, slots=True)
class CacheOwner:
    """Which cached rows are one loaded model's (``cache_shares``): ``fingerprints``, its own
    namespaces' (``Model.cache_fingerprints``: its file with its projector, its adapter sets),
    and ``drafts``, its draft model's namespaces (``Model.draft_namespaces``)."""

    fingerprints: frozenset[bytes]
    drafts: frozenset[Namespace] = frozenset()


def cache_shares(
    rows: Sequence[RowInfo],
    stored: Mapping[TierName, int],
    owners: Mapping[str, CacheOwner],
) -> dict[str, dict[TierName, int]]:
    """Each model's part of each tier's ``stored`` bytes: the tier's bytes apportioned by the
    KV its rows restore (``RowInfo.logical_bytes``). Exact where rows share no chunk; chunks
    shared by two rows count for both in proportion to their rows.

    A row is, first, the model's whose draft model saved it under that very namespace
    (``CacheOwner.drafts``), else the model's one of whose ``fingerprints`` its namespace's
    is, else the model's whose draft model has that fingerprint (a salted row it no longer
    remembers, or one of an earlier load). Found by review (ownerkey): by fingerprint alone a
    draft model's rows were no model's, or, its file also served, that model's."""
    total: Counter[TierName] = Counter()
    by_model: dict[str, Counter[TierName]] = {m: Counter() for m in owners}
    exact = {ns: m for m, o in owners.items() for ns in o.drafts}
    whose = {fp: m for m, o in owners.items() for fp in o.fingerprints}
    drafted = {ns.fingerprint: m for m, o in owners.items() for ns in o.drafts}
    for row in rows:
        total[row.tier] += row.logical_bytes
        ns = row.namespace
        model = exact.get(ns) or whose.get(ns.fingerprint) or drafted.get(ns.fingerprint)
        if model is not None:
            by_model[model][row.tier] += row.logical_bytes
    return {
        m: {t: stored.get(t, 0) * n // total[t] for t, n in tiers.items() if total[t]}
        for m, tiers in by_model.items()
    }


def memory_of(model_id: str, model: ServedModel) -> ModelMemory:
    """What a loaded model holds, from its ``info()``: its projector's weights and buffers,
    its draft model's weights and its LoRA adapters' count with its weights (the draft
    model's context with its contexts). Found by review (lorabudget): the adapters were
    counted nowhere, so a server under a budget loaded them past it."""
    info = model.info()
    weights = info.size_bytes + info.projector_bytes + info.draft_bytes + info.adapter_bytes
    return ModelMemory(model_id, weights, info.kv_bytes, info.context_bytes)


def apply(cache: Cache, memory_plan: MemoryPlan) -> None:
    """Make ``memory_plan`` the cache's: with a budget, the RAM tier gets its remainder."""
    if memory_plan.budget_bytes > 0 and "ram" in cache.tier_names():
        cache.resize_tier("ram", memory_plan.ram_quota_bytes)
        log.info(
            "memory budget %s: RAM tier %s",
            fmt_bytes(memory_plan.budget_bytes),
            fmt_bytes(memory_plan.ram_quota_bytes),
        )
