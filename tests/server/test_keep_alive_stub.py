"""Models that come and go, as Ollama's and LM Studio's users expect, over HTTP on the stub:
a request's ``keep_alive`` (0 unloads the model once that request is answered; a duration
sets its idle time; negative keeps it), pinned models, the memory budget unloading idle
models for the model a request names (never a pinned one), and what ``/v1/models`` and
``/cache/stats`` say of each model (how long it stays, its memory with its cache share).

The server's own reaper thread does the unloading; a test waits for the state it reaches
(bounded), never for a time to pass."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app
from kvwarm.server.state import ServerState
from kvwarm.settings import ModelSpec

from .conftest import stub_settings, wait_ready

MIB = 1 << 20
PROMPT = "Remember the lighthouse keeper and the cat who lived on the island for years"


def _state(client: TestClient) -> ServerState:
    state = client.app.state.kvwarm  # type: ignore[attr-defined]
    assert isinstance(state, ServerState)
    return state


def _until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) for a state the server's threads reach."""
    pause = threading.Event()
    for _ in range(3000):
        if condition():
            return
        pause.wait(0.01)
    raise AssertionError("the server never got there")


def _models(client: TestClient) -> dict[str, dict[str, object]]:
    return {m["id"]: m for m in client.get("/v1/models").json()["data"]}


def _complete(client: TestClient, model: str, **fields: object) -> dict[str, object]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.json()
    return response.json()  # type: ignore[no-any-return]


def test_keep_alive_zero_unloads_the_model_once_its_request_is_answered() -> None:
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        _complete(client, "a", keep_alive=0)
        _until(lambda: _models(client)["a"]["status"] == "available")
        assert _models(client)["b"]["status"] == "ready"  # only the one it named
        again = _complete(client, "a")  # the next request loads it again
        assert _models(client)["a"]["status"] == "ready" and again["choices"]


@pytest.mark.parametrize("route", ["chat", "messages", "responses", "embeddings"])
def test_every_generation_api_takes_keep_alive(route: str) -> None:
    bodies = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        "messages": (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
        "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        "embeddings": ("/v1/embeddings", {"input": "hi"}),
    }
    path, body = bodies[route]
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        bad = client.post(path, json={**body, "model": "a", "keep_alive": "soon"})
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]["message"]
        ok = client.post(path, json={**body, "model": "a", "keep_alive": "0s"})
        assert ok.status_code == 200, ok.json()
        _until(lambda: _models(client)["a"]["status"] == "available")


def test_keep_alive_durations_show_in_the_model_list() -> None:
    with TestClient(create_app(stub_settings(model_idle_unload_s=600))) as client:
        wait_ready(client.get)
        listed = _models(client)["a"]
        assert (listed["pinned"], listed["keep_alive_s"]) == (False, 600.0)
        assert isinstance(listed["expires_at"], int)
        _complete(client, "a", keep_alive="1h30m")
        listed = _models(client)["a"]
        assert listed["keep_alive_s"] == 5400.0
        assert listed["expires_at"] - _models(client)["b"]["expires_at"] > 4000  # type: ignore[operator]
        _complete(client, "a", keep_alive=-1)
        assert _models(client)["a"]["keep_alive_s"] is None  # for ever
        assert _models(client)["a"]["expires_at"] is None


def test_a_pinned_model_stays_through_keep_alive_zero() -> None:
    models = (
        ModelSpec(path="stub-a", id="a", options=(("pinned", True),)),
        ModelSpec(path="stub-b", id="b"),
    )
    with TestClient(create_app(stub_settings(models=models))) as client:
        wait_ready(client.get)
        _complete(client, "a", keep_alive=0)
        _complete(client, "b", keep_alive=0)
        _until(lambda: _models(client)["b"]["status"] == "available")
        state = _state(client)
        assert state.registry.reap_idle() == []  # nothing else is due: a stays
        listed = _models(client)["a"]
        assert listed["status"] == "ready" and listed["pinned"] is True
        assert listed["keep_alive_s"] is None and listed["expires_at"] is None
        # An admin may still unload it (the page's Unload button).
        unloaded = client.post("/admin/models/unload", json={"model": "a"})
        assert unloaded.status_code == 200 and unloaded.json()["status"] == "available"


