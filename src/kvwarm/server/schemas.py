"""Request bodies of the OpenAI-compatible endpoints (pydantic, validated, extras ignored).

Invariant: unknown fields are ignored (clients send vendor extensions), but a known field of the
wrong type is a 400 naming the field: every body model is a ``JsonBody``, validated strictly
(no ``true`` for 1, no ``"3"`` for 3, no ``1`` for true). Bodies are parsed from bytes we read
ourselves (``read_json``), so oversized and malformed bodies get OpenAI-shaped errors too, and a
lone UTF-16 surrogate anywhere in a body is a 400 naming its path (``kvwarm.unicode``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Strict,
    StrictInt,
    Tag,
    ValidationError,
    model_validator,
)
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from kvwarm.engine.types import MAX_DRAFT_TOKENS, SpecType
from kvwarm.server.errors import HTTPError
from kvwarm.server.tenancy import MAX_SALT_CHARS
from kvwarm.settings import Settings
from kvwarm.unicode import find_lone_surrogate

_INT32_MAX = (1 << 31) - 1


def keep_alive_field() -> Any:
    """Ollama's ``keep_alive``: how long the model stays loaded after this request."""
    return Field(
        default=None,
        description="how long the model stays loaded once idle after this request: seconds, "
        'or a duration as "5m" or "1h30m"; 0 unloads it when this request ends, a negative '
        "value keeps it loaded (default: the server's model_idle_unload_s)",
    )


def spec_type_field() -> Any:
    """A request's speculative decoding (``engine/worker/drafts.py``), on every generating
    body (the OpenAI ones, and as kvwarm's extension Anthropic's and the Responses API's);
    llama-server's "speculative.type" is accepted too. None: the model's."""
    return Field(
        default=None,
        validation_alias=AliasChoices("spec_type", "speculative.type"),
        description="speculative decoding: none, ngram-simple, ngram-map-k, ngram-map-k4v, "
        "ngram-mod, ngram-cache or draft-simple (default: the model's spec_type); a speed "
        "hint, the output is the same",
    )


def spec_draft_max_field() -> Any:
    """The most tokens one of a request's drafts holds (``spec_type_field``'s bodies);
    llama-server's "speculative.n_max" is accepted too."""
    return Field(
        default=None,
        ge=0,
        le=MAX_DRAFT_TOKENS,
        validation_alias=AliasChoices("spec_draft_max", "speculative.n_max"),
        description="speculative decoding: the most tokens one draft holds (0: none)",
    )


def _salt_field() -> Any:
    return Field(
        default=None,
        min_length=1,
        max_length=MAX_SALT_CHARS,
        description="cache namespace: requests share cached prompts only with the same salt",
    )


@functools.cache
def _defaulted_names(model: type[BaseModel]) -> frozenset[str]:
    """The body keys (names and aliases) of ``model``'s fields that have a non-null default."""
    names: set[str] = set()
    for name, field in model.model_fields.items():
        if field.is_required() or field.get_default(call_default_factory=True) is None:
            continue
        names.add(name)
        if field.alias:
            names.add(field.alias)
        alias = field.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
        names.update(c for c in choices if isinstance(c, str))
    return frozenset(names)


