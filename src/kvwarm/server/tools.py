"""Chat messages and tools in, tool calls out.

Invariants:

- A template that renders the ``tools`` it is given (the tool names appear in its output) gets
  them natively; any other template gets a Hermes-style system prompt describing them, so tools
  work with every model. Either way the reply is parsed by the same tolerant parser, which knows
  the common formats (``<tool_call>`` JSON, Mistral ``[TOOL_CALLS]`` (a JSON list, or
  ``name[ARGS]{...}``), Llama ``<|python_tag|>`` and
  ``<function=…>``, and a reply that is a bare ``{"name", "arguments"}`` object).
- A call is only reported for a tool the request declared; anything else stays content.
- ``tool_choice`` "required" or a named function constrains decoding with a JSON schema, so the
  reply *is* a call; "none" hides the tools from the model entirely.
- ``tool_choice`` "auto" holds a call to the same schema once the model starts one, where its
  format has an opener a grammar can start at (``LazyCalls``: ``<tool_call>``, the described
  format's and Hermes/Qwen templates'; Mistral's ``[TOOL_CALLS]``; ``<function=name>``;
  Llama 3.x's ``<|python_tag|>``), or, for Llama 3.x's bare-JSON call, where the reply
  begins as one (``{"name"`` at its start); the text around calls stays free. Other formats'
  calls are as the model writes them.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvwarm.backends.grammar import schemas_to_rules
from kvwarm.engine.prompts import joined_turns, system_folded
from kvwarm.errors import GrammarError
from kvwarm.server.errors import HTTPError
from kvwarm.server.media import engine_parts
from kvwarm.server.schemas import (
    STRICT_DECODER,
    ChatMessage,
    NamedToolChoice,
    Tool,
    json_depth,
    strict_loads,
)
from kvwarm.unicode import json_text

MAX_ARGUMENT_DEPTH = 64

Message = dict[str, object]

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FUNCTION_TAG = re.compile(r"<function=([\w.\-]+)>\s*(.*?)\s*(?:</function>|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text, as the OpenAI wire format wants

    def to_openai(self, index: int | None = None) -> dict[str, object]:
        out: dict[str, object] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


#: A reply is texts and calls, in the order the model wrote them.
Part = str | ToolCall

#: The call formats a lazy grammar holds (``LazyCalls``), each started by its opener:
#: "hermes", a ``<tool_call>`` block of ``{"name", "arguments"}`` JSON (the described tools'
#: format; Hermes, Qwen templates); "mistral-list", ``[TOOL_CALLS]`` and a JSON list of such
#: calls, each with an optional 9-character ``id`` (Mistral 7B v0.3, Nemo);
#: "mistral-args", ``[TOOL_CALLS]name[ARGS]{...}`` with an optional ``[CALL_ID]id`` before
#: ``[ARGS]`` (Mistral Small 3.2, Devstral, Magistral), one opener per call;
#: "function-tag", ``<function=name>{...}</function>`` (Llama 3.1 templates of functionary's
#: style); "llama3-json", Llama 3.x's ``{"name": ..., "parameters": {...}}``, the whole reply
#: (no opener: held when the reply begins as one, ``LLAMA3_START``) or after
#: ``<|python_tag|>``.
CallFormat = Literal["hermes", "mistral-list", "mistral-args", "function-tag", "llama3-json"]
CALL_FORMATS: tuple[CallFormat, ...] = (
    "hermes",
    "mistral-list",
    "mistral-args",
    "function-tag",
    "llama3-json",
)
_OPENERS: dict[CallFormat, str] = {
    "hermes": "<tool_call>",
    "mistral-list": "[TOOL_CALLS]",
    "mistral-args": "[TOOL_CALLS]",
    "function-tag": "<function=",
    "llama3-json": "<|python_tag|>",
}
#: Where a reply begins as a Llama 3.x bare-JSON call (llama.cpp's ``PATTERN_FULL`` trigger for
#: it): an object whose first key is ``"name"`` (after an optional ``"type": "function"``).
#: The grammar holds from the ``{`` on; a reply that begins otherwise stays free.
LLAMA3_START = r'\s*(\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name")'
#: The formats whose grammar names each tool in GBNF of its own: a name the format's parser
#: cannot read back gets no grammar.
_NAMED_FORMATS: frozenset[CallFormat] = frozenset({"mistral-args", "function-tag"})
#: The texts the parser reads calls by. A model's vocabulary may hold one as a control token
#: (Mistral's ``[TOOL_CALLS]``, ``[ARGS]``, ``[CALL_ID]``; Llama 3's ``<|python_tag|>``; some
#: Hermes-style ``<tool_call>``), whose text a reply leaves out unless it is preserved
#: (``GenerationOptions.preserved_tokens``, llama-server's ``preserved_tokens``): a request
#: whose calls are parsed keeps every one of them in the text the parser reads.
CALL_MARKERS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|python_tag|>",
    "<function=",
    "</function>",
)
#: The rules a call grammar adds around the schemas' (``_call_grammar`` checks that no
#: schema's rule has one of these names).
_SPACE = "kvwarm-call-space ::= [ \\t\\r\\n]{0,4}"
_CALL_ID = "kvwarm-call-id ::= [a-zA-Z0-9]{9}"
#: JSON's whitespace between a call object's tokens, a pretty-printer's indent included.
_JSON_SPACE = "kvwarm-json-space ::= [ \\t\\r\\n]{0,20}"
_RULE_NAME = re.compile(r"^([A-Za-z0-9-]+) ::=", re.MULTILINE)
_MISTRAL_NAME = re.compile(r"[\w.\-]+")


@dataclass(frozen=True, slots=True)
class CallGrammar:
    """A lazy grammar (``GenerationOptions.grammar_triggers``): ``grammar`` holds from one of
    ``triggers`` on; ``once``: the reply ends after the call (parallel calls off)."""

    grammar: str
    triggers: tuple[str, ...]
    once: bool
    starts: tuple[str, ...] = ()  # ``GenerationOptions.grammar_start_patterns``


@dataclass(frozen=True, slots=True)
class LazyCalls:
    """``tool_choice`` auto's calls in ``format``, held to ``tools``' schemas once one starts.
    The grammar is built only when a request is decoded with it (not to count tokens)."""

    tools: tuple[Tool, ...]
    format: CallFormat
    once: bool

    def grammar(self) -> CallGrammar:
        """``GrammarError`` for a schema the grammar cannot hold, as for a forced call's
        (``chat.call_grammar`` then leaves auto's calls free: no grammar, not a 400)."""
        grammar = call_grammar(self.format, self.tools, once=self.once)
        starts = (LLAMA3_START,) if self.format == "llama3-json" else ()
        return CallGrammar(grammar, (_OPENERS[self.format],), self.once, starts)


def call_grammar(fmt: CallFormat, tools: Sequence[Tool], *, once: bool = False) -> str:
    """GBNF of one call in ``fmt`` (from its opener to its end) of one of ``tools``, with
    arguments its schema admits (``once``: a list format's list holds one call)."""
    if fmt == "hermes":
        rules, (call,) = schemas_to_rules([forced_call_schema(tools)], "kvwarm-call")
        root = f'"<tool_call>" kvwarm-call-space {call} kvwarm-call-space "</tool_call>"'
        return _call_grammar(root, [_SPACE], rules)
    if fmt == "mistral-list":
        schema = forced_call_schema(tools, with_id=True)
        defs = schema.pop("$defs", None)
        listed: dict[str, object] = {"type": "array", "items": schema, "minItems": 1}
        if once:
            listed["maxItems"] = 1
        if defs is not None:
            listed["$defs"] = defs
        rules, (calls,) = schemas_to_rules([listed], "kvwarm-call")
        return _call_grammar(f'"[TOOL_CALLS]" kvwarm-call-space {calls}', [_SPACE], rules)
    parameters = [tool.function.parameters or {"type": "object"} for tool in tools]
    rules, names = schemas_to_rules(parameters, "kvwarm-args")
    if fmt == "function-tag":
        tags = " | ".join(
            f"{_literal(tool.function.name + '>')} kvwarm-call-space {args}"
            for tool, args in zip(tools, names, strict=True)
        )
        root = f'"<function=" ({tags}) kvwarm-call-space "</function>"'
        return _call_grammar(root, [_SPACE], rules)
    if fmt == "llama3-json":
        objects = " | ".join(
            _llama_object(tool.function.name, args) for tool, args in zip(tools, names, strict=True)
        )
        root = f'("<|python_tag|>" kvwarm-json-space)? ({objects})'
        return _call_grammar(root, [_JSON_SPACE], rules)
    alternatives = " | ".join(
        f'{_literal(tool.function.name)} ("[CALL_ID]" kvwarm-call-id)? "[ARGS]" {args}'
        for tool, args in zip(tools, names, strict=True)
    )
    return _call_grammar(f'"[TOOL_CALLS]" ({alternatives})', [_CALL_ID], rules)


def _llama_object(name: str, args: str) -> str:
    """GBNF of Llama 3.x's call object of tool ``name`` whose arguments are rule ``args``:
    ``"name"`` first (after an optional ``"type": "function"``), then ``"parameters"`` (or
    ``"arguments"``); the name as the model writes it, not ASCII-escaped."""
    ws = "kvwarm-json-space"
    quoted = _literal(json.dumps(name, ensure_ascii=False))
    kind = f'"\\"type\\"" {ws} ":" {ws} "\\"function\\"" {ws} "," {ws}'
    key = '("\\"parameters\\"" | "\\"arguments\\"")'
    return (
        f'"{{" {ws} ({kind})? "\\"name\\"" {ws} ":" {ws} {quoted} {ws} "," {ws} '
        f'{key} {ws} ":" {ws} {args} {ws} "}}"'
    )


def _literal(text: str) -> str:
    """``text`` as a GBNF string literal (JSON's escapes are GBNF's)."""
    return json.dumps(text, ensure_ascii=False)


def _call_grammar(root: str, own: Sequence[str], rules: str) -> str:
    """``root`` and ``own`` rules beside the schemas' ``rules``, none of which may take a name
    of ours (a ``$defs`` entry names a rule: one named ``root`` is a 400)."""
    ours = {"root", *(rule.split(" ::=", 1)[0] for rule in own)}
    if taken := ours & set(_RULE_NAME.findall(rules)):
        raise GrammarError(
            f"a tool's schema names a rule {sorted(taken)[0]!r}, which a call's grammar uses",
            param="tools",
        )
    return "\n".join([f"root ::= {root}", *own, rules])


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What to render and how to decode: ``tools`` go to the template (native support) or are
    None (described in a system message, or hidden by tool_choice none)."""

    messages: list[Message]
    tools: list[Message] | None
    json_schema: dict[str, object] | None
    names: frozenset[str]  # the tools a call may name; empty: do not parse calls
    forced: bool  # tool_choice required / named: the whole reply is one call
    single: bool = False  # parallel calls turned off: a reply makes at most one call
    lazy: LazyCalls | None = None  # tool_choice auto: a call held to its schema once started

    @property
    def preserved(self) -> tuple[str, ...]:
        """The special tokens the reply's text keeps (``CALL_MARKERS``) where its calls are
        parsed: the parser must see a call's markers, whatever tokens they are."""
        return CALL_MARKERS if self.names else ()

    def parts(self, text: str) -> list[Part]:
        """A whole reply as its texts and calls in order (``reply_parts``), keeping only the
        first call when parallel calls are off."""
        return reply_parts(text, self.names, single=self.single)

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole reply as (content, calls): every text of it joined, and its calls."""
        parts = self.parts(text)
        return content_of(parts), calls_of(parts)


def _content(message: ChatMessage, index: int) -> str | list[dict[str, object]]:
    """A message's content as the engine takes it: text, or parts with images and audio; an
    assistant's ``refusal`` is text it said, after its content (as a refusal part is)."""
    content = message.content
    refusal = message.refusal or ""
    if content is None:
        return refusal
    if isinstance(content, str):
        return content + refusal
    parts = engine_parts(content, f"messages.{index}.content")
    if not refusal:
        return parts
    if isinstance(parts, str):
        return parts + refusal
    return [*parts, {"type": "text", "text": refusal}]


def _arguments_object(arguments: str | Mapping[str, object]) -> object:
    if not isinstance(arguments, str):
        return dict(arguments)
    try:
        parsed: object = strict_loads(arguments) if arguments.strip() else {}
    # Kept as text, as any non-JSON arguments (NaN, an integer of more than 4,300 digits too).
    except (ValueError, RecursionError):
        return arguments
    # Templates recurse over the arguments; a pathologically deep value stays opaque text.
    return arguments if json_depth(parsed) > MAX_ARGUMENT_DEPTH else parsed


def _call_text(name: str, arguments: object) -> str:
    """A call of the history as the described tools' format writes it, and as a model writes
    it: its characters as they are (``json_text``), so the turn renders as it was generated
    and the next prompt shares the cached reply's tokens. Found by review: ``json.dumps``
    wrote ``"Zürich"`` as ``"Z\\u00fcrich"``, unlike the reply the cache held."""
    return "<tool_call>\n" + json_text({"name": name, "arguments": arguments}) + "\n</tool_call>"


_TEMPLATE_ID = re.compile(r"[A-Za-z0-9]{9}")


def template_id(call_id: str) -> str:
    """A call's id as a native template sees it. Mistral's templates refuse any id but 9
    letters and digits (theirs), so any other (``call_…``, Anthropic's ``toolu_…``) is shown as
    9 hex digits of its hash: the same for a call and its result, on every turn."""
    if _TEMPLATE_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


class _TemplateIds:
    """One conversation's call ids as a native template sees them (``template_id``), two
    different ids never shown as one: the first to take 9 characters keeps them, a later id
    they would also stand for gets others (of its hash and a count). Given in the order the
    conversation names them, so a longer conversation shows its start's ids as before."""

    def __init__(self) -> None:
        self._shown: dict[str, str] = {}
        self._taken: set[str] = set()

    def __call__(self, call_id: str) -> str:
        if (known := self._shown.get(call_id)) is not None:
            return known
        shown, n = template_id(call_id), 0
        while shown in self._taken:
            n += 1
            shown = hashlib.sha256(f"{n}:{call_id}".encode()).hexdigest()[:9]
        self._shown[call_id] = shown
        self._taken.add(shown)
        return shown


def template_messages(messages: Sequence[ChatMessage], *, native: bool) -> list[Message]:
    """OpenAI messages as chat-template input. Non-native templates see tool calls and tool
    results as text in the Hermes format, so history round-trips through any template."""
    out: list[Message] = []
    ids = _TemplateIds()
    for index, message in enumerate(messages):
        role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
        text = _content(message, index)
        item: Message = {"role": role, "content": text}
        if message.name:
            item["name"] = message.name
        if message.tool_calls:
            calls = [
                (c.function.name, _arguments_object(c.function.arguments))
                for c in message.tool_calls
            ]
            if native:
                item["tool_calls"] = [
                    {
                        "id": ids(call.id or f"call_{index}_{i}"),
                        "type": "function",
                        "function": {"name": name, "arguments": args},
                    }
                    for i, (call, (name, args)) in enumerate(
                        zip(message.tool_calls, calls, strict=True)
                    )
                ]
            else:
                blocks = "\n".join(_call_text(name, args) for name, args in calls)
                if isinstance(text, list):
                    item["content"] = [*text, {"type": "text", "text": "\n" + blocks}]
                else:
                    item["content"] = f"{text}\n{blocks}" if text else blocks
        if role == "tool":
            if native:
                if message.tool_call_id:
                    item["tool_call_id"] = ids(message.tool_call_id)
            elif isinstance(text, list):  # a result with images: they stay parts, in place
                opening = {"type": "text", "text": "<tool_response>\n"}
                closing = {"type": "text", "text": "\n</tool_response>"}
                item = {"role": "user", "content": [opening, *text, closing]}
            else:
                item = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
            if out and out[-1]["role"] == "user" and not native:
                out[-1] = joined_turns(out[-1], item)  # one turn of results, as Hermes templates do
                continue
        elif out and role == "user" and not native and index and _is_result(messages[index - 1]):
            out[-1] = joined_turns(out[-1], item)
            continue
        out.append(item)
    return out


def _is_result(message: ChatMessage) -> bool:
    return message.role in ("tool", "function")


def openai_tools(tools: Sequence[Tool]) -> list[Message]:
    return [tool.model_dump(mode="json", exclude_none=True) for tool in tools]


def tools_system_prompt(tools: Sequence[Tool]) -> str:
    # Their text as written (found by review: a description in French or Chinese reached the
    # model as ``\u`` escapes, unreadable and several tokens a character).
    signatures = "\n".join(json_text(t.model_dump(mode="json", exclude_none=True)) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The available "
        f"functions are:\n<tools>\n{signatures}\n</tools>\nTo call a function, reply with a JSON "
        'object {"name": <function-name>, "arguments": <args-object>} inside '
        "<tool_call></tool_call> tags."
    )


#: Keywords whose values are data, not schemas: a ``$ref`` string in them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(node: object, root: str) -> object:
    """``node`` with its document-local ``$ref``s (``#``, ``#/...``) pointing below ``root``
    (a JSON pointer of the place the schema now lies in a larger document)."""
    if isinstance(node, list):
        return [_rebased(item, root) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, object] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, root)
    return out


