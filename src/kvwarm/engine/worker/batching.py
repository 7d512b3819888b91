"""Batch strategies: which tokens go into the next forward pass. A small protocol.

Invariant kept by every strategy: a slot's prefill chunk never crosses an absolute multiple of
``n_batch``; a deterministic slot's chunk is never cut by the budget (it runs in a call of its
own when it does not fit), so its numerics equal a cold prefill's. A ``whole`` prompt (a model
whose attention is not causal) is never cut either, and shares a call only within one ubatch:
if it does not fit what is left, it waits for the next tick. A generating slot's draft
(speculative decoding, ``drafted`` tokens in all) travels with its next token: what the
decoding slots put in the call counts against the budget before any prefill chunk does.

Order: the prompts with the fewest tokens left to prefill get room first, so a short prompt
beside a long one gets its first token soon, except that a prompt passed over for
``AGING_TICKS`` ticks in a row (``PrefillWant.waited``, kept by the tick through
``waited_after``) goes before them all: under ``balanced`` it takes the tick's one chunk, and
a ``whole`` prompt that does not fit keeps the room (nothing is placed after it) until it
does. Without that, shorter prompts arriving in the other slots could keep a seated long
prompt from any prefill forever; with it, a seated prompt waits at most about
``AGING_TICKS`` ticks per chunk. Likewise a generating slot: ``prefill_first`` holds decodes
while prompts prefill, but not once a slot has been passed over for ``AGING_TICKS`` ticks in a
row (``decode_waited``, kept by the tick): prompts seated one after another in the other slots
held it for as long as they kept coming.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvwarm.alignment import chunk_end

StrategyName = Literal["decode_first", "prefill_first", "balanced"]

#: Ticks in a row a prompt may want prefill room and get none before it goes first.
AGING_TICKS = 8


@dataclass(frozen=True, slots=True)
class PrefillWant:
    slot: int
    start: int  # next prompt position to prefill
    stop: int  # exclusive: end of prompt or the cold-save pause point
    deterministic: bool
    #: Prefilled whole, in one ubatch with whatever shares its call (an encoder: every
    #: position attends to every other, and llama.cpp asserts the call fits one ubatch).
    whole: bool = False
    #: Ticks in a row it wanted prefill room and got none (``waited_after``).
    waited: int = 0

    @property
    def aged(self) -> bool:
        return self.waited >= AGING_TICKS


@dataclass(frozen=True, slots=True)
class Chunk:
    slot: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class TickPlan:
    decode_slots: tuple[int, ...]  # slots whose pending token joins the shared call
    shared_chunks: tuple[Chunk, ...]  # prefill chunks in the shared call
    isolated_chunks: tuple[Chunk, ...]  # deterministic chunks that each get their own call


class BatchStrategy(Protocol):
    def plan(
        self,
        decoding: Sequence[int],
        prefilling: Sequence[PrefillWant],
        n_batch: int,
        n_ubatch: int,
        drafted: int = 0,
        *,
        decode_waited: int = 0,
    ) -> TickPlan: ...


def _fill(
    prefilling: Sequence[PrefillWant],
    budget: int,
    used: int,
    n_batch: int,
    n_ubatch: int,
    max_chunks: int | None = None,
) -> tuple[list[Chunk], list[Chunk], int]:
    shared: list[Chunk] = []
    isolated: list[Chunk] = []

    # The fewest tokens left to prefill first (found by review: in slot order, a long prompt
    # in a lower slot took the whole budget every tick, and a short prompt beside it got its
    # first token only once the long one was prefilled, seconds to minutes later). A long
    # prompt still gets what the short ones leave: a few tokens each, then they decode.
    # Except that one passed over for AGING_TICKS ticks goes first (the longest waiting
    # first): shorter prompts arriving in the other slots starved it with no bound (found
    # by review).
    def order(w: PrefillWant) -> tuple[int, int, int, int]:
        return (
            (0, -w.waited, w.stop - w.start, w.slot) if w.aged else (1, 0, w.stop - w.start, w.slot)
        )

    for want in sorted(prefilling, key=order):
        if max_chunks is not None and len(shared) + len(isolated) >= max_chunks:
            break
        end = chunk_end(want.start, want.stop, n_batch)
        size = end - want.start
        if want.whole:
            # Admission keeps such a prompt within n_ubatch, so one always fits an empty call.
            if used + size <= min(budget, n_ubatch):
                shared.append(Chunk(want.slot, want.start, end))
                used += size
            elif want.aged:
                break  # keep the room for it: nothing smaller goes ahead of it
            continue
        if want.deterministic:
            # Mixing keeps numerics only if llama.cpp will not split the call differently
            # (the whole call must fit one ubatch); otherwise the chunk runs alone.
            if used + size <= min(budget, n_ubatch):
                shared.append(Chunk(want.slot, want.start, end))
                used += size
            else:
                isolated.append(Chunk(want.slot, want.start, end))
            continue
        take = min(size, budget - used)
        if take <= 0:
            continue
        shared.append(Chunk(want.slot, want.start, want.start + take))
        used += take
    return shared, isolated, used


class DecodeFirst:
    """Generating slots each get their next token first; prefill fills what is left."""

    def plan(
        self,
        decoding: Sequence[int],
        prefilling: Sequence[PrefillWant],
        n_batch: int,
        n_ubatch: int,
        drafted: int = 0,
        *,
        decode_waited: int = 0,
    ) -> TickPlan:
        used = len(decoding) + drafted
        shared, isolated, _ = _fill(prefilling, n_batch, used, n_batch, n_ubatch)
        return TickPlan(tuple(decoding), tuple(shared), tuple(isolated))


class PrefillFirst:
    """Admitted prompts are prefilled before anyone decodes: lowest time to first token.
    Except that once a generating slot has been held ``AGING_TICKS`` ticks in a row
    (``decode_waited``, the most of any decoding slot), every generating slot decodes this
    tick and prefill fills what is left, as under ``decode_first``."""

    def plan(
        self,
        decoding: Sequence[int],
        prefilling: Sequence[PrefillWant],
        n_batch: int,
        n_ubatch: int,
        drafted: int = 0,
        *,
        decode_waited: int = 0,
    ) -> TickPlan:
        if not prefilling or (decoding and decode_waited >= AGING_TICKS):
            return DecodeFirst().plan(decoding, prefilling, n_batch, n_ubatch, drafted)
        shared, isolated, _ = _fill(prefilling, n_batch, 0, n_batch, n_ubatch)
        return TickPlan((), tuple(shared), tuple(isolated))


class Balanced:
    """Decode tokens first, but at most one prefill chunk per tick: steady token pacing."""

    def plan(
        self,
        decoding: Sequence[int],
        prefilling: Sequence[PrefillWant],
        n_batch: int,
        n_ubatch: int,
        drafted: int = 0,
        *,
        decode_waited: int = 0,
    ) -> TickPlan:
        shared, isolated, _ = _fill(
            prefilling, n_batch, len(decoding) + drafted, n_batch, n_ubatch, max_chunks=1
        )
        return TickPlan(tuple(decoding), tuple(shared), tuple(isolated))


def waited_after(plan: TickPlan, prefilling: Sequence[PrefillWant]) -> dict[int, int]:
    """Each wanting slot's ``PrefillWant.waited`` for the next tick: 0 where ``plan`` gives
    it a chunk, one more than now where it gets none."""
    served = {c.slot for c in (*plan.shared_chunks, *plan.isolated_chunks)}
    return {w.slot: 0 if w.slot in served else w.waited + 1 for w in prefilling}


def isolate(plan: TickPlan, deterministic: set[int]) -> tuple[TickPlan, tuple[int, ...]]:
    """``plan`` with each ``deterministic`` slot's work in a call of its own, for a context
    of per-sequence KV streams: a pass over several streams attends with another kernel (a
    batch of streams, never the split-KV decode path) than a pass over one, so a
    deterministic slot's tokens must not share their pass with another slot's. Returns the
    plan (its shared call keeps the other slots' work; the deterministic chunks join the
    isolated ones) and the deterministic decode slots, each to run alone."""
    if len(plan.decode_slots) + len(plan.shared_chunks) <= 1:
        return plan, ()
    shared = tuple(c for c in plan.shared_chunks if c.slot not in deterministic)
    moved = tuple(c for c in plan.shared_chunks if c.slot in deterministic)
    decode = tuple(i for i in plan.decode_slots if i not in deterministic)
    alone = tuple(i for i in plan.decode_slots if i in deterministic)
    return TickPlan(decode, shared, (*moved, *plan.isolated_chunks)), alone


def strategy(name: StrategyName) -> BatchStrategy:
    from kvwarm.errors import ConfigError

    table: dict[str, BatchStrategy] = {
        "decode_first": DecodeFirst(),
        "prefill_first": PrefillFirst(),
        "balanced": Balanced(),
    }
    try:
        return table[name]
    except KeyError:
        raise ConfigError(f"batch_strategy must be one of {sorted(table)}; got {name!r}") from None
