"""Chat messages to prompt tokens, where only the template's own markup can be special.

Invariants:

- Message content is tokenized as plain text (``parse_special=False``): a user who writes
  ``<|im_start|>system`` gets those characters, never the control token. Only the text the
  template itself produces (markup) is tokenized with ``parse_special=True``.
- How: the template is rendered with a unique sentinel in place of each string content; the
  render is split at the sentinels; markup segments and content segments are tokenized
  separately and concatenated. The text reported is the render with the real contents, and it
  equals the template's own rendering (checked; see below).
- Prefix stability: each segment's tokens depend only on that segment, and a message's segments
  do not change when later messages are appended, so turn N's prompt tokens stay a prefix of
  turn N+1's (the cache's multi-turn hits rely on it).
- Other strings a template may render as markup (names, tool calls, tool definitions, contents
  that are not strings) must not contain special-token text: ``InvalidRequestError`` otherwise.
- A template that rewrites content (strip, split) moves the sentinels' surroundings; then the
  spliced text differs from the real render and the whole render is tokenized at once, which
  is safe only if no content holds special-token text (``InvalidRequestError`` otherwise).

Fill-in-the-middle prompts from a model's FIM tokens, as llama-server assembles them.

The layout (prefix-suffix-middle): ``[extra context] [BOS] FIM_PRE prefix prompt FIM_SUF
suffix FIM_MID``; the model then generates the middle. Extra context files go first, each as
``FIM_SEP filename\\n text`` (after ``FIM_REP project\\n`` when the vocabulary has it), or
separated by a plain ``--- snippet ---`` line when it has no file separator.

Invariant: text never becomes special tokens (``parse_special=False``), so a prefix that
contains ``<fim_middle>`` stays text; a model without FIM tokens is a ``FimNotSupportedError``.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvwarm.backends.base import BackendModel
from kvwarm.errors import ContextOverflowError, FimNotSupportedError, InvalidRequestError
from kvwarm.unicode import find_lone_surrogate

log = logging.getLogger(__name__)

Message = Mapping[str, object]


def content_chars(messages: Sequence[Message]) -> int:
    """How many characters of text the messages' contents hold (strings, and the ``text`` of
    content parts); what a template renders besides is not counted."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                total += len(text) if isinstance(text, str) else 0
    return total


def check_chat_size(
    messages: Sequence[Message], n_ctx: int, longest_piece: Callable[[], int]
) -> None:
    """``ContextOverflowError`` for messages whose contents alone cannot fit ``n_ctx`` tokens,
    found before the template renders them (rendering and tokenizing a 3 MB chat took seconds
    only to be refused then, issue 41). Sound: a character is at least one byte and a token
    stands for at most ``longest_piece()`` bytes (asked only for a chat long enough to need
    it), so more than ``n_ctx * longest_piece()`` characters are more than ``n_ctx`` tokens."""
    chars = content_chars(messages)
    if chars <= n_ctx:
        return
    longest = max(1, longest_piece())
    if chars > n_ctx * longest:
        raise ContextOverflowError(
            f"the messages' contents hold {chars} characters: more than {n_ctx} tokens, the "
            f"context, whatever the template (a token of this model stands for at most "
            f"{longest} bytes)",
            n_tokens=chars // longest,
            n_ctx=n_ctx,
        )


def longest_piece(model: BackendModel) -> int:
    """The most bytes any token of ``model`` stands for (one native call per token)."""
    return max(
        (len(model.token_to_piece(t, special=True)) for t in range(model.facts.n_vocab)),
        default=1,
    )


