"""Subprocess writer for fault tests. Talks to the parent over stdout (and stdin for ``race``).

writer_child.py kill  ROOT TIER STEP N      store N rows (ACK each), then SIGKILL self at STEP
                                      while storing the victim row
writer_child.py race  ROOT TIER ID          store the race row; pause at "checked" for "GO"
writer_child.py enospc ROOT                 on a tiny tmpfs: a fitting row, then one too big
writer_child.py chunked ROOT TIER STEP N    through a Cache: save N chunked rows (ACK each),
                                      then SIGKILL self at STEP of the victim's save
writer_child.py packed URL STEP N          as chunked, into a redis tier (``URL``) with packs:
                                      each save's new chunks in one pack object
writer_child.py windowed ROOT STEP K        through a Cache: save two checkpoints of a window
                                      model (ACK each), then SIGKILL self at the K-th STEP of
                                      a third one's save (its window in chunks)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.*

from tests.cache.fakebook import FakeBook
from tests.cache.tierkit import request

from kvwarm.cache.tiers.cotenants import PROCS
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.types import SaveRequest, TierName
from kvwarm.errors import CacheIOError


def row(i: int, size: int = 64 * 1024) -> tuple[bytes, SaveRequest]:
    """Row i of the kill test: deterministic so the parent can rebuild it."""
    return request(tuple(range(i, i + 50)), payload=bytes([i % 251]) * size)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def kill_mode(root: str, tier: str, step: str, n: int) -> None:
    book = FakeBook()
    plain = FileTier(cast(TierName, tier), root, 1 << 30)
    for i in range(n):
        key, req = row(i)
        assert plain.store(key, req, book) is not None
        say(f"ACK {key.hex()}")

    def hook(s: str) -> None:
        if s == step:
            os.kill(os.getpid(), signal.SIGKILL)

    victim = FileTier(cast(TierName, tier), root, 1 << 30, on_step=hook)
    key, req = row(n)
    say(f"VICTIM {key.hex()}")
    victim.store(key, req, book)
    say("SURVIVED")


def race_mode(root: str, tier: str, ident: int) -> None:
    steps: list[str] = []

    def hook(s: str) -> None:
        steps.append(s)
        if s == "checked":
            say("READY")
            if sys.stdin.readline().strip() != "GO":
                raise SystemExit("no GO")

    t = FileTier(cast(TierName, tier), root, 1 << 30, on_step=hook)
    key, req = request((1, 2, 3), payload=f"writer {ident} ".encode() * 1000)
    got = t.store(key, req, FakeBook())
    outcome = "LINKED" if "linked" in steps else "ADOPTED" if "adopted" in steps else "NONE"
    say(f"{outcome} {got.info.size if got else -1}")


def enospc_mode(root: str) -> None:
    t = FileTier("ram_file", root, 1 << 30)
    book = FakeBook()
    small_key, small = request((1,), payload=b"s" * 8 * 1024)
    small_row = t.store(small_key, small, book)
    assert small_row is not None and small_row.location is not None
    before = hashlib.sha256(Path(small_row.location).read_bytes()).hexdigest()
    big_key, big = request((2,), payload=b"b" * 1024 * 1024)  # the tmpfs holds 256 KiB
    err = None
    try:
        t.store(big_key, big, book)
    except CacheIOError as exc:
        err = exc.errno
    after = hashlib.sha256(Path(small_row.location).read_bytes()).hexdigest()
    intact = bytes(t.load(small_row).payload) == small.payload
    say(json.dumps({
        "errno": err, "before": before, "after": after, "intact": intact,
        "listing": sorted(n for n in os.listdir(root) if n != PROCS),
        "reservations": len(book.reservations),
        "small": small_key.hex(),
    }))  # fmt: skip


def chunked_rows(n: int) -> list[list[int]]:
    """Rows 0..n of the chunked kill test: each extends a shared 512-token prefix with chunks
    of its own, so the victim (row n) reuses chunks and writes new ones."""
    return [[*range(512), *range(10_000 * (i + 1), 10_000 * (i + 1) + 600)] for i in range(n + 1)]


def chunked_mode(root: str, tier: str, step: str, n: int) -> None:
    from tests.cache.chunkkit import chunked_request
    from tests.cache.tierkit import NS

    from kvwarm.cache import Cache, CacheConfig, TierConfig

    armed = False

    def hook(s: str) -> None:
        if armed and s == step:
            os.kill(os.getpid(), signal.SIGKILL)

    name = cast(TierName, tier)
    files = FileTier(name, root, 1 << 30, on_step=hook)
    cfg = CacheConfig(tiers=(TierConfig(name, 1 << 30, root=Path(root)),), chunk_tokens=256)
    rows = chunked_rows(n)
    with Cache(cfg, tiers=[files], background=False) as cache:
        for tokens in rows[:n]:
            key = cache.save(chunked_request(NS, tokens, tier=name), sync=True)
            assert key is not None
            say(f"ACK {key.hex()}")
        armed = True
        victim = chunked_request(NS, rows[n], tier=name)
        say(f"VICTIM {cache.key_for(NS, victim.tokens).hex()}")
        cache.save(victim, sync=True)
        say("SURVIVED")


def packed_mode(url: str, step: str, n: int) -> None:
    from tests.cache.chunkkit import chunked_request
    from tests.cache.tierkit import NS

    from kvwarm.cache import Cache, CacheConfig, TierConfig
    from kvwarm.cache.tiers.objects import ObjectTier
    from kvwarm.cache.tiers.redis import RedisStore

    armed = False

    def hook(s: str) -> None:
        if armed and s == step:
            os.kill(os.getpid(), signal.SIGKILL)

    tier = ObjectTier(RedisStore(url), 1 << 30, name="shared", on_step=hook)
    assert tier.capabilities.packs
    cfg = CacheConfig(tiers=(TierConfig("shared", 1 << 30, url=url),), chunk_tokens=256)
    rows = chunked_rows(n)
    with Cache(cfg, tiers=[tier], background=False) as cache:
        for tokens in rows[:n]:
            key = cache.save(chunked_request(NS, tokens, tier="shared"), sync=True)
            assert key is not None
            say(f"ACK {key.hex()}")
        armed = True
        victim = chunked_request(NS, rows[n], tier="shared")
        say(f"VICTIM {cache.key_for(NS, victim.tokens).hex()}")
        cache.save(victim, sync=True)
        say("SURVIVED")


#: The windowed kill test's checkpoints of one conversation: two acknowledged, then the victim,
#: whose save writes one first-cache chunk and three window chunks (then its manifest).
WINDOWED = (600, 700, 900)
WINDOWED_TOKENS = list(range(3000, 4000))


def windowed_mode(root: str, step: str, nth: int) -> None:
    from tests.cache.chunkkit import window_request
    from tests.cache.tierkit import NS

    from kvwarm.cache import Cache, CacheConfig, TierConfig

    armed = False
    seen = 0

    def hook(s: str) -> None:
        nonlocal seen
        if armed and s == step:
            seen += 1
            if seen == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    files = FileTier("disk", root, 1 << 30, on_step=hook)
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=Path(root)),), chunk_tokens=256)
    with Cache(cfg, tiers=[files], background=False) as cache:
        for n in WINDOWED[:-1]:
            key = cache.save(window_request(NS, WINDOWED_TOKENS[:n], [], tier="disk"), sync=True)
            assert key is not None
            say(f"ACK {key.hex()}")
        armed = True
        victim = window_request(NS, WINDOWED_TOKENS[: WINDOWED[-1]], [], tier="disk")
        say(f"VICTIM {cache.key_for(NS, victim.tokens).hex()}")
        cache.save(victim, sync=True)
        say("SURVIVED")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "kill":
        kill_mode(args[0], args[1], args[2], int(args[3]))
    elif mode == "race":
        race_mode(args[0], args[1], int(args[2]))
    elif mode == "chunked":
        chunked_mode(args[0], args[1], args[2], int(args[3]))
    elif mode == "packed":
        packed_mode(args[0], args[1], int(args[2]))
    elif mode == "windowed":
        windowed_mode(args[0], args[1], int(args[2]))
    elif mode == "enospc":
        enospc_mode(args[0])
    else:
        raise SystemExit(f"unknown mode {mode}")
