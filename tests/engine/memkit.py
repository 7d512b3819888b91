"""What the real-model memory-kind tests share: an engine over a RAM (and optionally disk)
tier, a deterministic model saving to disk when it has one, and the bit-for-bit comparison."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvwarm.backends.base import ContextParams
from kvwarm.cache.types import CacheConfig, PolicyConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import Completion, GenerationOptions

#: A system prompt the Gemma 3 270M tests build their prompts on.
GEMMA_SYSTEM = (
    "You are the archivist of a small coastal town. You answer questions about its history, "
    "its harbour, its lighthouse and the families who kept it, in plain words. "
)


def exact_policy(n_batch: int, *, min_tokens: int = 16, cold_min_tokens: int = 64) -> PolicyConfig:
    """A save policy for exactness tests: cold saves at aligned ``n_batch`` boundaries, no
    continued saves, and every checkpoint, however close to the state below it (the gap that
    skips some is tested on the stub)."""
    return PolicyConfig(
        min_tokens=min_tokens,
        cold_min_tokens=cold_min_tokens,
        cold_max_tokens=100_000,
        continued_interval=10_000,
        boundary_trim_tokens=0,
        boundary_align_tokens=n_batch,
        session_resume_wait_ms=5000,
        evict_save_timeout_ms=30_000,
        checkpoint_gap_tokens=0,
    )


def engine(
    tmp: Path | None, policy: PolicyConfig, *, ram: int = 256 << 20, chunk_tokens: int = 256
) -> Engine:
    tiers = [TierConfig("ram", ram)]
    if tmp is not None:
        tiers.append(TierConfig("disk", 1 << 30, tmp / "disk"))
    cache = CacheConfig(tiers=tuple(tiers), chunk_tokens=chunk_tokens)
    return Engine(EngineConfig(cache=cache, policy=policy))


def load(
    eng: Engine, path: str, *, n_ctx: int, n_batch: int, det: bool = True, n_parallel: int = 1
) -> Model:
    cfg = ModelConfig(
        context=ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch),
        n_parallel=n_parallel,
        deterministic=det,
    )
    if "disk" in eng.cache.tier_names():
        cfg = replace(cfg, save_tier="disk")
    return eng.load_model(path, config=cfg)


def same(a: Completion, b: Completion) -> None:
    """Bit for bit: the same tokens and the same logprobs."""
    assert a.completion_tokens == b.completion_tokens
    assert a.logprobs is not None and b.logprobs is not None
    assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]


def together(
    model: Model, prompts: Sequence[list[int]], opts: GenerationOptions
) -> list[Completion]:
    """Every prompt at once, one thread each: the model's slots run them side by side."""
    out: list[Completion | None] = [None] * len(prompts)

    def run(i: int) -> None:
        out[i] = model.complete(prompts[i], opts)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [c for c in out if c is not None]
    assert len(done) == len(prompts), "a request failed (see its thread's traceback)"
    return done
