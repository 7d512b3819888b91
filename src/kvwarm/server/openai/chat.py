"""``/v1/chat/completions``: tools planned, ``n`` choices prefilled once, streamed or not;
llama-server's ``/apply-template``, the prompt such a chat sends.

Invariants: as every route (``server/generate.py``: the event loop never blocks on the engine).
Streamed choices interleave as their tokens arrive, each chunk naming its choice ``index``; each
choice's deltas follow ``ChatChoiceStream`` below (content, logprobs with it, tool calls as
OpenAI streams them).

One streamed chat choice: engine fragments in, the ``delta`` chunks OpenAI streams out.

Invariants: the content deltas, concatenated, are the content a non-streamed response gives;
the logprobs of every generated token go out exactly once, with the content they belong to (a
token whose text is held back, by the engine or by the tool-call filter, sends its logprob
with the text that follows it, or with the last chunk); tool calls go out as the tool-call
filter (``tool_stream``) reports them, in the order the model wrote them: text after a call
is content too, joined as the non-streamed ``content`` joins it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvwarm.engine.request import Fragment
from kvwarm.engine.types import Completion, TokenLogprob
from kvwarm.server import chat, convert, tenancy
from kvwarm.server.errors import HTTPError
from kvwarm.server.generate import SSE_HEADERS, sse
from kvwarm.server.openai.choices import Choices, group_stats
from kvwarm.server.schemas import (
    ChatRequest,
    check_count,
    check_sampling,
    json_body,
    lora_pairs,
    parse_body,
    read_json,
    refuse_moderation,
)
from kvwarm.server.served import ServedModel
from kvwarm.server.state import server_state
from kvwarm.server.tool_stream import ContentJoin, ToolStream, call_delta
from kvwarm.server.tools import ChatPlan, Part, ToolCall
from kvwarm.settings import Settings

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    openapi_extra=json_body(ChatRequest, streams=True) | tenancy.openapi_header(),
)
async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    raw = await read_json(request, state.settings)
    check_count(raw, "messages", state.settings.max_chat_messages, "max_chat_messages")
    req = parse_body(raw, ChatRequest)
    check_sampling(req)
    for legacy in ("functions", "function_call"):
        if getattr(req, legacy) is not None:
            raise HTTPError(
                400,
                f"{legacy} (OpenAI's deprecated function calling) is not supported: "
                "use tools and tool_choice",
                code="unsupported_parameter",
                param=legacy,
            )
    if req.best_of is not None:
        raise HTTPError(
            400,
            "best_of is a /v1/completions parameter; chat completions have no best_of "
            "(as OpenAI's): ask for n choices",
            code="unsupported_parameter",
            param="best_of",
        )
    other = [m for m in req.modalities or () if m != "text"]
    if other:
        raise HTTPError(
            400,
            f"modalities {other[0]!r} is not supported: kvwarm replies in text only",
            param="modalities",
            code="unsupported_parameter",
        )
    if req.audio is not None:
        raise HTTPError(
            400,
            "audio output is not supported: kvwarm replies in text only",
            param="audio",
            code="unsupported_parameter",
        )
    refuse_moderation(req.moderation)
    if req.top_logprobs and not req.logprobs:
        # OpenAI's rule; the request would otherwise get no logprobs at all, silently.
        raise HTTPError(
            400,
            "top_logprobs needs logprobs set to true",
            code="invalid_value",
            param="top_logprobs",
        )
    model, lora = await state.acquire_generation(
        req.model, keep_alive=req.keep_alive, lora=lora_pairs(req.lora)
    )
    schema = convert.response_schema(req.response_format)
    plan = await _plan(model, req, state.settings)
    if plan.json_schema is not None and schema is not None:
        raise HTTPError(
            400,
            "tool_choice required/named cannot be combined with response_format",
            code="unsupported_parameter",
            param="response_format",
        )
    salt = tenancy.cache_salt(request, req.cache_salt, state.settings)
    opts = convert.options(
        req,
        default_max_tokens=state.settings.default_max_tokens,
        max_tokens_limit=state.settings.max_tokens_limit,
        over_limit=state.settings.max_tokens_over_limit,
        # OpenAI's (and vLLM's) rule: max_completion_tokens wins over the legacy max_tokens.
        max_tokens=(
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        ),
        json_schema=plan.json_schema or schema,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        cache_salt=salt,
        lora=lora,
        calls=await chat.call_grammar(
            plan, whole=schema is not None or req.grammar is not None, cache_salt=salt
        ),
        preserved=plan.preserved,
        prediction=req.prediction.text() if req.prediction is not None else None,
    )
    choices = await Choices.start(
        request,
        lambda: model.chat_streams(
            plan.messages, n=req.n, tools=plan.tools, options=opts, fragments=req.stream
        ),
        "chat",
        model.id,
        state,
        user=req.user,
        # The prompt is the messages: a prompt too long names them, as OpenAI's error does.
        names={"prompt": "messages", **req.sent_as()},
    )
    ids = convert.ResponseIds("chatcmpl", state.lora.reply_name(req.model, model))
    if not req.stream:
        async with choices:
            results = await choices.results()
        body: list[dict[str, object]] = []
        for index, done in enumerate(results):
            content, calls = plan.split(done.text)
            shown = content if content or not calls else None
            body.append(convert.chat_choice(index, done, shown, calls))
        stats = group_stats([r.stats for r in results])
        return JSONResponse(convert.chat_response(ids, body, stats))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    await choices.open_streaming()
    events = _events(choices, ids, plan, bool(req.logprobs), include_usage)
    return StreamingResponse(
        sse(events, choices.close), media_type="text/event-stream", headers=SSE_HEADERS
    )


@router.post("/apply-template", openapi_extra=json_body(ChatRequest))
async def apply_template(request: Request) -> Response:
    """llama-server's ``/apply-template``: a chat completion's body, answered with the prompt
    text that chat would send the model (its tools planned as the chat plans them), running
    nothing."""
    state = server_state(request)
    raw = await read_json(request, state.settings)
    check_count(raw, "messages", state.settings.max_chat_messages, "max_chat_messages")
    req = parse_body(raw, ChatRequest)
    model = await state.acquire(req.model)
    plan = await _plan(model, req, state.settings)
    _, text = await run_in_threadpool(model.chat_tokens, plan.messages, tools=plan.tools)
    return JSONResponse({"prompt": text})


#: The roles whose messages OpenAI requires content of: an assistant's may have none (its
#: calls, or its ``refusal``, are what it said), as may a deprecated ``function`` result.
_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool"})


async def _plan(model: ServedModel, req: ChatRequest, settings: Settings) -> ChatPlan:
    """The chat's messages and tools as the model is sent them (``server/chat.py``). A message
    without content where OpenAI requires it is a 400, as OpenAI's (found by review: a user
    message with ``content: null``, or none, was rendered as an empty turn)."""
    for i, message in enumerate(req.messages):
        if message.content is None and message.role in _CONTENT_REQUIRED:
            raise HTTPError(
                400,
                f"messages.{i}.content: a {message.role} message needs content (a string or "
                "a list of parts), not null",
                code="invalid_type",
                param=f"messages.{i}.content",
            )
    return await chat.plan(
        model,
        req.messages,
        req.tools,
        req.tool_choice,
        parallel=req.parallel_tool_calls,
        settings=settings,
    )


async def _events(
    choices: Choices,
    ids: convert.ResponseIds,
    plan: ChatPlan,
    logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[dict[str, object]]:
    n = len(choices.gens)
    streams = [
        ChatChoiceStream(plan.names, forced=plan.forced, single=plan.single, logprobs=logprobs)
        for _ in range(n)
    ]
    for index in range(n):
        # With tools, a reply may be calls alone, whose content is null (as llama-server's
        # first chunk, and OpenAI's for calls): a client's accumulated stream is the reply.
        role: dict[str, object] = {"role": "assistant", "content": None if plan.names else ""}
        yield convert.chat_chunk(ids, role, index=index, with_usage=include_usage)
    async for index, fragment in choices.merged():
        if fragment is None:
            deltas = streams[index].finish(await choices.gens[index].result())
        else:
            deltas = streams[index].feed(fragment)
        for d in deltas:
            yield convert.chat_chunk(
                ids, d.delta, d.finish, index=index, logprobs=d.logprobs, with_usage=include_usage
            )
    if include_usage:
        stats = group_stats([r.stats for r in await choices.results()])
        yield convert.usage_chunk(ids, "chat.completion.chunk", stats)


# --- One streamed chat choice: engine fragments in, the ``delta`` chunks OpenAI streams out.

Json = dict[str, object]


@dataclass(frozen=True, slots=True)
class Delta:
    """One chunk's choice: its delta, its logprobs (or None), its finish reason (or None)."""

    delta: Json
    logprobs: Json | None = None
    finish: str | None = None


