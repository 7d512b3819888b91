"""Where a request's prompt KV comes from. Pure decisions: candidates in, a plan out; no native,
cache or file calls.

Sources, best first at equal length: the slot's own live KV (no work), another slot's live KV
(``seq_cp``), a cache row (load + unpack). Every source is scored by ``usable_length``, and a
row that turns out different once opened is re-scored by the same rules (``recheck_row``,
``trim_restored``): this module is the only place that decides how much KV is reused.
Deterministic mode only uses a canonical prefix trimmed to a multiple of ``n_batch``, so the
result is bit-identical to a cold prefill (``kvwarm.alignment``; ``docs/architecture.md``).
A slot's live KV is a candidate only for a request of the same namespace (``kv_namespace``):
like rows, live KV never crosses models, adapter sets or cache salts, or ``cached_tokens``
would tell one tenant what another's prompt begins with.

A source is never resumed inside a span (an image's or audio's positions, decoded whole:
``kvwarm.tokens``): a length that falls inside one moves back to the span's start.

Every source also has a *floor* (``kvwarm.memory``): the shortest prefix its state resumes at.
A sliding-window state longer than its window, or any recurrent state, is exactly the state of
its own length and of no shorter prefix; keeping fewer tokens than the floor would be a wrong
answer, so such a source is not used at all (a miss, never a trim below the floor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from kvwarm.alignment import align_down
from kvwarm.cache.explain import MissReason
from kvwarm.cache.types import Namespace, PrefixMatch
from kvwarm.engine.worker.slots import Slot
from kvwarm.memory import MemoryKind
from kvwarm.tokens import Span, common_prefix, resume_point, tail_of

SourceKind = Literal["none", "self", "copy", "row"]


def usable_length(
    shared: int,
    n_prompt: int,
    *,
    canonical: int | None,
    n_batch: int,
    deterministic: bool,
    row_tokens: int | None = None,
    row_has_logits: bool = False,
    floor: int = 0,
    spans: Sequence[Span] = (),
) -> tuple[int, bool]:
    """(tokens to keep from the source, whether its stored logits replace any decode).

    At least one prompt token is left to prefill unless the source is a row holding exactly the
    prompt with its final logits, because sampling needs logits after the last prompt token.
    ``floor``: the shortest prefix the source's state resumes at; below it, nothing is kept.
    ``spans``: the prompt's; a keep never ends inside one (``within_spans``).
    """
    u = min(shared, n_prompt)
    if deterministic:
        u = align_down(min(u, canonical if canonical is not None else u), n_batch)
    exact_logits = (
        row_has_logits
        and row_tokens == n_prompt
        and shared >= n_prompt
        and (not deterministic or canonical is None or canonical >= n_prompt)
    )
    if exact_logits:
        return n_prompt, True
    if u >= n_prompt:
        u = n_prompt - 1
        if deterministic:
            u = align_down(u, n_batch)
    u = within_spans(u, spans, n_batch if deterministic else 1)
    if u < floor:
        return 0, False
    return max(u, 0), False


def within_spans(keep: int, spans: Sequence[Span], align: int = 1) -> int:
    """The longest ``k <= keep`` that ends no span early and is a multiple of ``align``."""
    while spans:
        moved = align_down(resume_point(spans, keep), align)
        if moved == keep:
            break
        keep = moved
    return keep


@dataclass(frozen=True, slots=True)
class Plan:
    kind: SourceKind
    keep: int  # prompt tokens whose KV is reused
    use_logits: bool = False
    src_seq: int = -1  # for "copy"; for a "row" with a ``base``: the slot whose KV it is
    row_key: bytes | None = None  # for "row"
    shared: int = 0  # tokens the source shares with the prompt before trimming
    #: For "row": leading tokens taken from live KV (``src_seq``'s, the slot's own or a
    #: ``seq_cp``) instead of the row; the row's chunks from there on are all it restores.
    base: int = 0


@dataclass(frozen=True, slots=True)
class RowCandidate:
    """The cache's best row for a prompt, as the cache's prefix lookup described it."""

    key: bytes
    n_shared: int
    n_tokens: int
    canonical: int | None
    has_logits: bool
    floor: int = 0  # the shortest prefix the row's saved state resumes at (kvwarm.memory)
    #: How many tokens each of its chunks covers (() for a row stored whole).
    chunk_lens: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, match: PrefixMatch, memory: MemoryKind, chunk_lens: tuple[int, ...] = ()
    ) -> RowCandidate:
        """The candidate a lookup's ``match`` makes, its floor from the model's memory kind."""
        row = match.row
        return cls(
            row.key,
            match.n_shared,
            row.n_tokens,
            row.canonical_tokens,
            row.has_logits,
            floor=memory.saved_floor(row.n_tokens),
            chunk_lens=chunk_lens,
        )

    def tail_start(self, live: int) -> int:
        """The last chunk boundary at or before ``live`` (tokens some live KV shares with
        the row), short of the row's last chunk: where a restore onto that live KV starts."""
        return tail_of(self.chunk_lens, live)[1]