def test_the_budget_unloads_an_idle_model_for_the_one_a_request_names_never_a_pinned_one() -> None:
    # Room for one stub model (64 MiB of weights and its context), not two. At startup b is
    # refused (configured models never unload each other); asked for later, it takes a's room.
    for pinned in (False, True):
        models = (
            ModelSpec(path="stub-a", id="a", options=(("pinned", pinned),)),
            ModelSpec(path="stub-b", id="b"),
        )
        settings = stub_settings(models=models, memory_budget=100 * MIB)
        with TestClient(create_app(settings)) as client:
            wait_ready(client.get)
            assert _models(client)["b"]["status"] == "failed"
            load = client.post("/admin/models/load", json={"name": "b"})
            listed = _models(client)
            if pinned:
                assert load.status_code == 507  # no room now: b stays loadable
                assert load.json()["error"]["code"] == "memory_budget"
                assert "memory budget 100.0 MiB" in load.json()["error"]["message"]
                assert (listed["a"]["status"], listed["b"]["status"]) == ("ready", "available")
            else:
                assert load.status_code == 200, load.json()
                assert (listed["a"]["status"], listed["b"]["status"]) == ("available", "ready")
                stats = client.get("/cache/stats").json()
                assert list(stats["memory"]["models"]) == ["b"]


def test_each_models_memory_includes_its_share_of_the_cache() -> None:
    with TestClient(create_app(stub_settings())) as client:
        wait_ready(client.get)
        for i in range(3):
            _complete(client, "a", prompt=f"{PROMPT} {i}")
        state = _state(client)
        assert state.engine is not None and state.engine.cache.flush()
        stats = client.get("/cache/stats").json()
        models = stats["memory"]["models"]
        ram = stats["tiers"]["ram"]["bytes"]
        assert ram > 0
        a, b = models["a"], models["b"]
        assert a["cache_bytes"] == a["cache_tiers"]["ram"] > 0
        assert b["cache_bytes"] == 0  # b served nothing
        assert a["cache_bytes"] <= ram
        assert a["total_bytes"] == a["weights_bytes"] + a["context_bytes"] + a["cache_bytes"]


def test_a_model_the_budget_refuses_while_the_others_are_busy_loads_once_one_is_idle(
    tmp_path: Path,
) -> None:
    """Found by review (memrev): a models_dir model a request asked for, refused by the budget
    because the loaded model was in use, stayed ``failed``: every later request was a 503
    ``model_load_failed`` and /health degraded until an admin loaded it, though the other
    model went idle a moment later (the cap, refusing alike, left the model loadable)."""
    d = tmp_path / "models"
    d.mkdir()
    for name in ("alpha.gguf", "beta.gguf"):
        (d / name).write_bytes(b"GGUF stub weights " + name.encode())
    # Room for one stub model (64 MiB of weights and its context), not two.
    settings = stub_settings(models=(), models_dir=d, memory_budget=100 * MIB)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        _complete(client, "alpha")
        release = _state(client).registry.hold("alpha")  # alpha busy: nothing to unload
        refused = client.post("/v1/completions", json={"model": "beta", "prompt": PROMPT})
        assert refused.status_code == 507, refused.json()
        error = refused.json()["error"]
        assert error["code"] == "memory_budget" and "memory budget 100.0 MiB" in error["message"]
        listed = _models(client)
        assert (listed["alpha"]["status"], listed["beta"]["status"]) == ("ready", "available")
        assert client.get("/health").json()["status"] == "ok"
        release()
        _complete(client, "beta")  # alpha is idle now: it makes room
        listed = _models(client)
        assert (listed["alpha"]["status"], listed["beta"]["status"]) == ("available", "ready")


def test_a_model_that_can_never_fit_unloads_nothing() -> None:
    """Found by review (memrev): a model larger than the budget on its own unloaded every idle
    model to make room, then was refused all the same: the server lost a model it served for
    nothing. It is refused with the arithmetic and the others stay loaded."""
    models = (ModelSpec(path="stub-a", id="a"), ModelSpec(path="stub-b", id="b", n_ctx=1 << 21))
    settings = stub_settings(models=models, memory_budget=100 * MIB)  # b: 256 MiB of KV
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        load = client.post("/admin/models/load", json={"name": "b"})
        assert load.status_code == 507, load.json()
        message = load.json()["error"]["message"]
        assert "memory budget 100.0 MiB < weights 64.0 MiB + KV 256.0 MiB" in message
        listed = _models(client)
        assert (listed["a"]["status"], listed["b"]["status"]) == ("ready", "available")
        _complete(client, "a")
