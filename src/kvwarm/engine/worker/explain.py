"""Why a request reused no more KV than it did (``ReuseReport``), read back from what admission
saw: the planner's candidates, the keep it ended with, and the cache's memory of rows that are
gone or not written yet (``cache/explain.py``).

Invariants: this module decides nothing (the planner and admission do); it only explains, with
an enum and numbers, no text. It asks the cache only when some prompt tokens were left that a
source could have covered, and only about namespaces the request may learn of: its own, and
the other models'/adapter sets' namespaces of this cache under the request's own salt, never
another salt's (``docs/architecture.md``, "Tenants").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvwarm.cache.api import CacheApi
from kvwarm.cache.explain import MissReason, ReuseReport
from kvwarm.cache.formats.key import salted_namespace
from kvwarm.cache.types import Namespace, PrefixMatch
from kvwarm.engine.worker.planner import RowCandidate, trim_reason, usable_length
from kvwarm.engine.worker.slots import Slot
from kvwarm.memory import MemoryKind
from kvwarm.tokens import Span, common_prefix


@dataclass(frozen=True, slots=True)
class Found:
    """The source sharing the most with the prompt, as the planner's rules score it."""

    shared: int = 0
    canonical: int | None = None
    floor: int = 0
    #: Whether the source holds more than the ``shared`` tokens: it goes on with other
    #: content where the prompt diverges from it.
    longer: bool = False


def best_found(
    tokens: Sequence[int],
    *,
    slots: Sequence[Slot],
    rows: Sequence[RowCandidate],
    namespace: Namespace,
    n_batch: int,
    deterministic: bool,
    spans: Sequence[Span] = (),
) -> Found:
    """The candidate (a slot's live KV of ``namespace``, or a row) sharing the most tokens;
    among equals the one the planner keeps the most of."""
    n = len(tokens)
    best = Found()
    best_keep = -1
    cands: list[tuple[int, int | None, int, int | None, bool, bool]] = []
    for slot in slots:
        if slot.kv_tokens and slot.kv_namespace == namespace:
            shared = common_prefix(slot.kv_tokens, tokens)
            longer = len(slot.kv_tokens) > shared
            cands.append((shared, slot.canonical, slot.floor, None, False, longer))
    for row in rows:
        shared = min(row.n_shared, n)
        longer = row.n_tokens > shared
        cands.append((shared, row.canonical, row.floor, row.n_tokens, row.has_logits, longer))
    for shared, canonical, floor, row_tokens, has_logits, longer in cands:
        keep, _ = usable_length(
            shared,
            n,
            canonical=canonical,
            n_batch=n_batch,
            deterministic=deterministic,
            row_tokens=row_tokens,
            row_has_logits=has_logits,
            floor=floor,
            spans=spans,
        )
        if (shared, keep) > (best.shared, best_keep):
            best, best_keep = Found(shared, canonical, floor, longer), keep
    return best


def explain(
    cache: CacheApi,
    tokens: Sequence[int],
    found: Found,
    reused: int,
    *,
    namespace: Namespace,
    others: Sequence[Namespace],
    n_batch: int,
    deterministic: bool,
    spans: Sequence[Span] = (),
) -> ReuseReport:
    """The report for a request that kept ``reused`` prompt tokens; ``others``: the
    namespaces besides its own the request may learn about (``same_tenant``); ``spans``: the
    prompt's."""
    n = len(tokens)
    if reused >= n:
        return ReuseReport(MissReason.NONE, found.shared, reused)
    if found.shared < n:
        gone = cache.explain_miss(namespace, tokens, found.shared, others)
        if gone is not None:
            return replace(gone, reused_tokens=reused)
    reason = trim_reason(
        found.shared,
        n,
        reused,
        canonical=found.canonical,
        n_batch=n_batch,
        deterministic=deterministic,
        floor=found.floor,
        spans=spans,
    )
    # The prompt shows an image or clip where the source holds other content (another
    # picture, or text): its span's ids name its content, so they part right there.
    starts = {span.start for span in spans}
    if reason is MissReason.NEW_TOKENS and found.longer and found.shared in starts:
        reason = MissReason.MEDIA_DIFFERS
    return ReuseReport(reason, found.shared, reused)


def same_tenant(cache: CacheApi, base: Namespace, salt: bytes | None) -> list[Namespace]:
    """The other models' and adapter sets' namespaces of ``cache`` (those its models noted),
    under the request's own salt: what a request may be told holds its prompt. Never another
    salt's: that would tell one tenant what another's prompt begins with."""
    return [salted_namespace(b, salt) for b in cache.noted_namespaces() if b != base]


def prefix_rows(
    cache: CacheApi,
    namespace: Namespace,
    tokens: Sequence[int],
    memory: MemoryKind,
    probe_lengths: Sequence[int] = (),
) -> tuple[PrefixMatch | None, list[PrefixMatch]]:
    """The row sharing the most with ``tokens`` and, for a memory that cannot be trimmed (of
    use only whole), the rows that are all a prefix of it: what the planner chooses among
    (``CachePort.lookup``, and ``explain_prompt`` as it). ``probe_lengths``: the prefix
    lengths shared tiers are asked for (``CacheApi.longest_prefix``)."""
    match = cache.longest_prefix(namespace, tokens, probe_lengths=probe_lengths)
    whole = [] if memory.trimmable else cache.whole_prefixes(namespace, tokens)
    n = len(tokens)
    if match is not None and match.n_shared == n and match.row.n_tokens > n and not whole:
        # Every row under the prompt shares all of it, and the lookup names the smallest;
        # a row of exactly the prompt (a prompt's end, a prewarm) is the one whose final
        # logits serve it with no decode: finish rows past it keep none
        # (``finish_keeps_logits``), and are often the smaller.
        key = cache.key_for(namespace, tokens)
        exact = cache.lookup_exact(key) if cache.has(key) else None
        if exact is not None and exact.has_logits:
            whole = [PrefixMatch(exact, n)]
    return match, whole


def explain_prompt(
    cache: CacheApi,
    tokens: Sequence[int],
    *,
    namespace: Namespace,
    others: Sequence[Namespace],
    n_batch: int,
    deterministic: bool,
    memory: MemoryKind,
) -> ReuseReport:
    """The planner's reasoning for ``tokens`` against ``cache`` alone (no slots, no model):
    what ``kvwarm cache explain`` prints. Reads no row's bytes and probes no shared tier."""
    match, whole = prefix_rows(cache, namespace, tokens, memory)
    rows = [RowCandidate.of(m, memory) for m in (match, *whole) if m is not None]
    n = len(tokens)
    reused = 0
    for row in rows:
        keep, _ = usable_length(
            min(row.n_shared, n),
            n,
            canonical=row.canonical,
            n_batch=n_batch,
            deterministic=deterministic,
            row_tokens=row.n_tokens,
            row_has_logits=row.has_logits,
            floor=row.floor,
        )
        reused = max(reused, keep)
    found = best_found(
        tokens,
        slots=(),
        rows=rows,
        namespace=namespace,
        n_batch=n_batch,
        deterministic=deterministic,
    )
    return explain(
        cache,
        tokens,
        found,
        reused,
        namespace=namespace,
        others=others,
        n_batch=n_batch,
        deterministic=deterministic,
    )
