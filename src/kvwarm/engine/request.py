"""A request as the worker sees it, the checks it passes before it is queued, and the events
it sends back to its caller.

Invariants: a queued request's prompt is non-empty, leaves room for one generated token, and
holds only valid token ids, so the worker never has to refuse one (``docs/architecture.md``).
A request is answered once: ``answer`` puts the first final event (``Done`` or ``Failed``) and
ignores any later one. A request with ``forks`` (``n > 1``) is queued alone; its forks share
its prompt and are seated and answered by the worker with it. A request with ``after`` (a
rerank's document, after the prefix its documents share) waits at the head of the queue until
that request is answered, and ends as it did if it did not finish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import TYPE_CHECKING, Literal

from kvwarm.cache.types import TtlClass
from kvwarm.engine.channel import Channel
from kvwarm.engine.types import Completion, GenerationOptions, TokenLogprob
from kvwarm.errors import ContextOverflowError, InvalidRequestError
from kvwarm.tokens import Prompt

if TYPE_CHECKING:
    from kvwarm.engine.prompts import SpanMedia

#: ``score``: a rerank document, prefilled and scored by the model's pooling (rank),
#: generating nothing and saving nothing.
RequestKind = Literal["generate", "prewarm", "score"]


@dataclass(frozen=True, slots=True)
class Done:
    completion: Completion


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


@dataclass(frozen=True, slots=True)
class Fragment:
    """Text that is now safe to show, with the logprobs of the tokens whose text begins in it
    (or in held-back text before it) since the last fragment (empty unless logprobs were asked
    for); a token whose text is still held back (a partial character, a possible stop string)
    keeps its logprob for a later fragment. The last fragment may have empty text and carry
    the logprobs still unsent (tokens of a character a ``max_tokens`` cut left incomplete)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Prefilled:
    """Sent once the prompt is prefilled, when prompt logprobs were asked for."""

    prompt_logprobs: tuple[TokenLogprob, ...]


Event = Fragment | Prefilled | Done | Failed


@dataclass(slots=True, eq=False)
class Request:
    #: Its ids and spans (``kvwarm.tokens``); ``prompt_tokens`` are its ids.
    prompt: Prompt
    options: GenerationOptions
    grammar: str | None
    deterministic: bool
    kind: RequestKind = "generate"
    ttl_class: TtlClass = TtlClass.SHORT
    prompt_text: str = ""
    # False for complete()/chat(): only the final event is sent, so the caller's thread is
    # not woken once per token (on few cores that wake-up steals time from the decode).
    fragments: bool = True
    # n > 1: the other choices. They share this prompt; the worker seats them with this
    # request and copies its prompt KV to them once it is prefilled (``engine/worker/forks.py``).
    forks: tuple[Request, ...] = ()
    #: What each of the prompt's spans shows, in order (``engine/prompts.py``): what the worker
    #: encodes for a span it does not restore.
    media: tuple[SpanMedia, ...] = ()
    #: Queued behind this request, and admitted only once it is answered: a rerank's shared
    #: prefix, whose KV its documents then copy (``engine/rerank.py``).
    after: Request | None = None
    #: Whether it counts against the queue's ``max_queue``: a rerank's documents ride on the
    #: rerank's first request, so one rerank is one queued request however many it scores.
    counted: bool = True
    #: The cache's upkeep, not a request served: ``Model.prewarm`` (keep-alive's re-warms,
    #: ``/cache/prewarm``, ``--prewarm-system``, a library's own). Counted as the model's
    #: prewarms (``ModelStatus.prewarms``), never in its requests, their tokens and prefill
    #: time, nor in the cache's request outcomes (hits, misses). A rerank's shared prefix is
    #: a prewarm by kind but part of the client's rerank, so not upkeep.
    upkeep: bool = False
    #: The tokens whose text its reply keeps although they are special
    #: (``GenerationOptions.preserved_tokens``, resolved by ``engine/submit.py``).
    preserved: frozenset[int] = frozenset()
    #: ``GenerationOptions.prediction``'s tokens (plain text, no BOS), at most the context's:
    #: what its drafter may replay (``engine/worker/drafts.Predicted``).
    predicted: tuple[int, ...] = ()
    channel: Channel[Event] = field(default_factory=Channel)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    answered: bool = False
    outcome: Done | Failed | None = None  # the final event, once answered

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        return self.prompt.tokens

    def answer(self, event: Done | Failed) -> None:
        """Send the final event, once; a later one is dropped."""
        if self.answered:
            return
        self.outcome = event  # before ``answered``: whoever sees that reads this
        self.answered = True
        self.channel.put(event)

    @property
    def finished(self) -> bool:
        """Answered with a completion that was not cancelled."""
        out = self.outcome
        return isinstance(out, Done) and out.completion.stats.finish_reason != "cancelled"

    @property
    def group(self) -> tuple[Request, ...]:
        """This request and its forks, in choice order."""
        return (self, *self.forks)


def check_tokens(tokens: Sequence[int], n_vocab: int, *, param: str = "prompt") -> list[int]:
    """``tokens`` as a list of ``int``, if every one is a valid id of an ``n_vocab``
    vocabulary. Any integer type is taken (numpy's, as a tokenizer's arrays hold them, and as
    ``detokenize`` takes them); found by review: ``complete([np.int64(5)])`` was refused as
    "token 5 is not a valid id for this vocabulary (0..264)", a message that named no fault."""
    out: list[int] = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise InvalidRequestError(
                f"token {t!r} is not a token id: a {type(t).__name__}, not an integer",
                param=param,
            )
        if not 0 <= t < n_vocab:
            raise InvalidRequestError(
                f"token {t!r} is not a valid id for this vocabulary (0..{n_vocab - 1})",
                param=param,
            )
        out.append(int(t))
    return out


def check_length(tokens: Sequence[int], n_ctx: int) -> None:
    """A prompt must be non-empty and leave room in the slot's window for one more token."""
    if not tokens:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if len(tokens) >= n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(tokens)} tokens; this model's context holds {n_ctx} "
            "(the prompt must leave room for at least one generated token)",
            n_tokens=len(tokens),
            n_ctx=n_ctx,
        )