def _has_local_ref(node: object) -> bool:
    text = json.dumps(node)
    return '"$ref": "#' in text


_MISTRAL_ID: dict[str, object] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}


def forced_call_schema(tools: Sequence[Tool], *, with_id: bool = False) -> dict[str, object]:
    """A schema whose instances are exactly the calls of ``tools``. A tool's parameters that
    refer into themselves (``"$ref": "#/$defs/..."``, as pydantic writes nested models) keep
    resolving: they are copied under the wrapper's ``$defs`` and their references rebased
    there, since the wrapper, not the parameters, is the document's root now. ``with_id``:
    a call may end with the 9-character ``id`` Mistral's list format gives it."""
    variants: list[dict[str, object]] = []
    defs: dict[str, object] = {}
    for i, tool in enumerate(tools):
        parameters: object = tool.function.parameters or {"type": "object"}
        if _has_local_ref(parameters):
            parameters = _rebased(parameters, f"#/$defs/kvwarm-tool-{i}")
            defs[f"kvwarm-tool-{i}"] = parameters
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "arguments": parameters,
                    **({"id": _MISTRAL_ID} if with_id else {}),
                },
                "required": ["name", "arguments"],
            }
        )
    schema: dict[str, object] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "$defs": defs} if defs else schema


def check_tools(tools: Sequence[Tool]) -> None:
    """400s for tool definitions a reply's calls could not be told apart by (two of one name)
    or whose arguments would be no object (parameters of another ``type``: OpenAI's and
    Anthropic's rule; a call's arguments, an Anthropic ``tool_use`` input, are an object)."""
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise HTTPError(
                400,
                f"tools.{i}: the name {name!r} is taken by tools.{seen[name]}; tool names must "
                "be unique",
                code="invalid_value",
                param=f"tools.{i}",
            )
        seen[name] = i
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise HTTPError(
                400,
                f"tools.{i}: the parameters of {name!r} must be a JSON schema of type 'object', "
                f"not {kind!r}",
                code="invalid_value",
                param=f"tools.{i}",
            )


