"""Miss reasons at the server's edges (issue 25): ``timings.cache_reason`` on every completion
(plain and streamed), the ``reason=`` on the request log line and the
``kvwarm_cache_reasons_total{model,reason}`` counter."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tests.server.conftest import sse_events, stub_settings, wait_ready

from kvwarm.server import create_app

PROMPT = "Why did it prefill again? Because nothing shared a prefix. " * 3


@pytest.fixture
def fresh() -> Iterator[TestClient]:
    """Its own app: the reasons depend on what this cache has seen."""
    with TestClient(create_app(stub_settings())) as test_client:
        wait_ready(test_client.get)
        yield test_client


def reasons(client: TestClient) -> dict[tuple[str, str], float]:
    text = client.get("/metrics").text
    return {
        (s.labels["model"], s.labels["reason"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvwarm_cache_reasons_total"
    }


def test_timings_log_and_counter_say_why(
    fresh: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="kvwarm.server.requests"):
        first = fresh.post("/v1/completions", json=body).json()
    assert first["timings"]["cache_reason"] == {
        "reason": "no_prefix",
        "found_tokens": 0,
        "reused_tokens": 0,
    }
    assert any("reason=no_prefix found=0" in r.getMessage() for r in caplog.records)
    longer = {**body, "prompt": PROMPT + "And then?"}
    second = fresh.post("/v1/completions", json=longer).json()
    why = second["timings"]["cache_reason"]
    assert why["reason"] == "new_tokens"
    assert why["reused_tokens"] == second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    counts = reasons(fresh)
    assert counts[("a", "no_prefix")] == 1 and counts[("a", "new_tokens")] == 1


def test_a_streamed_chat_carries_the_reason_with_its_usage(fresh: TestClient) -> None:
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = fresh.post("/v1/chat/completions", json=body)
    events = [e for e in sse_events(response.text) if isinstance(e, dict) and e.get("usage")]
    assert events, "no usage chunk"
    assert events[-1]["timings"]["cache_reason"]["reason"] == "no_prefix"


def generations(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    out: dict[str, float] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == "kvwarm_generations_total":
                out[s.labels["model"]] = out.get(s.labels["model"], 0.0) + s.value
    return out


def test_every_choice_of_n_has_a_reason(
    fresh: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: the other choices of an ``n > 1`` request (forks of the first, their
    whole prompt's KV its) carried no reason, so ``kvwarm_cache_reasons_total`` counted one
    generation where ``kvwarm_generations_total`` counted ``n``, and their log lines said
    ``reason=-``: every completion says why, as the docs promise ("none": all of it reused)."""
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 2, "n": 3}
    with caplog.at_level(logging.INFO, logger="kvwarm.server.requests"):
        assert fresh.post("/v1/completions", json=body).status_code == 200
    counted = reasons(fresh)
    assert sum(n for (model, _), n in counted.items() if model == "a") == generations(fresh)["a"]
    assert counted[("a", "none")] == 2  # the two forks: the first choice's prompt KV, whole
    lines = [r.getMessage() for r in caplog.records if r.name == "kvwarm.server.requests"]
    assert len(lines) == 3 and not [line for line in lines if "reason=-" in line], lines
