"""llama.cpp sampler chains, with the grammar kept outside the chain where it can be checked.

Invariants:

- The chain (logit biases → penalties → top-k → typical → top-p → min-p → temperature →
  seeded dist, or greedy: llama-server's order; typical after a floor that drops the
  candidates of no probability, whose NaN entropy disabled it) and the optional grammar
  sampler are each freed exactly once, when the sampler closes; the sampler holds its model
  (``acquire``) because both reference the model's vocabulary.
- The grammar never sees a token it rejected: with a grammar, candidates are built in Python,
  the grammar masks them, ``GrammarError`` is raised if nothing is left, and only the chosen
  (hence allowed) token is accepted. llama.cpp aborts on accepting a disallowed token or an
  end-of-generation token mid-grammar, so ``accept()`` feeds the chain (penalty history) only.
- Without a grammar, ``sample`` is ``llama_sampler_sample`` on a row the context has verified.
- A grammar step slower than ``GRAMMAR_TOKEN_BUDGET_S`` fails the sample (``GrammarError``).
- While a grammar holds, it never chooses a control token (``LlamaModel.unspoken_tokens``)
  other than the request's preserved ones: llama.cpp's grammar matches such a token's special
  text, which the reply's text leaves out, so the reply would not be what the grammar held.
- A lazy grammar (``grammar_triggers``) is that same grammar, held only from a trigger on
  (``backends/lazy_grammar.py``): until then the reply is sampled as without one; the text a
  trigger came in is given to the grammar a byte at a time, each byte checked by the grammar
  before it is accepted, so a refused start leaves the reply free, never aborts the process;
  once the grammar admits end-of-generation (its text is complete) it lets go (unless
  ``grammar_once``).
- NaN logits fail the sample with ``BackendError`` on every path: plain greedy finds them in
  its argmax (numpy returns a row's first NaN), the others in one max over the row.
"""

from __future__ import annotations

import ctypes
import logging
import math
import secrets
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from kvwarm.backends import _checks
from kvwarm.backends.base import BackendContext, SamplingParams
from kvwarm.backends.grammar_cost import check_grammar_safe
from kvwarm.backends.lazy_grammar import trigger_watch
from kvwarm.backends.lifetime import Lifetime
from kvwarm.errors import BackendError, GrammarError, InvalidRequestError, NoLogitsError
from kvwarm.unicode import encode_utf8

if TYPE_CHECKING:
    from kvwarm.backends.llama.context import LlamaContext
    from kvwarm.backends.llama.model import LlamaModel

log = logging.getLogger(__name__)

#: The most CPU time one token's grammar step may take (``llama_sampler_apply`` of the grammar over
#: the vocabulary; a few ms for any grammar ``grammar_cost`` lets through). Past it the request
#: fails: an ambiguous grammar's cost grows with every token, and its model's other requests
#: wait on each of them.
GRAMMAR_TOKEN_BUDGET_S = 2.0

#: The probability, relative to the best candidate's, below which candidates are dropped before
#: llama.cpp's typical sampler (``_build_chain``): e^-80, where e^-104 is a float's 0 and a
#: candidate's probability is divided by at most a vocabulary's size (e^13) on top.
_TYPICAL_FLOOR = math.exp(-80.0)

