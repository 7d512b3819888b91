"""The stub backend's byte-level vocabulary: token ``b + OFFSET`` is the byte ``b``; after the
bytes come the fill-in-the-middle tokens.

Invariants: these ids are fixed; stub KV blobs and tests depend on them. The FIM tokens exist
in every stub vocabulary, but only a model whose path names ``fim`` reports them
(``ModelFacts.fim``), as only some GGUFs do; the stub never samples them.
"""

from __future__ import annotations

UNK, BOS, EOS = 0, 1, 2
OFFSET = 3
N_BYTE_TOKENS = 256 + OFFSET  # the ids the fake logits rank
FIM_PRE, FIM_SUF, FIM_MID, FIM_PAD, FIM_REP, FIM_SEP = range(N_BYTE_TOKENS, N_BYTE_TOKENS + 6)
N_VOCAB = N_BYTE_TOKENS + 6
N_EMBD = 16

FIM_TEXT = {
    FIM_PRE: "<fim_prefix>",
    FIM_SUF: "<fim_suffix>",
    FIM_MID: "<fim_middle>",
    FIM_PAD: "<fim_pad>",
    FIM_REP: "<repo_name>",
    FIM_SEP: "<file_sep>",
}
