"""Token sequences as both sides of the cache see them: how much two prompts share, and where a
row's tail begins. The engine's planner and the cache's index and reads use the same helpers.

Invariant: pure; imports nothing of kvwarm.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["common_prefix", "tail_of"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: slices compare in C, far faster than a Python loop.
    block = 256
    while i + block <= n and a[i : i + block] == b[i : i + block]:
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tail_of(chunk_lens: Sequence[int], upto: int) -> tuple[int, int]:
    """(how many leading chunks end at or before ``upto``, the position the others start
    at): where a read or restore of a row's tail begins when the KV before ``upto`` is held
    elsewhere. The last chunk is always part of the tail."""
    skip = start = 0
    for length in chunk_lens[:-1]:
        if start + length > upto:
            break
        start += length
        skip += 1
    return skip, start