class JsonBody(BaseModel):
    """A request body, or a part of one, as JSON writes it: pydantic's strict mode, so a known
    field of the wrong type is a 400 naming it rather than a value read into it. Found by
    review: lax types read ``"n": true`` as 1, ``"echo": "yes"`` as true, ``"best_of": "2"``
    as 2. The rule, for every body the server takes:

    - a boolean is a JSON boolean; a string a JSON string; a number (``float``) a JSON number,
      an integer taken as a float;
    - an integer is a JSON integer; a count or setting (``JsonInt``: token counts, ``n``,
      ``top_k``, ``seed``, ``dimensions``, ``top_n``, ``bytes``...) also takes an integral float
      such as 3.0, as llama-server reads its integers; an id (``TokenIds``, a LoRA adapter's
      ``id``) is a JSON integer only, as llama-server reads a prompt's token ids.

    Deliberate exceptions: free-form values are any JSON (``dict[str, object]``: a tool's
    JSON schema, a tool call's input), and fields read only to be refused by name are typed
    ``object`` (chat's ``functions`` and ``best_of``). Unknown fields are ignored
    (``extra="ignore"``) unless a body says otherwise (the admin bodies forbid them)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    # {field: the name the body gave it}, for each field given under another of its names
    # (llama-server's ``speculative.type`` for ``spec_type``): set by ``parse_body``.
    _sent_as: dict[str, str] = PrivateAttr(default_factory=dict)

    def sent_as(self) -> dict[str, str]:
        """The fields the client gave under another of their names, each with that name: an
        error about one names what the client sent (``convert.rename``)."""
        return dict(self._sent_as)


class NullMeansDefault(JsonBody):
    """A body whose optional fields take ``null`` as "not given". OpenAI's API declares them
    nullable (``"n": null``, ``"stream": null``, ``"store": null``...) and clients built on
    its spec send that (a 400 for it would refuse a valid request)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        defaulted = _defaulted_names(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


class _Body(NullMeansDefault):
    """An OpenAI-style body (or part): strict (``JsonBody``), ``null`` as "not given"."""


#: A number in a body: a JSON number only (an integer is taken as a float; true and "1" are not).
StrictNumber = Annotated[float, Strict()]


def _json_number(value: Any) -> Any:
    if isinstance(value, bool | str):
        raise ValueError("must be a JSON number, not a boolean or a string")
    return value


#: A count or a sampler's integer in a body: a JSON number (an integral float such as 3.0 is
#: taken, as llama-server takes it; true and "3" are not). Found by review: pydantic's lax
#: ``int`` read ``"top_k": true`` as 1 and ``"max_tokens": "5"`` as 5. ``Strict(False)``: the
#: bodies are strict (``JsonBody``), which alone would refuse 3.0.
JsonInt = Annotated[int, Strict(False), BeforeValidator(_json_number)]

#: A token id in a body: a JSON integer only. Found by review: pydantic's lax ``int`` took
#: ``true`` as token 1 and ``2.0`` as token 2 (``"input": [true]`` embedded token 1).
TokenIds = list[StrictInt]


class StreamOptions(_Body):
    include_usage: bool = False


class LoraItem(JsonBody):
    """llama-server's per-request adapter: its id (``GET /lora-adapters``) and scale."""

    model_config = ConfigDict(extra="forbid")

    # JSON numbers only (found by review: lax types took true as id 1 and scale 1.0, "0.5"
    # as a scale).
    id: StrictInt = Field(ge=0, le=_INT32_MAX)
    scale: StrictNumber = 0.0  # llama-server's default: an id listed without a scale stays off


def lora_pairs(items: list[LoraItem] | None) -> list[tuple[int, float]] | None:
    return None if items is None else [(item.id, item.scale) for item in items]


class SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    # JSON numbers only (found by review: "temperature": true sampled at 1.0, "0.5" at 0.5).
    max_tokens: JsonInt | None = Field(default=None, ge=0)
    temperature: StrictNumber | None = None
    top_p: StrictNumber | None = None
    top_k: JsonInt | None = Field(default=None, le=_INT32_MAX)  # a C int in llama.cpp
    min_p: StrictNumber | None = None
    # llama-server's locally typical sampling (found by review: ignored, as an unknown field).
    typical_p: StrictNumber | None = None
    repeat_penalty: StrictNumber | None = None
    frequency_penalty: StrictNumber | None = None
    presence_penalty: StrictNumber | None = None
    # Any 64-bit seed is accepted; the samplers take it modulo 2**32 (convert.options).
    seed: JsonInt | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Choices per prompt, prefilled once; the model's n_parallel caps it (a 400 above).
    n: JsonInt = Field(default=1, ge=1, le=64)
    grammar: str | None = None  # llama.cpp extension: a GBNF grammar
    logit_bias: dict[str, StrictNumber] | None = None  # token id (a string) -> bias in [-100, 100]
    ignore_eos: bool = False  # llama.cpp extension: never stop on an end-of-generation token
    cache_salt: str | None = _salt_field()  # vLLM's field (server/tenancy.py)
    # Speculative decoding for this request (engine/worker/drafts.py); llama-server's
    # "speculative.type" and "speculative.n_max" are accepted too. None: the model's.
    spec_type: SpecType | None = spec_type_field()
    spec_draft_max: JsonInt | None = spec_draft_max_field()
    # llama-server's: the adapters this request runs under (others off); server/lora.py.
    lora: list[LoraItem] | None = Field(default=None, max_length=64)
    keep_alive: float | str | None = keep_alive_field()  # Ollama's (server/registry.py)
    user: str | None = Field(
        default=None,
        description="the end user this request is for (OpenAI's): named in the server's "
        "request log line; it changes nothing in the reply",
    )


def refuse_moderation(moderation: object | None) -> None:
    """400 for a request asking for OpenAI's moderation (chat, Responses): kvwarm has no
    moderation model to score the input and output with, nor to block them by."""
    if moderation is not None:
        raise HTTPError(
            400,
            "moderation is not supported: this server runs no moderation model; moderate "
            "the input and the reply in the client",
            code="unsupported_parameter",
            param="moderation",
        )


def check_sampling(req: SamplingFields) -> None:
    """What OpenAI refuses and validation alone does not: ``stream_options`` without a stream
    (its usage chunk would never come)."""
    if req.stream_options is not None and not req.stream:
        raise HTTPError(
            400,
            "stream_options is only allowed with stream: true",
            code="invalid_value",
            param="stream_options",
        )


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")  # llama.cpp style


class LineStops(SamplingFields):
    """llama-server's line stops of code completion (llama.vim's, llama.vscode's), which its
    ``/infill``, ``/completion`` and ``/v1/completions`` read: 0 or below is off, as
    llama-server reads them (``GenerationOptions.n_indent``, ``t_max_predict_ms``)."""

    n_indent: JsonInt = 0
    t_max_predict_ms: JsonInt = -1


class CompletionRequest(LineStops):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    suffix: str | None = None  # fill-in-the-middle: the text after the completion
    # OpenAI's: this many candidates per prompt (n at least; the model's n_parallel caps it,
    # as it caps n), the n with the highest mean logprob per token returned; not streamed.
    best_of: JsonInt | None = Field(default=None, ge=1, le=64)
    logprobs: JsonInt | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    response_format: ResponseFormat | None = None


class ExtraChunk(_Body):
    """An ``input_extra`` file. ``text`` is required, as llama-server requires it (found by
    review: a chunk without it, say one sending ``content``, was taken as an empty file, its
    context dropped without a word)."""

    text: str
    filename: str = "tmp"


class LlamaFields(LineStops):
    """llama-server's own fields of a generation in its shape (``/infill``, ``/completion``)."""

    n_predict: JsonInt | None = Field(default=None, ge=-1)  # llama-server's max_tokens; -1: default
    # llama-server's: the top tokens' logprobs of each token (completion_probabilities), the
    # generated ids in ``tokens``, and the final body cut to these fields ("a/b" unnested).
    n_probs: JsonInt = Field(default=0, ge=0, le=20)
    return_tokens: bool = False
    response_fields: list[str] | None = Field(default=None, max_length=256)
    # The reply constrained to this JSON schema, as ``grammar`` constrains it (found by review:
    # declared on /completion only, /infill ignored it and answered unconstrained).
    json_schema: dict[str, object] | None = None
    # Refused unless "off" (llama-server's defaults): kvwarm has no such sampler or control
    # (``completions.refuse_unsupported``). Found by review: declared on /completion only, so
    # /infill dropped them silently (a mirostat or DRY request sampled without either).
    id_slot: JsonInt = -1
    cache_prompt: bool = True
    mirostat: JsonInt = 0
    dry_multiplier: StrictNumber = 0.0
    xtc_probability: StrictNumber = 0.0
    top_n_sigma: StrictNumber = -1.0
    dynatemp_range: StrictNumber = 0.0
    repeat_last_n: JsonInt = 64
    min_keep: JsonInt = 0
    samplers: str | list[str] | None = None
    timings_per_token: bool = False
    return_progress: bool = False
    post_sampling_probs: bool = False


class InfillRequest(LlamaFields):
    """llama-server's ``/infill``: the code before and after the gap, optional context files,
    and ``prompt``, the start of the middle already written."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""


class LlamaCompletionRequest(LlamaFields):
    """llama-server's ``/completion``: a prompt (text, token ids, or a list of them) continued,
    answered in llama-server's shape. Its fields kvwarm cannot honour are declared so that a
    value other than their "off" one is a 400 naming them (``completions.refuse_unsupported``),
    never a field silently dropped."""

    prompt: str | TokenIds | list[str | TokenIds]
    # llama-server's name for n: choices per prompt.
    n: JsonInt = Field(default=1, ge=1, le=64, validation_alias=AliasChoices("n", "n_cmpl"))


class ImageUrl(_Body):
    url: str
    detail: str | None = None  # accepted and ignored: the projector decides the resolution


class InputAudio(_Body):
    data: str  # base64
    format: str | None = None


class ContentPart(_Body):
    """A chat message's content part: ``text``, ``image_url`` (a base64 data: URI, or an
    http(s) URL from a host ``media_fetch_hosts`` lists) or ``input_audio`` (base64 WAV)."""

    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant's ``refusal`` part: its text, as said
    image_url: ImageUrl | str | None = None
    input_audio: InputAudio | None = None
    #: Where the part was in the request as the client sent it (another API's body
    #: translated into chat messages): what an error about it names.
    _where: str | None = PrivateAttr(default=None)


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, object] = ""


class ToolCallIn(_Body):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    # An assistant's refusal, as OpenAI returns it ({"content": null, "refusal": "..."}): the
    # text it said, after its content (found by review: dropped, the turn shown empty).
    refusal: str | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, object] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionTools(_Body):
    """A body whose ``tools`` are OpenAI's chat tools: one of another type (OpenAI's
    ``custom`` tools, a hosted tool) is a 400 ``unsupported_tool`` naming it, as the Responses
    and Anthropic routes answer one (found by review: ``invalid_value``, which said the request
    was wrong where it asks what kvwarm cannot run)."""

    @model_validator(mode="before")
    @classmethod
    def _function_tools_only(cls, data: Any) -> Any:
        tools = data.get("tools") if isinstance(data, dict) else None
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type", "function") if isinstance(tool, dict) else "function"
            if isinstance(kind, str) and kind != "function":
                # Not a ValueError: pydantic passes it on as raised, a 400 of this code.
                raise HTTPError(
                    400,
                    f"tools.{i}: {kind!r} tools are not supported; only function tools",
                    code="unsupported_tool",
                    param=f"tools.{i}.type",
                )
        return data


class NamedToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class AllowedTools(_Body):
    mode: Literal["auto", "required"]
    # Tool references, as OpenAI writes them: {"type": "function", "function": {"name"}}
    # (chat) or {"type": "function", "name"} (Responses).
    tools: list[dict[str, object]] = Field(min_length=1)

    def names(self, param: str) -> list[str]:
        """The function names the references give; 400 for one that names none."""
        out: list[str] = []
        for i, ref in enumerate(self.tools):
            fn = ref.get("function")
            name = fn.get("name") if isinstance(fn, dict) else ref.get("name")
            if not isinstance(name, str) or not name:
                raise HTTPError(
                    400,
                    f"{param}.{i} names no function",
                    code="invalid_value" if name == "" else "invalid_type",
                    param=f"{param}.{i}",
                )
            out.append(name)
        return out


class AllowedToolsChoice(_Body):
    """OpenAI's ``allowed_tools`` choice: calls only to these tools, optionally forced."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def choice_type(value: object) -> str | None:
    """A ``tool_choice`` object's ``type`` (its union's discriminator)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


#: A ``tool_choice`` object, told apart by its ``type`` (so an error names the right one).
ToolChoiceObject = Annotated[
    Annotated[NamedToolChoice, Tag("function")]
    | Annotated[AllowedToolsChoice, Tag("allowed_tools")],
    Discriminator(choice_type),
]


class PredictionPart(_Body):
    type: Literal["text"]
    text: str


class Prediction(_Body):
    """OpenAI's predicted output (``{"type": "content", "content": ...}``): text the reply
    is expected to repeat for the most part, drafted where the model speculates
    (``GenerationOptions.prediction``)."""

    type: Literal["content"]
    content: str | list[PredictionPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(SamplingFields, FunctionTools):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JsonInt | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool = True  # False: a reply makes at most one tool call
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: JsonInt | None = Field(default=None, ge=0, le=20)
    # OpenAI's deprecated function calling, read only to refuse it: ignored, a client relying
    # on it would get text where it expects a call.
    functions: list[object] | None = None
    function_call: object | None = None
    # The legacy completions' best_of, which OpenAI's chat API does not have: read only to
    # refuse it (a client sending it would get n choices, none chosen from more).
    best_of: object | None = None
    # OpenAI's output modalities: "text" is what every reply is; "audio" (and ``audio``, the
    # voice and format of an audio reply) is refused, not ignored: a client asking for audio
    # would get a text reply whose message.audio is null (found by review).
    modalities: list[str] | None = None
    audio: object | None = None
    # OpenAI's moderation of the input and output (a policy of "block" withholds what it
    # flags): kvwarm runs no moderation model, so it is refused, not ignored (found by
    # review: served unmoderated without a word). Null asks for none.
    moderation: object | None = None
    prediction: Prediction | None = None


class EmbeddingRequest(_Body):
    model: str | None = None
    keep_alive: float | str | None = keep_alive_field()  # Ollama's (server/registry.py)
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    # OpenAI's shortened embeddings: the first ``dimensions`` values, scaled to unit length.
    dimensions: JsonInt | None = Field(default=None, ge=1)
    # llama-server's per-request adapters, as a completion's (found by review: the field was
    # ignored, unknown to the body, and the embedding ran under the global scales).
    lora: list[LoraItem] | None = Field(default=None, max_length=64)


class LlamaEmbeddingRequest(_Body):
    """llama-server's ``/embedding`` (``/embeddings``): ``content`` (or ``input``) as text,
    token ids or a list of them; ``embd_normalize`` 2 (unit length) or -1 (none)."""

    model: str | None = None
    keep_alive: float | str | None = keep_alive_field()  # Ollama's (server/registry.py)
    content: str | TokenIds | list[str | TokenIds] | None = None
    input: str | TokenIds | list[str | TokenIds] | None = None
    embd_normalize: JsonInt = 2
    lora: list[LoraItem] | None = Field(default=None, max_length=64)  # as a completion's


class RerankDocument(_Body):
    """A document as an object (Jina's, Cohere v1's): its ``text`` is what is ranked."""

    text: str


class RerankRequest(_Body):
    """``/v1/rerank``: Jina's and Cohere's shape (v1: documents as texts or ``{"text"}``,
    ``return_documents``; v2: ``max_tokens_per_doc``), as llama-server's ``/v1/rerank``."""

    model: str | None = None
    keep_alive: float | str | None = keep_alive_field()  # Ollama's (server/registry.py)
    query: str
    documents: list[str | RerankDocument]
    # Counts (found by review: pydantic's lax int took true as top_n 1, which Model.rerank
    # itself refuses, and "2" as 2); an integral 2.0 is taken, as for every count (JsonBody).
    top_n: JsonInt | None = Field(
        default=None, ge=1, description="return the best n (default: all)"
    )
    return_documents: bool = Field(
        default=False, description="put each result's document in the answer"
    )
    max_tokens_per_doc: JsonInt | None = Field(
        default=None, ge=1, description="cut each document to this many tokens (Cohere v2)"
    )
    cache_salt: str | None = _salt_field()
    lora: list[LoraItem] | None = Field(default=None, max_length=64)  # as a completion's


