"""llama-server's own routes (``/completion``, ``/completions``, ``/embedding``,
``/embeddings``, ``/apply-template``, ``GET``/``POST /props``, ``/slots``) in llama-server's
shapes, on the stub backend: what a llama-server client (its web page, llama.vim, scripts)
reads of them. A field kvwarm cannot honour is a 400 naming it, never dropped silently."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app
from kvwarm.settings import ModelSpec

from .conftest import server_state, stub_settings, wait_ready

ADMIN = "admin-secret"
KEY = "api-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(stub_settings(api_key=KEY, admin_key=ADMIN))) as c:
        wait_ready(c.get)
        yield c


@pytest.fixture(scope="module")
def fim() -> Iterator[TestClient]:
    """A server of one model with FIM tokens, for /infill."""
    with TestClient(create_app(stub_settings(models=(ModelSpec(path="stub-fim", id="fim"),)))) as c:
        wait_ready(c.get)
        yield c


INFILL = {"model": "fim", "input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 2}


def _events(text: str) -> list[dict[str, object]]:
    assert "[DONE]" not in text  # llama-server's own routes send none
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]


def test_completion_answers_in_llama_servers_shape(client: TestClient) -> None:
    body = {"prompt": "hello there", "n_predict": 4, "temperature": 0, "return_tokens": True}
    done = client.post("/completion", json=body, headers=AUTH)
    assert done.status_code == 200, done.text
    data = done.json()
    assert data["stop"] is True and data["index"] == 0 and data["model"] == "a"
    assert data["stop_type"] == "limit" and data["tokens_predicted"] == 4 == len(data["tokens"])
    detok = client.post("/detokenize", json={"tokens": data["tokens"]}, headers=AUTH).json()
    assert detok["content"] == data["content"]
    settings = data["generation_settings"]
    assert settings["n_predict"] == 4 and settings["temperature"] == 0
    assert data["prompt"].endswith("hello there")
    assert data["tokens_evaluated"] == data["timings"]["prompt_n"] + data["timings"]["cache_n"]
    # /completions is the same route; n_probs gives llama-server's completion_probabilities.
    probs = client.post("/completions", json={**body, "n_probs": 2}, headers=AUTH).json()
    assert probs["content"] == data["content"]
    assert [r["id"] for r in probs["completion_probabilities"]] == data["tokens"]


def test_completion_streams_tokens_then_the_whole_body(client: TestClient) -> None:
    body = {"prompt": "hello there", "n_predict": 5, "temperature": 0}
    whole = client.post("/completion", json={**body, "return_tokens": True}, headers=AUTH).json()
    streamed = client.post("/completion", json={**body, "stream": True}, headers=AUTH)
    assert streamed.status_code == 200
    events = _events(streamed.text)
    chunks, last = events[:-1], events[-1]
    assert all(c["stop"] is False and c["index"] == 0 for c in chunks)
    assert "".join(str(c["content"]) for c in chunks) == whole["content"]
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]  # type: ignore[attr-defined]
    assert chunks[-1]["tokens_predicted"] == 5
    assert chunks[-1]["tokens_evaluated"] == whole["tokens_evaluated"]
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == []
    assert isinstance(last["generation_settings"], dict) and "timings" in last


def test_completion_of_several_prompts_is_a_list_indexed_as_llama_server(
    client: TestClient,
) -> None:
    body = {"prompt": ["one", [5, 6, 7]], "n_predict": 2, "n": 2, "temperature": 0}
    data = client.post("/completion", json=body, headers=AUTH).json()
    assert isinstance(data, list) and [d["index"] for d in data] == [0, 1, 2, 3]
    events = _events(client.post("/completion", json={**body, "stream": True}, headers=AUTH).text)
    ends = sorted(int(str(e["index"])) for e in events if e["stop"] is True)
    assert ends == [0, 1, 2, 3]
    assert client.post("/completion", json={**body, "n_cmpl": 3}, headers=AUTH).status_code == 400


#: llama-server's samplers and controls kvwarm lacks, at a value that would change what runs:
#: /completion and /infill refuse them by name.
CONTROLS: list[tuple[str, object]] = [
    ("mirostat", 2),
    ("dry_multiplier", 0.8),
    ("xtc_probability", 0.5),
    ("top_n_sigma", 1.0),
    ("dynatemp_range", 0.5),
    ("min_keep", 2),
    ("timings_per_token", True),
    ("return_progress", True),
    ("post_sampling_probs", True),
]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *CONTROLS,
        ("repeat_last_n", 128),
        ("id_slot", 0),
        ("cache_prompt", False),
        ("samplers", ["top_k", "temperature"]),
        ("samplers", "edskympxt"),  # min-p before top-p
    ],
)
def test_completion_refuses_what_kvwarm_cannot_do_by_name(
    client: TestClient, field: str, value: object
) -> None:
    body = {"prompt": "x", "n_predict": 1, field: value}
    if field == "repeat_last_n":
        body["repeat_penalty"] = 1.1  # the window of a penalty that runs
    refused = client.post("/completion", json=body, headers=AUTH)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"


@pytest.mark.parametrize(("field", "value"), CONTROLS)
def test_infill_refuses_what_kvwarm_cannot_do_by_name(
    fim: TestClient, field: str, value: object
) -> None:
    """Found by review: /infill dropped these silently (a mirostat or DRY request sampled
    without either), where /completion refuses them."""
    refused = fim.post("/infill", json={**INFILL, field: value})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"
    penalised = {**INFILL, "repeat_last_n": 128, "repeat_penalty": 1.1}
    assert fim.post("/infill", json=penalised).json()["error"]["param"] == "repeat_last_n"


def test_infill_takes_llama_vims_request(fim: TestClient) -> None:
    """What llama.vim sends with every request: its samplers (an "infill" sampler kvwarm has
    not) and cache_prompt are ignored on /infill, as docs/server.md says, never refused."""
    body = {
        **INFILL,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "id_slot": 0,
        "top_k": 40,
        "top_p": 0.9,
        "mirostat": 0,
        "min_keep": 1,
    }
    done = fim.post("/infill", json=body)
    assert done.status_code == 200, done.text


def test_an_infill_extra_file_without_text_is_refused(fim: TestClient) -> None:
    """llama-server refuses an ``input_extra`` chunk without a string ``text``; kvwarm took it
    as an empty file (one sending ``content`` lost its context without a word)."""
    for chunk in ({"filename": "a.py", "content": "x = 1"}, {"filename": "a.py"}):
        refused = fim.post("/infill", json={**INFILL, "input_extra": [chunk]})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "input_extra.0.text"
    kept = fim.post("/infill", json={**INFILL, "input_extra": [{"text": "x = 1"}]})
    assert kept.status_code == 200, kept.text


def test_infill_reads_json_schema_as_completion_does(fim: TestClient) -> None:
    """llama-server's /infill reads ``json_schema`` as /completion does; kvwarm ignored it
    there and answered unconstrained. (The stub constrains nothing by a schema: what shows
    that it now reaches the options is the refusal of it with a grammar, as /completion's.)"""
    schema = {"type": "string", "enum": ["xyzzy"]}
    both = {"json_schema": schema, "grammar": 'root ::= "q"'}
    for route, body in (("/completion", {"model": "fim", "prompt": "x"}), ("/infill", INFILL)):
        refused = fim.post(route, json={**body, **both})
        assert refused.status_code == 400, (route, refused.text)
        assert refused.json()["error"]["param"] == "grammar"
        # The field as these routes spell it (it named response_format, which they lack).
        assert "json_schema" in refused.json()["error"]["message"]
    assert fim.post("/infill", json={**INFILL, "json_schema": schema}).status_code == 200


def test_completion_takes_the_off_values_llama_server_clients_send(client: TestClient) -> None:
    off = {"cache_prompt": True, "id_slot": -1, "mirostat": 0, "top_n_sigma": -1.0}
    done = client.post("/completion", json={"prompt": "x", "n_predict": 1, **off}, headers=AUTH)
    assert done.status_code == 200, done.text
    # llama.cpp runs these only above 0 (top-n-sigma, dynamic temperature, the line stops):
    # 0 and any negative value are off (found by review: 0, their common "off", was a 400).
    for field in ("top_n_sigma", "dynatemp_range", "t_max_predict_ms", "n_indent"):
        for value in (0, -1, -0.5 if field in ("top_n_sigma", "dynatemp_range") else -7):
            body = {"prompt": "x", "n_predict": 1, field: value}
            done = client.post("/completion", json=body, headers=AUTH)
            assert done.status_code == 200, (field, value, done.text)


@pytest.mark.parametrize(
    "extra",
    [
        {"samplers": "edskypmxt"},  # llama-server's default order
        {"samplers": "edkypmxt"},  # an older default, without top-n-sigma
        {"samplers": "ekypmt"},
        {"samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temp"]},
        {"repeat_last_n": 256},  # no penalty runs: its window counts nothing
        {"repeat_last_n": 0, "repeat_penalty": 1.0, "presence_penalty": 0},
        {"min_keep": 1},  # llama.cpp's truncations keep one at least anyway
    ],
)
def test_completion_takes_what_changes_nothing_kvwarm_runs(
    client: TestClient, extra: dict[str, object]
) -> None:
    body = {"prompt": "x", "n_predict": 1, **extra}
    done = client.post("/completion", json=body, headers=AUTH)
    assert done.status_code == 200, done.text


