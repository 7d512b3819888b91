"""Choosing where a request's prompt KV comes from. Pure decisions; no native or file calls.

Sources, best first at equal length: the slot's own live KV (no work), another slot's live KV
(``seq_cp``), a cache row (load + unpack). Deterministic mode only uses KV that an aligned-chunk
prefill produced, trimmed to a multiple of ``n_batch``, so the result is bit-identical to a cold
prefill (DESIGN.md, "Two correctness guarantees").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

SourceKind = Literal["none", "self", "copy", "row"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: slices compare in C, far faster than a Python loop.
    block = 256
    while i + block <= n and a[i : i + block] == b[i : i + block]:
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return i


def usable_length(
    shared: int,
    n_prompt: int,
    *,
    canonical: int | None,
    n_batch: int,
    deterministic: bool,
    row_tokens: int | None = None,
    row_has_logits: bool = False,
) -> tuple[int, bool]:
    """(tokens to keep from the source, whether its stored logits replace any decode).

    At least one prompt token is left to prefill unless the source is a row holding exactly the
    prompt with its final logits, because sampling needs logits after the last prompt token.
    """
    u = min(shared, n_prompt)
    if deterministic:
        u = min(u, canonical if canonical is not None else u)
        u -= u % n_batch
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
            u -= u % n_batch
    return max(u, 0), False


@dataclass(frozen=True, slots=True)
class Plan:
    kind: SourceKind
    keep: int  # prompt tokens whose KV is reused
    use_logits: bool = False
    src_seq: int = -1  # for "copy"
    row_key: bytes | None = None  # for "row"
    shared: int = 0  # tokens the source shares with the prompt before trimming


def better(a: Plan, b: Plan) -> Plan:
    """The plan that reuses more; ties prefer the cheaper source (self < copy < row)."""
    order = {"self": 0, "copy": 1, "row": 2, "none": 3}
    if (b.keep, b.use_logits) > (a.keep, a.use_logits):
        return b
    if (b.keep, b.use_logits) == (a.keep, a.use_logits) and order[b.kind] < order[a.kind]:
        return b
    return a


def canonical_after(keep: int, source_canonical: int | None, n_prompt: int, n_batch: int) -> int:
    """Canonical prefix length once the prompt is fully prefilled after keeping ``keep``."""
    src = keep if source_canonical is None else min(keep, source_canonical)
    if src == keep and keep % n_batch == 0:
        return n_prompt  # the rest is prefilled in aligned chunks from an aligned start
    return src
