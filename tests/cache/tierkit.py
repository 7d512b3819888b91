"""Shared helpers for tier tests: requests with stub payloads and per-tier factories."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvwarm.cache.formats.key import cache_key
from kvwarm.cache.protocols import Tier
from kvwarm.cache.tiers.cotenants import PROCS
from kvwarm.cache.tiers.files import FileTier, StepHook
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.types import Namespace, SaveReason, SaveRequest, TierName, TtlClass

NS = Namespace(fingerprint=b"\x5a" * 32, quant=1, ctx_hash=b"\xa5" * 32)
TIERS: tuple[TierName, ...] = ("ram", "ram_file", "disk", "s3", "redis")


def request(
    tokens: tuple[int, ...],
    payload: bytes | None = None,
    *,
    tier: TierName = "disk",
    logits: bytes | None = None,
    reason: SaveReason = SaveReason.COLD,
) -> tuple[bytes, SaveRequest]:
    """(key, request) for ``tokens``; the payload defaults to bytes derived from the tokens."""
    if payload is None:
        payload = b"".join(t.to_bytes(4, "little") for t in tokens) * 3 + b"kv"
    req = SaveRequest(
        namespace=NS,
        tokens=tokens,
        payload=payload,
        reason=reason,
        tier=tier,
        logits=logits,
        prompt_text="stub",
        ttl_class=TtlClass.LONG,
        context_size=512,
        canonical_tokens=len(tokens),
    )
    return cache_key(NS, tokens), req


@contextmanager
def shm_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvwarm-test-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


TierFactory = Callable[[], Tier]


def factory(name: TierName, root: Path, on_step: StepHook | None = None) -> TierFactory:
    """A callable returning a fresh tier instance over the same storage (a 'restart')."""
    if name == "ram":
        return lambda: RamTier(1 << 30)
    return lambda: FileTier(name, root, 1 << 30, on_step=on_step)


def data_names(root: str | os.PathLike[str]) -> list[str]:
    """``os.listdir(root)`` without the registry of processes using it (``cotenants.py``),
    which holds no cache data."""
    return [n for n in os.listdir(root) if n != PROCS]