# Mirrors llama_token_data {int32 id; float logit; float p;} (12 bytes, no padding).
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class LlamaSampler:
    """``Sampler`` over a native ``llama_sampler`` chain (+ grammar)."""

    def __init__(self, model: LlamaModel, params: SamplingParams) -> None:
        if params.grammar is not None and not params.grammar.strip():
            raise GrammarError("empty grammar", param="grammar")
        _checks.check_sampling(params)
        self._watch = trigger_watch(params)
        #: Whether the grammar holds now: always for a whole-reply grammar, from a trigger on
        #: for a lazy one.
        self._holding = self._watch is None
        self._bytes, eog = model.grammar_tokens() if self._watch is not None else ((), ())
        self._eog = np.array(eog, dtype=np.int64)
        # Control tokens a grammar must not match: their text is the grammar's, not the reply's.
        unspoken = model.unspoken_tokens() if params.grammar is not None else ()
        kept = frozenset(params.preserved_tokens)
        self._unspoken = np.array([t for t in unspoken if t not in kept], dtype=np.int64)
        lib = model._lib
        self._lib = lib
        self._model = model
        self._params = params
        self._n_vocab = model.n_vocab
        self._seed = params.seed if params.seed is not None else secrets.randbits(32)
        self._candidates: np.ndarray[tuple[int], np.dtype[np.void]] | None = None
        self._ctx: LlamaContext | None = None  # the last context checked (``_context``)
        model.lifetime.acquire()
        self._chain: object = None
        self._grammar: object = None
        try:
            # A dependent of the model from here (it cannot be freed meanwhile), not under its
            # lock: compiling a large grammar took ~0.3 s on a request's thread, in which the
            # model's tokenizes and the worker's sampler builds and frees would have waited.
            # The compile only reads the vocabulary.
            self._grammar = self._build_grammar(params)
            self._chain = self._build_chain(params)
        except BaseException:
            self._free_native()
            model.lifetime.release()
            raise
        self._life = Lifetime("sampler", self._free)
        # Plain greedy (no grammar, no penalties) is an argmax: numpy over the zero-copy logits
        # row is ~8x cheaper than llama_sampler_sample building a 49k-entry candidate array.
        # Both pick the first maximum; biases are added first, as in the chain.
        # So is a lazy grammar's free text (``_free_argmax``); its rows still go one by one.
        self._free_argmax = (
            params.greedy
            and params.repeat_penalty == 1.0
            and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0
        )
        self._argmax_only = self._free_argmax and params.grammar is None
        self._bias_idx = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        self._bias_set = frozenset(t for t, _ in params.logit_bias)
        # Added biases, and banned tokens (-inf), which are set rather than added: a +inf
        # logit plus -inf is NaN, and an argmax picks a NaN, so the banned token would win.
        added = [(t, b) for t, b in params.logit_bias if b != -np.inf]
        self._add_idx = np.array([t for t, _ in added], dtype=np.int64)
        self._add_val = np.array([b for _, b in added], dtype=np.float32)
        self._ban_idx = np.array([t for t, b in params.logit_bias if b == -np.inf], dtype=np.int64)
        self._bias_nonpositive = all(b <= 0 for _, b in params.logit_bias)

    def _build_grammar(self, params: SamplingParams) -> object:
        if params.grammar is None:
            return None
        if "\0" in params.grammar or "\0" in params.grammar_root:
            # A C string ends at the first NUL: llama.cpp would compile the grammar's head only.
            raise GrammarError("the grammar contains a NUL character", param="grammar")
        check_grammar_safe(params.grammar)  # a grammar llama.cpp would crash or hang on
        lib = self._lib
        grammar = lib.llama_sampler_init_grammar(
            self._model.vocab,
            encode_utf8(params.grammar, param="grammar"),
            encode_utf8(params.grammar_root, param="grammar"),
        )
        if not grammar:
            raise GrammarError("the grammar does not compile (see the log)", param="grammar")
        return grammar

    def _build_chain(self, params: SamplingParams) -> object:
        lib = self._lib
        cparams = lib.llama_sampler_chain_default_params()
        cparams.no_perf = True
        chain = lib.llama_sampler_chain_init(cparams)
        if not chain:
            raise NoLogitsError("llama.cpp could not allocate a sampler chain")
        self._chain = chain  # owned from here on, so _free_native frees it on a later failure
        if params.logit_bias:
            # First, on the raw logits, as llama-server's chain (and the stub's) adds them: a
            # penalty then scales the biased logit (found by review: it came after them).
            self._add(self._logit_bias(params.logit_bias))
        last_n = params.repeat_last_n if params.repeat_last_n >= 0 else self._model_ctx_train()
        if last_n and (
            params.repeat_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
        ):
            # The pinned binding (0.3.36) and its llama.h take n_vocab first; the stub cannot
            # catch a mismatch here, the contract suite's per-option cases on llama_cpp do.
            self._add(
                lib.llama_sampler_init_penalties(
                    self._n_vocab, last_n, params.repeat_penalty, params.frequency_penalty,
                    params.presence_penalty,
                )
            )  # fmt: skip
        if params.greedy:
            self._add(lib.llama_sampler_init_greedy())
            return chain
        if params.top_k > 0:
            self._add(lib.llama_sampler_init_top_k(params.top_k))
        if params.typical_p < 1.0:
            # llama.cpp's typical sums -p log p over the candidates: one of probability 0 (a
            # ban's or a grammar's -inf, a logit 104 below the best) makes the entropy NaN,
            # and it then kept every candidate (typical_p 0.5 sampled all of four tokens where
            # two are typical; found by review). Those candidates go first: ones this far
            # below the best keep a probability above 0, and those dropped weigh under e^-80.
            self._add(lib.llama_sampler_init_min_p(_TYPICAL_FLOOR, 1))
            self._add(lib.llama_sampler_init_typical(params.typical_p, 1))
        if params.top_p < 1.0:
            self._add(lib.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            self._add(lib.llama_sampler_init_min_p(params.min_p, 1))
        self._add(lib.llama_sampler_init_temp(params.temperature))
        self._add(lib.llama_sampler_init_dist(self._seed))
        return chain

    def _logit_bias(self, biases: tuple[tuple[int, float], ...]) -> object:
        lib = self._lib
        arr = (lib.llama_logit_bias * len(biases))()
        for i, (token, bias) in enumerate(biases):
            if not 0 <= token < self._n_vocab:
                raise InvalidRequestError(
                    f"logit_bias token {token} outside [0, {self._n_vocab})", param="logit_bias"
                )
            arr[i].token = token
            arr[i].bias = bias
        # llama.cpp copies the array into the sampler, so ``arr`` may die after this call.
        return lib.llama_sampler_init_logit_bias(self._n_vocab, len(biases), arr)

    def _model_ctx_train(self) -> int:
        return int(self._lib.llama_model_n_ctx_train(self._model.native))

    def _add(self, sampler: object) -> None:
        if not sampler:
            raise InvalidRequestError("llama.cpp rejected a sampler parameter")
        # The chain takes ownership: freeing the chain frees the sampler.
        self._lib.llama_sampler_chain_add(self._chain, sampler)

    # -- Sampler protocol ---------------------------------------------------------------------

    def sample(self, ctx: BackendContext, index: int) -> int:
        with self._life.using():
            llama = self._context(ctx)
            row = np.frombuffer(llama.logits(index), dtype=np.float32)
            if self._argmax_only:
                return self._argmax(row)
            if self._free_argmax and not self._holding:
                return self._watch_for_trigger(self._argmax(row))
            _finite_or_inf(row)
            if self._grammar is None or not self._holding:
                token = llama.sample_with(self._chain, index)
                if not 0 <= token < self._n_vocab:
                    raise NoLogitsError(f"llama_sampler_sample returned token {token}")
                return self._watch_for_trigger(token)
            return self._choose(row)

    def argmax_rows(self, ctx: BackendContext, first: int, count: int) -> list[int] | None:
        """Plain greedy's tokens for batch rows ``first .. first + count - 1`` at once (one
        numpy pass over a 2-D view: a verify pass's rows), each exactly what ``sample`` would
        return for its row; -1 for a row with NaN logits (``sample`` raises there, and only
        a row the caller reaches fails it). None for any other sampler, whose rows must be
        sampled one by one, in order, through its state."""
        if not self._argmax_only:
            return None
        with self._life.using():
            block = self._context(ctx).logits_block(first, count)
            rows = np.frombuffer(block, dtype=np.float32).reshape(count, self._n_vocab)
            # argmax returns a row's first NaN where it has one: one gather finds them all.
            best = rows.argmax(axis=1)
            nan = np.isnan(rows[np.arange(count), best])
            if self._bias_idx.size:
                best = self._biased(rows).argmax(axis=1)
            best[nan] = -1
            return cast(list[int], best.tolist())

    def _context(self, ctx: BackendContext) -> LlamaContext:
        """``ctx``, checked to be a llama.cpp context of this sampler's model (once: the
        last one checked is remembered, and a context's model never changes)."""
        bound = self._ctx
        if bound is not None and ctx is bound:
            return bound
        from kvwarm.backends.llama.context import LlamaContext

        if not isinstance(ctx, LlamaContext) or ctx.model is not self._model:
            raise InvalidRequestError("the context belongs to another model")
        self._ctx = ctx
        return ctx

    def sample_logits(self, logits: bytes | memoryview) -> int:
        with self._life.using():
            row = _checks.logits_row(logits, self._n_vocab)
            if self._argmax_only:
                # A row's stored logits (an exact hit): no 262k-entry candidate array either.
                return self._argmax(row)
            if self._free_argmax and not self._holding:
                return self._watch_for_trigger(self._argmax(row))
            _finite_or_inf(row)
            return self._choose(row)

    def accept(self, token: int) -> None:
        with self._life.using():
            if not 0 <= token < self._n_vocab:
                raise InvalidRequestError(
                    f"token id {token} outside [0, {self._n_vocab})", param="tokens"
                )
            self._lib.llama_sampler_accept(self._chain, token)

    def reset(self) -> None:
        with self._life.using():
            self._lib.llama_sampler_reset(self._chain)
            if self._grammar is not None:
                self._lib.llama_sampler_reset(self._grammar)
            if self._watch is not None:
                self._watch.restart()
                self._holding = False

    def close(self) -> None:
        self._life.close()

    # -- internals ----------------------------------------------------------------------------

    def _argmax(self, row: np.ndarray[tuple[int], np.dtype[np.float32]]) -> int:
        """Plain greedy: the first maximum, after the logit biases (as the chain applies them).
        numpy's argmax returns the index of the first NaN where there is one, so one pass
        both picks the token and finds NaN logits (``BackendError``)."""
        best = int(row.argmax())
        if row[best] != row[best]:
            raise BackendError(_NAN)
        if not self._bias_idx.size or (self._bias_nonpositive and best not in self._bias_set):
            # Lowering other tokens cannot displace an unbiased maximum.
            return best
        return int(self._biased(row).argmax())

    def _biased(self, rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """A copy of ``rows`` (one row, or a verify pass's rows) with the logit biases
        added, and each banned token -inf whatever its logit, +inf included."""
        biased = rows.copy()
        biased[..., self._add_idx] += self._add_val
        biased[..., self._ban_idx] = -np.inf
        return biased

    def _candidates_of(self, logits: np.ndarray[tuple[int], np.dtype[np.float32]]) -> Any:
        """Every token with its logit, as llama.cpp's samplers take them."""
        if self._candidates is None:
            self._candidates = np.zeros(self._n_vocab, dtype=_TOKEN_DATA)
        cand = self._candidates
        cand["id"] = np.arange(self._n_vocab, dtype=np.int32)
        cand["logit"] = logits
        cand["p"] = 0.0
        return self._lib.llama_token_data_array(
            data=ctypes.cast(ctypes.c_void_p(cand.ctypes.data), self._lib.llama_token_data_p),
            size=self._n_vocab,
            selected=-1,
            sorted=False,
        )

    def _choose(self, logits: np.ndarray[tuple[int], np.dtype[np.float32]]) -> int:
        """Grammar → chain over an explicit candidate array; accept the chosen token."""
        lib = self._lib
        arr = self._candidates_of(logits)
        ref = ctypes.byref(arr)
        held = self._grammar is not None and self._holding
        if held:
            # This thread's CPU time, not the wall's: on a starved CPU (other models and
            # processes decoding) a legitimate step must not read as a slow one (found by
            # review). The grammar's work runs natively on this thread.
            start = time.thread_time()
            lib.llama_sampler_apply(self._grammar, ref)
            spent = time.thread_time() - start
            if spent > GRAMMAR_TOKEN_BUDGET_S:
                # A grammar ambiguous in a way ``grammar_cost`` does not weigh: its next
                # tokens would cost more (found by a grammar fuzz in review: 0.9, 2.1, 4.7 s).
                raise GrammarError(
                    f"the grammar took {spent:.1f} s to weigh one token, more than the "
                    f"{GRAMMAR_TOKEN_BUDGET_S:g} s allowed: it is too ambiguous for llama.cpp's "
                    "grammar engine (repeats of repeats, recursion inside repeats); simplify it",
                    param="grammar",
                )
            if self._unspoken.size:
                # llama.cpp's grammar reads a control token as its special text, which a
                # reply leaves out: under root ::= "<|im_start|>" "x" the reply was "x"
                # (found by review). The candidates are in id order; the grammar only masks.
                self._view(arr)["logit"][self._unspoken] = -np.inf
            if not np.isfinite(self._view(arr)["logit"]).any():
                raise GrammarError("the grammar admits no further token", param="grammar")
            if self._watch is not None and not self._params.grammar_once and self._done(arr):
                # A lazy grammar's text is complete: it lets go, and this token is free.
                self._let_go()
                held = False
                arr = self._candidates_of(logits)
                ref = ctypes.byref(arr)
        lib.llama_sampler_apply(self._chain, ref)
        selected = int(arr.selected)
        view = self._view(arr)
        if not 0 <= selected < view.size:
            raise NoLogitsError("the sampler chain selected no token")
        token = int(view["id"][selected])
        if not 0 <= token < self._n_vocab or not np.isfinite(view["logit"][selected]):
            # The grammar left tokens (checked above), and the chain's biases took them all:
            # say so, not that the sampler broke the grammar (found by review).
            raise GrammarError(
                "every token the grammar allows here is banned: a logit_bias of -inf, or "
                "ignore_eos where the grammar's text is complete (it admits only an end of "
                "generation)",
                param="grammar",
            )
        if held:
            lib.llama_sampler_accept(self._grammar, token)
        lib.llama_sampler_accept(self._chain, token)
        return token if held else self._watch_for_trigger(token)

    # -- a lazy grammar -----------------------------------------------------------------------

    def _done(self, arr: object) -> bool:
        """Whether the grammar's text is complete: it admits an end-of-generation token (the
        candidates are in id order, the grammar only masks them)."""
        logits = self._view(arr)["logit"]
        return bool(self._eog.size) and bool(np.isfinite(logits[self._eog]).any())

    def _let_go(self) -> None:
        assert self._watch is not None
        self._lib.llama_sampler_reset(self._grammar)
        self._watch.clear()
        self._holding = False

    def _watch_for_trigger(self, token: int) -> int:
        """``token``, a free one of a lazy grammar's reply (or of a reply without a grammar):
        the grammar starts where it completes a trigger, if the grammar accepts the text from
        the trigger on."""
        watch = self._watch
        if watch is None or self._model.is_eog(token):
            return token
        start = watch.feed(self._model.token_to_piece(token, special=True))
        while start is not None:
            if self._start_with(start):
                self._holding = True
                break
            log.debug("a lazy grammar refused its start %r: the reply stays free", start[:64])
            self._lib.llama_sampler_reset(self._grammar)
            start = watch.refused(start)  # the token's text after it may hold another
        return token

    def _start_with(self, text: bytes) -> bool:
        """Feed ``text`` to the (reset) grammar a byte at a time, each byte's token checked by
        the grammar before it is accepted (accepting a refused one aborts the process); False
        at the first it refuses, or a byte no token spells alone."""
        lib = self._lib
        lib.llama_sampler_reset(self._grammar)
        one = np.zeros(1, dtype=_TOKEN_DATA)
        for byte in text:
            token = self._bytes[byte]
            if token is None:
                return False
            one["id"], one["logit"], one["p"] = token, 0.0, 0.0
            arr = lib.llama_token_data_array(
                data=ctypes.cast(ctypes.c_void_p(one.ctypes.data), lib.llama_token_data_p),
                size=1,
                selected=-1,
                sorted=False,
            )
            lib.llama_sampler_apply(self._grammar, ctypes.byref(arr))
            if int(arr.size) != 1 or not np.isfinite(one["logit"][0]):
                return False
            lib.llama_sampler_accept(self._grammar, token)
        return True

    def _view(self, arr: object) -> np.ndarray[tuple[int], np.dtype[np.void]]:
        """The candidates as they are now: samplers may move ``data`` and shrink ``size``."""
        size = int(arr.size)  # type: ignore[attr-defined]
        address = ctypes.cast(arr.data, ctypes.c_void_p).value  # type: ignore[attr-defined]
        if not size or not address:
            return np.zeros(0, dtype=_TOKEN_DATA)
        buffer = (ctypes.c_uint8 * (size * _TOKEN_DATA.itemsize)).from_address(address)
        return np.frombuffer(memoryview(buffer).cast("B"), dtype=_TOKEN_DATA)

    def _free_native(self) -> None:
        if self._chain:
            self._lib.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar:
            self._lib.llama_sampler_free(self._grammar)
            self._grammar = None

    def _free(self) -> None:
        self._free_native()
        self._model.lifetime.release()


_NAN = (
    "the model computed NaN logits, so no token can be sampled: its weights or its "
    "adapters overflow (is a LoRA scale far too large?)"
)


def _finite_or_inf(row: np.ndarray[tuple[int], np.dtype[np.float32]]) -> None:
    """``BackendError`` if the model computed NaN logits (weights or an adapter that overflow:
    a LoRA scale of 1e30 does it): every sampler would then pick an arbitrary token and report
    NaN logprobs, so the request fails instead. One reduction: a max is NaN where any value
    is (plain greedy needs not even that: ``_argmax``)."""
    if np.isnan(row.max()):
        raise BackendError(_NAN)
