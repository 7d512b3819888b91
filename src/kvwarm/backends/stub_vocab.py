"""The stub backend's byte-level vocabulary: token ``b + OFFSET`` is the byte ``b``.

Invariant: these ids are fixed; stub KV blobs and tests depend on them.
"""

from __future__ import annotations

UNK, BOS, EOS = 0, 1, 2
OFFSET = 3
N_VOCAB = 256 + OFFSET
N_EMBD = 16
