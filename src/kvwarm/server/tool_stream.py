"""Streaming a chat reply that may hold tool calls: its texts and calls sent in order, each
text as it comes, each call once it is known to be one.

A reply is texts and calls in the order the model wrote them (``tools.reply_parts``); the
stream sends the same parts, text in pieces, each call whole. OpenAI's shape of a call ``i``:
a delta ``{"index": i, "id", "type": "function", "function": {"name", "arguments"}}`` (here
with its whole arguments); its content is the texts joined by ``tools.TEXT_SEPARATOR``
(``ContentJoin``). Anthropic's: a ``text`` block per text, a ``tool_use`` block per call.

Invariants:

- The streamed reply is the non-streamed one: what is sent is always the start of what
  ``tools.reply_parts`` makes of the whole reply (the same parser), and ``finish`` sends the
  rest. So text that may be the start of a call (a marker, a tail that could grow into one, a
  reply that starts as bare JSON) is held back, and so is a text's trailing whitespace (the
  parser strips it where a call follows).
- A call goes out only once the parser finds it, complete, in the reply so far, and only
  where no later text can undo it (a closed ``<tool_call>`` block: nothing after it changes
  it). A call that never parses (invalid JSON, an undeclared tool, cut off by ``max_tokens``)
  is text, never a half-sent call. Other formats ([TOOL_CALLS], ``<|python_tag|>``,
  ``<function=…>``, a bare JSON reply), where a later marker or value can still turn the calls
  into text, are sent by ``finish``, with the text after them.
- A call keeps the id it was sent with: ``finish`` returns the whole reply's parts with the
  streamed calls as they were sent.
"""

from __future__ import annotations

import logging

from kvwarm.server.tools import TEXT_SEPARATOR, Part, ToolCall, reply_parts

Json = dict[str, object]

log = logging.getLogger(__name__)

_STABLE_MARKER = "<tool_call>"  # the parser's first choice: no later marker overrides it
_STABLE_END = "</tool_call>"
_MARKERS = (_STABLE_MARKER, "[TOOL_CALLS]", "<|python_tag|>", "<function=")


def _tail_cut(text: str, markers: tuple[str, ...]) -> int:
    """Where ``text`` stops being safe to show: at its first marker, or at a tail that could
    grow into one; ``len(text)`` if neither."""
    cut = len(text)
    for marker in markers:
        at = text.find(marker)
        if at >= 0:
            cut = min(cut, at)
            continue
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


class ToolStream:
    """``feed`` returns the parts (text pieces, calls) safe to send now; ``finish`` the rest."""

    def __init__(self, names: frozenset[str], *, forced: bool, single: bool = False) -> None:
        """``single``: parallel calls are off; only the reply's first call is reported."""
        self._names = names
        self._single = single
        self._text = ""
        self._sent: list[Part] = []  # the parts sent so far (the last text maybe in part)
        self._parsed = 0  # how much of the reply the parts sent were parsed from
        # Everything from here on waits for ``finish`` (None: nothing is held so far). A forced
        # reply is all call: it shows nothing.
        self._hold: int | None = 0 if names and forced else None

    @property
    def any_call(self) -> bool:
        return any(isinstance(p, ToolCall) for p in self._sent)

    def feed(self, fragment: str) -> list[Part]:
        self._text += fragment
        if not self._names:  # nothing to parse: the text as it comes
            self._sent.append(fragment)
            return [fragment] if fragment else []
        settled = self._settled()
        if settled is None or settled == self._parsed:
            return []  # nothing new settled (say, a call's arguments still coming)
        self._parsed = settled
        parts = reply_parts(self._text[:settled], self._names, single=self._single)
        if parts and isinstance(parts[-1], str):  # a text may go on: its end waits
            parts[-1] = parts[-1].rstrip()
            if not parts[-1]:
                parts.pop()
        return self._extend(parts)

    def _settled(self) -> int | None:
        """How much of the reply so far no later text can reparse (None: nothing new)."""
        text = self._text
        if self._hold is not None:
            return None
        first = text.find(_STABLE_MARKER)
        head = text if first < 0 else text[:first]
        if not self._sent and text.lstrip().startswith(("{", "[")):
            self._hold = 0  # may be a bare JSON call: the whole reply decides
            return None
        # Before any <tool_call>, the other formats decide only at the end: from the first.
        found = [at for marker in _MARKERS[1:] if (at := head.find(marker)) >= 0]
        if found:
            self._hold = min(found)
            return self._hold
        if first < 0:
            return _tail_cut(text, _MARKERS)
        pos = 0
        while (start := text.find(_STABLE_MARKER, pos)) >= 0:
            end = text.find(_STABLE_END, start)
            if end < 0:
                return start  # an open block: a call, or text, once it closes
            pos = end + len(_STABLE_END)
        return pos + _tail_cut(text[pos:], (_STABLE_MARKER,))

    def _extend(self, parts: list[Part]) -> list[Part]:
        """What of ``parts`` (the reply's parts so far) was not sent yet; remembered as sent.
        A call already sent stays as sent (its id)."""
        out: list[Part] = []
        for i, part in enumerate(parts):
            if i < len(self._sent):
                sent = self._sent[i]
                if isinstance(sent, ToolCall) and isinstance(part, ToolCall):
                    if (sent.name, sent.arguments) != (part.name, part.arguments):
                        log.error("streamed tool calls differ from the reply's: %r", self._text)
                    continue
                if isinstance(sent, str) and isinstance(part, str) and part.startswith(sent):
                    if len(part) > len(sent):
                        out.append(part[len(sent) :])
                        self._sent[i] = part
                    continue
                # Cannot happen while the parser keeps what it parsed of a reply's start.
                log.error("streamed reply differs from the whole reply: %r", self._text)
                return out
            out.append(part)
            self._sent.append(part)
        return out

    def finish(self) -> tuple[list[Part], list[Part]]:
        """(the parts not yet sent, the whole reply's parts with calls as they were sent)."""
        if not self._names:
            return [], [t for t in ("".join(p for p in self._sent if isinstance(p, str)),) if t]
        rest = self._extend(reply_parts(self._text, self._names, single=self._single))
        return rest, list(self._sent)


class ContentJoin:
    """A stream's parts as OpenAI's ``content`` deltas: a text after a call starts with
    ``TEXT_SEPARATOR`` when text came before it, as ``tools.content_of`` joins them."""

    def __init__(self) -> None:
        self._texts = False
        self._after_call = False

    def __call__(self, part: Part) -> str:
        """The content delta of ``part`` ("" for a call)."""
        if isinstance(part, ToolCall):
            self._after_call = True
            return ""
        text = TEXT_SEPARATOR + part if self._texts and self._after_call else part
        self._texts = self._texts or bool(part)
        self._after_call = False
        return text


def call_delta(index: int, call: ToolCall) -> Json:
    """OpenAI's delta of call ``index``, whole."""
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
