"""A sliding-window model through the HTTP server: Gemma 3 270M, whose GGUF carries no chat
template (chats fall back to chatml, as llama-server's do), in a multi-turn chat over a system
prompt longer than its 512-token window. Every follow-up, and the first turn after a restart,
reports at least the previous turn's prompt as cached: checkpoints, never a trimmed window.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvwarm.cache.types import PolicyConfig
from kvwarm.settings import Settings
from kvwarm.settings.types import ModelSpec

from .conftest import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.slow]

SYSTEM = (
    "You are the archivist of a small coastal town. You answer questions about its history, "
    "its harbour and its lighthouse, briefly and in plain words. "
) * 22
QUESTIONS = ["Who built the lighthouse?", "And when?", "Who keeps it now?"]


def settings(model: str, cache_dir: Path) -> Settings:
    return Settings(
        models=(ModelSpec(path=model, id="gemma"),),
        cache_dir=cache_dir,
        n_ctx=2048,
        n_batch=256,
        policy=PolicyConfig(
            min_tokens=16, cold_min_tokens=64, boundary_align_tokens=256, boundary_trim_tokens=0
        ),
        keepalive_interval_s=0,
        default_max_tokens=8,
    )


def turn(http: httpx.Client, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    response = http.post(
        "/v1/chat/completions",
        json={"model": "gemma", "messages": messages, "max_tokens": 8, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    usage = body["usage"]
    cached = int(usage["prompt_tokens_details"]["cached_tokens"])
    return str(body["choices"][0]["message"]["content"]), cached, int(usage["prompt_tokens"])


def test_multi_turn_chat_resumes_every_turn_and_after_a_restart(
    gemma_path: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    messages = [{"role": "system", "content": SYSTEM}]
    previous_prompt = 0
    live = LiveServer(settings(gemma_path, cache)).start()
    try:
        with httpx.Client(base_url=live.base_url, timeout=600) as http:
            info = http.get("/v1/models").json()["data"][0]["meta"]
            assert info["chat_template_name"] == "chatml (fallback)"
            assert info["memory"] == {"kind": "swa", "n_swa": 512, "swa_full": False}
            for i, question in enumerate(QUESTIONS[:2]):
                messages.append({"role": "user", "content": question})
                reply, cached, prompt = turn(http, messages)
                assert prompt > 512  # every turn is longer than the window
                if i:
                    assert cached >= previous_prompt, (i, cached, previous_prompt)
                messages.append({"role": "assistant", "content": reply})
                previous_prompt = prompt
            http.post("/cache/flush")  # not needed for correctness; settles the writers
    finally:
        live.stop()

    restarted = LiveServer(settings(gemma_path, cache)).start()
    try:
        with httpx.Client(base_url=restarted.base_url, timeout=600) as http:
            messages.append({"role": "user", "content": QUESTIONS[2]})
            _, cached, _ = turn(http, messages)
            assert cached >= previous_prompt, (cached, previous_prompt)
    finally:
        restarted.stop()
