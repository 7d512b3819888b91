"""Anthropic Messages shapes <-> the shared chat path (``server/chat.py``).

Invariants:

- A request becomes the same ``ChatMessage``/``Tool`` lists an OpenAI chat request would: the
  system prompt leads, ``tool_use`` blocks become an assistant's tool calls and ``tool_result``
  blocks tool messages, in their order. A trailing assistant message is a *prefill*: the reply
  continues it and does not repeat it.
- Usage splits the prompt the way Anthropic's clients add it up (input + cache read + cache
  creation = the whole prompt): ``cache_read_input_tokens`` are the tokens restored from the
  kvwarm cache; ``cache_creation_input_tokens`` the rest of the prompt when this request asked
  the cache to keep its reply row (``CompletionStats.key``), else those are ``input_tokens``.
- A stream is Anthropic's exact event sequence: ``message_start``, per block
  ``content_block_start`` / ``content_block_delta`` (``text_delta`` or ``input_json_delta``) /
  ``content_block_stop``, one ``ping`` after the first block opens, ``message_delta`` (stop
  reason and the whole usage; ``message_start`` knows only the prompt's size), ``message_stop``.
- A reply's ``text`` and ``tool_use`` blocks are in the order the model wrote them (text
  after a call is a block of its own), streamed or not: a streamed ``tool_use`` block goes out
  whole once its call parses (``tool_stream``).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import AsyncIterator, Sequence

from kvwarm.engine.types import CompletionStats
from kvwarm.errors import KvwarmError
from kvwarm.server.anthropic.schemas import (
    Container,
    CountTokensRequest,
    ImageBlock,
    MediaBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
)
from kvwarm.server.chat import ChatReply
from kvwarm.server.chat import ToolChoice as ChatToolChoice
from kvwarm.server.errors import HTTPError, anthropic_body, kind_of
from kvwarm.server.generate import Event
from kvwarm.server.schemas import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDef,
    ImageUrl,
    NamedToolChoice,
    NamedToolChoiceFunction,
    Tool,
    ToolCallIn,
)
from kvwarm.server.tools import TEXT_SEPARATOR, ToolCall

Json = dict[str, object]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _unsupported(block: MediaBlock, where: str) -> HTTPError:
    return HTTPError(
        400,
        f"{where}: content blocks of type {block.type!r} are not supported (text and images)",
        code="unsupported_content",
        param=where,
    )


def _texts(blocks: Sequence[TextBlock], sep: str) -> str:
    return sep.join(block.text for block in blocks)


_MEDIA_TYPE = re.compile(r"[\w.+-]+/[\w.+-]+")


def _image(block: ImageBlock, where: str) -> ContentPart:
    """An image block as an OpenAI ``image_url`` part (a data: URI, or the URL the server
    fetches only from an allowed host), naming where it was."""
    source = block.source
    if source.type == "base64":
        if not source.data:
            raise HTTPError(
                400, f"{where}: an image block needs source.data", code="invalid_value", param=where
            )
        # The bytes decide what the image is (kvwarm.media sniffs them, as for every API's
        # images); a type the data: URI cannot carry (none, "png") is left out of it.
        kind = source.media_type or ""
        if not _MEDIA_TYPE.fullmatch(kind):
            kind = "application/octet-stream"
        url = f"data:{kind};base64,{source.data}"
    else:
        if not source.url:
            raise HTTPError(
                400, f"{where}: an image block needs source.url", code="invalid_value", param=where
            )
        url = source.url
    part = ContentPart(type="image_url", image_url=ImageUrl(url=url))
    part._where = where
    return part


def _user_content(parts: list[ContentPart]) -> str | list[ContentPart]:
    """Text alone as a string (as before images), else the parts in order."""
    if all(p.type == "text" for p in parts):
        return "".join(p.text or "" for p in parts)
    return parts


def _tool_result(block: ToolResultBlock, where: str) -> str | list[ContentPart]:
    """A tool result's content: a string, or its text blocks (one a line) and images in order
    (Claude Code sends the image file it read); an error's text says it is one."""
    result = block.content
    prefix = "Error: " if block.is_error else ""
    if isinstance(result, str):
        return prefix + result
    parts: list[ContentPart] = [ContentPart(type="text", text=prefix)] if prefix else []
    after_text = False  # text blocks are one a line, as a string result joins them
    for i, item in enumerate(result):
        at = f"{where}.content.{i}"
        if isinstance(item, MediaBlock):
            raise _unsupported(item, at)
        if isinstance(item, ImageBlock):
            parts.append(_image(item, at))
            after_text = False
            continue
        parts.append(ContentPart(type="text", text=("\n" if after_text else "") + item.text))
        after_text = True
    if all(p.type == "text" for p in parts):
        return "".join(p.text or "" for p in parts)
    return parts


