"""llama.cpp rotates quantized KV cells (a Hadamard matrix on K, V and the queries) unless
``LLAMA_ATTN_ROT_DISABLE`` is set when a context is made: a state saved one way attends
wrongly when restored the other way, so the switch is hashed into cache keys
(``model_file.kv_rotation_off``, ``BackendModel.kv_tag``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from tests.backends.conftest import SMALL

from kvwarm.backends import get_backend
from kvwarm.backends.base import BackendModel, ContextParams
from kvwarm.backends.llama import model_file
from kvwarm.backends.params import KvType
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.embedded import default_model_path
from kvwarm.engine.api import Engine, EngineConfig

SWITCH = model_file.ROTATION_SWITCH
TOKENS = [1, 504, 3458, 282, 260, 6372, 30, 2, 744, 314]


@pytest.mark.parametrize(
    ("value", "type_k", "type_v", "off"),
    [
        (None, "q8_0", "q8_0", False),
        ("1", "q8_0", "f16", True),
        ("1", "f16", "q4_0", True),
        ("1", "f16", "f16", False),  # nothing quantized: nothing rotated either way
        ("1", "auto", "auto", False),  # auto unresolved runs f16
        ("0", "q8_0", "q8_0", False),
        ("yes", "q8_0", "q8_0", False),  # atoi: a word is 0
        (" 2", "q4_1", "f16", True),
    ],
)
def test_the_rotation_is_off_as_llama_cpp_reads_its_switch(
    monkeypatch: pytest.MonkeyPatch, value: str | None, type_k: KvType, type_v: KvType, off: bool
) -> None:
    if value is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, value)
    params = replace(SMALL, type_k=type_k, type_v=type_v)
    assert model_file.kv_rotation_off(params) is off


@pytest.fixture(scope="module")
def smollm2() -> Iterator[BackendModel]:
    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    yield model
    model.close()


def _q8_0(model: BackendModel) -> ContextParams:
    return model.context_params(
        replace(SMALL, type_k="q8_0", type_v="q8_0", flash_attn="on"), deterministic=False
    )


def _state(model: BackendModel, params: ContextParams) -> tuple[bytes, np.ndarray]:
    """The KV blob of ``TOKENS[:-1]`` and the logits after the last token, cold."""
    ctx = model.new_context(params)
    try:
        ctx.prefill(0, TOKENS[:-1], 0)
        blob = ctx.kv_pack(0)
        ctx.prefill(0, TOKENS[-1:], len(TOKENS) - 1)
        return blob, np.frombuffer(ctx.logits(), dtype=np.float32).copy()
    finally:
        ctx.close()


@pytest.mark.model
def test_a_rotated_state_restored_unrotated_is_wrong_so_the_keys_differ(
    smollm2: BackendModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The premise and the guard: the same tokens store other bytes with the rotation off,
    and a rotated state restored into an unrotated context gives other logits than that
    context computes cold (it is no state of these tokens there); so the tag differs and
    the two contexts' cache keys do."""
    params = _q8_0(smollm2)
    monkeypatch.delenv(SWITCH, raising=False)
    rotated_blob, _ = _state(smollm2, params)
    tag_on = smollm2.kv_tag(params)
    monkeypatch.setenv(SWITCH, "1")
    plain_blob, plain_logits = _state(smollm2, params)
    tag_off = smollm2.kv_tag(params)
    assert rotated_blob != plain_blob
    assert "unrotated" in tag_off.split(",") and "unrotated" not in tag_on.split(",")
    assert params.kv_hash(tag_on) != params.kv_hash(tag_off)

    ctx = smollm2.new_context(params)  # made with the rotation off
    try:
        assert ctx.kv_unpack(0, rotated_blob) == len(TOKENS) - 1
        ctx.prefill(0, TOKENS[-1:], len(TOKENS) - 1)
        mixed = np.frombuffer(ctx.logits(), dtype=np.float32)
        assert float(np.abs(mixed - plain_logits).max()) > 1.0
    finally:
        ctx.close()


@pytest.mark.model
def test_f16_cells_keep_their_keys_whatever_the_switch(
    smollm2: BackendModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = smollm2.context_params(SMALL, deterministic=False)
    monkeypatch.setenv(SWITCH, "1")
    assert "unrotated" not in smollm2.kv_tag(params).split(",")


@pytest.mark.model
def test_the_engine_hashes_the_switch_into_a_quantized_models_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def namespace_ctx_hash() -> bytes:
        config = EngineConfig(CacheConfig(tiers=(TierConfig("ram", 1 << 24),)))
        with Engine(config) as engine:
            model = engine.load_model(
                str(default_model_path()), n_ctx=256, type_k="q8_0", type_v="q8_0"
            )
            return model.namespace().ctx_hash

    monkeypatch.delenv(SWITCH, raising=False)
    rotated = namespace_ctx_hash()
    monkeypatch.setenv(SWITCH, "1")
    assert namespace_ctx_hash() != rotated
