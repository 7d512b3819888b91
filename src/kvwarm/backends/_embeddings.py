"""Reading a context's embeddings after a decode with ``embeddings=True`` (``LlamaContext.embed``).

Invariants: every pointer llama.cpp returns is checked before numpy reads it, and the values
are copied out before the next decode can overwrite them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwarm.errors import BackendError


def read(lib: Any, ctx: object, n: int, n_embd: int, *, pooled: bool) -> npt.NDArray[np.float64]:
    """Sequence 0's pooled embedding, or (no pooling) the mean of its ``n`` token rows."""
    if pooled:
        ptr = lib.llama_get_embeddings_seq(ctx, 0)
        if not ptr:
            raise BackendError("llama.cpp returned no pooled embedding")
        return np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(np.float64)
    rows = []
    for i in range(n):
        ptr = lib.llama_get_embeddings_ith(ctx, i)
        if not ptr:
            raise BackendError("llama.cpp returned no token embeddings")
        rows.append(np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy())
    mean: npt.NDArray[np.float64] = np.mean(np.stack(rows), axis=0, dtype=np.float64)
    return mean


def as_list(vec: npt.NDArray[np.float64], *, normalize: bool) -> list[float]:
    """``vec`` as floats, scaled to unit length when ``normalize`` (a zero vector stays)."""
    if normalize:
        norm = math.sqrt(float(np.dot(vec, vec)))
        if norm > 0:
            vec = vec / norm
    return [float(x) for x in np.asarray(vec, dtype=np.float64).ravel()]
