"""Log-probabilities of tokens from one position's logits, for generated and prompt tokens.

Invariant: a logprob is ``logit - logsumexp(logits)`` of the raw model logits (before any
sampler step), so the same position gives the same numbers whether it was generated, echoed
from the prompt or streamed.
"""

from __future__ import annotations

import math

import numpy as np

from kvwarm.backends.base import BackendModel
from kvwarm.engine.text import piece_text
from kvwarm.engine.types import TokenLogprob


def token_logprob(model: BackendModel, logits: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """``token``'s logprob under ``logits`` (float32, n_vocab), with the ``top_n`` best."""
    m = float(logits.max())
    lse = m + math.log(float(np.exp(logits - m).sum()))
    top: tuple[tuple[int, str, float], ...] = ()
    if top_n > 0:
        idx = np.argpartition(-logits, top_n)[:top_n]
        idx = idx[np.argsort(-logits[idx])]
        top = tuple((int(i), _text(model, int(i)), float(logits[i]) - lse) for i in idx)
    return TokenLogprob(token, _text(model, token), float(logits[token]) - lse, top)


def _text(model: BackendModel, token: int) -> str:
    # Byte-level tokens of a longer character are not text on their own: name their bytes.
    return piece_text(model.token_to_piece(token))
