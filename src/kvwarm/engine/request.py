"""A request as the worker sees it, and the events it sends back to its caller."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from kvwarm.cache.types import TtlClass
from kvwarm.engine.channel import Channel
from kvwarm.engine.types import Completion, GenerationOptions

RequestKind = Literal["generate", "prewarm"]
_ids = itertools.count(1)


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
    id: int = field(default_factory=lambda: next(_ids))
    channel: Channel[Event] = field(default_factory=Channel)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