class TokenizeRequest(_Body):
    model: str | None = None
    content: str
    add_special: bool = True
    parse_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


class PrewarmRequest(FunctionTools):
    model: str | None = None
    # Text or token ids, as documented (found by review: ids were refused, a 400).
    prompt: str | TokenIds | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    ttl_class: Literal["short", "long", "extended"] = "long"
    keep_alive: bool = True
    cache_salt: str | None = _salt_field()
    # With cache_salt_from_auth: whose scope to fill instead of the caller's (server/tenancy.py).
    tenant_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="prewarm as a request presenting this API key (cache_salt_from_auth)",
    )
    shared: bool = Field(
        default=False,
        description="prewarm as a request presenting no key (cache_salt_from_auth)",
    )


class EvictRequest(_Body):
    bytes: JsonInt = Field(ge=0)
    # Tier names as configured (any store may be configured by URL under any name).
    # At least one (left out: every tier); an empty list freed nothing and answered 200.
    tiers: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_]{1,64}$")]] | None = Field(
        default=None, min_length=1
    )


def json_body(model: type[BaseModel], *, streams: bool = False) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as a route's JSON request body. The routes read
    their bodies themselves (``read_json``), so FastAPI cannot see them; this puts them in
    ``/openapi.json`` for clients and for the schema-driven tests. Definitions are inlined so
    the fragment stands alone. ``streams``: the 200 may also be an SSE stream (``stream``)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    extra: dict[str, Any] = {"requestBody": {"required": True, "content": content}}
    if streams:
        extra["responses"] = {"200": {"content": {"text/event-stream": {"schema": {}}}}}
    return extra


