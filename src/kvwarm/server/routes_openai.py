"""The OpenAI-compatible endpoints: completions, chat completions, embeddings, models.

Invariant: handlers never block the event loop on the engine: blocking calls (template
rendering, tokenizing, embedding) run in the thread pool and generation is awaited through the
engine's async stream. Each generation runs inside a ``Generation`` so a disconnect cancels it.
"""

from __future__ import annotations

import base64
import functools
import struct
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvwarm.engine.types import Completion
from kvwarm.server import convert, tenancy
from kvwarm.server.errors import HTTPError
from kvwarm.server.generate import Generation, request_log, sse, start_stream
from kvwarm.server.schemas import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Tool,
    json_body,
    parse_body,
    read_json,
)
from kvwarm.server.state import ServerState
from kvwarm.server.tools import ToolStream, openai_tools, parse_tool_calls, plan_chat

if TYPE_CHECKING:
    from kvwarm.server.served import ServedModel

router = APIRouter()

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def server_state(request: Request) -> ServerState:
    state = request.app.state.kvwarm
    assert isinstance(state, ServerState)
    return state


def renders_tools(model: ServedModel, tools: Sequence[Tool]) -> bool:
    """Whether the model's template shows the tools it is given (native tool support)."""
    probe: list[dict[str, object]] = [{"role": "user", "content": "hi"}]
    try:
        with_tools = model.apply_chat_template(probe, tools=openai_tools(tools))
    except Exception:  # a template that chokes on tools does not support them
        return False
    without = model.apply_chat_template(probe)
    return any(t.function.name in with_tools and t.function.name not in without for t in tools)


# --- /v1/chat/completions --------------------------------------------------------------------


@router.post(
    "/v1/chat/completions", openapi_extra=json_body(ChatRequest) | tenancy.openapi_header()
)
async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), ChatRequest)
    model = state.model(req.model)
    schema = convert.response_schema(req.response_format)
    native = False
    if req.tools and req.tool_choice != "none":
        native = await run_in_threadpool(renders_tools, model, req.tools)
    plan = plan_chat(req.messages, req.tools, req.tool_choice, renders_tools=native)
    if plan.json_schema is not None and schema is not None:
        raise HTTPError(
            400,
            "tool_choice required/named cannot be combined with response_format",
            param="response_format",
        )
    opts = convert.options(
        req,
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_limit=state.settings.max_tokens_limit,
        # OpenAI's (and vLLM's) rule: max_completion_tokens wins over the legacy max_tokens.
        max_tokens=(
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        ),
        json_schema=plan.json_schema or schema,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        cache_salt=tenancy.cache_salt(request, req.cache_salt, state.settings),
    )
    stream = await start_stream(
        lambda: model.stream_chat(plan.messages, tools=plan.tools, options=opts)
    )
    ids = convert.ResponseIds("chatcmpl", model.id)
    gen = Generation(request, stream, "chat", model.id, state)
    if not req.stream:
        async with gen:
            done = await gen.result()
        content, calls = parse_tool_calls(done.text, plan.names)
        body = convert.chat_response(ids, done, content if content or not calls else None, calls)
        return JSONResponse(body)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    await gen.open_streaming()

    async def events() -> AsyncIterator[dict[str, object]]:
        role: dict[str, object] = {"role": "assistant", "content": ""}
        yield convert.chat_chunk(ids, role, with_usage=include_usage)
        filt = ToolStream(plan.names, forced=plan.forced)
        async for fragment in gen.fragments():
            text = filt.feed(fragment)
            if text:
                yield convert.chat_chunk(ids, {"content": text}, with_usage=include_usage)
        done = await gen.result()
        rest, calls = filt.finish()
        if rest:
            yield convert.chat_chunk(ids, {"content": rest}, with_usage=include_usage)
        if calls:
            delta: dict[str, object] = {"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]}
            yield convert.chat_chunk(ids, delta, with_usage=include_usage)
        reason = convert.finish_reason(done.stats, calls)
        yield convert.chat_chunk(ids, {}, reason, with_usage=include_usage)
        if include_usage:
            yield convert.usage_chunk(ids, "chat.completion.chunk", done.stats)

    return StreamingResponse(
        sse(events(), gen.close), media_type="text/event-stream", headers=_SSE_HEADERS
    )


# --- /v1/completions -------------------------------------------------------------------------


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise HTTPError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    out: list[str | list[int]] = []
    for p in prompt:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list):
            out.append(list(p))
    return out


