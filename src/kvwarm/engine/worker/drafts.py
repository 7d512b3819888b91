"""Drafts for speculative decoding: the tokens a request's own text (its prompt and its reply so
far) suggests come next, and how many of them are worth a verify pass.

A slot that speculates puts its next token and a draft of ``k`` more into one forward pass
(``tick``); the model's logits at each of those ``k + 1`` positions are then sampled in order,
exactly as plain decoding would, and the draft is kept up to its first token that differs from
what was sampled (``sampling.Sampling.on_verify``). So a draft is only a guess: a wrong one
costs the extra positions of one pass, never a different output. Here:

- ``NgramIndex``: where each n-gram of a growing token list occurred, one list item per
  position (built once per request from its prompt, then a few entries per generated token).
- ``Drafter``: one request's drafts, by its ``SpecType``. "ngram-simple" proposes what followed
  an earlier occurrence of the last ``n`` tokens, the one matching most of the text before
  them (llama-server's ``ngram-simple`` scans backwards for the latest); "ngram-map-k" does
  the same lookup but caps each n-gram's next draft at one more token than were accepted of
  its last (llama-server's ``ngram-map-k`` caps it at exactly that many, which mutes a key for
  good once one draft of it fails);
  "ngram-mod" chains each token from the n before it; "ngram-map-k4v" drafts a key's most
  frequent continuation where it dominates; "ngram-cache" drafts each token from next-token
  counts of the last 1- to 4-grams (``NgramCounts``), the request's, then its tenant's rows'.
- ``DraftBudget``: how long a draft is worth making. With a per-token acceptance ``a`` (counted
  from this request's verify passes, older ones weighing less) a draft of ``k`` yields
  ``1 + a + ... + a**k`` tokens for a pass that costs ``1 + f + c*k`` one-token passes, so
  the ``k`` that maximises their ratio is drafted; ``k = 0`` (plain decoding) whenever no
  length pays. That is how a prompt with nothing to copy costs what plain decoding does: no
  match, no draft; matches that keep failing drive ``a`` down until drafting stops.
- ``SentenceEnds``, ``CopyEnds``: where a draft crosses a sentence end, and how often this
  model's copies went on past one (a reply that quotes one sentence ends there; a draft that
  runs on wastes its tail), learned from verify passes and weighed into ``DraftBudget``.
- ``PassCost``: ``f`` and ``c`` (``Cost``), measured: each verify pass against the plain
  passes just before it, so the trade-off follows the hardware (a GPU verifies 16 tokens for
  little more than one; a CPU pays for the first drafted token what a whole pass costs) and
  not another process's load.
- ``DraftCost``: what a draft model's pass costs in the model's one-token passes, measured
  the same way: a draft model's draft of ``k`` tokens costs ``k`` of them besides its verify
  pass, and is priced by both.

Invariants: nothing here touches the context or the sampler; a drafter reads only its own
request's tokens and its own tenant's rows (the tenant rule: ``docs/architecture.md``,
"Tenants"); its memory is a few dict entries per token of the request and is freed with the
request.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvwarm.cache.types import Namespace, RowInfo
from kvwarm.engine.types import SpecType
from kvwarm.tokens import is_span_id


@dataclass(frozen=True, slots=True)
class RowMatch:
    """Where a request's last ``n`` tokens occur in a cached row (``RowDrafts.matches``): the
    row's tokens, where what followed them begins (``seq[at:]``), how many of the request's
    last tokens the row has there too (at most ``MATCH_MAX``), and whether the row begins with
    all of the request's text (a retry of the same request). ``predicted``: the row is the
    request's prediction (``Predicted``), the client's word, not an earlier reply."""

    seq: tuple[int, ...]
    at: int
    matched: int
    whole: bool
    predicted: bool = False


#: A request's second source of drafts: its text (prompt and reply so far) to where its last
#: ``n`` tokens occur in the cached rows of its namespace (``RowDrafts.matches``), the longest
#: match first.
Elsewhere = Callable[[Sequence[int]], list[RowMatch]]

#: How many of an n-gram's latest occurrences ``NgramIndex.lookup`` compares.
CANDIDATES = 8
#: Most tokens a match is followed backwards (``match_length``): enough to tell a copy from a
#: common phrase.
MATCH_MAX = 64
#: What the per-token acceptance starts from, before this request's verify passes say more, is
#: ``match_prior`` of how long the match is, worth ``_PRIOR_WEIGHT`` tokens of evidence. A
#: match of a few tokens is mostly a common phrase (a chat: "of the", ", and the"), not a copy:
#: 4 tokens give 0.73, too little to pay for a CPU's verify pass; 12 give 0.89 and 32 give 0.96,
#: which do. Inside a copy the evidence of its accepted drafts outweighs the prior, so a draft
#: resumes right after a changed word.
_PRIOR_WEIGHT = 4.0
#: The acceptance a plain budget (no match length known) assumes: that of a 13-token match.
DEFAULT_PRIOR = 0.9
#: How much one verify pass's evidence fades at the next (a half-life of about 3 passes), so
#: a request that leaves a copied passage stops drafting within a few passes, and one that
#: enters another starts again.
_FADE = 0.8
#: How much the evidence fades at each match not drafted (a low acceptance then drifts back
#: to the prior, so a request whose early matches failed tries again later).
_IDLE_FADE = 0.95
#: Most tokens a draft from a cached row takes when it is no copy of the request's own text
#: (``Drafter._copies_own``) and the row is not a retry of the whole request (nor the request's
#: prediction, ``Predicted``): another request's reply, which this one follows only as long as
#: the model happens to write the same (a chat's second story began as the first for 20
#: tokens; the 25-token draft after them was rejected outright, ~12 passes' worth of a 96-token
#: reply on 2 CPU cores). Its drafts still grow with what they keep, 8 tokens at a time.
ROW_UNSURE_MAX = 8
#: How many of a row draft's first tokens ``Drafter._copies_own`` checks.
_OWN_CHECK = 16
#: A row draft that copies the request's own text (or is a retry of it) with at least this
#: many of the request's last tokens matching the row's context is the reply an earlier request
#: gave in the same place to the same material, and is drafted as near-certain
#: (``TRUSTED_PRIOR``) while ``RowTrust`` says such drafts hold: 24 is llama-server's
#: ``ngram-mod`` context, whose pool drafts a previous reply whole on the same condition.
TRUST_CONTEXT = 24
#: The per-token acceptance a trusted row draft starts from: enough for a CPU's budget to draft
#: a reply's 48 tokens in one pass (with ``Cost(0.9, 0.42)``, 0.977, a 64-token match's, drafts
#: ~17 and ramps up over four passes).
TRUSTED_PRIOR = 0.9995


class NgramIndex:
    """Where each ``n``-gram of a growing token list last occurred."""

    __slots__ = ("_indexed", "_starts", "n", "tokens")

    def __init__(self, n: int, tokens: Sequence[int] = ()) -> None:
        if n < 1:
            raise ValueError("an n-gram has at least one token")
        self.n = n
        self.tokens: list[int] = list(tokens)
        self._starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its starts, ascending
        self._indexed = 0  # n-grams ending before this position are in _starts

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def lookup(self) -> int | None:
        """Where the earlier occurrence of the list's last ``n`` tokens that matches the most
        of the tail starts (``match_length``; of the latest ``CANDIDATES`` occurrences, the
        latest among the longest), None if there is none. What followed it begins at
        ``start + n``, at most the last token.

        The longest match, not simply the latest: a passage's "over 2,900 ... over 2,300"
        has the 4-gram "over 2," twice, and a reply quoting its first half would otherwise
        be drafted the second's continuation (measured on the quote load: two of a reply's
        drafts rejected outright, each costing a verify pass)."""
        toks, n = self.tokens, self.n
        size = len(toks)
        if size <= n:
            return None
        starts = self._starts
        # Index every n-gram ending before the last token: the tail's own occurrence is not
        # an earlier one.
        for end in range(max(self._indexed, n - 1), size - 1):
            starts.setdefault(tuple(toks[end - n + 1 : end + 1]), []).append(end - n + 1)
        self._indexed = max(self._indexed, size - 1)
        found = starts.get(tuple(toks[size - n :]))
        if not found:
            return None
        if len(found) == 1:
            return found[0]
        return max(found[-CANDIDATES:], key=lambda start: (self.match_length(start), start))

    def occurrences(self, key: tuple[int, ...]) -> Sequence[int]:
        """Every earlier start of ``key``, ascending (n-grams ending before the list's last
        token are indexed by ``lookup``)."""
        return self._starts.get(key, ())

    def next_after(self, key: tuple[int, ...]) -> int | None:
        """The token that followed the latest earlier occurrence of ``key`` (``n`` tokens;
        n-grams ending before the list's last token are indexed by ``lookup``)."""
        found = self._starts.get(key)
        return self.tokens[found[-1] + self.n] if found else None

    def match_length(self, start: int) -> int:
        """How many tokens the occurrence at ``start`` and the list's tail have in common,
        counted back from their ends (at least ``n``, at most ``MATCH_MAX``)."""
        toks = self.tokens
        a, b = start - 1, len(toks) - self.n - 1
        length = self.n
        while a >= 0 and length < MATCH_MAX and toks[a] == toks[b]:
            a, b, length = a - 1, b - 1, length + 1
        return length


#: A match whose continuation reaches the present continues as a loop (``overlapping``) once
#: its match goes back this many of the loop's periods: the text has repeated that often.
LOOP_REPEATS = 2


def overlapping(source: list[int], period: int, limit: int) -> list[int]:
    """``source`` (what followed a match, up to the text's end), continued to ``limit``
    tokens as a copy that overlaps itself (LZ77's): where the match's continuation reaches
    the present, the text since the match is the tail repeating with ``period`` (the distance
    between the two occurrences), so what follows is that repetition again. A reply caught in
    a loop (a base model's "<|im_end|>user\n" over and over) was drafted one period a pass,
    where llama-server's n-gram pools draft the loop whole (Gemma 3 270M on the JSON load:
    kvwarm 1.36x plain, llama-server's ``ngram-mod`` 2.98x). A ``source`` that stops short
    of the text's end is returned as it is. ``Drafter`` drafts it only once the match goes
    back ``LOOP_REPEATS`` periods, by a budget of its own (``Drafter.loop_budget``)."""
    if period <= 0 or len(source) != period or len(source) >= limit:
        return source
    out = list(source)
    while len(out) < limit:
        out.append(out[len(out) - period])
    return out


#: ngram-cache (llama.cpp's ``common/ngram-cache``): the n-gram sizes whose next-token counts
#: draft, longest first, and per size (1 .. 4) the samples and the share of them the most
#: frequent next token needs: lax for the request's own text, strict for its tenant's cached
#: rows (llama.cpp's context and dynamic caches; its thresholds).
CACHE_NGRAM_MAX = 4
_LAX = ((2, 66), (2, 50), (1, 50), (1, 50))
_STRICT = ((4, 75), (3, 66), (2, 66), (2, 66))
#: A next-token count of an n-gram (``NgramCounts``): token -> times it followed.
Counts = dict[int, int]
#: Most tokens of one namespace's rows counted for ngram-cache, and of all namespaces'
#: together (an n-gram's counts cost about 300 bytes, four per token: ~40 MB).
COUNT_TOKENS_MAX = 1 << 15


class NgramCounts:
    """How often each token followed each 1- to 4-gram of a growing token list (llama.cpp's
    ``common_ngram_cache``)."""

    __slots__ = ("_fed", "counts")

    def __init__(self) -> None:
        self.counts: dict[tuple[int, ...], Counts] = {}
        self._fed = 0  # tokens whose predecessors are counted

    def update(self, tokens: Sequence[int]) -> None:
        """Count the tokens of ``tokens`` (the same list, grown) not yet counted."""
        counts = self.counts
        for i in range(max(self._fed, 1), len(tokens)):
            token = tokens[i]
            for size in range(1, min(CACHE_NGRAM_MAX, i) + 1):
                part = counts.setdefault(tuple(tokens[i - size : i]), {})
                part[token] = part.get(token, 0) + 1
        self._fed = max(self._fed, len(tokens))


def pick_next(
    counts: Callable[[tuple[int, ...]], Counts | None],
    text: Sequence[int],
    thresholds: tuple[tuple[int, int], ...],
) -> tuple[int, int] | None:
    """ngram-cache's next token after ``text``: the most frequent follower of its longest
    last n-gram (4 down to 1) whose counts pass ``thresholds``, and that n-gram's size."""
    for size in range(min(CACHE_NGRAM_MAX, len(text)), 0, -1):
        part = counts(tuple(text[len(text) - size :]))
        if not part:
            continue
        token, best = max(part.items(), key=lambda item: item[1])
        total = sum(part.values())
        need, percent = thresholds[size - 1]
        if total >= need and 100 * best >= percent * total:
            return token, size
    return None


def match_prior(length: int) -> float:
    """The per-token acceptance a draft from a match of ``length`` tokens starts from."""
    return length / (length + 1.5)


class DraftBudget:
    """How many tokens a draft is worth, from the acceptance this request has seen."""

    __slots__ = ("accepted", "rejected")

    def __init__(self) -> None:
        self.accepted = 0.0
        self.rejected = 0.0

    def acceptance(self, prior: float = DEFAULT_PRIOR) -> float:
        """The estimated chance that a drafted token is accepted (given its predecessors were),
        from this request's evidence over ``prior`` (``match_prior``)."""
        acc = self.accepted + _PRIOR_WEIGHT * prior
        return acc / (self.accepted + self.rejected + _PRIOR_WEIGHT)

    def length(
        self,
        limit: int,
        cost: Cost,
        prior: float = DEFAULT_PRIOR,
        breaks: Sequence[int] = (),
        through: float = 1.0,
        end: bool = False,
    ) -> int:
        """The draft length in ``[0, limit]`` with the most expected tokens per unit of pass
        cost (``Cost``: in one-token passes). ``breaks``: the draft positions (0-based) that
        follow a sentence end, where a copy goes on only with probability ``through``
        (``CopyEnds``). ``end``: the request stops ``limit`` tokens after this pass's first
        (its ``max_tokens``, its window), so a draft a few tokens short of it leaves them to a
        pass of their own: it is drafted to the end where that costs less per token than this
        pass and that one together."""
        a = self.acceptance(prior)
        best_k, best, best_gain, best_p = 0, 1.0, 1.0, 1.0
        gain, p = 1.0, 1.0
        for k in range(1, limit + 1):
            p *= a * through if k - 1 in breaks else a
            gain += p
            value = gain / cost.draft(k)
            if value > best:
                best_k, best, best_gain, best_p = k, value, gain, p
            elif p < 1e-3 and not cost.split(k + 1):
                # The gain has stopped growing; the cost has not, but for the step a draft
                # past a multiple of the tile pays: the next whole tile may cost less.
                break
        if end and 0 < best_k < limit and k == limit:
            # This pass and, if it is kept whole, one more for the last limit - best_k tokens.
            rest = limit - best_k
            two = (best_gain + best_p * rest) / (cost.draft(best_k) + best_p * cost.draft(rest - 1))
            if gain / cost.draft(limit) >= two:
                return limit
        return best_k

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify pass kept ``accepted`` of ``drafted`` tokens."""
        self.accepted = self.accepted * _FADE + accepted
        self.rejected = self.rejected * _FADE + (1.0 if accepted < drafted else 0.0)

    def skipped(self) -> None:
        """A match was found but not drafted: the evidence fades toward the prior."""
        self.accepted *= _IDLE_FADE
        self.rejected *= _IDLE_FADE


#: What a piece ends with (trailing whitespace aside) when it ends a sentence.
_SENTENCE_END = (b".", b"!", b"?")


class SentenceEnds:
    """Where a draft crosses a sentence end, from the model's token pieces: after a token
    whose piece ends in ``.``, ``!`` or ``?`` when that piece ends in whitespace or the next
    token's piece starts with it ("kilometres." then " It"; not "3." then "5", nor "e.g" then
    ".,"). A quoted passage goes on past its sentence ends, but a reply that quotes one
    sentence ends at one: those are where a copy stops (``CopyEnds``)."""

    __slots__ = ("_ended", "_ends", "_opens")

    def __init__(self, pieces: Sequence[bytes]) -> None:
        ends: list[int] = []
        ended: list[int] = []
        opens: list[int] = []
        for token, piece in enumerate(pieces):
            if piece.rstrip().endswith(_SENTENCE_END):
                (ended if piece[-1:].isspace() else ends).append(token)
            if piece[:1].isspace():
                opens.append(token)
        self._ends = frozenset(ends)  # a sentence end if the next piece opens with a space
        self._ended = frozenset(ended)  # a sentence end whatever follows
        self._opens = frozenset(opens)

    def breaks(self, last: int, draft: Sequence[int]) -> list[int]:
        """The positions in ``draft`` (0-based) of tokens right after a sentence end;
        ``last`` is the token before the draft."""
        out = []
        before = last
        for i, token in enumerate(draft):
            if before in self._ended or (before in self._ends and token in self._opens):
                out.append(i)
            before = token
        return out


class FadedOdds:
    """Two outcomes counted over one model's verify passes, each count fading by
    ``_COPY_FADE`` at the next outcome (a memory of about 30), over a Beta(1, 1) prior: the
    chance of the first outcome starts at one half and follows what the model's requests
    keep doing."""

    __slots__ = ("no", "yes")

    def __init__(self) -> None:
        self.yes = 0.0
        self.no = 0.0

    @property
    def chance(self) -> float:
        return (self.yes + 1.0) / (self.yes + self.no + 2.0)

    def observe(self, yes: bool) -> None:
        self.yes = self.yes * _COPY_FADE + (1.0 if yes else 0.0)
        self.no = self.no * _COPY_FADE + (0.0 if yes else 1.0)


#: How much one outcome fades at the next (``FadedOdds``).
_COPY_FADE = 0.97


class CopyEnds(FadedOdds):
    """How often a copy that reached a sentence end went on past it, over one model's verify
    passes (``FadedOdds``), so a load whose replies each quote a sentence learns within a
    reply or two to stop its drafts there, and one that copies whole passages learns to go
    on."""

    __slots__ = ()

    @property
    def through(self) -> float:
        """The chance that a copy goes on past a sentence end it has reached."""
        return self.chance


class RowTrust(FadedOdds):
    """How often a row draft that may be trusted (``TRUST_CONTEXT``) was kept whole, over one
    model's verify passes (``FadedOdds``). Such drafts are trusted (``TRUSTED_PRIOR``) while
    at least half hold: a load that asks again of the same material (a JSON document
    rewritten, a passage quoted) drafts an earlier reply whole from the first, and one whose
    requests change what they ask of it (another key to rename, before the same document)
    stops after a draft or two that failed, its row drafts then ramping with their evidence
    like any other's, whose outcomes still count here."""

    __slots__ = ()

    @property
    def trusted(self) -> bool:
        return self.chance >= 0.5


