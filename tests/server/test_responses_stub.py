"""``/v1/responses`` on the stub backend: shapes, event order, the store, conversion, errors."""

from __future__ import annotations

import typing

import openai
import pydantic
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent

from kvwarm.engine.types import Completion, CompletionStats
from kvwarm.server import create_app
from kvwarm.server.chat import ChatReply
from kvwarm.server.responses import translate as responses
from kvwarm.server.responses.schemas import ResponsesRequest
from kvwarm.server.responses.store import ResponseStore, StoredResponse
from kvwarm.server.schemas import ChatMessage
from kvwarm.server.tools import ToolCall

from .conftest import server_state, stub_settings, wait_ready
from .test_anthropic_stub import named_events
from .test_api_stub import assert_error

BASE: dict[str, object] = {
    "model": "a",
    "input": "Tell me about the quick brown fox, please.",
    "instructions": "Be terse.",
    "max_output_tokens": 12,
    "temperature": 0,
}


def test_response_shape_and_usage(client: TestClient) -> None:
    response = client.post("/v1/responses", json=BASE)
    assert response.status_code == 200, response.json()
    data = response.json()
    assert data["id"].startswith("resp_") and data["object"] == "response"
    assert data["status"] in ("completed", "incomplete") and data["model"] == "a"
    assert data["instructions"] == "Be terse." and data["max_output_tokens"] == 12
    if data["status"] == "incomplete":
        assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = data["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["id"].startswith("msg_") and item["status"] in ("completed", "incomplete")
    (part,) = item["content"]
    assert part["type"] == "output_text" and isinstance(part["text"], str)
    usage = data["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 < usage["output_tokens"] <= 12
    assert set(usage["input_tokens_details"]) == {"cached_tokens", "cache_write_tokens"}
    again = client.post("/v1/responses", json=BASE).json()
    assert again["output"][0]["content"] == item["content"]  # greedy: the same reply
    details = again["usage"]["input_tokens_details"]
    assert details["cached_tokens"] > 0
    # Written: the rest of the prompt, saved with the reply's row (as Anthropic's
    # cache_creation_input_tokens: tests/server/test_anthropic_stub.py).
    assert (
        details["cache_write_tokens"] == again["usage"]["input_tokens"] - details["cached_tokens"]
    )


def test_stream_events_in_order_end_with_the_stored_response(client: TestClient) -> None:
    whole = client.post("/v1/responses", json=BASE).json()
    with client.stream("POST", "/v1/responses", json={**BASE, "stream": True}) as response:
        assert response.status_code == 200
        events = named_events(response.read().decode())
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    terminal = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        terminal,
    ]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    text = "".join(str(d["delta"]) for n, d in events if n == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]
    assert events[-4][1]["text"] == text
    final = events[-1][1]["response"]
    assert isinstance(final, dict) and final["status"] == whole["status"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["output"][0]["id"] == events[2][1]["item"]["id"]  # type: ignore[index]
    stored = client.get(f"/v1/responses/{final['id']}")
    assert stored.status_code == 200 and stored.json() == final


def _sdk_event_types() -> dict[str, type[pydantic.BaseModel]]:
    """The openai SDK's class of each Responses stream event, by its ``type``."""
    union = typing.get_args(ResponseStreamEvent)[0]
    out: dict[str, type[pydantic.BaseModel]] = {}
    for cls in typing.get_args(union):
        (kind,) = typing.get_args(cls.model_fields["type"].annotation)
        out[kind] = cls
    return out


def test_bodies_and_events_validate_against_the_sdk_schemas(client: TestClient) -> None:
    # The SDK builds its objects without validation, so a required field left out reads as
    # None, silently: usage.input_tokens_details.cache_write_tokens was missing (found by
    # review). Here every body and event is validated against the SDK's models, strictly.
    whole = client.post("/v1/responses", json=BASE)
    assert whole.status_code == 200, whole.text
    Response.model_validate(whole.json())
    with client.stream("POST", "/v1/responses", json={**BASE, "stream": True}) as response:
        streamed = [event for _, event in named_events(response.read().decode())]
    # A reply with a call (the stub holds no model to a tool's JSON: the events are made here).
    shape = responses.ResponseShape(ResponsesRequest.model_validate({"input": "hi"}), "a")
    events = responses.ResponseEvents(shape)
    call = ToolCall("call_x", "f", '{"q": 1}')
    made = [*events.start(), *events.part("Let me look."), *events.part(call)]
    made += events.finish(_reply("Let me look.", [call]))
    classes = _sdk_event_types()
    for event in [*streamed, *(data for _, data in made)]:
        classes[str(event["type"])].model_validate(event)
    assert "response.function_call_arguments.done" in {n for n, _ in made}


def test_logprobs_come_when_included_streamed_or_not(client: TestClient) -> None:
    # include "message.output_text.logprobs" and top_logprobs were ignored: every output text
    # said logprobs [] (streamed) or had none (found by review).
    body = {**BASE, "include": [responses.LOGPROBS_INCLUDE], "top_logprobs": 2}
    data = client.post("/v1/responses", json=body).json()
    (part,) = data["output"][0]["content"]
    entries = part["logprobs"]
    assert "".join(e["token"] for e in entries) == part["text"]  # the stub's tokens are bytes
    assert len(entries) <= data["usage"]["output_tokens"] and entries
    for entry in entries:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"]
    alone = client.post("/v1/responses", json={**BASE, "top_logprobs": 0}).json()
    assert [e["logprob"] for e in alone["output"][0]["content"][0]["logprobs"]] == [
        e["logprob"] for e in entries
    ]
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        events = named_events(response.read().decode())
    deltas = [d for n, d in events if n == "response.output_text.delta"]
    streamed = [e for d in deltas for e in d["logprobs"]]  # type: ignore[union-attr]
    assert streamed == entries
    (done,) = [d for n, d in events if n == "response.output_text.done"]
    assert done["logprobs"] == entries
    assert events[-1][1]["response"]["output"][0]["content"][0]["logprobs"] == entries  # type: ignore[index]
    plain = client.post("/v1/responses", json=BASE).json()
    assert "logprobs" not in plain["output"][0]["content"][0]  # not asked for: as before


def test_previous_response_id_restores_the_conversation(client: TestClient) -> None:
    first = client.post("/v1/responses", json={**BASE, "input": "Name a colour, fox."}).json()
    follow = {**BASE, "input": "And another one?", "previous_response_id": first["id"]}
    before = client.get("/cache/stats").json()["counters"]
    second = client.post("/v1/responses", json=follow).json()
    assert second["previous_response_id"] == first["id"]
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    # The whole first prompt (and its reply) came from the cache, not a prefill.
    assert cached >= first["usage"]["input_tokens"]
    assert second["usage"]["input_tokens"] > cached
    after = client.get("/cache/stats").json()["counters"]
    # One outcome, of what served the prefix: the slot still held the first turn, so its live
    # KV (hits_live), not a row (hits_resume: tests/engine/test_hit_counters_stub.py). The
    # wait for the previous reply's finish row counts nothing (found by review).
    outcomes = ("hits_exact", "hits_resume", "hits_longest_prefix", "hits_live", "misses")
    assert {k: after[k] - before[k] for k in outcomes if after[k] != before[k]} == {"hits_live": 1}
    # Reading a row's metadata is no hit either (it counted as hits_resume).
    key = client.get("/cache/rows").json()["data"][0]["key"]
    assert client.get(f"/cache/rows/{key}").status_code == 200
    again = client.get("/cache/stats").json()["counters"]
    assert {k: again[k] for k in again if k.startswith("hits_")} == {
        k: after[k] for k in after if k.startswith("hits_")
    }
    # A chain: the third turn builds on the second, which holds the first.
    third = client.post(
        "/v1/responses", json={**follow, "input": "Thanks.", "previous_response_id": second["id"]}
    ).json()
    assert (
        third["usage"]["input_tokens_details"]["cached_tokens"] >= second["usage"]["input_tokens"]
    )


def test_a_conversation_longer_than_max_chat_messages_is_a_400() -> None:
    """``max_chat_messages`` bounds the conversation a follow-up continues, not only its own
    input: a chain of turns grew by each one's input and reply without bound (found by
    review). With a limit of 3: a follow-up to one turn (user, assistant, user) fits, a
    follow-up to that (five messages) does not; an input of 3 alone still fits."""
    with TestClient(create_app(stub_settings(max_chat_messages=3))) as fresh:
        wait_ready(fresh.get)
        first = fresh.post("/v1/responses", json=BASE)
        assert first.status_code == 200, first.text
        second = fresh.post(
            "/v1/responses", json={**BASE, "previous_response_id": first.json()["id"]}
        )
        assert second.status_code == 200, second.text
        over = fresh.post(
            "/v1/responses", json={**BASE, "previous_response_id": second.json()["id"]}
        )
        assert_error(over, 400, "invalid_value", "previous_response_id")
        assert "5 messages" in over.json()["error"]["message"]
        assert "max_chat_messages" in over.json()["error"]["message"]
        turns = [{"role": "user", "content": "x"}] * 3
        assert fresh.post("/v1/responses", json={**BASE, "input": turns}).status_code == 200


def test_a_follow_up_that_would_outgrow_the_store_is_a_400() -> None:
    """The store's character bound held between responses, but a response larger than it
    is kept, and a chain of follow-ups made each turn's larger than the last: every stored
    response holds its whole conversation and input items, items no prompt holds (a
    ``reasoning`` item's summary: no context bound) included. Found by review: 8 KB of
    reasoning per turn grew one stored response past any bound (to max_body_bytes times
    max_chat_messages / 2: gigabytes). A follow-up that would outgrow the bound is refused;
    a new conversation is not."""
    bound = 30_000
    with TestClient(create_app(stub_settings())) as fresh:
        wait_ready(fresh.get)
        store = server_state(fresh).responses = ResponseStore(max_chars=bound)
        reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r" * 8000}]}
        body = {
            **BASE,
            "max_output_tokens": 2,
            "input": [reasoning, {"role": "user", "content": "More?"}],
        }
        previous = fresh.post("/v1/responses", json=body)
        for _ in range(8):
            assert previous.status_code == 200, previous.text
            follow = fresh.post(
                "/v1/responses", json={**body, "previous_response_id": previous.json()["id"]}
            )
            if follow.status_code != 200:
                break
            previous = follow
        assert_error(follow, 400, "invalid_value", "previous_response_id")
        assert f"{bound:,}" in follow.json()["error"]["message"]
        kept = store.get(previous.json()["id"])
        assert kept is not None and kept.size() <= bound
        assert fresh.post("/v1/responses", json=body).status_code == 200


def test_an_input_item_id_already_among_the_items_is_a_400(client: TestClient) -> None:
    """``input_items`` pages by item id (``after``/``before``), so the ids of a response's
    items must be unique. Found by review: an id the client gave twice, or gave again after
    ``previous_response_id`` (a ``function_call`` item sent back with the id the previous
    output gave it), was stored twice; a cursor naming it found the first, so paging from
    one to the next returned the second again for ever (the SDK's auto-paging never ended).
    Refused as OpenAI's does ("Duplicate item found with id ...")."""
    first = client.post(
        "/v1/responses", json={**BASE, "input": [{"role": "user", "content": "Hi.", "id": "m1"}]}
    )
    assert first.status_code == 200, first.text
    again = [{"role": "user", "content": "Hi again.", "id": "m1"}]
    follow = {**BASE, "input": again, "previous_response_id": first.json()["id"]}
    assert_error(client.post("/v1/responses", json=follow), 400, "invalid_value", "input.0.id")
    output_id = first.json()["output"][0]["id"]
    resent = [{"role": "assistant", "content": "x", "id": output_id}, *again]
    follow = {**follow, "input": [*resent[:1], {"role": "user", "content": "Go on."}]}
    assert_error(client.post("/v1/responses", json=follow), 400, "invalid_value", "input.0.id")
    twice = [
        {"role": "user", "content": "a", "id": "m2"},
        {"role": "user", "content": "b", "id": "m2"},
    ]
    assert_error(
        client.post("/v1/responses", json={**BASE, "input": twice}),
        400,
        "invalid_value",
        "input.1.id",
    )
    # Not stored, none is listed: the ids are the client's business.
    unstored = client.post("/v1/responses", json={**BASE, "input": twice, "store": False})
    assert unstored.status_code == 200, unstored.text
    fresh = {**follow, "input": [{"role": "user", "content": "New.", "id": "m3"}]}
    listed = client.get(
        f"/v1/responses/{client.post('/v1/responses', json=fresh).json()['id']}/input_items"
    )
    ids = [item["id"] for item in listed.json()["data"]]
    assert ids == ["m3", output_id, "m1"]


def test_store_get_delete_and_unknown_ids(client: TestClient) -> None:
    kept = client.post("/v1/responses", json=BASE).json()
    assert client.get(f"/v1/responses/{kept['id']}").json()["id"] == kept["id"]
    deleted = client.delete(f"/v1/responses/{kept['id']}")
    assert deleted.json() == {"id": kept["id"], "object": "response", "deleted": True}
    assert_error(client.get(f"/v1/responses/{kept['id']}"), 404, "response_not_found")
    assert_error(client.delete(f"/v1/responses/{kept['id']}"), 404, "response_not_found")
    unstored = client.post("/v1/responses", json={**BASE, "store": False}).json()
    assert unstored["store"] is False
    assert_error(client.get(f"/v1/responses/{unstored['id']}"), 404, "response_not_found")
    follow = {**BASE, "previous_response_id": unstored["id"]}
    assert_error(
        client.post("/v1/responses", json=follow),
        404,
        "previous_response_not_found",
        "previous_response_id",
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"input": [{"type": "computer_call"}]}, "input.0"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        ({"temperature": -1}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        # References to objects the server does not keep were ignored: the model answered
        # without the conversation's history or the prompt's instructions (found by review).
        ({"conversation": "conv_1"}, "conversation"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"prompt": {"id": "pmpt_1", "variables": {"x": "y"}}}, "prompt"),
        ({"tool_choice": "required"}, "tool_choice"),  # a forced call needs tools
        ({"tool_choice": {"type": "function", "name": "w"}}, "tool_choice"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    client: TestClient, body: dict[str, object], param: str
) -> None:
    response = client.post("/v1/responses", json={**BASE, **body})
    assert response.status_code == 400, response.json()
    assert response.json()["error"]["param"] == param


def test_items_become_chat_turns() -> None:
    req = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "developer", "content": "dev"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "weather "},
                        {"type": "input_text", "text": "in Oslo?"},
                    ],
                },
                {"type": "reasoning", "summary": []},
                {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "call_2", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            ]
        }
    )
    turns = responses.with_instructions("sys", responses.to_history(req.input))
    assert [(t.role, t.content) for t in turns] == [
        ("system", "sys"),
        ("developer", "dev"),
        ("user", "weather in Oslo?"),
        ("assistant", ""),
        ("tool", "sunny"),
    ]
    calls = turns[3].tool_calls
    assert calls is not None and [c.id for c in calls] == ["call_1", "call_2"]
    assert turns[4].tool_call_id == "call_1"