@router.post(
    "/v1/completions", openapi_extra=json_body(CompletionRequest) | tenancy.openapi_header()
)
async def completions(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), CompletionRequest)
    model = state.model(req.model)
    prompts = _prompts(req.prompt)
    if req.stream and len(prompts) > 1:
        raise HTTPError(400, "streaming supports one prompt per request", param="prompt")
    opts = convert.options(
        req,
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_limit=state.settings.max_tokens_limit,
        json_schema=convert.response_schema(req.response_format),
        logprobs=req.logprobs,
        cache_salt=tenancy.cache_salt(request, req.cache_salt, state.settings),
    )
    ids = convert.ResponseIds("cmpl", model.id)

    async def echo_text(prompt: str | list[int]) -> str:
        if not req.echo:
            return ""
        if isinstance(prompt, str):
            return prompt
        return await run_in_threadpool(model.detokenize, prompt)

    if not req.stream:
        choices: list[dict[str, object]] = []
        results: list[Completion] = []
        for index, prompt in enumerate(prompts):
            # Not streamed: no per-token events needed (spares the event loop a wake-up each).
            stream = await start_stream(functools.partial(model.submit, prompt, opts))
            async with Generation(request, stream, "completion", model.id, state) as gen:
                done = await gen.result()
            if gen.disconnected:
                break
            echo = await echo_text(prompt)
            choices.append(convert.text_choice(index, echo + done.text, done, len(echo)))
            results.append(done)
        if not results:
            return Response(status_code=499)
        stats = convert.sum_stats([r.stats for r in results])
        body = {
            **ids.head("text_completion"),
            "choices": choices,
            "usage": convert.usage(stats),
            "timings": convert.timings(stats),
        }
        return JSONResponse(body)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    stream = await start_stream(lambda: model.stream(prompts[0], opts))
    gen = Generation(request, stream, "completion", model.id, state)
    await gen.open_streaming()

    async def events() -> AsyncIterator[dict[str, object]]:
        echo = await echo_text(prompts[0])
        if echo:
            yield convert.text_chunk(ids, echo, None, with_usage=include_usage)
        async for fragment in gen.fragments():
            yield convert.text_chunk(ids, fragment, None, with_usage=include_usage)
        done = await gen.result()
        reason = convert.finish_reason(done.stats)
        yield convert.text_chunk(ids, "", reason, with_usage=include_usage)
        if include_usage:
            yield convert.usage_chunk(ids, "text_completion", done.stats)

    return StreamingResponse(
        sse(events(), gen.close), media_type="text/event-stream", headers=_SSE_HEADERS
    )


# --- /v1/embeddings, /v1/models --------------------------------------------------------------


@router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))
async def embeddings(request: Request) -> Response:
    state = server_state(request)
    req = parse_body(await read_json(request, state.settings), EmbeddingRequest)
    model = state.model(req.model)
    raw = req.input
    # Token ids go to the model as they are: no detokenize / re-tokenize round trip.
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [[x for x in raw if isinstance(x, int)]]
    else:
        items = [x for x in raw if isinstance(x, str | list)]
    if not items:
        raise HTTPError(400, "input must not be empty", param="input")

    def work() -> tuple[list[list[float]], int]:
        vectors = model.embed(items)
        n_tokens = sum(len(model.tokenize(x)) if isinstance(x, str) else len(x) for x in items)
        return vectors, n_tokens

    vectors, n_tokens = await run_in_threadpool(work)
    data: list[dict[str, object]] = []
    for index, full in enumerate(vectors):
        cut = req.dimensions if req.dimensions and 0 < req.dimensions < len(full) else len(full)
        vector = full[:cut]
        encoded: list[float] | str = vector
        if req.encoding_format == "base64":
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    request_log.info(
        "embeddings model=%s inputs=%d prompt_tokens=%d", model.id, len(items), n_tokens
    )
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model.id,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )


def _model_item(state: ServerState, entry_id: str) -> dict[str, object]:
    entry = state.entries[entry_id]
    item: dict[str, object] = {
        "id": entry.id,
        "object": "model",
        "created": int(state.started),
        "owned_by": "kvwarm",
        "status": entry.state,
    }
    if entry.model is not None:
        info = entry.model.info()
        item["meta"] = {
            "path": info.path,
            "backend": info.backend,
            "n_ctx": info.n_ctx,
            "n_ctx_train": info.n_ctx_train,
            "n_vocab": info.n_vocab,
            "n_embd": info.n_embd,
            "n_parallel": info.n_parallel,
            "size": info.size_bytes,
            "description": info.description,
            "fingerprint": info.fingerprint,
            "chat_template": info.chat_template,
        }
    elif entry.error:
        item["error"] = entry.error
    return item


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = server_state(request)
    data = [_model_item(state, entry_id) for entry_id in state.entries]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> Response:
    """One model, as OpenAI's ``models.retrieve`` returns it; 404 ``model_not_found``."""
    state = server_state(request)
    if model_id not in state.entries:
        raise HTTPError(
            404, f"The model {model_id!r} does not exist", param="model", code="model_not_found"
        )
    return JSONResponse(_model_item(state, model_id))
