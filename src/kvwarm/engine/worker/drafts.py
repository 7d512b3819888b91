"""Drafts for speculative decoding: the tokens a request's own text (its prompt and its reply so
far) suggests come next, and how many of them are worth a verify pass.

A slot that speculates puts its next token and a draft of ``k`` more into one forward pass
(``tick``); the model's logits at each of those ``k + 1`` positions are then sampled in order,
exactly as plain decoding would, and the draft is kept up to its first token that differs from
what was sampled (``sampling.Sampling.on_verify``). So a draft is only a guess: a wrong one
costs the extra positions of one pass, never a different output. Here:

- ``NgramIndex``: where each n-gram of a growing token list last occurred, one dict entry per
  position (built once per request from its prompt, then a few entries per generated token).
- ``Drafter``: one request's drafts, by its ``SpecType``. "ngram-simple" proposes what followed
  the latest earlier occurrence of the last ``n`` tokens (llama-server's ``ngram-simple``, which
  scans backwards for the same thing); "ngram-map-k" does the same lookup but caps each n-gram's
  next draft at one more token than were accepted of its last (llama-server's ``ngram-map-k``
  caps it at exactly that many, which mutes a key for good once one draft of it fails).
- ``DraftBudget``: how long a draft is worth making. With a per-token acceptance ``a`` (counted
  from this request's verify passes, older ones weighing less) a draft of ``k`` yields
  ``1 + a + ... + a**k`` tokens for a pass that costs ``1 + c*k`` single-token decodes, so the
  ``k`` that maximises their ratio is drafted; ``k = 0`` (plain decoding) whenever no length
  pays. That is how a prompt with nothing to copy costs what plain decoding does: no match, no
  draft; matches that keep failing drive ``a`` down until drafting stops.
- ``PassCost``: ``c``, measured: each verify pass against the plain passes just before it,
  so the trade-off follows the hardware (a GPU verifies 16 tokens for little more than one;
  a CPU does not) and not another process's load.

Invariants: nothing here touches the context or the sampler; a drafter reads only its own
request's tokens (the tenant rule: ``docs/architecture.md``, "Tenants"); its memory is one dict
entry per token of the request and is freed with the request.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

from kvwarm.engine.types import SpecType

#: Per-token acceptance a new request starts from (as if one of two tokens had been accepted).
_PRIOR_ACCEPTED = 1.0
_PRIOR_REJECTED = 1.0
#: How much one verify pass's evidence fades at the next (a half-life of about 3 passes), so
#: a request that leaves a copied passage stops drafting within a few passes, and one that
#: enters another starts again.
_FADE = 0.8
#: How much the evidence fades at each match not drafted (a low acceptance then drifts back
#: to the prior, so a request whose early matches failed tries again later).
_IDLE_FADE = 0.95


class NgramIndex:
    """Where each ``n``-gram of a growing token list last occurred."""

    __slots__ = ("_indexed", "_starts", "n", "tokens")

    def __init__(self, n: int, tokens: Sequence[int] = ()) -> None:
        if n < 1:
            raise ValueError("an n-gram has at least one token")
        self.n = n
        self.tokens: list[int] = list(tokens)
        self._starts: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in _starts

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def lookup(self) -> int | None:
        """Where the latest earlier occurrence of the list's last ``n`` tokens starts (None:
        there is none). What followed it begins at ``start + n``, at most the last token."""
        toks, n = self.tokens, self.n
        size = len(toks)
        if size <= n:
            return None
        starts = self._starts
        # Index every n-gram ending before the last token: the tail's own occurrence is not
        # an earlier one.
        for end in range(max(self._indexed, n - 1), size - 1):
            starts[tuple(toks[end - n + 1 : end + 1])] = end - n + 1
        self._indexed = max(self._indexed, size - 1)
        return starts.get(tuple(toks[size - n :]))


class DraftBudget:
    """How many tokens a draft is worth, from the acceptance this request has seen."""

    __slots__ = ("accepted", "rejected")

    def __init__(self) -> None:
        self.accepted = 0.0
        self.rejected = 0.0

    @property
    def acceptance(self) -> float:
        """The estimated chance that a drafted token is accepted (given its predecessors were)."""
        acc = self.accepted + _PRIOR_ACCEPTED
        return acc / (acc + self.rejected + _PRIOR_REJECTED)

    def length(self, limit: int, cost: float) -> int:
        """The draft length in ``[0, limit]`` with the most expected tokens per unit of pass
        cost, each extra token costing ``cost`` of a one-token pass."""
        a = self.acceptance
        best_k, best = 0, 1.0
        gain, p = 1.0, 1.0
        for k in range(1, limit + 1):
            p *= a
            gain += p
            value = gain / (1.0 + cost * k)
            if value > best:
                best_k, best = k, value
            elif p < 1e-3:
                break  # the gain has stopped growing; the cost has not
        return best_k

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify pass kept ``accepted`` of ``drafted`` tokens."""
        self.accepted = self.accepted * _FADE + accepted
        self.rejected = self.rejected * _FADE + (1.0 if accepted < drafted else 0.0)

    def skipped(self) -> None:
        """A match was found but not drafted: the evidence fades toward the prior."""
        self.accepted *= _IDLE_FADE
        self.rejected *= _IDLE_FADE