def _reply(text: str, calls: list[ToolCall], finish: str = "stop") -> ChatReply:
    stats = CompletionStats(10, 4, 3, 1.0, 1.0, 0.0, "partial", finish, None)  # type: ignore[arg-type]
    parts: list[str | ToolCall] = [text] if text else []
    return ChatReply(Completion(text, (1,) * 10, (2,) * 3, stats), [*parts, *calls])


def test_function_call_output_and_events() -> None:
    req = ResponsesRequest.model_validate({"input": "hi"})
    shape = responses.ResponseShape(req, "a")
    call = ToolCall("call_abc", "get_weather", '{"city": "Oslo"}')
    body = shape.final(_reply("", [call]), "")
    assert body["status"] == "completed"
    assert body["output"] == [
        {
            "type": "function_call",
            "id": "fc_abc",
            "call_id": "call_abc",
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
            "status": "completed",
        }
    ]
    assert body["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},  # no row saved
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }
    events = responses.ResponseEvents(shape)
    seq = [*events.start(), *events.finish(_reply("", [call]))]
    assert [n for n, _ in seq] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = seq[2][1]["item"]
    assert isinstance(added, dict) and added["arguments"] == "" and added["id"] == "fc_abc"
    assert seq[4][1]["arguments"] == '{"city": "Oslo"}' and seq[4][1]["output_index"] == 0
    assert seq[-1][1]["response"] == body | {"created_at": body["created_at"]}


