"""Subprocess for the randomised crash harness (``test_crash_harness.py``): runs ``SCRIPT``
through a ``Cache`` on one local file tier and may SIGKILL itself at the Nth filesystem
operation of one kind.

crash_child.py ROOT TIER [KIND N WHEN]

``KIND``: one of ``OPS``' kinds (``write``, ``fsync``, ``link``, ``unlink``, ``rename``);
``WHEN``: ``before`` the Nth such call, ``after`` it returned, or ``torn`` (a write: half of
its bytes written, then the kill). Without them it runs to the end (the reference run) and
prints ``COUNTS {kind: calls}``.

Each operation ``i`` of the script is announced ``BEGIN i <key hex>`` (the row it saves or
deletes) and acknowledged ``ACK i <sorted hex keys the index holds>`` once it returned: a
save is published (and its quota enforced) when ``Cache.save(sync=True)`` returns.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

from tests.cache.chunkkit import (
    PER_TOKEN,
    blob,
    chunked_request,
    join,
    join_rest,
    rest_of,
    two_part_request,
    window_cells,
    window_request,
)
from tests.cache.tierkit import NS

from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.types import SaveReason, SaveRequest, TierName

CHUNK_TOKENS = 256
#: Small enough that the script's saves evict (a chunked 1000-token row is ~1 MiB).
QUOTA = 4 << 20
WINDOW = 100  # chunkkit.window_request's

#: The os calls counted, by kind.
OPS: dict[str, tuple[str, ...]] = {
    "write": ("write", "writev", "pwrite"),
    "fsync": ("fsync", "fdatasync"),
    "link": ("link",),
    "unlink": ("unlink", "remove"),
    "rename": ("rename", "replace"),
}


@dataclass(frozen=True)
class Row:
    """One row of the script: ``kind`` is how it is saved (and what it restores to)."""

    kind: str  # "chunked", "window", "two_part", "whole"
    tokens: tuple[int, ...]

    @property
    def key(self) -> bytes:
        return cache_key(NS, self.tokens)

    def request(self, tier: TierName) -> SaveRequest:
        if self.kind == "chunked":
            return chunked_request(NS, self.tokens, tier=tier)
        if self.kind == "window":
            return window_request(NS, self.tokens, [], tier=tier)
        if self.kind == "two_part":
            return two_part_request(NS, self.tokens, [], tier=tier)
        return SaveRequest(NS, self.tokens, self.expected(), SaveReason.CONTINUED, tier)

    def expected(self) -> bytes:
        """What a restore of the row gives back, byte for byte."""
        n = len(self.tokens)
        if self.kind == "window":
            return blob(self.tokens) + window_cells(self.tokens, max(0, n - WINDOW), n)
        if self.kind == "two_part":
            return blob(self.tokens) + rest_of(self.tokens)
        if self.kind == "whole":
            return bytes([n % 251]) * (n * PER_TOKEN // 4)
        return blob(self.tokens)


def _conv(base: int, n: int) -> tuple[int, ...]:
    return tuple(range(base, base + n))


SHARED = tuple(range(600))  # the prefix rows A and B share (two chunks)
A = Row("chunked", SHARED + _conv(10_000, 300))
B = Row("chunked", SHARED + _conv(20_000, 400))
W1 = Row("window", _conv(30_000, 600))
W2 = Row("window", _conv(30_000, 900))  # extends W1: shares its first-cache chunks
W3 = Row("window", _conv(30_000, 1000))
T1 = Row("two_part", _conv(40_000, 700))
T2 = Row("two_part", _conv(40_000, 800))
H1 = Row("whole", _conv(50_000, 40))
H2 = Row("whole", _conv(60_000, 64))
C = Row("chunked", SHARED + _conv(70_000, 200))

#: (op, row or bytes): save a row, delete a row (a retire), restore a row (its hit fields then
#: written), or evict about that many bytes.
SCRIPT: tuple[tuple[str, Any], ...] = (
    ("save", A),
    ("save", B),
    ("save", W1),
    ("save", H1),
    ("save", W2),
    ("delete", A),  # B keeps the shared chunks
    ("restore", B),  # its hit fields rewritten in place (a pwrite)
    ("save", T1),
    ("save", T2),
    ("save", C),  # the quota evicts from here on
    ("evict", 1 << 20),
    ("save", W3),
    ("delete", W2),
    ("restore", W3),
    ("save", H2),
    ("save", A),  # saved again after its retire
    ("evict", 2 << 20),
    ("save", B),
)

ROWS: dict[bytes, Row] = {r.key: r for op, r in SCRIPT if isinstance(r, Row)}


def restored(cache: Any, key: bytes) -> bytes:
    with cache.open_row(key) as row:
        if row.rest_chunks:
            return join(row.chunks) + join_rest(row.rest_chunks, row.rest_from)
        return join(row.chunks) + bytes(row.payload)


def config(root: Path, tier: TierName, quota: int) -> Any:
    from kvwarm.cache import CacheConfig, TierConfig

    return CacheConfig(
        tiers=(TierConfig(tier, quota, root=root),),
        chunk_tokens=CHUNK_TOKENS,
        writer_threads=1,
    )


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Killer:
    """Counts the calls of ``OPS`` (every kind) and kills the process at the ``nth`` of
    ``kind``."""

    def __init__(self, kind: str | None, nth: int, when: str) -> None:
        self.counts = dict.fromkeys(OPS, 0)
        self._kind, self._nth, self._when = kind, nth, when
        for k, names in OPS.items():
            for name in names:
                setattr(os, name, self._wrap(k, name, getattr(os, name)))

    def _wrap(self, kind: str, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[kind] += 1
            hit = kind == self._kind and self.counts[kind] == self._nth
            if hit and self._when == "before":
                die()
            if hit and self._when == "torn" and kind == "write":
                _torn(real, name, args)
                die()
            out = real(*args, **kwargs)
            if hit:
                die()
            return out

        return counted


def _torn(real: Callable[..., Any], name: str, args: Sequence[Any]) -> None:
    """Half of a write's bytes, as a kill in the middle of a long write leaves them."""
    fd, data = args[0], args[1]
    if name == "writev":
        data = b"".join(bytes(memoryview(b).cast("B")) for b in data)
    half = bytes(memoryview(data).cast("B"))[: max(0, memoryview(data).nbytes // 2)]
    if name == "pwrite":
        real(fd, half, args[2])
    elif name == "writev":
        real(fd, [half])
    else:
        real(fd, half)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(root: Path, tier: TierName, kind: str | None, nth: int, when: str) -> None:
    killer = Killer(kind, nth, when)
    from kvwarm.cache import Cache

    with Cache(config(root, tier, QUOTA), background=False) as cache:
        for i, (op, arg) in enumerate(SCRIPT):
            if op == "save":
                say(f"BEGIN {i} {arg.key.hex()}")
                assert cache.save(arg.request(tier), sync=True) == arg.key
            elif op == "delete":
                say(f"BEGIN {i} {arg.key.hex()}")
                cache.delete(arg.key)
            elif op == "restore":
                say(f"BEGIN {i} -")
                assert restored(cache, arg.key) == arg.expected()
                cache.persist_hits()
            else:
                say(f"BEGIN {i} -")
                cache.evict_bytes(arg)
            say(f"ACK {i} {json.dumps(sorted(r.key.hex() for r in cache.rows()))}")
    say(f"COUNTS {json.dumps(killer.counts)}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 2:
        main(Path(args[0]), cast(TierName, args[1]), None, 0, "")
    else:
        main(Path(args[0]), cast(TierName, args[1]), args[2], int(args[3]), args[4])
