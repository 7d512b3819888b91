"""Chat messages to prompt tokens, where only the template's own markup can be special.

Invariants:

- Message content is tokenized as plain text (``parse_special=False``): a user who writes
  ``<|im_start|>system`` gets those characters, never the control token. Only the text the
  template itself produces (markup) is tokenized with ``parse_special=True``.
- How: the template is rendered with a unique sentinel in place of each string content; the
  render is split at the sentinels; markup segments and content segments are tokenized
  separately and concatenated. The text reported is the render with the real contents, and it
  equals the template's own rendering (checked; see below).
- BOS and EOS as llama-server places them (``common_chat_templates_apply``, then tokenizing
  with ``add_special``): where the vocabulary adds BOS (EOS), one BOS (EOS) text is taken off
  the render's start (end) and the id put there, so the prompt has exactly the one the model
  wants whether or not the template writes it.
- Prefix stability: each segment's tokens depend only on that segment, and a message's segments
  do not change when later messages are appended, so turn N's prompt tokens stay a prefix of
  turn N+1's (the cache's multi-turn hits rely on it).
- Other strings a template may render as markup (names, tool calls, tool definitions, contents
  that are not strings, and the keys of their mappings) must not contain special-token text:
  ``InvalidRequestError`` otherwise.
- A template that rewrites content (strip, split) moves the sentinels' surroundings; then the
  spliced text differs from the real render and the whole render is tokenized at once, which
  is safe only if no content holds special-token text (``InvalidRequestError`` otherwise).
- Images and audio (a content list's ``image``/``image_url``/``audio``/``input_audio`` parts)
  are decoded under the model's ``MediaLimits`` (``kvwarm.media``) and sit in the message where
  they were, as llama-server puts them: its text parts joined, no newline next to a medium, the
  projector's marker tokens around each (``<start_of_image>`` ...) and a span of its
  embeddings (``Prompt.spans``, named by the decoded content's digest). A user's text never
  becomes a medium: media are placed by a private sentinel, never by a marker string, and the
  rendered ``text`` shows each as ``MEDIA_MARKER``. Every medium must come out of the template
  exactly once (``InvalidRequestError`` otherwise).

Fill-in-the-middle prompts from a model's FIM tokens, as llama-server assembles them.

The layout (prefix-suffix-middle): ``[extra context] [BOS] FIM_PRE prefix prompt FIM_SUF
suffix FIM_MID``; the model then generates the middle. Extra context files go first, each as
``FIM_SEP filename\\n text`` (after ``FIM_REP project\\n`` when the vocabulary has it), or
separated by a plain ``--- snippet ---`` line when it has no file separator.

Invariant: text never becomes special tokens (``parse_special=False``), so a prefix that
contains ``<fim_middle>`` stays text; a model without FIM tokens is a ``FimNotSupportedError``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvwarm.backends.base import BackendModel, MediaSpan, Projector
from kvwarm.errors import ContextOverflowError, FimNotSupportedError, InvalidRequestError
from kvwarm.media import (
    Media,
    MediaBudget,
    MediaError,
    MediaKind,
    MediaLimits,
    load_media,
    too_many,
)
from kvwarm.tokens import Prompt
from kvwarm.unicode import find_lone_surrogate

log = logging.getLogger(__name__)

Message = Mapping[str, object]


#: How the rendered text of a chat shows where an image or clip sits (mtmd's default marker).
MEDIA_MARKER = "<__media__>"


@dataclass(frozen=True, slots=True)
class SpanMedia:
    """What one span of a prompt shows: the ``index``-th span of ``media``'s layout."""

    media: Media
    index: int = 0


@dataclass(frozen=True, slots=True)
class MediaPrompt:
    """A ``Prompt`` and the media its spans show, one ``SpanMedia`` per span, in order: what
    a prompt with images or audio needs to be decoded (the ids only name the content)."""

    prompt: Prompt
    media: tuple[SpanMedia, ...] = ()

    def __post_init__(self) -> None:
        if len(self.media) != len(self.prompt.spans):
            raise ValueError(f"{len(self.prompt.spans)} spans, {len(self.media)} media")

    def extended(self, tokens: Sequence[int]) -> MediaPrompt:
        """This prompt followed by text ``tokens``."""
        p = self.prompt
        return MediaPrompt(Prompt((*p.tokens, *tokens), p.spans), self.media)


