"""Speculative decoding at the server's edges: the request fields (kvwarm's and llama-server's
names), ``timings.draft_n``/``draft_n_accepted`` and the decode clock (``predicted_*``), the
``/metrics`` counters and what ``/v1/models`` says, on a stub model that copies (its path names
``copy``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tests.server.conftest import sse_events, stub_settings, wait_ready

from kvwarm.engine.worker.drafts import Cost, PassCost
from kvwarm.server import create_app
from kvwarm.settings import ModelSpec

PASSAGE = "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat. "
PROMPT = f"Copy this: {PASSAGE}{PASSAGE}Again: The quick"


@pytest.fixture(scope="module", autouse=True)
def cheap_passes() -> Iterator[None]:
    """One more token in a pass costs 5% of a pass, whatever the timing (as on a GPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05)))
        yield


@pytest.fixture(scope="module")
def client(cheap_passes: None) -> Iterator[TestClient]:
    settings = stub_settings(
        models=(
            ModelSpec(path="stub-copy", id="spec", options=(("spec_type", "ngram-simple"),)),
            ModelSpec(path="stub-copy-plain", id="plain"),
        )
    )
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


def counters(client: TestClient, model: str) -> dict[str, float]:
    text = client.get("/metrics").text
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("kvwarm_spec_") and s.labels.get("model") == model
    }


def test_timings_and_metrics_count_drafts(client: TestClient) -> None:
    before = counters(client, "spec")
    body = {"model": "spec", "prompt": PROMPT, "max_tokens": 48, "temperature": 0}
    spec = client.post("/v1/completions", json=body).json()
    plain = client.post(
        "/v1/completions", json={**body, "spec_type": "none", "cache_salt": "other"}
    ).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    timings = spec["timings"]
    assert 0 < timings["draft_n_accepted"] <= timings["draft_n"]
    assert plain["timings"]["draft_n"] == 0
    after = counters(client, "spec")
    drafted = after["kvwarm_spec_draft_tokens_total"] - before.get(
        "kvwarm_spec_draft_tokens_total", 0
    )
    assert drafted == timings["draft_n"]
    assert after["kvwarm_spec_accepted_tokens_total"] > before.get(
        "kvwarm_spec_accepted_tokens_total", 0
    )
    assert after["kvwarm_spec_verify_passes_total"] > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_timings_count_the_drafts_of_every_choice(client: TestClient, path: str) -> None:
    """``n`` choices: ``draft_n`` and ``draft_n_accepted`` are every choice's, as
    ``completion_tokens`` and the ``/metrics`` counters are (found by review: the first
    choice's alone)."""
    body: dict[str, object] = {"model": "spec", "max_tokens": 24, "temperature": 0.7, "n": 3}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    before = counters(client, "spec")
    out = client.post(path, json={**body, "seed": 4, "cache_salt": f"choices{path}"}).json()
    after = counters(client, "spec")
    timings = out["timings"]
    for name, metric in (
        ("draft_n", "kvwarm_spec_draft_tokens_total"),
        ("draft_n_accepted", "kvwarm_spec_accepted_tokens_total"),
    ):
        assert timings[name] == after[metric] - before.get(metric, 0), name
    assert len(out["choices"]) == 3 and timings["draft_n_accepted"] > 0


def test_timings_time_the_decode_steps_as_llama_server_does(client: TestClient) -> None:
    """``predicted_n``/``predicted_ms``/``predicted_per_second``: tokens sampled, the time
    from the first one's sampling to the last one's, and the tokens after the first a second
    (the first comes from the prompt's pass), llama-server's clock, so that a comparison
    times both alike; ``generation_ms`` holds more (the first sampling, the finish)."""
    for model, salt, max_tokens in (("spec", "t1", 40), ("plain", "t2", 40), ("plain", "t3", 1)):
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
        out = client.post("/v1/completions", json={**body, "cache_salt": salt}).json()
        timings, tokens = out["timings"], out["usage"]["completion_tokens"]
        ended = out["choices"][0]["finish_reason"] == "stop"
        assert timings["predicted_n"] == tokens + (1 if ended else 0)
        assert 0 <= timings["predicted_ms"] <= timings["generation_ms"]
        steps = timings["predicted_n"] - 1
        if steps == 0:
            assert timings["predicted_per_second"] == 0
        else:
            rate = steps * 1e3 / timings["predicted_ms"]
            assert timings["predicted_per_second"] == pytest.approx(rate, rel=1e-3, abs=1e-3)