def _not_json(name: str) -> object:
    """Python's decoder accepts ``NaN`` and ``Infinity``; JSON does not, and a value echoed
    back (a tool's schema in a stored response, a tool call's arguments) could then never be
    sent as JSON."""
    raise ValueError(f"{name} is not a JSON value")


def strict_loads(text: str) -> object:
    """``json.loads`` of JSON alone: ``ValueError`` for ``NaN``/``Infinity`` (and, as
    ``json.loads``, for malformed text or an integer of more than 4,300 digits)."""
    return json.loads(text, parse_constant=_not_json)


#: ``json.JSONDecoder`` of JSON alone (``strict_loads``), for ``raw_decode`` scans.
STRICT_DECODER = json.JSONDecoder(parse_constant=_not_json)


async def read_json(request: Request, settings: Settings) -> object:
    """The request body as JSON. 413 past ``settings.max_body_bytes`` (checked on the declared
    length first, then while reading, so a lying or chunked client cannot make us buffer more);
    400 ``json_too_deep`` past ``settings.max_json_depth`` nested arrays/objects, so nothing
    downstream (validation, schema conversion, templates) ever recurses on an unbounded input.
    A client gone before its body ends is a 400 ``incomplete_body``."""
    max_bytes = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        # The client's doing, not ours: a 400 (to no one), not an "unexpected error" logged
        # with its traceback and counted as a 500 for every cut-short body.
        raise HTTPError(
            400, "the client went away before sending the whole body", code="incomplete_body"
        ) from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise HTTPError(
            400, "the request body is empty; expected a JSON object", code="invalid_json"
        )
    if len(raw) > _PARSE_INLINE_BYTES:
        # An 8 MB body took ~2 s to decode and check: off the event loop, so the requests
        # of other clients go on meanwhile (issue 41).
        return await run_in_threadpool(_decoded, raw, settings)
    return _decoded(raw, settings)


