"""llama.cpp's CPU flash attention takes its split-KV kernel for a one-token pass over a view of
512 cells or more (f16 or f32 K and V): each thread attends over its share of the cells and
the shares are combined after, so the thread count changes the pass's bits. Such a pass's
logits are a row's stored final logits (a prompt whose last chunk is one token), and its KV is
a row's wherever a prefill runs one-token passes (``n_ubatch`` 1); so the thread count is
hashed into a deterministic model's cache keys (``LlamaModel.kv_tag``), so that its restores
are the bits a cold run computes with this process's threads. Elsewhere another count's row
is the same prefix's KV rounded otherwise, as another CPU's, and is shared."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from kvwarm.backends import get_backend
from kvwarm.backends.base import BackendModel, ContextParams
from kvwarm.backends.llama import native
from kvwarm.backends.params import FlashAttn, KvType
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.embedded import default_model_path
from kvwarm.engine.api import Engine, EngineConfig

pytestmark = pytest.mark.model

#: Past 512 cells: the next one-token pass takes the split-KV kernel.
PROMPT = [int(t) for t in np.random.default_rng(7).integers(100, 40000, 514)]
FLASH = ContextParams(n_ctx=1024, n_batch=512, n_ubatch=512, flash_attn="on", type_k="f16",
                      type_v="f16")  # fmt: skip


@pytest.fixture(scope="module")
def smollm2() -> Iterator[BackendModel]:
    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    yield model
    model.close()


def _threads(n: int) -> ContextParams:
    return replace(FLASH, n_threads=n, n_threads_batch=n)


def _cold(model: BackendModel, params: ContextParams) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A canonical prefill of ``PROMPT[:-1]`` (a chunk of 512, then one token): the blob, the
    logits of that one-token pass, and of one more token's."""
    ctx = model.new_context(params)
    try:
        ctx.prefill(0, PROMPT[:512], 0)
        ctx.prefill(0, PROMPT[512:513], 512)
        stored = np.frombuffer(ctx.logits(), dtype=np.float32).copy()
        blob = ctx.kv_pack(0)
        ctx.prefill(0, PROMPT[513:], 513)
        return blob, stored, np.frombuffer(ctx.logits(), dtype=np.float32).copy()
    finally:
        ctx.close()


def test_a_one_token_pass_past_512_cells_depends_on_the_threads_so_the_keys_do(
    smollm2: BackendModel,
) -> None:
    """The premise and the guard: the same canonical prefill on 1 and on 2 threads stores
    other final logits and other KV bytes (the one-token pass's), and a 1-thread state
    restored into a 2-thread context gives other logits than that context computes cold; so
    the two contexts' tags and cache keys differ."""
    one, two = _threads(1), _threads(2)
    blob_1, stored_1, _ = _cold(smollm2, one)
    blob_2, stored_2, next_2 = _cold(smollm2, two)
    assert float(np.abs(stored_1 - stored_2).max()) > 1e-3
    assert blob_1 != blob_2
    ctx = smollm2.new_context(two)
    try:
        assert ctx.kv_unpack(0, blob_1) == 513
        ctx.prefill(0, PROMPT[513:], 513)
        mixed = np.frombuffer(ctx.logits(), dtype=np.float32)
        assert float(np.abs(mixed - next_2).max()) > 1e-3
    finally:
        ctx.close()
    tag_1, tag_2 = (smollm2.kv_tag(p, deterministic=True) for p in (one, two))
    assert tag_1 != tag_2 and one.kv_hash(tag_1) != two.kv_hash(tag_2)


@pytest.mark.parametrize(
    ("flash_attn", "type_k", "type_v", "threads", "tagged"),
    [
        ("on", "f16", "f16", 2, True),
        ("auto", "auto", "f32", 3, True),  # auto left alone: flash attention on the CPU, f16
        ("on", "f16", "f16", 1, False),  # one thread: one share, whatever the view
        ("off", "f16", "f16", 2, False),  # no flash attention: no split
        ("on", "q8_0", "f16", 2, False),  # quantized K: attended row by row in every pass
        ("on", "f16", "bf16", 2, False),
    ],
)
def test_the_thread_count_is_tagged_where_a_one_token_pass_splits_the_cells(
    smollm2: BackendModel,
    flash_attn: FlashAttn,
    type_k: KvType,
    type_v: KvType,
    threads: int,
    tagged: bool,
) -> None:
    params = replace(FLASH, flash_attn=flash_attn, type_k=type_k, type_v=type_v, n_threads=threads)
    tag = smollm2.kv_tag(params, deterministic=True)
    assert (f"threads{threads}" in tag.split(",")) is tagged
    # n_threads_batch runs passes of several rows, which never split the cells (measured).
    assert smollm2.kv_tag(replace(params, n_threads_batch=threads + 1), deterministic=True) == tag
    # Not deterministic: no bits promised, rows shared between thread counts.
    assert "threads" not in smollm2.kv_tag(params)


def test_unset_threads_are_tagged_as_the_process_runs_them(
    smollm2: BackendModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``n_threads`` None runs the CPUs this process may use: another machine's count."""
    monkeypatch.setattr(native, "default_threads", lambda: 5)
    tag = smollm2.kv_tag(FLASH, deterministic=True)
    assert "threads5" in tag.split(",")
    assert tag == smollm2.kv_tag(replace(FLASH, n_threads=5), deterministic=True)


def test_a_deterministic_models_namespace_holds_its_threads() -> None:
    """The engine's namespace: a deterministic model keeps flash attention (``auto``) on the
    CPU, so its f16 rows' keys name the threads that computed them."""

    def ctx_hash(threads: int, deterministic: bool) -> bytes:
        config = EngineConfig(CacheConfig(tiers=(TierConfig("ram", 1 << 24),)))
        with Engine(config) as engine:
            model = engine.load_model(
                str(default_model_path()),
                n_ctx=256,
                n_threads=threads,
                deterministic=deterministic,
                flash_attn="on",
            )
            return model.namespace().ctx_hash

    assert ctx_hash(1, True) != ctx_hash(2, True)
    assert ctx_hash(1, False) == ctx_hash(2, False)  # shared: no bits promised
