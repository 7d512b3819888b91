"""``/metrics`` as a whole, from a live stub app, read by prometheus_client's reference parsers
(text and OpenMetrics): every family has HELP and TYPE, counters' samples end in ``_total``,
a model id with a quote, a backslash and a newline is escaped, no series appears twice, and
no counter goes down when a model unloads and loads again (found by review: a model's
counters, and the dashboard's tokens served from the cache and time saved, started again
from zero, or vanished, with each load). Also ``/cache/stats``'s ``model_totals`` and
per-tier restores."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from kvwarm.server import create_app
from kvwarm.settings import ModelSpec

from .conftest import stub_settings, wait_ready

ODD = 'we"ird\\id\nx'  # a model id a label value must escape
ADMIN = {"Authorization": "Bearer admin"}
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def client() -> Iterator[TestClient]:
    settings = stub_settings(
        models=(ModelSpec(path="stub-a", id="a"), ModelSpec(path="stub-b", id=ODD)),
        admin_key="admin",
    )
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


def scrape(client: TestClient, accept: str | None = None) -> str:
    headers = {**ADMIN, **({"Accept": accept} if accept else {})}
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    return response.text


def checked(text: str) -> tuple[Series, dict[str, str]]:
    """Every sample by (name, labels), and each family's type, once the text passed the
    checks every scrape must pass."""
    series: Series = {}
    types: dict[str, str] = {}
    seen: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    for family in text_string_to_metric_families(text):
        assert family.type != "unknown", f"{family.name} has no TYPE"
        assert family.documentation, f"{family.name} has no HELP"
        assert family.name not in types, f"{family.name} is two families"
        types[family.name] = family.type
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
            key = (sample.name, tuple(sorted(sample.labels.items())))
            seen[key] += 1
            series[key] = sample.value
    assert [k for k, n in seen.items() if n > 1] == []  # no series twice
    return series, types


def complete(client: TestClient, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 200


def counters_of(series: Series, types: dict[str, str]) -> Series:
    return {
        k: v
        for k, v in series.items()
        if k[0].endswith("_total") and types.get(k[0][: -len("_total")]) == "counter"
    }


PROMPT = "A prompt long enough to be saved, and served again from the cache: " * 3


def test_metrics_parse_whole_and_counters_survive_an_unload_and_a_reload(
    client: TestClient,
) -> None:
    for model in ("a", ODD):
        complete(client, model, PROMPT)
        complete(client, model, PROMPT)  # its slot's live KV, or the row
    first, types = checked(scrape(client))
    # The odd id is one label value, escaped and read back whole.
    assert first[("kvwarm_requests_total", (("model", ODD),))] == 2
    assert first[("kvwarm_requests_total", (("model", "a"),))] == 2
    assert first[("kvwarm_cached_tokens_total", (("model", "a"),))] > 0
    # Per-tier restores are counters with a tier label (the RAM tier's, stub_settings).
    assert types["kvwarm_cache_tier_restores"] == "counter"
    assert ("kvwarm_cache_tier_restores_total", (("tier", "ram"),)) in first
    assert types["kvwarm_cache_tier_bytes"] == "gauge"
    # OpenMetrics, when asked for, parses with its own (stricter) parser.
    om = scrape(client, "application/openmetrics-text; version=1.0.0")
    assert any(f.name == "kvwarm_requests" for f in openmetrics_families(om))
    stats = client.get("/cache/stats", headers=ADMIN).json()
    assert stats["model_totals"]["a"]["requests"] == 2
    assert stats["model_totals"][ODD]["cached_tokens"] > 0

    unloaded = client.post("/admin/models/unload", json={"model": "a"}, headers=ADMIN)
    assert unloaded.status_code == 200, unloaded.text
    after_unload, types = checked(scrape(client))
    before = counters_of(first, types)
    gone = {k: v for k, v in before.items() if after_unload.get(k, -1.0) < v}
    assert gone == {}  # not one counter went down, nor vanished
    # Its gauges went with it; its counters stay.
    assert ("kvwarm_model_queue_depth", (("model", "a"),)) not in after_unload
    assert after_unload[("kvwarm_requests_total", (("model", "a"),))] == 2
    stats = client.get("/cache/stats", headers=ADMIN).json()
    assert stats["model_totals"]["a"]["requests"] == 2  # the dashboard's figures too

    complete(client, "a", PROMPT)  # loads it again: a fresh worker, counting from zero
    reloaded, types = checked(scrape(client))
    previous = counters_of(after_unload, types)
    assert {k: v for k, v in previous.items() if reloaded.get(k, -1.0) < v} == {}
    assert reloaded[("kvwarm_requests_total", (("model", "a"),))] == 3
    assert ("kvwarm_model_queue_depth", (("model", "a"),)) in reloaded
    stats = client.get("/cache/stats", headers=ADMIN).json()
    assert stats["model_totals"]["a"]["requests"] == 3
    prompt_tokens = reloaded[("kvwarm_prompt_tokens_total", (("model", "a"),))]
    assert stats["model_totals"]["a"]["prompt_tokens"] == prompt_tokens


def test_kv_cache_usage_is_a_share_of_every_slot_s_cells(client: TestClient) -> None:
    """Found by review: ``kvwarm_model_kv_cells`` was one slot's ``n_ctx`` while the context
    holds ``n_ctx`` cells for each of the ``n_parallel`` slots and ``kv_cells_used`` counts
    them all, so four slots holding 203 tokens each in a 256-token model read as 812 of 256
    cells, ``kvwarm_model_kv_cache_usage_ratio`` 3.17 (documented 0..1, what a Gateway API
    endpoint picker reads as the server's KV load); ``/cache/slots`` said the same."""
    info = {m["id"]: m for m in client.get("/v1/models", headers=ADMIN).json()["data"]}
    meta = info[ODD]["meta"]
    cells = meta["n_ctx"] * meta["n_parallel"]
    assert meta["n_parallel"] > 1
    prompt = "word " * (meta["n_ctx"] * 3 // 4 // 5)  # 3/4 of one slot, in every slot
    body = {"model": ODD, "prompt": prompt, "max_tokens": 3, "n": meta["n_parallel"]}
    assert client.post("/v1/completions", json=body, headers=ADMIN).status_code == 200
    series, _ = checked(scrape(client))
    labels = (("model", ODD),)
    used = series[("kvwarm_model_kv_cells_used", labels)]
    assert used > meta["n_ctx"]  # the slots together hold more than one slot's n_ctx
    assert series[("kvwarm_model_kv_cells", labels)] == cells
    ratio = series[("kvwarm_model_kv_cache_usage_ratio", labels)]
    assert 0 < ratio <= 1 and ratio == pytest.approx(used / cells)
    slots = {m["id"]: m for m in client.get("/cache/slots", headers=ADMIN).json()["data"]}
    assert slots[ODD]["kv_cells"] == cells and slots[ODD]["kv_cells_used"] <= cells