def _user(message: Message, where: str) -> list[ChatMessage]:
    """A user turn: its tool results become tool messages, its text and images a user message,
    in order."""
    if isinstance(message.content, str):
        return [ChatMessage(role="user", content=message.content)]
    out: list[ChatMessage] = []
    parts: list[ContentPart] = []
    for i, block in enumerate(message.content):
        at = f"{where}.content.{i}"
        if isinstance(block, TextBlock):
            parts.append(ContentPart(type="text", text=block.text))
        elif isinstance(block, ImageBlock):
            parts.append(_image(block, at))
        elif isinstance(block, ToolResultBlock):
            if parts:
                out.append(ChatMessage(role="user", content=_user_content(parts)))
                parts = []
            body = _tool_result(block, at)
            out.append(ChatMessage(role="tool", content=body, tool_call_id=block.tool_use_id))
        elif isinstance(block, MediaBlock):
            raise _unsupported(block, at)
        elif isinstance(block, ToolUseBlock):
            raise HTTPError(
                400,
                f"{at}: tool_use blocks belong to assistant turns",
                code="invalid_value",
                param=at,
            )
    if parts or not out:
        out.append(ChatMessage(role="user", content=_user_content(parts)))
    return out


def _assistant(message: Message, where: str) -> ChatMessage:
    if isinstance(message.content, str):
        return ChatMessage(role="assistant", content=message.content)
    text: list[str] = []
    calls: list[ToolCallIn] = []
    after_call = False
    for i, block in enumerate(message.content):
        at = f"{where}.content.{i}"
        if isinstance(block, TextBlock):
            # Texts a call stood between join as a reply's do (``tools.content_of``), so a
            # reply sent back renders as the same turn on every API.
            text.append((TEXT_SEPARATOR if text and after_call else "") + block.text)
            after_call = False
        elif isinstance(block, ToolUseBlock):
            after_call = True
            call = FunctionCall(name=block.name, arguments=dict(block.input))
            calls.append(ToolCallIn(id=block.id, function=call))
        elif isinstance(block, MediaBlock | ImageBlock):
            raise HTTPError(
                400,
                f"{at}: an assistant turn holds text and tool calls, not {block.type} blocks",
                code="unsupported_content",
                param=at,
            )
        elif isinstance(block, ToolResultBlock):
            raise HTTPError(
                400,
                f"{at}: tool_result blocks belong to user turns",
                code="invalid_value",
                param=at,
            )
        # ThinkingBlock: an earlier turn's reasoning is not part of the prompt.
    return ChatMessage(role="assistant", content="".join(text), tool_calls=calls or None)


def _parts(content: str | list[ContentPart] | None) -> list[ContentPart]:
    if isinstance(content, list):
        return content
    return [ContentPart(type="text", text=content or "")]


def _merged(first: ChatMessage, second: ChatMessage) -> ChatMessage:
    """Two consecutive turns of one role as one, as Anthropic combines them: their texts a
    line apart (an assistant's a blank line apart where a call stood between, as in one
    reply), images in place, the calls in order."""
    a, b = first.content, second.content
    if not a or not b:
        content = a or b
    elif isinstance(a, str) and isinstance(b, str):
        sep = TEXT_SEPARATOR if first.tool_calls else "\n"
        content = a + sep + b
    else:
        content = [*_parts(a), ContentPart(type="text", text="\n"), *_parts(b)]
    calls = [*(first.tool_calls or ()), *(second.tool_calls or ())]
    return ChatMessage(role=first.role, content=content, tool_calls=calls or None)


def refuse(req: CountTokensRequest) -> None:
    """400 for a field asking for what kvwarm cannot run (an empty value asks nothing): MCP
    servers (Anthropic's MCP connector, whose tools its servers would call) and a container's
    skills. Found by review: both were ignored, so a client asking for MCP tools or skills got
    a model without them and no word. Fields kvwarm does without, whose reply is still what
    was asked (``thinking``, ``context_management``: Claude Code sends them), stay ignored."""
    if req.mcp_servers:
        raise HTTPError(
            400,
            "mcp_servers: MCP servers are not supported (kvwarm calls no tools itself); give "
            "their tools in tools and run them in the client",
            code="unsupported_parameter",
            param="mcp_servers",
        )
    if isinstance(req.container, Container) and req.container.skills:
        raise HTTPError(
            400,
            "container: skills are not supported (kvwarm runs no code execution container)",
            code="unsupported_parameter",
            param="container.skills",
        )


