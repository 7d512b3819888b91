"""Keep-alive: re-warm prewarmed prefixes before their cache TTL lapses, within bounds.

Invariants: an entry is re-warmed once ``stale_fraction`` of its TTL class's lifetime has passed
since it was last warmed, so a prefix someone asked to keep warm does not expire while it is
kept. What is kept is bounded, because every entry costs a background prefill per TTL period:
at most ``max_entries`` entries and ``max_tokens`` tokens in all (``register`` refuses more with
``KeepAliveFullError``), and an entry not registered again for ``max_age_s`` seconds is dropped
(0: never). Pinned entries (the operator's ``prewarm_system`` prompts) never age out and are
not refused. Re-warming is best effort: a failure, of any kind, fails only its entry, is logged
and retried with exponential backoff (the keep-alive interval after the first consecutive
failure, doubling after each next one, at most the entry's re-warm period: its TTL's
``stale_fraction``; a success resets it), so a prefix that keeps failing costs a prefill and a
warning per period, not per tick. A failure of a permanent kind (``PERMANENT``: the prompt is
invalid or too long for the model's context, the model no longer exists) drops an unpinned
entry with one log line; a pinned entry keeps retrying with backoff. A model unloaded while
its entry re-warms is no failure: its entries wait for it to load again (none is loaded for
them). An entry re-warms under
the cache salt it was prewarmed with, and the same prompt under two salts is two entries
(``server.tenancy``).
The clock is injectable so tests drive ``tick`` without waiting.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwarm.cache.types import TtlClass
from kvwarm.errors import (
    EngineClosedError,
    InvalidRequestError,
    KeepAliveFullError,
    KvwarmError,
    ModelNotFoundError,
    UnknownModelError,
)

if TYPE_CHECKING:
    from kvwarm.engine.types import CompletionStats
    from kvwarm.server.served import ServedModel

log = logging.getLogger("kvwarm.server.keepalive")

#: Re-warm failures that retrying cannot mend (``ContextOverflowError`` is an
#: ``InvalidRequestError``): an unpinned entry is dropped on the first.
PERMANENT: tuple[type[KvwarmError], ...] = (
    InvalidRequestError,
    ModelNotFoundError,
    UnknownModelError,
)


@dataclass(frozen=True, slots=True)
class ChatPrefix:
    """A chat prewarmed by its messages (``ModelCalls.prewarm_chat``): its images and audio
    are in the prompt only as content, so it is re-warmed from the messages, not from ids.
    Canonical JSON: equal chats are one entry."""

    messages: str
    tools: str = "null"

    @classmethod
    def of(
        cls, messages: Sequence[Mapping[str, object]], tools: Sequence[Mapping[str, object]] | None
    ) -> ChatPrefix:
        return cls(json.dumps(list(messages), sort_keys=True), json.dumps(tools, sort_keys=True))

    def prewarm(
        self, model: ServedModel, ttl_class: TtlClass, cache_salt: str | None
    ) -> CompletionStats:
        messages = json.loads(self.messages)
        tools = json.loads(self.tools)
        return model.prewarm_chat(messages, tools=tools, ttl_class=ttl_class, cache_salt=cache_salt)


Prompt = str | tuple[int, ...] | ChatPrefix


def prompt_tokens(model: ServedModel, prompt: str | Sequence[int] | ChatPrefix) -> int:
    """How many tokens a prewarm of ``prompt`` prefills (at least), measured without
    prefilling it, so that a prewarm past ``max_tokens`` is refused before its prefill (found
    by review: a text prompt or a chat counted as 0 then, was prefilled and saved, and only
    then refused). Text is tokenized as ``prewarm`` tokenizes it; a chat rendered as
    ``prewarm_chat`` renders it, but one with images or audio, whose positions only its
    prefill counts, as 0 (``register`` measures it after)."""
    if isinstance(prompt, str):
        return len(model.tokenize(prompt, add_special=True, parse_special=True))
    if not isinstance(prompt, ChatPrefix):
        return len(prompt)
    messages = json.loads(prompt.messages)
    tools = json.loads(prompt.tools)
    try:
        tokens, _ = model.chat_tokens(messages, tools=tools, add_generation_prompt=False)
    except InvalidRequestError:  # images or audio (or a chat the prewarm itself refuses)
        return 0
    return len(tokens)


@dataclass(frozen=True, slots=True)
class KeepAliveLimits:
    max_entries: int = 16
    max_tokens: int = 16384
    max_age_s: float = 86400.0  # 0: entries never age out


@dataclass(slots=True)
class Prewarmed:
    model_id: str
    prompt: Prompt
    ttl_class: TtlClass
    last_warm: float
    add_special: bool = True  # False for rendered chat text (the template carries BOS)
    warms: int = 1
    failures: int = 0
    failing: int = 0  # consecutive failures since the last success (the backoff's exponent)
    retry_at: float = 0.0  # after a failure: not tried again before this (clock time)
    n_tokens: int = 0
    registered: float = 0.0  # when last (re-)registered: the age that max_age_s bounds
    pinned: bool = False
    cache_salt: str | None = None  # a tenant's secret: never listed or logged

    @property
    def id(self) -> str:
        """A stable id for the listing and ``DELETE``: a hash of what identifies the entry."""
        return entry_id(self.model_id, self.prompt, self.cache_salt)

    def warm(
        self,
        prewarm: Callable[..., CompletionStats],
        prewarm_chat: Callable[..., CompletionStats],
    ) -> CompletionStats:
        """Prefill the entry's prompt again through a model's ``prewarm`` (a prompt) or
        ``prewarm_chat`` (a chat: its images and audio too), under its TTL class and salt;
        the cluster's ingress passes them bound to one replica (``on``)."""
        if isinstance(self.prompt, ChatPrefix):
            return prewarm_chat(
                json.loads(self.prompt.messages),
                tools=json.loads(self.prompt.tools),
                ttl_class=self.ttl_class,
                cache_salt=self.cache_salt,
            )
        prompt = self.prompt if isinstance(self.prompt, str) else list(self.prompt)
        return prewarm(
            prompt,
            ttl_class=self.ttl_class,
            add_special=self.add_special,
            cache_salt=self.cache_salt,
        )


