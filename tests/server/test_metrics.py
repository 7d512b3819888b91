"""/metrics through prometheus_client: the reference parser reads it, families stay together,
each app has its own registry, and replicas sharing PROMETHEUS_MULTIPROC_DIR sum their counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwarm.engine.types import ModelStatus
from kvwarm.server import metrics


def _families(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_tiers_are_labelled_by_their_configured_names() -> None:
    out = metrics.Families()
    counters = {
        "tier_shared_bytes": 7,  # a tier configured by URL under a name of its own
        "tier_ram_file_effective_quota_bytes": 9,
        "tier_disk_quota_bytes": 11,
    }
    metrics.add_cache(out, counters)
    fams = _families(out.render())
    assert fams["kvwarm_cache_tier_bytes"] == {(("tier", "shared"),): 7}
    assert fams["kvwarm_cache_tier_effective_quota_bytes"] == {(("tier", "ram_file"),): 9}
    assert fams["kvwarm_cache_tier_quota_bytes"] == {(("tier", "disk"),): 11}


def test_cache_models_and_http_render_and_parse() -> None:
    out = metrics.Families()
    metrics.add_cache(
        out,
        {
            "hits_exact": 3,
            "misses": 1,
            "tier_disk_bytes": 2048,
            "tier_ram_rows": 2,
            "latency_pack_seconds": 0.25,
            "evicted_bytes": 10,
            "rows": 4,
        },
    )
    status = ModelStatus(
        id='m"1',
        state="ready",
        queued=2,
        active=1,
        n_parallel=2,
        requests=5,
        prompt_tokens=100,
        cached_tokens=60,
        completion_tokens=40,
        prefill_ms=1500.0,
        generation_ms=500.0,
        kv_cells_used=300,
        kv_cells=4096,
    )
    metrics.add_models(out, {'m"1': "ready", "m2": "loading"}, [status])
    server = metrics.ServerMetrics(metrics.Snapshot)
    for status in (200, 200, 200, 200, 400):
        server.record("/v1/completions", status)
    body, content_type = server.exposition(None)
    assert content_type.startswith("text/plain")
    text = out.render() + body.decode()
    fams = _families(text)
    assert fams["kvwarm_cache_hits_exact_total"][()] == 3
    assert fams["kvwarm_cache_tier_bytes"][(("tier", "disk"),)] == 2048
    assert fams["kvwarm_cache_evicted_bytes_total"][()] == 10
    assert fams["kvwarm_cache_latency_pack_seconds_total"][()] == 0.25
    assert fams["kvwarm_cache_rows"][()] == 4
    assert "# TYPE kvwarm_cache_rows gauge" in text
    assert fams["kvwarm_cache_tier_rows"][(("tier", "ram"),)] == 2
    assert fams["kvwarm_model_queue_depth"][(("model", 'm"1'),)] == 2
    # What an external router balances on: free slots and KV cells in use.
    assert fams["kvwarm_model_free_slots"][(("model", 'm"1'),)] == 1
    assert fams["kvwarm_model_kv_cells_used"][(("model", 'm"1'),)] == 300
    assert fams["kvwarm_model_kv_cells"][(("model", 'm"1'),)] == 4096
    ratio = fams["kvwarm_model_kv_cache_usage_ratio"][(("model", 'm"1'),)]
    assert ratio == pytest.approx(300 / 4096)
    assert fams["kvwarm_model_ready"][(("model", "m2"),)] == 0
    assert fams["kvwarm_prefill_seconds_total"][(("model", 'm"1'),)] == 1.5
    assert fams["kvwarm_cached_tokens_total"][(("model", 'm"1'),)] == 60
    key = (("route", "/v1/completions"), ("status", "400"))
    assert fams["kvwarm_http_requests_total"][key] == 1
    # Each family's samples are contiguous (a second TYPE line for a name would be invalid).
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(type_lines) == len({line.split()[2] for line in type_lines})


def _counts(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return _families(text).get(name, {})


def test_each_app_has_its_own_registry_and_snapshots_are_read_per_scrape() -> None:
    level = {"rows": 1.0}
    first = metrics.ServerMetrics(lambda: metrics.Snapshot(cache=dict(level)))
    second = metrics.ServerMetrics(metrics.Snapshot)
    first.record("/health", 200)
    first.record_finish("m", "stop", disconnected=True)
    text = first.exposition(None)[0].decode()
    assert _counts(text, "kvwarm_http_requests_total") == {
        (("route", "/health"), ("status", "200")): 1
    }
    assert _counts(text, "kvwarm_generations_total")[(("model", "m"), ("reason", "stop"))] == 1
    assert _counts(text, "kvwarm_client_disconnects_total")[()] == 1
    assert _counts(text, "kvwarm_cache_rows")[()] == 1
    other = second.exposition(None)[0].decode()
    assert _counts(other, "kvwarm_http_requests_total") == {}
    assert _counts(other, "kvwarm_client_disconnects_total")[()] == 0
    level["rows"] = 7.0  # read at scrape time, not at registration
    assert _counts(first.exposition(None)[0].decode(), "kvwarm_cache_rows")[()] == 7


def test_openmetrics_when_the_scraper_asks() -> None:
    server = metrics.ServerMetrics(metrics.Snapshot)
    body, content_type = server.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.decode().rstrip().endswith("# EOF")


_REPLICA = """
import sys
from kvwarm.server import metrics
server = metrics.ServerMetrics(metrics.Snapshot)
for _ in range(int(sys.argv[1])):
    server.record("/v1/completions", 200)
server.record_finish("m", "length", disconnected=False)
sys.stdout.write(server.exposition(None)[0].decode())
"""


def _replica(env: dict[str, str], requests: int) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _REPLICA, str(requests)],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return result.stdout


def test_replicas_sharing_a_multiproc_dir_report_the_sum(tmp_path: Path) -> None:
    """Two server processes on one host with PROMETHEUS_MULTIPROC_DIR: a scrape of either
    counts both (the first has exited: its counts still count, as a counter's must)."""
    src = str(Path(metrics.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": src, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    _replica(env, 3)
    text = _replica(env, 2)
    key = (("route", "/v1/completions"), ("status", "200"))
    assert _counts(text, "kvwarm_http_requests_total")[key] == 5
    assert _counts(text, "kvwarm_generations_total")[(("model", "m"), ("reason", "length"))] == 2
    assert _counts(text, "kvwarm_model_ready") == {}  # the snapshot part is still served
    alone = {k: v for k, v in env.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    assert _counts(_replica(alone, 2), "kvwarm_http_requests_total")[key] == 2