def plan_chat(
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool] | None,
    tool_choice: str | NamedToolChoice | None,
    *,
    renders_tools: bool,
    parallel: bool = True,
    system: bool = True,
    native_format: CallFormat | None = None,
) -> ChatPlan:
    """Decide how tools reach the model. ``renders_tools``: the template shows tools natively;
    ``native_format``: the format its calls take, where a lazy grammar can hold them (None:
    under tool_choice auto they are as the model writes them).
    ``parallel`` False (OpenAI's ``parallel_tool_calls``, Anthropic's
    ``disable_parallel_tool_use``): a reply makes at most one call. ``system`` False: the
    template does not show a system message (refuses or drops it), so described tools open
    the first user message.
    A forced call (``required``, a named function) with no tools is a 400, as in OpenAI's API:
    the reply could not be the call the client asked for."""
    if not tools and (tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)):
        choice = (
            f"names {tool_choice.function.name!r}"
            if isinstance(tool_choice, NamedToolChoice)
            else "is 'required'"
        )
        raise HTTPError(
            400,
            f"tool_choice {choice}, but the request has no tools",
            code="invalid_value",
            param="tool_choice",
        )
    check_tools(tools or ())
    if not tools or tool_choice == "none":
        plain = template_messages(messages, native=False)
        return ChatPlan(plain if system else system_folded(plain), None, None, frozenset(), False)
    chosen = list(tools)
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == tool_choice.function.name]
        if not chosen:
            raise HTTPError(
                400,
                f"tool_choice names {tool_choice.function.name!r}, which is not in tools",
                code="invalid_value",
                param="tool_choice",
            )
    forced = tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)
    schema = forced_call_schema(chosen) if forced else None
    names = frozenset(t.function.name for t in chosen)
    calls_format = native_format if renders_tools else "hermes"
    if calls_format in _NAMED_FORMATS and not all(
        _MISTRAL_NAME.fullmatch(t.function.name) for t in chosen
    ):
        calls_format = None  # a name the format's parser cannot read back: no grammar
    lazy = (
        LazyCalls(tuple(chosen), calls_format, not parallel)
        if not forced and calls_format is not None
        else None
    )
    if renders_tools:
        rendered = template_messages(messages, native=True)
        rendered = rendered if system else system_folded(rendered)
        return ChatPlan(rendered, openai_tools(chosen), schema, names, forced, not parallel, lazy)
    rendered = template_messages(messages, native=False)
    prompt = tools_system_prompt(chosen)
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {**rendered[0], "content": _appended(rendered[0]["content"], prompt)}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    rendered = rendered if system else system_folded(rendered)
    return ChatPlan(rendered, None, schema, names, forced, not parallel, lazy)