def test_text_then_call_events_number_items_in_output_order() -> None:
    shape = responses.ResponseShape(ResponsesRequest.model_validate({"input": "hi"}), "a")
    events = responses.ResponseEvents(shape)
    call = ToolCall("call_x", "f", "{}")
    seq = [*events.start(), *events.part("Let me "), *events.part("look."), *events.part(call)]
    seq += events.finish(_reply("Let me look.", [call]))
    added = [d for n, d in seq if n == "response.output_item.added"]
    assert [(d["output_index"], d["item"]["type"]) for d in added] == [  # type: ignore[index]
        (0, "message"),
        (1, "function_call"),
    ]
    final = seq[-1][1]["response"]
    assert isinstance(final, dict)
    assert final["output"][0]["content"][0]["text"] == "Let me look."  # type: ignore[index]
    cut = shape.final(_reply("abc", [], finish="length"), "abc")
    assert cut["status"] == "incomplete"
    assert cut["output"][0]["status"] == "incomplete"  # type: ignore[index]


def test_store_is_bounded_and_keeps_the_newest() -> None:
    store = ResponseStore(max_items=2, max_chars=10**6)

    def item(i: int, text: str = "x") -> StoredResponse:
        turns = (ChatMessage(role="user", content=text),)
        return StoredResponse(f"r{i}", "a", turns, None, {"id": f"r{i}"})

    for i in range(3):
        store.put(item(i))
    assert len(store) == 2 and store.get("r0") is None and store.get("r2") is not None
    assert store.get("r1") is not None  # now the most recently used
    store.put(item(3))
    assert store.get("r2") is None and store.get("r1") is not None
    small = ResponseStore(max_items=10, max_chars=200)
    small.put(item(0, "y" * 50))
    small.put(item(1, "y" * 150))  # over budget together: the older one goes
    assert small.get("r0") is None and small.get("r1") is not None
    small.put(item(2, "y" * 1000))  # alone over budget: still kept, so a follow-up works
    assert len(small) == 1 and small.get("r2") is not None


