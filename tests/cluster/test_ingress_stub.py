"""The cluster's ingress (the server's routes over ``RemoteModel``) and the engine replica's
body, in one process on the stub backend: no Ray, the handle replaced by direct calls. What
crosses the handle here is what crosses it under Ray (``calls``: typed, picklable values)."""

from __future__ import annotations

import asyncio
import json
import pickle
from collections.abc import AsyncIterator, Awaitable, Iterator

import pytest
from fastapi.testclient import TestClient
from ray.exceptions import ActorDiedError
from tests.cluster.test_remote_ops import Hung
from tests.server.conftest import sse_events, stub_settings, wait_ready

from kvwarm.cluster.calls import Failed, Generate, ModelOp, Served, SnapshotCall
from kvwarm.cluster.chains import chat_chain
from kvwarm.cluster.ingress import create_ingress_app
from kvwarm.cluster.replica import EngineReplica
from kvwarm.cluster.routing import ClusterIndex
from kvwarm.engine.cancel import Cancellation
from kvwarm.errors import InvalidRequestError
from kvwarm.server.app import create_app
from kvwarm.settings import ModelSpec

SYSTEM = {"role": "system", "content": "You answer in one short sentence, always politely."}


class DirectStream:
    """A replica's ``generate`` as the ingress sees a streaming handle call; every item goes
    through pickle, as it would between processes."""

    def __init__(self, items: AsyncIterator[object]) -> None:
        self._items = items
        self.cancelled = False
        self._closing: set[asyncio.Future[None]] = set()

    def __anext__(self) -> Awaitable[object]:
        async def step() -> object:
            return pickle.loads(pickle.dumps(await self._items.__anext__()))

        return step()

    def cancel(self) -> None:
        self.cancelled = True
        task = asyncio.ensure_future(self._items.aclose())  # type: ignore[attr-defined]
        self._closing.add(task)


class DirectCalls:
    def __init__(self, replica: EngineReplica, *, broken: bool = False) -> None:
        self.replica = replica
        self.broken = broken
        self.calls: list[Generate] = []
        self.cancels: list[Cancellation | None] = []  # each op's, from the route

    def stream(self, call: Generate) -> DirectStream:
        call = pickle.loads(pickle.dumps(call))
        self.calls.append(call)
        if self.broken:
            return DirectStream(_dies())
        return DirectStream(self.replica.generate(call))

    def op(self, op: ModelOp, cancel: Cancellation | None = None) -> object:
        self.cancels.append(cancel)
        return pickle.loads(pickle.dumps(asyncio.run(self.replica.call(op))))

    def replicas(self) -> list[str]:
        return [self.replica.replica_id]


# What Ray's errors carry about the process that failed (its address, pid, files): never the
# client's to read (``remote.unavailable``).
INTERNALS = "ip: 10.0.0.7, pid: 4242, /srv/kvwarm/secret.py"


async def _dies() -> AsyncIterator[object]:
    raise RuntimeError(f"ActorDiedError: the replica's process died ({INTERNALS})")
    yield  # an async generator


@pytest.fixture(scope="module")
def replica() -> Iterator[EngineReplica]:
    body = EngineReplica(stub_settings(), replica_id="replica-1")
    yield body
    body.engine.close()


@pytest.fixture(scope="module")
def calls(replica: EngineReplica) -> DirectCalls:
    return DirectCalls(replica)


@pytest.fixture(scope="module")
def index() -> ClusterIndex:
    return ClusterIndex()


@pytest.fixture(scope="module")
def client(calls: DirectCalls, index: ClusterIndex) -> Iterator[TestClient]:
    with TestClient(create_ingress_app(stub_settings(), calls, index)) as test_client:
        wait_ready(test_client.get)
        yield test_client