@dataclass(slots=True, eq=False)
class _KeyValues:
    """ngram-map-k4v: the continuations (values) counted after one key n-gram."""

    counted: int = 0  # the key's occurrences counted so far
    #: value (its ``m`` tokens) -> [times it followed the key, its latest start, draft cap]
    values: dict[tuple[int, ...], list[int]] = field(default_factory=dict)


#: ngram-map-k4v: most distinct values counted per key (llama.cpp's
#: ``COMMON_NGRAM_MAX_VALUES``); a fifth is not counted.
K4V_VALUES = 4


class Drafter:
    """One request's drafts, by its n-gram ``SpecType``."""

    __slots__ = (
        "_breaks", "_caps", "_counts", "_cut", "_fed", "_last_key", "_last_value", "_looping",
        "_parted", "_prompt", "_replays", "_row_counts", "_synced", "_trusting", "_values",
        "budget", "copy_ends", "draft_max", "elsewhere", "index", "kind", "loop_budget",
        "row_trust", "sentence_ends",
    )  # fmt: skip

    def __init__(
        self,
        kind: SpecType,
        n: int,
        draft_max: int,
        prompt: Sequence[int],
        elsewhere: Elsewhere | None = None,
        row_counts: Callable[[tuple[int, ...]], Counts | None] | None = None,
        sentence_ends: SentenceEnds | None = None,
        copy_ends: CopyEnds | None = None,
        row_trust: RowTrust | None = None,
    ) -> None:
        if kind in ("none", "draft-simple"):
            raise ValueError("an n-gram drafter needs an n-gram draft source")
        self.kind = kind
        self.draft_max = draft_max
        #: The cached rows of the request's namespace: asked while no row replays (below).
        self.elsewhere = elsewhere
        #: The rows that replay this request (``_follow_rows``): each one's tokens, where its
        #: next token is, how much of the request's text it matched and whether it begins
        #: with all of it, and whether it is the request's prediction; the length of the text
        #: they are aligned with; the prompt's length; and whether some of them parted from
        #: the request's text while others went on.
        self._replays: list[tuple[tuple[int, ...], int, int, bool, bool]] = []
        self._synced = 0
        self._prompt = len(prompt)
        self._parted = False
        self.index = NgramIndex(n, prompt)
        self.budget = DraftBudget()
        self._fed = 0  # generated tokens already in the index
        self._caps: dict[tuple[int, ...], int] = {}  # ngram-map-k: key -> next draft's cap
        self._last_key: tuple[int, ...] | None = None
        #: ngram-map-k4v: key -> its values; the value a draft came from (with its key).
        self._values: dict[tuple[int, ...], _KeyValues] = {}
        self._last_value: list[int] | None = None
        #: ngram-cache: the request's own next-token counts, and its tenant's rows' (strict).
        self._counts = NgramCounts() if kind == "ngram-cache" else None
        self._row_counts = row_counts
        #: Where drafts cross sentence ends, and how often the model's copies went on past
        #: one (shared by the model's requests); the last draft's crossings.
        self.sentence_ends = sentence_ends
        self.copy_ends = copy_ends
        self._breaks: list[int] = []
        #: The token the copy would have gone on with, where the last draft stopped right at a
        #: sentence end: what the model samples after that draft says whether it did.
        self._cut: int | None = None
        #: Whether trusted row drafts hold (shared by the model's requests), and whether the
        #: last draft was one that may be trusted (its outcome is then counted there).
        self.row_trust = row_trust
        self._trusting = False
        #: Drafts that continue a loop the reply is caught in (``overlapping``), and the
        #: evidence of those alone: a reply whose early copies of the prompt failed drafts
        #: nothing for a while by the main budget, while its loop is near-certain.
        self.loop_budget = DraftBudget()
        self._looping = False

    def propose(
        self, generated: Sequence[int], limit: int, cost: Cost, *, end: bool = False
    ) -> list[int]:
        """A draft of at most ``limit`` tokens to follow ``generated`` (the reply so far, its
        last token the one about to be decoded); empty when nothing is worth drafting.
        ``end``: the request stops ``limit`` tokens after the one about to be decoded
        (``DraftBudget.length``)."""
        self._last_key = self._last_value = None
        self._breaks, self._cut = [], None
        self._trusting = self._looping = False
        prior: float | None = None  # the budget's prior, when not the match length's
        if len(generated) > self._fed:
            self.index.extend(generated[self._fed :])
            self._fed = len(generated)
        if limit > self.draft_max:
            limit, end = self.draft_max, False
        if limit <= 0:
            return []
        index = self.index
        toks, n = index.tokens, index.n
        start = index.lookup()
        found = self._follow_rows() if self.kind != "ngram-cache" else None
        replay = self._replay(limit)
        own = index.match_length(start) if start is not None else 0
        if replay is not None and (replay[2] or own < TRUST_CONTEXT):
            # An earlier reply given in the same place: it wins over the request's own text
            # where it copies that text too (or is a retry), else only over a shorter match,
            # and then a few tokens at a time (``ROW_UNSURE_MAX``); it is trusted whole
            # (``RowTrust``) unless earlier replies to this place went different ways. A
            # draft only the request's prediction makes is trusted as the model's trust says,
            # and teaches it nothing: it is one client's word, and the trust every client's.
            source, matched, sure, replied = replay
            if not sure:
                source = source[:ROW_UNSURE_MAX]
            elif self.row_trust is not None:
                self._trusting = replied
                prior = TRUSTED_PRIOR if self.row_trust.trusted and not self._parted else None
        elif self.kind == "ngram-cache":
            source, matched = self._from_counts(start, limit)
        elif start is not None:
            matched = own
            if self.kind == "ngram-mod":
                source = self._chain(start, limit)
            elif self.kind == "ngram-map-k4v":
                source, matched = self._dominant(limit)
            else:
                source = toks[start + n : start + n + limit]
                period = len(toks) - start - n
                if len(source) == period < limit and matched >= LOOP_REPEATS * period:
                    source, self._looping = overlapping(source, period, limit), True
        elif found:
            best = found[0]
            source, matched = list(best.seq[best.at : best.at + limit]), best.matched
            # The request's prediction is the client's word for what the reply repeats: after
            # an edit its drafts grow with what they keep, as the request's own copies do.
            if not (best.whole or best.predicted or self._copies_own(source)):
                source = source[:ROW_UNSURE_MAX]
        else:
            return []
        # A media span's positions are no token: a draft stops before one (a prompt's or a
        # row's span ids would otherwise be proposed as tokens, which no vocabulary has).
        source = list(itertools.takewhile(lambda t: not is_span_id(t), source))
        if not source:
            self._last_value = None
            return []
        end = end and len(source) >= limit
        limit = len(source)
        key: tuple[int, ...] | None = None
        if self.kind == "ngram-map-k":
            key = tuple(toks[len(toks) - n :])
            end = end and self._caps.get(key, limit) >= limit
            limit = min(limit, self._caps.get(key, limit))
        breaks: list[int] = []
        through = 1.0
        if self.sentence_ends is not None and self.copy_ends is not None and toks:
            breaks = self.sentence_ends.breaks(toks[-1], source[:limit])
            through = self.copy_ends.through
        if prior is None:
            prior = match_prior(matched)
        budget = self.loop_budget if self._looping else self.budget
        k = budget.length(limit, cost, prior, breaks, through, end)
        if k == 0:
            budget.skipped()
            self._looping = False
            self._last_value = None
            self._trusting = False
            return []
        self._last_key = key
        self._breaks = [i for i in breaks if i < k]
        self._cut = source[k] if k in breaks else None
        return source[:k]

    def _follow_rows(self) -> list[RowMatch] | None:
        """Keep the rows that replay this request in step with its text, and where none is
        left, look its last ``n`` tokens up in the rows (returned: the matches, the longest
        first). A row replays the request where it holds the request's whole reply so far
        and at least ``TRUST_CONTEXT`` tokens of its prompt before it (or begins with all of
        its text, a retry): an earlier reply given in the same place, followed token for token
        for as long as the request writes what it holds, wherever the request's own text has
        matches too (a loop's period, a document's lines). Rows were asked only where the
        request's own text had no match, 3 or 4 times a Gemma 3 270M reply looping through
        the chat template's tags that its prompt holds too. A row that matches only the
        reply's later tokens (the request's reply went another way before) replays nothing:
        it is one more n-gram match (``propose``)."""
        toks = self.index.tokens
        new = tuple(toks[self._synced :])
        self._synced = len(toks)
        if self._replays and new:
            step = len(new)
            before = len(self._replays)
            self._replays = [
                (seq, at + step, min(MATCH_MAX, matched + step), whole, predicted)
                for seq, at, matched, whole, predicted in self._replays
                if seq[at : at + step] == new
            ]
            if 0 < len(self._replays) < before:
                # Earlier replies to this place went different ways: the request may yet
                # go a way of its own (SmolLM2's rename: two replies shared 4 tokens, the
                # one it followed 19 more, then a trusted 48-token draft kept 3).
                self._parted = True
        if self._replays or self.elsewhere is None or len(toks) < self.index.n:
            return None
        found = self.elsewhere(toks)
        need = len(toks) - self._prompt + TRUST_CONTEXT  # the reply and the context before it
        tail: tuple[int, ...] | None = None
        replays = []
        for m in found:
            if not m.whole:
                if m.matched < min(need, MATCH_MAX) or m.at < need or need > len(toks):
                    continue
                if need > m.matched:  # matched stops counting at MATCH_MAX
                    # Where the context and the reply begin first: a row that matches a long
                    # loop's later periods (each one does) fails there, not after a whole
                    # reply's comparison per candidate and token.
                    lo, at = len(toks) - need, m.at - need
                    if m.seq[at] != toks[lo] or m.seq[at + TRUST_CONTEXT] != toks[self._prompt]:
                        continue
                    tail = tail or tuple(toks[lo:])
                    if m.seq[at : m.at] != tail:
                        continue
            replays.append((m.seq, m.at, m.matched, m.whole, m.predicted))
        self._replays = replays
        self._parted = False
        return found

    def _replay(self, limit: int) -> tuple[list[int], int, bool, bool] | None:
        """What the rows that replay this request (``_follow_rows``) hold next, as far as
        they all agree (two earlier replies to the same prompt that went different ways
        draft only what they share, until the request's next tokens tell which it follows),
        at most ``limit`` tokens; the longest of their matches; and whether the draft is
        sure: a row is a retry of the whole request, or the draft copies the request's own
        text (``_copies_own``); and whether an earlier reply drafts it, not only the request's
        prediction (``RowMatch.predicted``). None where no row replays it or they agree on
        nothing."""
        replays = self._replays
        if not replays:
            return None
        seq, at, matched, whole, predicted = replays[0]
        replied = not predicted
        first = seq[at : at + limit]
        common = len(first)
        for other, other_at, other_matched, other_whole, other_predicted in replays[1:]:
            cont = other[other_at : other_at + common]
            same = 0
            while same < len(cont) and cont[same] == first[same]:
                same += 1
            common = same
            matched, whole = max(matched, other_matched), whole or other_whole
            replied = replied or not other_predicted
        if common == 0:
            return None
        source = list(first[:common])
        return source, matched, whole or self._copies_own(source), replied

    def _copies_own(self, draft: Sequence[int]) -> bool:
        """Whether at least half of the n-grams that end in the first ``_OWN_CHECK`` tokens of
        ``draft`` (a cached row's continuation) occur in the request's own text: the row's
        reply copies what this request also holds (a JSON document, a quoted passage), so the
        model, copying it here too, likely goes on as the row did."""
        index = self.index
        n = index.n
        window = [*index.tokens[len(index.tokens) - n + 1 :], *draft[:_OWN_CHECK]]
        grams = len(window) - n + 1
        found = sum(1 for i in range(grams) if index.occurrences(tuple(window[i : i + n])))
        return 2 * found >= grams

    def _dominant(self, limit: int) -> tuple[list[int], int]:
        """ngram-map-k4v: the continuation of the text's last ``n`` tokens that followed them
        most often, when it did at least twice as often as all the others together (llama.cpp's
        rule), at most one token more than were accepted of its last draft; and how long the
        match at its latest occurrence is. A value is the ``draft_max`` tokens after an
        occurrence, counted once they all precede the text's last token; at most
        ``K4V_VALUES`` distinct ones per key."""
        index = self.index
        toks, n, m = index.tokens, index.n, self.draft_max
        key = tuple(toks[len(toks) - n :])
        stats = self._values.get(key)
        if stats is None:
            stats = self._values[key] = _KeyValues()
        starts = index.occurrences(key)
        while stats.counted < len(starts) and starts[stats.counted] + n + m < len(toks):
            start = starts[stats.counted]
            stats.counted += 1
            value = tuple(toks[start + n : start + n + m])
            seen = stats.values.get(value)
            if seen is not None:
                seen[0] += 1
                seen[1] = start
            elif len(stats.values) < K4V_VALUES:
                stats.values[value] = [1, start, m]
        if not stats.values:
            return [], 0
        best = max(stats.values.values(), key=lambda seen: seen[0])
        others = sum(seen[0] for seen in stats.values.values()) - best[0]
        if others > 0 and best[0] < 2 * others:
            return [], 0  # no continuation dominates: no draft
        self._last_value = best
        start = best[1]
        return toks[start + n : start + n + min(limit, best[2])], index.match_length(start)

    def _from_counts(self, start: int | None, limit: int) -> tuple[list[int], int]:
        """ngram-cache: each drafted token the most frequent follower of the last 4, 3, 2 or
        1 tokens (the draft's included) in the request's own text, else in its tenant's
        cached rows under stricter thresholds (``pick_next``); and the match length its
        acceptance starts from: the request's own match (as ngram-simple's) when it has one,
        else the size of the n-gram that drafted the first token."""
        counts = self._counts
        assert counts is not None
        toks = self.index.tokens
        counts.update(toks)
        window = toks[len(toks) - CACHE_NGRAM_MAX :]
        draft: list[int] = []
        first = 0
        while len(draft) < limit:
            got = pick_next(counts.counts.get, window, _LAX)
            if got is None and self._row_counts is not None:
                got = pick_next(self._row_counts, window, _STRICT)
            if got is None:
                break
            draft.append(got[0])
            first = first or got[1]
            window = [*window, got[0]][-CACHE_NGRAM_MAX:]
        matched = self.index.match_length(start) if start is not None else first
        return draft, max(matched, first)

    def _chain(self, start: int, limit: int) -> list[int]:
        """ngram-mod: each drafted token is what followed the latest earlier occurrence of the
        ``n`` tokens before it (the request's text, then the draft so far), so a draft may
        pass from one earlier occurrence to another, and go on past the text's end."""
        index = self.index
        toks, n = index.tokens, index.n
        draft = [toks[start + n]]
        window = toks[len(toks) - n + 1 :] + draft
        while len(draft) < limit:
            token = index.next_after(tuple(window[len(window) - n :]))
            if token is None:
                break
            draft.append(token)
            window.append(token)
        return draft

    def verified(self, drafted: int, accepted: int, after: int | None = None) -> None:
        """The draft ``propose`` made was verified: ``accepted`` of its ``drafted`` tokens
        were what the model sampled, and ``after`` the token it sampled after them all (None
        where it sampled none: a draft token differed, or the request ran out of room)."""
        (self.loop_budget if self._looping else self.budget).verified(drafted, accepted)
        self._looping = False
        if self._trusting and self.row_trust is not None:
            self.row_trust.observe(accepted == drafted)
            self._trusting = False
        if self.copy_ends is not None:
            # Each sentence end the model's text reached: did the copy go on past it?
            for i in self._breaks:
                if accepted < i:
                    break
                self.copy_ends.observe(accepted > i)
            if self._cut is not None and accepted == drafted and after is not None:
                self.copy_ends.observe(after == self._cut)  # drafted up to the end, not past
            self._breaks, self._cut = [], None
        if self._last_key is not None:
            self._caps[self._last_key] = accepted + 1
            self._last_key = None
        if self._last_value is not None:
            self._last_value[2] = accepted + 1
            self._last_value = None


