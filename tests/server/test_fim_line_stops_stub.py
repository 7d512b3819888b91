"""llama-server's line stops of ``/infill`` and ``/completion`` (``n_indent``,
``t_max_predict_ms``), which llama.vim and llama.vscode send with every request, on the stub
backend. A literal grammar makes the stub write exactly the text a test needs (one byte a
token); the time limit reads the worker's clock, replaced here by one that ticks a second
each sampled token: no test waits on a real clock."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvwarm.server import create_app
from kvwarm.settings import ModelSpec

from .conftest import stub_settings, wait_ready

# The middle the stub writes: lines indented 4, 4, then 2 (under an n_indent of 4), then 0.
MIDDLE = "    a\n    b\n  c\nd\n"
GRAMMAR = "root ::= " + json.dumps(MIDDLE)
# What llama-server returns of it with n_indent 4: up to the first character of the line
# indented less (the line's indentation kept, as llama-server's cut keeps it).
KEPT = "    a\n    b\n  "

ROUTES = {
    "/infill": {"model": "fim", "input_prefix": "def f():\n", "input_suffix": "\n"},
    "/completion": {"model": "fim", "prompt": "def f():\n"},
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    models = (ModelSpec(path="stub-fim", id="fim"),)
    with TestClient(create_app(stub_settings(models=models))) as c:
        wait_ready(c.get)
        yield c


def _events(text: str) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: ")]


def _post(client: TestClient, path: str, stream: bool, **extra: object) -> dict[str, object]:
    """The final body, and for a stream the text of its chunks as its ``content``."""
    body = {**ROUTES[path], "grammar": GRAMMAR, "temperature": 0, "n_predict": 64, **extra}
    response = client.post(path, json={**body, "stream": stream})
    assert response.status_code == 200, response.text
    if not stream:
        data: dict[str, object] = response.json()
        return data
    events = _events(response.text)
    chunks, last = events[:-1], events[-1]
    assert all(c["stop"] is False for c in chunks) and last["stop"] is True
    assert last["content"] == ""
    return {**last, "content": "".join(str(c["content"]) for c in chunks)}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(ROUTES))
def test_n_indent_ends_the_reply_at_a_line_indented_less(
    client: TestClient, path: str, stream: bool
) -> None:
    whole = _post(client, path, stream)
    assert whole["content"] == MIDDLE and whole["stop_type"] == "eos"
    data = _post(client, path, stream, n_indent=4)
    # The partial line is not in the text, streamed or not: a stream never sent it.
    assert data["content"] == KEPT
    assert data["stop_type"] == "limit" and data["truncated"] is False
    assert data["stopping_word"] == "" and data["has_new_line"] is True
    # Its tokens were generated (the "c" one too, as llama-server counts it), not all decoded.
    assert data["tokens_predicted"] == len(KEPT) + 1
    timings = data["timings"]
    assert isinstance(timings, dict) and timings["predicted_n"] == len(KEPT) + 1
    # A line indented exactly n_indent goes on; 0 or below is off, as llama-server's.
    assert _post(client, path, stream, n_indent=2)["content"] == "    a\n    b\n  c\n"
    for n_indent in (0, -3):
        assert _post(client, path, stream, n_indent=n_indent)["content"] == MIDDLE


def test_n_indent_counts_tabs_and_stops_at_an_empty_line(client: TestClient) -> None:
    # llama-server counts spaces and tabs alike, and an empty line is indented 0: it stops.
    grammar = "root ::= " + json.dumps("x\n\t\ty\n\nz\n")
    data = _post(client, "/infill", False, grammar=grammar, n_indent=2)
    assert data["content"] == "x\n\t\ty\n" and data["stop_type"] == "limit"
    # The first line is the rest of the line the cursor is on: never checked.
    grammar = "root ::= " + json.dumps("x\n  y\n")
    assert _post(client, "/infill", False, grammar=grammar, n_indent=2)["content"] == "x\n  y\n"


@pytest.fixture()
def ticking(client: TestClient) -> Iterator[None]:
    """The worker's clock reads 0, 1, 2, ... seconds: each sampled token a second later."""
    rt = client.app.state.kvwarm.entries["fim"].model._worker.rt  # type: ignore[attr-defined]
    real = rt.clock
    seconds = itertools.count()
    rt.clock = lambda: float(next(seconds))
    try:
        yield
    finally:
        rt.clock = real


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(ROUTES))
@pytest.mark.usefixtures("ticking")
def test_t_max_predict_ms_ends_the_reply_at_a_newline_past_the_limit(
    client: TestClient, path: str, stream: bool
) -> None:
    grammar = "root ::= " + json.dumps("a\nbc\nd\n")
    # Tokens at 0 s ("a"), 1 s ("\n": 1000 ms, within 1500), 2 s, 3 s, 4 s ("\n": past it).
    data = _post(client, path, stream, grammar=grammar, t_max_predict_ms=1500)
    assert data["content"] == "a\nbc\n"
    assert data["stop_type"] == "limit" and data["truncated"] is False
    assert data["tokens_predicted"] == 5
    timings = data["timings"]
    assert isinstance(timings, dict) and timings["predicted_ms"] == 4000.0
    # Past the limit at the first newline already: the reply ends with it.
    assert _post(client, path, stream, grammar=grammar, t_max_predict_ms=500)["content"] == "a\n"
    # 0 and below are off, as llama-server reads them.
    for limit in (0, -1):
        assert _post(client, path, stream, grammar=grammar, t_max_predict_ms=limit)["content"] == (
            "a\nbc\nd\n"
        )


def test_the_line_stops_are_checked_before_a_stop_string(client: TestClient) -> None:
    # Whichever comes first in the text ends it, as llama-server's checks of one token do.
    stopped = _post(client, "/completion", False, n_indent=4, stop=["d\n"])
    assert stopped["content"] == KEPT and stopped["stop_type"] == "limit"
    word = _post(client, "/completion", False, n_indent=4, stop=["b"])
    assert word["content"] == "    a\n    " and word["stop_type"] == "word"
    assert word["stopping_word"] == "b"


@pytest.mark.usefixtures("ticking")
def test_openai_completions_take_the_line_stops_as_llama_servers_does(client: TestClient) -> None:
    """llama-server's /v1/completions reads both line stops too (its params_from_json_cmpl is
    every completion route's): there they were ignored as unknown fields."""
    body = {"model": "fim", "prompt": "def f():\n", "grammar": GRAMMAR, "temperature": 0}
    body["max_tokens"] = 64
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["text"] == MIDDLE
    cut = client.post("/v1/completions", json={**body, "n_indent": 4}).json()
    assert cut["choices"][0]["text"] == KEPT
    assert cut["choices"][0]["finish_reason"] == "length"
    grammar = "root ::= " + json.dumps("a\nbc\nd\n")
    # Tokens a second apart (``ticking``): the newline at 4 s is the first past 1.5 s.
    timed = client.post(
        "/v1/completions", json={**body, "grammar": grammar, "t_max_predict_ms": 1500}
    ).json()
    assert timed["choices"][0]["text"] == "a\nbc\n"
