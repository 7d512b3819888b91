"""Keep-alive: re-warm prewarmed prefixes before their cache TTL lapses.

Invariant: an entry is re-warmed once ``stale_fraction`` of its TTL class's lifetime has passed
since it was last warmed, so a prefix someone asked to keep warm never expires while the server
runs. Re-warming is best effort (a failure is logged and retried next tick) and never retries in
a loop. The clock is injectable so tests drive ``tick`` without waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwarm.cache.types import TtlClass
from kvwarm.errors import KvwarmError

if TYPE_CHECKING:
    from kvwarm.engine.api import Model

log = logging.getLogger("kvwarm.server.keepalive")

Prompt = str | tuple[int, ...]


@dataclass(slots=True)
class Prewarmed:
    model_id: str
    prompt: Prompt
    ttl_class: TtlClass
    last_warm: float
    add_special: bool = True  # False for rendered chat text (the template carries BOS)
    warms: int = 1
    failures: int = 0


class KeepAlive:
    def __init__(
        self,
        ttl_seconds: Sequence[float],
        stale_fraction: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl = tuple(ttl_seconds)
        self._fraction = stale_fraction
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, Prompt], Prewarmed] = {}

    def register(
        self,
        model_id: str,
        prompt: str | Sequence[int],
        ttl_class: TtlClass,
        *,
        add_special: bool = True,
    ) -> None:
        key_prompt: Prompt = prompt if isinstance(prompt, str) else tuple(prompt)
        with self._lock:
            self._entries[(model_id, key_prompt)] = Prewarmed(
                model_id, key_prompt, ttl_class, self._clock(), add_special
            )

    def forget(self, model_id: str) -> None:
        with self._lock:
            for key in [k for k in self._entries if k[0] == model_id]:
                del self._entries[key]

    def entries(self) -> list[Prewarmed]:
        with self._lock:
            return list(self._entries.values())

    def due(self) -> list[Prewarmed]:
        now = self._clock()
        with self._lock:
            return [
                e
                for e in self._entries.values()
                if now - e.last_warm >= self._fraction * self._ttl[int(e.ttl_class)]
            ]

    def tick(self, resolve: Callable[[str], Model | None]) -> int:
        """Re-warm every due entry whose model is ready; the number re-warmed."""
        done = 0
        for entry in self.due():
            model = resolve(entry.model_id)
            if model is None:
                continue
            prompt = entry.prompt if isinstance(entry.prompt, str) else list(entry.prompt)
            try:
                model.prewarm(prompt, ttl_class=entry.ttl_class, add_special=entry.add_special)
            except KvwarmError as exc:
                entry.failures += 1
                log.warning("keep-alive re-warm for %s failed: %s", entry.model_id, exc)
                continue
            with self._lock:
                entry.last_warm = self._clock()
                entry.warms += 1
            done += 1
        if done:
            log.info("keep-alive re-warmed %d prefix(es)", done)
        return done
