"""LoRA over real HTTP on the real embedded model, with a tiny random-weight adapter written
at test time (``tests/backends/lora_fixture.py``): both forms (vLLM's adapter name, llama-
server's per-request ``lora`` and ``/lora-adapters``) run the adapter, share one namespace
with each other and never one with the base model (``cached_tokens``); an adapter of other
dimensions fails its model's load with llama.cpp's reason, never a crash. Prompts are short."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from tests.backends.lora_fixture import make_lora

from kvwarm.embedded import default_model_path, model_id_for
from kvwarm.server import create_app

from .conftest import LiveServer
from .test_live_openai import real_settings

pytestmark = [pytest.mark.model, pytest.mark.slow]

BASE = model_id_for(default_model_path())
PROMPT = "Here is a list of the planets of the solar system, in order: Mercury, Venus,"


@pytest.fixture(scope="module")
def lora_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora(default_model_path(), tmp_path_factory.mktemp("lora") / "tiny.gguf")


@pytest.fixture(scope="module")
def http(lora_path: Path) -> Iterator[httpx.Client]:
    settings = real_settings(None).replace(n_ctx=512, lora=(("tiny", str(lora_path)),))
    live = LiveServer(settings).start()
    try:
        with httpx.Client(base_url=live.base_url, timeout=300) as client:
            yield client
    finally:
        live.stop()


def _complete(http: httpx.Client, **fields: object) -> tuple[str, int]:
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_both_forms_run_the_adapter_in_a_namespace_of_its_own(http: httpx.Client) -> None:
    base, cached = _complete(http)
    assert cached == 0
    again, cached = _complete(http)
    assert again == base and cached > 0
    tiny, cached = _complete(http, model="tiny")  # vLLM's form
    assert cached == 0  # never the base model's rows or live KV
    assert tiny != base  # the adapter acts
    by_id, cached = _complete(http, lora=[{"id": 0, "scale": 1.0}])  # llama-server's form
    assert (by_id, cached > 0) == (tiny, True)  # the same set: the same namespace and text
    back, cached = _complete(http)
    assert (back, cached > 0) == (base, True)  # and the base model's own rows are still its


def test_global_scales_and_the_listing(http: httpx.Client, lora_path: Path) -> None:
    listed = http.get("/lora-adapters").json()
    assert listed == [
        {"id": 0, "path": str(lora_path), "scale": 0.0, "name": "tiny", "model": BASE}
    ]
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["tiny"]["parent"] == BASE
    tiny, _ = _complete(http, model="tiny")
    base, _ = _complete(http, lora=[])  # an empty list: no adapter (the global scales are 0)
    try:
        assert http.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}]).status_code == 200
        assert _complete(http)[0] == tiny
    finally:
        assert http.post("/lora-adapters", json=[]).status_code == 200
    assert _complete(http)[0] == base
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "Name a planet."}],
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    assert chat.status_code == 200 and chat.json()["model"] == "tiny"


def test_an_adapter_of_other_dimensions_fails_its_models_load_saying_why(
    tmp_path: Path,
) -> None:
    misfit = make_lora(default_model_path(), tmp_path / "misfit.gguf", misfit=8)
    fatal: list[str] = []
    settings = real_settings(None).replace(
        n_ctx=256, lora=(("misfit", str(misfit)),), allowed_hosts=("testserver",)
    )
    with TestClient(create_app(settings, on_fatal=fatal.append)) as client:
        for _ in range(6000):  # the load runs in the background: bounded wait for its end
            body = client.get("/health").json()
            if body.get("status") == "error" and fatal:  # on_fatal is told just after
                break
            threading.Event().wait(0.01)
        assert body.get("status") == "error", body
        assert fatal and "incorrect shape" in fatal[0] and "misfit" in fatal[0]
        refused = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert refused.status_code == 503
        assert "incorrect shape" in refused.json()["error"]["message"]
