"""A seeded concurrency stress of the HTTP server on the stub (review "concur"): client threads
send a random mix of completions, chats and Anthropic messages (consecutive same-role turns
merged) over real connections to a live server (streamed or not, ``n`` of 1 to 3, stop
strings, grammars and JSON schemas, speculation on or off; some episodes priced as a CPU whose
matrix kernel takes rows 4 at a time, so verify passes take filler rows: ``Cost.pad``), some
leaving mid-stream, under a memory budget with room for one model of two (each request for
the other unloads it), while an admin thread evicts and collects the cache and unloads and
loads models. After each episode:

- every request ended (bounded waits: a hang fails);
- each greedy reply is the reply the same request gets alone from a fresh server, or a typed
  error the chaos explains (a model busy when the budget needed its room: 507; unloaded under
  the request: 503, Anthropic's 529);
- every loaded model's gauges (active, queued) are 0, and its KV cells too once evicted;
- ``/cache/verify`` finds nothing bad;
- once the server stopped, no thread it started is left and no file descriptor leaked.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvwarm.engine.worker.drafts import Cost, PassCost
from kvwarm.server import create_app
from kvwarm.settings import Settings

from ..engine.test_concurrency_stress_stub import (
    SCHEMA,
    WORDS,
    YES_NO,
    assert_no_fd_leaked,
    fd_targets,
    run_lanes,
    stress_seeds,
)
from .conftest import LiveServer, stub_settings, wait_ready

MIB = 1 << 20
WAIT_S = 60.0
MODELS = ("copy-alpha", "copy-beta")  # "copy": the stub repeats itself, so drafts land
#: Statuses the chaos explains: a model the budget could not make room for (the other busy),
#: one unloaded or reloading under the request (503; Anthropic's 529), a full queue.
EXPLAINED = {503, 529, 507, 429}


@dataclass(frozen=True)
class Spec:
    path: str
    body: dict[str, Any]
    leave_after: int | None  # streamed: SSE events read before the client disconnects


@dataclass
class Outcome:
    status: int = 0
    texts: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    left: bool = False
    error: str = ""


def random_spec(rng: random.Random, draft_caps: bool = False) -> Spec:
    """``draft_caps``: half the requests cap their drafts at 1 to 7 tokens
    (``speculative.n_max``), so drafts end between tiles."""
    model = rng.choice(MODELS)
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
    body: dict[str, Any] = {
        "model": model,
        "temperature": 0,
        "max_tokens": rng.randint(1, 24),
        "n": rng.choice((1, 1, 1, 2, 3)),
    }
    kind = rng.random()
    api = rng.random()
    if draft_caps and rng.random() < 0.5:
        body["speculative.n_max"] = rng.randint(1, 7)
    if api < 0.15:
        return messages_spec(rng, body, words, kind)
    chat = api < 0.4
    if kind < 0.15:
        body["grammar"] = YES_NO
    elif kind < 0.25:
        if chat:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            }
        else:
            body["json_schema"] = SCHEMA
    elif kind < 0.45:
        body["stop"] = [rng.choice("aeiou"), rng.choice(WORDS)[:3]]
    if rng.random() < 0.5:
        body["speculative.type"] = "none"
    stream = rng.random() < 0.5
    leave_after = rng.randint(0, 4) if stream and rng.random() < 0.3 else None
    if stream:
        body["stream"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
        return Spec("/v1/chat/completions", body, leave_after)
    body["prompt"] = words
    return Spec("/v1/completions", body, leave_after)


def messages_spec(rng: random.Random, body: dict[str, Any], words: str, kind: float) -> Spec:
    """An Anthropic ``/v1/messages`` request of ``body``'s (one choice; a JSON schema as its
    ``output_config``, stops as ``stop_sequences``); its user turn sometimes sent as two
    consecutive user messages, which Anthropic reads as one turn (``translate._merged``)."""
    del body["n"]
    if kind < 0.1:
        body["output_config"] = {"format": {"type": "json_schema", "schema": SCHEMA}}
    elif kind < 0.3:
        body["stop_sequences"] = [rng.choice("aeiou"), rng.choice(WORDS)[:3]]
    if rng.random() < 0.5:
        body["speculative.type"] = "none"
    cut = words.find(" ", len(words) // 2)
    split = cut > 0 and rng.random() < 0.5
    turns = [words[:cut], words[cut + 1 :]] if split else [words]
    body["messages"] = [{"role": "user", "content": t} for t in turns]
    stream = rng.random() < 0.5
    if stream:
        body["stream"] = True
    leave_after = rng.randint(0, 4) if stream and rng.random() < 0.3 else None
    return Spec("/v1/messages", body, leave_after)


def stream_events(
    http: httpx.Client,
    spec: Spec,
    body: dict[str, Any],
    out: Outcome,
    take: Callable[[dict[str, Any]], None],
) -> bool:
    """Stream ``spec``'s reply into ``out``: its status, an error event as its error, every
    other event to ``take``, the client leaving after ``spec.leave_after`` events; False
    where the reply is not a 200 (its body then the error)."""
    with http.stream("POST", spec.path, json=body) as r:
        out.status = r.status_code
        if r.status_code != 200:
            r.read()
            out.error = r.text
            return False
        events = 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:  # OpenAI's error object, Anthropic's error event
                out.error = json.dumps(event)
                out.status = 503 if "unloaded" in out.error else 500
                continue
            take(event)
            events += 1
            if spec.leave_after is not None and events > spec.leave_after:
                out.left = True  # the client goes away: the connection closes here
                break
    return True


def collect_messages(http: httpx.Client, spec: Spec, body: dict[str, Any]) -> Outcome:
    """``collect`` for an Anthropic message: its text blocks' text, its stop_reason."""
    out = Outcome()
    if not body.get("stream"):
        r = http.post(spec.path, json=body)
        out.status = r.status_code
        if r.status_code == 200:
            data = r.json()
            out.texts = ["".join(b["text"] for b in data["content"] if b["type"] == "text")]
            out.reasons = [data["stop_reason"]]
        else:
            out.error = r.text
        return out
    text, reason = [""], [""]

    def take(event: dict[str, Any]) -> None:
        if event["type"] == "content_block_delta":
            text[0] += event["delta"].get("text", "")
        elif event["type"] == "message_delta":
            reason[0] = event["delta"]["stop_reason"] or ""

    if stream_events(http, spec, body, out, take):
        out.texts, out.reasons = text, reason
    return out