def _owned(i: int, owner: str | None, text: str = "x") -> StoredResponse:
    turns = (ChatMessage(role="user", content=text),)
    return StoredResponse(f"{owner}-{i}", "a", turns, None, {"id": i}, owner=owner)


def test_one_tenants_flood_evicts_its_own_responses_not_anothers() -> None:
    # Found by review: the store's bound was global, so a tenant sending many responses
    # pushed every other tenant's out (a follow-up to them was then a 404).
    store = ResponseStore(max_items=8, max_chars=10**6)
    for i in range(3):
        store.put(_owned(i, "quiet"))
    for i in range(100):
        store.put(_owned(i, "flood"))
    assert [store.get(f"quiet-{i}") is not None for i in range(3)] == [True] * 3
    assert store.held("flood") == (5, store.held("flood")[1])
    assert store.get("flood-99") is not None and store.get("flood-94") is None
    # A tenant holding more than its share gives back down to it, its oldest first: two
    # tenants each keep half, their most recent responses.
    for i in range(3, 8):
        store.put(_owned(i, "quiet"))
    assert store.held("quiet")[0] == 4 and store.held("flood")[0] == 4
    assert store.get("quiet-7") is not None and store.get("quiet-3") is None
    for i in range(100, 200):
        store.put(_owned(i, "flood"))
    assert store.held("quiet")[0] == 4 and store.get("quiet-4") is not None