#: Bodies up to this size are decoded on the event loop (a thread hop costs more than that).
_PARSE_INLINE_BYTES = 64 << 10
# A lone surrogate can enter only through a \uD800-\uDFFF escape: the body's text is decoded
# strictly (``_text``), and no strictly decoded text holds one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _text(raw: bytes) -> str:
    """A body's text, in the encoding ``json.loads`` detects (RFC 8259's UTF-8, or UTF-16/32),
    decoded strictly. Found by review: ``json.loads`` of bytes decodes with ``surrogatepass``,
    so a lone surrogate sent as raw bytes (UTF-8's ``ED A0 80``, or in a UTF-16/32 body) went
    past the escape check below: a Responses body's ``metadata`` ran a whole generation, was
    stored, then failed to serialise (a 500)."""
    encoding = json.detect_encoding(raw)
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise HTTPError(
            400,
            f"the request body is not valid {encoding.removesuffix('-sig').upper()} text: "
            f"{exc.reason} at byte {exc.start}",
            code="invalid_json",
        ) from None


def _decoded(raw: bytes, settings: Settings) -> object:
    """``read_json``'s decoding and checks of a whole body."""
    text = _text(raw)
    try:
        data = strict_loads(text)
    # ValueError too: an integer literal of more than 4,300 digits is refused by int() itself.
    except ValueError as exc:
        raise HTTPError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from exc
    except RecursionError as exc:  # deeper than the C decoder's recursion limit
        raise _too_deep(settings.max_json_depth) from exc
    if json_depth(data) > settings.max_json_depth:
        raise _too_deep(settings.max_json_depth)
    # JSON escapes can spell lone surrogates ("\ud800"), which no text field can carry on.
    where = find_lone_surrogate(data) if _SURROGATE_ESCAPE.search(text) else None
    if where is not None:
        raise HTTPError(
            400,
            f"{where}: contains a lone UTF-16 surrogate; text must be valid Unicode",
            code="invalid_value",
            param=where,
        )
    return data


