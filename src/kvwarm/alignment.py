"""The n_batch-alignment rule: why a deterministic restore is bit-identical to a cold prefill.

This module is the rule's only home; the planner, the tick, the batch strategies, the backends'
prefill and the cache's save boundaries call it instead of doing the arithmetic themselves.

Why. llama.cpp computes a forward pass in batches, and the floating-point result for a position
depends on which positions share its pass (matrix shapes, reduction order). A cold prefill
splits a prompt at absolute positions that are multiples of ``n_batch``: every call covers
``[k*n_batch, (k+1)*n_batch)`` or ends at the prompt's end. So the KV of positions
``[0, k*n_batch)`` is the same bytes whenever aligned chunks produced it, by this prompt or by
any other that shares the prefix.

The rule, wherever KV is produced or reused:

1. A prefill chunk ends at the next absolute multiple of ``n_batch`` or at the end of what is
   being prefilled (``chunk_end``), never anywhere else unless a tick budget cuts it. A media
   span (an image's positions) is one call of its own, so the chunks before and after it end
   and start at its edges: cuts that depend on the prompt alone, as the multiples do.
2. Every slot and row records its *canonical prefix*: the leading tokens whose KV came from
   such aligned chunks. Generated tokens (decoded one at a time) and chunks cut short by a
   tick's budget are not canonical (``canonical_after``, ``canonical_after_chunk``).
3. A deterministic request reuses only a canonical prefix, trimmed down to a multiple of
   ``n_batch`` (``align_down``), and prefills the rest in aligned chunks; its KV and logits
   are then bit-identical to a cold prefill's.
4. A cold save pauses the prefill at a multiple of ``n_batch``, so the whole row is canonical.

Invariant: pure integer arithmetic, no imports of kvwarm, no state. See ``docs/architecture.md``,
"Exactness".
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = [
    "align_down",
    "canonical_after",
    "canonical_after_chunk",
    "chunk_end",
    "is_aligned",
]


def align_down(n: int, n_batch: int) -> int:
    """``n`` rounded down to a multiple of ``n_batch`` (the longest reusable aligned prefix)."""
    return n - n % n_batch


def is_aligned(n: int, n_batch: int) -> bool:
    return n % n_batch == 0


def chunk_end(start: int, stop: int, n_batch: int) -> int:
    """Where a prefill chunk starting at ``start`` ends: the next absolute multiple of
    ``n_batch``, or ``stop`` (exclusive) if that comes first."""
    return min((start // n_batch + 1) * n_batch, stop)


def canonical_after(keep: int, source_canonical: int | None, n_prompt: int, n_batch: int) -> int:
    """Canonical prefix length once the prompt is fully prefilled after keeping ``keep`` tokens
    of a source whose canonical prefix is ``source_canonical`` (None: all of it)."""
    src = keep if source_canonical is None else min(keep, source_canonical)
    if src == keep and is_aligned(keep, n_batch):
        return n_prompt  # the rest is prefilled in aligned chunks from an aligned start
    return src


def canonical_after_chunk(
    canonical: int,
    start: int,
    end: int,
    n_prompt: int,
    n_batch: int,
    *,
    cuts: Collection[int] = (),
) -> int:
    """The canonical prefix after prefilling ``[start, end)`` of an ``n_prompt``-token prompt.

    A chunk cut short by the tick budget (ending neither at a multiple of ``n_batch``, nor at
    the prompt's end, nor at one of ``cuts``) was not computed the way an aligned prefill
    computes it: from its aligned start on, the KV is not canonical. ``cuts``: the starts and
    ends of the prompt's media spans, where every prefill of it cuts too (a span is decoded
    whole in a call of its own, so those cuts depend only on the prompt, as the multiples of
    ``n_batch`` do).
    """
    if is_aligned(end, n_batch) or end == n_prompt or end in cuts:
        return canonical
    return min(canonical, align_down(start, n_batch))