def test_the_character_bound_takes_from_the_tenant_holding_the_most_characters() -> None:
    store = ResponseStore(max_items=100, max_chars=2000)
    store.put(_owned(0, "quiet", "q" * 300))
    for i in range(50):
        store.put(_owned(i, "flood", "f" * 200))
    assert store.get("quiet-0") is not None
    assert store.held("flood")[1] <= 2000 - store.held("quiet")[1]
    # Without keys every response is one tenant's (None): one LRU over them all, as before.
    single = ResponseStore(max_items=3, max_chars=10**6)
    for i in range(5):
        single.put(_owned(i, None))
    single.get("None-2")
    single.put(_owned(5, None))
    assert [single.get(f"None-{i}") is not None for i in range(6)] == [
        False, False, True, False, True, True,
    ]  # fmt: skip


def test_a_response_larger_than_the_bound_takes_no_other_tenants_with_it() -> None:
    """Found by review: one tenant's response larger than the whole character bound (a long
    chain of big inputs: each stored response holds its conversation and its input items)
    evicted every other tenant's responses, theirs being all that could go. It is kept, as
    the entry just added always is, alone over the bound; the next put takes it first."""
    store = ResponseStore(max_items=100, max_chars=3000)
    for i in range(3):
        store.put(_owned(i, "quiet", "q" * 300))
    store.put(_owned(0, "big", "b" * 5000))
    assert [store.get(f"quiet-{i}") is not None for i in range(3)] == [True] * 3
    assert store.get("big-0") is not None
    store.put(_owned(3, "quiet", "q" * 300))
    assert store.get("big-0") is None and store.get("quiet-3") is not None
    assert store.held("quiet")[1] <= 3000


