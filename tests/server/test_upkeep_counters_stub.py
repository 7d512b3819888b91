"""What the model counters and the cache's request outcomes count, over HTTP on the stub (found
by review "metricsrev"): the server's own upkeep (``/cache/prewarm``, keep-alive's re-warms) is
counted apart, as prewarms, never as client requests, cached tokens or hits, so an idle
server's hit rate and time saved stay put; an ``n > 1`` request's prompt is prefilled once and
its prefill time counted once; a request cancelled while still queued is a generation that
ended, in ``kvwarm_requests_total`` as in ``kvwarm_generations_total``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvwarm.server import create_app

from .conftest import background_ended, hold_restores, server_state, stub_settings, wait_ready

ADMIN = {"Authorization": "Bearer admin"}
PROMPT = "The keeper of the lighthouse wrote down every ship that passed the point. " * 3
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings(admin_key="admin"))) as test_client:
        wait_ready(test_client.get)
        yield test_client


def scrape(client: TestClient) -> Series:
    response = client.get("/metrics", headers=ADMIN)
    assert response.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def model_series(series: Series, name: str, model: str = "a") -> float:
    return series.get((name, (("model", model),)), 0.0)


def cache_series(series: Series, name: str) -> float:
    return series.get((name, ()), 0.0)


HITS = (
    "kvwarm_cache_hits_exact_total",
    "kvwarm_cache_hits_longest_prefix_total",
    "kvwarm_cache_hits_resume_total",
    "kvwarm_cache_hits_live_total",
    "kvwarm_cache_misses_total",
    "kvwarm_cache_admission_failures_total",
)
CLIENT_COUNTERS = (
    "kvwarm_requests_total",
    "kvwarm_prompt_tokens_total",
    "kvwarm_cached_tokens_total",
    "kvwarm_prefilled_tokens_total",
    "kvwarm_prefill_seconds_total",
)


def client_counts(series: Series) -> dict[str, float]:
    """What the dashboard and a scraper read as client traffic."""
    counts = {name: model_series(series, name) for name in CLIENT_COUNTERS}
    counts.update({name: cache_series(series, name) for name in HITS})
    return counts


def test_prewarms_and_keep_alive_re_warms_are_not_client_requests(client: TestClient) -> None:
    before = client_counts(scrape(client))
    prewarmed = client.post("/cache/prewarm", json={"model": "a", "prompt": PROMPT}, headers=ADMIN)
    assert prewarmed.status_code == 200, prewarmed.text
    first = scrape(client)
    assert client_counts(first) == before
    assert model_series(first, "kvwarm_prewarms_total") == 1
    n_prompt = model_series(first, "kvwarm_prewarm_prompt_tokens_total")
    assert n_prompt > 0
    assert model_series(first, "kvwarm_prewarm_prefilled_tokens_total") == n_prompt
    assert model_series(first, "kvwarm_prewarm_seconds_total") > 0

    # Keep-alive's tick, with the entry due: it re-warms it (its row restored).
    state = server_state(client)
    [entry] = state.keepalive.entries()
    entry.last_warm = float("-inf")
    state._keepalive_tick()
    assert entry.warms == 2
    second = scrape(client)
    assert client_counts(second) == before
    assert model_series(second, "kvwarm_prewarms_total") == 2
    assert model_series(second, "kvwarm_prewarm_prompt_tokens_total") == 2 * n_prompt
    assert model_series(second, "kvwarm_prewarm_cached_tokens_total") > 0

    # What the dashboard derives its hit rate and time saved from: nothing served, no hits.
    stats = client.get("/cache/stats", headers=ADMIN).json()
    totals = stats["model_totals"]["a"]
    assert (totals["requests"], totals["cached_tokens"], totals["prefill_ms"]) == (0, 0, 0)
    assert totals["prewarms"] == 2
    hits = ("hits_exact", "hits_longest_prefix", "hits_resume", "hits_live", "misses")
    assert {k: stats["counters"][k] for k in hits} == dict.fromkeys(hits, 0)

    # A client's request that the prewarm serves counts as one, with its hit.
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    served = client.post("/v1/completions", json=body)
    assert served.status_code == 200, served.text
    third = scrape(client)
    assert model_series(third, "kvwarm_requests_total") == 1
    assert model_series(third, "kvwarm_cached_tokens_total") > 0
    assert sum(cache_series(third, h) for h in HITS[:4]) == 1
    assert model_series(third, "kvwarm_prewarms_total") == 2


def test_n_choices_count_their_one_prefill_s_time_once(client: TestClient) -> None:
    before = scrape(client)
    body = {"model": "a", "prompt": PROMPT * 2, "max_tokens": 2, "temperature": 0.7, "n": 3}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    # The response's timings are its first choice's: the one prefill the group ran.
    prompt_ms = response.json()["timings"]["prompt_ms"]
    assert prompt_ms > 0
    after = scrape(client)
    assert model_series(after, "kvwarm_requests_total") == 3  # three generations finished
    spent_ms = 1e3 * (
        model_series(after, "kvwarm_prefill_seconds_total")
        - model_series(before, "kvwarm_prefill_seconds_total")
    )
    assert spent_ms == pytest.approx(prompt_ms, abs=0.01)
    prompt = response.json()["usage"]["prompt_tokens"]
    assert model_series(after, "kvwarm_prefilled_tokens_total") == prompt


def test_a_request_cancelled_while_queued_counts_as_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One slot; the first background response held in its admission, the second queued
    behind it and cancelled there: both are generations that ended, one ``cancelled``."""
    entered, release = hold_restores(monkeypatch)
    body = {
        "model": "a",
        "input": "Tell me about the quick brown fox, please.",
        "max_output_tokens": 2,
        "temperature": 0,
        "background": True,
    }
    with TestClient(create_app(stub_settings(admin_key="admin", n_parallel=1))) as client:
        wait_ready(client.get)
        try:
            first = client.post("/v1/responses", json=body)
            assert first.status_code == 200, first.text
            assert entered.wait(10)  # the worker admits it: the next one stays queued
            second = client.post("/v1/responses", json=body)
            assert second.status_code == 200, second.text
            sid = second.json()["id"]
            cancelled = client.post(f"/v1/responses/{sid}/cancel")
            assert cancelled.json()["status"] == "cancelled", cancelled.text
        finally:
            release.set()
        background_ended(client, first.json()["id"])
        background_ended(client, sid)
        series = scrape(client)
    finished = {
        labels: value
        for (name, labels), value in series.items()
        if name == "kvwarm_generations_total" and ("model", "a") in labels
    }
    assert finished[(("model", "a"), ("reason", "cancelled"))] == 1
    assert model_series(series, "kvwarm_requests_total") == sum(finished.values()) == 2


def test_cache_slots_rounds_prewarm_time_as_the_others(client: TestClient) -> None:
    prewarmed = client.post("/cache/prewarm", json={"model": "a", "prompt": PROMPT}, headers=ADMIN)
    assert prewarmed.status_code == 200, prewarmed.text
    (status,) = [
        m for m in client.get("/cache/slots", headers=ADMIN).json()["data"] if m["id"] == "a"
    ]
    for name in ("prefill_ms", "generation_ms", "prewarm_ms"):
        assert status[name] == round(status[name], 3), name
    assert status["prewarm_ms"] > 0