def test_chat_carries_its_chain_names_the_replica_and_warms_it(
    client: TestClient, calls: DirectCalls, replica: EngineReplica
) -> None:
    turn1 = [SYSTEM, {"role": "user", "content": "Name a colour of the sky."}]
    body = {"model": "a", "messages": turn1, "max_tokens": 6, "temperature": 0}
    first = client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.json()
    assert first.headers["x-kvwarm-replica"] == "replica-1"
    assert calls.calls[-1].chain == chat_chain("a", turn1)
    assert set(chat_chain("a", turn1)) <= set(replica.warm.recent())
    reply = first.json()["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    assert calls.calls[-1].options.parent_key is None  # a new conversation has no parent
    # The ingress tokenized the prompt (its vocabulary alone) as the replica does: the
    # router keys its chunks from these.
    assert calls.calls[-1].tokens == replica.models["a"].chat_tokens(turn1)[0]
    second = client.post("/v1/chat/completions", json={**body, "messages": turn2}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # The follow-up named the first turn's finish row, which any replica can look up by key.
    parent = calls.calls[-1].options.parent_key
    assert parent is not None
    assert replica.engine.cache.lookup_exact_or_wait(parent, 5.0) is not None
    stats = replica.record_routing_stats()
    assert stats["warm"][:1] == [chat_chain("a", turn2)[-1]]  # most recent first
    assert stats["in_flight"] == 0 and stats["ttft_ms"] is not None


def test_get_cluster_lists_replicas_and_what_their_caches_hold(
    client: TestClient, replica: EngineReplica, index: ClusterIndex
) -> None:
    turn = [SYSTEM, {"role": "user", "content": "Name a bird that cannot fly."}]
    body = {"model": "a", "messages": turn, "max_tokens": 6, "temperature": 0}
    done = client.post("/v1/chat/completions", json=body).json()
    key = bytes.fromhex(done["timings"]["cache_key"])
    chain = chat_chain("a", turn)
    # The ingress noted what replica-1 served before answering: its slot holds the turn.
    live = index.reach(chain, None, {"replica-1": None})["replica-1"]["live"]
    assert live == done["usage"]["total_tokens"]
    # The router applies the replica's report (what Ray relays every stats period).
    assert replica.engine.cache.lookup_exact_or_wait(key, 5.0) is not None
    stats = replica.record_routing_stats()
    if index.observe("replica-1", "node-1", stats):  # this index missed earlier reports
        snapshot = asyncio.run(replica.snapshot(SnapshotCall("replica-1")))
        assert index.load_snapshot("replica-1", pickle.loads(pickle.dumps(snapshot)))
    assert index.wanted() == []
    assert index.reach((), key, {"replica-1": "node-1"})["replica-1"]["memory"] > 0
    view = client.get("/cluster").json()
    assert view["routing"] == "events"
    (entry,) = view["replicas"]
    assert entry["id"] == "replica-1" and entry["health"] == "running"
    assert entry["node"] == "node-1" and entry["stats"]["pid"] > 0
    assert entry["stats"]["cache"]["ram"]["rows"] == entry["indexed"]["tiers"]["ram"]["rows"]
    assert entry["seq"] == stats["events"]["seq"]  # type: ignore[index]
    assert view["index"]["rows"] >= 1 and view["index"]["chunks"] >= 0


def test_get_cluster_is_404_on_a_plain_server() -> None:
    with TestClient(create_app(stub_settings())) as plain:
        wait_ready(plain.get)
        answer = plain.get("/cluster")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_a_cluster"


def test_a_completion_carries_its_prompts_tokens(
    client: TestClient, calls: DirectCalls, replica: EngineReplica
) -> None:
    body = {"model": "a", "prompt": "Once upon a time", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert calls.calls[-1].tokens == tuple(replica.models["a"].tokenize("Once upon a time"))
    ids = {"model": "a", "prompt": [5, 6, 7, 8], "max_tokens": 2}
    assert client.post("/v1/completions", json=ids).status_code == 200
    assert calls.calls[-1].tokens == (5, 6, 7, 8)


def test_streamed_chat_and_completion(client: TestClient) -> None:
    body = {
        "model": "a",
        "messages": [SYSTEM, {"role": "user", "content": "Count to three."}],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["x-kvwarm-replica"] == "replica-1"
    events = sse_events(response.text)
    assert events[-1]["usage"]["completion_tokens"] >= 1  # type: ignore[index]
    text = client.post(
        "/v1/completions", json={"model": "a", "prompt": "Once upon a time", "max_tokens": 4}
    )
    assert text.status_code == 200 and text.json()["usage"]["completion_tokens"] >= 1


def test_non_generation_calls_go_through_the_replica(client: TestClient) -> None:
    tokens = client.post("/tokenize", json={"model": "a", "content": "hello world"}).json()
    assert tokens["tokens"]
    text = client.post("/detokenize", json={"model": "a", "tokens": tokens["tokens"]}).json()
    assert "hello" in text["content"]
    emb = client.post("/v1/embeddings", json={"model": "a", "input": ["a b", "c"]}).json()
    assert len(emb["data"]) == 2 and emb["usage"]["prompt_tokens"] > 0
    models = client.get("/v1/models").json()["data"]
    assert {m["id"] for m in models} == {"a", "b"}
    assert all(m["status"] == "ready" and m["meta"]["n_ctx"] > 0 for m in models)


def test_a_replica_runs_only_declared_operations(replica: EngineReplica) -> None:
    # The replica dispatches by name (engine.ops.CALLS): a name that is not a declared
    # operation, such as the model's own unload, is refused and the model stays loaded.
    refused = asyncio.run(replica.call(ModelOp("a", "unload")))
    assert isinstance(refused, Failed) and isinstance(refused.error, InvalidRequestError)
    assert replica.models["a"].status().state == "ready"
    info = asyncio.run(replica.call(ModelOp("a", "info")))
    assert getattr(info, "id", None) == "a"


def test_replica_errors_keep_their_type(client: TestClient) -> None:
    # Model b has n_ctx 256: the replica's ContextOverflowError comes back as the same 400.
    long = {"model": "b", "prompt": "word " * 400, "max_tokens": 4}
    response = client.post("/v1/completions", json=long)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert client.post("/v1/completions", json={"model": "zz", "prompt": "x"}).status_code == 404
    bad = client.post("/v1/completions", json={"model": "a", "prompt": "x", "temperature": -1})
    assert bad.status_code == 400


@pytest.mark.parametrize("bad_id", [-1, 1 << 40])
def test_a_token_id_out_of_any_vocabulary_is_the_replicas_400(
    client: TestClient, bad_id: int
) -> None:
    """Found by review: the ingress hashed a token prompt's ids as 4 unsigned bytes each to
    route it (``chains.text_chain``), so a negative or huge id was an OverflowError there, a
    500, where a server answers the 400 naming the prompt; a prewarm's ids (``/cache/prewarm``
    takes ids) too."""
    ids = [bad_id, *range(5, 45)]
    for path, body in (
        ("/v1/completions", {"model": "a", "prompt": ids, "max_tokens": 1}),
        ("/cache/prewarm", {"model": "a", "prompt": ids, "keep_alive": False}),
    ):
        response = client.post(path, json=body)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == "prompt"


def test_cache_administration_is_per_replica(client: TestClient) -> None:
    response = client.get("/cache/stats")
    assert response.status_code == 501
    assert response.json()["error"]["code"] == "not_supported_in_cluster"
    # The slots too: the ingress has none, and an empty list said the replicas had none
    # (found by review).
    slots = client.get("/cache/slots")
    assert slots.status_code == 501, slots.text
    assert slots.json()["error"]["code"] == "not_supported_in_cluster"
    # llama-server's /slots as well (found by review: an empty list, and with
    # fail_on_no_slot a 503 "no slot available" on every call, a health check's "down").
    for query in ("", "?fail_on_no_slot=1"):
        llama = client.get(f"/slots{query}")
        assert llama.status_code == 501, llama.text
        assert llama.json()["error"]["code"] == "not_supported_in_cluster"


def test_a_dead_replica_is_a_503(replica: EngineReplica) -> None:
    with TestClient(create_ingress_app(stub_settings(), DirectCalls(replica, broken=True))) as c:
        wait_ready(c.get)
        body = {"model": "a", "messages": [SYSTEM], "max_tokens": 3}
        response = c.post("/v1/chat/completions", json=body)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "replica_unavailable"
    # Transient: Serve starts a replacement (the 429's header, found by review: none).
    assert response.headers["retry-after"] == "1"
    # The error's type, never Ray's message (found by review).
    assert "RuntimeError" in response.text and INTERNALS not in response.text


def test_an_unexpected_replica_error_is_a_500_naming_no_internals(
    replica: EngineReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``kvwarm serve`` answers an unexpected error: 500 ``internal_error``, the details
    in the replica's log only (found by review: its message reached the client)."""

    def broken(call: Generate) -> object:
        raise OSError(f"[Errno 5] {INTERNALS}")

    monkeypatch.setattr(replica, "_start", broken)
    with TestClient(create_ingress_app(stub_settings(), DirectCalls(replica))) as c:
        wait_ready(c.get)
        for stream in (False, True):
            body = {"model": "a", "messages": [SYSTEM], "max_tokens": 3, "stream": stream}
            response = c.post("/v1/chat/completions", json=body)
            assert response.status_code == 500, response.text
            assert response.json()["error"]["code"] == "internal_error"
            assert INTERNALS not in response.text


class DyingCalls(DirectCalls):
    """The first ``deaths`` generations land on a replica that dies: before answering, or
    (``after_text``) after streaming some text; later ones reach the real replica."""

    def __init__(self, replica: EngineReplica, deaths: int, *, after_text: bool = False) -> None:
        super().__init__(replica)
        self.deaths = deaths
        self.after_text = after_text

    def stream(self, call: Generate) -> DirectStream:
        if self.deaths == 0:
            return super().stream(call)
        self.deaths -= 1
        self.calls.append(call)
        return DirectStream(self._dies_mid_call())

    async def _dies_mid_call(self) -> AsyncIterator[object]:
        yield Served("replica-dying")
        if self.after_text:
            yield "Half a rep"
        raise ActorDiedError()


def test_a_request_whose_replica_dies_before_answering_goes_to_another(
    replica: EngineReplica,
) -> None:
    calls = DyingCalls(replica, deaths=2)
    with TestClient(create_ingress_app(stub_settings(), calls)) as c:
        wait_ready(c.get)
        body = {"model": "a", "messages": [SYSTEM], "max_tokens": 3}
        response = c.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.json()
        assert response.headers["x-kvwarm-replica"] == "replica-1"
        # The retries named the lost replica, so the router passes over it.
        lost = ("replica-dying",)
        assert [call.avoid for call in calls.calls] == [(), lost, lost]
        assert c.get("/cluster").json()["ingress"]["retried"] == 2
        streamed = c.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and calls.deaths == 0
        # Three lost in a row: the client hears 503, never a hang.
        calls.deaths = 3
        assert c.post("/v1/chat/completions", json=body).status_code == 503


def test_a_stream_whose_replica_dies_mid_reply_ends_with_an_error_event(
    replica: EngineReplica,
) -> None:
    calls = DyingCalls(replica, deaths=1, after_text=True)
    with TestClient(create_ingress_app(stub_settings(), calls)) as c:
        wait_ready(c.get)
        body = {"model": "a", "messages": [SYSTEM], "max_tokens": 3, "stream": True}
        response = c.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    events = sse_events(response.text)
    text = "".join(
        e["choices"][0]["delta"].get("content") or ""  # type: ignore[index]
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )
    assert text == "Half a rep"
    assert events[-1]["error"]["code"] == "replica_unavailable"  # type: ignore[index]
    assert len(calls.calls) == 1  # text had reached the client: not sent again


def test_a_non_streamed_request_whose_replica_dies_mid_reply_is_sent_again(
    replica: EngineReplica,
) -> None:
    # Its text came back in part, but none of it reached the client: another replica serves
    # it whole (found by bench/cluster.py: one failed request in a run with a kill).
    calls = DyingCalls(replica, deaths=1, after_text=True)
    with TestClient(create_ingress_app(stub_settings(), calls)) as c:
        wait_ready(c.get)
        body = {"model": "a", "messages": [SYSTEM], "max_tokens": 3}
        response = c.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.json()
    assert "Half a rep" not in response.json()["choices"][0]["message"]["content"]
    assert len(calls.calls) == 2


def test_n_choices_logprobs_and_infill_through_the_ingress(client: TestClient) -> None:
    body = {"model": "a", "prompt": "Once upon a time", "max_tokens": 4, "n": 2, "seed": 3}
    done = client.post("/v1/completions", json={**body, "temperature": 1.0}).json()
    assert [c["index"] for c in done["choices"]] == [0, 1]
    assert done["usage"]["prompt_tokens"] == len("Once upon a time") + 1  # once, BOS included
    chat = {
        "model": "a",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "logprobs": True,
    }
    response = client.post("/v1/chat/completions", json=chat)
    events = sse_events(response.text)
    finished = {
        e["choices"][0]["index"]  # type: ignore[index]
        for e in events
        if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]
    }
    assert finished == {0, 1}
    logprobs = [
        t
        for e in events
        if isinstance(e, dict) and e["choices"] and e["choices"][0]["logprobs"]
        for t in e["choices"][0]["logprobs"]["content"]
    ]
    assert len(logprobs) >= 2  # a replica streams text only: they come with the last chunks
    refused = client.post("/infill", json={"model": "a", "input_prefix": "a", "input_suffix": "b"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "fim_not_supported"


def test_a_streamed_llama_completion_carries_its_tokens_through_the_ingress(
    client: TestClient,
) -> None:
    """A replica streams text only: the tokens and probabilities llama-server's chunks
    carry come with each choice's end, never dropped (found by review: every chunk said
    ``"tokens": []`` and ``n_probs`` gave no probability at all)."""
    body = {"model": "a", "prompt": ["hello there", "bye"], "n_predict": 4, "temperature": 0}
    whole = client.post("/completion", json={**body, "return_tokens": True, "n_probs": 2})
    assert whole.status_code == 200, whole.text
    streamed = client.post("/completion", json={**body, "stream": True, "n_probs": 2})
    assert streamed.status_code == 200, streamed.text
    assert "[DONE]" not in streamed.text  # llama-server's own routes send none
    lines = streamed.text.split("\n")
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    for want in whole.json():
        i = want["index"]
        chunks = [e for e in events if e["index"] == i and e["stop"] is False]
        assert [t for c in chunks for t in c["tokens"]] == want["tokens"]
        assert "".join(c["content"] for c in chunks) == want["content"]
        probs = [p for c in chunks for p in c.get("completion_probabilities", [])]
        assert probs == want["completion_probabilities"]
        assert chunks[-1]["tokens_predicted"] == want["tokens_predicted"] == 4
        assert chunks[-1]["tokens_evaluated"] == want["tokens_evaluated"]


def test_a_chats_prediction_reaches_the_replica_and_is_drafted_there(
    client: TestClient, calls: DirectCalls
) -> None:
    """OpenAI's ``prediction`` crosses the handle with the chat's options: the replica drafts
    from it (its own salt, so no cached row of the plain reply drafts instead), and the
    reply is the plain one."""
    turn = [SYSTEM, {"role": "user", "content": "Name three birds of the coast."}]
    body = {"model": "a", "messages": turn, "max_tokens": 16, "temperature": 0}
    plain = client.post("/v1/chat/completions", json={**body, "cache_salt": "pred-0"}).json()
    text = plain["choices"][0]["message"]["content"]
    prediction = {"type": "content", "content": [{"type": "text", "text": text}]}
    predicted = client.post(
        "/v1/chat/completions", json={**body, "cache_salt": "pred-1", "prediction": prediction}
    ).json()
    assert calls.calls[-1].options.prediction == text
    assert predicted["choices"][0]["message"]["content"] == text
    assert predicted["timings"]["draft_n_accepted"] > plain["timings"]["draft_n_accepted"]


def test_a_streamed_echo_carries_its_prompts_logprobs_through_the_ingress(
    client: TestClient,
) -> None:
    """Found by review: the prompt's tokens and logprobs came only with the reply's end, so the
    first chunk of a streamed ``echo`` with ``logprobs`` held the first token alone (the
    prompt's others missing, as ``kvwarm serve`` writes them); the replica now sends them
    before the first fragment."""
    body = {"model": "a", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
    body |= {"echo": True, "logprobs": 1}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    response = client.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200
    first = sse_events(response.text)[0]["choices"][0]  # type: ignore[index]
    assert first["text"] == "Once upon a time"
    echoed = first["logprobs"]
    n = len("Once upon a time") + 1  # BOS included
    assert len(echoed["tokens"]) == n
    for field in ("tokens", "token_logprobs", "text_offset"):
        assert echoed[field] == whole[field][:n], field


def test_startup_prompts_reach_the_api_key_tenant_through_the_replicas() -> None:
    """``--prewarm-system`` with ``cache_salt_from_auth``: the ingress warms the key's
    namespace on the replicas too, not only the unsalted one (as ``serve`` does)."""
    system = "You are the startup assistant of every tenant; keep answers short and friendly."
    body = EngineReplica(stub_settings(), replica_id="replica-warm")
    try:
        settings = stub_settings(prewarm_system=(system,), cache_salt_from_auth=True, api_key="k1")
        with TestClient(create_ingress_app(settings, DirectCalls(body))) as warm:
            wait_ready(warm.get)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
            request = {"model": "a", "messages": messages, "max_tokens": 1}
            response = warm.post(
                "/v1/chat/completions", json=request, headers={"Authorization": "Bearer k1"}
            )
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    finally:
        body.engine.close()


def test_fill_in_the_middle_of_a_token_prompt_through_the_ingress() -> None:
    """A token-id prompt with a ``suffix`` is detokenized by a replica: off the event loop,
    where a blocking handle call may run (under Ray ``.result()`` on the loop is refused,
    here ``asyncio.run``: both were a 503 before). Found by review."""
    settings = stub_settings(models=(ModelSpec(path="stub-fim", id="coder"),))
    body = EngineReplica(settings, replica_id="replica-fim")
    try:
        with TestClient(create_ingress_app(settings, DirectCalls(body))) as c:
            wait_ready(c.get)
            request = {"model": "coder", "prompt": [100, 101, 102], "suffix": "\n", "max_tokens": 2}
            response = c.post("/v1/completions", json=request)
            assert response.status_code == 200, response.text
            # BOS, FIM_PRE, the prefix's three bytes, FIM_SUF, the suffix's byte, FIM_MID.
            assert response.json()["usage"]["prompt_tokens"] == 1 + 1 + 3 + 1 + 1 + 1
    finally:
        body.engine.close()


class LostOnTemplate(DirectCalls):
    """Ops reach a replica that is lost while rendering a template (``apply_chat_template``,
    which the ingress asks to learn whether a model renders tools natively)."""

    def op(self, op: ModelOp, cancel: Cancellation | None = None) -> object:
        if op.op == "apply_chat_template":
            raise ActorDiedError()
        return super().op(op, cancel)


def test_a_replica_lost_while_probing_the_template_for_tools_is_a_503(
    replica: EngineReplica,
) -> None:
    # Not "the template renders no tools": that would run the request with the tools
    # emulated in the prompt, a different prompt than the model's own. Found by review.
    calls = LostOnTemplate(replica)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    with TestClient(create_ingress_app(stub_settings(), calls)) as c:
        wait_ready(c.get)
        body = {"model": "a", "messages": [SYSTEM], "max_tokens": 3, "tools": [tool]}
        response = c.post("/v1/chat/completions", json=body)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "replica_unavailable"
    assert calls.calls == []  # nothing generated with a prompt the model would not render


class HungCalls(DirectCalls):
    """Generations reach a replica that stops answering after it said it serves them."""

    def stream(self, call: Generate) -> Hung:  # type: ignore[override]
        self.calls.append(call)
        return Hung()


@pytest.mark.parametrize("stream", [False, True])
def test_a_hung_replica_ends_at_the_servers_deadline(replica: EngineReplica, stream: bool) -> None:
    """``request_timeout_s`` holds at the ingress as at ``kvwarm serve``: a replica that
    hangs (alive to Ray, answering nothing) is a ``request_timeout`` at the deadline, not a
    hang until Ray's health checks kill it (found by review)."""
    settings = stub_settings(request_timeout_s=0.5)
    with TestClient(create_ingress_app(settings, HungCalls(replica))) as c:
        wait_ready(c.get)
        body = {"model": "a", "messages": [SYSTEM], "max_tokens": 3, "stream": stream}
        response = c.post("/v1/chat/completions", json=body)
    # Streamed or not: nothing was sent before the cut, so the deadline is the status, as
    # serve's (``Generation.prime``).
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "request_timeout"
