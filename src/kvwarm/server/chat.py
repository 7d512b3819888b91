"""The chat path every chat-shaped API shares: OpenAI chat completions, Anthropic messages and
OpenAI responses all become ``ChatMessage``/``Tool`` lists, then run through here.

Invariants: tools are planned one way (``plan``: native or described, forced calls constrained
by a schema) and replies are split into content and tool calls one way (``tools``' parser, the
``tool_stream`` holdback), whichever wire format asked. Anthropic and Responses requests
translate into these types and render ``ChatReply`` in their own shapes; OpenAI chat, with its
``n`` choices and incremental call deltas, uses ``plan`` and its own stream
(``server/openai/chat.py``; docs/architecture.md, "Server and CLI").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from starlette.concurrency import run_in_threadpool

from kvwarm.backends.grammar_cost import cheap_grammar
from kvwarm.engine.prompts import shows_system
from kvwarm.engine.types import Completion, GenerationOptions, TokenLogprob
from kvwarm.errors import GrammarError, ReplicaUnavailableError
from kvwarm.server import convert
from kvwarm.server.errors import HTTPError
from kvwarm.server.generate import Generation
from kvwarm.server.media import fetch_images
from kvwarm.server.schemas import (
    AllowedToolsChoice,
    ChatMessage,
    NamedToolChoice,
    SamplingFields,
    Tool,
    parse_body,
)
from kvwarm.server.tool_stream import ToolStream
from kvwarm.server.tools import (
    CallFormat,
    CallGrammar,
    ChatPlan,
    Part,
    ToolCall,
    calls_of,
    check_tools,
    content_of,
    openai_tools,
    plan_chat,
)

if TYPE_CHECKING:
    from kvwarm.server.served import ServedModel, ServedStream
    from kvwarm.settings import Settings

log = logging.getLogger(__name__)

ToolChoice = str | NamedToolChoice | AllowedToolsChoice | None


class ChatTemplate(Protocol):
    """What planning a chat asks of a model: its chat template rendered (a served model, or
    ``kvwarm cache explain``'s vocabulary-only one)."""

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class ChatReply:
    """A finished reply: its texts and tool calls in the order the model wrote them."""

    done: Completion
    parts: list[Part]

    @property
    def content(self) -> str:
        """The reply's texts as one (OpenAI's ``content``; ``tools.content_of``)."""
        return content_of(self.parts)

    @property
    def calls(self) -> list[ToolCall]:
        return calls_of(self.parts)


# Answers of ``renders_tools`` per model object (a reloaded model is a new object, so its
# answers start afresh) and tool set: two template renders a request with tools, which under
# ``kvwarm cluster`` are two replica round trips, are paid once per tool set (an agent sends
# the same tools every turn).
_PROBED: weakref.WeakKeyDictionary[ChatTemplate, OrderedDict[str, bool]] = (
    weakref.WeakKeyDictionary()
)
_PROBED_LOCK = threading.Lock()
PROBED_TOOL_SETS = 64  # per model, least recently used first out


def renders_tools(model: ChatTemplate, tools: Sequence[Tool]) -> bool:
    """Whether the model's template shows the tools it is given (native tool support);
    remembered per model and tool set."""
    defs = openai_tools(tools)
    key = json.dumps(defs, sort_keys=True, separators=(",", ":"))
    with _PROBED_LOCK:
        known = _PROBED.get(model)
        if known is not None and key in known:
            known.move_to_end(key)
            return known[key]
    probe: list[dict[str, object]] = [{"role": "user", "content": "hi"}]
    try:
        with_tools = model.apply_chat_template(probe, tools=defs)
    except ReplicaUnavailableError:
        raise  # a cluster lost the replica asked: no answer about the template
    except Exception:  # a template that chokes on tools does not support them
        return False  # not remembered: the error may not be the template's
    without = model.apply_chat_template(probe)
    answer = any(t.function.name in with_tools and t.function.name not in without for t in tools)
    with _PROBED_LOCK:
        known = _PROBED.setdefault(model, OrderedDict())
        known[key] = answer
        while len(known) > PROBED_TOOL_SETS:
            known.popitem(last=False)
    return answer


_SYSTEM_PROBE = "\0system"  # the key of ``accepts_system``'s answer among a model's tool sets


def accepts_system(model: ChatTemplate) -> bool:
    """Whether the model's template shows a system message (``prompts.shows_system``, the
    engine's probe: ``Model.chat`` folds by the same answer); where it shows none, the
    client's system prompt and emulated tools' description open the first user turn.
    Remembered per model; a cluster's lost replica (``ReplicaUnavailableError``) is no
    answer about the template and raises."""
    with _PROBED_LOCK:
        known = _PROBED.get(model)
        if known is not None and _SYSTEM_PROBE in known:
            known.move_to_end(_SYSTEM_PROBE)  # among the tool sets, last out
            return known[_SYSTEM_PROBE]
    answer = shows_system(model.apply_chat_template)
    with _PROBED_LOCK:
        _PROBED.setdefault(model, OrderedDict())[_SYSTEM_PROBE] = answer
    return answer


# ``call_format``'s answer per model object (a tuple: None is an answer too).
_PROBED_FORMATS: weakref.WeakKeyDictionary[ChatTemplate, tuple[CallFormat | None]] = (
    weakref.WeakKeyDictionary()
)
_PROBE_TOOL: dict[str, object] = {
    "type": "function",
    "function": {
        "name": "kvwarm_probe",
        "description": "a probe of how the template writes a call",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
_PROBE_CALL: list[dict[str, object]] = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "kvwprobe1",
                "type": "function",
                "function": {"name": "kvwarm_probe", "arguments": {"q": "x"}},
            }
        ],
    },
]
#: How each format held (``tools.CallFormat``) shows the probe's call.
_SHOWN: tuple[tuple[CallFormat, re.Pattern[str]], ...] = (
    ("hermes", re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"kvwarm_probe"')),
    # Any key order: a template may write "arguments" first (``tojson(sort_keys=true)``).
    ("mistral-list", re.compile(r'\[TOOL_CALLS\]\s*\[\s*\{[^\]]*"name"\s*:\s*"kvwarm_probe"')),
    ("mistral-args", re.compile(r"\[TOOL_CALLS\]kvwarm_probe(?:\[CALL_ID\]\w*)?\[ARGS\]")),
    # Functionary v3.1's template joins its tag to ``tojson``'s result: jinja2's own filter
    # returned Markup and HTML-escaped it (``&lt;function=...&gt;``); ours, Hugging Face's, does
    # not, and either form is read. The model writes the tag itself.
    ("function-tag", re.compile(r"(?:<|&lt;)function=kvwarm_probe(?:>|&gt;)")),
    # Last: the formats above show the same object. The call's arguments, not the tool's
    # own definition (which ``tojson`` may also write as "name" then "parameters").
    (
        "llama3-json",
        re.compile(r'"name"\s*:\s*"kvwarm_probe"\s*,\s*"parameters"\s*:\s*\{\s*"q"\s*:\s*"x"'),
    ),
)


def call_format(model: ChatTemplate) -> CallFormat | None:
    """The format a template that renders tools writes a call in, where a lazy grammar can
    hold it (``tools.LazyCalls``), as the template shows a call in the history; None for
    any other, or a template that refuses the probe. Remembered per model."""
    with _PROBED_LOCK:
        known = _PROBED_FORMATS.get(model)
        if known is not None:
            return known[0]
    try:
        rendered = model.apply_chat_template(
            _PROBE_CALL, tools=[_PROBE_TOOL], add_generation_prompt=False
        )
    except ReplicaUnavailableError:
        raise  # a cluster lost the replica asked: no answer about the template
    except Exception:  # a template that chokes on a call in the history: no grammar
        answer: CallFormat | None = None
    else:
        answer = next((fmt for fmt, shown in _SHOWN if shown.search(rendered)), None)
    with _PROBED_LOCK:
        _PROBED_FORMATS[model] = (answer,)
    return answer


async def plan(
    model: ServedModel,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool] | None,
    tool_choice: ToolChoice,
    *,
    parallel: bool = True,
    settings: Settings | None = None,
) -> ChatPlan:
    """How ``messages`` and ``tools`` reach ``model`` (the template probe runs off the loop);
    ``parallel`` False: at most one call per reply. With ``settings``, an image given by an
    http(s) URL is fetched if its host is allowed, else refused (``server/media.py``)."""
    if settings is not None:
        messages = await fetch_images(messages, settings)
    if not tools and not _leads_with_system(messages):  # no template probe to run
        return plan_messages(model, messages, tools, tool_choice, parallel=parallel)
    # The template probes render: off the loop.
    return await run_in_threadpool(
        plan_messages, model, messages, tools, tool_choice, parallel=parallel
    )


