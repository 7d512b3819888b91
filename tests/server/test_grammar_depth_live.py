"""One small request must not kill the server process on the real backend.

A grammar nesting groups tens of thousands deep (sent as ``grammar``, a 150 KB body, or made
by the JSON-schema converter from ``{"type":"string","maxLength":50000}``, 100 bytes) overflowed
the thread's stack in llama.cpp's recursive-descent grammar parser inside
``llama_sampler_init_grammar``: a segfault that took every connection and model with it.
``check_grammar_cost`` now refuses nesting past ``MAX_GRAMMAR_DEPTH`` first.

Each case runs a server in a child process, so a crash is a test failure and not the end of
the test run: the request must be a 400 and the process must still be alive to answer it.
"""

from __future__ import annotations

import json

import pytest
from tests.childkit import ROOT, run_child

pytestmark = [pytest.mark.model, pytest.mark.slow]

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import httpx
from kvwarm.settings import ModelSpec, Settings
from tests.server.conftest import LOW_POLICY, LiveServer

settings = Settings(models=(ModelSpec(),), cache_dir=None, n_ctx=512, n_batch=64,
                    policy=LOW_POLICY, keepalive_interval_s=0, default_max_tokens=4)
live = LiveServer(settings).start()
path, body = json.loads(sys.stdin.read())
with httpx.Client(base_url=live.base_url, timeout=300) as http:
    response = http.post(path, json=body)
    print("STATUS", response.status_code, flush=True)
    print("HEALTH", http.get("/health").status_code, flush=True)
live.stop()
"""

DEPTH = 50_000
CASES = {
    "grammar": (
        "/v1/completions",
        {
            "prompt": "hi",
            "max_tokens": 2,
            "grammar": "root ::= " + "(" * DEPTH + '"a"' + ")?" * DEPTH,
        },
    ),
    "json_schema_maxLength": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "maxLength": DEPTH}},
            },
        },
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_deeply_nested_grammar_is_a_400_and_the_server_survives(case: str) -> None:
    done, lines = run_child(
        CHILD, str(ROOT), stdin=json.dumps(CASES[case]), prefixes=("STATUS", "HEALTH")
    )
    # Before the fix: returncode -11 (SIGSEGV) and no STATUS line: the process died mid-request.
    assert done.returncode == 0, f"server process died: rc={done.returncode}, saw {lines}"
    assert "STATUS 400" in lines, lines
    assert "HEALTH 200" in lines, lines
