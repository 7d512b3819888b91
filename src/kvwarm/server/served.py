"""What the HTTP routes need of a model and of a generation, as protocols.

Invariant: the routes, ``Generation`` and the keep-alive use a model only through
``ServedModel`` and a generation only through ``ServedStream``. ``kvwarm.engine.Model`` and
``CompletionStream`` satisfy them in-process (``kvwarm serve``); the cluster ingress passes
proxies that forward to engine replicas (``kvwarm.cluster.remote``), so both servers run the
same route code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from kvwarm.cache.types import TtlClass

if TYPE_CHECKING:
    from kvwarm.engine.prompts import ExtraFile
    from kvwarm.engine.request import Fragment
    from kvwarm.engine.types import (
        Completion,
        CompletionStats,
        GenerationOptions,
        ModelInfo,
        ModelStatus,
        TokenLogprob,
    )

Message = Mapping[str, object]


class ServedStream(Protocol):
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


class ServedModel(Protocol):
    @property
    def id(self) -> str: ...

    def info(self) -> ModelInfo: ...

    def status(self) -> ModelStatus: ...

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

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
    ) -> tuple[tuple[int, ...], str]: ...

    def stream(
        self, prompt: str | Sequence[int], options: GenerationOptions | None = None
    ) -> ServedStream: ...

    def submit(
        self, prompt: str | Sequence[int], options: GenerationOptions | None = None
    ) -> ServedStream: ...

    def stream_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
    ) -> ServedStream: ...

    def streams(
        self,
        prompt: str | Sequence[int],
        options: GenerationOptions | None = None,
        *,
        n: int,
        fragments: bool = True,
    ) -> Sequence[ServedStream]:
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
    ) -> Sequence[ServedStream]: ...

    def infill_tokens(
        self, prefix: str, suffix: str, *, prompt: str = "", extra: Sequence[ExtraFile] = ()
    ) -> list[int]: ...

    def prewarm(
        self,
        prompt: str | Sequence[int],
        *,
        ttl_class: TtlClass = TtlClass.LONG,
        add_special: bool = True,
        cache_salt: str | None = None,
    ) -> CompletionStats: ...

    def embed(
        self, inputs: str | Sequence[str | Sequence[int]], *, normalize: bool = True
    ) -> list[list[float]]: ...


def stalled_for(model: object) -> float:
    """Seconds ``model``'s worker has gone without ticking; 0.0 for a served model that has
    no local worker to watch (a remote replica)."""
    probe = getattr(model, "stalled_for", None)
    return float(probe()) if callable(probe) else 0.0
