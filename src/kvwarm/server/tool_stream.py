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

from kvwarm.server.tools import (
    TEXT_SEPARATOR,
    Part,
    ToolCall,
    block_spans,
    parts_of_spans,
    reply_parts,
)

Json = dict[str, object]

log = logging.getLogger(__name__)

_STABLE_MARKER = "<tool_call>"  # the parser's first choice: no later marker overrides it
_STABLE_END = "</tool_call>"
_MARKERS = (_STABLE_MARKER, "[TOOL_CALLS]", "<|python_tag|>", "<function=")
_LONGEST = max(len(m) for m in (*_MARKERS, _STABLE_END))


def _partial(text: str, markers: tuple[str, ...], lo: int = 0) -> int:
    """How long a tail of ``text[lo:]`` could grow into one of ``markers`` (0: none can)."""
    start = max(lo, len(text) - _LONGEST + 1)
    if "<" not in text[start:] and "[" not in text[start:]:  # what every marker starts with
        return 0
    for at in range(start, len(text)):
        if text[at] not in "<[":
            continue
        piece = text[at:]
        if any(m.startswith(piece) for m in markers):
            return len(piece)
    return 0


class ToolStream:
    """``feed`` returns the parts (text pieces, calls) safe to send now; ``finish`` the rest.

    The work per fragment is the fragment's, not the reply's: markers are looked for in the
    new text only, a text that goes on sends its new end as it is, and the reply is parsed
    again only where a ``<tool_call>`` block closed or a text starts, from its last call on
    (the parts before it are sent and final)."""

    def __init__(self, names: frozenset[str], *, forced: bool, single: bool = False) -> None:
        """``single``: parallel calls are off; only the reply's first call is reported."""
        self._names = names
        self._single = single
        self._text = ""
        self._sent: list[Part] = []  # the parts sent so far (the last text maybe in part)
        self._tail: list[str] = []  # pieces sent of the last text, not yet joined to it
        self._parsed = 0  # how much of the reply the parts sent were parsed from
        # Everything from here on waits for ``finish`` (None: nothing is held so far). A forced
        # reply is all call: it shows nothing.
        self._hold: int | None = 0 if names and forced else None
        self._scanned = 0  # markers starting before this less _LONGEST were looked for
        self._stable: int | None = None  # where the first <tool_call> starts
        self._closed = 0  # where the last closed <tool_call> block ends
        self._open: int | None = None  # where an unclosed <tool_call> block starts
        # The reply from ``_base`` on is parsed again as it grows; the ``_frozen`` parts sent
        # before it (up to its last call) are final.
        self._base = 0
        self._frozen = 0
        self._upto: int | None = None  # where the text sent of a text that goes on ends

    @property
    def any_call(self) -> bool:
        return any(isinstance(p, ToolCall) for p in self._sent)

    def feed(self, fragment: str) -> list[Part]:
        # The reply's one reference in a local: CPython grows it in place, where
        # ``self._text += fragment`` copied the whole reply per token.
        text, self._text = self._text, ""
        text += fragment
        self._text = text
        del text
        if not self._names:  # nothing to parse: the text as it comes
            return [fragment] if fragment else []
        settled = self._settled()
        if settled is None or settled <= self._parsed:
            return []  # nothing new settled (say, a call's arguments still coming)
        parsed, self._parsed = self._parsed, settled
        if self._text.find(_STABLE_MARKER, parsed, settled) >= 0:
            return self._reparse(settled)  # a block closed: it may be a call
        if self._upto is None:  # no text goes on: one starts, unless this is whitespace
            return self._reparse(settled) if self._text[parsed:settled].strip() else []
        # A text goes on: its new end, less trailing whitespace.
        piece = self._text[self._upto : settled].rstrip()
        if not piece:
            return []
        self._upto += len(piece)
        self._tail.append(piece)
        return [piece]

    def _settled(self) -> int | None:
        """How much of the reply so far no later text can reparse (None: nothing new)."""
        if self._hold is not None:
            return None
        text = self._text
        scan = max(self._scanned - _LONGEST + 1, 0)
        self._scanned = len(text)
        if self._stable is None:
            if not self._sent and text.lstrip().startswith(("{", "[")):
                self._hold = 0  # may be a bare JSON call: the whole reply decides
                return None
            first = text.find(_STABLE_MARKER, scan)
            head = len(text) if first < 0 else first
            # Before any <tool_call>, the other formats decide only at the end: from the first.
            found = [at for m in _MARKERS[1:] if (at := text.find(m, scan, head)) >= 0]
            if found:
                self._hold = min(found)
                return self._hold
            if first < 0:
                return len(text) - _partial(text, _MARKERS)
            self._stable = self._closed = first
        while True:
            start = self._open
            if start is None:
                start = text.find(_STABLE_MARKER, max(self._closed, scan))
                if start < 0:
                    break
            end = text.find(_STABLE_END, max(start, scan))
            if end < 0:
                self._open = start
                return start  # an open block: a call, or text, once it closes
            self._open = None
            self._closed = end + len(_STABLE_END)
        return len(text) - _partial(text, (_STABLE_MARKER,), self._closed)

    def _reparse(self, settled: int) -> list[Part]:
        """The parts of the reply from its last call sent to ``settled``, sent where new."""
        text, base = self._text, self._base
        after_call = base > 0
        spans = block_spans(text, self._names, base, settled) if self._stable is not None else []
        parts = parts_of_spans(
            text, spans, start=base, end=settled, after_call=after_call, single=self._single
        )
        if parts and isinstance(parts[-1], str):  # a text may go on: its end waits
            parts[-1] = parts[-1].rstrip()
            if not parts[-1]:
                parts.pop()
        out = self._extend(parts, self._frozen)
        lo = spans[-1][1] if spans else base  # where the reply's last text starts
        rest = text[lo:settled].rstrip()
        self._upto = lo + len(rest) if rest.strip() and parts else None
        freeze = spans[:1] if self._single else spans
        if freeze and not (self._single and after_call):  # parts up to the last call: final
            end = freeze[-1][1]
            self._frozen += len(
                parts_of_spans(
                    text, freeze, start=base, end=end, after_call=after_call, single=self._single
                )
            )
            self._base = end
        return out

    def _extend(self, parts: list[Part], at: int) -> list[Part]:
        """What of ``parts`` (the reply's parts from part ``at`` on) was not sent yet;
        remembered as sent. A call already sent stays as sent (its id)."""
        if self._tail:  # pieces of the last text (which ``_reparse`` sent first)
            last = self._sent[-1]
            self._sent[-1] = (last if isinstance(last, str) else "") + "".join(self._tail)
            self._tail.clear()
        out: list[Part] = []
        for i, part in enumerate(parts, at):
            if i < len(self._sent):
                sent = self._sent[i]
                if isinstance(sent, ToolCall) and isinstance(part, ToolCall):
                    if (sent.name, sent.arguments) != (part.name, part.arguments):
                        self._diverged("streamed tool calls differ from the reply's")
                    continue
                if isinstance(sent, str) and isinstance(part, str) and part.startswith(sent):
                    if len(part) > len(sent):
                        out.append(part[len(sent) :])
                        self._sent[i] = part
                    continue
                # Cannot happen while the parser keeps what it parsed of a reply's start.
                self._diverged("streamed reply differs from the whole reply")
                return out
            out.append(part)
            self._sent.append(part)
        return out

    def _diverged(self, what: str) -> None:
        """A broken invariant: said at ERROR without the reply (found by review: the whole
        reply, a user's text, was logged at ERROR), which DEBUG adds."""
        log.error("%s (a reply of %d characters; DEBUG logs it)", what, len(self._text))
        log.debug("%s: %r", what, self._text)

    def finish(self) -> tuple[list[Part], list[Part]]:
        """(the parts not yet sent, the whole reply's parts with calls as they were sent)."""
        if not self._names:
            return [], [self._text] if self._text else []
        if self._base == 0:
            parts = reply_parts(self._text, self._names, single=self._single)
        else:
            spans = block_spans(self._text, self._names, self._base)
            parts = parts_of_spans(
                self._text, spans, start=self._base, after_call=True, single=self._single
            )
        rest = self._extend(parts, self._frozen)
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