def json_depth(value: object) -> int:
    """How deeply arrays/objects nest in ``value`` (a scalar is 0); iterative, so any depth
    is measured without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[object]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children)
    return deepest


def _too_deep(limit: int) -> HTTPError:
    return HTTPError(
        400, f"the request body nests arrays/objects deeper than {limit}", code="json_too_deep"
    )


def _too_large(max_bytes: int) -> HTTPError:
    return HTTPError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")


_M = TypeVar("_M", bound=BaseModel)
# Union members and validator wrappers appear in pydantic locations; they are not field names.
_LOC_NOISE = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _param(loc: tuple[int | str, ...]) -> str | None:
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (p.lower() not in _LOC_NOISE and "[" not in p and "-" not in p)
    ]
    return ".".join(parts) or None


#: pydantic's errors for a value of the right JSON type that the field does not take (past a
#: bound, too short or long): server.md's 400 ``invalid_value``, and so is a string that is not
#: one of a field's choices (the API's choices are strings: a number there is a wrong type).
#: Every other failure (a wrong type, a missing field, the wrong shape) is ``invalid_type``.
#: Found by the docs run: ``"n": 0`` was ``invalid_type`` beside ``"n": 9``'s ``invalid_value``.
_VALUE_ERRORS = frozenset(
    {
        "greater_than",
        "greater_than_equal",
        "less_than",
        "less_than_equal",
        "multiple_of",
        "too_short",
        "too_long",
        "string_too_short",
        "string_too_long",
        "string_pattern_mismatch",
    }
)
_CHOICE_ERRORS = frozenset({"literal_error", "enum"})


def value_refused(error: Mapping[str, Any]) -> bool:
    """Whether a pydantic validation failure (one of ``errors()``' items) is of a value the
    field does not take (``invalid_value``), not of its type or shape (``invalid_type``)."""
    kind = error.get("type")
    return kind in _VALUE_ERRORS or (kind in _CHOICE_ERRORS and isinstance(error.get("input"), str))


def _within(path: str | None, field: str | None) -> bool:
    if path is None or field is None:
        return path == field
    return path == field or path.startswith(field + ".")


def check_count(data: object, field: str, limit: int, setting: str) -> None:
    """400 for a body whose list ``field`` holds more than ``limit`` items (texts, messages,
    token lists), counted on the parsed JSON before validation builds an object per item. A
    list of bare token ids is one item (one tokenized prompt or input)."""
    items = data.get(field) if isinstance(data, dict) else None
    if not isinstance(items, list) or len(items) <= limit:
        return
    count = sum(1 for item in items if not isinstance(item, int) or isinstance(item, bool))
    if count > limit:
        raise HTTPError(
            400,
            f"{field} holds {count} items, more than this server's limit of {limit} "
            f"(setting {setting})",
            param=field,
            code="invalid_value",
        )


@functools.cache
def _alias_groups(model: type[BaseModel]) -> tuple[tuple[str, ...], ...]:
    """The body keys of each of ``model``'s fields that has several (``AliasChoices``)."""
    groups = []
    for field in model.model_fields.values():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names = tuple(c for c in alias.choices if isinstance(c, str))
            if len(names) > 1:
                groups.append(names)
    return tuple(groups)


def _one_value_per_field(data: dict[str, Any], model: type[BaseModel]) -> None:
    """A 400 where a body gives one field under two of its names with other values (kvwarm's
    ``spec_type`` and llama-server's ``speculative.type``): pydantic takes the first name
    given and drops the other (found by review: silently)."""
    for names in _alias_groups(model):
        given = [name for name in names if name in data]
        first = data[given[0]] if given else None
        for other in given[1:]:
            value = data[other]
            # JSON's true is not 1 (Python's is): a boolean and a number differ.
            if value != first or isinstance(value, bool) != isinstance(first, bool):
                raise HTTPError(
                    400,
                    f"{given[0]} and {other} name one field: give one of them, or the same "
                    "value to both",
                    code="invalid_value",
                    param=other,
                )


def parse_body(data: object, model: type[_M]) -> _M:
    """Validate ``data``; the first problem becomes a 400 naming the offending field."""
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object", code="invalid_json")
    _one_value_per_field(data, model)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        param = _param(tuple(errors[0]["loc"]))
        # A union field fails once per branch ("not a string", then the list's real problem):
        # report the deepest failure within the first failing field, the one that says why.
        same = [e for e in errors if _within(_param(tuple(e["loc"])), param)]
        first = max(same, key=lambda e: len(_param(tuple(e["loc"])) or ""))
        param = _param(tuple(first["loc"]))
        count = exc.error_count()
        more = f" (and {count - 1} more)" if count > 1 else ""
        raise HTTPError(
            400,
            f"{param or 'body'}: {first['msg']}{more}",
            code="invalid_value" if value_refused(first) else "invalid_type",
            param=param,
        ) from exc
    if isinstance(body, JsonBody):
        for names in _alias_groups(model):
            given = next((name for name in names if name in data), names[0])
            if given != names[0]:
                body._sent_as[names[0]] = given
    return body
