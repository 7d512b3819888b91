"""Save reservations: the state machine behind the crash-safe publish protocol.

Invariant: at most one live reservation per key, identified by a token never reused in this
process. A reservation is *live* while its token is the one stored for the key; the TTL only
decides when the reaper may take it away (and when a new writer may supersede it), so a slow
but healthy writer is not failed merely for being slow.

Two reaping stages (erllama's "two-stage TTL cleanup"): an expired reservation that never
reached ``mark_linked`` is dropped (no file exists); one that did is handed back as an
*orphan* so the owner can ask the tier to adopt the linked file if it parses, or delete it.

Not locked: ``Index`` owns the lock and calls in under it. No I/O here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kvwarm.cache.types import TierName

__all__ = ["Orphan", "Reservation", "Reservations"]


@dataclass(slots=True)
class Reservation:
    token: int
    tier: TierName
    deadline: float  # monotonic seconds
    location: str | None = None  # set by mark_linked: the final file exists from here on


@dataclass(frozen=True, slots=True)
class Orphan:
    """An expired reservation whose file was linked: adopt it if it parses, else delete."""

    key: bytes
    tier: TierName
    location: str


class Reservations:
    __slots__ = ("_by_key", "_clock", "_tokens", "_ttl_s")

    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._by_key: dict[bytes, Reservation] = {}
        self._tokens = itertools.count(1)

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def reserve(self, key: bytes, tier: TierName) -> int | None:
        """A fresh token, or None while another unexpired reservation holds ``key``."""
        now = self._clock()
        cur = self._by_key.get(key)
        if cur is not None and cur.deadline > now:
            return None
        # An expired holder is superseded: its token dies, so its check/publish will fail.
        token = next(self._tokens)
        self._by_key[key] = Reservation(token, tier, now + self._ttl_s)
        return token

    def check(self, key: bytes, token: int) -> bool:
        cur = self._by_key.get(key)
        return cur is not None and cur.token == token

    def mark_linked(self, key: bytes, token: int, location: str) -> bool:
        cur = self._by_key.get(key)
        if cur is None or cur.token != token:
            return False
        cur.location = location
        return True

    def take(self, key: bytes, token: int) -> Reservation | None:
        """Remove and return the reservation if ``token`` is live; None otherwise."""
        cur = self._by_key.get(key)
        if cur is None or cur.token != token:
            return None
        del self._by_key[key]
        return cur

    def reap(self) -> tuple[int, list[Orphan]]:
        """Drop every expired reservation. Returns (dropped without a file, linked orphans)."""
        now = self._clock()
        expired = [(k, r) for k, r in self._by_key.items() if r.deadline <= now]
        dropped = 0
        orphans: list[Orphan] = []
        for key, res in expired:
            del self._by_key[key]
            if res.location is None:
                dropped += 1
            else:
                orphans.append(Orphan(key, res.tier, res.location))
        return dropped, orphans