#: Most tokens of cached rows one worker indexes for drafts, over all namespaces. An indexed
#: token costs about 130 bytes (a dict entry, its keys, the row's token tuple): ~17 MB.
ROW_TOKENS_MAX = 1 << 17
_ROWS_PER_REFRESH = 64  # rows a namespace's index takes in at most, per refresh
_REFRESH_S = 1.0  # a namespace's rows are listed at most this often


@dataclass(slots=True, eq=False)
class _Rows:
    """One namespace's index: its rows' token sequences and where each n-gram occurs."""

    #: Whose rows they are (``tenants.tenant_of`` its salt; None: no key's, the shared
    #: tenant): the bound is shared fairly between tenants.
    tenant: str | None = None
    seqs: list[tuple[int, ...]] = field(default_factory=list)
    #: The keys of the cache's rows of it already looked at (indexed or not): only those
    #: the cache still lists.
    keys: set[bytes] = field(default_factory=set)
    #: hash of an n-gram -> (index into ``seqs``) << 32 | its start, or a list of the
    #: latest ``CANDIDATES`` of them, oldest first, where it occurs more than once; checked
    #: on use.
    starts: dict[int, int | list[int]] = field(default_factory=dict)
    tokens: int = 0
    refreshed: float = float("-inf")
    #: Its namespace, and when it was last drafted from (``RowDrafts._touch``: the order of
    #: ``RowDrafts._spaces``, comparable across tenants).
    ns: Namespace | None = None
    touched: int = 0
    #: ngram-cache: the next-token counts of the rows' 1- to 4-grams (``RowDrafts.counts``),
    #: made on first use; how many of ``seqs`` are in them, and their tokens.
    counts: dict[tuple[int, ...], Counts] | None = None
    counted: int = 0
    counted_tokens: int = 0


