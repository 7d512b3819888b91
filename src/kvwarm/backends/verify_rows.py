"""Whether a pass of several rows computes, row for row, what one-token passes compute.

Speculative decoding is exact (a greedy reply is plain decoding's, token for token) only where
each row of a verify pass has bit for bit the logits of the one-token pass at its position.
That depends on kernels the backend chooses by the number of rows in a pass: llama.cpp's CPU
attention (``BackendModel.verify_exactness``) and its matrix products, which take another
kernel for several rows than ``vec_dot`` for one with weights of some types
(``model_file.several_row_kernels``: found, Gemma 3 270M's K-quants in the tiled kernel gave
14-16 of 16 rows that differ, whatever the KV type; SmolLM2's Q4_1 and Q8_0 none).
``differing_rows`` measures it on a context; ``probe_tokens`` picks tokens that any vocabulary
spells.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvwarm.backends.base import BackendContext, BatchToken

#: Verify passes the probe compares, by rows: the shortest (tinyBLAS takes two rows or more),
#: and one of several of its tiles and a remainder. Each needs as many one-token passes as its
#: rows: 9 passes are ~0.1 s on SmolLM2 here, a few seconds for an 8B model on a CPU.
PROBE_ROWS = (2, 9)
#: Cells of prompt before the compared rows.
PROBE_PROMPT = 8
PROBE_TEXT = "The quick brown fox jumps over the lazy dog while the keeper counts the ships. "


def differing_rows(
    ctx: BackendContext, prompt: Sequence[int], follow: Sequence[int], passes: Sequence[int]
) -> int:
    """After ``prompt`` in sequence 0 of an empty ``ctx``: how many rows of passes of ``n`` of
    ``follow``'s tokens (each ``n`` in ``passes``) differ from the one-token passes at the
    same positions. The sequence is removed after."""
    at = len(prompt)
    try:
        ctx.prefill(0, list(prompt), 0)
        one = []
        for i, token in enumerate(follow[: max(passes)]):
            ctx.decode([BatchToken(token, at + i, 0, True)])
            one.append(np.frombuffer(ctx.logits(0), np.float32).copy())
        differ = 0
        for n in passes:
            ctx.seq_rm(0, at, -1)
            ctx.decode([BatchToken(t, at + i, 0, True) for i, t in enumerate(follow[:n])])
            differ += sum(
                not np.array_equal(one[i], np.frombuffer(ctx.logits(i), np.float32))
                for i in range(n)
            )
        return differ
    finally:
        ctx.seq_rm(0)


def probe_tokens(tokenize: Callable[[str], Sequence[int]], n_vocab: int) -> list[int]:
    """``PROBE_PROMPT + max(PROBE_ROWS)`` token ids of ordinary text, repeated as needed; ids
    1, 2, 3 ... where the vocabulary spells none of it."""
    want = PROBE_PROMPT + max(PROBE_ROWS)
    tokens = [t for t in tokenize(PROBE_TEXT) if 0 <= t < n_vocab]
    if not tokens:
        tokens = [1 + i % max(1, n_vocab - 1) for i in range(want)]
    return [tokens[i % len(tokens)] for i in range(want)]