def better(a: Plan, b: Plan) -> Plan:
    """The plan that reuses more; ties prefer the cheaper source (self < copy < row)."""
    order = {"self": 0, "copy": 1, "row": 2, "none": 3}
    if (b.keep, b.use_logits) > (a.keep, a.use_logits):
        return b
    if (b.keep, b.use_logits) == (a.keep, a.use_logits) and order[b.kind] < order[a.kind]:
        return b
    return a


def choose(
    tokens: Sequence[int],
    *,
    free: Sequence[Slot],
    slots: Sequence[Slot],
    row: RowCandidate | None,
    n_batch: int,
    deterministic: bool,
    namespace: Namespace | None = None,
    rows: Sequence[RowCandidate] = (),
    tails: bool = False,
    spans: Sequence[Span] = (),
) -> tuple[Slot, Plan]:
    """The free slot to serve ``tokens`` in, and the plan for its prompt KV.

    ``free``: the idle slots; ``slots``: all of them (any slot's live KV of the request's
    ``namespace`` can be shared); ``row``: the cache's longest-prefix row in that namespace, if
    any; ``rows``: further row candidates (the longest row that is a whole prefix, for a
    model whose state cannot be trimmed). Each source counts only down to its floor.
    ``tails``: a row may restore only its chunks past live KV that holds its leading ones
    (``BackendContext.restores_tails``; never in deterministic mode, whose rows and live KV
    each stay canonical on their own): the plan's ``base``. ``spans``: the prompt's (no
    source is resumed inside one).
    """
    n = len(tokens)

    def keep_of(shared: int, canonical: int | None, floor: int) -> int:
        keep, _ = usable_length(
            shared,
            n,
            canonical=canonical,
            n_batch=n_batch,
            deterministic=deterministic,
            floor=floor,
            spans=spans,
        )
        return keep

    # Prefix affinity: the free slot whose own live KV shares the most with the prompt.
    best_slot = min(free, key=lambda s: s.last_used)
    best = Plan("none", 0)
    for slot in free:
        if slot.kv_namespace != namespace:
            continue
        shared = common_prefix(slot.kv_tokens, tokens)
        cand = Plan("self", keep_of(shared, slot.canonical, slot.floor), shared=shared)
        if better(best, cand) is cand and cand.keep > 0:
            best, best_slot = cand, slot
    if best.kind == "none":
        # Prefer an empty slot over overwriting a warm one.
        empty = [s for s in free if not s.kv_tokens]
        best_slot = empty[0] if empty else best_slot
    for other in slots:
        if other is best_slot or not other.kv_tokens or other.kv_namespace != namespace:
            continue
        shared = common_prefix(other.kv_tokens, tokens)
        keep = keep_of(shared, other.canonical, max(other.floor, other.copy_floor))
        cand = Plan("copy", keep, src_seq=other.seq, shared=shared)
        if cand.keep > 0:
            best = better(best, cand)
    for cand_row in (row, *rows):
        if cand_row is None:
            continue
        shared = min(cand_row.n_shared, n)
        keep, use_logits = usable_length(
            shared,
            n,
            canonical=cand_row.canonical,
            n_batch=n_batch,
            deterministic=deterministic,
            row_tokens=cand_row.n_tokens,
            row_has_logits=cand_row.has_logits,
            floor=cand_row.floor,
            spans=spans,
        )
        if keep > 0:
            plan = Plan("row", keep, use_logits, row_key=cand_row.key, shared=shared)
            if tails and not deterministic and cand_row.chunk_lens:
                plan = _on_live(plan, cand_row, tokens, best_slot, slots, namespace)
            best = better(best, plan)
    if best.kind == "row" and best.use_logits and best.keep == n and not deterministic:
        # The whole prompt is a row with its final logits; a free slot whose live KV already
        # holds the prompt needs only those logits, not the row's KV copied over its own.
        for slot in free:
            if (
                slot.kv_namespace == namespace
                and slot.floor < n
                and common_prefix(slot.kv_tokens, tokens) == n
            ):
                return slot, Plan("self", n, True, row_key=best.row_key, shared=n)
    return best_slot, best


