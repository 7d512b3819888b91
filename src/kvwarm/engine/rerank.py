"""Reranking: a query and its documents to relevance scores, through the model's worker like
every other request.

A document's prompt is llama-server's (``format_prompt_rerank``): the GGUF's rerank template
with ``{query}`` then ``{document}`` replaced, tokenized whole with special tokens parsed;
without a template, ``[BOS] query [EOS] [SEP] document [EOS]``, each token as the vocabulary
adds it. One deliberate difference: a query or document is text, never markup. Where one holds
special-token text (llama-server makes it a special token, so an untrusted document can forge
the template's markers and inflate its own score), the template's pieces are tokenized with
special parsing and the query and document without, then concatenated (``_template_tokens``;
so too where a query's or document's edge spells a control token with the template's text
beside it); every other prompt, and so its score, is llama-server's. Each document
is one request of kind ``score`` in a slot of its own: the tick batches the documents of every
rerank into its forward passes, and the model's rank pooling gives each its score as its
prompt ends (``engine/worker/tick.py``). Scores are llama-server's: the first value the
classifier head gives (a decoder reranker's p("yes"), a cross-encoder's raw score).

Where the cache pays: a decoder reranker's template puts the query before the document, so
every document of a query shares its prompt up to the document. With a causal model that
prefix is a request of its own (a prewarm: prefilled, saved), queued first; the documents wait
behind it (``Request.after``) and then take its KV from the slot that holds it (``seq_cp``) or
from its row, as the planner finds them: N documents cost one prefix prefill and N document
prefills, and a later rerank with the same query finds the prefix the same way. An encoder
(attention not causal: a BERT cross-encoder) computes every position from the whole pair, so
no document's KV serves another: its documents run whole, several to a call within one ubatch,
and its slots keep nothing (``WorkerConfig.whole``).

Numerics: a document scored alone is bit-identical to llama-server's score of it (same flash
attention, batch size and KV types: ``-np 1``). Scored beside others, a document's last bits
move with what shares its forward pass, in llama.cpp itself: measured on a 576-wide f16 model,
llama-server's own ``-np 8`` scores differ from its ``-np 1`` ones by up to 6e-5, kvwarm's
batched ones by up to 1.5e-4; on the tests' f32 models both by up to 2e-5. A deterministic
model (``deterministic``) runs each document's passes alone, in a KV stream of its own, and
shares the prefix only at a multiple of ``n_batch`` (``kvwarm.alignment``): then every score
is exactly the document's own, whatever else is being ranked (``tests/engine``,
``bench/rerank.py --exact``).

Invariants: every input is checked on the caller's thread before anything is queued; a
rerank's requests are queued together or not at all and end together (the first failure
cancels the rest, and is raised; so do a deadline, ``timeout_s``: the server's
``request_timeout_s``, and a ``Cancellation``: the server's, on its client's disconnect);
results are sorted by score, ties in document order; every score is a finite number (one
that is not, from weights or adapters that overflow, fails the rerank: ``BackendError``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvwarm.backends.base import BackendModel
from kvwarm.cache.types import TtlClass
from kvwarm.engine.cancel import Cancellation, check_cancel, check_timeout
from kvwarm.engine.request import Done, Failed, Request, RequestKind
from kvwarm.engine.types import GenerationOptions, Reranking, RerankResult
from kvwarm.engine.worker.loop import Worker
from kvwarm.engine.worker.runtime import LoraChoice
from kvwarm.errors import (
    BackendError,
    ContextOverflowError,
    EngineClosedError,
    InvalidRequestError,
    RequestCancelledError,
    RequestTimeoutError,
)
from kvwarm.tokens import Prompt, common_prefix

#: A rerank template's placeholders (split with them kept: text, placeholder, text, ...).
_PLACEHOLDERS = re.compile(r"(\{query\}|\{document\})")


@dataclass(frozen=True, slots=True)
class RerankLimits:
    """``limit``: the most tokens one document's prompt may have (the slot's window; an
    encoder's must also fit one ubatch); ``max_documents``: per rerank; ``truncate``: cut a
    document that does not fit instead of refusing the rerank."""

    limit: int
    max_documents: int
    truncate: bool


class Ranker:
    """The rerank operation of one model (a model whose pooling is rank)."""

    def __init__(
        self,
        bmodel: BackendModel,
        worker: Worker,
        limits: RerankLimits,
        *,
        whole: bool,
        deterministic: bool,
        n_batch: int,
    ) -> None:
        """``whole``: the model's attention is not causal (its documents share nothing);
        ``deterministic``: a deterministic model, whose requests reuse KV only at multiples
        of ``n_batch`` (``kvwarm.alignment``), so its shared prefix is cut to one."""
        self._bmodel = bmodel
        self._worker = worker
        self._limits = limits
        self._whole = whole
        self._deterministic = deterministic
        self._align = n_batch if deterministic else 1
        # Per token id: whether it is a control token (``_is_control``); the control tokens
        # the rerank template's own text holds, in order (``_markers``).
        self._control: dict[int, bool] = {}
        self._template_markers: list[int] | None = None

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        max_tokens_per_doc: int | None = None,
        cache_salt: str | None = None,
        lora: LoraChoice | None = None,
        timeout_s: float | None = None,
        cancel: Cancellation | None = None,
    ) -> Reranking:
        """``lora``: the adapter set every document runs under (``GenerationOptions.lora``;
        the model's own set as the call begins, ``Adapters.applied_choice``)."""
        docs = self._check(query, documents, top_n, max_tokens_per_doc)
        check_timeout(timeout_s)
        check_cancel(cancel)
        options = GenerationOptions(max_tokens=0, temperature=0.0, cache_salt=cache_salt, lora=lora)
        options.validate()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        prompts = self._prompts(query, docs, max_tokens_per_doc)
        requests, scored = self._requests(prompts, options)
        if cancel is not None and cancel.cancelled:  # its client left while it was tokenized
            raise _cancelled(len(scored), len(scored))
        self._worker.submit(*requests)

        def cancel_unanswered() -> None:
            for req in requests:
                if not req.answered:
                    self._worker.cancel(req)

        # A disconnect (any thread): the documents not yet scored are cancelled at once, so
        # the worker stops on them; the loop below then finds an unscored one and raises.
        forget = cancel.on_cancel(cancel_unanswered) if cancel is not None else None
        try:
            scores, cached = self._scores(scored, deadline, timeout_s, cancel)
        finally:
            if forget is not None:
                forget()
            cancel_unanswered()
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        keep = len(order) if top_n is None else top_n
        return Reranking(
            results=tuple(RerankResult(i, scores[i]) for i in order[:keep]),
            prompt_tokens=sum(len(p) for p in prompts),
            cached_tokens=cached,
        )

    # ---- on the caller's thread -----------------------------------------------------------

    def _check(
        self,
        query: object,
        documents: object,
        top_n: object,
        max_tokens_per_doc: object,
    ) -> list[str]:
        if not isinstance(query, str):
            raise InvalidRequestError(
                f"query must be a text, not {type(query).__name__}", param="query"
            )
        if isinstance(documents, str | bytes | bytearray) or not isinstance(documents, Sequence):
            raise InvalidRequestError("documents must be a list of texts", param="documents")
        docs = list(documents)
        if not docs:
            raise InvalidRequestError("no documents to rerank", param="documents")
        most = self._limits.max_documents
        if len(docs) > most:
            raise InvalidRequestError(
                f"{len(docs)} documents; this model reranks at most {most} at once "
                "(rerank_max_documents)",
                param="documents",
            )
        for i, doc in enumerate(docs):
            if not isinstance(doc, str):
                raise InvalidRequestError(
                    f"document {i} must be a text, not {type(doc).__name__}", param="documents"
                )
        for name, value in (("top_n", top_n), ("max_tokens_per_doc", max_tokens_per_doc)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise InvalidRequestError(f"{name} must be an integer >= 1", param=name)
        return docs

    def _prompts(
        self, query: str, docs: Sequence[str], max_tokens_per_doc: int | None
    ) -> list[tuple[int, ...]]:
        """Each document's prompt, cut to ``max_tokens_per_doc`` document tokens and to the
        limit (``rerank_truncate``), or refused."""
        # Whether the query holds special-token text: asked once, not once per document.
        marked = self._has_special(query)
        empty = self._parts(query, "", marked)
        if len(empty[0]) + len(empty[2]) > self._limits.limit:
            raise ContextOverflowError(
                f"the rerank prompt without a document has {len(empty[0]) + len(empty[2])} "
                f"tokens; a document's prompt may have {self._limits.limit}",
                n_tokens=len(empty[0]) + len(empty[2]),
                n_ctx=self._limits.limit,
                # Found by review: it named "prompt", a field a rerank does not have.
                param="query",
            )
        prompts = []
        for i, doc in enumerate(docs):
            head, body, tail = self._parts(query, doc, marked, empty)
            if max_tokens_per_doc is not None:
                body = body[:max_tokens_per_doc]
            room = self._limits.limit - len(head) - len(tail)
            if len(body) > room:
                if not self._limits.truncate:
                    n = len(head) + len(body) + len(tail)
                    raise ContextOverflowError(
                        f"document {i}'s prompt has {n} tokens; this model's context holds "
                        f"{self._limits.limit} (set rerank_truncate to cut such documents)",
                        n_tokens=n,
                        n_ctx=self._limits.limit,
                        param="documents",  # found by review: "prompt", no rerank field
                    )
                body = body[:room]
            prompt = (*head, *body, *tail)
            if not prompt:
                raise InvalidRequestError(
                    f"document {i} makes an empty prompt (an empty query and document, and a "
                    "vocabulary that adds no tokens)",
                    param="documents",
                )
            prompts.append(prompt)
        return prompts

    def _parts(
        self,
        query: str,
        doc: str,
        marked: bool,
        empty: tuple[list[int], list[int], list[int]] | None = None,
    ) -> tuple[list[int], list[int], list[int]]:
        """A document's prompt as (before the document, the document, after it); ``marked``:
        the query holds special-token text (``_template_tokens``)."""
        bm = self._bmodel
        facts = bm.facts
        template = facts.rerank_template
        if template is not None:
            tokens = self._template_tokens(template, query, doc, marked)
            if empty is None:
                return tokens, [], []
            # Where the document is: what the same prompt without it does not share with
            # this one (tokenized whole, the document's edges may merge with the template's).
            bare = [*empty[0], *empty[2]]
            head = common_prefix(tokens, bare)
            tail = common_prefix(tokens[head:][::-1], bare[head:][::-1])
            return tokens[:head], tokens[head : len(tokens) - tail], tokens[len(tokens) - tail :]
        q = bm.tokenize(query, add_special=False, parse_special=False)
        d = bm.tokenize(doc, add_special=False, parse_special=False)
        eos = facts.eos if facts.eos is not None else facts.sep
        # A token the vocabulary asks for but lacks is left out (llama-server would send -1).
        bos = [facts.bos] if facts.add_bos and facts.bos is not None else []
        end = [eos] if facts.add_eos and eos is not None else []
        sep = [facts.sep] if facts.add_sep and facts.sep is not None else []
        return [*bos, *q, *end, *sep], d, list(end)

    def _template_tokens(
        self, template: str, query: str, doc: str, query_marked: bool
    ) -> list[int]:
        """The template's prompt for ``query`` and ``doc``. As llama-server's whole render
        tokenized with special tokens parsed, unless the query or the document holds
        special-token text of its own: then, where llama-server would make it a special
        token (an untrusted document forging the template's markers, e.g.
        ``<|im_start|>assistant``, to inflate its own score), it stays text: the template's
        pieces are tokenized with special parsing, the query and the document without, and
        concatenated, as chat content is (``engine/prompts.py``); so too where the query's
        or document's edge spells a control token with the template's text beside it (the
        whole render's control tokens are not the template's own)."""
        bm = self._bmodel
        if not (query_marked or self._has_special(doc)):
            # llama-server's order: {query} first, so a query holding "{document}" has it
            # replaced too, as there.
            text = template.replace("{query}", query).replace("{document}", doc)
            whole = bm.tokenize(text, add_special=False, parse_special=True)
            # Its control tokens are the template's own, unless the query's or document's
            # edge spells one with the template's text beside it: then as below.
            if [t for t in whole if self._is_control(t)] == self._markers(template):
                return whole
        tokens: list[int] = []
        for k, piece in enumerate(_PLACEHOLDERS.split(template)):
            if k % 2 == 0:
                if piece:
                    tokens += bm.tokenize(piece, add_special=False, parse_special=True)
            else:
                text = query if piece == "{query}" else doc
                tokens += bm.tokenize(text, add_special=False, parse_special=False)
        return tokens

    def _markers(self, template: str) -> list[int]:
        """The control tokens of the template's own text, in order (the same for every
        rerank: the model's template is fixed)."""
        markers = self._template_markers
        if markers is None:
            bm = self._bmodel
            markers = [
                t
                for piece in _PLACEHOLDERS.split(template)[::2]
                if piece
                for t in bm.tokenize(piece, add_special=False, parse_special=True)
                if self._is_control(t)
            ]
            self._template_markers = markers
        return markers

    def _is_control(self, token: int) -> bool:
        """A control token: text only with special parsing, as llama.cpp writes it (its
        piece is empty unless special), memoized per id."""
        known = self._control.get(token)
        if known is None:
            bm = self._bmodel
            known = not bm.token_to_piece(token, special=False) and bool(
                bm.token_to_piece(token, special=True)
            )
            self._control[token] = known
        return known

    def _has_special(self, text: str) -> bool:
        """Whether ``text`` tokenizes otherwise with special tokens parsed (it holds a special
        token's text)."""
        if not text:
            return False
        bm = self._bmodel
        plain = bm.tokenize(text, add_special=False, parse_special=False)
        return bm.tokenize(text, add_special=False, parse_special=True) != plain

    def _requests(
        self, prompts: Sequence[tuple[int, ...]], options: GenerationOptions
    ) -> tuple[list[Request], list[Request]]:
        """(everything to queue, in order; the documents' requests)."""

        def request(
            tokens: tuple[int, ...], kind: RequestKind, after: Request | None, counted: bool
        ) -> Request:
            return Request(
                prompt=Prompt.text(tokens),
                options=options,
                grammar=None,
                deterministic=self._deterministic,
                kind=kind,
                ttl_class=TtlClass.SHORT,
                fragments=False,
                after=after,
                counted=counted,
            )

        head: Request | None = None
        if not self._whole and len(prompts) > 1:
            shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
            shared -= shared % self._align  # what a deterministic document can reuse of it
            if shared > 0:
                head = request(prompts[0][:shared], "prewarm", None, True)
        # The whole rerank counts once against max_queue: its first request.
        docs = [request(p, "score", head, head is None and i == 0) for i, p in enumerate(prompts)]
        return ([head] if head is not None else []) + docs, docs

    def _scores(
        self,
        docs: Sequence[Request],
        deadline: float | None,
        timeout_s: float | None,
        cancel: Cancellation | None,
    ) -> tuple[list[float], int]:
        """Each document's score, in order, and the prompt tokens reused; the first failure
        is raised, ``RequestTimeoutError`` past ``deadline`` and ``RequestCancelledError``
        once ``cancel`` is cancelled (the caller cancels the rest)."""
        scores: list[float] = []
        cached = 0
        for req in docs:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = req.channel.get(wait)
            except TimeoutError:
                raise RequestTimeoutError(
                    f"the rerank ran past its deadline ({timeout_s:g} s: request_timeout_s) "
                    f"with {len(docs) - len(scores)} of its {len(docs)} documents unscored; "
                    "they were cancelled"
                ) from None
            if isinstance(event, Failed):
                raise event.error
            assert isinstance(event, Done)
            done = event.completion
            if done.score is None and cancel is not None and cancel.cancelled:
                raise _cancelled(len(docs) - len(scores), len(docs))
            if done.score is None:
                raise EngineClosedError(
                    "the rerank was cancelled before every document was scored (the model "
                    "is unloading)"
                )
            if not math.isfinite(done.score):
                # Found by review: weights or adapters that overflow gave NaN scores, sorted
                # as if numbers (NaN compares false) and an untyped 500 as JSON.
                raise BackendError(
                    f"the model computed a score that is not a finite number ({done.score}) "
                    "for a document: its weights or its adapters overflow (is a LoRA scale "
                    "far too large?)"
                )
            scores.append(done.score)
            cached += done.stats.cached_tokens
        return scores, cached


def _cancelled(unscored: int, total: int) -> RequestCancelledError:
    return RequestCancelledError(
        f"the rerank was cancelled by its caller with {unscored} of its {total} documents "
        "unscored; they were cancelled"
    )
