"""GPU and context settings as llama.cpp receives them: the filled ``llama_model_params`` /
``llama_context_params`` structs (no model needed), what the stub backend is handed through the
engine, and the real CPU model running with them (``n_gpu_layers`` accepted by a CPU build)."""

from __future__ import annotations

import ctypes
import os
from dataclasses import replace
from pathlib import Path

import pytest
from tests.conftest import GPU_LAYERS_ENV

from kvwarm.backends.base import ContextParams, ModelParams
from kvwarm.backends.llama import native as _native
from kvwarm.backends.llama import params as llama_params
from kvwarm.backends.stub import StubBackend, StubModel
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import ConfigError, InvalidRequestError


def test_model_params_struct() -> None:
    lib = _native.lib()
    native = llama_params.model_params(
        lib,
        ModelParams(
            n_gpu_layers=-1, split_mode="row", main_gpu=1, tensor_split=(3, 1), use_mmap=False,
            use_mlock=True,
        ),
        None,
    )  # fmt: skip
    mp = native.struct
    assert (mp.n_gpu_layers, mp.split_mode, mp.main_gpu) == (-1, 2, 1)  # type: ignore[attr-defined]
    shares = mp.tensor_split  # type: ignore[attr-defined]
    n = int(lib.llama_max_devices())
    assert [shares[i] for i in range(n)] == [3.0, 1.0] + [0.0] * (n - 2)
    assert mp.load_mode == 2  # type: ignore[attr-defined]  # LLAMA_LOAD_MODE_MLOCK
    assert any(isinstance(k, ctypes.Array) for k in native.keep)  # the array outlives the load
    defaults = llama_params.model_params(lib, ModelParams(), None).struct
    assert (defaults.n_gpu_layers, defaults.split_mode, defaults.load_mode) == (0, 1, 1)  # type: ignore[attr-defined]
    assert not defaults.tensor_split  # type: ignore[attr-defined]  # NULL: llama.cpp's choice
    with pytest.raises(ConfigError, match=f"at most {n} devices"):
        llama_params.model_params(lib, ModelParams(tensor_split=(1.0,) * (n + 1)), None)
    with pytest.raises(ConfigError, match="n_gpu_layers"):
        llama_params.model_params(lib, ModelParams(n_gpu_layers=-7), None)


def test_context_params_struct() -> None:
    lib = _native.lib()
    cp = llama_params.context_params(
        lib,
        ContextParams(
            n_ctx=1024, flash_attn="on", type_k="q8_0", type_v="q4_0", n_threads=2,
            n_threads_batch=3, rope_scaling="yarn", rope_freq_base=1e6, rope_freq_scale=0.5,
            yarn_ext_factor=1.0, yarn_attn_factor=2.0, yarn_beta_fast=16.0, yarn_beta_slow=2.0,
            yarn_orig_ctx=2048,
        ),
    )  # fmt: skip
    got = {name: getattr(cp, name) for name in (
        "n_ctx", "flash_attn_type", "type_k", "type_v", "n_threads", "n_threads_batch",
        "rope_scaling_type", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor",
        "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx", "kv_unified",
    )}  # fmt: skip
    assert got == {
        "n_ctx": 1024, "flash_attn_type": 1, "type_k": 8, "type_v": 2, "n_threads": 2,
        "n_threads_batch": 3, "rope_scaling_type": 2, "rope_freq_base": 1e6,
        "rope_freq_scale": 0.5, "yarn_ext_factor": 1.0, "yarn_attn_factor": 2.0,
        "yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0, "yarn_orig_ctx": 2048, "kv_unified": True,
    }  # fmt: skip
    # The defaults are llama.cpp's own ("from the model").
    default = llama_params.context_params(lib, ContextParams(n_threads=2))
    upstream = lib.llama_context_default_params()
    for name in ("flash_attn_type", "rope_scaling_type", "rope_freq_base", "rope_freq_scale",
                 "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow",
                 "yarn_orig_ctx"):  # fmt: skip
        assert getattr(default, name) == getattr(upstream, name), name
    assert default.n_threads_batch == 2  # n_threads_batch follows n_threads
    with pytest.raises(ConfigError, match="quantised V cache"):
        llama_params.context_params(lib, ContextParams(type_v="q8_0", flash_attn="off"))


class _Recording(StubBackend):
    """A stub that keeps what a load was given, as llama.cpp's structs would be filled."""

    loads: list[ModelParams]

    def __init__(self) -> None:
        super().__init__()
        self.loads = []

    def load_model(self, path: str, params: ModelParams | None = None) -> StubModel:
        self.loads.append(params or ModelParams())
        return super().load_model(path, params)


def test_the_engine_hands_the_settings_to_the_backend(tmp_path: Path) -> None:
    backend = _Recording()
    context = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32)
    cache = CacheConfig(tiers=(TierConfig("ram", 1 << 20),))
    with Engine(EngineConfig(cache=cache)) as engine:
        model = engine.load_model(
            "stub-hw",
            config=ModelConfig(backend=backend, context=context),
            n_gpu_layers=99, main_gpu=0, split_mode="none", tensor_split=(1.0,),
            flash_attn="on", type_k="q8_0", type_v="q8_0", n_threads=2, rope_freq_scale=0.5,
        )  # fmt: skip
        params = backend.loads[-1]
        assert (params.n_gpu_layers, params.split_mode, params.tensor_split) == (99, "none", (1.0,))
        got = model.config.context
        assert (got.flash_attn, got.type_k, got.type_v) == ("on", "q8_0", "q8_0")
        assert model.complete("hello", max_tokens=2).stats.completion_tokens >= 1
        with pytest.raises(ConfigError, match="quantised V cache"):
            engine.load_model("stub-bad", backend="stub", type_v="q4_0", flash_attn="off")
        with pytest.raises(ConfigError, match="n_gpu_layers"):
            engine.load_model("stub-bad", backend="stub", n_gpu_layers=-4)
        with pytest.raises(ConfigError, match="deterministic mode needs flash attention"):
            engine.load_model("stub-bad", backend="stub", deterministic=True, flash_attn="off")
    assert len(backend.loads) == 1  # the bad configs never reached a backend