class Predicted:
    """A request's prediction (``GenerationOptions.prediction``, OpenAI's predicted outputs) as
    one more row to draft from: its prompt followed by the predicted tokens, the reply an
    earlier request would have got in the same place. While the reply is the prediction's
    first tokens, the row begins with all of the request's text, so ``Drafter`` replays it
    token for token as it does such a row (a retry's, ``Drafter._follow_rows``), trusted while
    ``RowTrust`` says such drafts hold, its own outcomes not counted there
    (``RowMatch.predicted``: one client's word, where the trust is all of the model's
    clients'); once the reply goes its own way (an edit the prediction did not have), the row
    is one more n-gram match, where what follows the reply's last ``n`` tokens in the
    prediction resumes the copy. It changes no token: every draft is verified."""

    __slots__ = ("_agreed", "_starts", "n", "seq")

    def __init__(self, n: int, prompt: Sequence[int], predicted: Sequence[int]) -> None:
        self.n = n
        self.seq = (*prompt, *predicted)
        #: How many of the first tokens of the text ``matches`` is given (the request's, which
        #: only grows) are known to be the row's; -1 once they part (``_retry``).
        self._agreed = 0
        #: n-gram -> the starts of its latest ``CANDIDATES`` occurrences, oldest first, of
        #: those followed by a predicted token: an n-gram followed by more prompt is the
        #: request's own text, which its own index (``Drafter.index``) already drafts from, so
        #: the prompt is not indexed again (it cost ~80 ms and ~30 MB on the worker thread
        #: behind a 120,000-token prompt).
        starts: dict[tuple[int, ...], list[int]] = {}
        for start in range(max(0, len(prompt) - n), len(self.seq) - n):
            found = starts.setdefault(self.seq[start : start + n], [])
            found.append(start)
            if len(found) > CANDIDATES:
                del found[0]
        self._starts = starts

    def matches(self, text: Sequence[int]) -> list[RowMatch]:
        """Where the last ``n`` tokens of ``text`` (the request's prompt and reply so far)
        occur in the row, the longest match first, the latest among equals (as
        ``RowDrafts.matches``)."""
        seq, n, size = self.seq, self.n, len(text)
        if size < n:
            return []
        found: list[tuple[int, int, RowMatch]] = []
        # The row as a retry of the request, wherever else its last n-gram occurs (the
        # latest ``CANDIDATES`` starts may all come after it, in a repetitive prediction).
        if self._retry(text):
            whole = RowMatch(seq, size, min(size, MATCH_MAX), True, True)
            found.append((whole.matched, size - n, whole))
        for start in self._starts.get(tuple(text[size - n :]), ()):
            if start == size - n and found:
                continue  # the retry's own occurrence, found above
            a, b, matched = start - 1, size - n - 1, n
            while a >= 0 and b >= 0 and matched < MATCH_MAX and seq[a] == text[b]:
                a, b, matched = a - 1, b - 1, matched + 1
            found.append((matched, start, RowMatch(seq, start + n, matched, False, True)))
        found.sort(key=lambda item: (item[0], item[1]), reverse=True)
        return [match for _, _, match in found]

    def _retry(self, text: Sequence[int]) -> bool:
        """Whether the row begins with all of ``text`` and goes on past it. ``text`` only
        grows (the request's prompt and reply so far), so what agreed before agrees still, and
        once it parts from the row it never is the row's again: each of its tokens is compared
        once. Compared whole at each call, it cost 0.6 ms a token behind a 120,000-token
        prompt (found by review), the drafter asking each token the reply does not follow
        the prediction."""
        size, agreed = len(text), self._agreed
        if agreed < 0 or size >= len(self.seq):
            return False
        if size > agreed:
            if self.seq[agreed:size] != tuple(text[agreed:size]):
                self._agreed = -1
                return False
            self._agreed = size
        return True