def to_chat(req: CountTokensRequest) -> tuple[list[ChatMessage], str]:
    """The chat messages of ``req`` and its prefill (the text of a trailing assistant turn).
    Consecutive messages of one role are one turn, as Anthropic's API combines them (found by
    review: they were turns of their own, which a template wanting user and assistant to
    alternate, as Gemma's and Mistral's, refused)."""
    out: list[ChatMessage] = []
    if req.system:
        system = req.system
        text = system if isinstance(system, str) else _texts(system, "\n")
        out.append(ChatMessage(role="system", content=text))
    first = len(out)
    called: str | None = None  # the trailing assistant turn's first message with a call
    for index, message in enumerate(req.messages):
        where = f"messages.{index}"
        if message.role == "user":
            turns = _user(message, where)
            called = None
        else:
            turns = [_assistant(message, where)]
            if turns[0].tool_calls and called is None:
                called = where
        for turn in turns:
            if len(out) > first and out[-1].role == turn.role != "tool":
                out[-1] = _merged(out[-1], turn)
            else:
                out.append(turn)
    prefill = ""
    # A trailing assistant turn is a prefill: the reply continues it, as Anthropic's API does
    # also where it is the only message (found by review: kept as a history turn, the model
    # answered it with a new turn instead of continuing it).
    if req.messages[-1].role == "assistant":
        turn = out.pop()
        if called is not None:
            raise HTTPError(
                400,
                f"{called}: the last message cannot be an assistant tool call",
                code="invalid_value",
                param=called,
            )
        prefill = turn.content if isinstance(turn.content, str) else ""
        if prefill != prefill.rstrip():
            # As Anthropic's API refuses it (found by review: taken, the reply continued
            # after a lone space token, SmolLM2's "The sea " went on "\nis a vast...").
            where = f"messages.{len(req.messages) - 1}"
            raise HTTPError(
                400,
                f"{where}: the final assistant content (a prefill) cannot end with trailing "
                "whitespace",
                code="invalid_value",
                param=where,
            )
    return out, prefill


def output_schema(req: MessagesRequest) -> dict[str, object] | None:
    """The JSON schema a structured-output request asks for (None: free text)."""
    if req.output_config is not None and req.output_config.format is not None:
        return req.output_config.format.schema_
    return req.output_format.schema_ if req.output_format is not None else None


def tools(defs: Sequence[ToolDef] | None) -> list[Tool] | None:
    if not defs:
        return None
    out: list[Tool] = []
    for i, tool in enumerate(defs):
        if tool.type not in (None, "custom"):
            raise HTTPError(
                400,
                f"tools.{i}: server tools ({tool.type!r}) are not supported; give name, "
                "description and input_schema",
                code="unsupported_tool",
                param=f"tools.{i}.type",
            )
        fn = FunctionDef(name=tool.name, description=tool.description, parameters=tool.input_schema)
        out.append(Tool(function=fn))
    return out


def tool_choice(choice: ToolChoice | None, declared: Sequence[Tool] | None) -> ChatToolChoice:
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "none":
        return "none"
    if not declared:
        raise HTTPError(
            400,
            f"tool_choice {choice.type!r} needs tools",
            code="invalid_value",
            param="tool_choice",
        )
    if choice.type == "any":
        return "required"
    if not choice.name:
        raise HTTPError(
            400,
            "tool_choice of type 'tool' needs a name",
            code="invalid_type" if choice.name is None else "invalid_value",
            param="tool_choice.name",
        )
    return NamedToolChoice(function=NamedToolChoiceFunction(name=choice.name))


# --- replies ---------------------------------------------------------------------------------


def usage(stats: CompletionStats) -> Json:
    cached = stats.cached_tokens
    created = stats.written_tokens
    return {
        "input_tokens": stats.prompt_tokens - cached - created,
        "output_tokens": stats.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": created,
    }


