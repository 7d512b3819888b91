"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Invariant: a request is translated (``translate.py``) and then runs the chat path every
chat-shaped API shares (``server/chat.py``): the same templates, tool planning, cache and
disconnect handling as ``/v1/chat/completions``. Errors on these paths are Anthropic-shaped
(``errors.ANTHROPIC_PATHS``).
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvwarm.server import chat, convert, tenancy
from kvwarm.server.anthropic import translate as anthropic
from kvwarm.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from kvwarm.server.errors import HTTPError
from kvwarm.server.generate import SSE_HEADERS, Generation, named_sse, start_stream
from kvwarm.server.schemas import check_count, json_body, parse_body, read_json
from kvwarm.server.served import ServedModel
from kvwarm.server.state import server_state
from kvwarm.server.tools import ChatPlan
from kvwarm.settings import Settings

router = APIRouter()


async def _plan(
    model: ServedModel, req: CountTokensRequest, settings: Settings
) -> tuple[ChatPlan, str]:
    """The chat plan and assistant prefill of a request: one translation for both routes, so
    ``count_tokens`` counts what ``messages`` would render."""
    anthropic.refuse(req)
    history, prefill = anthropic.to_chat(req)
    tools = anthropic.tools(req.tools)
    choice = anthropic.tool_choice(req.tool_choice, tools)
    parallel = req.tool_choice is None or not req.tool_choice.disable_parallel_tool_use
    plan = await chat.plan(model, history, tools, choice, parallel=parallel, settings=settings)
    return plan, prefill


@router.post(
    "/v1/messages",
    openapi_extra=json_body(MessagesRequest, streams=True) | tenancy.openapi_header(),
)
async def messages(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request, state.settings)
    check_count(body, "messages", state.settings.max_chat_messages, "max_chat_messages")
    req = parse_body(body, MessagesRequest)
    model, lora = await state.acquire_generation(req.model, keep_alive=req.keep_alive)
    plan, prefill = await _plan(model, req, state.settings)
    schema = anthropic.output_schema(req)
    if plan.json_schema is not None and schema is not None:
        raise HTTPError(
            400,
            "tool_choice any/tool cannot be combined with an output format",
            code="unsupported_parameter",
            param="output_config.format",
        )
    if schema is not None and prefill:
        # The grammar holds the reply from its first token, but the client reads the
        # prefill and the reply as one text: a JSON prefill was followed by a whole JSON
        # document of its own (invalid JSON, silently; found by review). llama.cpp aborts
        # on a grammar fed a token it refuses, so the prefill cannot be fed to it either.
        raise HTTPError(
            400,
            "a trailing assistant message (a prefill) cannot be combined with an output "
            "format: the format constrains the whole reply; drop the prefill",
            code="invalid_value",
            param="messages",
        )
    fields = chat.sampling_fields(
        max_tokens=req.max_tokens,
        param="max_tokens",
        limit=state.settings.max_tokens_limit,
        over_limit=state.settings.max_tokens_over_limit,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences,
        spec_type=req.spec_type,
        spec_draft_max=req.spec_draft_max,
    )
    salt = tenancy.cache_salt(request, req.cache_salt, state.settings)
    opts = convert.options(
        fields,
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_limit=state.settings.max_tokens_limit,
        over_limit=state.settings.max_tokens_over_limit,
        json_schema=plan.json_schema or schema,
        cache_salt=salt,
        lora=lora,
        names={"stop": "stop_sequences", **req.sent_as()},
        calls=await chat.call_grammar(plan, whole=schema is not None, cache_salt=salt),
        preserved=plan.preserved,
    )
    stream = await start_stream(chat.submit(model, plan, opts, prefill), req.sent_as())
    user = req.metadata.user_id if req.metadata is not None else None
    gen = Generation(request, stream, "messages", model.id, state, user=user)
    msg_id = anthropic.new_id("msg")
    name = state.lora.reply_name(req.model, model)
    if not req.stream:
        reply = await chat.whole_reply(gen, plan)
        return JSONResponse(anthropic.message(msg_id, name, reply, opts.max_tokens))
    await gen.open_streaming()
    events = anthropic.MessageEvents(msg_id, name, opts.max_tokens, len(stream.prompt_tokens))
    body = anthropic.stream_events(events, chat.streamed_reply(gen, plan))
    return StreamingResponse(
        named_sse(body, gen.close, anthropic.stream_error),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
async def count_tokens(request: Request) -> Response:
    """The prompt's token count as ``/v1/messages`` would render it (nothing is generated)."""
    state = server_state(request)
    body = await read_json(request, state.settings)
    check_count(body, "messages", state.settings.max_chat_messages, "max_chat_messages")
    req = parse_body(body, CountTokensRequest)
    model = await state.acquire(req.model)
    plan, prefill = await _plan(model, req, state.settings)

    def count() -> int:
        return model.count_chat_tokens(plan.messages, tools=plan.tools, prefill=prefill)

    return JSONResponse({"input_tokens": await run_in_threadpool(count)})
