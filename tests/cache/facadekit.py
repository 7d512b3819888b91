"""Helpers for index/facade tests: namespaces, requests, a controllable tier and a clock."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from kvwarm.cache.protocols import ReservationBook, RowBytes, StoredRow, TierCapabilities
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.types import Namespace, SaveReason, SaveRequest, TierName, TtlClass

NS = Namespace(fingerprint=b"\x11" * 32, quant=2, ctx_hash=b"\x22" * 32)
NS2 = Namespace(fingerprint=b"\x33" * 32, quant=2, ctx_hash=b"\x22" * 32)


def req(
    tokens: tuple[int, ...],
    size: int = 100,
    *,
    tier: TierName = "ram",
    ns: Namespace = NS,
    reason: SaveReason = SaveReason.COLD,
    ttl: TtlClass = TtlClass.SHORT,
) -> SaveRequest:
    return SaveRequest(ns, tokens, bytes([len(tokens) % 251]) * size, reason, tier, ttl_class=ttl)


class FakeClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class GatedTier:
    """A RamTier whose ``store`` parks on ``gate`` after reserving, and can be told to fail or
    to corrupt loads. ``entered`` is set once a store is parked at the gate."""

    def __init__(self, quota_bytes: int = 1 << 30, *, clock: FakeClock | None = None) -> None:
        self._inner = RamTier(quota_bytes)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_store = False
        self.corrupt: set[bytes] = set()
        self.deleted: list[bytes] = []
        self.hits: dict[bytes, int] = {}

    @property
    def name(self) -> TierName:
        return "ram"

    @property
    def quota_bytes(self) -> int:
        return self._inner.quota_bytes

    def store(self, key: bytes, request: SaveRequest, book: ReservationBook) -> StoredRow | None:
        self.entered.set()
        self.gate.wait(10)
        if self.fail_store:
            from kvwarm.errors import CacheIOError

            raise CacheIOError("injected failure")
        return self._inner.store(key, request, book)

    def load(self, row: StoredRow, buffer: bytearray | None = None) -> RowBytes:
        if row.info.key in self.corrupt:
            from kvwarm.errors import CacheFormatError

            raise CacheFormatError("injected corruption")
        return self._inner.load(row, buffer)

    def load_meta(self, row: StoredRow) -> RowBytes:
        if row.info.key in self.corrupt:
            from kvwarm.errors import CacheFormatError

            raise CacheFormatError("injected corruption")
        return self._inner.load_meta(row)

    def delete(self, key: bytes) -> None:
        self.deleted.append(key)
        self._inner.delete(key)

    def record_hit(self, row: StoredRow, hits: int, last_used: float) -> None:
        self.hits[row.info.key] = hits
        self._inner.record_hit(row, hits, last_used)

    def scan(self) -> Iterator[StoredRow]:
        return self._inner.scan()

    def probe(self, key: bytes) -> StoredRow | None:
        return self._inner.probe(key)

    def stored_keys(self) -> Iterator[bytes]:
        return self._inner.stored_keys()

    @property
    def capabilities(self) -> TierCapabilities:
        return self._inner.capabilities

    def problems(self) -> tuple[tuple[str, str], ...]:
        return self._inner.problems()

    def close(self) -> None:
        self._inner.close()
