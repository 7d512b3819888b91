"""A request as the worker sees it, the checks it passes before it is queued, and the events
it sends back to its caller.

Invariant: a queued request's prompt is non-empty, leaves room for one generated token, and
holds only valid token ids, so the worker never has to refuse one (``docs/architecture.md``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvwarm.cache.types import TtlClass
from kvwarm.engine.channel import Channel
from kvwarm.engine.types import Completion, GenerationOptions
from kvwarm.errors import ContextOverflowError, InvalidRequestError

RequestKind = Literal["generate", "prewarm"]


@dataclass(frozen=True, slots=True)
class Done:
    completion: Completion


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


Event = str | Done | Failed


@dataclass(slots=True, eq=False)
class Request:
    prompt_tokens: tuple[int, ...]
    options: GenerationOptions
    grammar: str | None
    deterministic: bool
    kind: RequestKind = "generate"
    ttl_class: TtlClass = TtlClass.SHORT
    prompt_text: str = ""
    # False for complete()/chat(): only the final event is sent, so the caller's thread is
    # not woken once per token (on few cores that wake-up steals time from the decode).
    fragments: bool = True
    channel: Channel[Event] = field(default_factory=Channel)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)


def check_tokens(tokens: Sequence[int], n_vocab: int, *, param: str = "prompt") -> list[int]:
    """``tokens`` as a list, if every one is a valid id of an ``n_vocab`` vocabulary."""
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
            raise InvalidRequestError(
                f"token {t!r} is not a valid id for this vocabulary (0..{n_vocab - 1})",
                param=param,
            )
        out.append(t)
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
