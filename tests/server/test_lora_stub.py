"""LoRA over HTTP on the stub backend (``server/lora.py``): llama-server's ``/lora-adapters``
and per-request ``lora``, vLLM's adapters served under model names of their own, the cache
namespace of each, the errors and the guard. The stub's logits are salted by the adapters a
pass runs under, so a request run under the wrong set gives other text.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app

from .conftest import stub_settings, wait_ready

PROMPT = "Tell me a story about a lighthouse keeper and a cat, in three short sentences"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("lora")
    sql, pirate = folder / "sql.gguf", folder / "pirate.gguf"
    sql.write_bytes(b"stub adapter: sql")
    pirate.write_bytes(b"stub adapter: pirate")
    return sql, pirate


@pytest.fixture(scope="module")
def client(adapters: tuple[Path, Path]) -> Iterator[TestClient]:
    sql, pirate = adapters
    settings = stub_settings(lora=(("sql", str(sql)), ("pirate", str(pirate))))
    with TestClient(create_app(settings)) as test_client:
        wait_ready(test_client.get)
        yield test_client


def _complete(client: TestClient, prompt: str, **fields: object) -> dict[str, object]:
    body = {"model": "a", "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.json()
    return response.json()  # type: ignore[no-any-return]


def _text(reply: dict[str, object]) -> str:
    return reply["choices"][0]["text"]  # type: ignore[index,no-any-return]


def _cached(reply: dict[str, object]) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index,no-any-return]


def test_adapters_are_listed_by_id_and_as_models(
    client: TestClient, adapters: tuple[Path, Path]
) -> None:
    listed = client.get("/lora-adapters").json()
    assert listed == [
        {"id": 0, "path": str(adapters[0]), "scale": 0.0, "name": "sql", "model": "a"},
        {"id": 1, "path": str(adapters[1]), "scale": 0.0, "name": "pirate", "model": "a"},
    ]
    assert client.get("/lora-adapters", params={"model": "sql"}).json() == listed
    assert client.get("/lora-adapters", params={"model": "b"}).json() == []
    missing = client.get("/lora-adapters", params={"model": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["sql"]["parent"] == "a" and models["sql"]["root"] == str(adapters[0])
    assert models["pirate"]["status"] == models["a"]["status"] == "ready"
    one = client.get("/v1/models/sql").json()
    assert one["id"] == "sql" and one["parent"] == "a"


def test_each_adapter_is_its_own_cache_namespace_in_both_forms(client: TestClient) -> None:
    prompt = PROMPT + " (namespaces)"
    base = _complete(client, prompt)
    assert _complete(client, prompt)["choices"] == base["choices"]
    assert _cached(_complete(client, prompt)) > 0
    # vLLM's form: the adapter's name. Never the base model's rows or live KV.
    sql = _complete(client, prompt, model="sql")
    assert _cached(sql) == 0 and _text(sql) != _text(base)
    assert sql["model"] == "sql"
    again = _complete(client, prompt, model="sql")
    assert _cached(again) > 0 and _text(again) == _text(sql)
    # llama-server's form, the same adapter at the same scale: the same namespace and text.
    by_id = _complete(client, prompt, lora=[{"id": 0, "scale": 1.0}])
    assert _cached(by_id) > 0 and _text(by_id) == _text(sql)
    # Another adapter, and another scale, are other namespaces.
    pirate = _complete(client, prompt, lora=[{"id": 1, "scale": 1.0}])
    assert _cached(pirate) == 0 and _text(pirate) not in (_text(base), _text(sql))
    half = _complete(client, prompt, model="sql", lora=[{"id": 0, "scale": 0.5}])
    assert _cached(half) == 0 and _text(half) not in (_text(base), _text(sql))
    # The base model is still the base model, its rows still its own.
    back = _complete(client, prompt)
    assert _text(back) == _text(base) and _cached(back) > 0
    # Scale 0 (llama-server's default for a listed id) is no adapter: the base namespace.
    off = _complete(client, prompt, lora=[{"id": 0}])
    assert _text(off) == _text(base) and _cached(off) > 0


def test_the_chat_apis_run_the_adapter_too(client: TestClient) -> None:
    messages = [{"role": "user", "content": PROMPT + " (chat)"}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    base = client.post("/v1/chat/completions", json={**body, "model": "a"}).json()
    sql = client.post("/v1/chat/completions", json={**body, "model": "sql"}).json()
    by_id = client.post(
        "/v1/chat/completions", json={**body, "model": "a", "lora": [{"id": 0, "scale": 1}]}
    ).json()
    content = [r["choices"][0]["message"]["content"] for r in (base, sql, by_id)]
    assert content[1] != content[0] and content[2] == content[1]
    assert sql["model"] == "sql" and base["model"] == "a"
    anthropic = client.post(
        "/v1/messages", json={"model": "sql", "messages": messages, "max_tokens": 8,
                              "temperature": 0},
    ).json()  # fmt: skip
    assert anthropic["model"] == "sql" and anthropic["content"][0]["text"] == content[1]
    responses = client.post(
        "/v1/responses", json={"model": "sql", "input": messages, "max_output_tokens": 8,
                               "temperature": 0},
    ).json()  # fmt: skip
    assert responses["model"] == "sql"


def test_global_scales_change_what_the_base_name_runs_under(client: TestClient) -> None:
    prompt = PROMPT + " (global)"
    base = _text(_complete(client, prompt))
    pirate = _text(_complete(client, prompt, model="pirate"))
    try:
        ok = client.post("/lora-adapters", json=[{"id": 1, "scale": 1.0}])
        assert ok.status_code == 200 and ok.json() == {"success": True}
        assert [a["scale"] for a in client.get("/lora-adapters").json()] == [0.0, 1.0]
        assert _text(_complete(client, prompt)) == pirate
        # A request's own list wins over the global scales; its model name too.
        assert _text(_complete(client, prompt, lora=[{"id": 1, "scale": 0}])) == base
        assert _text(_complete(client, prompt, model="sql")) != pirate
    finally:
        assert client.post("/lora-adapters", json=[]).status_code == 200
    assert [a["scale"] for a in client.get("/lora-adapters").json()] == [0.0, 0.0]
    assert _text(_complete(client, prompt)) == base


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora": [{"id": 9, "scale": 1.0}]}, "lora"),
        ({"lora": [{"id": 0, "scale": 1.0}, {"id": 0, "scale": 0.5}]}, "lora"),
        ({"lora": [{"id": 0, "scale": "HUGE"}]}, "lora"),
        ({"lora": [{"id": -1, "scale": 1.0}]}, "lora.0.id"),
        ({"lora": [{"id": 0, "scale": 1.0, "x": 1}]}, "lora.0.x"),
        ({"lora": {"id": 0}}, "lora"),
        ({"model": "b", "lora": [{"id": 0, "scale": 1.0}]}, "lora"),
        # JSON numbers only (found by review: true was id 1 or scale 1.0, "0.5" a scale).
        ({"lora": [{"id": True, "scale": 1.0}]}, "lora.0.id"),
        ({"lora": [{"id": 1.0, "scale": 1.0}]}, "lora.0.id"),
        ({"lora": [{"id": 0, "scale": True}]}, "lora.0.scale"),
        ({"lora": [{"id": 0, "scale": "0.5"}]}, "lora.0.scale"),
    ],
)
def test_a_bad_lora_list_is_a_400(client: TestClient, body: dict[str, object], param: str) -> None:
    raw = json.dumps({"model": "a", "prompt": "hi", "max_tokens": 2, **body})
    response = client.post(
        "/v1/completions",
        content=raw.replace('"HUGE"', "1e999"),  # JSON's way to infinity: a float too big
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, response.json()
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "body",
    [
        {"id": 0, "scale": 1.0},
        [{"id": 5, "scale": 1.0}],
        [{"id": 0, "scale": "HUGE"}],
        ["x"],
        [{"id": 1, "scale": True}],
        [{"id": True, "scale": 1}],
        [{"id": 0, "scale": "1"}],
    ],
)
def test_a_bad_scales_body_is_a_400_and_changes_nothing(client: TestClient, body: object) -> None:
    response = client.post(
        "/lora-adapters",
        content=json.dumps(body).replace('"HUGE"', "1e999"),
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, response.json()
    assert [a["scale"] for a in client.get("/lora-adapters").json()] == [0.0, 0.0]


def test_an_adapter_name_cannot_embed(client: TestClient) -> None:
    response = client.post("/v1/embeddings", json={"model": "sql", "input": "hello"})
    assert response.status_code == 400 and "adapter" in response.json()["error"]["message"]


def test_embeddings_run_under_the_global_scales(client: TestClient) -> None:
    """As llama-server embeds under its global LoRA scales (``POST /lora-adapters``), every
    later request of the model runs under them, embeddings included. Found by review: the
    embeddings route dropped the scales, so it embedded the base model alone while the
    docs said every later request ran under them. (The stub's vectors are salted by the
    adapters attached, as its logits are.)"""

    def embed() -> list[float]:
        response = client.post("/v1/embeddings", json={"model": "a", "input": "hello"})
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]  # type: ignore[no-any-return]

    base = embed()
    try:
        assert client.post("/lora-adapters", json=[{"id": 1, "scale": 1.0}]).status_code == 200
        pirate = embed()
        assert pirate != base
        assert client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}]).status_code == 200
        assert embed() not in (base, pirate)
    finally:
        assert client.post("/lora-adapters", json=[]).status_code == 200
    assert embed() == base


def test_an_embeddings_own_lora_list_is_what_it_runs_under(client: TestClient) -> None:
    """Found by review: ``/v1/embeddings`` took no ``lora`` list (unknown to its body, the
    field was ignored), so ``"lora": [{"id": 1, "scale": 1}]`` embedded under the global
    scales: the base model's vector, silently. It runs that request under exactly those
    adapters, as a completion's list does, and a bad list is a 400 naming ``lora``."""

    def embed(**fields: object) -> list[float]:
        body = {"model": "a", "input": "hello", **fields}
        response = client.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["embedding"]  # type: ignore[no-any-return]

    base = embed()
    pirate = embed(lora=[{"id": 1, "scale": 1.0}])
    assert pirate != base
    try:
        assert client.post("/lora-adapters", json=[{"id": 1, "scale": 1.0}]).status_code == 200
        assert embed() == pirate  # the same set, by the global scales
        assert embed(lora=[]) == base  # an empty list: every adapter off, as llama-server's
        assert embed(lora=[{"id": 1, "scale": 0.0}]) == base  # listed off: off
    finally:
        assert client.post("/lora-adapters", json=[]).status_code == 200
    bad = client.post(
        "/v1/embeddings", json={"model": "a", "input": "x", "lora": [{"id": 9, "scale": 1}]}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora", bad.text


def test_an_adapter_name_cannot_prewarm(client: TestClient) -> None:
    """Found by review: ``/cache/prewarm`` with an adapter's name answered 200 and filled its
    model's own rows, which a request naming the adapter (a namespace of its own) never
    restores: it then ran cold. A 400 now, and nothing is kept alive for it."""
    prompt = PROMPT + " (prewarm)"
    kept = client.get("/cache/keepalive").json()["data"]
    response = client.post("/cache/prewarm", json={"model": "sql", "prompt": prompt})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "model"
    assert "adapter" in response.json()["error"]["message"]
    assert client.get("/cache/keepalive").json()["data"] == kept


def test_setting_scales_needs_the_admin_key_and_a_trusted_page(adapters: tuple[Path, Path]) -> None:
    settings = stub_settings(
        lora=(("sql", str(adapters[0])),), api_key="user-key", admin_key="admin-key"
    )
    with TestClient(create_app(settings)) as c:
        user = {"Authorization": "Bearer user-key"}
        admin = {"Authorization": "Bearer admin-key"}
        wait_ready(lambda path: c.get(path, headers=user))
        assert c.get("/lora-adapters", headers=user).status_code == 200
        refused = c.post("/lora-adapters", json=[{"id": 0, "scale": 1}], headers=user)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_key"
        cross_site = c.post(
            "/lora-adapters",
            json=[{"id": 0, "scale": 1}],
            headers={**admin, "Origin": "http://evil.example"},
        )
        assert cross_site.status_code == 403
        assert c.get("/lora-adapters", headers=user).json()[0]["scale"] == 0.0
        assert c.post("/lora-adapters", json=[{"id": 0, "scale": 1}], headers=admin).is_success
        assert c.get("/lora-adapters", headers=user).json()[0]["scale"] == 1.0


def test_a_running_request_keeps_the_scales_it_began_under(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``POST /lora-adapters`` while a request of the global scales runs: the request ends
    under the set it was admitted with (its text that set's), and its row lands in that set's
    namespace (restored for that set alone, never for the new one's). The stub's decode is
    held, by an event, while the scales change."""
    from kvwarm.backends.stub.context import StubContext

    prompt = "In flight: " + PROMPT  # a prefix of its own: no other test's rows match it
    entered, release = threading.Event(), threading.Event()
    decode = StubContext._decode

    def held(self: StubContext, batch: object) -> None:
        entered.set()
        assert release.wait(30)
        decode(self, batch)  # type: ignore[arg-type]

    replies: list[dict[str, object]] = []
    try:
        assert client.post("/lora-adapters", json=[{"id": 1, "scale": 1.0}]).status_code == 200
        monkeypatch.setattr(StubContext, "_decode", held)
        runner = threading.Thread(target=lambda: replies.append(_complete(client, prompt)))
        runner.start()
        assert entered.wait(30)
        assert client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}]).status_code == 200
        monkeypatch.setattr(StubContext, "_decode", decode)
        release.set()
        runner.join(30)
        assert not runner.is_alive() and len(replies) == 1
        # Its row is the pirate set's: restored for that set, with the text it gave.
        pirate = _complete(client, prompt, model="pirate")
        assert _cached(pirate) > 0 and _text(pirate) == _text(replies[0])
        # The new scales run the other set, from no row of the old one.
        sql = _complete(client, prompt)
        assert _cached(sql) < _cached(pirate) and _text(sql) != _text(pirate)
        assert _text(sql) == _text(_complete(client, prompt, model="sql"))
    finally:
        release.set()
        assert client.post("/lora-adapters", json=[]).status_code == 200