@dataclass(frozen=True, slots=True)
class ChatMedia:
    """How a chat's media are read: the model's projector (None: it reads none) and the
    limits they are decoded under."""

    projector: Projector | None
    limits: MediaLimits


def span_digest(media: Media, index: int) -> bytes:
    """The digest a medium's ``index``-th span is named by: its content's (``index`` 0, the
    one span of an image on every projector kvwarm knows), else that folded with ``index``."""
    if index == 0:
        return media.digest
    return hashlib.sha256(media.digest + index.to_bytes(4, "little")).digest()


#: What ``shows_system`` renders as a system message and looks for in the render.
_SYSTEM_PROBE_TEXT = "kvwarm-system-probe"


def shows_system(render: Callable[[Sequence[Message]], str]) -> bool:
    """Whether a chat template (``render``: messages to its text) shows a system message:
    Gemma 2's and Mistral's first ones refuse one ("System role not supported"), some drop
    it without a word. Where it shows none, a chat's leading system messages reach it
    ``system_folded``."""
    probe: list[Message] = [
        {"role": "system", "content": _SYSTEM_PROBE_TEXT},
        {"role": "user", "content": "hi"},
    ]
    try:
        rendered = render(probe)
    except InvalidRequestError:  # the template refused it
        return False
    return _SYSTEM_PROBE_TEXT in rendered


def leads_with_system(messages: Sequence[Message]) -> bool:
    """Whether the chat opens with a system message (what ``system_folded`` moves)."""
    return bool(messages) and messages[0].get("role") == "system"


def system_folded(messages: Sequence[Message]) -> list[dict[str, object]]:
    """``messages`` for a template that shows no system message (``shows_system``): the
    leading system messages open the first user turn, each a line before the next, as
    llama.cpp's server folds them (``common/chat.cpp``, ``system_message_not_supported``);
    with no user turn after them they are one of their own (llama.cpp drops the text there).
    The one fold of the server's chat APIs, the library's chats and ``--prewarm-system``, so
    a prewarmed system prompt is the prefix its requests render."""
    lead = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    rest = [dict(m) for m in messages[lead:]]
    if not lead:
        return rest
    turn: dict[str, object] = {"role": "user", "content": messages[0].get("content")}
    for message in messages[1:lead]:
        turn = joined_turns(turn, message)
    if rest and rest[0].get("role") == "user":
        turn, rest = {**rest[0], **joined_turns(turn, rest[0])}, rest[1:]
    return [turn, *rest]


def joined_turns(first: Message, second: Message) -> dict[str, object]:
    """Two turns as one user turn (a template that wants roles to alternate, as Gemma's and
    Mistral's do, refuses two in a row): their texts, or parts, one after the other."""
    a, b = first.get("content"), second.get("content")
    if isinstance(a, str) and isinstance(b, str):
        return {"role": "user", "content": f"{a}\n{b}"}
    return {"role": "user", "content": [*_parts(a), {"type": "text", "text": "\n"}, *_parts(b)]}


