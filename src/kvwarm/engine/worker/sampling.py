"""Sampling: from one position's logits to the next token, and where that token goes.

Invariants: a slot's generated tokens are sampled in order from the logits of the position
before them (a decode row, a verify pass's row, or a row's stored final logits on an exact
hit), by the request's one sampler, so a speculative request samples what a plain one would;
an end-of-generation token, a stop string, a line stop (``n_indent``, ``t_max_predict_ms``),
``max_tokens`` or a full window ends the request through ``Outcomes``; the token that reaches
``max_tokens`` (or a line stop) is reported but never decoded; a verify pass leaves the
sequence holding only the accepted draft (``docs/architecture.md``).
A generated token's text is its piece, a control token's empty, except for the tokens its
request preserves (``Request.preserved``: a tool call's markers), whose text it is; an
end-of-generation token is never text.

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
from kvwarm.engine.types import FinishReason, TokenLogprob
from kvwarm.engine.worker.outcomes import Outcomes
from kvwarm.engine.worker.runtime import Runtime
from kvwarm.engine.worker.slots import Active, Slot
from kvwarm.errors import KvwarmError, StateRestoreError

_UNSEEN = b"\0unseen"  # no piece is this object: a miss in ``Sampling._pieces``


class Sampling:
    def __init__(self, rt: Runtime, outcomes: Outcomes) -> None:
        self.rt = rt
        self.outcomes = outcomes
        #: Each sampled token's piece, None for an end-of-generation token: one lookup a
        #: token where the model's ``is_eog`` and ``token_to_piece`` were two calls (right
        #: after a forward pass, every function first touched costs microseconds).
        self._pieces: dict[int, bytes | None] = {}
        #: The pieces, special tokens' text included, of the tokens a request preserves
        #: (``Request.preserved``).
        self._kept: dict[int, bytes] = {}

    def on_logits(self, slot: Slot, row: int | None, stored: bytes | None) -> None:
        """Sample the next token from batch row ``row`` (or stored logits) and route it."""
        act = slot.active
        assert act is not None
        if self._used_up(slot):
            # max_tokens (0 for a prewarm-style request) or the slot's window is used up.
            self.outcomes.finish(slot, "length", self._logits_bytes(slot, row, stored))
            return
        token = self._sample(act, row, stored)
        reason = self._route(act, token)
        if reason is None:
            act.pending = token
            return
        self.outcomes.finish(slot, reason, self._logits_bytes(slot, row, stored))

    def on_verify(self, slot: Slot, first: int, draft: list[int], pad: int = 0) -> None:
        """Speculative decoding: batch rows ``first .. first + len(draft)`` hold the logits
        after the slot's ``pending`` token and after each draft token (and ``pad`` filler
        rows after them, never sampled: ``Tick._pad``). Each row is sampled
        in turn, exactly as plain decoding would sample it (the same sampler, its state, its
        seed), for as long as the draft so far is what was sampled; the first sampled token
        that differs from the draft (or the one after a fully accepted draft) becomes the new
        ``pending``. With a draft that is one token for sure (an n-gram's), accepting it when
        sampled and otherwise keeping what was sampled *is* speculative rejection sampling:
        the draft token ``d`` is kept with probability ``p(d)`` and, if not, the token comes
        from ``p`` without ``d``, renormalised (``docs/internals.md``, "Speculative
        decoding"). So output, logprobs, grammar and penalties are plain decoding's.

        Then the KV: the cells of the draft tokens past the last accepted one are removed
        (``seq_rm``, checked), the filler's with them; ``kv_tokens`` grows by ``pending`` and
        the accepted draft, and only then may the request finish (its finish save packs
        exactly those)."""
        act = slot.active
        assert act is not None and act.pending is not None
        rt = self.rt
        decoded = act.pending
        act.pending = None
        n = len(slot.kv_tokens)  # ``decoded`` sits at position n, draft[i] at n + 1 + i
        reason: FinishReason | None = None
        matched = 0  # draft tokens equal to what was sampled, in order
        last = len(draft)  # the last row sampled
        after: int | None = None  # the token sampled after the whole draft
        best = self._greedy_rows(act, first, draft)
        for i in range(len(draft) + 1):
            if self._used_up(slot, n + i + 1):
                reason, last = "length", i
                break
            if best is None or i >= len(best) or best[i] < 0:
                token = self._sample(act, first + i, None)
            else:
                token = self._logprob(act, first + i, best[i])
            if i == len(draft):
                after = token
            same = i < len(draft) and token == draft[i]
            matched += same
            reason = self._route(act, token)
            if reason is not None or not same:
                last = i
                if reason is None:
                    act.pending = token
                break
        # ``decoded`` and draft[:last] hold the KV the sampled tokens were sampled from.
        self._trim(slot, n + last + 1, n + len(draft) + pad)
        slot.kv_tokens.append(decoded)
        slot.kv_tokens.extend(draft[:last])
        act.drafted += len(draft)
        act.accepted += matched
        rt.stats.verify_passes += 1
        rt.stats.filler_rows += pad
        if act.drafter is not None:
            act.drafter.verified(len(draft), matched, after)
        self.outcomes.port.decoded(slot)
        if reason is not None:
            self.outcomes.finish(slot, reason, self._logits_bytes(slot, first + last, None))

    def _greedy_rows(self, act: Active, first: int, draft: list[int]) -> list[int] | None:
        """Plain greedy's tokens for a verify pass's rows, as far as they can be needed: the
        first row's, and only if it is the draft's first token every other row's, in one
        numpy pass (each what ``_sample`` would pick; -1 where a row holds NaN, which
        ``_sample`` then refuses if that row is reached). None: not plain greedy, each row is
        sampled in turn. A row's logits are ~200 KB to ~1 MB read from memory: a draft
        rejected at once reads one row, not all of them."""
        ctx, sampler = self.rt.ctx, act.sampler
        head = sampler.argmax_rows(ctx, first, 1)
        if head is None or not draft or head[0] != draft[0]:
            return head
        rest = sampler.argmax_rows(ctx, first + 1, len(draft))
        return None if rest is None else head + rest

    def _trim(self, slot: Slot, keep: int, top: int) -> None:
        """Remove the cells of positions ``keep .. top`` from the slot's sequence, and check
        that what is left is exactly ``[0, keep)``, a state the model can resume from
        (``StateRestoreError`` if the memory refused: the request then fails, its slot is
        cleared; never a sequence holding a rejected draft's cells)."""
        if keep > top:
            return
        ctx = self.rt.ctx
        ctx.seq_rm(slot.seq, keep, -1)
        held = ctx.seq_pos_max(slot.seq)
        mem = self.rt.memory
        # Asked of the state the pass left (``top + 1`` tokens), as the draft model's trim
        # does: ``live_floor(keep, ...)`` is never above ``keep`` (a state resumes at its own
        # length), so this check could not fail. A window that lost cells during the pass
        # (llama.cpp reuses a cell masked for the draft's later rows: a verify split over
        # ubatches) must fail here, not decode on with positions missing.
        if held != keep - 1 or mem.live_floor(top + 1, ctx.seq_pos_min(slot.seq)) > keep:
            raise StateRestoreError(
                f"removing a rejected draft left seq {slot.seq} holding up to position {held}, "
                f"not a state of its first {keep} tokens ({mem.describe()} memory)"
            )

    def _used_up(self, slot: Slot, live: int | None = None) -> bool:
        """Whether ``max_tokens`` or the slot's window (``live`` tokens of KV, by default
        what it holds) leave no room for one more sampled token."""
        act = slot.active
        assert act is not None
        live = len(slot.kv_tokens) if live is None else live
        return len(act.generated) >= act.req.options.max_tokens or live >= self.rt.cfg.n_ctx_slot

    def _logprob(self, act: Active, row: int, token: int) -> int:
        """``token``, sampled from batch row ``row`` already, with its logprob if asked for."""
        top_n = act.req.options.logprobs
        if top_n is not None:
            logits = np.frombuffer(self.rt.ctx.logits(row), dtype=np.float32).copy()
            act.logprobs.append(token_logprob(self.rt.model, logits, token, top_n))
        return token

    def _sample(self, act: Active, row: int | None, stored: bytes | None) -> int:
        """The next token from batch row ``row`` (or stored logits), with its logprob."""
        rt = self.rt
        opts = act.req.options
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
        return token

    def _route(self, act: Active, token: int) -> FinishReason | None:
        """Send ``token`` on its way; why the request ends with it, if it does (an
        end-of-generation token is not part of the reply, nor is its logprob; the one that
        reaches ``max_tokens`` is, but is never decoded)."""
        now = self.rt.clock()
        if not act.sampled:
            act.first_sampled = now
        act.last_sampled = now
        act.sampled += 1
        piece = self._pieces.get(token, _UNSEEN)
        if piece is _UNSEEN:
            model = self.rt.model
            piece = None if model.is_eog(token) else model.token_to_piece(token)
            self._pieces[token] = piece
        if piece is not None and token in act.req.preserved:
            # A special token the reply keeps (a tool call's marker): its text, not nothing.
            piece = self._kept.get(token)
            if piece is None:
                piece = self._kept[token] = self.rt.model.token_to_piece(token, special=True)
        if piece is None:
            # Its logprob goes with it: a reply's logprobs are those of its tokens, as many as
            # completion_tokens counts (the end was an entry with empty text before).
            ended = len(act.logprobs) > len(act.generated) and act.logprobs[-1].token == token
            if ended:
                act.logprobs.pop()
            return "stop"
        act.generated.append(token)
        fragment = act.assembler.feed(piece)
        begun = act.assembler.begun()
        if act.assembler.stopped:
            # The stop sequence is no part of the reply: nor are the logprobs of the tokens
            # that only spell it (completion_tokens still counts them: they were generated).
            del act.logprobs[begun:]
        if fragment and act.req.fragments:
            # A token whose text is held back keeps its logprob until text goes out with it.
            act.req.channel.put(Fragment(fragment, act.unsent_logprobs(begun)))
        if act.assembler.indent_cut:
            act.stopped_by = "n_indent"
            return "length"
        if act.assembler.stopped:
            return "stop"
        if len(act.generated) >= act.req.options.max_tokens:
            return "length"
        limit_ms = act.req.options.t_max_predict_ms
        if limit_ms and "\n" in fragment and (now - act.first_sampled) * 1e3 > limit_ms:
            # llama-server's: a newline out past the limit ends the reply with it.
            act.stopped_by = "t_max_predict_ms"
            return "length"
        return None

    def _logits_bytes(self, slot: Slot, row: int | None, stored: bytes | None) -> bytes | None:
        """The final logits the finish save stores, if its row is one that keeps them
        (``CachePort.finish_keeps_logits``); None otherwise, and then nothing is copied."""
        if not self.outcomes.port.finish_keeps_logits(slot):
            return None
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
