"""Every model operation, declared once: what a served model offers, as protocols.

``ModelCalls`` are the non-streaming operations: one blocking call each, with plain picklable
arguments and results. ``ModelStreams`` are the generations: each returns ``OpStream``\\ s of
text fragments ending in a ``Completion``. ``ModelOps`` is both, plus the model's id and status
(which a serving side answers itself). The names the cluster's wire accepts (``CALLS``) and
the registry of every op with its kind (``OPS``) are derived from these protocols, never
listed by hand.

Invariants: ``kvwarm.engine.Model`` satisfies ``ModelOps`` (checked by mypy where it is
defined); the server's routes use a model only through ``ModelOps`` (``server.served``
names it ``ServedModel``); the cluster's ``RemoteModel`` subclasses ``ModelOps`` and forwards
each call generically (``cluster.remote``), so an operation added here and forgotten there is
an abstract-class error in mypy and a failing test. Adding an operation (as ``rerank`` was): its
signature here, its body in ``Model``, one line in ``RemoteModel``, then the route.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

from kvwarm.cache.types import TtlClass

if TYPE_CHECKING:
    from kvwarm.engine.cancel import Cancellation
    from kvwarm.engine.prompts import ExtraFile
    from kvwarm.engine.request import Fragment
    from kvwarm.engine.types import (
        Completion,
        CompletionStats,
        GenerationOptions,
        ModelInfo,
        ModelStatus,
        Reranking,
        TokenLogprob,
    )

Message = Mapping[str, object]
OpKind = Literal["call", "stream"]
OpName = str
"""The name of a non-streaming operation: a member of ``CALLS`` (checked where it is read)."""


class OpStream(Protocol):
    """Text fragments of one generation, ending in a ``Completion`` (or its error)."""

    @property
    def done(self) -> bool: ...

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[str]: ...

    def afragments(self) -> AsyncIterator[Fragment]:
        """The fragments with the logprobs of their tokens (a remote stream: text only)."""
        ...

    @property
    def prompt_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """Set once the prompt is prefilled, when prompt logprobs were asked for."""
        ...

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        """The prompt's tokens (a remote stream: empty)."""
        ...

    async def aresult(self) -> Completion: ...


class ModelCalls(Protocol):
    """The non-streaming operations: one blocking call each (routes run them on a thread)."""

    def info(self) -> ModelInfo: ...

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes as its vocabulary writes it, a special token's text included
        and no leading space taken off (llama.cpp's ``common_token_to_piece``: what
        llama-server's ``/tokenize`` pieces show)."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str: ...

    def chat_tokens(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[tuple[int, ...], str]:
        """The prompt tokens of a chat and its rendered text."""
        ...

    def count_chat_tokens(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        prefill: str = "",
    ) -> int:
        """The length of the prompt ``stream_chat`` would send: its images' and audio's
        positions counted, as ``chat_tokens`` (ids only) cannot."""
        ...

    def infill_tokens(
        self,
        prefix: str,
        suffix: str,
        *,
        prompt: str = "",
        extra: Sequence[ExtraFile] = (),
        n_predict: int | None = None,
    ) -> list[int]:
        """The fill-in-the-middle prompt for the text between ``prefix`` and ``suffix``."""
        ...

    def prewarm(
        self,
        prompt: str | Sequence[int],
        *,
        ttl_class: TtlClass = TtlClass.LONG,
        add_special: bool = True,
        cache_salt: str | None = None,
    ) -> CompletionStats:
        """Prefill ``prompt`` and save it, generating nothing."""
        ...

    def prewarm_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        ttl_class: TtlClass = TtlClass.LONG,
        cache_salt: str | None = None,
    ) -> CompletionStats:
        """Prefill the prompt every chat that starts with ``messages`` begins with (no
        generation prompt), its images and audio included, and save it."""
        ...

    def embed(
        self,
        inputs: str | Sequence[str | Sequence[int]],
        *,
        normalize: bool = True,
        lora: tuple[tuple[int, float], ...] | None = None,
        timeout_s: float | None = None,
        cancel: Cancellation | None = None,
    ) -> list[list[float]]:
        """One pooled vector per input (text or token ids), under the LoRA set ``lora``
        ((handle, scale) pairs; None: the model's own); past ``timeout_s`` the inputs not
        yet embedded are dropped (``RequestTimeoutError``), and once ``cancel`` is
        cancelled (``RequestCancelledError``)."""
        ...

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        max_tokens_per_doc: int | None = None,
        cache_salt: str | None = None,
        lora: tuple[tuple[int, float], ...] | None = None,
        timeout_s: float | None = None,
        cancel: Cancellation | None = None,
    ) -> Reranking:
        """The documents by relevance to ``query``, best first (a reranker only), under the
        LoRA set ``lora`` (as ``embed``'s); past ``timeout_s`` the documents not yet scored
        are cancelled (``RequestTimeoutError``), and once ``cancel`` is cancelled
        (``RequestCancelledError``)."""
        ...


class ModelStreams(Protocol):
    """The generations: each starts at once and returns its stream(s)."""

    def stream(
        self, prompt: str | Sequence[int], options: GenerationOptions | None = None
    ) -> OpStream: ...

    def submit(
        self, prompt: str | Sequence[int], options: GenerationOptions | None = None
    ) -> OpStream:
        """``stream`` without per-token events: the stream ends with the completion."""
        ...

    def stream_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
        prefill: str = "",
    ) -> OpStream:
        """``prefill``: text the reply continues (Anthropic's trailing assistant message)."""
        ...

    def streams(
        self,
        prompt: str | Sequence[int],
        options: GenerationOptions | None = None,
        *,
        n: int,
        fragments: bool = True,
    ) -> Sequence[OpStream]:
        """``n`` choices of one prompt (``fragments=False``: no per-token events)."""
        ...

    def chat_streams(
        self,
        messages: Sequence[Message],
        *,
        n: int,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
        fragments: bool = True,
    ) -> Sequence[OpStream]: ...


class ModelOps(ModelCalls, ModelStreams, Protocol):
    """A served model: every operation, plus what the serving side answers itself."""

    @property
    def id(self) -> str: ...

    def status(self) -> ModelStatus: ...


def _operations(protocol: type) -> frozenset[str]:
    return frozenset(
        name for name, value in vars(protocol).items() if callable(value) and name[0] != "_"
    )


CALLS: frozenset[OpName] = _operations(ModelCalls)
#: The calls that take a ``cancel`` (a ``Cancellation``): their caller can end them early.
CANCELLABLE: frozenset[OpName] = frozenset({"embed", "rerank"})
STREAMS: frozenset[str] = _operations(ModelStreams)
OPS: Mapping[str, OpKind] = {
    **{name: "call" for name in sorted(CALLS)},
    **{name: "stream" for name in sorted(STREAMS)},
}
