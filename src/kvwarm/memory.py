"""A model's memory kind, and the one rule for which prefix lengths a saved or live state can
resume from. Pure: no imports beyond the standard library, no native calls.

llama.cpp keeps four kinds of per-sequence memory:

- ``full``: every layer attends to every earlier position. The KV of ``[0, n)`` can be trimmed
  to any ``k <= n`` (``llama_memory_seq_rm``) and stays exactly the KV of ``[0, k)``.
- ``swa``: sliding-window (or chunked) attention layers beside full ones (Gemma 2/3, gpt-oss,
  Llama 4). Each SWA layer needs only the last ``n_swa`` positions, and llama.cpp drops (or
  overwrites) older ones: a state saved at ``n > n_swa`` holds the SWA cells of
  ``[n - n_swa, n)`` only (``state_write`` skips masked cells). Trimming such a state to ``k``
  leaves the positions before ``k`` that a token at ``k`` attends to missing: a wrong answer,
  not a miss. A state resumes at ``k`` only if it still holds every position
  ``[k - n_swa, k)``: its lowest position ``pos_min <= max(0, k - n_swa)`` (llama-server's
  rule). With ``swa_full`` (llama.cpp's full-size SWA cache) a live sequence keeps its cells
  and trims like ``full`` (its ``pos_min`` stays 0), but a *saved* state still leaves the
  masked cells out (measured: ``state_write`` filters them whatever the cache size), so saved
  rows resume at their own length alone either way.
- ``recurrent`` (Mamba, RWKV) and ``hybrid`` (attention plus a recurrent state: Jamba,
  Granite 4, LFM2, Qwen3-Next): the recurrent state is one value per sequence, updated in place.
  It cannot be rolled back: a state of ``n`` tokens resumes at ``n`` and nowhere else.

Every component that reuses KV (the planner for live slots and rows, the saves that decide
where checkpoints go) asks this module, never the model's name.

Invariant: ``resume_floor`` is a lower bound on the lengths a state resumes at; together with
its own length ``n`` it gives the only lengths ``k`` (``floor <= k <= n``) at which that state
is exactly the state a cold run of the first ``k`` tokens would hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

MemoryKindName = Literal["full", "swa", "recurrent", "hybrid"]
MEMORY_KINDS: tuple[str, ...] = get_args(MemoryKindName)


@dataclass(frozen=True, slots=True)
class MemoryKind:
    """What a context's per-sequence memory is: the model's kind, its window, and whether the
    context keeps a full-size SWA cache."""

    kind: MemoryKindName = "full"
    n_swa: int = 0
    swa_full: bool = False

    @property
    def trimmable(self) -> bool:
        """Whether every state of ``n`` tokens, live or saved, is also the state of every
        shorter prefix: plain full attention only."""
        return self.kind == "full" or (self.kind == "swa" and self.n_swa <= 0)

    @property
    def kv_caches(self) -> int:
        """How many KV caches a sequence's state blob holds before anything else: an iSWA
        cache is two (full-attention layers, then the window's), a recurrent state none."""
        if self.kind == "recurrent":
            return 0
        return 2 if self.n_swa > 0 else 1

    @property
    def chunkable(self) -> bool:
        """Whether a saved state can be cut into per-token-range chunks (one KV stream of
        cells, nothing else): only plain full attention."""
        return self.trimmable

    @property
    def has_rest(self) -> bool:
        """Whether a saved state is a KV cache of every position followed by a part that
        must be kept whole (its *rest*): an iSWA model's full-attention cache, then its window;
        a hybrid model's attention cache, then its recurrent state. Rows of such a memory are
        that first cache as chunks (shared like full attention's) plus the rest: a window's
        in chunks of its own (``rest_chunkable``), a recurrent state in the row itself (the
        codec's ``rest``; it refuses a blob that is not of this shape, and the row is then
        stored whole)."""
        return self.kind == "hybrid" or (self.kind == "swa" and self.n_swa > 0)

    @property
    def rest_chunkable(self) -> bool:
        """Whether the rest (``has_rest``) is itself a KV cache of per-position cells, cut into
        chunks like the first cache (``KvCodec.split_rest``): an iSWA window, whose cell at
        position ``i`` depends only on the tokens up to ``i``, so checkpoints of one
        conversation share all but their newest cells and conversations share a system
        prompt's. A recurrent state is one value per sequence: kept whole."""
        return self.kind == "swa" and self.n_swa > 0

    def saved_floor(self, n_tokens: int) -> int:
        """The shortest prefix a *saved* state of ``n_tokens`` tokens resumes at.

        A saved SWA state longer than its window holds only the window's cells, so its
        lowest position is ``n - n_swa`` and it resumes at ``n`` alone (with ``swa_full``
        too: the masked cells are not saved).
        """
        if self.trimmable:
            return 0
        if self.kind == "swa":
            return 0 if n_tokens <= self.n_swa else n_tokens
        return n_tokens

    def live_floor(self, n_tokens: int, pos_min: int) -> int:
        """The shortest prefix a *live* sequence of ``n_tokens`` tokens whose lowest held
        position is ``pos_min`` resumes at (llama.cpp keeps masked SWA cells until it needs
        their room, and with ``swa_full`` never needs it, so a live state may reach further
        back than a saved one)."""
        if self.trimmable or n_tokens == 0:
            return 0
        if self.kind == "swa":
            if pos_min < 0:
                # The SWA cells are gone while full-attention ones remain (a trim below the
                # window empties the SWA cache; llama.cpp reports only its positions).
                return n_tokens
            return 0 if pos_min == 0 else min(n_tokens, pos_min + self.n_swa)
        return n_tokens

    def lookahead(self, n_tokens: int) -> int | None:
        """How many tokens a *live* sequence of ``n_tokens`` tokens may decode past its end
        and still be trimmed back to any length in between (speculative decoding's verify
        pass: the rejected draft tokens are removed). None: no limit (full attention; a
        full-size SWA cache, whose live state trims like full attention). A sliding window
        without it: only while no position is masked yet, that is while the last decoded
        position stays below ``n_swa`` (llama.cpp reuses a masked cell, so a trim past it
        would leave the window short). A recurrent or hybrid state: 0, it cannot roll back."""
        if self.trimmable or (self.kind == "swa" and self.swa_full):
            return None
        if self.kind == "swa":
            return max(0, self.n_swa - n_tokens)
        return 0

    def describe(self) -> str:
        """A short label: ``full``, ``swa(512)``, ``swa(512, full cache)``, ``recurrent``..."""
        if self.kind != "swa":
            return self.kind
        return f"swa({self.n_swa}, full cache)" if self.swa_full else f"swa({self.n_swa})"


FULL = MemoryKind()
