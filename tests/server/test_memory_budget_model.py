"""The memory budget's terms on the real embedded model (issue 25): llama.cpp's weights size
and the buffers it allocated for the context, as /v1/models and /cache/stats report them."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from fastapi.testclient import TestClient
from tests.backends.lora_fixture import make_lora

from kvwarm.embedded import default_model_path
from kvwarm.server import create_app
from kvwarm.settings import ModelSpec, Settings

from .conftest import LOW_POLICY, wait_ready

pytestmark = pytest.mark.model

GIB = 1 << 30
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, f16 K and V: 23,040 bytes a cell.
CELL_BYTES = 30 * 3 * 64 * 2 * 2


def _smol_under_a_budget(**overrides: object) -> Settings:
    """SmolLM2 alone, one slot, under a 1 GiB memory budget."""
    return Settings(
        models=(ModelSpec(path=str(default_model_path()), id="smol"),),
        cache_dir=None,
        n_ctx=512,
        n_batch=64,
        n_parallel=1,
        n_threads=2,
        policy=LOW_POLICY,
        keepalive_interval_s=0,
        memory_budget=GIB,
        allowed_hosts=("testserver",),
    ).replace(**overrides)


def test_models_report_weights_and_kv_bytes_and_size_the_ram_tier() -> None:
    settings = _smol_under_a_budget(n_ctx=512)
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        (model,) = c.get("/v1/models").json()["data"]
        stats = c.get("/cache/stats").json()
    meta = model["meta"]
    assert meta["weights_bytes"] == meta["size"] > 50 << 20  # llama_model_size, ~92 MiB
    assert meta["kv_bytes"] == pytest.approx(512 * CELL_BYTES, abs=5 << 10)
    assert meta["context_bytes"] > meta["kv_bytes"]  # the output and compute buffers too
    ram = GIB - meta["weights_bytes"] - meta["context_bytes"]
    assert stats["memory"]["tiers"]["ram"]["quota_bytes"] == ram
    assert stats["counters"]["tier_ram_quota_bytes"] == ram


def test_a_lora_adapter_counts_with_its_models_weights(tmp_path: Path) -> None:
    """Found by review (lorabudget): a model's LoRA adapters were in no term of the budget.
    A tiny random adapter's tensor bytes (what llama.cpp copies into its buffers) count with
    the model's weights, and the RAM tier shrinks by them."""
    lora = make_lora(default_model_path(), tmp_path / "tiny.gguf", rank=32)
    tensors = gguf.GGUFReader(str(lora)).tensors
    adapter = sum(int(t.n_bytes) for t in tensors if t.name.endswith((".lora_a", ".lora_b")))
    settings = _smol_under_a_budget(n_ctx=256, lora=(("tiny", str(lora)),))
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        meta = {m["id"]: m for m in c.get("/v1/models").json()["data"]}["smol"]["meta"]
        memory = c.get("/cache/stats").json()["memory"]
    assert meta["adapter_bytes"] == adapter > 1 << 20
    assert meta["weights_bytes"] == meta["size"] + adapter
    assert memory["models"]["smol"]["weights_bytes"] == meta["weights_bytes"]
    ram = GIB - meta["weights_bytes"] - meta["context_bytes"]
    assert memory["tiers"]["ram"]["quota_bytes"] == ram