def with_predicted(predicted: Predicted, rows: Elsewhere | None) -> Elsewhere:
    """``rows`` (a request's matches in its namespace's cached rows) and ``predicted``'s,
    the longest first; the prediction's first among equals (the request's own)."""

    def matches(text: Sequence[int]) -> list[RowMatch]:
        found = predicted.matches(text)
        if rows is not None:
            found += rows(text)
            found.sort(key=lambda m: m.matched, reverse=True)  # stable: ties keep the order
        return found

    return matches


class RowDrafts:
    """Drafts from the cache: n-grams of the token sequences of the cached rows of each
    namespace (each one's latest ``CANDIDATES`` occurrences), for what a request's own text
    cannot suggest (the reply an earlier request of the same namespace got: a retried
    question, a file sent again; ``Drafter`` follows a row that replays the request token for
    token, ``Drafter._follow_rows``). A namespace includes
    the cache salt, so a request drafts from its own tenant's rows only
    (``docs/architecture.md``, "Tenants"); drafts change no token either way.

    Bounded: ``max_tokens`` tokens indexed over all namespaces, shared fairly between
    tenants (a namespace's tenant is its salt's key, ``tenants.tenant_of``; every namespace
    without one is one tenant's, None's): past the bound what goes is the tenant's holding
    the most, its namespace drafted from least recently dropped whole, or, its only one,
    rebuilt from its newest rows within its share (``max_tokens`` over the tenants indexed);
    and a namespace grows at most to its share or to what the other tenants leave, whichever
    is more. So one tenant's flood of rows or namespaces never takes another below its share,
    while a worker with one tenant (no keys) drops the namespace drafted from least recently,
    as a plain LRU. A namespace takes in at most ``_ROWS_PER_REFRESH``
    rows per refresh (its newest), at most once per ``_REFRESH_S``, the longest first (a row
    that is a prefix of one indexed is not kept). Tokens come from the
    cache's index (``CacheApi.row_tokens``, through the worker's cache port): no tier is read;
    and a finish save this worker makes is indexed at once (``saved``). Worker thread only."""

    def __init__(
        self,
        rows: Callable[[Namespace], list[RowInfo]],
        row_tokens: Callable[[bytes], tuple[int, ...] | None],
        n: int,
        *,
        max_tokens: int = ROW_TOKENS_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rows = rows  # a namespace's published rows (the cache port's)
        self._row_tokens = row_tokens  # a row's tokens, from the cache's index
        self.n = n
        self.max_tokens = max_tokens
        self._clock = clock
        # Every namespace, drafted from least recently first; and per tenant, its own.
        self._spaces: OrderedDict[Namespace, _Rows] = OrderedDict()
        self._of_tenant: dict[str | None, OrderedDict[Namespace, _Rows]] = {}
        # Kept as they change, so that a save or a refresh costs no pass over the namespaces
        # (found by review: three or more a save, ~4 ms with 4,000 namespaces): tokens indexed,
        # in all and per tenant holding any; per tenant, its namespaces holding any; the
        # namespaces holding none.
        self._total = 0
        self._held_by: dict[str | None, int] = {}
        self._nonempty: dict[str | None, int] = {}
        self._empties: dict[Namespace, None] = {}
        self._stamp = itertools.count()

    @property
    def tokens(self) -> int:
        """Tokens indexed, over all namespaces."""
        return self._total

    def held(self, tenant: str | None) -> int:
        """Tokens indexed of ``tenant``'s namespaces."""
        return self._held_by.get(tenant, 0)

    def _touch(self, ns: Namespace, space: _Rows) -> None:
        """``ns`` is drafted from now: last in the order of what goes first."""
        self._spaces.move_to_end(ns)
        self._of_tenant[space.tenant].move_to_end(ns)
        space.touched = next(self._stamp)

    def _new(self, ns: Namespace, tenant: str | None) -> _Rows:
        space = self._spaces[ns] = _Rows(tenant, ns=ns)
        self._of_tenant.setdefault(tenant, OrderedDict())[ns] = space
        self._empties[ns] = None
        return space

    def _drop(self, ns: Namespace) -> None:
        """Forget ``ns``'s index."""
        space = self._spaces.pop(ns)
        mine = self._of_tenant[space.tenant]
        del mine[ns]
        if not mine:
            del self._of_tenant[space.tenant]
        if space.tokens:
            self._counted(space, -space.tokens)
        else:
            del self._empties[ns]

    def _counted(self, space: _Rows, delta: int) -> None:
        """``space.tokens`` changes by ``delta``: the totals follow (not ``space`` itself)."""
        tenant, before = space.tenant, space.tokens
        after = before + delta
        self._total += delta
        held = self._held_by.get(tenant, 0) + delta
        if held:
            self._held_by[tenant] = held
        else:
            self._held_by.pop(tenant, None)
        if bool(before) != bool(after):
            assert space.ns is not None
            count = self._nonempty.get(tenant, 0) + (1 if after else -1)
            if count:
                self._nonempty[tenant] = count
            else:
                self._nonempty.pop(tenant, None)
            if after:
                self._empties.pop(space.ns, None)
            elif space.ns in self._spaces:
                self._empties[space.ns] = None

    def refresh(self, ns: Namespace, tenant: str | None = None) -> None:
        """Take in the namespace's rows not yet indexed (rate-limited). ``tenant``: whose
        namespace it is (``tenants.tenant_of`` the salt folded into it)."""
        space = self._spaces.get(ns)
        now = self._clock()
        if space is not None and now - space.refreshed < _REFRESH_S:
            self._touch(ns, space)
            return
        if space is None:
            space = self._new(ns, tenant)
        self._touch(ns, space)
        space.refreshed = now
        listed = self._rows(ns)
        # Only the keys of rows the cache still holds are remembered (their tokens may stay
        # indexed): the set of every key ever seen grew for the life of a busy namespace.
        space.keys.intersection_update(info.key for info in listed)
        infos = [info for info in listed if info.key not in space.keys]
        infos.sort(key=lambda info: info.created, reverse=True)
        fresh = sorted(infos[:_ROWS_PER_REFRESH], key=lambda info: info.n_tokens, reverse=True)
        cap = self._cap(space)  # only this namespace grows meanwhile: the others' stay
        for info in fresh:
            space.keys.add(info.key)
            tokens = self._row_tokens(info.key)
            if tokens is None or not self._make_room(space, len(tokens), cap):
                continue
            self._add(space, tokens)
        self._bound(keep=ns)

    def saved(self, ns: Namespace, tokens: Sequence[int]) -> None:
        """This worker saved a row of ``tokens`` under ``ns`` (a finish save: a reply is in
        it): indexed at once, before the save is even published."""
        space = self._spaces.get(ns)
        if space is None or not self._make_room(space, len(tokens), self._cap(space)):
            return  # a namespace nobody drafts from yet is listed from the cache when one does
        self._add(space, tuple(tokens))
        self._bound(keep=ns)

    def _cap(self, space: _Rows) -> int:
        """The most tokens ``space`` may hold: its tenant's share of the bound (the bound
        over the tenants indexed, itself included), or what the other tenants leave of it
        if that is more (the whole bound for a worker's only tenant)."""
        held = self._held_by
        others = self._total - held.get(space.tenant, 0)
        share = self.max_tokens // (len(held) + (space.tenant not in held))
        return max(share, self.max_tokens - others)

    def _make_room(self, space: _Rows, need: int, cap: int) -> bool:
        """Whether a row of ``need`` tokens fits the namespace's index within ``cap``
        (``_cap``), once its oldest rows are dropped if it would not: the index is rebuilt
        from its newest rows, up to half its cap less the new row (so a busy namespace goes
        on learning its newest replies, at the cost of one rebuild, ~16 ms for 65,000 tokens,
        per half a bound of new rows). False for a row larger than the cap."""
        if need > cap:
            return False
        if space.tokens + need <= cap:
            return True
        self._rebuild(space, cap // 2 - need)
        return True

    def _rebuild(self, space: _Rows, room: int) -> None:
        """Keep only ``space``'s newest rows that fit ``room`` tokens."""
        kept: list[tuple[int, ...]] = []
        for seq in reversed(space.seqs):
            if len(seq) > room:
                break
            kept.append(seq)
            room -= len(seq)
        self._counted(space, -space.tokens)
        space.seqs, space.starts, space.tokens = [], {}, 0
        space.counts, space.counted, space.counted_tokens = None, 0, 0
        for seq in reversed(kept):
            self._add(space, seq, compared=True)

    def _add(self, space: _Rows, tokens: tuple[int, ...], *, compared: bool = False) -> None:
        """Index a row, unless an indexed row begins with all of it (a prefix or a copy of
        one, whose occurrences in their contexts are indexed already): each of its n-grams'
        occurrences, the latest ``CANDIDATES`` of each kept. A row whose n-grams all occur in
        other rows is indexed too: the same n-grams in another context are what a replay
        follows (``Drafter._follow_rows``). A reply that copies its prompt holds no n-gram
        its prompt's row does not, and was not indexed: Gemma 3 270M's JSON rewrite, sent
        again, drafted from its own text, not from the reply it got before. Only a row all
        of whose n-grams are indexed is compared with the rows (a row beginning with it holds
        them all), and ``compared`` (a rebuild's, each compared when indexed first) none:
        every row compared with every row cost a rebuild of 12-token rows 1.15 s."""
        n, starts, size = self.n, space.starts, len(tokens)
        if size <= n:
            return
        hashes = [hash(tokens[start : start + n]) for start in range(size - n)]
        if (
            not compared
            and all(h in starts for h in hashes)
            and any(
                len(seq) >= size and seq[size - 1] == tokens[-1] and seq[:size] == tokens
                for seq in space.seqs
            )
        ):
            return
        seq = len(space.seqs) << 32
        for start, h in enumerate(hashes):
            at = starts.get(h)
            if at is None:
                starts[h] = seq | start
            elif isinstance(at, int):
                starts[h] = [at, seq | start]
            else:
                at.append(seq | start)
                if len(at) > CANDIDATES:
                    del at[0]
        space.seqs.append(tokens)
        self._counted(space, len(tokens))
        space.tokens += len(tokens)

    def _bound(self, keep: Namespace) -> None:
        """Back within ``max_tokens``, taking from the tenant holding the most (on a tie, the
        one whose namespace was drafted from least recently): its namespace drafted from
        least recently (never ``keep``, the one a request drafts from now), or, its only one,
        its newest rows within its share. No pass over every namespace (found by review: each
        namespace dropped read them all again, three times: ~6 s of the worker's thread to
        drop 2,000 of one tenant's 4,000 for another's refresh)."""
        while self._total > self.max_tokens:
            for ns in [ns for ns in self._empties if ns != keep]:
                self._drop(ns)  # nothing indexed: listed again when drafted from
            held = self._held_by
            share = self.max_tokens // len(held)
            # Each tenant's namespace drafted from least recently (``keep`` too): ties go by it.
            first: dict[str | None, _Rows] = {}
            for tenant in held:
                oldest = self._oldest(tenant)
                assert oldest is not None  # it holds tokens
                first[tenant] = oldest
            for tenant in sorted(held, key=lambda t: (-held[t], first[t].touched)):
                if held[tenant] <= share:
                    return  # nobody is over its share (the bound is met once shares are)
                victim = first[tenant] if first[tenant].ns != keep else self._oldest(tenant, keep)
                if victim is None:
                    continue  # only ``keep``: its cap (``_make_room``) bounds it
                if self._nonempty[tenant] > 1:
                    assert victim.ns is not None
                    self._drop(victim.ns)
                else:  # its only one: its newest rows within its share
                    self._rebuild(victim, share)
                break
            else:
                return  # only ``keep`` is over: its cap (``_make_room``) bounds it

    def _oldest(self, tenant: str | None, skip: Namespace | None = None) -> _Rows | None:
        """``tenant``'s namespace drafted from least recently that holds any tokens, but
        ``skip``; None if none does."""
        for ns, space in self._of_tenant[tenant].items():
            if space.tokens and ns != skip:
                return space
        return None

    def counts(self, ns: Namespace, ngram: tuple[int, ...]) -> Counts | None:
        """ngram-cache: how often each token followed ``ngram`` (1 to 4 tokens) in the rows of
        ``ns`` (None: never). The counts are made on a namespace's first such lookup and
        take in its rows indexed since, at most ``COUNT_TOKENS_MAX`` tokens of them; all
        namespaces' together stay within that too, the least recently drafted from dropped
        first."""
        space = self._spaces.get(ns)
        if space is None:
            return None
        if space.counts is None or space.counted < len(space.seqs):
            self._count(ns, space)
        assert space.counts is not None
        return space.counts.get(ngram)

    def _count(self, ns: Namespace, space: _Rows) -> None:
        if space.counts is None:
            space.counts, space.counted, space.counted_tokens = {}, 0, 0
        for seq in space.seqs[space.counted :]:
            space.counted += 1
            if space.counted_tokens + len(seq) > COUNT_TOKENS_MAX:
                continue
            space.counted_tokens += len(seq)
            counter = NgramCounts()
            counter.counts = space.counts
            counter.update(seq)
        total = sum(s.counted_tokens for s in self._spaces.values())
        for other_ns, other in self._spaces.items():  # least recently drafted from first
            if total <= COUNT_TOKENS_MAX:
                break
            if other_ns != ns and other.counts is not None:
                total -= other.counted_tokens
                other.counts, other.counted, other.counted_tokens = None, 0, 0

    def matches(self, ns: Namespace, text: Sequence[int]) -> list[RowMatch]:
        """Where the last ``n`` tokens of ``text`` (a request's prompt and reply so far)
        occur in the rows of ``ns`` (the latest ``CANDIDATES`` occurrences), the longest
        match first (``RowMatch.matched``), the latest among equals. A loop's n-grams occur
        many times a row, the first of them in a prompt: only the occurrence whose context is
        the request's drafts what the request will write (Gemma 3 270M's looping reply: the
        first occurrence, the only one kept before, drafted the prompt's JSON, 1 token of 3
        kept)."""
        space = self._spaces.get(ns)
        n = self.n
        if space is None or len(text) < n:
            return []
        key = tuple(text[len(text) - n :])
        packed = space.starts.get(hash(key))
        if packed is None:
            return []
        found: list[tuple[int, int, RowMatch]] = []
        for order, at in enumerate([packed] if isinstance(packed, int) else packed):
            seq, start = space.seqs[at >> 32], at & 0xFFFF_FFFF
            if seq[start : start + n] != key:
                continue  # another n-gram with the same hash
            a, b, matched = start - 1, len(text) - n - 1, n
            while a >= 0 and b >= 0 and matched < MATCH_MAX and seq[a] == text[b]:
                a, b, matched = a - 1, b - 1, matched + 1
            whole = start == len(text) - n and seq[: len(text)] == tuple(text)
            found.append((matched, order, RowMatch(seq, start + n, matched, whole)))
        found.sort(key=lambda item: (item[0], item[1]), reverse=True)
        return [match for _, _, match in found]


@dataclass(frozen=True, slots=True)
class Cost:
    """What a pass that verifies a draft of ``k`` tokens costs, in one-token passes:
    ``1 + fixed + per_token * k``, and ``step`` more where its ``k + 1`` rows are more than
    ``tile`` and not a multiple of it. On a CPU the first drafted token costs most (a one-token
    pass multiplies a vector, any other a matrix): SmolLM2 on 2 cores with flash attention,
    measured (the fastest of 9 passes each, k = 1 .. 48): about 0.4 and 0.3; a GPU's are
    near 0. ``tile``: llamafile's tinyBLAS multiplies Q8_0 (Q4_0, Q5_0, IQ4_NL) weights
    against 4 rows at a time on AVX-512 and reads them once more for the rest
    (``ModelFacts.pass_tile``): Gemma 3 270M, whose tied Q8_0 output is 90% of its weight
    bytes, took 44 ms for 8 rows, 61 for 9 and 58 for 12 (``bench/verify_ceiling.py``), so a
    draft of 7 tokens costs less than one of 6 and 8 more than one of 11.

    A pass of rows past a multiple of the tile may instead take filler rows up to the next
    multiple (``pad``), each costing ``row`` (a verify row's ``per_token``; None: that), where
    they cost less than the step: a draft cut short by its source, the request's
    ``max_tokens`` or its window then pays for a few rows, not another sweep of the weights
    (Gemma 3 270M: 48 rows took 186 ms, 47 took 197)."""

    fixed: float
    per_token: float
    tile: int = 1
    step: float = 0.0
    #: What one filler row costs (``pad``), in one-token passes; None: ``per_token``. A draft
    #: model's drafted token costs its own pass besides its row (``DraftCost.total``); a
    #: filler row is drafted by nobody.
    row: float | None = None
    #: How many rows past its first the pass of one draft may take, filler included, where
    #: ``draft`` prices it (``Tick._propose``: its reach and the batch's room, 0 where a prompt
    #: waits, its chunk then sharing the pass, which takes no filler); None: no bound. A draft
    #: of ``k`` tokens whose filler would pass it pays the step: ``Tick._pad`` adds none.
    reach: int | None = None

    def of(self, k: int) -> float:
        """What a pass of ``k + 1`` rows costs (its one token and a draft of ``k``)."""
        if k <= 0:
            return 1.0
        extra = self.step if self.split(k + 1) else 0.0
        return 1.0 + self.fixed + self.per_token * k + extra

    def draft(self, k: int) -> float:
        """What a draft of ``k`` tokens costs its pass, with the filler rows that pass then
        takes where they cost less than the step (``pad``) and lie within ``reach``."""
        pad = self.pad(k + 1)
        if self.reach is not None and k + pad > self.reach:
            pad = 0
        return self.of(k) - (self.step - self.per_row * pad if pad else 0.0)

    def split(self, rows: int) -> bool:
        """Whether a pass of ``rows`` rows pays ``step``: more than ``tile``, not a multiple."""
        return rows > self.tile > 1 and rows % self.tile != 0

    def pad(self, rows: int) -> int:
        """How many filler rows a pass of ``rows`` rows is worth: up to the next multiple of
        the tile, where they cost less than the step it would pay; else 0."""
        if not self.split(rows):
            return 0
        filler = self._filler(rows)
        return filler if self.per_row * filler < self.step else 0

    @property
    def per_row(self) -> float:
        """What one filler row costs, in one-token passes."""
        return self.per_token if self.row is None else self.row

    def _filler(self, rows: int) -> int:
        return -rows % self.tile


class PassCost:
    """``Cost``, measured: each pass that verified a draft, against the lower quartile of the
    latest plain passes of as many slots (run moments before, under the same load: another
    process's load cancels out), gives a sample ``(k, t / t_plain)``. A stall only ever makes
    a pass slower, and a new context's first passes are several times slower than the rest
    (measured: 870 ms against 8 ms), so the baseline is a low quantile, not the median, and
    takes at least ``_MIN_PLAIN`` passes: a baseline inflated by them would make every draft
    look nearly free (a fit of 0.02 one-token passes per token against a true 0.3 on 2 CPU
    cores), and a chat then drafts at every common phrase. The line through the
    samples of the last ``_WINDOW_S`` seconds and two points of the prior is fitted robustly
    (Theil-Sen: the median of pairwise slopes, then the lower quartile of the intercepts:
    stalls only add, and with the median a host busy half the time fitted a fixed part of 3
    and more against a true 0.4, which drafts nothing short), so a pass stalled by another
    process moves it little; a few samples move it a little, many all the way; and
    with no recent sample (a cost estimated so high that nothing was drafted: no sample for
    ``_WINDOW_S`` seconds, or ``_STALE_PLAIN`` plain passes since the last one) the prior
    comes back, drafts are tried again and measured afresh. The pass count bounds how long a
    burst of stalled verify passes (another process on the cores: 0.7-2.4 s against ~31 ms,
    seen in a bench run at load 2-5) can price every draft out: by time alone, two minutes,
    longer than a whole reply.

    ``tile``, ``share`` (``ModelFacts.pass_tile``, ``pass_tile_share``): where the CPU
    multiplies some weights against ``tile`` rows at a time, a pass of rows past a multiple
    of it (``Cost.split``) pays a ``step`` more: the median of what such samples cost above
    the line, with ``share`` (its prior: the bytes read once more, in one-token passes) worth
    ``_STEP_PRIOR_WEIGHT`` samples; the line is fitted to the samples less that step, twice
    over (a first step from the prior), so split and whole passes both measure it. A sample
    pays the step against its baseline only where its rows are split and the baseline's
    (as many rows as slots) are not, and saves it where the baseline's are split and its
    own not: 5 slots on a tile of 4 pay it plain, and a draft of 3 beside them does not
    (counted as paying it, such samples fitted a step of 0 against a true 0.27)."""

    #: What a pass costs until passes have been timed: a CPU-like guess.
    PRIOR = Cost(0.5, 0.3)
    _KEEP = 31  # recent plain passes per slot count; recent samples
    _MIN_PLAIN = 3  # plain passes of as many slots a sample needs
    _WINDOW_S = 120.0
    _STALE_PLAIN = 48  # plain passes with no verify pass since the last sample
    _PRIOR_AT = (1, 16)  # the prior's two pseudo-samples
    _MAX_FIXED, _MAX_PER_TOKEN, _MAX_STEP = 4.0, 2.0, 4.0
    _STEP_PRIOR_WEIGHT = 2

    __slots__ = (
        "_clock", "_fit", "_fitted_at", "_plain", "_plain_since", "_samples", "_share", "_tile",
    )  # fmt: skip

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, tile: int = 1, share: float = 0.0
    ) -> None:
        self._clock = clock
        self._tile = tile if tile > 1 and share > 0.0 else 1
        self._share = min(self._MAX_STEP, max(0.0, share)) if self._tile > 1 else 0.0
        self._plain: dict[int, deque[float]] = {}
        #: (when, drafted, its ratio to a plain pass, the steps it pays over that pass's:
        #: 1, 0 or -1)
        self._samples: deque[tuple[float, int, float, int]] = deque(maxlen=self._KEEP)
        self._fit = Cost(self.PRIOR.fixed, self.PRIOR.per_token, self._tile, self._share)
        self._fitted_at: float | None = None  # None: refit at the next read
        self._plain_since = 0  # plain passes since the last verify pass

    @property
    def tile(self) -> int:
        """The rows the CPU's matrix kernel takes at a time (1: no tile)."""
        return self._tile

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
            self._plain_since += 1
            if self._samples and self._plain_since >= self._STALE_PLAIN:
                self._samples.clear()
                self._fitted_at = None
            return
        self._plain_since = 0
        if plain is not None and len(plain) >= self._MIN_PLAIN:
            ratio = seconds / _lower_quartile(plain)
            steps = int(self._fit.split(slots + drafted)) - int(self._fit.split(slots))
            self._samples.append((self._clock(), drafted, ratio, steps))
            self._fitted_at = None

    def plain(self) -> float | None:
        """What a plain pass of one slot takes now, in seconds: the lower quartile of the latest
        (of the fewest slots timed where one slot's are not), None before ``_MIN_PLAIN``."""
        for slots in sorted(self._plain):
            plain = self._plain[slots]
            if len(plain) >= self._MIN_PLAIN:
                return _lower_quartile(plain)
        return None

    @property
    def cost(self) -> Cost:
        now = self._clock()
        stale = self._samples and now - self._samples[0][0] > self._WINDOW_S
        if self._fitted_at is None or (stale and now - self._fitted_at > 1.0):
            while self._samples and now - self._samples[0][0] > self._WINDOW_S:
                self._samples.popleft()
            self._fit = self._estimate()
            self._fitted_at = now
        return self._fit

    def _estimate(self) -> Cost:
        step = self._share
        fixed, per_token = self._line(step)
        if any(steps for *_, steps in self._samples):
            above = [
                (r - 1.0 - fixed - per_token * k) / steps
                for _, k, r, steps in self._samples
                if steps
            ]
            step = statistics.median([self._share] * self._STEP_PRIOR_WEIGHT + above)
            step = min(self._MAX_STEP, max(0.0, step))
            fixed, per_token = self._line(step)
        return Cost(fixed, per_token, self._tile, step)

    def _line(self, step: float) -> tuple[float, float]:
        """``fixed`` and ``per_token`` of the samples, each less the ``step`` it pays (or
        plus the one it saves)."""
        # Every verify pass refits (up to 33 points, 528 pairs, twice with a tile), right
        # after the pass has streamed the weights through the caches: numpy's calls then took
        # ~0.74 ms a fit (cold), this loop ~35 us, the same numbers (IEEE doubles either way;
        # the median of an even count the mean of its middle two, as ``np.median``).
        points = [(k, self.PRIOR.of(k) - 1.0) for k in self._PRIOR_AT]
        points += [(k, r - 1.0 - step * steps) for _, k, r, steps in self._samples]
        slopes = [
            (yb - ya) / (xb - xa)
            for a, (xa, ya) in enumerate(points)
            for xb, yb in points[a + 1 :]
            if xa != xb
        ]
        per_token = statistics.median(slopes)
        intercepts = sorted(y - per_token * x for x, y in points)
        fixed = intercepts[len(points) // 4]
        return (
            min(self._MAX_FIXED, max(0.0, fixed)),
            min(self._MAX_PER_TOKEN, max(0.002, per_token)),
        )


class DraftCost:
    """What one pass of a draft model (``--draft-model``) costs, in the model's one-token
    passes: a draft of ``k`` tokens runs ``k`` of them before its verify pass (the last
    token, then each drafted one but the last), so a draft model as large as the model
    (SmolLM2 or Gemma 3 270M drafting for itself: ~1) makes a drafted token cost more than
    the row it saves on a CPU, where the verify row alone costs ~0.3 (``Cost``), and the
    draft pays only where the model's pass is many times the draft model's. ``DraftBudget``
    prices a draft by both (``total``). Measured like ``PassCost``: each draft pass of one
    token is timed, and the lower quartile of the last ``_KEEP`` (of the last ``_WINDOW_S``
    seconds; a stall only adds) over ``PassCost.plain``, the lower quartile of the model's
    latest one-slot plain passes, is the cost; until ``_MIN`` passes are timed, the prior
    (the draft model's weights over the model's: a decode on a CPU reads every weight once).
    With no draft pass for ``_WINDOW_S`` seconds or ``_STALE`` drafts priced out since the
    last, the prior comes back, so a cost measured under a stall is measured again."""

    _KEEP = 31
    _MIN = 3
    _WINDOW_S = 120.0
    _STALE = 48
    _MAX = 4.0

    __slots__ = ("_clock", "_idle", "_samples", "prior")

    def __init__(self, prior: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.prior = min(self._MAX, max(0.0, prior))
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque(maxlen=self._KEEP)  # (when, seconds)
        self._idle = 0  # drafts priced out since the last draft pass

    def observe(self, seconds: float) -> None:
        """A draft pass of one token took ``seconds``."""
        if seconds > 0.0:
            self._samples.append((self._clock(), seconds))
            self._idle = 0

    def idle(self) -> None:
        """A draft was not made (priced out, or its acceptance too low)."""
        self._idle += 1
        if self._idle >= self._STALE:
            self._samples.clear()

    def per_token(self, plain: float | None) -> float:
        """The cost of one draft pass in one-token passes of the model, which take ``plain``
        seconds (``PassCost.plain``; None: not timed yet, the prior)."""
        now = self._clock()
        while self._samples and now - self._samples[0][0] > self._WINDOW_S:
            self._samples.popleft()
        if plain is None or plain <= 0.0 or len(self._samples) < self._MIN:
            return self.prior
        seconds = _lower_quartile([s for _, s in self._samples])
        return min(self._MAX, seconds / plain)

    def total(self, cost: Cost, plain: float | None) -> Cost:
        """``cost`` (the verify pass's) with each drafted token's draft pass added: what a draft
        of ``k`` tokens costs in all, as ``DraftBudget.length`` weighs it."""
        return replace(cost, per_token=cost.per_token + self.per_token(plain), row=cost.per_row)


def _lower_quartile(values: Iterable[float]) -> float:
    """The lower quartile of timings (a stall only ever adds: ``PassCost``, ``DraftCost``)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 4]