def test_follow_ups_stay_in_their_namespace_and_tenant() -> None:
    settings = stub_settings(api_key="user", admin_key="root", cache_salt_from_auth=True)
    user = {"authorization": "Bearer user"}
    with TestClient(create_app(settings)) as secured:
        wait_ready(secured.get)
        first = secured.post("/v1/responses", json={**BASE, "cache_salt": "s1"}, headers=user)
        assert first.status_code == 200, first.json()
        rid = first.json()["id"]
        follow = {**BASE, "input": "More, fox?", "previous_response_id": rid}
        # No salt named: the conversation's own namespace, so its rows are found.
        same = secured.post("/v1/responses", json=follow, headers=user).json()
        assert same["usage"]["input_tokens_details"]["cached_tokens"] > 0
        # Another salt is another namespace: nothing of this conversation is visible there.
        other = secured.post(
            "/v1/responses", json={**follow, "cache_salt": "s2"}, headers=user
        ).json()
        assert other["usage"]["input_tokens_details"]["cached_tokens"] == 0
        # Another tenant (the admin key names a different one) cannot see the response at all.
        admin = {"x-api-key": "root"}
        assert_error(secured.get(f"/v1/responses/{rid}", headers=admin), 404, "response_not_found")
        assert_error(
            secured.post("/v1/responses", json=follow, headers=admin),
            404,
            "previous_response_not_found",
        )
        assert_error(
            secured.delete(f"/v1/responses/{rid}", headers=admin), 404, "response_not_found"
        )
        items = f"/v1/responses/{rid}/input_items"
        assert_error(secured.get(items, headers=admin), 404, "response_not_found")
        assert secured.get(f"/v1/responses/{rid}", headers=user).status_code == 200
        assert (
            secured.get(items, headers=user).json()["data"][0]["content"][0]["text"]
            == (BASE["input"])
        )


@pytest.mark.parametrize("from_auth", [False, True])
def test_a_response_id_alone_never_opens_its_salt_to_a_keyless_follow_up(from_auth: bool) -> None:
    # Without a key naming the tenant, the salt is what a client must know to share a
    # namespace: a follow-up that does not present the conversation's salt must not run in it,
    # or whoever holds a response id could probe its maker's later turns by cached_tokens.
    with TestClient(create_app(stub_settings(cache_salt_from_auth=from_auth))) as fresh:
        wait_ready(fresh.get)
        first = fresh.post("/v1/responses", json={**BASE, "cache_salt": "alice"}).json()
        follow = {**BASE, "input": "More, fox?", "previous_response_id": first["id"]}
        # Another client's follow-up, naming no salt: the unsalted namespace (empty here).
        stranger = fresh.post("/v1/responses", json=follow).json()
        assert stranger["usage"]["input_tokens_details"]["cached_tokens"] == 0
        bob = fresh.post("/v1/responses", json=follow, headers={"X-Cache-Salt": "bob"}).json()
        assert bob["usage"]["input_tokens_details"]["cached_tokens"] == 0
        # The maker, presenting its salt, still resumes its conversation from the cache.
        own = fresh.post("/v1/responses", json={**follow, "cache_salt": "alice"}).json()
        resumed = own["usage"]["input_tokens_details"]["cached_tokens"]
        assert resumed >= first["usage"]["input_tokens"]


def test_retrieving_a_response_as_a_stream_is_a_400_naming_stream(client: TestClient) -> None:
    # OpenAI's resumable background streams are not served: the SDK's
    # responses.retrieve(id, stream=True) got the JSON body and read it as a stream of no
    # events, silently (found by review).
    sdk = openai.OpenAI(
        base_url="http://testserver/v1", api_key="k", http_client=client, max_retries=0
    )
    made = sdk.responses.create(model="a", input="hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as caught:
        list(sdk.responses.retrieve(made.id, stream=True))
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "stream"
    assert sdk.responses.retrieve(made.id).id == made.id
    assert client.get(f"/v1/responses/{made.id}", params={"stream": "false"}).status_code == 200
    missing = client.get("/v1/responses/resp_nope", params={"stream": "true"})
    assert_error(missing, 404, "response_not_found")
