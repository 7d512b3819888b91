"""A minimal, thread-safe ``ReservationBook`` for tier tests (the real one is the index).

One live reservation per key; published rows refuse new reservations. ``calls`` records the
protocol steps so tests can assert their order; ``lose_at`` makes check/publish report a lost
reservation to exercise those branches.
"""

from __future__ import annotations

import itertools
import threading

from kvwarm.cache.protocols import StoredRow
from kvwarm.cache.types import TierName


class FakeBook:
    def __init__(self, *, lose_at: str | None = None) -> None:
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self.lose_at = lose_at  # "check" or "publish"
        self.reservations: dict[bytes, int] = {}
        self.linked: dict[bytes, str] = {}
        self.published: dict[bytes, StoredRow] = {}
        self.calls: list[str] = []

    def reserve(self, key: bytes, tier: TierName) -> int | None:
        with self._lock:
            self.calls.append("reserve")
            if key in self.published or key in self.reservations:
                return None
            token = next(self._tokens)
            self.reservations[key] = token
            return token

    def check(self, key: bytes, token: int) -> bool:
        with self._lock:
            self.calls.append("check")
            return self.lose_at != "check" and self.reservations.get(key) == token

    def mark_linked(self, key: bytes, token: int, location: str) -> None:
        with self._lock:
            self.calls.append("mark_linked")
            self.linked[key] = location

    def publish(self, key: bytes, token: int, row: StoredRow) -> bool:
        with self._lock:
            self.calls.append("publish")
            if self.lose_at == "publish" or self.reservations.get(key) != token:
                return False
            del self.reservations[key]
            self.published[key] = row
            return True

    def abandon(self, key: bytes, token: int) -> None:
        with self._lock:
            self.calls.append("abandon")
            if self.reservations.get(key) == token:
                del self.reservations[key]

    def adopt(self, row: StoredRow) -> bool:
        with self._lock:
            self.calls.append("adopt")
            if row.info.key in self.published:
                return False
            self.published[row.info.key] = row
            return True