def _parts(content: object) -> list[object]:
    return list(content) if isinstance(content, list) else [{"type": "text", "text": content}]


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
    it), so more than ``n_ctx * longest_piece()`` characters are more than ``n_ctx`` tokens.
    Messages are a list of mappings each with a string ``role`` (``InvalidRequestError``:
    found by review, ``model.chat("hi")`` was an ``AttributeError`` and a message without a
    role rendered as one of role ``None``)."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            "messages must be a list of messages ({'role': 'user', 'content': 'hi'}), not "
            f"{type(messages).__name__}",
            param="messages",
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(
                f"message {i} must be a mapping with a string 'role', got {message!r:.80}",
                param="messages",
            )
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
    ``template`` (Jinja source; None: the model's own). Text only (``chat_prompt`` takes
    media)."""
    chat, text = chat_prompt(
        model,
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        template=template,
        media=None,
    )
    return chat.prompt.tokens, text


def chat_prompt(
    model: BackendModel,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, object]] | None = None,
    add_generation_prompt: bool = True,
    template: str | None = None,
    media: ChatMedia | None,
) -> tuple[MediaPrompt, str]:
    """The prompt of ``messages`` (text, and the images and audio of their content lists,
    read as ``media`` says) and the rendered text it stands for."""
    for name, given in (("messages", list(messages)), ("tools", list(tools or ()))):
        where = find_lone_surrogate(given)
        if where is not None:
            raise InvalidRequestError(
                f"{name}.{where} contains a lone UTF-16 surrogate; text must be valid Unicode",
                param=f"{name}.{where}",
            )
    tag = secrets.token_hex(8)
    messages, found = _media_parts(messages, tag, media)
    text = model.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, template=template
    )
    for where, value in _markup_strings(messages, tools):
        _refuse_special(model, value, where)
    marked, contents = _with_sentinels(messages, tag)
    rendered = model.apply_chat_template(
        marked, tools=tools, add_generation_prompt=add_generation_prompt, template=template
    )
    shown_text = text
    bos, eos = _added_specials(model)
    # As llama-server (common_chat_templates_apply, then tokenizing with add_special): a
    # model that wants BOS (EOS) gets exactly one from the tokenizer, whether the template
    # writes it or not, so its text is taken off the render's start (end) first.
    if bos is not None:
        text, rendered = _strip_start(text, bos[1]), _strip_start(rendered, bos[1])
    if eos is not None:
        text, rendered = _strip_end(text, eos[1]), _strip_end(rendered, eos[1])
    pieces = re.split(f"\ue000{tag}:([0-9]+)\ue001", rendered)
    # re.split alternates markup and captured content indices: m0, i0, m1, i1, ..., mN.
    spliced = "".join(p if k % 2 == 0 else contents[int(p)] for k, p in enumerate(pieces))
    parts: list[Sequence[int] | tuple[bytes, int, str]] = [] if bos is None else [[bos[0]]]
    placed: list[SpanMedia] = []
    seen: list[int] = []
    shown = re.sub(f"\ue000{tag}:m[0-9]+\ue001", MEDIA_MARKER, shown_text)

    def add(piece: str, *, special: bool) -> None:
        for k, bit in enumerate(re.split(f"\ue000{tag}:m([0-9]+)\ue001", piece)):
            if k % 2 == 0:
                if bit:
                    parts.append(model.tokenize(bit, add_special=False, parse_special=special))
                continue
            assert media is not None and media.projector is not None  # it read them
            item = found[int(bit)]
            seen.append(int(bit))
            index = 0
            for lay in media.projector.layout(item):
                if isinstance(lay, MediaSpan):
                    parts.append((span_digest(item, index), lay.n_tokens, lay.kind))
                    placed.append(SpanMedia(item, index))
                    index += 1
                else:
                    parts.append(lay)

    if spliced != text:
        log.debug("the chat template rewrites content; tokenizing its whole render")
        for index, content in enumerate(contents):
            _refuse_special(model, _unmarked(content, tag), f"messages.{index}.content")
        # The template already carries any BOS/special tokens as text.
        add(text, special=True)
    else:
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                if piece:
                    add(piece, special=True)
            else:
                content = contents[int(piece)]
                if content:
                    add(content, special=False)
    if sorted(seen) != list(range(len(found))):
        raise InvalidRequestError(
            "the chat template did not place every image or audio part exactly once "
            "(it drops or repeats message content)",
            param="messages",
        )
    if eos is not None:
        parts.append([eos[0]])
    return MediaPrompt(Prompt.build(parts), tuple(placed)), shown


def _added_specials(model: BackendModel) -> tuple[tuple[int, str] | None, tuple[int, str] | None]:
    """The BOS and EOS (id, text) the model's tokenizer adds to a text (its ``add_bos`` and
    ``add_eos`` metadata); None where it adds none."""
    facts = model.facts

    def special(token: int | None, added: bool) -> tuple[int, str] | None:
        if token is None or not added:
            return None
        return token, model.token_to_piece(token, special=True).decode("utf-8", "replace")

    return special(facts.bos, facts.add_bos), special(facts.eos, facts.add_eos)


def _strip_start(text: str, piece: str) -> str:
    return text[len(piece) :] if piece and text.startswith(piece) else text


def _strip_end(text: str, piece: str) -> str:
    return text[: -len(piece)] if piece and text.endswith(piece) else text


def _unmarked(content: str, tag: str) -> str:
    return re.sub(f"\ue000{tag}:m[0-9]+\ue001", "", content)


_MEDIA_TYPES: dict[str, tuple[MediaKind, str]] = {
    "image": ("image", "image"),
    "image_url": ("image", "image_url"),
    "audio": ("audio", "audio"),
    "input_audio": ("audio", "input_audio"),
}


def _media_parts(
    messages: Sequence[Message], tag: str, media: ChatMedia | None
) -> tuple[list[Message], list[Media]]:
    """``messages`` with each content list made a string: its text parts joined, each image
    or clip (decoded, in ``found``) replaced by a private sentinel ``\ue000{tag}:m{n}\ue001``."""
    out: list[Message] = []
    found: list[Media] = []
    budget = None if media is None else MediaBudget(media.limits)
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list | tuple):
            out.append(message)
            continue
        text: list[str] = []
        for j, part in enumerate(content):
            where = f"messages.{i}.content.{j}"
            if isinstance(part, Mapping) and isinstance(part.get("param"), str):
                where = str(part["param"])  # where the client put it (another API's body)
            if isinstance(part, str):
                text.append(part)
                continue
            if not isinstance(part, Mapping):
                raise InvalidRequestError(f"{where} is not a content part", param=where)
            kind = part.get("type")
            if kind == "text":
                value = part.get("text")
                if not isinstance(value, str):
                    raise InvalidRequestError(f"{where}.text is not a string", param=where)
                text.append(value)
                continue
            if not isinstance(kind, str) or kind not in _MEDIA_TYPES:
                raise InvalidRequestError(
                    f"{where} has type {kind!r}: a content part is text, image, image_url, "
                    "audio or input_audio",
                    param=where,
                )
            text.append(f"\ue000{tag}:m{len(found)}\ue001")
            found.append(_read_part(part, kind, where, media, len(found), budget))
        out.append({**message, "content": "".join(text)})
    return out, found


def _read_part(
    part: Mapping[str, object],
    kind: str,
    where: str,
    media: ChatMedia | None,
    count: int,
    budget: MediaBudget | None,
) -> Media:
    medium, key = _MEDIA_TYPES[kind]
    projector = None if media is None else media.projector
    if media is None or projector is None:
        raise InvalidRequestError(
            f"{where}: this model cannot read {medium} input: it has no multimodal projector "
            "(load it with --mmproj)",
            param=where,
        )
    if medium not in projector.facts.kinds:
        raise InvalidRequestError(
            f"{where}: this model's projector reads {' and '.join(projector.facts.kinds)}, "
            f"not {medium}",
            param=where,
        )
    if count >= media.limits.max_items:
        raise too_many(where, media.limits.max_items)
    value = part.get(key)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(url, str) or not url.startswith("data:"):
            raise MediaError(
                f"{where}.image_url.url must be a base64 data: URI here (the server fetches "
                "http(s) URLs only from the hosts its media_fetch_hosts setting lists)",
                param=where,
            )
        value = url
    elif kind == "input_audio":
        data = value.get("data") if isinstance(value, Mapping) else None
        if not isinstance(data, str):
            raise MediaError(f"{where}.input_audio.data must be base64 text", param=where)
        value = data if data.startswith("data:") else f"data:audio/wav;base64,{data}"
    return load_media(
        value,
        medium,
        media.limits,
        where,
        sample_rate=projector.facts.audio_sample_rate or 16000,
        budget=budget,
    )


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
        # Keys too: a template's ``tojson`` writes them as markup (a schema's property names,
        # a call's argument names).
        found: list[tuple[str, str]] = []
        for k, v in value.items():
            if isinstance(k, str):
                found.append((f"{where}.{k}", k))
            found += _strings(v, f"{where}.{k}")
        return found
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
    fit: FimFit | None = None,
) -> list[int]:
    """The prompt tokens that ask ``model`` for the text between ``prefix`` (+ ``prompt``,
    the start of the middle already written) and ``suffix``, in llama-server's layout.
    ``fit``: llama-server's ``/infill`` prompt, its repository header and last file separator
    (where the model has those tokens) always and cut as it cuts (``FimFit``); None (OpenAI's
    ``suffix``, which llama-server refuses): whole, the header only with extra files."""
    fim = model.facts.fim
    if fim is None:
        raise FimNotSupportedError(
            "this model has no fill-in-the-middle tokens (FIM_PRE/FIM_SUF/FIM_MID), so it "
            "cannot complete with a suffix",
            param="suffix",
        )

    def text(value: str) -> list[int]:
        return model.tokenize(value, add_special=False, parse_special=False)

    # Found by review: the header and the last separator came only with extra files, where
    # llama-server's /infill writes them always, so a code model (Qwen2.5-Coder's repo
    # tokens) read another prompt than llama-server's for the same /infill.
    header = fit is not None or bool(extra)
    extra_tokens: list[int] = []
    if fim.rep is not None and header:
        extra_tokens += [fim.rep, *text("myproject\n")]
    for item in extra:
        if fim.sep is not None:
            extra_tokens += [fim.sep, *text(item.filename + "\n")]
        else:
            extra_tokens += text("\n\n--- snippet ---\n\n")
        extra_tokens += text(item.text)
    if fim.sep is not None and header:
        extra_tokens += [fim.sep, *text("filename\n")]
    before, middle, after = text(prefix), text(prompt), text(suffix)
    if fit is not None:
        before, after, extra_tokens = fit.cut(before, middle, after, extra_tokens)
    tokens = extra_tokens
    bos = model.facts.bos
    if model.facts.add_bos and bos is not None:
        tokens.append(bos)
    tokens += [fim.pre, *before, *middle, fim.suf, *after, fim.mid]
    return tokens


#: llama-server's default ``-b`` (``common_params.n_batch``), the batch its ``/infill`` cut
#: is sized by (``FimFit.for_context``).
LLAMA_SERVER_N_BATCH = 2048


@dataclass(frozen=True, slots=True)
class FimFit:
    """llama-server's ``/infill`` cut (``format_prompt_infill``), for a context of ``n_ctx``
    tokens, prefill batches of ``n_batch`` and a reply of ``n_predict``: the prefix's last
    3/4 of a batch, the suffix's first quarter less the prompt (and 2), and the extra files'
    last ``n_ctx - n_batch - 2 * n_predict`` tokens. Found by review: uncut, an editor's
    extra context (llama.vim's ring of chunks) past the context was a 400 where
    llama-server keeps the latest of it."""

    n_ctx: int
    n_batch: int
    n_predict: int

    @classmethod
    def for_context(cls, n_ctx: int, n_predict: int) -> FimFit:
        """The cut of a llama-server of default batch (``LLAMA_SERVER_N_BATCH``) in a context
        of ``n_ctx``, or of half the context where that is smaller, so that the prefix and
        suffix never fill it (llama-server, its batch unclamped, would send a prompt longer
        than a context below 2,048). Never the model's own ``n_batch``: a prefill knob
        (performance, cache alignment) must not change which tokens a request reads. Found
        by review: it did, so kvwarm (512 by default) kept 384 tokens of a prefix where
        llama-server (2,048) keeps 1,536."""
        return cls(n_ctx, min(LLAMA_SERVER_N_BATCH, n_ctx // 2), n_predict)

    def cut(
        self, prefix: list[int], prompt: list[int], suffix: list[int], extra: list[int]
    ) -> tuple[list[int], list[int], list[int]]:
        quarter = self.n_batch // 4
        n_prefix = min(len(prefix), 3 * quarter)
        n_suffix = min(len(suffix), max(0, quarter - (2 + len(prompt))))
        n_extra = min(max(0, self.n_ctx - self.n_batch - 2 * self.n_predict), len(extra))
        return (
            prefix[len(prefix) - n_prefix :],
            suffix[:n_suffix],
            extra[len(extra) - n_extra :],
        )
