"""A client that goes away mid-rerank or mid-embedding cancels the work left, over a real
connection to a server on 127.0.0.1 (found by review: the model went on scoring and
embedding for nobody; llama-server stops). The stub's passes and embeddings are held at a
gate: the request's first one is under way when the client leaves, and none of what it had
not begun runs afterwards (its documents and inputs carry a byte nothing else has)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwarm.backends.stub import StubBackend
from kvwarm.backends.stub.vocab import OFFSET
from kvwarm.engine.cancel import Cancellation
from kvwarm.server import generate
from kvwarm.settings import ModelSpec

from ..engine.test_rerank_stub import RecordingBackend
from .conftest import LiveServer, gated_live, stub_settings

MARK = OFFSET + ord("Z")  # only the work the client abandons holds this byte


class _Watched(Cancellation):
    """The server's Cancellation, telling the test when it was cancelled."""

    cancelled_event = threading.Event()

    def cancel(self) -> None:
        super().cancel()
        type(self).cancelled_event.set()


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LiveServer, RecordingBackend]]:
    backend = RecordingBackend()
    monkeypatch.setattr(StubBackend, "from_env", classmethod(lambda cls: backend))
    monkeypatch.setattr(generate, "Cancellation", _Watched)
    _Watched.cancelled_event.clear()
    settings = stub_settings(
        models=(
            ModelSpec(path="stub-reranker.gguf", id="ranker"),
            ModelSpec(path="stub-a", id="embedder"),
        ),
        allowed_hosts=(),
        n_parallel=1,
    )
    with gated_live(settings, backend) as server:
        yield server, backend


def _abandon(server: LiveServer, backend: RecordingBackend, path: str, body: object) -> None:
    """Send ``body`` to ``path``, wait until its first pass is under way, hang up, wait until
    the server cancelled the work, and let the passes go."""
    assert backend.gate is not None
    _hang_up_in_first_pass(server, backend, path, body)
    assert _Watched.cancelled_event.wait(60), "the disconnect did not cancel the work"
    backend.gate.set()


def _hang_up_in_first_pass(
    server: LiveServer, backend: RecordingBackend, path: str, body: object
) -> None:
    """POST ``body`` to ``path`` over a raw socket and close it once the request's first
    forward pass has reached the (gated) model."""
    raw = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + raw)
        assert backend.entered.wait(60), "the request never reached the model"


def test_a_disconnect_cancels_a_rerank(live: tuple[LiveServer, RecordingBackend]) -> None:
    server, backend = live
    docs = [f"{c} ZZZZ ZZZZ" for c in "abcdef"]  # the shared prefix ends before any Z
    _abandon(server, backend, "/v1/rerank", {"model": "ranker", "query": "q", "documents": docs})
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        # Behind the abandoned rerank in the model's queue: once it is answered, whatever
        # of the other was going to run has.
        probe = {"model": "ranker", "query": "q", "documents": ["plain"]}
        assert http.post("/v1/rerank", json=probe).status_code == 200
    decoded = [t.token for batch in backend.calls for t in batch]
    assert decoded and MARK not in decoded