def _on_live(
    plan: Plan,
    row: RowCandidate,
    tokens: Sequence[int],
    slot: Slot,
    slots: Sequence[Slot],
    namespace: Namespace | None,
) -> Plan:
    """``plan`` (a row restore into ``slot``) restoring only the row's chunks past the live
    KV that holds the most of its leading ones: ``slot``'s own, else a copy of another's.
    A conversation's next turn after another conversation over the same system prompt took
    the slot reads and restores its own turns, not the system prompt's KV again."""
    best_base, best_seq = 0, -1
    for other in slots:
        if other.kv_namespace != namespace or other.floor > 0 or not other.kv_tokens:
            continue
        live = min(common_prefix(other.kv_tokens, tokens), plan.keep)
        base = row.tail_start(live)
        if base > best_base or (base == best_base and base and other is slot):
            best_base, best_seq = base, other.seq
    return replace(plan, src_seq=best_seq, base=best_base) if best_base else plan


def recheck_row(
    keep: int,
    shared: int,
    n_prompt: int,
    *,
    canonical: int | None,
    n_batch: int,
    det: bool,
    floor: int = 0,
    spans: Sequence[Span] = (),
) -> int:
    """The planned ``keep`` of a row, re-scored if the opened row shares only ``shared`` tokens
    with the prompt (the row changed since the lookup). Token-exact, always."""
    if shared >= keep:
        return keep
    keep, _ = usable_length(
        shared,
        n_prompt,
        canonical=canonical,
        n_batch=n_batch,
        deterministic=det,
        floor=floor,
        spans=spans,
    )
    return keep


def trim_restored(
    keep: int,
    n_restored: int,
    n_prompt: int,
    *,
    use_logits: bool,
    n_batch: int,
    det: bool,
    floor: int = 0,
    spans: Sequence[Span] = (),
) -> tuple[int, bool]:
    """(tokens of an unpacked row to keep, whether its stored logits are used).

    ``use_logits``: the plan wanted the row's logits and the row has them. A blob holding fewer
    cells than its tokens claim keeps only what it holds, and then no logits. ``floor``: the
    restored state's; a keep below it is 0 (the state is discarded, never trimmed past it).
    """
    use_logits = use_logits and keep == n_prompt
    if not use_logits and keep >= n_prompt:
        keep = n_prompt - 1
    if keep > n_restored:
        keep, use_logits = n_restored, False
    if det and not use_logits:
        keep = align_down(keep, n_batch)
    if not use_logits:
        keep = within_spans(keep, spans, n_batch if det else 1)
    if keep < floor:
        return 0, False
    return keep, use_logits


def trim_reason(
    shared: int,
    n_prompt: int,
    keep: int,
    *,
    canonical: int | None,
    n_batch: int,
    deterministic: bool,
    floor: int = 0,
    spans: Sequence[Span] = (),
) -> MissReason:
    """Why ``usable_length`` kept ``keep`` of the ``shared`` tokens a source shares with a
    prompt of ``n_prompt`` (the same rules, read back; nothing here decides anything)."""
    if keep >= n_prompt:
        return MissReason.NONE
    if shared <= 0:
        return MissReason.NO_PREFIX
    u = min(shared, n_prompt)
    if u >= n_prompt:
        u = n_prompt - 1
    if spans and within_spans(u, spans) < u and keep <= within_spans(u, spans):
        return MissReason.INSIDE_SPAN
    if keep == 0 and floor > 0:
        aligned = (
            align_down(min(u, canonical if canonical is not None else u), n_batch)
            if deterministic
            else u
        )
        if aligned < floor:
            return MissReason.MEMORY_FLOOR
    if deterministic and keep < u:
        return MissReason.ALIGNED_TRIM
    if keep < u:
        return MissReason.MEMORY_FLOOR
    return MissReason.LAST_TOKEN if shared >= n_prompt else MissReason.NEW_TOKENS
