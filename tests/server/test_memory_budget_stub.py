"""One memory budget (issue 25): the arithmetic, the RAM tier sized to what is left, a model
that does not fit refused with the sum in the error, and every surface reporting the terms."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.server.conftest import stub_settings, wait_ready

from kvwarm.backends.stub import STUB_WEIGHTS_BYTES
from kvwarm.cache.types import Namespace, RowInfo, SaveReason, TierConfig, TtlClass
from kvwarm.engine.worker.drafts import Cost, PassCost
from kvwarm.errors import BackendError, ConfigError, MemoryBudgetError
from kvwarm.server import create_app
from kvwarm.server.budget import CacheOwner, ModelMemory, cache_shares, plan
from kvwarm.server.errors import kind_of
from kvwarm.settings import ModelSpec, add_settings_arguments, load_settings, settings_flags

MIB, GIB = 1 << 20, 1 << 30
TIERS = (
    TierConfig("ram", GIB),
    TierConfig("ram_file", 2 * GIB, Path("/dev/shm/x")),
    TierConfig("disk", 20 * GIB, Path("/x")),  # disk is not memory
)


def test_the_ram_tier_gets_what_weights_contexts_and_shm_leave() -> None:
    models = [ModelMemory("a", 270 * MIB, 96 * MIB, 100 * MIB), ModelMemory("b", 30 * MIB, 0, 4)]
    p = plan(3 * GIB, models, TIERS)
    assert p.ram_quota_bytes == 3 * GIB - 270 * MIB - 100 * MIB - 30 * MIB - 4 - 2 * GIB
    assert p.total_bytes == 3 * GIB
    report = p.report({"ram": 5, "ram_file": 7})
    assert report["weights_bytes"] == 300 * MIB and report["kv_bytes"] == 96 * MIB
    assert report["tiers"] == {
        "ram": {"quota_bytes": p.ram_quota_bytes, "bytes": 5},
        "ram_file": {"quota_bytes": 2 * GIB, "bytes": 7},
    }
    # No budget: the RAM tier keeps its quota, the terms are still reported.
    assert plan(0, models, TIERS).ram_quota_bytes == GIB


def test_a_budget_that_cannot_fit_is_refused_with_the_arithmetic() -> None:
    with pytest.raises(MemoryBudgetError) as caught:
        plan(2 * GIB, [ModelMemory("gemma", 270 * MIB, 96 * MIB, 96 * MIB)], TIERS)
    message = str(caught.value)
    assert message.startswith(
        "memory budget 2.0 GiB < weights 270.0 MiB + KV 96.0 MiB + shm tier 2.0 GiB = 2.4 GiB"
    )
    assert "gemma" in message
    assert isinstance(caught.value, ConfigError)
    assert (kind_of(caught.value).status, kind_of(caught.value).code) == (507, "memory_budget")
    # Exactly full is not refused: the RAM tier gets nothing.
    assert plan(2 * GIB, [], TIERS[1:]).ram_quota_bytes == 0


def test_memory_budget_is_a_flag_an_env_var_and_a_toml_key(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    flags = settings_flags(parser.parse_args(["--memory-budget", "2G"]))
    assert load_settings(flags, {}).memory_budget == 2 * GIB
    assert load_settings({}, {"KVWARM_MEMORY_BUDGET": "512M"}).memory_budget == 512 * MIB
    config = tmp_path / "c.toml"
    config.write_text('memory_budget = "3G"\n')
    assert load_settings({}, {"KVWARM_CONFIG": str(config)}).memory_budget == 3 * GIB
    assert load_settings({}, {}).memory_budget == 0  # off by default


def _metric(text: str, name: str, **labels: str) -> float:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{name}{{{inner}}} (\S+)$" if labels else rf"^{name} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def test_the_server_sizes_its_ram_tier_and_reports_every_term(tmp_path: Path) -> None:
    budget = 1 * GIB
    settings = stub_settings(
        memory_budget=budget, shm_dir=tmp_path / "shm", shm_quota_bytes=GIB // 4
    )
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        meta = {m["id"]: m["meta"] for m in c.get("/v1/models").json()["data"]}
        stats = c.get("/cache/stats").json()
        metrics = c.get("/metrics").text
    for model_id in ("a", "b"):
        m = meta[model_id]
        assert m["weights_bytes"] == STUB_WEIGHTS_BYTES
        assert 0 < m["kv_bytes"] < m["context_bytes"]
        assert _metric(metrics, "kvwarm_model_weights_bytes", model=model_id) == STUB_WEIGHTS_BYTES
        assert _metric(metrics, "kvwarm_model_kv_bytes", model=model_id) == m["kv_bytes"]
        assert _metric(metrics, "kvwarm_model_context_bytes", model=model_id) == m["context_bytes"]
    assert meta["a"]["kv_bytes"] > meta["b"]["kv_bytes"]  # n_ctx 1024 against 256
    taken = sum(m["weights_bytes"] + m["context_bytes"] for m in meta.values())
    ram = budget - taken - GIB // 4
    memory = stats["memory"]
    assert memory["budget_bytes"] == budget and memory["total_bytes"] == budget
    assert memory["tiers"]["ram"]["quota_bytes"] == ram
    assert memory["tiers"]["ram_file"]["quota_bytes"] == GIB // 4
    assert memory["models"]["a"]["kv_bytes"] == meta["a"]["kv_bytes"]
    assert stats["tiers"]["ram"]["quota_bytes"] == ram == stats["counters"]["tier_ram_quota_bytes"]
    assert _metric(metrics, "kvwarm_cache_tier_quota_bytes", tier="ram") == ram
    assert _metric(metrics, "kvwarm_memory_budget_bytes") == budget
    assert _metric(metrics, "kvwarm_memory_planned_bytes") == budget


def test_a_model_that_does_not_fit_is_refused_and_the_other_serves() -> None:
    # Room for one stub model's weights (64 MiB) and context, not two.
    settings = stub_settings(memory_budget=100 * MIB)
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        health = c.get("/health").json()
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        stats = c.get("/cache/stats").json()
        ok = c.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2})
    assert health["status"] == "degraded" and health["models"] == {"a": "ready", "b": "failed"}
    error = models["b"]["error"]
    assert error.startswith("MemoryBudgetError: memory budget 100.0 MiB < weights 128.0 MiB")
    assert list(stats["memory"]["models"]) == ["a"]  # the refused model was unloaded
    assert ok.status_code == 200


def test_in_memory_tiers_past_the_budget_refuse_to_start(tmp_path: Path) -> None:
    settings = stub_settings(memory_budget=GIB, shm_dir=tmp_path / "shm", shm_quota_bytes=2 * GIB)
    with TestClient(create_app(settings)) as c:
        # wait_ready fails with the body once startup is over and nothing can be served.
        with pytest.raises(AssertionError, match="model failed to load") as caught:
            wait_ready(c.get)
        health = c.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert "memory budget 1.0 GiB < weights 0 B + KV 0 B + shm tier 2.0 GiB" in str(caught.value)


def test_an_embedding_context_is_counted_and_shrinks_the_ram_tier() -> None:
    """Found by review: the embedding context, created on a model's first embedding, was in no
    term of the budget; the RAM tier kept the room it took."""
    budget = 1 * GIB
    with TestClient(create_app(stub_settings(memory_budget=budget))) as c:
        wait_ready(c.get)
        before = c.get("/cache/stats").json()["memory"]
        r = c.post("/v1/embeddings", json={"model": "a", "input": "hello"})
        assert r.status_code == 200
        after = c.get("/cache/stats").json()["memory"]
        meta = {m["id"]: m["meta"] for m in c.get("/v1/models").json()["data"]}
    grown = after["models"]["a"]["context_bytes"] - before["models"]["a"]["context_bytes"]
    assert grown > 0 and meta["a"]["context_bytes"] == after["models"]["a"]["context_bytes"]
    assert after["tiers"]["ram"]["quota_bytes"] == before["tiers"]["ram"]["quota_bytes"] - grown
    assert after["total_bytes"] == budget


def test_an_embedding_context_past_the_budget_empties_the_ram_tier_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Room for model a (a stub context of n_ctx 1024) and b, and little besides.
    probe = stub_settings()
    with TestClient(create_app(probe)) as c:
        wait_ready(c.get)
        taken = c.get("/cache/stats").json()["memory"]
    fixed = sum(m["weights_bytes"] + m["context_bytes"] for m in taken["models"].values())
    with TestClient(create_app(stub_settings(memory_budget=fixed + 1024))) as c:
        wait_ready(c.get)
        with caplog.at_level("ERROR", logger="kvwarm.server.state"):
            r = c.post("/v1/embeddings", json={"model": "a", "input": "hello"})
        memory = c.get("/cache/stats").json()["memory"]
    assert r.status_code == 200
    assert memory["tiers"]["ram"]["quota_bytes"] == 0
    assert memory["total_bytes"] > memory["budget_bytes"]
    assert any("the RAM tier is emptied" in rec.getMessage() for rec in caplog.records)


def test_a_model_whose_unload_raised_is_counted_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: an unload that raised (freeing its native state failed, after the
    engine had forgotten the model) left the model in the budget: listed in ``/cache/stats``
    while the registry had it unloaded, its memory kept from the RAM tier and from every
    later load."""
    with TestClient(create_app(stub_settings(memory_budget=GIB))) as c:
        wait_ready(c.get)
        engine = c.app.state.kvwarm.engine  # type: ignore[attr-defined]
        unload = engine.unload_model

        def failing(model_id: str) -> None:
            unload(model_id)
            raise BackendError("freeing the context failed")

        monkeypatch.setattr(engine, "unload_model", failing)
        before = c.get("/cache/stats").json()["memory"]
        r = c.post("/admin/models/unload", json={"model": "b"})
        after = c.get("/cache/stats").json()["memory"]
    assert r.status_code == 200 and r.json()["status"] == "available"
    assert list(after["models"]) == ["a"]
    b = before["models"]["b"]
    freed = b["weights_bytes"] + b["context_bytes"]
    assert after["tiers"]["ram"]["quota_bytes"] == before["tiers"]["ram"]["quota_bytes"] + freed


