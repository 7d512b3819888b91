"""Request body of the OpenAI Responses API (``POST /v1/responses``).

Invariant: as for the chat bodies (``schemas.py``), unknown fields are ignored and a known field
of the wrong type is a 400 naming it. Input items are told apart by ``type`` (a message may omit
it, as OpenAI's "easy" input messages do); content and items kvwarm cannot use (files, hosted
tools, item references) parse, so that the conversion refuses them by name. Images
(``input_image``) and audio (``input_audio``) reach a model with a projector (``--mmproj``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag

from kvwarm.engine.types import SpecType
from kvwarm.server.schemas import (
    JsonInt,
    NullMeansDefault,
    StrictNumber,
    choice_type,
    keep_alive_field,
    spec_draft_max_field,
    spec_type_field,
)
from kvwarm.server.tenancy import MAX_SALT_CHARS


class _Body(NullMeansDefault):
    """A Responses body (or part): strict types, unknown fields ignored, ``null`` as "not
    given" (``NullMeansDefault``)."""


class TextPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: str


class MediaPart(_Body):
    """Files: parsed only to be refused by name."""

    type: Literal["input_file"]


class ImagePart(_Body):
    """An image: ``image_url`` a base64 data: URI (or a URL from a host the server may fetch
    from); a stored ``file_id`` is refused."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class AudioData(_Body):
    data: str
    format: str | None = None


class AudioPart(_Body):
    type: Literal["input_audio"]
    input_audio: AudioData


ContentPart = Annotated[
    TextPart | RefusalPart | MediaPart | ImagePart | AudioPart, Field(discriminator="type")
]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str = Field(min_length=1)
    arguments: str = ""
    id: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(_Body):
    """A previous turn's reasoning, which a client sends back; not part of the prompt."""

    type: Literal["reasoning"]


class ItemReference(_Body):
    """A stored item named by id: refused (use ``previous_response_id``)."""

    type: Literal["item_reference"]
    id: str


def _item_type(value: object) -> str:
    if isinstance(value, dict):
        kind = value.get("type") or "message"  # absent or null: an "easy" input message
        return kind if isinstance(kind, str) else ""
    return str(getattr(value, "type", ""))


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ItemReference, Tag("item_reference")],
    Discriminator(_item_type),
]


class FunctionTool(_Body):
    # Hosted tools (web_search, file_search, ...) carry other types and are refused by name.
    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)


class AllowedToolsChoice(_Body):
    """OpenAI's ``allowed_tools`` choice, as the Responses API writes it (flat)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, object]] = Field(min_length=1)


#: A ``tool_choice`` object, told apart by its ``type``: an error names the field of the one
#: meant (a plain union named the other's missing fields: ``{"type": "function", "name": 5}``
#: was "tool_choice.AllowedToolsChoice.tools: Field required").
ToolChoiceObject = Annotated[
    Annotated[FunctionChoice, Tag("function")]
    | Annotated[AllowedToolsChoice, Tag("allowed_tools")],
    Discriminator(choice_type),
]


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    keep_alive: float | str | None = keep_alive_field()  # Ollama's (server/registry.py)
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    max_output_tokens: JsonInt | None = Field(default=None, ge=1)
    temperature: StrictNumber | None = None
    top_p: StrictNumber | None = None
    stream: bool = False
    store: bool = True
    # OpenAI's background mode: the POST answers at once (status queued), GET polls, POST
    # .../cancel ends it (server/responses/routes.py). Needs store; not with stream.
    background: bool = False
    previous_response_id: str | None = None
    # OpenAI's references to objects this server does not keep (a Conversations API
    # conversation, a stored prompt template): parsed only to be refused, since ignoring
    # them left the model without the history or instructions they stand for.
    conversation: object | None = None
    prompt: object | None = None
    # OpenAI's moderation: refused, as on chat (``schemas.refuse_moderation``).
    moderation: object | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    # OpenAI's: the output text's logprobs come with include "message.output_text.logprobs"
    # (or top_logprobs), each with top_logprobs alternatives (0-20).
    include: list[str] | None = None
    top_logprobs: JsonInt | None = Field(default=None, ge=0, le=20)
    user: str | None = None
    # kvwarm's extension, as on the OpenAI bodies (server/tenancy.py); X-Cache-Salt works too.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)
    # kvwarm's extensions, as on the OpenAI bodies: this request's speculative decoding.
    spec_type: SpecType | None = spec_type_field()
    spec_draft_max: JsonInt | None = spec_draft_max_field()
