"""Embeddings: pooled vectors from a separate, lazily created embedding context.

Invariants: the embedding context is created and used only on the model's worker thread (as
jobs between ticks), so it never races the generation context; inputs are validated on the
caller's thread before any job is queued (``docs/architecture.md``, "Engine"). A batch is
embedded in pieces of about ``n_batch`` tokens, one job each, queued one after the other, so
the model's other requests get a tick between any two pieces (issue 41: 20,000 inputs as one
job held a concurrent chat for 168 s), as a batch of completion prompts shares the model.
Past its deadline (``timeout_s``: the server's ``request_timeout_s``) or once its caller
cancels it (``engine.cancel``: the server's, on a disconnect), the pieces not yet begun are
never run. Before each embedding job the context takes the LoRA set the embedding runs under
(``Adapters.resolve``, by its first piece, for all of them): the one it names (the server's
global scales, as llama-server embeds), else the model's own, so a model with an adapter
attached embeds with it, as it generates with it; a change of the model's set while it runs
never reaches its later pieces. Every vector returned is finite numbers (one that is not, from
weights or adapters that overflow, fails the embedding: ``BackendError``).

The embedding context is sized to the inputs it has embedded (found by review): pooling needs a
whole input in one ubatch, so its ``n_ubatch`` (and ``n_ctx``) must hold the longest input, and
llama.cpp's compute buffer grows with the square of ``n_ubatch``. Sized to the generation
context's ``n_ctx`` up front, one short input allocated ~0.9 GiB at n_ctx 4096 (SmolLM2). It
starts at ``_MIN_TOKENS`` and is created again, at the next power of two up to ``n_ctx``, when a
longer input comes; ``memory_bytes`` reports what it holds (the model counts it in its info).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError
from dataclasses import replace

from kvwarm.backends.base import (
    AdapterSet,
    BackendContext,
    BackendModel,
    ContextMemory,
    ContextParams,
)
from kvwarm.engine.cancel import Cancellation, check_cancel, check_timeout
from kvwarm.engine.request import check_tokens
from kvwarm.engine.worker.loop import Worker
from kvwarm.engine.worker.runtime import LoraChoice
from kvwarm.errors import (
    BackendError,
    ContextOverflowError,
    InvalidRequestError,
    RequestCancelledError,
    RequestTimeoutError,
)

#: The smallest embedding context, in tokens (llama.cpp pads a context to 256 cells anyway).
_MIN_TOKENS = 512


def pieces(token_lists: list[list[int]], budget: int) -> Iterator[list[list[int]]]:
    """``token_lists`` in order, in runs of at most ``budget`` tokens (an input longer than
    that is a run of its own)."""
    run: list[list[int]] = []
    size = 0
    for tokens in token_lists:
        if run and size + len(tokens) > budget:
            yield run
            run, size = [], 0
        run.append(tokens)
        size += len(tokens)
    if run:
        yield run


def context_tokens(longest: int, limit: int) -> int:
    """The embedding context's size for inputs of up to ``longest`` tokens: the next power of
    two from ``_MIN_TOKENS``, at most ``limit`` (the model's ``n_ctx``)."""
    size = _MIN_TOKENS
    while size < longest:
        size *= 2
    return min(size, limit)


class Embedder:
    def __init__(
        self,
        bmodel: BackendModel,
        params: ContextParams,
        worker: Worker,
        adapters: Callable[[LoraChoice | None], AdapterSet] = lambda _: (),
    ) -> None:
        """``adapters`` resolves an embedding's LoRA choice to the set to embed with (called on
        the worker thread; None: the model's own)."""
        self._bmodel = bmodel
        self._params = params
        self._worker = worker
        self._adapters = adapters
        self._ctx: BackendContext | None = None
        self._ctx_adapters: AdapterSet = ()  # the set the embedding context has natively

    def embed(
        self,
        inputs: str | Sequence[str | Sequence[int]],
        *,
        normalize: bool,
        lora: LoraChoice | None = None,
        timeout_s: float | None = None,
        cancel: Cancellation | None = None,
    ) -> list[list[float]]:
        """One vector per input: text (tokenized with BOS) or token ids, used as given. Past
        ``timeout_s`` (``RequestTimeoutError``), or once ``cancel`` is cancelled
        (``RequestCancelledError``), the pieces not yet embedded are dropped from the queue
        (one the worker has begun ends first, in the background)."""
        check_timeout(timeout_s)
        check_cancel(cancel)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        token_lists = self._tokens(inputs)
        limit = self._params.n_ctx

        size = context_tokens(max(len(t) for t in token_lists), limit)
        # The set every piece embeds under, resolved by the first (as a generation's is at
        # admission). Found by review: each piece resolved it anew, and a change of the
        # model's set is a job that waits only for idle slots, which an embedding holds none
        # of, so it ran between two pieces: one response's vectors came from two adapter
        # sets, silently. (An adapter detached meanwhile is closed: its next piece fails.)
        fixed: list[AdapterSet] = []

        def run(piece: list[list[int]]) -> list[list[float]]:
            ctx = self._ctx
            if ctx is None or ctx.params.n_ubatch < size:
                if ctx is not None:
                    self._ctx = None
                    ctx.close()
                ctx = self._bmodel.new_context(
                    replace(
                        self._params,
                        embeddings=True,
                        n_seq_max=1,
                        n_ctx=size,
                        n_batch=size,
                        n_ubatch=size,
                    )
                )
                self._ctx, self._ctx_adapters = ctx, ()
            if not fixed:
                fixed.append(self._adapters(lora))
            wanted = fixed[0]
            if wanted != self._ctx_adapters:
                ctx.set_adapters(wanted)
                self._ctx_adapters = wanted
            return [_finite(ctx.embed(toks, normalize=normalize)) for toks in piece]

        vectors: list[list[float]] = []

        def unembedded(why: str) -> str:
            left = len(token_lists) - len(vectors)
            return f"{why} with {left} of its {len(token_lists)} inputs not embedded"

        for piece in pieces(token_lists, self._params.n_batch):
            # One piece at a time: the next is queued once this one is done, after the
            # worker's next tick, never ahead of the other requests' tokens.
            if cancel is not None and cancel.cancelled:
                raise RequestCancelledError(unembedded("the embedding was cancelled"))
            job = self._worker.call(functools.partial(run, piece))
            # A piece not yet begun is dropped from the worker's queue (Future.cancel).
            forget = cancel.on_cancel(job.cancel) if cancel is not None else None
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                vectors += job.result(wait)
            except CancelledError:
                raise RequestCancelledError(unembedded("the embedding was cancelled")) from None
            except TimeoutError:
                job.cancel()
                raise RequestTimeoutError(
                    unembedded(f"the embedding ran past its deadline ({timeout_s:g} s)")
                ) from None
            finally:
                if forget is not None:
                    forget()
        return vectors

    def _tokens(self, inputs: str | Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Each input's tokens, validated on the caller's thread."""
        if not _is_sequence(inputs):
            raise InvalidRequestError("input must be a text or a list of inputs", param="input")
        items = [inputs] if isinstance(inputs, str) else list(inputs)
        if not items:
            raise InvalidRequestError("no input to embed", param="input")
        limit = self._params.n_ctx
        token_lists = []
        for item in items:
            if isinstance(item, str):
                toks = self._bmodel.tokenize(item, add_special=True, parse_special=False)
            elif _is_sequence(item):
                toks = check_tokens(item, self._bmodel.facts.n_vocab, param="input")
            else:
                # Found by review: a flat list of ids ([1, 2, 3]) or None raised TypeError.
                raise InvalidRequestError(
                    f"each input is a text or a list of token ids, not {type(item).__name__} "
                    "(one tokenized input is [[1, 2, 3]])",
                    param="input",
                )
            # An empty text too, whatever the tokenizer adds: found by review, "" embedded a
            # lone BOS on a model that adds one (a vector of nothing) and was a 400 elsewhere.
            if not toks or (isinstance(item, str) and not item):
                raise InvalidRequestError("cannot embed an empty input", param="input")
            if len(toks) > limit:
                raise ContextOverflowError(
                    f"input has {len(toks)} tokens; the embedding context holds {limit}",
                    n_tokens=len(toks),
                    n_ctx=limit,
                    param="input",  # found by review: it named "prompt", a field embeddings lack
                )
            token_lists.append(toks)
        return token_lists

    def memory_bytes(self) -> ContextMemory:
        """What the embedding context holds (nothing before the first embedding)."""
        ctx = self._ctx
        return ctx.memory_bytes if ctx is not None else ContextMemory()

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()


def _finite(vector: list[float]) -> list[float]:
    """``vector``, if every value is a finite number; else ``BackendError``. Found by review:
    weights or adapters that overflow (a LoRA scale of 1e4 on SmolLM2, an adapter whose alpha
    is NaN) gave a vector of NaN, returned as it was: a 200 of NaN vectors under base64, an
    untyped 500 as JSON floats (which JSON cannot hold). As a generation's NaN logits are."""
    if not all(map(math.isfinite, vector)):
        raise BackendError(
            "the model computed an embedding whose values are not all finite numbers (NaN or "
            "infinite): its weights or its adapters overflow (is a LoRA scale far too large?)"
        )
    return vector


def _is_sequence(value: object) -> bool:
    """A text or a list of items; bytes are neither (they would pass as token ids)."""
    return isinstance(value, Sequence) and not isinstance(value, bytes | bytearray)