def test_a_ram_url_tier_counts_against_the_budget_as_shm_does() -> None:
    """Found by review (memrev): a tier added by URL as ``ram://`` is process memory, but the
    budget counted only ``ram_file`` beside the RAM tier, so ``--memory-budget 4G --tiers
    fast=ram://?quota=8G`` planned 4 GiB while the cache alone could hold 9."""
    settings = stub_settings(
        memory_budget=3 * GIB,
        tiers=("fast=ram://?quota=2G", "far=file:///srv/kvwarm?quota=8G"),
    )
    tiers = settings.cache_config().tiers
    p = plan(settings.memory_budget, [], tiers)
    assert p.ram_quota_bytes == GIB  # what the 2 GiB ram:// tier leaves; a file tier is disk
    assert p.total_bytes == 3 * GIB
    assert p.report({"fast": 5})["tiers"]["fast"] == {"quota_bytes": 2 * GIB, "bytes": 5}
    with pytest.raises(MemoryBudgetError, match=r"fast tier 2\.0 GiB = 2\.0 GiB"):
        plan(GIB, [], tiers)


def _big_adapter(path: Path, size: int) -> Path:
    """A stub LoRA adapter of ``size`` bytes (sparse): the stub counts a file's bytes as the
    adapter's weights, as llama.cpp holds a real adapter's tensors."""
    path.write_bytes(b"stub adapter: big")
    with path.open("r+b") as f:
        f.truncate(size)
    return path


