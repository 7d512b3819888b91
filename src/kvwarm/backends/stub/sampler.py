"""The stub backend's sampler: the llama.cpp chain re-done in numpy over the stub's logits.

Invariants: deterministic for a given seed (``seed=None`` draws one from the OS); the chain
order matches llama.cpp's (logit biases → penalties → top-k → typical → top-p → min-p →
temperature → draw); a grammar
is checked for a ``root`` rule (``GrammarError`` otherwise) and *enforced* only when it is one
rule of string-literal alternatives (``root ::= "yes" | "no"``) — any other grammar is accepted
unconstrained, which is enough for engine plumbing tests and is stated here so nobody relies on
the stub for grammar semantics. A lazy grammar (``grammar_triggers``) keeps llama.cpp's
backend's rules (``backends/lazy_grammar.py``): free until a trigger, whose text a literal
grammar must accept to start, letting go once it admits end-of-generation (complete).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections import deque
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvwarm.backends import _checks
from kvwarm.backends.base import BackendContext, SamplingParams
from kvwarm.backends.grammar_cost import check_grammar_safe
from kvwarm.backends.lazy_grammar import trigger_watch
from kvwarm.backends.lifetime import Lifetime
from kvwarm.errors import GrammarError, InvalidRequestError, NoLogitsError
from kvwarm.unicode import encode_utf8

log = logging.getLogger(__name__)

_LITERAL_ALTS = re.compile(r'^\(?\s*("(?:[^"\\]|\\.)*"(?:\s*\|\s*"(?:[^"\\]|\\.)*")*)\s*\)?$')
_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')


class LiteralGrammar:
    """Output must be exactly one of ``alternatives``, then end of generation."""

    def __init__(self, alternatives: list[bytes]) -> None:
        self.alternatives = alternatives
        self.prefix = b""

    @classmethod
    def compile(cls, grammar: str, root: str) -> LiteralGrammar | None:
        rules = [line for line in grammar.splitlines() if line.strip()]
        head = re.compile(rf"^\s*{re.escape(root)}\s*::=")
        encode_utf8(grammar, param="grammar")  # as llama.cpp's backend does before compiling
        if "\0" in grammar or "\0" in root:
            raise GrammarError("the grammar contains a NUL character", param="grammar")
        check_grammar_safe(grammar)  # as llama.cpp's sampler refuses it
        if not any(head.match(line) for line in rules):
            raise GrammarError(f"grammar has no {root!r} rule", param="grammar")
        _check_references(grammar)
        if len(rules) != 1:
            return None
        body = head.sub("", rules[0]).strip()
        match = _LITERAL_ALTS.match(body)
        if match is None:
            return None
        try:
            alts = [json.loads(lit).encode() for lit in _LITERAL.findall(match.group(1))]
        except ValueError as exc:
            raise GrammarError(f"bad string literal in grammar: {exc}", param="grammar") from exc
        return cls(alts)

    def allows(self, piece: bytes, is_eog: bool) -> bool:
        if is_eog:
            return self.prefix in self.alternatives
        candidate = self.prefix + piece
        return bool(piece) and any(alt.startswith(candidate) for alt in self.alternatives)

    def accept(self, piece: bytes, is_eog: bool) -> None:
        if not is_eog:
            self.prefix += piece

    def start(self, text: bytes) -> bool:
        """Hold ``text`` already (a lazy grammar's start), if some alternative begins so."""
        self.prefix = b""
        if not any(alt.startswith(text) for alt in self.alternatives):
            return False
        self.prefix = text
        return True

    def reset(self) -> None:
        self.prefix = b""


# Rule names as llama.cpp's parser reads them: letters, digits, '-' and '_', in any order; a
# rule starts a line, which a CR ends as an LF does.
_RULE_HEAD = re.compile(r"(?:^|(?<=\r))\s*([A-Za-z0-9_-]+)\s*::=", re.MULTILINE)
# Literals, classes, comments and repetition counts ({0,4}): none of them names a rule.
_NOISE = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\r\n]*|\{[^}]*\}')
_IDENT = re.compile(r"[A-Za-z0-9_-]+")


def _check_references(grammar: str) -> None:
    """Every rule a body names is defined (as llama.cpp's parser demands)."""
    defined = set(_RULE_HEAD.findall(grammar))
    bodies = _RULE_HEAD.sub(" ", _NOISE.sub(" ", grammar))
    missing = sorted(set(_IDENT.findall(bodies)) - defined)
    if missing:
        raise GrammarError(f"grammar uses undefined rules: {', '.join(missing)}", param="grammar")