class ChatChoiceStream:
    def __init__(
        self, names: frozenset[str], *, forced: bool, logprobs: bool, single: bool = False
    ) -> None:
        self._tools = ToolStream(names, forced=forced, single=single)
        self._content = ContentJoin()
        self._calls = 0
        self._want_logprobs = logprobs
        self._pending: list[TokenLogprob] = []
        self._fed_logprobs = False

    def feed(self, fragment: Fragment) -> list[Delta]:
        self._pending.extend(fragment.logprobs)
        self._fed_logprobs = self._fed_logprobs or bool(fragment.logprobs)
        return self._deltas(self._tools.feed(fragment.text))

    def _deltas(self, parts: list[Part]) -> list[Delta]:
        """The deltas of ``parts``, in order: content (with the logprobs held so far), calls."""
        out: list[Delta] = []
        for part in parts:
            text = self._content(part)
            if text:
                out.append(Delta({"content": text}, self._take_logprobs()))
            if isinstance(part, ToolCall):
                out.append(Delta({"tool_calls": [call_delta(self._calls, part)]}))
                self._calls += 1
        return out

    def finish(self, done: Completion) -> list[Delta]:
        rest, _ = self._tools.finish()
        out = self._deltas(rest)
        reason = convert.finish_reason(done.stats, self._tools.any_call)
        if not self._fed_logprobs and done.logprobs:
            # A stream whose fragments carry no logprobs (a cluster replica streams text only):
            # the completion's logprobs go out with the last chunk.
            self._pending = list(done.logprobs)
        out.append(Delta({}, self._take_logprobs() if self._pending else None, reason))
        return out

    def _take_logprobs(self) -> Json | None:
        if not self._want_logprobs:
            return None
        items, self._pending = self._pending, []
        return convert.chat_logprobs(items)