def test_lora_adapters_count_against_the_budget_and_are_released_with_their_model(
    tmp_path: Path,
) -> None:
    """Found by review (lorabudget): a model's LoRA adapters were in no term of the budget, so
    a server under one loaded adapters past it: here model b loaded beside model a and its
    48 MiB adapter in a budget of 160 MiB. Now they count with a's weights wherever the budget
    reports them, b is refused with the arithmetic, and unloading a releases them."""
    adapter = _big_adapter(tmp_path / "big.gguf", 48 * MIB)
    # Room for a with its adapter (112 MiB) or b (64 MiB), not both.
    settings = stub_settings(memory_budget=160 * MIB, lora=(("big", str(adapter)),))
    with TestClient(create_app(settings)) as c:
        wait_ready(c.get)
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        memory = c.get("/cache/stats").json()["memory"]
        metrics = c.get("/metrics").text
        assert c.get("/health").json()["models"] == {"a": "ready", "b": "failed"}
        # An admin load of b makes room by unloading a, its adapter with it.
        assert c.post("/admin/models/load", json={"name": "b"}).status_code == 200
        after = c.get("/cache/stats").json()["memory"]
        listed = {m["id"]: m["status"] for m in c.get("/v1/models").json()["data"]}
    weights = STUB_WEIGHTS_BYTES + 48 * MIB
    meta = models["a"]["meta"]
    assert (meta["weights_bytes"], meta["adapter_bytes"]) == (weights, 48 * MIB)
    assert memory["models"]["a"]["weights_bytes"] == weights == memory["weights_bytes"]
    assert _metric(metrics, "kvwarm_model_weights_bytes", model="a") == weights
    error = models["b"]["error"]
    assert error.startswith("MemoryBudgetError: memory budget 160.0 MiB < weights 176.0 MiB")
    assert (listed["a"], listed["b"]) == ("available", "ready")
    assert list(after["models"]) == ["b"] and after["weights_bytes"] == STUB_WEIGHTS_BYTES


def test_a_model_whose_adapters_do_not_fit_is_refused_with_the_budgets_error(
    tmp_path: Path,
) -> None:
    """The model alone fits (64 MiB of 100); with its 48 MiB adapter it does not: a 507
    ``memory_budget`` naming the sum, and the server stays up."""
    adapter = _big_adapter(tmp_path / "big.gguf", 48 * MIB)
    settings = stub_settings(
        models=(ModelSpec(path="stub-a", id="a"),),
        memory_budget=100 * MIB,
        lora=(("big", str(adapter)),),
    )
    with TestClient(create_app(settings)) as c:
        with pytest.raises(AssertionError, match="model failed to load"):
            wait_ready(c.get)
        load = c.post("/admin/models/load", json={"name": "a"})
        memory = c.get("/cache/stats").json()["memory"]
    assert load.status_code == 507, load.json()
    assert load.json()["error"]["code"] == "memory_budget"
    assert "memory budget 100.0 MiB < weights 112.0 MiB" in load.json()["error"]["message"]
    assert memory["models"] == {} and memory["weights_bytes"] == 0


