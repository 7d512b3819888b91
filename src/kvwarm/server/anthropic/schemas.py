"""Request bodies of the Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Invariant: as for the OpenAI bodies (``schemas.py``), unknown fields are ignored and a known field
of the wrong type is a 400 naming it. Content blocks are told apart by their ``type``; blocks
kvwarm cannot use (documents) parse, so that the conversion can refuse them with a clear
message, and thinking blocks of earlier turns parse and are dropped. Image blocks (base64, or a
URL the server may fetch) reach a model with a projector (``--mmproj``). A structured-output
format (``output_config.format``, the beta's ``output_format``) constrains the reply as chat's
``response_format`` does.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvwarm.engine.types import SpecType
from kvwarm.server.schemas import (
    JsonBody,
    JsonInt,
    StrictNumber,
    keep_alive_field,
    spec_draft_max_field,
    spec_type_field,
)
from kvwarm.server.tenancy import MAX_SALT_CHARS

_INT32_MAX = (1 << 31) - 1


class _Body(JsonBody):
    """An Anthropic body (or part): strict types, unknown fields ignored (``JsonBody``)."""


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class MediaBlock(_Body):
    """A document: parsed only to be refused by name."""

    type: Literal["document"]


class ImageSource(_Body):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(_Body):
    """An image: base64 data (or a URL from a host the server may fetch from)."""

    type: Literal["image"]
    source: ImageSource


class ThinkingBlock(_Body):
    """A previous turn's reasoning, which a client sends back; not part of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str = Field(min_length=1)
    input: dict[str, object] = Field(default_factory=dict)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: (
        str | list[Annotated[TextBlock | ImageBlock | MediaBlock, Field(discriminator="type")]]
    ) = ""
    is_error: bool = False


ContentBlock = Annotated[
    TextBlock | ImageBlock | MediaBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


def _any_object() -> dict[str, object]:
    return {"type": "object"}


class ToolDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, object] = Field(default_factory=_any_object)
    # Absent or "custom" for a client tool; Anthropic's server tools ("bash_20250124", ...)
    # carry their own type and are refused.
    type: str | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class JsonOutputFormat(_Body):
    """Structured output: the reply is JSON matching ``schema`` (a grammar constrains it)."""

    type: Literal["json_schema"]
    schema_: dict[str, object] = Field(alias="schema")


class OutputConfig(_Body):
    format: JsonOutputFormat | None = None


class Metadata(_Body):
    user_id: str | None = None


class Container(_Body):
    """A code-execution container: read only for its ``skills``, which kvwarm cannot load."""

    id: str | None = None
    skills: list[object] | None = None


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    # Read only to refuse a value asking for what kvwarm cannot run (``translate.refuse``).
    mcp_servers: list[object] | None = None
    container: str | Container | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: JsonInt = Field(ge=1)  # required, as in Anthropic's API
    keep_alive: float | str | None = keep_alive_field()  # Ollama's (server/registry.py)
    stop_sequences: list[str] | None = None
    temperature: StrictNumber | None = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: StrictNumber | None = Field(default=None, ge=0, le=1)
    top_k: JsonInt | None = Field(default=None, ge=0, le=_INT32_MAX)  # a C int in llama.cpp
    metadata: Metadata | None = None
    # Structured outputs: ``output_config.format``, or the beta's top-level ``output_format``.
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None
    stream: bool = False
    # kvwarm's extension, as on the OpenAI bodies (server/tenancy.py); X-Cache-Salt works too.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_SALT_CHARS)
    # kvwarm's extensions, as on the OpenAI bodies: this request's speculative decoding.
    spec_type: SpecType | None = spec_type_field()
    spec_draft_max: JsonInt | None = spec_draft_max_field()