def _appended(content: object, prompt: str) -> object:
    """A system message's content with the described tools after it."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": f"\n\n{prompt}"}]
    return f"{content}\n\n{prompt}"


def _new_id() -> str:
    return "call_" + secrets.token_hex(12)


def _as_call(obj: object, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function")
    if isinstance(fn, dict):  # OpenAI-shaped {"function": {"name", "arguments"}}
        obj = fn
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:  # no arguments, or null: a call of a tool that takes none
        args = {}
    if isinstance(args, str):
        try:
            args = strict_loads(args)
        except (ValueError, RecursionError):  # not JSON, NaN, more than 4,300 digits
            return None
    return ToolCall(_new_id(), name, json_text(args))  # its characters as the model wrote them


_SEPARATORS = " \t\r\n;,"


def _json_run(text: str, pos: int = 0) -> tuple[list[object], int]:
    """The JSON values side by side in ``text`` from ``pos`` (a list's items one by one), and
    where the last one ends: a run stops at the first text that is not a JSON value."""
    decoder = STRICT_DECODER
    values: list[object] = []
    end = pos
    while True:
        while pos < len(text) and text[pos] in _SEPARATORS:
            pos += 1
        if pos >= len(text):
            break
        try:
            value, pos = decoder.raw_decode(text, pos)
        # Model output may nest without bound, hold NaN or an integer of 4,300+ digits.
        except (ValueError, RecursionError):
            break
        values.extend(value if isinstance(value, list) else [value])
        end = pos
    return values, end


def _calls_of(values: Sequence[object], names: frozenset[str]) -> list[ToolCall]:
    """The calls ``values`` are, all of them, or none: a value that is no call of a declared
    tool makes the whole run content."""
    calls = [c for v in values if (c := _as_call(v, names))]
    return calls if values and len(calls) == len(values) else []


#: A call found in a reply: where its text starts and ends, and the calls it makes.
Span = tuple[int, int, list[ToolCall]]


def block_spans(
    text: str, names: frozenset[str], pos: int = 0, endpos: int | None = None
) -> list[Span]:
    """The calls of the ``<tool_call>`` blocks in ``text[pos:endpos]``, in order (positions
    in ``text``). Each block stands alone: one that is not wholly calls of declared tools is
    text; one never closed (the end of the text) is its calls, then text."""
    spans: list[Span] = []
    end_at = len(text) if endpos is None else endpos
    for match in _TOOL_CALL_BLOCK.finditer(text, pos, end_at):
        body = match.group(1)
        values, end = _json_run(body)
        if not (calls := _calls_of(values, names)):
            continue
        if end == len(body):
            spans.append((match.start(), match.end(), calls))
        elif not match.group(0).endswith("</tool_call>"):  # never closed: text follows
            spans.append((match.start(), match.start(1) + end, calls))
    return spans


def _call_spans(text: str, names: frozenset[str]) -> list[Span]:
    """Where ``text`` makes calls, in order. ``<tool_call>`` blocks (the parser's first choice:
    any other marker in a reply that has one is text) each stand alone; a block that is not
    wholly calls of declared tools stays text."""
    spans: list[Span] = []
    if "<tool_call>" in text:
        return block_spans(text, names)
    if "<function=" in text:
        for match in _FUNCTION_TAG.finditer(text):
            name, body = match.group(1), match.group(2)
            values, end = _json_run(body)
            if end != len(body) or len(values) > 1:
                continue
            call = _as_call({"name": name, "arguments": values[0] if values else {}}, names)
            if call is not None:
                spans.append((match.start(), match.end(), [call]))
        return spans
    if (start := text.find("[TOOL_CALLS]")) >= 0 and _MISTRAL_CALL.match(text, start):
        return _mistral_spans(text, start, names)
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        if marker in text:
            start = text.index(marker)
            values, end = _json_run(text, start + len(marker))
            calls = _calls_of(values, names)
            return [(start, end, calls)] if calls else []
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):  # a reply that is a bare call (a forced call's shape)
        values, end = _json_run(text)
        calls = _calls_of(values, names)
        return [(0, end, calls)] if calls else []
    return []


#: Mistral's newer format (Mistral Small 3.2, Devstral, Magistral): a call is
#: ``[TOOL_CALLS]name[ARGS]{...}``, or ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``.
_MISTRAL_CALL = re.compile(r"\[TOOL_CALLS\]([\w.\-]+)(?:\[CALL_ID\][\w\-]*)?\[ARGS\]")


def _mistral_spans(text: str, start: int, names: frozenset[str]) -> list[Span]:
    """The calls of Mistral's ``[TOOL_CALLS]name[ARGS]{...}`` format from ``start``, one after
    another; all of them, or none when one is no call of a declared tool."""
    spans: list[Span] = []
    pos = start
    while match := _MISTRAL_CALL.match(text, pos):
        at = match.end()
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
        try:
            arguments, end = STRICT_DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):  # not JSON, NaN, 4,300+ digits, too deep
            return []
        call = _as_call({"name": match.group(1), "arguments": arguments}, names)
        if call is None:
            return []
        spans.append((match.start(), end, [call]))
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
    return spans


def reply_parts(text: str, names: frozenset[str], *, single: bool = False) -> list[Part]:
    """A whole reply as its text and calls, in order. Without a call the reply is one text,
    as it came; with calls, the text around them is kept (none of it is dropped), stripped
    where it touches a call, and text that is only whitespace goes. ``single``: parallel
    calls are off, only the first call is kept (the text after later ones too)."""
    spans = _call_spans(text, names) if names else []
    return parts_of_spans(text, spans, single=single)


def parts_of_spans(
    text: str,
    spans: Sequence[Span],
    *,
    start: int = 0,
    end: int | None = None,
    after_call: bool = False,
    single: bool = False,
) -> list[Part]:
    """``text[start:end]`` as its texts and the calls of ``spans`` (found in it), in order
    (``reply_parts``' rule). ``after_call``: a call of the reply comes right before ``start``
    (so the first text is stripped where it touches it; with ``single``, every later call
    goes and the texts join): a stream parses a reply from its last call on this way."""
    stop = len(text) if end is None else end
    if not spans and not after_call:
        return [text[start:stop]] if stop > start else []
    parts: list[Part] = []
    pos = start
    for begin, finish, calls in spans:
        before = text[pos:begin]
        before = before.rstrip() if pos == start and not after_call else before.strip()
        if before:
            parts.append(before)
        parts.extend(calls)
        pos = finish
    after = text[pos:stop].strip()
    if after:
        parts.append(after)
    if single and after_call:  # the first call came before: later ones go, texts join
        texts = [p for p in parts if isinstance(p, str)]
        return [TEXT_SEPARATOR.join(texts)] if texts else []
    if single and spans:  # the later calls go; the texts they stood between join as calls' do
        first = next(i for i, p in enumerate(parts) if isinstance(p, ToolCall))
        kept = parts[: first + 1]
        for part in parts[first + 1 :]:
            if isinstance(part, str):
                if isinstance(kept[-1], str):
                    kept[-1] += TEXT_SEPARATOR + part
                else:
                    kept.append(part)
        parts = kept
    return parts


#: What joins a reply's texts into the one ``content`` string OpenAI's chat (and Responses'
#: one message item) has: the calls stood between them.
TEXT_SEPARATOR = "\n\n"


def content_of(parts: Sequence[Part]) -> str:
    return TEXT_SEPARATOR.join(p for p in parts if isinstance(p, str))


def calls_of(parts: Sequence[Part]) -> list[ToolCall]:
    return [p for p in parts if isinstance(p, ToolCall)]


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]]:
    """Split a reply into (content, calls). With no recognised call the text is all content;
    with calls, the content is every text around them (``reply_parts``, ``content_of``)."""
    parts = reply_parts(text, names)
    return content_of(parts), calls_of(parts)
