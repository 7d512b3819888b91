"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``.

Invariants: a request is translated (``server/responses/translate.py``) and runs the chat path every
chat-shaped API shares (``server/chat.py``). A follow-up naming ``previous_response_id``
re-renders the stored conversation plus its new input and passes the previous reply's finish row
as ``parent_key``, so the engine waits for that row if its save is still in flight and restores
the conversation instead of prefilling it. It runs in the stored conversation's cache salt only
for the key's tenant that made it (``cache_salt_from_auth``); any other follow-up runs in the salt
it presents, so holding a response id never opens another salt's namespace. Only finished (not
cancelled) replies are stored, and only with ``store`` true.

``background: true`` (OpenAI's background mode; needs ``store``, not with ``stream``): the
request is checked and queued on its model as any other (its 4xx come from the ``POST``), then
the ``POST`` answers at once with status ``queued``; the generation runs on a task of the
server's, watched by no client (a client going away does not cancel it; the server's deadline,
``request_timeout_s``, and shutdown end it as any generation), ``GET`` shows it ``queued``,
``in_progress`` from its first token, then its final response, stored with status
``completed``, ``incomplete``, ``failed`` (with its ``error``) or ``cancelled``. ``POST
.../cancel`` cancels it (its slot freed, or it is taken out of its model's queue) and answers
once it has ended; on a background response already ended it answers it unchanged, on any
other response it is a 400. A failed or cancelled response cannot be continued
(``previous_response_id``: a 400), nor one still running.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvwarm.server import chat, convert, tenancy
from kvwarm.server.errors import HTTPError, kind_of
from kvwarm.server.generate import (
    SSE_HEADERS,
    Event,
    Generation,
    as_kvwarm,
    named_sse,
    start_stream,
)
from kvwarm.server.guard import presented_key
from kvwarm.server.responses import translate as responses
from kvwarm.server.responses.schemas import ResponsesRequest
from kvwarm.server.responses.store import Pending, StoredResponse
from kvwarm.server.schemas import (
    ChatMessage,
    check_count,
    json_body,
    parse_body,
    read_json,
    refuse_moderation,
)
from kvwarm.server.state import ServerState, server_state
from kvwarm.server.tools import ChatPlan
from kvwarm.settings import Settings

router = APIRouter()

Json = dict[str, object]


def _not_found(response_id: str, param: str | None = None) -> HTTPError:
    return HTTPError(
        404,
        f"Response with id {response_id!r} not found.",
        code="previous_response_not_found" if param else "response_not_found",
        param=param,
    )


def _owner(request: Request, settings: Settings) -> str | None:
    """The tenant a request speaks for, when keys name tenants (``cache_salt_from_auth``)."""
    token = presented_key(request.headers)
    return tenancy.tenant_id(token) if settings.cache_salt_from_auth and token else None


def _lookup(request: Request, response_id: str, param: str | None = None) -> StoredResponse:
    """A stored response of the requesting tenant (another tenant's is "not found")."""
    state = server_state(request)
    found = state.responses.get(response_id)
    if found is None or found.owner != _owner(request, state.settings):
        if param is not None and _find(request, response_id) is not None:
            raise HTTPError(  # a background response still running: nothing to continue yet
                400,
                f"Response with id {response_id!r} is still running (background); wait until "
                "it has completed to continue it.",
                code="invalid_value",
                param=param,
            )
        raise _not_found(response_id, param)
    return found


def _find(request: Request, response_id: str) -> StoredResponse | Pending | None:
    """The requesting tenant's response ``response_id``, stored or running in the
    background (another tenant's is None)."""
    state = server_state(request)
    running = state.responses.running(response_id)
    if running is not None and running.deleted:
        # Deleted: gone to every route at once, though its generation may still be winding
        # down (found by review: GET showed it queued, DELETE and cancel took it again).
        return None
    found: StoredResponse | Pending | None = running
    if found is None:
        found = state.responses.get(response_id)
    if found is None or found.owner != _owner(request, state.settings):
        return None
    return found


def _found(request: Request, response_id: str) -> StoredResponse | Pending:
    found = _find(request, response_id)
    if found is None:
        raise _not_found(response_id)
    return found


@dataclass(frozen=True, slots=True)
class _Turn:
    """What a finished reply is stored with."""

    history: list[ChatMessage]
    cache_salt: str | None
    owner: str | None
    input_items: tuple[Json, ...]

    def keep(
        self, state: ServerState, shape: responses.ResponseShape, reply: chat.ChatReply, text: str
    ) -> dict[str, object]:
        body = shape.final(reply, text)
        if reply.done.stats.finish_reason != "cancelled":
            state.responses.put(self.stored(shape, body, reply, text))
        return body

    def stored(
        self,
        shape: responses.ResponseShape,
        body: Json,
        reply: chat.ChatReply | None = None,
        text: str = "",
    ) -> StoredResponse:
        """The response as stored: with its reply's turn and finish row, or (a background
        response that failed or was cancelled: ``reply`` None) its input turns alone."""
        turns = (*self.history, responses.reply_turn(reply, text)) if reply else self.history
        key = reply.done.stats.key if reply else None
        return StoredResponse(
            shape.id,
            shape.model_id,
            tuple(turns),
            key,
            body,
            self.cache_salt,
            self.owner,
            self.input_items,
        )


@router.post(
    "/v1/responses",
    openapi_extra=json_body(ResponsesRequest, streams=True) | tenancy.openapi_header(),
)
async def create_response(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request, state.settings)
    check_count(body, "input", state.settings.max_chat_messages, "max_chat_messages")
    req = parse_body(body, ResponsesRequest)
    given = body.get("input") if isinstance(body, dict) else None
    for field, instead in (("conversation", "previous_response_id"), ("prompt", "instructions")):
        if getattr(req, field) is not None:
            raise HTTPError(
                400,
                f"{field}: OpenAI's stored {field}s are not supported by this server; use "
                f"{instead} instead",
                code="unsupported_parameter",
                param=field,
            )
    refuse_moderation(req.moderation)
    if req.background and not req.store:
        raise HTTPError(
            400,
            "background mode needs store: a background response is polled from the store "
            "(GET /v1/responses/{id}); set store to true",
            code="invalid_value",
            param="background",
        )
    if req.background and req.stream:
        raise HTTPError(
            400,
            "background with stream is not supported by this server: create it without "
            "stream and poll GET /v1/responses/{id}",
            code="unsupported_parameter",
            param="stream",
        )
    previous = None
    if req.previous_response_id is not None:
        previous = _lookup(request, req.previous_response_id, "previous_response_id")
        if not previous.continuable:
            raise HTTPError(
                400,
                f"Response with id {req.previous_response_id!r} {previous.body.get('status')}: "
                "it has no reply to continue from",
                code="invalid_value",
                param="previous_response_id",
            )
    # A key's tenant (``owner``, checked by ``_lookup``) continues in its conversation's
    # namespace unless it names a salt itself: every salt under its key is its own. Without a
    # key, knowing a salt is what shares its namespace, so a follow-up runs in the salt it
    # presents: a response id alone never opens another salt to cached_tokens probes.
    salt = tenancy.cache_salt(request, req.cache_salt, state.settings)
    if (
        previous is not None
        and previous.owner is not None
        and tenancy.explicit_salt(request, req.cache_salt) is None
    ):
        salt = previous.cache_salt
    history = [*(previous.conversation if previous else ()), *responses.to_history(req.input)]
    limit = state.settings.max_chat_messages
    if len(history) > limit:
        # Found by review: the input's own count was checked, not the conversation it
        # continues, which grew by each turn's input and reply without bound (each turn's
        # prompt fitting the context: on a long-context model tens of thousands of messages
        # rendered and tokenized at every turn).
        raise HTTPError(
            400,
            f"the conversation holds {len(history)} messages with previous_response_id's, "
            f"more than this server's limit of {limit} (setting max_chat_messages); start a "
            "new conversation",
            param="previous_response_id",
            code="invalid_value",
        )
    if previous is not None and req.store:
        # Found by review: the store keeps a response larger than its bound (a client's one
        # big request), and each follow-up's holds its whole conversation and input items,
        # some in no prompt (a reasoning item's summary: no context bound), so a chain grew
        # one stored response past any bound, max_body_bytes a turn.
        grown = state.responses.chars(previous) + 2 * len(json.dumps(given))
        if grown > state.responses.max_chars:
            raise HTTPError(
                400,
                f"the conversation with previous_response_id's would hold about {grown:,} "
                "characters, more than this server's response store keeps "
                f"({state.responses.max_chars:,}); start a new conversation",
                param="previous_response_id",
                code="invalid_value",
            )
    items: tuple[Json, ...] = ()
    if req.store:
        # As OpenAI's: the items used to generate this response, so a follow-up's list holds
        # the earlier turns too (their inputs and outputs), then its own input.
        earlier = (*previous.input_items, *_output_items(previous.body)) if previous else ()
        items = _unique_ids(earlier, responses.input_items(given))
    requested = req.model or (previous.model_id if previous else None)
    model, lora = await state.acquire_generation(requested, keep_alive=req.keep_alive)
    tools = responses.tools(req.tools)
    messages = responses.with_instructions(req.instructions, history)
    choice = responses.tool_choice(req.tool_choice)
    plan = await chat.plan(
        model, messages, tools, choice, parallel=req.parallel_tool_calls, settings=state.settings
    )
    schema = responses.text_schema(req.text)
    if plan.json_schema is not None and schema is not None:
        raise HTTPError(
            400,
            "tool_choice required/named cannot be combined with text.format",
            code="unsupported_parameter",
            param="text",
        )
    fields = chat.sampling_fields(
        max_tokens=req.max_output_tokens,
        param="max_output_tokens",
        limit=state.settings.max_tokens_limit,
        over_limit=state.settings.max_tokens_over_limit,
        temperature=req.temperature,
        top_p=req.top_p,
        spec_type=req.spec_type,
        spec_draft_max=req.spec_draft_max,
    )
    opts = convert.options(
        fields,
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_limit=state.settings.max_tokens_limit,
        over_limit=state.settings.max_tokens_over_limit,
        json_schema=plan.json_schema or schema,
        logprobs=responses.wanted_logprobs(req),
        cache_salt=salt,
        lora=lora,
        calls=await chat.call_grammar(plan, whole=schema is not None, cache_salt=salt),
        preserved=plan.preserved,
        names=req.sent_as(),
    )
    opts = chat.with_parent(opts, previous.key if previous else None)
    # The prompt is the input (a prompt too long names it, not chat's ``prompt``).
    stream = await start_stream(
        chat.submit(model, plan, opts), {"prompt": "input", **req.sent_as()}
    )
    # A background response's generation is watched by no client: it outlives the POST.
    watch = not req.background
    gen = Generation(request, stream, "responses", model.id, state, watch=watch, user=req.user)
    # An adapter's name, when one was asked for: a follow-up naming no model stays on it.
    shape = responses.ResponseShape(req, state.lora.reply_name(requested, model))
    turn = _Turn(history, salt, _owner(request, state.settings), items)
    if req.background:
        return JSONResponse(_start_background(state, gen, plan, shape, turn))
    if not req.stream:
        reply = await chat.whole_reply(gen, plan)
        if req.store:
            return JSONResponse(turn.keep(state, shape, reply, reply.content))
        return JSONResponse(shape.final(reply, reply.content))
    await gen.open_streaming()
    events = responses.ResponseEvents(shape)

    async def body_events() -> AsyncIterator[Event]:
        replies = chat.streamed_reply(gen, plan, events.logprobs)
        async for name, data in responses.stream_events(events, replies):
            if name in ("response.completed", "response.incomplete") and req.store:
                assert events.reply is not None
                turn.keep(state, shape, events.reply, events.text)
            yield name, data

    return StreamingResponse(
        named_sse(body_events(), gen.close, events.error),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


def _unique_ids(earlier: tuple[Json, ...], own: list[Json]) -> tuple[Json, ...]:
    """The items a response lists (``earlier``, then its input's ``own``), each id once, or a
    400 naming the input item whose id is taken (as OpenAI's: "Duplicate item found"). Found
    by review: ``input_items`` pages by id, and a cursor naming an id held twice found the
    first, so paging past it returned the second again, for ever."""
    seen = {item.get("id") for item in earlier}
    for at, item in enumerate(own):
        ident = item.get("id")
        if ident in seen:
            raise HTTPError(
                400,
                f"Duplicate item found with id {ident!r}: an item of this input, or of the "
                "conversation it continues (previous_response_id), has it already; remove "
                "duplicate items from the input",
                code="invalid_value",
                param=f"input.{at}.id",
            )
        seen.add(ident)
    return (*earlier, *own)


def _start_background(
    state: ServerState,
    gen: Generation,
    plan: ChatPlan,
    shape: responses.ResponseShape,
    turn: _Turn,
) -> Json:
    """Run ``gen`` on a task of the server's as the background response ``shape`` (pending
    in the store until it ends); its body as ``POST`` answers it (status ``queued``)."""
    pending = Pending(
        shape.id, turn.owner, shape.body("queued", []), turn.input_items, gen.stream.cancel
    )
    # Its model stays leased until it ends (the POST's lease ends with the POST): its
    # keep_alive counts from its end, as a synchronous request's does.
    release = state.registry.hold(gen.model_id)
    state.responses.start(pending)
    task = asyncio.ensure_future(_run_background(state, gen, plan, shape, turn, pending, release))
    task.add_done_callback(lambda _: release())  # also if it never ran (the loop closed)
    state.background.add(task)
    task.add_done_callback(state.background.discard)
    return pending.body


async def _run_background(
    state: ServerState,
    gen: Generation,
    plan: ChatPlan,
    shape: responses.ResponseShape,
    turn: _Turn,
    pending: Pending,
    release: Callable[[], None],
) -> None:
    """A background response's generation, to its final response in the store; then its
    model's lease is released (``release``)."""
    stored: StoredResponse | None = None
    try:
        try:
            await gen.prime()  # its first token (or its end): it is running
            if not pending.cancelled:
                pending.body = shape.body("in_progress", [])
            reply = await chat.whole_reply(gen, plan)
        finally:
            gen.close()  # its slot is free whatever ended it
    except Exception as exc:
        error = as_kvwarm(exc)  # a bug is logged there, with its traceback
        body = shape.body("failed", [])
        body["error"] = {"code": kind_of(error).code, "message": str(error) or type(error).__name__}
        stored = turn.stored(shape, body)
    else:
        if reply.done.stats.finish_reason == "cancelled":
            stored = turn.stored(shape, shape.cancelled(reply))
        else:
            body = shape.final(reply, reply.content)
            stored = turn.stored(shape, body, reply, reply.content)
    finally:
        if stored is None:  # cancelled itself (the loop closing): nobody polls any more
            stored = turn.stored(shape, shape.body("cancelled", []))
        release()
        state.responses.finish(pending, stored)


#: How long ``POST .../cancel`` waits for a background response's generation to end: between
#: two tokens (a running one), or at once (a queued one); past it, it answers ``cancelled``
#: and the generation ends on its own.
CANCEL_WAIT_S = 30.0


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    """OpenAI's ``responses.cancel``: a background response still running is cancelled (its
    generation ended, its slot freed) and answered once it has ended, status ``cancelled``
    (or how it ended, if it ended first); one that has ended is answered unchanged. Any other
    response is a 400: only background responses can be cancelled."""
    found = _found(request, response_id)
    if isinstance(found, Pending):
        found.cancelled = True
        found.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(found.ended.wait()), CANCEL_WAIT_S)
        except TimeoutError:
            return JSONResponse({**found.body, "status": "cancelled"})
        found = _found(request, response_id)
    if isinstance(found, Pending) or not found.body.get("background"):
        raise HTTPError(
            400,
            f"Response with id {response_id!r} was not created with background: only "
            "background responses can be cancelled.",
            code="invalid_value",
            param="response_id",
        )
    return JSONResponse(found.body)


def _output_items(body: Json) -> list[Json]:
    """A stored response's ``output`` items (each with its ``id``)."""
    output = body.get("output")
    return [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    """A stored response, or a background one as it stands (``queued``, ``in_progress``).
    ``stream=true`` (the SDK's ``responses.retrieve(id, stream=True)``, OpenAI's resumable
    background stream) is a 400: answered as JSON, the SDK read it as a stream of no events,
    silently (found by review)."""
    found = _found(request, response_id)
    stream = request.query_params.get("stream")
    if stream is not None and stream.lower() != "false":
        raise HTTPError(
            400,
            "stream: streaming a response again (OpenAI's resumable background streams) is "
            "not supported by this server; GET it without stream and poll its status",
            code="unsupported_parameter",
            param="stream",
        )
    return JSONResponse(found.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    """Forget a stored response; a background one still running is cancelled and then not
    stored."""
    found = _found(request, response_id)
    if isinstance(found, Pending):
        found.deleted = found.cancelled = True
        found.cancel()
    server_state(request).responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


_MAX_LIST_LIMIT = 100


def _list_limit(raw: str | None) -> int:
    if raw is None:
        return 20
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_LIST_LIMIT:
        raise HTTPError(
            400,
            f"limit must be an integer from 1 to {_MAX_LIST_LIMIT}, not {raw!r}",
            code="invalid_value",
            param="limit",
        )
    return limit


def _cursor(items: list[Json], param: str, value: str | None) -> int | None:
    """The position of the item ``value`` names (``after``/``before``); a 400 if none does."""
    if value is None:
        return None
    for at, item in enumerate(items):
        if item.get("id") == value:
            return at
    raise HTTPError(
        400,
        f"{param}: no input item of this response has id {value!r}",
        code="invalid_value",
        param=param,
    )


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str) -> Response:
    """OpenAI's ``responses.input_items.list``: the items used to generate the response (after
    ``previous_response_id``, the earlier turns' inputs and outputs first), a page at a
    time (``order`` desc by default, ``limit`` 1-100, default 20, ``after``/``before`` item
    ids), for the tenant that made the response only."""
    found = _found(request, response_id)
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise HTTPError(
            400,
            f"order must be 'asc' or 'desc', not {order!r}",
            code="invalid_value",
            param="order",
        )
    limit = _list_limit(query.get("limit"))
    items = list(found.input_items)
    if order == "desc":
        items.reverse()
    after = _cursor(items, "after", query.get("after"))
    before = _cursor(items, "before", query.get("before"))
    window = items[(after + 1 if after is not None else 0) : before]
    page = window[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(window) > limit,
        }
    )