def test_streamed_chat_reports_drafts_in_its_usage_chunk(client: TestClient) -> None:
    body = {
        "model": "spec",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(client.post("/v1/chat/completions", json=body).text)
    last = events[-1]
    assert isinstance(last, dict) and last["timings"]["draft_n_accepted"] > 0


def test_llama_server_request_names_switch_it_per_request(client: TestClient) -> None:
    body = {"model": "plain", "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    off = client.post("/v1/completions", json=body).json()["timings"]
    assert off["draft_n"] == 0
    on = client.post(
        "/v1/completions",
        json={**body, "cache_salt": "x", "speculative.type": "ngram-map-k", "speculative.n_max": 4},
    ).json()["timings"]
    assert on["draft_n_accepted"] > 0
    mine = client.post(
        "/v1/completions", json={**body, "cache_salt": "y", "spec_type": "ngram-simple"}
    ).json()["timings"]
    assert mine["draft_n_accepted"] > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("spec_type", "draft-eagle3"),  # llama-server's, not kvwarm's
        ("speculative.type", "draft-mtp"),
        ("spec_type", "draft-simple"),  # a name, but this model has no draft model
        ("spec_draft_max", 63),
    ],
)
def test_bad_values_are_400s_naming_the_field(
    client: TestClient, field: str, value: object
) -> None:
    body = {"model": "spec", "prompt": "x", "max_tokens": 2, field: value}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert field.split(".", maxsplit=1)[0] in response.text


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [
        ({"spec_type": "none"}, {"speculative.type": "ngram-mod"}),
        ({"spec_type": None}, {"speculative.type": "ngram-mod"}),
        ({"spec_draft_max": 2}, {"speculative.n_max": 40}),
        ({"spec_draft_max": 1}, {"speculative.n_max": True}),  # JSON's true is not 1
    ],
)
def test_both_names_of_a_field_with_other_values_are_a_400(
    client: TestClient, mine: dict[str, object], theirs: dict[str, object]
) -> None:
    """kvwarm's name and llama-server's for one field, given different values: a 400 naming
    them (found by review: the first name silently won and the other was dropped)."""
    body = {"model": "spec", "prompt": "x", "max_tokens": 2, **mine, **theirs}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == next(iter(theirs))
    assert next(iter(mine)) in error["message"] and next(iter(theirs)) in error["message"]
    same = {**body, next(iter(theirs)): next(iter(mine.values()))}
    assert client.post("/v1/completions", json=same).status_code == 200  # one value: fine


def test_models_say_whether_and_how_they_speculate(client: TestClient) -> None:
    data = {m["id"]: m["meta"] for m in client.get("/v1/models").json()["data"]}
    assert data["spec"]["speculative"] == {
        "type": "ngram-simple",
        "available": "on",
        "exact": "at any length",  # the stub's logits are a function of the prefix alone
        "draft_model": None,
    }
    assert data["plain"]["speculative"] == {
        "type": "none",
        "available": "on",
        "exact": "at any length",
        "draft_model": None,
    }


def test_a_deterministic_model_says_its_draft_model_is_not_loaded() -> None:
    """Deterministic: speculation is off, so the draft model is not loaded (found by review:
    it was, its weights and context taken for drafts never asked for)."""
    spec = ModelSpec(path="stub-copy", id="exact", options=(("draft_model", "draft-stub.gguf"),))
    settings = stub_settings(models=(spec,), deterministic=True)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        [meta] = [m["meta"] for m in client.get("/v1/models").json()["data"]]
    assert meta["speculative"]["draft_model"] is None and meta["draft_bytes"] == 0
    available = meta["speculative"]["available"]
    assert meta["speculative"]["exact"] is None  # it cannot speculate
    assert available.startswith("off: deterministic mode")
    assert available.endswith("; the draft model draft-stub.gguf was not loaded")