def test_embedding_is_llama_servers_list_of_vectors(client: TestClient) -> None:
    oai = client.post("/v1/embeddings", json={"input": ["x", "yz"]}, headers=AUTH).json()
    for route, field in (("/embedding", "content"), ("/embeddings", "input")):
        data = client.post(route, json={field: ["x", "yz"]}, headers=AUTH).json()
        assert [d["index"] for d in data] == [0, 1]
        assert [d["embedding"] for d in data] == [[d["embedding"]] for d in oai["data"]]
    raw = client.post("/embedding", json={"content": "x", "embd_normalize": -1}, headers=AUTH)
    assert raw.status_code == 200
    refused = client.post("/embedding", json={"content": "x", "embd_normalize": 1}, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "embd_normalize"
    none = client.post("/embedding", json={"model": "a"}, headers=AUTH)
    assert none.status_code == 400 and none.json()["error"]["param"] == "content"


def test_apply_template_is_the_prompt_a_chat_sends(client: TestClient) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = client.post("/apply-template", json={"messages": messages}, headers=AUTH)
    assert prompt.status_code == 200, prompt.text
    text = prompt.json()["prompt"]
    assert "be brief" in text and "hi" in text
    chat = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, headers=AUTH
    ).json()
    tokens = client.post(
        "/tokenize", json={"content": text, "parse_special": True}, headers=AUTH
    ).json()["tokens"]
    assert len(tokens) == chat["usage"]["prompt_tokens"]