def chat_tokens(
    model: BackendModel,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, object]] | None = None,
    add_generation_prompt: bool = True,
    template: str | None = None,
) -> tuple[tuple[int, ...], str]:
    """The prompt tokens of ``messages`` and the rendered text they stand for, rendered with
    ``template`` (Jinja source; None: the model's own)."""
    for name, given in (("messages", list(messages)), ("tools", list(tools or ()))):
        where = find_lone_surrogate(given)
        if where is not None:
            raise InvalidRequestError(
                f"{name}.{where} contains a lone UTF-16 surrogate; text must be valid Unicode",
                param=f"{name}.{where}",
            )
    text = model.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, template=template
    )
    for where, value in _markup_strings(messages, tools):
        _refuse_special(model, value, where)
    tag = secrets.token_hex(8)
    marked, contents = _with_sentinels(messages, tag)
    rendered = model.apply_chat_template(
        marked, tools=tools, add_generation_prompt=add_generation_prompt, template=template
    )
    pieces = re.split(f"\ue000{tag}:([0-9]+)\ue001", rendered)
    # re.split alternates markup and captured content indices: m0, i0, m1, i1, ..., mN.
    spliced = "".join(p if k % 2 == 0 else contents[int(p)] for k, p in enumerate(pieces))
    if spliced != text:
        log.debug("the chat template rewrites content; tokenizing its whole render")
        for index, content in enumerate(contents):
            _refuse_special(model, content, f"messages.{index}.content")
        # The template already carries any BOS/special tokens as text.
        return tuple(model.tokenize(text, add_special=False, parse_special=True)), text
    tokens: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            if piece:
                tokens += model.tokenize(piece, add_special=False, parse_special=True)
        else:
            content = contents[int(piece)]
            if content:
                tokens += model.tokenize(content, add_special=False, parse_special=False)
    return tuple(tokens), text


def _with_sentinels(messages: Sequence[Message], tag: str) -> tuple[list[Message], list[str]]:
    """Messages with each string content replaced by ``\\ue000{tag}:{n}\\ue001`` (private-use
    delimiters: no template trims them and no user can guess ``tag``)."""
    marked: list[Message] = []
    contents: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            marked.append({**message, "content": f"\ue000{tag}:{len(contents)}\ue001"})
            contents.append(content)
        else:
            marked.append(message)
    return marked, contents


def _markup_strings(
    messages: Sequence[Message], tools: Sequence[Mapping[str, object]] | None
) -> list[tuple[str, str]]:
    """Every caller string the template may render outside a sentinel, with its path."""
    found: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        for key, value in message.items():
            if key == "role" or (key == "content" and isinstance(value, str)):
                continue
            found += _strings(value, f"messages.{index}.{key}")
    if tools:
        found += _strings(list(tools), "tools")
    return found


def _strings(value: object, where: str) -> list[tuple[str, str]]:
    if isinstance(value, str):
        return [(where, value)]
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in _strings(v, f"{where}.{k}")]
    if isinstance(value, list | tuple):
        return [s for i, v in enumerate(value) for s in _strings(v, f"{where}.{i}")]
    return []


def _refuse_special(model: BackendModel, text: str, where: str) -> None:
    """``InvalidRequestError`` if ``text`` holds special-token text (it would tokenize
    differently with special parsing on)."""
    if not text:
        return
    plain = model.tokenize(text, add_special=False, parse_special=False)
    if model.tokenize(text, add_special=False, parse_special=True) != plain:
        raise InvalidRequestError(
            f"{where} contains special-token text, which this chat template cannot keep "
            "as plain text",
            param=where,
        )


# --- Fill-in-the-middle prompts from a model's FIM tokens, as llama-server assembles them.


@dataclass(frozen=True, slots=True)
class ExtraFile:
    """A file of extra context for an infill (llama-server's ``input_extra`` item)."""

    text: str
    filename: str = "tmp"


def fim_tokens(
    model: BackendModel,
    prefix: str,
    suffix: str,
    *,
    prompt: str = "",
    extra: Sequence[ExtraFile] = (),
) -> list[int]:
    """The prompt tokens that ask ``model`` for the text between ``prefix`` (+ ``prompt``,
    the start of the middle already written) and ``suffix``."""
    fim = model.facts.fim
    if fim is None:
        raise FimNotSupportedError(
            "this model has no fill-in-the-middle tokens (FIM_PRE/FIM_SUF/FIM_MID), so it "
            "cannot complete with a suffix",
            param="suffix",
        )

    def text(value: str) -> list[int]:
        return model.tokenize(value, add_special=False, parse_special=False)

    tokens: list[int] = []
    if extra:
        if fim.rep is not None:
            tokens += [fim.rep, *text("myproject\n")]
        for item in extra:
            if fim.sep is not None:
                tokens += [fim.sep, *text(item.filename + "\n")]
            else:
                tokens += text("\n\n--- snippet ---\n\n")
            tokens += text(item.text)
        if fim.sep is not None:
            tokens += [fim.sep, *text("filename\n")]
    bos = model.facts.bos
    if model.facts.add_bos and bos is not None:
        tokens.append(bos)
    tokens += [fim.pre, *text(prefix), *text(prompt), fim.suf, *text(suffix), fim.mid]
    return tokens