@pytest.mark.model
def test_real_cpu_model_runs_with_gpu_and_kv_settings() -> None:
    """A CPU build accepts n_gpu_layers (nothing to offload to) and runs quantised KV cells
    with flash attention; each KV configuration is its own cache namespace."""
    cache = CacheConfig(tiers=(TierConfig("ram", 64 << 20),))
    ctx = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_threads=2)
    prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of"
    with Engine(EngineConfig(cache=cache)) as engine:
        fast = engine.load_model(
            model_id="q8", config=ModelConfig(context=ctx), n_gpu_layers=99, flash_attn="on",
            type_k="q8_0", type_v="q8_0", use_mlock=False,
        )  # fmt: skip
        plain = engine.load_model(model_id="f16", config=ModelConfig(context=ctx), flash_attn="off")
        assert fast.namespace().ctx_hash != plain.namespace().ctx_hash
        first = fast.complete(prompt, max_tokens=4, temperature=0)
        again = fast.complete(prompt, max_tokens=4, temperature=0)
        assert first.text and again.text == first.text
        assert again.stats.cached_tokens > 0  # quantised rows pack and restore
        other = plain.complete(prompt, max_tokens=4, temperature=0)
        assert other.stats.cached_tokens == 0  # never a q8_0 row in an f16 context


@pytest.mark.model
def test_auto_flash_attention_is_off_where_attention_runs_on_the_cpu() -> None:
    """kvwarm's ``auto`` turns flash attention off for a model whose layers all stay on the CPU
    (its kernel decodes and prefills short batches more slowly there; bench/flash_attn.py),
    keeps a quantised V's need for it, keeps explicit choices and, with layers offloaded to a
    GPU, leaves the choice to llama.cpp. The loaded model runs, reports and hashes the result."""
    from kvwarm.backends.llama.model import LlamaBackend
    from kvwarm.embedded import default_model_path

    gpu = bool(_native.lib().llama_supports_gpu_offload())
    # On a GPU machine KVWARM_TEST_GPU_LAYERS offloads every model these tests load.
    default = "auto" if gpu and os.environ.get(GPU_LAYERS_ENV, "0") != "0" else "off"
    path = str(default_model_path())
    auto = ContextParams()
    cpu = LlamaBackend().load_model(path)
    try:
        assert cpu.context_params(auto, deterministic=False).flash_attn == default
        q8 = replace(auto, type_k="f16", type_v="q8_0")
        assert cpu.context_params(q8, deterministic=False) == q8
        # Deterministic mode keeps it: restores are bit-identical to cold runs only with it.
        f16 = replace(auto, type_k="f16", type_v="f16")
        assert cpu.context_params(auto, deterministic=True) == f16
        for explicit in ("on", "off"):
            on_off = replace(auto, flash_attn=explicit)
            assert cpu.context_params(on_off, deterministic=False).flash_attn == explicit
    finally:
        cpu.close()
    offloaded = LlamaBackend().load_model(path, ModelParams(n_gpu_layers=99))
    try:
        got = offloaded.context_params(auto, deterministic=False)
        assert got.flash_attn == ("auto" if gpu else "off")
    finally:
        offloaded.close()

    cache = CacheConfig(tiers=(TierConfig("ram", 64 << 20),))
    ctx = ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_threads=2)
    with Engine(EngineConfig(cache=cache)) as engine:
        model = engine.load_model(model_id="m", config=ModelConfig(context=ctx))
        assert model.config.context.flash_attn == model.info().flash_attn == default
        assert model.namespace().ctx_hash == replace(ctx, flash_attn=default).kv_hash()
        # Unresolved ``auto`` cells hash as the f16 they run as: rows keep their keys.
        assert replace(ctx, type_k="f16", type_v="f16").kv_hash() == ctx.kv_hash()
        if default == "off":
            assert model.namespace().ctx_hash != ctx.kv_hash()  # llama.cpp's auto: FA on
        first = model.complete("The capital of France is", max_tokens=4, temperature=0)
        again = model.complete("The capital of France is", max_tokens=4, temperature=0)
        assert again.stats.cached_tokens > 0 and again.text == first.text
        if default == "off":  # a deterministic request cannot be bit-identical without it
            det = GenerationOptions(max_tokens=1, deterministic=True)
            with pytest.raises(InvalidRequestError, match="without flash attention"):
                model.complete("The capital of France is", det)


@pytest.mark.parametrize("field", ["n_ctx", "n_batch", "n_ubatch"])
def test_sizes_past_int32_are_refused(field: str) -> None:
    """llama.cpp takes them as 32-bit ints and ctypes wraps a larger value silently: n_batch
    2**32 + 64 made a context of 64 that the first long prefill wrote past (found by review)."""
    big = 2**32 + 64
    sizes = {"n_ctx": 256, "n_batch": 64, "n_ubatch": 64}
    sizes.update({field: big} if field != "n_ubatch" else {"n_batch": big, "n_ubatch": big})
    with pytest.raises(ConfigError, match="must be <= 2147483647"):
        ContextParams(**sizes).validate()
    ContextParams(n_ctx=2**31 - 1, n_batch=2**31 - 1, n_ubatch=64).validate()