def stop_reason(reply: ChatReply, max_tokens: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply; ``max_tokens``: the length it ran
    under (the client's, or the server's limit where that capped it). A reply cut short of
    it filled the model's context: Anthropic's ``model_context_window_exceeded`` (found by
    review: it said ``max_tokens``, as if a larger budget would have let it go on)."""
    stats = reply.done.stats
    if stats.finish_reason == "length":  # even after calls: the one cut off is lost
        if stats.completion_tokens < max_tokens:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    if reply.calls:
        return "tool_use", None
    if stats.stop_sequence is not None:
        return "stop_sequence", stats.stop_sequence
    return "end_turn", None


def tool_use(call: ToolCall, *, with_input: bool = True) -> Json:
    """A ``tool_use`` block. Anthropic's ``input`` is an object: other JSON is wrapped."""
    arguments: object = json.loads(call.arguments) if with_input else {}
    if not isinstance(arguments, dict):
        arguments = {"arguments": arguments}
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": arguments,
    }


def _input_json(call: ToolCall) -> str:
    return json.dumps(tool_use(call)["input"])


def message(msg_id: str, model_id: str, reply: ChatReply, max_tokens: int) -> Json:
    content: list[Json] = [
        {"type": "text", "text": p} if isinstance(p, str) else tool_use(p) for p in reply.parts
    ]
    reason, sequence = stop_reason(reply, max_tokens)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model_id,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(reply.done.stats),
    }


class MessageEvents:
    """Anthropic's stream events for one reply; blocks are numbered as they open."""

    def __init__(self, msg_id: str, model_id: str, max_tokens: int, prompt_tokens: int = 0) -> None:
        self.msg_id = msg_id
        self.model_id = model_id
        self.max_tokens = max_tokens  # the reply's length limit (``stop_reason``)
        self.prompt_tokens = prompt_tokens  # 0 where the stream cannot tell yet (a replica's)
        self._index = -1
        self._text_open = False
        self._pinged = False

    def start(self) -> Event:
        # How much of the prompt the cache restored is known only at the end: message_delta
        # carries the whole usage, cumulative, as Anthropic's own message_delta does, and its
        # clients take it from there.
        head: Json = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation_input_tokens": 0,
            },
        }
        return "message_start", {"type": "message_start", "message": head}

    def _open(self, block: Json) -> list[Event]:
        self._index += 1
        opened: Json = {"type": "content_block_start", "index": self._index, "content_block": block}
        events: list[Event] = [("content_block_start", opened)]
        if not self._pinged:
            self._pinged = True
            events.append(("ping", {"type": "ping"}))
        return events

    def _delta(self, delta: Json) -> Event:
        body: Json = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return "content_block_delta", body

    def _stop(self) -> Event:
        return "content_block_stop", {"type": "content_block_stop", "index": self._index}

    def text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not self._text_open:
            self._text_open = True
            events += self._open({"type": "text", "text": ""})
        events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def call(self, call: ToolCall) -> list[Event]:
        """A ``tool_use`` block, whole; it closes the text block before it."""
        events: list[Event] = []
        if self._text_open:
            self._text_open = False
            events.append(self._stop())
        events += self._open(tool_use(call, with_input=False))
        events.append(self._delta({"type": "input_json_delta", "partial_json": _input_json(call)}))
        events.append(self._stop())
        return events

    def part(self, part: str | ToolCall) -> list[Event]:
        return self.text(part) if isinstance(part, str) else self.call(part)

    def finish(self, reply: ChatReply) -> list[Event]:
        """The end of a reply whose parts were all sent (``part``)."""
        events: list[Event] = []
        if self._text_open:
            self._text_open = False
            events.append(self._stop())
        if not self._pinged:
            self._pinged = True
            events.append(("ping", {"type": "ping"}))
        reason, sequence = stop_reason(reply, self.max_tokens)
        delta: Json = {"stop_reason": reason, "stop_sequence": sequence}
        final: Json = {"type": "message_delta", "delta": delta, "usage": usage(reply.done.stats)}
        events += [("message_delta", final), ("message_stop", {"type": "message_stop"})]
        return events


async def stream_events(
    events: MessageEvents, replies: AsyncIterator[str | ToolCall | ChatReply]
) -> AsyncIterator[Event]:
    yield events.start()
    async for item in replies:
        for event in events.finish(item) if isinstance(item, ChatReply) else events.part(item):
            yield event


def stream_error(exc: KvwarmError) -> list[Event]:
    """A failure after the stream began, as Anthropic's ``error`` event (its last)."""
    return [("error", anthropic_body(kind_of(exc).status, str(exc) or type(exc).__name__))]
