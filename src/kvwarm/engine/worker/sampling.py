"""Sampling: from one position's logits to the next token, and where that token goes.

Invariants: a slot's generated tokens are sampled in order from the logits of the position
before them (a decode row, or a row's stored final logits on an exact hit); an end-of-generation
token, a stop string, ``max_tokens`` or a full window ends the request through ``Outcomes``; the
token that reaches ``max_tokens`` is reported but never decoded (``docs/architecture.md``).

Log-probabilities of tokens from one position's logits, for generated and prompt tokens.

Invariant: a logprob is ``logit - logsumexp(logits)`` of the raw model logits (before any
sampler step), so the same position gives the same numbers whether it was generated, echoed
from the prompt or streamed.
"""

from __future__ import annotations

import math

import numpy as np

from kvwarm.backends.base import BackendModel
from kvwarm.engine.request import Fragment
from kvwarm.engine.text import piece_text
from kvwarm.engine.types import TokenLogprob
from kvwarm.engine.worker.outcomes import Outcomes
from kvwarm.engine.worker.runtime import Runtime
from kvwarm.engine.worker.slots import Slot
from kvwarm.errors import KvwarmError


class Sampling:
    def __init__(self, rt: Runtime, outcomes: Outcomes) -> None:
        self.rt = rt
        self.outcomes = outcomes

    def on_logits(self, slot: Slot, row: int | None, stored: bytes | None) -> None:
        """Sample the next token from batch row ``row`` (or stored logits) and route it."""
        act = slot.active
        assert act is not None
        rt = self.rt
        opts = act.req.options
        if len(act.generated) >= opts.max_tokens or len(slot.kv_tokens) >= rt.cfg.n_ctx_slot:
            # max_tokens (0 for a prewarm-style request) or the slot's window is used up.
            self.outcomes.finish(slot, "length", self._logits_bytes(row, stored))
            return
        lp_source = None
        if opts.logprobs is not None:
            lp_source = np.frombuffer(
                stored if stored is not None else rt.ctx.logits(-1 if row is None else row),
                dtype=np.float32,
            ).copy()
        if stored is not None:
            token = act.sampler.sample_logits(stored)
        else:
            assert row is not None
            token = act.sampler.sample(rt.ctx, row)
        if lp_source is not None:
            act.logprobs.append(token_logprob(rt.model, lp_source, token, opts.logprobs or 0))
        if rt.model.is_eog(token):
            self.outcomes.finish(slot, "stop", self._logits_bytes(row, stored))
            return
        act.generated.append(token)
        fragment = act.assembler.feed(rt.model.token_to_piece(token))
        if fragment and act.req.fragments:
            # A token whose text is held back keeps its logprob until text goes out with it.
            act.req.channel.put(Fragment(fragment, act.unsent_logprobs()))
        if act.assembler.stopped:
            self.outcomes.finish(slot, "stop", self._logits_bytes(row, stored))
            return
        act.pending = token
        if len(act.generated) >= opts.max_tokens:
            # The limit is reached: the last token is reported but never decoded.
            act.pending = None
            self.outcomes.finish(slot, "length", self._logits_bytes(row, stored))

    def _logits_bytes(self, row: int | None, stored: bytes | None) -> bytes | None:
        if stored is not None:
            return stored
        if row is None:
            return None
        try:
            return bytes(self.rt.ctx.logits(row))
        except KvwarmError:
            return None


# --- Log-probabilities of tokens from one position's logits, for generated and prompt tokens.


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