def collect(http: httpx.Client, spec: Spec, *, alone: bool = False) -> Outcome:
    out = Outcome()
    body = spec.body
    if alone:
        body = {k: v for k, v in body.items() if k != "stream"}
        body["speculative.type"] = "none"
    if spec.path == "/v1/messages":
        return collect_messages(http, spec, body)
    chat = spec.path.endswith("chat/completions")
    if not body.get("stream"):
        r = http.post(spec.path, json=body)
        out.status = r.status_code
        if r.status_code == 200:
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
            out.texts = [c["message"]["content"] if chat else c["text"] for c in choices]
            out.reasons = [c["finish_reason"] for c in choices]
        else:
            out.error = r.text
        return out
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}

    def take(event: dict[str, Any]) -> None:
        for c in event["choices"]:
            i = c["index"]
            piece = (c["delta"].get("content") if chat else c.get("text")) or ""
            texts[i] = texts.get(i, "") + piece
            if c.get("finish_reason"):
                reasons[i] = c["finish_reason"]

    if not stream_events(http, spec, body, out, take):
        return out
    out.texts = [texts[i] for i in sorted(texts)]
    out.reasons = [reasons.get(i, "") for i in sorted(texts)]
    return out


def settings_for(models_dir: Path, cache_dir: Path | None, budget: int) -> Settings:
    return stub_settings(
        models=(),
        models_dir=models_dir,
        cache_dir=cache_dir,
        memory_budget=budget,
        n_parallel=3,
        spec_type="ngram-simple",
        allowed_hosts=("testserver", "127.0.0.1"),
    )


def admin(rng: random.Random, base_url: str, stop: threading.Event, errors: list[str]) -> None:
    calls: list[Callable[[httpx.Client], httpx.Response]] = [
        lambda h: h.post("/cache/evict", json={"bytes": rng.randint(1, 1 << 16)}),
        lambda h: h.post("/cache/gc"),
        lambda h: h.post("/admin/models/unload", json={"model": rng.choice(MODELS)}),
        lambda h: h.post("/admin/models/load", json={"name": rng.choice(MODELS)}),
    ]
    with httpx.Client(base_url=base_url, timeout=WAIT_S) as http:
        while not stop.is_set():
            r = rng.choices(calls, (4, 2, 1, 1))[0](http)
            if r.status_code not in (200, *EXPLAINED, 404, 409):
                errors.append(f"admin: {r.status_code} {r.text}")
            stop.wait(0.005)  # pacing only


