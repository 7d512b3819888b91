"""The Prometheus exposition parses with the reference parser and keeps families together."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvwarm.engine.types import ModelStatus
from kvwarm.server import metrics


def _families(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_cache_models_and_http_render_and_parse() -> None:
    out = metrics.Exposition()
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
    )
    metrics.add_models(out, {'m"1': "ready", "m2": "loading"}, [status])
    metrics.add_http(out, {("/v1/completions", 200): 4, ("/v1/completions", 400): 1})
    text = out.render()
    fams = _families(text)
    assert fams["kvwarm_cache_hits_exact_total"][()] == 3
    assert fams["kvwarm_cache_tier_bytes"][(("tier", "disk"),)] == 2048
    assert fams["kvwarm_cache_evicted_bytes_total"][()] == 10
    assert fams["kvwarm_cache_latency_pack_seconds_total"][()] == 0.25
    assert fams["kvwarm_cache_rows"][()] == 4
    assert "# TYPE kvwarm_cache_rows gauge" in text
    assert fams["kvwarm_cache_tier_rows"][(("tier", "ram"),)] == 2
    assert fams["kvwarm_model_queue_depth"][(("model", 'm"1'),)] == 2
    assert fams["kvwarm_model_ready"][(("model", "m2"),)] == 0
    assert fams["kvwarm_prefill_seconds_total"][(("model", 'm"1'),)] == 1.5
    assert fams["kvwarm_cached_tokens_total"][(("model", 'm"1'),)] == 60
    key = (("route", "/v1/completions"), ("status", "400"))
    assert fams["kvwarm_http_requests_total"][key] == 1
    # Each family's samples are contiguous (a second TYPE line for a name would be invalid).
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(type_lines) == len({line.split()[2] for line in type_lines})