def plan_messages(
    model: ChatTemplate,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool] | None,
    tool_choice: ToolChoice,
    *,
    parallel: bool = True,
) -> ChatPlan:
    """``plan`` of messages whose images are fetched already, blocking (the template is
    probed): one function for the server and ``kvwarm cache explain``, which rendered a
    request's tools otherwise (found by review)."""
    check_tools(tools or ())  # every tool declared, before allowed_tools picks some
    if isinstance(tool_choice, AllowedToolsChoice):
        tools, tool_choice = allowed_tools(tools, tool_choice)
    native, calls = False, None
    if tools and tool_choice != "none":
        native = renders_tools(model, tools)
        if native and tool_choice in (None, "auto"):
            calls = call_format(model)
    # Where a system message would reach the template (the client's, or described tools'),
    # one that shows none gets its text in the first user turn: found by review, a system
    # prompt (which Claude Code and most agents always send) was a 400 on every API under
    # Gemma 2's template and Mistral's first ones.
    described = bool(tools) and tool_choice != "none" and not native
    system = accepts_system(model) if described or _leads_with_system(messages) else True
    return plan_chat(
        messages,
        tools,
        tool_choice,
        renders_tools=native,
        parallel=parallel,
        system=system,
        native_format=calls,
    )


def _leads_with_system(messages: Sequence[ChatMessage]) -> bool:
    """Whether the chat opens with a system (or developer) message."""
    return bool(messages) and messages[0].role in ("system", "developer")