def test_props_say_the_models_context_slots_and_defaults(client: TestClient) -> None:
    props = client.get("/props", headers=AUTH).json()
    assert props["total_slots"] == 4 and props["model_alias"] == "a"
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 1024 and settings["params"]["n_predict"] == 32
    assert (
        client.get("/props?model=b", headers=AUTH).json()["default_generation_settings"]["n_ctx"]
        == 256
    )


def test_post_props_is_admin_and_changes_nothing_silently(client: TestClient) -> None:
    assert client.post("/props", json={}, headers=AUTH).status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert client.post("/props", json={}, headers=admin).json() == {"success": True}
    refused = client.post("/props", json={"n_ctx": 8}, headers=admin)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n_ctx"


def test_slots_show_counts_never_a_tenants_prompt(client: TestClient) -> None:
    secret = "the other tenant's secret prompt"
    done = client.post("/completion", json={"prompt": secret, "n_predict": 2}, headers=AUTH)
    assert done.status_code == 200
    slots = client.get("/slots", headers=AUTH)
    assert slots.status_code == 200
    data = slots.json()
    assert [s["id"] for s in data] == [0, 1, 2, 3] and all(s["n_ctx"] == 1024 for s in data)
    # An idle slot's request counts are zero (SlotStatus: kvwarm keeps no finished request's).
    assert all(s["is_processing"] is False and s["n_prompt_tokens"] == 0 for s in data)
    assert "secret" not in slots.text
    assert not {"prompt", "generated", "params"} & {k for s in data for k in s}
    assert client.get("/slots").status_code == 401  # the API key, as every other route


def test_a_foreign_origin_cannot_drive_the_new_routes(client: TestClient) -> None:
    evil = {**AUTH, "Origin": "http://evil.example"}
    for route, body in (
        ("/completion", {"prompt": "x"}),
        ("/embedding", {"content": "x"}),
        ("/apply-template", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        assert client.post(route, json=body, headers=evil).status_code == 403
    assert client.get("/slots", headers=evil).status_code == 403


def test_a_get_loads_no_model() -> None:
    """GET /props and /slots answer for a loaded model only: any web page may send a GET
    (with no Origin header, so the guard cannot refuse it), and loading a model, or unloading
    an idle one to make room, is a change no foreign page may cause."""
    with TestClient(create_app(stub_settings())) as c:
        wait_ready(c.get)
        assert c.post("/admin/models/unload", json={"model": "b"}).json()["status"] == "available"
        for route in ("/props?model=b", "/slots?model=b"):
            refused = c.get(route)
            assert refused.status_code == 409, route
            assert refused.json()["error"]["code"] == "model_not_loaded"
        statuses = {m["id"]: m["status"] for m in c.get("/v1/models").json()["data"]}
        assert statuses["b"] == "available"  # still not loaded
        assert c.post("/completion", json={"prompt": "x", "n_predict": 1, "model": "b"}).is_success
        assert c.get("/props?model=b").json()["default_generation_settings"]["n_ctx"] == 256
        assert len(c.get("/slots?model=b").json()) >= 1


def test_a_get_leaves_the_idle_timer_alone() -> None:
    """GET /props and /slots do not count as a model's use: found by review, each restarted
    its idle timer (``model_idle_unload_s``, a request's ``keep_alive``), so any web page
    polling either (no Origin header: the guard cannot refuse it), or a monitor polling
    llama-server's ``/slots``, kept an idle model loaded for ever and last in line to be
    unloaded for another."""
    with TestClient(create_app(stub_settings(model_idle_unload_s=600))) as c:
        wait_ready(c.get)
        registry = server_state(c).registry
        entry = server_state(c).entries["a"]
        due = registry.due(entry)
        assert due is not None
        for route in ("/props?model=a", "/slots?model=a", "/props", "/slots"):
            assert c.get(route).status_code == 200, route
            assert registry.due(entry) == due, route
        # A request to the model is its use: the timer starts again from its end.
        assert c.post("/tokenize", json={"model": "a", "content": "x"}).is_success
        later = registry.due(entry)
        assert later is not None and later > due
