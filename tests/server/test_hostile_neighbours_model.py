"""Issue 41 on the real model: a JSON schema with a 100,000-value ``enum`` took 92 s and an
8-token chat sent beside it waited 90 s. Now the enum's grammar is a prefix tree llama.cpp
checks in milliseconds a token, and the chat waits about as long as alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvwarm.settings import ModelSpec, Settings

from .conftest import LOW_POLICY, LiveServer

pytestmark = pytest.mark.model

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    settings = Settings(
        models=(ModelSpec(),),
        cache_dir=None,
        n_ctx=512,
        n_batch=64,
        n_parallel=2,
        # One decode thread: the hostile request's preparation (schema to grammar, prefix
        # tree, cost bound: ~1 s of Python) runs on a core of its own. On a 2-core machine
        # with 2 decode threads it slowed llama.cpp's spinning threads, and with them the
        # chat, by CPU contention alone (chat 2 s beside it), not by waiting for it.
        n_threads=1,
        policy=LOW_POLICY,
        keepalive_interval_s=0,
    )
    server = LiveServer(settings).start()
    yield server
    server.stop()


def _timed_chat(http: httpx.Client) -> float:
    start = time.monotonic()
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    return time.monotonic() - start


def test_a_chat_beside_a_100k_value_enum_waits_about_as_long_as_alone(live: LiveServer) -> None:
    values = [f"value-{i}" for i in range(100_000)]
    body = {
        "messages": [{"role": "user", "content": "Pick a value."}],
        "max_tokens": 12,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": {"type": "string", "enum": values}},
        },
    }
    with httpx.Client(base_url=live.base_url, timeout=300) as http:
        _timed_chat(http)  # warm
        alone = min(_timed_chat(http) for _ in range(2))
        result: dict[str, Any] = {}
        sent = threading.Event()

        def hostile() -> None:
            with httpx.Client(base_url=live.base_url, timeout=300) as other:
                start = time.monotonic()
                sent.set()
                response = other.post("/v1/chat/completions", json=body)
                result["seconds"] = time.monotonic() - start
                result["status"] = response.status_code
                result["body"] = response.json()

        thread = threading.Thread(target=hostile)
        thread.start()
        assert sent.wait(30)
        beside = _timed_chat(http)
        thread.join(300)
    print(f"chat alone {alone:.2f} s, beside {beside:.2f} s; enum {result.get('seconds')}")
    assert result.get("status") == 200, result
    content = result["body"]["choices"][0]["message"]["content"]
    assert content.strip('"') in set(values), content
    assert result["seconds"] < 30, result["seconds"]  # was 92 s
    assert beside - alone < 1.0, (alone, beside)