async def call_grammar(
    plan: ChatPlan, *, whole: bool, cache_salt: str | None
) -> CallGrammar | None:
    """tool_choice auto's call grammar (``plan.lazy``), built off the event loop (a tool's
    100,000-value ``enum`` takes ~0.2 s to convert); None where its calls are not held or the
    request constrains its ``whole`` reply itself (its own grammar, a response format), and
    where a tool's schema is one the grammar cannot hold: then the calls are as the model
    writes them, as in a format without a grammar. Found by review: such a request was a
    400 (``invalid_grammar``), though under auto nothing must be constrained, OpenAI and
    llama-server answer it, and kvwarm did before auto's calls were held; a forced call
    (``required``, a named tool), which must be, is still the 400. ``cache_salt``: the
    request's, the scope its preparation is remembered in (``grammar_cost.TextMemo``); no
    default, so that no route forgets it (found by review: the Responses API's was unscoped)."""
    lazy = plan.lazy
    if lazy is None or whole:
        return None

    def checked() -> CallGrammar:
        calls = lazy.grammar()
        # Within the bounds every grammar is held to (``engine/submit.py``: too ambiguous, too
        # wide, too long), here, where past them means no grammar rather than a 400.
        scope = None if cache_salt is None else cache_salt.encode("utf-8")
        return dataclasses.replace(calls, grammar=cheap_grammar(calls.grammar, scope))

    try:
        return await run_in_threadpool(checked)
    except GrammarError as exc:
        log.info("tool_choice auto: the calls are not held by a grammar: %s", exc)
        return None


def allowed_tools(
    tools: Sequence[Tool] | None, choice: AllowedToolsChoice
) -> tuple[list[Tool], str]:
    """The tools an ``allowed_tools`` choice lets the reply call, and its mode ("auto": calls
    to them or text; "required": a call to one of them); naming an undeclared tool is a 400."""
    param = "tool_choice.allowed_tools.tools"
    names = choice.allowed_tools.names(param)
    declared = {t.function.name for t in tools or ()}
    for i, name in enumerate(names):
        if name not in declared:
            raise HTTPError(
                400,
                f"tool_choice allows {name!r}, which is not in tools",
                code="invalid_value",
                param=f"{param}.{i}",
            )
    return [t for t in tools or () if t.function.name in names], choice.allowed_tools.mode


def sampling_fields(
    *, max_tokens: int | None, param: str, limit: int, over_limit: str, **knobs: object
) -> SamplingFields:
    """The OpenAI sampling fields standing for another API's request. ``max_tokens`` is checked
    against the server's limit here, so an error names the field the client sent (``param``);
    with ``over_limit`` "cap", ``convert.options`` caps it as every request's."""
    convert.length_within(max_tokens, param, limit, over_limit)
    return parse_body({"max_tokens": max_tokens, **knobs}, SamplingFields)


def submit(
    model: ServedModel, chat: ChatPlan, opts: GenerationOptions, prefill: str = ""
) -> Callable[[], ServedStream]:
    """The blocking call that starts the generation (run it through ``start_stream``).
    ``prefill``: text the reply must continue (Anthropic's trailing assistant message); it is
    appended to the prompt as plain text after the template's generation prompt, after any
    images the chat shows (``Model.stream_chat``)."""
    return lambda: model.stream_chat(chat.messages, tools=chat.tools, options=opts, prefill=prefill)


def with_parent(opts: GenerationOptions, key: bytes | None) -> GenerationOptions:
    """``opts`` resuming from the cache row ``key`` (a previous reply's finish save)."""
    return opts if key is None else dataclasses.replace(opts, parent_key=key)


async def whole_reply(gen: Generation, chat: ChatPlan) -> ChatReply:
    """Wait for the reply and split it into texts and calls (non-streamed requests)."""
    async with gen:
        done = await gen.result()
    return ChatReply(done, chat.parts(done.text))


async def streamed_reply(
    gen: Generation,
    chat: ChatPlan,
    logprobs: Callable[[Sequence[TokenLogprob]], None] | None = None,
) -> AsyncIterator[Part | ChatReply]:
    """The reply's parts as they become safe to send (text pieces as they come, a possible
    tool call held back until it parses: ``tool_stream``), then one ``ChatReply``, the whole
    reply, whose calls have the ids they were sent with. ``gen`` must be opened
    (``Generation.open_streaming``). ``logprobs`` is handed each fragment's logprobs before
    the parts of its text."""
    held = ToolStream(chat.names, forced=chat.forced, single=chat.single)
    async for fragment in gen.fragments():
        if logprobs is not None and fragment.logprobs:
            logprobs(fragment.logprobs)
        for part in held.feed(fragment.text):
            yield part
    done = await gen.result()
    rest, parts = held.finish()
    for part in rest:
        yield part
    yield ChatReply(done, parts)