DRAFTED = "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat. "


@pytest.mark.parametrize("served", [False, True])
@pytest.mark.usefixtures("free_draft_passes")
def test_a_draft_models_rows_count_with_the_model_that_drafts_with_them(
    served: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review (ownerkey): rows were a model's by fingerprint alone, so a draft model's
    rows (its own namespace) were no model's share of the cache, and where its file was also
    served as a model of its own, they were all that model's. Now a draft model's namespace
    (salted too) is the drafting model's; the served file keeps its own rows."""
    # Drafts whatever the timing (one more token costs 5% of a pass).
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05)))
    drafting = (("spec_type", "draft-simple"), ("draft_model", "stub-copy-draft"))
    models = (ModelSpec(path="stub-copy", id="a", options=drafting),)
    if served:
        models += (ModelSpec(path="stub-copy-draft", id="d"),)
    with TestClient(create_app(stub_settings(models=models))) as c:
        wait_ready(c.get)
        state = c.app.state.kvwarm  # type: ignore[attr-defined]
        cache = state.engine.cache

        def shares() -> tuple[int, dict[str, int]]:
            assert cache.flush()
            stats = c.get("/cache/stats").json()
            ram = int(stats["tiers"]["ram"]["bytes"])
            return ram, {m: int(v["cache_bytes"]) for m, v in stats["memory"]["models"].items()}

        def complete(model: str, salt: str | None) -> None:
            body = {"model": model, "prompt": f"Copy this: {DRAFTED * 3}Again: The quick"}
            salted = {} if salt is None else {"cache_salt": salt}
            r = c.post("/v1/completions", json={**body, "max_tokens": 24, **salted})
            assert r.status_code == 200, r.text

        for salt in (None, "tenant"):
            complete("a", salt)
        ram, share = shares()
        draft_fp = state.engine.get_model("a")._draft.namespace.fingerprint
        drafts = [r for r in cache.rows() if r.namespace.fingerprint == draft_fp]
        assert len({r.namespace for r in drafts}) == 2  # drafted, salted and not: rows saved
        assert share["a"] == ram > 0  # every row is a's, its draft model's too
        if not served:
            return
        assert share["d"] == 0  # d served nothing
        for salt in (None, "tenant"):
            complete("d", salt)
        ram, share = shares()
        assert share["d"] > 0 and share["a"] > 0
        assert ram - 2 <= share["a"] + share["d"] <= ram  # whole but for rounding


def test_a_row_is_its_draft_namespaces_model_then_its_fingerprints_then_a_draft_models() -> None:
    """``cache_shares``' owner keys, in order: a draft model's namespace exactly, a model's own
    fingerprints (its adapter sets' too), a draft model's fingerprint (a salted row it no
    longer remembers): a file served and drafting splits, a salted row of unknown origin
    staying with the model that serves the file."""
    f_a, f_d, f_lora, f_x = (bytes([i]) * 32 for i in range(1, 5))
    draft = Namespace(f_d, 1, b"draft".ljust(32, b"\0"))
    salted = Namespace(f_d, 1, b"salted".ljust(32, b"\0"))
    forgotten = Namespace(f_d, 1, b"forgotten".ljust(32, b"\0"))
    own_d = Namespace(f_d, 1, b"own".ljust(32, b"\0"))

    def row(ns: Namespace, n: int) -> RowInfo:
        return RowInfo(
            b"k", "ram", n, 1, 0, 0.0, 0.0, SaveReason.COLD, TtlClass.SHORT, False, ns,
            logical_bytes=n,
        )  # fmt: skip

    rows = [
        row(Namespace(f_a, 1, b"a".ljust(32, b"\0")), 1),
        row(Namespace(f_lora, 1, b"a".ljust(32, b"\0")), 2),
        row(draft, 4),
        row(salted, 8),
        row(forgotten, 16),
        row(own_d, 32),
        row(Namespace(f_x, 1, b"x".ljust(32, b"\0")), 64),  # no loaded model's
    ]
    a = CacheOwner(frozenset({f_a, f_lora}), frozenset({draft, salted}))
    stored = {"ram": 127}
    served = cache_shares(rows, stored, {"a": a, "d": CacheOwner(frozenset({f_d}))})
    assert served == {"a": {"ram": 1 + 2 + 4 + 8}, "d": {"ram": 16 + 32}}
    alone = cache_shares(rows, stored, {"a": a})
    assert alone == {"a": {"ram": 1 + 2 + 4 + 8 + 16 + 32}}
