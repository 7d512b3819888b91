"""OpenAI Responses shapes <-> the shared chat path (``server/chat.py``).

Invariants:

- Input (a string, or message / function_call / function_call_output items) becomes the same
  ``ChatMessage`` list an OpenAI chat request would; ``instructions`` lead it as the system
  message and, as in OpenAI's API, are not carried into a follow-up.
- A reply's output is one ``message`` item (when it has text, or when it has nothing else:
  all its text, text after a call too, joined as chat's ``content``), then one
  ``function_call`` item per call; a stream emits exactly these items, with the same
  ids, before ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut
  the reply) carries the same object a non-streamed request returns.
- ``usage.input_tokens_details.cached_tokens`` counts the prompt tokens the cache restored,
  ``cache_write_tokens`` those prefilled and saved with the reply's row (Anthropic's
  ``cache_creation_input_tokens``).
- Asked for (``include`` "message.output_text.logprobs", or ``top_logprobs``), the output
  text's ``logprobs`` are the reply's tokens' (as chat's ``logprobs.content``); a stream's
  text deltas carry those of the tokens whose text they begin, its done events all of them.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Sequence

from kvwarm.engine.types import CompletionStats, TokenLogprob
from kvwarm.errors import KvwarmError
from kvwarm.server import convert
from kvwarm.server.chat import ChatReply
from kvwarm.server.chat import ToolChoice as ChatToolChoice
from kvwarm.server.errors import HTTPError, kind_of
from kvwarm.server.generate import Event
from kvwarm.server.responses.schemas import (
    AllowedToolsChoice,
    AudioPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    ImagePart,
    InputItem,
    ItemReference,
    MediaPart,
    MessageItem,
    RefusalPart,
    ResponsesRequest,
    TextConfig,
)
from kvwarm.server.schemas import (
    AllowedTools,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    ImageUrl,
    InputAudio,
    NamedToolChoice,
    NamedToolChoiceFunction,
    Tool,
    ToolCallIn,
)
from kvwarm.server.schemas import AllowedToolsChoice as ChatAllowedToolsChoice
from kvwarm.server.schemas import ContentPart as ChatPart
from kvwarm.server.tool_stream import ContentJoin
from kvwarm.server.tools import ToolCall

Json = dict[str, object]


def _content(content: str | Sequence[object], where: str) -> str | list[ChatPart]:
    """A message's content: its text, or (with images or audio) chat content parts, each
    naming where it was."""
    if isinstance(content, str):
        return content
    parts: list[ChatPart] = []
    for i, part in enumerate(content):
        at = f"{where}.{i}"
        chat: ChatPart
        if isinstance(part, MediaPart):
            raise HTTPError(
                400,
                f"{at}: content of type {part.type!r} is not supported (text, images, audio)",
                code="unsupported_content",
                param=at,
            )
        if isinstance(part, ImagePart):
            if part.image_url is None:
                raise HTTPError(
                    400,
                    f"{at}: an input_image needs image_url (stored files are not supported)",
                    code="unsupported_content",
                    param=at,
                )
            chat = ChatPart(type="image_url", image_url=ImageUrl(url=part.image_url))
        elif isinstance(part, AudioPart):
            audio = InputAudio(data=part.input_audio.data, format=part.input_audio.format)
            chat = ChatPart(type="input_audio", input_audio=audio)
        else:
            text = part.refusal if isinstance(part, RefusalPart) else getattr(part, "text", "")
            chat = ChatPart(type="text", text=text)
        chat._where = at
        parts.append(chat)
    if all(p.type == "text" for p in parts):
        return "".join(p.text or "" for p in parts)
    return parts


def to_history(given: str | Sequence[InputItem]) -> list[ChatMessage]:
    """The chat turns of ``input``; consecutive function calls join the assistant turn."""
    if isinstance(given, str):
        return [ChatMessage(role="user", content=given)]
    out: list[ChatMessage] = []
    for index, item in enumerate(given):
        where = f"input.{index}"
        if isinstance(item, MessageItem):
            content = _content(item.content, f"{where}.content")
            out.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallIn(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            # Text, or text and images in order (OpenAI's function_call_output may hold an
            # image, as chat's tool messages and Anthropic's tool_result blocks may).
            output = _content(item.output, f"{where}.output")
            out.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
        elif isinstance(item, ItemReference):
            raise HTTPError(
                400,
                f"{where}: item references are not supported; use previous_response_id",
                code="unsupported_item",
                param=where,
            )
        # ReasoningItem: an earlier turn's reasoning is not part of the prompt.
    if not out:
        raise HTTPError(
            400, "input has no message or function call item", code="invalid_value", param="input"
        )
    return out


_ITEM_ID_PREFIX = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "reasoning": "rs_",
}


def input_items(given: object) -> list[Json]:
    """A request's ``input`` (already validated by ``ResponsesRequest``) as the items
    ``GET /v1/responses/{id}/input_items`` lists: each with an ``id`` (the client's, else a new
    one), a message's text content as ``input_text`` parts (``output_text`` for an assistant's),
    in the order sent."""
    raw = [{"role": "user", "content": given}] if isinstance(given, str) else given
    out: list[Json] = []
    for value in raw if isinstance(raw, list) else []:
        if not isinstance(value, dict):
            continue
        item: Json = dict(value)
        kind = item.get("type") or "message"
        item["type"] = kind
        if kind == "message":
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
            item.setdefault("status", "completed")
        if not isinstance(item.get("id"), str) or not item["id"]:
            prefix = _ITEM_ID_PREFIX.get(str(kind), "item_")
            item["id"] = prefix + secrets.token_hex(16)
        out.append(item)
    return out


def with_instructions(
    instructions: str | None, history: Sequence[ChatMessage]
) -> list[ChatMessage]:
    system = [ChatMessage(role="system", content=instructions)] if instructions else []
    return [*system, *history]


def reply_turn(reply: ChatReply, text: str) -> ChatMessage:
    """The assistant turn a reply adds to the conversation (kept for a follow-up)."""
    calls = [
        ToolCallIn(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in reply.calls
    ]
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)


def tools(defs: Sequence[FunctionTool] | None) -> list[Tool] | None:
    if not defs:
        return None
    out: list[Tool] = []
    for i, tool in enumerate(defs):
        if tool.type != "function":
            raise HTTPError(
                400,
                f"tools.{i}: hosted tools ({tool.type!r}) are not supported; only function tools",
                code="unsupported_tool",
                param=f"tools.{i}.type",
            )
        if not tool.name:
            raise HTTPError(
                400,
                f"tools.{i}.name is required",
                code="invalid_type" if tool.name is None else "invalid_value",
                param=f"tools.{i}.name",
            )
        fn = FunctionDef(name=tool.name, description=tool.description, parameters=tool.parameters)
        out.append(Tool(function=fn))
    return out


def tool_choice(choice: str | FunctionChoice | AllowedToolsChoice | None) -> ChatToolChoice:
    if isinstance(choice, FunctionChoice):
        return NamedToolChoice(function=NamedToolChoiceFunction(name=choice.name))
    if isinstance(choice, AllowedToolsChoice):
        allowed = AllowedTools(mode=choice.mode, tools=choice.tools)
        return ChatAllowedToolsChoice(type="allowed_tools", allowed_tools=allowed)
    return choice


def text_schema(config: TextConfig | None) -> dict[str, object] | None:
    """The JSON schema ``text.format`` asks for (None: free text)."""
    fmt = config.format if config is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.schema_ is None:
        raise HTTPError(
            400,
            "text.format json_schema needs a schema",
            code="invalid_value",
            param="text.format.schema",
        )
    return fmt.schema_


def usage(stats: CompletionStats) -> Json:
    return {
        "input_tokens": stats.prompt_tokens,
        # cache_write_tokens: required by OpenAI's schema (the SDK's ``InputTokensDetails``);
        # absent, a client read None (found by review).
        "input_tokens_details": {
            "cached_tokens": stats.cached_tokens,
            "cache_write_tokens": stats.written_tokens,
        },
        "output_tokens": stats.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


def _call_item(call: ToolCall, *, done: bool) -> Json:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if done else "",
        "status": "completed" if done else "in_progress",
    }


#: The ``include`` value that asks for the output text's logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def wanted_logprobs(req: ResponsesRequest) -> int | None:
    """The alternatives per token a request's logprobs carry (None: no logprobs asked for).
    Found by review: both fields were ignored, and every output text said ``logprobs: []``."""
    if (req.include is None or LOGPROBS_INCLUDE not in req.include) and req.top_logprobs is None:
        return None
    return req.top_logprobs or 0


def logprobs_json(items: Sequence[TokenLogprob] | None) -> list[Json]:
    """Logprobs as an output text carries them (chat's ``logprobs.content`` entries)."""
    shaped = convert.chat_logprobs(items or ())
    assert shaped is not None
    content = shaped["content"]
    assert isinstance(content, list)
    return content


class ResponseShape:
    """One response's id, echo of its request, and its output as wire objects."""

    def __init__(self, req: ResponsesRequest, model_id: str) -> None:
        self.id = "resp_" + secrets.token_hex(16)
        self.message_id = "msg_" + secrets.token_hex(16)
        self.created_at = int(time.time())
        self.model_id = model_id
        self._req = req
        self.logprobs = wanted_logprobs(req) is not None

    def text_part(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> Json:
        part: Json = {"type": "output_text", "text": text, "annotations": []}
        if self.logprobs:
            part["logprobs"] = logprobs_json(logprobs)
        return part

    def message_item(
        self, text: str, status: str, logprobs: Sequence[TokenLogprob] | None = None
    ) -> Json:
        content: list[Json] = []
        if status != "in_progress":
            content = [self.text_part(text, logprobs)]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def output(self, reply: ChatReply, text: str) -> list[Json]:
        items: list[Json] = []
        if text or not reply.calls:
            items.append(self.message_item(text, _item_status(reply), reply.done.logprobs))
        return items + [_call_item(c, done=True) for c in reply.calls]

    def body(self, status: str, output: list[Json], stats: CompletionStats | None = None) -> Json:
        req = self._req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        choice = req.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": req.background,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model_id,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt
                else {"type": "text"}
            },
            "tool_choice": choice.model_dump()
            if isinstance(choice, FunctionChoice | AllowedToolsChoice)
            else (choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "truncation": "disabled",
            "usage": usage(stats) if stats is not None else None,
            "metadata": req.metadata or {},
            "user": req.user,
        }

    def final(self, reply: ChatReply, text: str) -> Json:
        return self.body(_status(reply), self.output(reply, text), reply.done.stats)

    def cancelled(self, reply: ChatReply) -> Json:
        """A background response cancelled while it ran: the text it had made, if any, in
        an ``incomplete`` message item (a tool call cut off is lost)."""
        text, lp = reply.content, reply.done.logprobs
        output = [self.message_item(text, "incomplete", lp)] if text else []
        return self.body("cancelled", output, reply.done.stats)


def _status(reply: ChatReply) -> str:
    """``incomplete`` for a reply max_output_tokens cut off, calls made before the cut or
    not (the one cut off is lost)."""
    return "incomplete" if reply.done.stats.finish_reason == "length" else "completed"


def _item_status(reply: ChatReply) -> str:
    return "incomplete" if _status(reply) == "incomplete" else "completed"


class ResponseEvents:
    """The Responses stream for one reply: numbered events, items opened as output appears."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self._deltas: list[str] = []  # every text delta sent so far (joined once: ``text``)
        self.reply: ChatReply | None = None  # set once the reply has finished
        self._seq = -1
        self._message_open = False
        self._index = -1  # output_index of the item last opened
        self._join = ContentJoin()
        self._logprobs: list[TokenLogprob] = []  # of tokens whose text no delta carried yet

    def logprobs(self, items: Sequence[TokenLogprob]) -> None:
        """A fragment's logprobs: the next text delta carries them."""
        if self.shape.logprobs:
            self._logprobs.extend(items)

    @property
    def text(self) -> str:
        """Every text delta sent so far. Kept as a list and joined when read (at the end of
        the reply): ``str +=`` on an attribute copied the whole text at every token."""
        if len(self._deltas) > 1:
            self._deltas[:] = ["".join(self._deltas)]
        return self._deltas[0] if self._deltas else ""

    def _event(self, kind: str, **fields: object) -> Event:
        self._seq += 1
        return kind, {"type": kind, "sequence_number": self._seq, **fields}

    def start(self) -> list[Event]:
        head = self.shape.body("in_progress", [])
        return [
            self._event("response.created", response=head),
            self._event("response.in_progress", response=head),
        ]

    def _part(self) -> Json:
        return {"item_id": self.shape.message_id, "output_index": self._index, "content_index": 0}

    def delta(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self._message_open:
            self._message_open = True
            self._index += 1
            item = self.shape.message_item("", "in_progress")
            events.append(
                self._event("response.output_item.added", output_index=self._index, item=item)
            )
            empty = self.shape.text_part("", ())
            events.append(self._event("response.content_part.added", **self._part(), part=empty))
        if text:
            self._deltas.append(text)
            sent, self._logprobs = logprobs_json(self._logprobs), []
            events.append(
                self._event("response.output_text.delta", **self._part(), delta=text, logprobs=sent)
            )
        return events

    def part(self, part: str | ToolCall) -> list[Event]:
        """A streamed part of the reply: text goes into the message item (joined as
        ``ChatReply.content`` joins it); calls wait for ``finish``, after the message item."""
        text = self._join(part)
        return self.delta(text) if text else []

    def finish(self, reply: ChatReply) -> list[Event]:
        """The end of a reply whose texts were all sent (``part``)."""
        self.reply = reply
        events: list[Event] = []
        if not reply.calls:
            events += self.delta("")  # a reply of no text still has its message item
        if self._message_open:
            lp = reply.done.logprobs
            part = self.shape.text_part(self.text, lp)
            item = self.shape.message_item(self.text, _item_status(reply), lp)
            done_lp = logprobs_json(lp) if self.shape.logprobs else []
            events += [
                self._event(
                    "response.output_text.done", **self._part(), text=self.text, logprobs=done_lp
                ),
                self._event("response.content_part.done", **self._part(), part=part),
                self._event("response.output_item.done", output_index=self._index, item=item),
            ]
        for call in reply.calls:
            events += self._call(call)
        final = self.shape.final(reply, self.text)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=final))
        return events

    def _call(self, call: ToolCall) -> list[Event]:
        self._index += 1
        item_id = _call_item(call, done=False)["id"]
        where: Json = {"item_id": item_id, "output_index": self._index}
        return [
            self._event(
                "response.output_item.added",
                output_index=self._index,
                item=_call_item(call, done=False),
            ),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event(
                "response.function_call_arguments.done",
                **where,
                arguments=call.arguments,
                name=call.name,
            ),
            self._event(
                "response.output_item.done",
                output_index=self._index,
                item=_call_item(call, done=True),
            ),
        ]

    def error(self, exc: KvwarmError) -> list[Event]:
        """A failure after the stream began, as the Responses API ends one: an ``error``
        event, then ``response.failed`` carrying the response (status ``failed``, its
        ``error``, the text sent so far)."""
        kind = kind_of(exc)
        message = str(exc) or type(exc).__name__
        param = getattr(exc, "param", None)
        output = [self.shape.message_item(self.text, "incomplete")] if self._message_open else []
        failed = self.shape.body("failed", output)
        failed["error"] = {"code": kind.code, "message": message}
        return [
            self._event("error", code=kind.code, message=message, param=param),
            self._event("response.failed", response=failed),
        ]


async def stream_events(
    events: ResponseEvents, replies: AsyncIterator[str | ToolCall | ChatReply]
) -> AsyncIterator[Event]:
    for event in events.start():
        yield event
    async for item in replies:
        for event in events.finish(item) if isinstance(item, ChatReply) else events.part(item):
            yield event
