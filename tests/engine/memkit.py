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
