"""When the worker saves, and which prefixes a shared tier could hold: the save gates.

Invariant: nothing here does I/O, reads a clock or keeps state; every function is a plain
transformation of its arguments, so the worker's save decisions are testable as data. Only the
worker's cache port (``cacheport.py``) calls these; the cache itself stores what it is handed.

Boundaries. A cold save persists a *trimmed, aligned* prefix of the prompt, not the whole
prompt: dropping the last ``boundary_trim_tokens`` keeps the row valid for the next request
whose text extends this one (BPE may re-tokenise the tail differently), and aligning down to a
multiple of ``boundary_align_tokens`` makes the saved state one that a chunked prefill at
absolute n_batch multiples reproduces bit-for-bit (the rule and its reason: ``kvwarm.alignment``).

Probes. A shared tier answers only "does this key exist", so a prefix lookup there asks for
the keys of the prefixes a save could have produced (``probe_lengths``): the cold-save
boundaries (the only save lengths a lookup can predict without knowing the other prompt) and
the prompt's own length (a finish, evict or prewarm row of exactly this prompt) and, in a chat,
where each earlier turn ended (that turn's finish save).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwarm.alignment import align_down
from kvwarm.cache.types import PolicyConfig

__all__ = [
    "aligned_boundary",
    "cold_save_length",
    "cold_save_lengths",
    "probe_lengths",
    "should_continued_save",
    "should_finish_save",
]


def aligned_boundary(n_tokens: int, trim: int, align: int) -> int:
    """``n_tokens - trim`` rounded down to a multiple of ``align``; 0 when nothing is left.

    ``align`` of 1 means "no alignment". Negative inputs are programming errors.
    """
    if n_tokens < 0 or trim < 0 or align < 1:
        raise ValueError(f"bad boundary arguments n={n_tokens} trim={trim} align={align}")
    usable = n_tokens - trim
    if usable <= 0:
        return 0
    return align_down(usable, align)


def cold_save_length(n_tokens: int, policy: PolicyConfig) -> int:
    """How many leading prompt tokens a cold save after prefilling ``n_tokens`` persists.

    0 means "no cold save": the prompt is under ``cold_min_tokens``, or the trimmed aligned
    boundary is under ``min_tokens``. Prompts longer than ``cold_max_tokens`` are capped (the
    cap itself aligned down) rather than skipped: their head is still worth keeping.
    """
    if n_tokens < policy.cold_min_tokens:
        return 0
    boundary = aligned_boundary(n_tokens, policy.boundary_trim_tokens, policy.boundary_align_tokens)
    cap = policy.cold_max_tokens - policy.cold_max_tokens % policy.boundary_align_tokens
    boundary = min(boundary, cap)
    if boundary <= 0 or boundary < policy.min_tokens:
        return 0
    return boundary


def cold_save_lengths(limit: int, policy: PolicyConfig, n_batch: int) -> tuple[int, ...]:
    """Every length up to ``limit`` that a cold save can write, longest first: the engine
    saves ``align_down(cold_save_length(m), n_batch)`` tokens of an m-token prompt
    (``engine/worker/cacheport.py``), which for some m is each multiple of ``boundary_align_tokens``
    from ``min_tokens`` up to the aligned ``cold_max_tokens``, aligned down to ``n_batch``."""
    if n_batch < 1:
        raise ValueError(f"n_batch must be >= 1, got {n_batch}")
    align = policy.boundary_align_tokens
    cap = min(limit, policy.cold_max_tokens - policy.cold_max_tokens % align)
    out: list[int] = []
    for boundary in range(cap - cap % align, 0, -align):
        length = align_down(boundary, n_batch)
        if length < max(1, policy.min_tokens):
            break
        if not out or out[-1] != length:
            out.append(length)
    return tuple(out)


def probe_lengths(
    n_tokens: int, policy: PolicyConfig, n_batch: int, *, turn_ends: Sequence[int] = ()
) -> tuple[int, ...]:
    """Prefix lengths of an ``n_tokens`` prompt worth probing in a shared tier, longest first.

    - the prompt itself: a row of exactly these tokens (finish, evict, prewarm);
    - each ``turn_ends`` position ``i`` (where an end-of-turn token sits in the prompt) and
      ``i - 1``: a chat follow-up repeats the previous reply before its end-of-turn token, and
      that turn's finish save holds the prompt and the reply up to there (a reply stopped by
      an end-of-generation token: ``i``; cut by ``max_tokens``, whose last token is never
      decoded: ``i - 1``);
    - every cold-save length below the prompt's (``cold_save_lengths``).

    Nothing shorter than ``min_tokens``: no save writes such a row."""
    floor = max(1, policy.min_tokens)
    if n_tokens < floor:
        return ()
    found = {n_tokens, *cold_save_lengths(n_tokens, policy, n_batch)}
    for end in turn_ends:
        found.update(n for n in (end, end - 1) if floor <= n <= n_tokens)
    return tuple(sorted(found, reverse=True))


def should_continued_save(live_tokens: int, last_saved_at: int, policy: PolicyConfig) -> bool:
    """True once ``continued_interval`` tokens were added since the last save of this slot."""
    if live_tokens < policy.min_tokens:
        return False
    return live_tokens - last_saved_at >= policy.continued_interval


def should_finish_save(live_tokens: int, policy: PolicyConfig) -> bool:
    """A finish save (prompt + reply) is worth writing once it clears ``min_tokens``."""
    return live_tokens >= policy.min_tokens