class StubSampler:
    """``Sampler`` over float32 logits; ``piece``/``is_eog`` come from the owning model."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        n_vocab: int,
        piece: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        on_free: Callable[[], None],
    ) -> None:
        _checks.check_sampling(params)
        self._params = params
        self._n_vocab = n_vocab
        self._piece = piece
        self._is_eog = is_eog
        self._grammar = (
            LiteralGrammar.compile(params.grammar, params.grammar_root)
            if params.grammar is not None
            else None
        )
        self._watch = trigger_watch(params)
        self._holding = self._watch is None  # a lazy grammar holds from a trigger on
        self._seed = params.seed if params.seed is not None else secrets.randbits(32)
        self._rng = np.random.default_rng(self._seed)
        self._history: deque[int] = deque(maxlen=max(params.repeat_last_n, 0) or None)
        for token, _ in params.logit_bias:
            if not 0 <= token < n_vocab:
                raise InvalidRequestError(
                    f"logit_bias token {token} outside [0, {n_vocab})", param="logit_bias"
                )
        self._life = Lifetime("sampler", on_free)

    def sample(self, ctx: BackendContext, index: int) -> int:
        with self._life.using():
            return self._choose(np.frombuffer(ctx.logits(index), dtype=np.float32))

    def argmax_rows(self, ctx: BackendContext, first: int, count: int) -> list[int] | None:
        p = self._params
        if not p.greedy or self._grammar is not None or p.repeat_penalty != 1.0:
            return None
        if self._watch is not None:  # a lazy grammar's state moves with each row sampled
            return None
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            return None
        with self._life.using():
            block = np.frombuffer(ctx.logits_block(first, count), dtype=np.float32)
            rows = block.reshape(count, self._n_vocab)
            # Row by row through ``_choose``, as ``sample`` does (the history it keeps
            # changes nothing without penalties): what the engine's batched path must equal.
            return [self._choose(row) for row in rows]

    def sample_logits(self, logits: bytes | memoryview) -> int:
        with self._life.using():
            return self._choose(_checks.logits_row(logits, self._n_vocab))

    def accept(self, token: int) -> None:
        with self._life.using():
            if not 0 <= token < self._n_vocab:
                raise InvalidRequestError(f"token id {token} outside [0, {self._n_vocab})")
            # History only: the grammar follows sampled output, never fed-in prompt tokens.
            self._remember(token)

    def reset(self) -> None:
        with self._life.using():
            self._rng = np.random.default_rng(self._seed)
            self._history.clear()
            if self._grammar is not None:
                self._grammar.reset()
            if self._watch is not None:
                self._watch.restart()
                self._holding = False

    def close(self) -> None:
        self._life.close()

    def _remember(self, token: int) -> None:
        if self._params.repeat_last_n != 0:
            self._history.append(token)

    def _choose(self, raw: npt.NDArray[np.float32]) -> int:
        logits = raw.astype(np.float64, copy=True)
        for token, bias in self._params.logit_bias:
            logits[token] += bias
        self._apply_penalties(logits)
        grammar = self._grammar if self._holding else None
        if grammar is not None:
            free = logits.copy()
            for tok in range(self._n_vocab):
                if not grammar.allows(self._piece(tok), self._is_eog(tok)):
                    logits[tok] = -np.inf
            if not np.isfinite(logits).any():
                raise GrammarError("the grammar admits no further token", param="grammar")
            admitted = np.flatnonzero(np.isfinite(logits))
            if (
                self._watch is not None
                and not self._params.grammar_once
                and any(self._is_eog(int(t)) for t in admitted)
            ):
                grammar.reset()  # complete: a lazy grammar lets go, and this token is free
                self._watch.clear()
                self._holding, grammar, logits = False, None, free
        token = self._draw(logits)
        if grammar is not None:
            grammar.accept(self._piece(token), self._is_eog(token))
        elif self._watch is not None and not self._is_eog(token):
            start = self._watch.feed(self._piece(token))
            while start is not None and self._grammar is not None:
                self._holding = self._grammar.start(start)
                if self._holding:
                    break
                start = self._watch.refused(start)  # the token's text after it may hold another
        self._remember(token)
        return token

    def _apply_penalties(self, logits: npt.NDArray[np.float64]) -> None:
        p = self._params
        if not self._history or (
            p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
        ):
            return
        counts = np.bincount(np.fromiter(self._history, dtype=np.int64), minlength=self._n_vocab)
        seen = counts > 0
        if p.repeat_penalty != 1.0:
            pos = seen & (logits > 0)
            logits[pos] /= p.repeat_penalty
            logits[seen & ~pos] *= p.repeat_penalty
        logits -= counts * p.frequency_penalty + seen * p.presence_penalty

    def _draw(self, logits: npt.NDArray[np.float64]) -> int:
        p = self._params
        if p.greedy:
            return int(np.argmax(logits))
        order = np.argsort(-logits, kind="stable")
        if p.top_k > 0:
            order = order[: p.top_k]
        kept = logits[order]
        probs = _softmax(kept)
        if p.typical_p < 1.0:
            # llama.cpp's: the tokens whose surprise is nearest the entropy, until their
            # probabilities reach typical_p (at least one kept), then back in logit order.
            with np.errstate(divide="ignore", invalid="ignore"):
                surprise = -np.log(probs)
                entropy = float(np.nansum(probs * surprise))
            near = np.argsort(np.abs(surprise - entropy), kind="stable")
            cut = int(np.searchsorted(np.cumsum(probs[near]), p.typical_p, side="right") + 1)
            keep = np.sort(near[:cut])
            order, kept = order[keep], kept[keep]
            probs = _softmax(kept)
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order, kept = order[:cut], kept[:cut]
            probs = _softmax(kept)
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            order, kept = order[keep], kept[keep]
        probs = _softmax(kept / p.temperature)
        if not np.isfinite(probs).all():
            raise NoLogitsError("no finite logits to sample from")
        return int(order[self._rng.choice(len(order), p=probs)])


def _softmax(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    finite = np.isfinite(x)
    out = np.zeros_like(x)
    if not finite.any():
        return out + np.nan
    shifted = np.exp(x[finite] - x[finite].max())
    out[finite] = shifted / shifted.sum()
    return out