@pytest.mark.parametrize("path", ["stub-reranker.gguf", "stub-cross-encoder.gguf"])
def test_a_reranker_says_it_does_not_speculate_and_loads_no_draft_model(path: str) -> None:
    """A reranker (a decoder pooling by rank, or a cross-encoder) never generates, so it never
    verifies a draft: given a ``spec_type`` and a ``draft_model`` (a server-wide one applies
    to every model) ``/v1/models`` says speculation is off and why, and the draft model is not
    loaded (found by review: "on", and the draft model's weights and context were loaded for
    drafts never asked for; a draft model of another vocabulary failed the reranker's load,
    every ``/v1/rerank`` a 503)."""
    options = (("spec_type", "ngram-simple"), ("draft_model", "draft-stub.gguf"))
    settings = stub_settings(models=(ModelSpec(path=path, id="ranker", options=options),))
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        [meta] = [m["meta"] for m in client.get("/v1/models").json()["data"]]
        ranked = client.post(
            "/v1/rerank", json={"model": "ranker", "query": "a", "documents": ["b"]}
        )
    assert ranked.status_code == 200, ranked.text
    speculative = meta["speculative"]
    assert speculative["available"].startswith("off: this model does not generate"), speculative
    assert speculative["available"].endswith("; the draft model draft-stub.gguf was not loaded")
    assert speculative["exact"] is None and speculative["draft_model"] is None
    assert meta["draft_bytes"] == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40},
        ),
        ("/v1/responses", {"input": PROMPT, "max_output_tokens": 40, "store": False}),
    ],
)
def test_anthropic_and_responses_bodies_choose_their_speculation(
    client: TestClient, path: str, body: dict[str, object]
) -> None:
    """``spec_type`` and ``spec_draft_max`` (and llama-server's names) on Anthropic's and the
    Responses API's bodies, as on the OpenAI ones: a per-request switch on every generating
    route (they were ignored there, so only the model's default applied), the text the same
    either way; a bad value is a 400 naming the field."""
    base = {**body, "temperature": 0}

    def drafted(model: str, extra: dict[str, object], salt: str) -> tuple[float, str]:
        before = counters(client, model).get("kvwarm_spec_draft_tokens_total", 0)
        reply = client.post(path, json={**base, "model": model, "cache_salt": salt, **extra})
        assert reply.status_code == 200, reply.text
        after = counters(client, model).get("kvwarm_spec_draft_tokens_total", 0)
        return after - before, reply.text

    n, _ = drafted("spec", {}, f"{path}a")
    assert n > 0  # the model's default: it drafts
    n, _ = drafted("spec", {"spec_type": "none"}, f"{path}b")
    assert n == 0
    n, _ = drafted("spec", {"speculative.n_max": 0}, f"{path}c")
    assert n == 0
    n, _ = drafted("plain", {}, f"{path}d")
    assert n == 0  # a model that does not speculate by default ...
    n, _ = drafted("plain", {"speculative.type": "ngram-simple"}, f"{path}e")
    assert n > 0  # ... does for a request that asks
    for bad in ({"spec_type": "ngram-fast"}, {"spec_draft_max": -1}, {"spec_type": 3}):
        reply = client.post(path, json={**base, "model": "spec", **bad})
        assert reply.status_code == 400, reply.text
        assert next(iter(bad)) in reply.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/responses", {"input": "x"}),
    ],
)
@pytest.mark.parametrize("field", ["spec_type", "speculative.type"])
def test_draft_simple_without_a_draft_model_names_the_field_as_sent(
    client: TestClient, path: str, body: dict[str, object], field: str
) -> None:
    """The check that needs the model (it has no draft model) runs at submit, past the body's
    validation: its 400 named kvwarm's ``spec_type`` to a client that sent llama-server's
    ``speculative.type`` (found by review)."""
    sent = {**body, "model": "spec", "max_tokens": 2, field: "draft-simple"}
    response = client.post(path, json=sent)
    assert response.status_code == 400, response.text
    text = response.text
    assert f"{field} 'draft-simple' needs a draft model" in text
    if field != "spec_type":
        assert "spec_type" not in text
    if path != "/v1/messages":  # Anthropic's error shape has no param
        assert response.json()["error"]["param"] == field


def test_a_chat_prediction_is_drafted_and_the_reply_is_the_same(cheap_passes: None) -> None:
    """OpenAI's ``prediction`` (predicted outputs): the reply predicted, as a string or as text
    parts, is drafted and kept, on a model that speculates and on one whose spec_type is none;
    the reply is what it is without one. A prediction of another shape is a 400 naming it.
    Stub models that do not copy: a reply's own text drafts next to nothing."""
    settings = stub_settings(
        models=(
            ModelSpec(path="stub-x", id="spec", options=(("spec_type", "ngram-simple"),)),
            ModelSpec(path="stub-y", id="plain"),
        )
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        _predictions(client)


def _predictions(client: TestClient) -> None:
    messages = [{"role": "user", "content": "Tell me about the harbour and the lighthouse."}]
    for model in ("spec", "plain"):
        body = {"model": model, "messages": messages, "max_tokens": 40, "temperature": 0}
        first = client.post("/v1/chat/completions", json={**body, "cache_salt": "p0"}).json()
        text = first["choices"][0]["message"]["content"]
        alone = client.post("/v1/chat/completions", json={**body, "cache_salt": "p1"}).json()
        parts = [{"type": "text", "text": text[:9]}, {"type": "text", "text": text[9:]}]
        for salt, content in (("p2", text), ("p3", parts)):
            predicted = client.post(
                "/v1/chat/completions",
                json={
                    **body,
                    "cache_salt": salt,
                    "prediction": {"type": "content", "content": content},
                },
            ).json()
            assert predicted["choices"][0]["message"]["content"] == text
            kept = predicted["timings"]["draft_n_accepted"]
            assert kept >= 30 > alone["timings"]["draft_n_accepted"], (model, kept, alone)
    for bad in ({"type": "content", "content": 5}, {"type": "file", "content": "x"}, "x"):
        res = client.post(
            "/v1/chat/completions",
            json={"model": "spec", "messages": messages, "max_tokens": 2, "prediction": bad},
        )
        assert res.status_code == 400, res.text
        assert res.json()["error"]["param"].startswith("prediction"), res.text