class Drafter:
    """One request's drafts (``SpecType`` "ngram-simple" or "ngram-map-k")."""

    __slots__ = ("_caps", "_fed", "_last_key", "budget", "draft_max", "index", "kind")

    def __init__(self, kind: SpecType, n: int, draft_max: int, prompt: Sequence[int]) -> None:
        if kind == "none":
            raise ValueError("a drafter needs a draft source")
        self.kind = kind
        self.draft_max = draft_max
        self.index = NgramIndex(n, prompt)
        self.budget = DraftBudget()
        self._fed = 0  # generated tokens already in the index
        self._caps: dict[tuple[int, ...], int] = {}  # ngram-map-k: key -> next draft's cap
        self._last_key: tuple[int, ...] | None = None

    def propose(self, generated: Sequence[int], limit: int, cost: float) -> list[int]:
        """A draft of at most ``limit`` tokens to follow ``generated`` (the reply so far, its
        last token the one about to be decoded); empty when nothing is worth drafting."""
        self._last_key = None
        if len(generated) > self._fed:
            self.index.extend(generated[self._fed :])
            self._fed = len(generated)
        limit = min(limit, self.draft_max)
        if limit <= 0:
            return []
        start = self.index.lookup()
        if start is None:
            return []
        toks, n = self.index.tokens, self.index.n
        limit = min(limit, len(toks) - (start + n))
        key: tuple[int, ...] | None = None
        if self.kind == "ngram-map-k":
            key = tuple(toks[len(toks) - n :])
            limit = min(limit, self._caps.get(key, limit))
        k = self.budget.length(limit, cost)
        if k == 0:
            self.budget.skipped()
            return []
        self._last_key = key
        return toks[start + n : start + n + k]

    def verified(self, drafted: int, accepted: int) -> None:
        """The draft ``propose`` made was verified: ``accepted`` of its ``drafted`` tokens
        were what the model sampled."""
        self.budget.verified(drafted, accepted)
        if self._last_key is not None:
            self._caps[self._last_key] = accepted + 1
            self._last_key = None


class PassCost:
    """What one more token in a decode pass costs, relative to a one-token pass.

    Measured in pairs, so that another process's load (the usual noise on a shared machine,
    passes slowed many times over for seconds) cancels out: a pass that verified drafts is
    compared with the median of the latest plain passes of as many slots, run moments before
    under the same load; ``(t / t_plain - 1) / drafted`` is one sample of the cost, and the
    cost is the median of the latest samples (``DEFAULT`` until there are a few)."""

    #: Until a few verify passes have been timed: a CPU-like guess.
    DEFAULT = 0.15
    _KEEP = 15  # recent plain passes per slot count, and recent cost samples
    _LOW, _HIGH = 0.005, 2.0

    __slots__ = ("_plain", "_samples")

    def __init__(self) -> None:
        self._plain: dict[int, deque[float]] = {}
        self._samples: deque[float] = deque(maxlen=self._KEEP)

    def observe(self, slots: int, drafted: int, seconds: float) -> None:
        """A decode-only pass of ``slots`` slots' next tokens and ``drafted`` draft tokens
        took ``seconds``."""
        if slots <= 0 or seconds <= 0.0:
            return
        plain = self._plain.get(slots)
        if not drafted:
            if plain is None:
                plain = self._plain[slots] = deque(maxlen=self._KEEP)
            plain.append(seconds)
            return
        if plain:
            ratio = seconds / statistics.median(plain)
            self._samples.append(min(self._HIGH, max(self._LOW, (ratio - 1.0) / drafted)))

    @property
    def cost(self) -> float:
        if len(self._samples) < 3:
            return self.DEFAULT
        return statistics.median(self._samples)