def episode(
    seed: int,
    tmp: Path,
    n_requests: int = 30,
    *,
    draft_caps: bool = False,
    then: Callable[[httpx.Client], None] | None = None,
) -> None:
    """``draft_caps``: as ``random_spec``'s. ``then``: run against the server once the chaos
    is over, before the checks of its models' state."""
    rng = random.Random(seed)
    models_dir = tmp / "models"
    models_dir.mkdir(parents=True)
    for name in MODELS:
        (models_dir / f"{name}.gguf").write_bytes(b"GGUF stub weights " + name.encode())
    specs = [random_spec(rng, draft_caps) for _ in range(n_requests)]

    with TestClient(create_app(settings_for(models_dir, None, 0))) as ref:
        wait_ready(ref.get)
        expected = [collect(ref, s, alone=True) for s in specs]  # type: ignore[arg-type]
    assert all(e.status == 200 for e in expected), [e.error for e in expected if e.error]

    threads_before = set(threading.enumerate())
    fds_before = fd_targets()
    # Room for one stub model (64 MiB of weights and its context), not two.
    server = LiveServer(settings_for(models_dir, tmp / "cache", 100 * MIB)).start()
    try:
        results: list[Outcome | None] = [None] * n_requests
        order = list(range(n_requests))
        rng.shuffle(order)
        stop = threading.Event()
        admin_errors: list[str] = []

        def client(lane: list[int]) -> None:
            with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as http:
                for i in lane:
                    results[i] = collect(http, specs[i])

        clients = [threading.Thread(target=client, args=(order[i::4],)) for i in range(4)]
        chaos = threading.Thread(
            target=admin, args=(random.Random(seed + 1), server.base_url, stop, admin_errors)
        )
        run_lanes(clients, chaos, stop, admin_errors, seed, "admin")

        for i, (spec, out, want) in enumerate(zip(specs, results, expected, strict=True)):
            assert out is not None
            where = f"seed {seed} request {i} {spec}"
            if out.status != 200:
                assert out.status in EXPLAINED, f"{where}: {out.status} {out.error}"
                continue
            assert len(out.texts) == len(want.texts) or out.left, f"{where}: {out}"
            for j, text in enumerate(out.texts):
                if out.left or out.reasons[j] == "":
                    assert want.texts[j].startswith(text), f"{where}: {text!r} vs {want.texts[j]!r}"
                else:
                    assert text == want.texts[j], f"{where}: {text!r} != alone {want.texts[j]!r}"
                    assert out.reasons[j] == want.reasons[j], f"{where}: {out} vs {want}"

        with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as http:
            if then is not None:
                then(http)
            app: Any = server.server.config.app
            state = app.state.kvwarm
            for entry in list(state.registry.entries.values()):
                model = entry.model
                if model is None or entry.state != "ready":
                    continue
                model.evict()
                status = model.status()
                assert (status.active, status.queued, status.kv_cells_used) == (0, 0, 0), status
            verify = http.post("/cache/verify")
            assert verify.status_code == 200, verify.text
            assert not verify.json().get("bad"), verify.json()
    finally:
        server.stop()
    left = [t for t in threading.enumerate() if t not in threads_before]
    for t in left:
        t.join(WAIT_S)
    assert not [t for t in left if t.is_alive()], f"threads left: {left}"
    assert_no_fd_leaked(fds_before)


@pytest.fixture(scope="module", autouse=True)
def warm() -> None:
    """A first live server opens what the process keeps for good (a pipe the event loop
    machinery creates once): counted before the episodes, not as their leak."""
    LiveServer(stub_settings(allowed_hosts=("127.0.0.1",))).start().stop()


@pytest.fixture(autouse=True)
def cheap_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculation drafts whatever the timing (one more token costs 5% of a pass)."""
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05)))


@pytest.mark.parametrize("seed", stress_seeds(2))
def test_random_concurrent_http_mix_keeps_every_reply_and_the_server_consistent(
    seed: int, tmp_path: Path
) -> None:
    episode(seed, tmp_path)


def fills(filled: list[int]) -> Callable[[httpx.Client], None]:
    """A check for ``episode``'s ``then``: a copy whose drafts are capped at 5 tokens (6 rows,
    2 filler rows a pass) takes filler rows, and its reply is plain decoding's. Whether the
    chaos's own requests took any depends on how the threads met (38 and 39 of 40 did)."""

    def check(http: httpx.Client) -> None:
        body = {
            "model": MODELS[0],
            "prompt": "Copy: the cat sat on the mat. the cat sat on the mat. the cat",
            "temperature": 0,
            "max_tokens": 30,
            "speculative.n_max": 5,
        }
        spec = Spec("/v1/completions", body, None)
        plain = collect(http, spec, alone=True)
        before = len(filled)
        drafted = collect(http, spec)
        assert (drafted.status, plain.status) == (200, 200), (drafted, plain)
        assert drafted.texts == plain.texts
        assert len(filled) > before, filled

    return check


@pytest.mark.parametrize("seed", stress_seeds(4))
def test_random_concurrent_http_mix_with_filled_verify_passes_keeps_every_reply(
    seed: int, tmp_path: Path, tiled_passes: list[int]
) -> None:
    """The same mix where verify passes are filled to a whole tile with filler rows (half the
    requests capping their drafts, so drafts end between tiles): every reply is still its
    request's alone, and the models' KV cells all go once evicted."""
    episode(seed, tmp_path, draft_caps=True, then=fills(tiled_passes))