def test_a_disconnect_cancels_an_embedding(live: tuple[LiveServer, RecordingBackend]) -> None:
    server, backend = live
    # n_batch 64: each input is a piece of its own; the first (no Z) is held at the gate.
    inputs = ["first " * 8] + [f"{i} ZZZZ " * 6 for i in range(5)]
    _abandon(server, backend, "/v1/embeddings", {"model": "embedder", "input": inputs})
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        probe = {"model": "embedder", "input": "plain"}
        assert http.post("/v1/embeddings", json=probe).status_code == 200
    assert len(backend.embedded) == 2, backend.embedded  # the held piece, then the probe
    assert not any(MARK in tokens for tokens in backend.embedded)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/rerank", {"model": "ranker", "query": "q", "documents": ["a ZZZZ", "b ZZZZ"]}),
        ("/v1/embeddings", {"model": "embedder", "input": ["first " * 8, "1 ZZZZ " * 6]}),
    ],
    ids=["rerank", "embedding"],
)
def test_shutdown_cancels_a_rerank_or_an_embedding_as_it_ends_generations(
    live: tuple[LiveServer, RecordingBackend], path: str, body: dict[str, object]
) -> None:
    """Found by review: shutdown's drain (``ServerState.drain``, a second before uvicorn's
    graceful wait ends) ended the generations still running but not a rerank or an
    embedding, which went on until uvicorn cancelled its handler (then its thread was left
    running into the engine's close). Now the drain cancels it too: its work not begun is
    dropped, its answer is the generations' 503 ``shutting_down``, and one that starts after
    the drain is refused at once, as a generation is."""
    server, backend = live
    assert backend.gate is not None
    state = server.server.config.app.state.kvwarm
    loop = server.server.servers[0].get_loop()
    answers: list[httpx.Response] = []

    def ask() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            answers.append(http.post(path, json=body))

    client = threading.Thread(target=ask)
    try:
        client.start()
        assert backend.entered.wait(60), "the request never reached the model"
        loop.call_soon_threadsafe(state.drain, 0.0)  # what shutdown calls, its delay passed
        # Its first pass is still held: only the drain can have cancelled it.
        assert _Watched.cancelled_event.wait(30), "the drain did not cancel the work"
    finally:
        backend.gate.set()
        client.join(60)
    (answer,) = answers
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "shutting_down"
    decoded = [t.token for batch in backend.calls for t in batch]
    assert MARK not in decoded and not any(MARK in tokens for tokens in backend.embedded)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        later = http.post(path, json=body)
    assert later.status_code == 503 and later.json()["error"]["code"] == "shutting_down"


LONG = "word " * 60  # some 300 tokens: prefilled in several passes of n_batch 64
GENERATIONS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "stream": True}),
    ("/v1/completions", {"prompt": [LONG, LONG + "again"]}),  # the second is never started
    ("/v1/completions", {"prompt": LONG, "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 32}),
    ("/v1/responses", {"input": LONG}),
    ("/v1/responses", {"input": LONG, "stream": True}),
]


@pytest.mark.parametrize(
    ("path", "body"),
    GENERATIONS,
    ids=["chat", "chat-stream", "completions", "completions-stream", "messages", "responses",
         "responses-stream"],
)  # fmt: skip
def test_a_disconnect_mid_prefill_cancels_the_generation(
    live: tuple[LiveServer, RecordingBackend], path: str, body: dict[str, object]
) -> None:
    """A client that leaves while its prompt is prefilled (streamed, before any header was
    sent, or not) ends its generation there: the pass under way finishes, no other runs for
    it, and its slot and its model's lease are free. ``/metrics`` counts it once, as a
    client's disconnect, a cancelled generation and an HTTP 499 (found by review: a chat, a
    message, a response and a stream cut before its headers counted a 200, the whole answer
    the route then sent to nobody, where a completion counted a 499)."""
    server, backend = live
    assert backend.gate is not None
    state = server.server.config.app.state.kvwarm
    entry = state.entries["embedder"]
    before = len(backend.calls)
    _hang_up_in_first_pass(server, backend, path, {"model": "embedder", "max_tokens": 32, **body})
    # Its first pass is still held: only the disconnect can have cancelled it.
    _until(lambda: any(g.stream.request.cancelled.is_set() for g in list(state.streams)))
    backend.gate.set()
    _until(lambda: not state.streams and entry.leases == 0)
    assert len(backend.calls) == before + 1, "the abandoned prompt went on being prefilled"
    with httpx.Client(base_url=server.base_url, timeout=60) as http:  # the slot is free
        probe = {"model": "embedder", "prompt": "x", "max_tokens": 2}
        assert http.post("/v1/completions", json=probe).status_code == 200
        counted = _counters(http.get("/metrics").text)
    assert counted["kvwarm_client_disconnects_total", ()] == 1
    labels = (("model", "embedder"), ("reason", "cancelled"))
    assert counted["kvwarm_generations_total", labels] == 1
    statuses = {
        dict(labels)["status"]: n
        for (name, labels), n in counted.items()
        if name == "kvwarm_http_requests_total" and dict(labels)["route"] == path
    }
    probed = {"200": 1} if path == "/v1/completions" else {}  # the probe above
    assert statuses == {"499": 1, **probed}


def _counters(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _until(ready: Callable[[], bool], deadline_s: float = 30.0) -> None:
    """Poll the server's state, bounded."""
    end = time.monotonic() + deadline_s
    while not ready():
        assert time.monotonic() < end, "the server did not get there in time"
        time.sleep(0.02)