def entry_id(model_id: str, prompt: Prompt, cache_salt: str | None = None) -> str:
    # Unsalted entries keep the ids they always had.
    ident = (model_id, prompt) if cache_salt is None else (model_id, prompt, cache_salt)
    raw = repr(ident).encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()[:16]


EntryKey = tuple[str, str | None, Prompt]  # (model id, cache salt, prompt)


class KeepAlive:
    def __init__(
        self,
        ttl_seconds: Sequence[float],
        stale_fraction: float,
        clock: Callable[[], float] = time.monotonic,
        limits: KeepAliveLimits | None = None,
        interval_s: float = 60.0,
    ) -> None:
        self._ttl = tuple(ttl_seconds)
        self._interval = interval_s  # the server's tick: the backoff's first step
        self._fraction = stale_fraction
        self._clock = clock
        self.limits = limits or KeepAliveLimits()
        self._lock = threading.Lock()
        self._entries: dict[EntryKey, Prewarmed] = {}

    def check_room(
        self,
        model_id: str,
        prompt: str | Sequence[int] | ChatPrefix,
        n_tokens: int = 0,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Raise ``KeepAliveFullError`` if registering this prompt would pass a limit (so a
        caller can refuse before doing the prefill)."""
        key = (model_id, cache_salt, _key_prompt(prompt))
        with self._lock:
            self._expire_locked(self._clock())
            self._check_locked(key, n_tokens)

    def register(
        self,
        model_id: str,
        prompt: str | Sequence[int] | ChatPrefix,
        ttl_class: TtlClass,
        *,
        add_special: bool = True,
        n_tokens: int = 0,
        pinned: bool = False,
        cache_salt: str | None = None,
    ) -> Prewarmed:
        """Keep ``prompt`` warm under ``cache_salt`` (registering it again refreshes its age);
        raises ``KeepAliveFullError`` past a limit, unless ``pinned``."""
        key = (model_id, cache_salt, _key_prompt(prompt))
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            if not pinned:
                self._check_locked(key, n_tokens)
            old = self._entries.get(key)
            entry = Prewarmed(
                model_id,
                key[2],
                ttl_class,
                now,
                add_special,
                n_tokens=n_tokens,
                cache_salt=cache_salt,
            )
            entry.registered, entry.pinned = now, pinned or (old is not None and old.pinned)
            self._entries[key] = entry
            return entry

    def _check_locked(self, key: EntryKey, n_tokens: int) -> None:
        others = [e for k, e in self._entries.items() if k != key]
        if len(others) + 1 > self.limits.max_entries:
            raise KeepAliveFullError(
                f"keep-alive holds its maximum of {self.limits.max_entries} prefixes; "
                "remove some (DELETE /cache/keepalive/{id}) or prewarm with keep_alive false"
            )
        total = sum(e.n_tokens for e in others) + n_tokens
        if total > self.limits.max_tokens:
            raise KeepAliveFullError(
                f"keep-alive would hold {total} tokens, over its limit of "
                f"{self.limits.max_tokens}; remove some prefixes or prewarm with keep_alive false"
            )

    def _expire_locked(self, now: float) -> None:
        max_age = self.limits.max_age_s
        if max_age <= 0:
            return
        old = [
            k for k, e in self._entries.items() if not e.pinned and now - e.registered >= max_age
        ]
        for key in old:
            log.info("keep-alive entry %s expired after %.0f s", self._entries[key].id, max_age)
            del self._entries[key]

    def forget(self, model_id: str) -> None:
        with self._lock:
            for key in [k for k in self._entries if k[0] == model_id]:
                del self._entries[key]

    def remove(self, ident: str | None = None) -> int:
        """Drop the entry with id ``ident`` (every entry if None); the number dropped."""
        with self._lock:
            keys = [k for k, e in self._entries.items() if ident is None or e.id == ident]
            for key in keys:
                del self._entries[key]
            return len(keys)

    def entries(self) -> list[Prewarmed]:
        with self._lock:
            self._expire_locked(self._clock())
            return list(self._entries.values())

    def now(self) -> float:
        return self._clock()

    def due(self) -> list[Prewarmed]:
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            return [
                e
                for e in self._entries.values()
                if now - e.last_warm >= self._period(e) and now >= e.retry_at
            ]

    def _period(self, entry: Prewarmed) -> float:
        return self._fraction * self._ttl[int(entry.ttl_class)]

    def _failed(self, entry: Prewarmed, exc: BaseException, *, unexpected: bool = False) -> None:
        """Count a failed re-warm of ``entry``: back it off, or drop it (one log line) when
        the failure is permanent and the entry is not pinned."""
        now = self._clock()
        with self._lock:
            entry.failures += 1
            entry.failing += 1
            if isinstance(exc, PERMANENT) and not entry.pinned:
                key = (entry.model_id, entry.cache_salt, entry.prompt)
                if self._entries.get(key) is entry:
                    del self._entries[key]
                log.warning(
                    "keep-alive dropped %s (model %s): its re-warm cannot succeed: %s",
                    entry.id,
                    entry.model_id,
                    exc,
                )
                return
            delay = min(self._interval * 2 ** min(entry.failing - 1, 32), self._period(entry))
            entry.retry_at = now + delay
        if unexpected:
            log.error(
                "keep-alive re-warm of %s (model %s) failed unexpectedly; retrying in %.0f s",
                entry.id,
                entry.model_id,
                delay,
                exc_info=exc,
            )
        else:
            log.warning(
                "keep-alive re-warm of %s (model %s) failed (%d in a row); retrying in %.0f s: %s",
                entry.id,
                entry.model_id,
                entry.failing,
                delay,
                exc,
            )

    def tick(self, resolve: Callable[[str], ServedModel | None]) -> int:
        """Re-warm every due entry whose model is ready; the number re-warmed. ``resolve``
        gives the ready model, None while it is not ready, or raises a ``KvwarmError`` when
        it is gone (``UnknownModelError``: the entry's failure, which drops it)."""
        done = 0
        for entry in self.due():
            try:
                model = resolve(entry.model_id)
            except KvwarmError as exc:
                self._failed(entry, exc)
                continue
            if model is None:
                continue
            try:
                entry.warm(model.prewarm, model.prewarm_chat)
            except KvwarmError as exc:
                if isinstance(exc, EngineClosedError) and _unloaded(resolve, entry, model):
                    # Found by review: a model unloaded (idle, the budget, an admin) between
                    # the look above and the re-warm made that the entry's failure, a
                    # warning and a backoff; its entries wait for it, as when found unloaded.
                    continue
                self._failed(entry, exc)
                continue
            except Exception as exc:  # a bug: this entry's failure, never the loop's end
                self._failed(entry, exc, unexpected=True)
                continue
            with self._lock:
                entry.last_warm = self._clock()
                entry.warms += 1
                entry.failing, entry.retry_at = 0, 0.0
            done += 1
        if done:
            log.info("keep-alive re-warmed %d prefix(es)", done)
        return done


def _unloaded(
    resolve: Callable[[str], ServedModel | None], entry: Prewarmed, model: ServedModel
) -> bool:
    """Whether ``model``, which ``resolve`` gave for ``entry``, is no longer the ready one."""
    try:
        return resolve(entry.model_id) is not model
    except KvwarmError:  # gone altogether: the next tick drops the entry
        return True


def _key_prompt(prompt: str | Sequence[int] | ChatPrefix) -> Prompt:
    return prompt if isinstance(prompt, str | ChatPrefix) else tuple(prompt)
