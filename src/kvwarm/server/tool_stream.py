"""Streaming a chat reply that may hold tool calls: content shown as it comes, each call sent
once it is known to be one.

OpenAI's shape, per call ``i``: a delta ``{"index": i, "id", "type": "function",
"function": {"name", "arguments"}}``; further deltas ``{"index": i, "function": {"arguments":
<fragment>}}`` may follow, and the concatenation is the call's arguments JSON. Here a call's
first delta carries its whole arguments.

Invariants:

- Text that may be the start of a call (a marker, a tail that could grow into one, a reply
  that starts as bare JSON) is held back from the content; ``finish`` parses the whole reply
  with ``tools.parse_tool_calls``, the same parser as a non-streamed response.
- The streamed reply is the non-streamed one: a call goes out only once the parser finds it,
  complete, in the reply so far, and only where no later text can undo it (the reply has a
  ``<tool_call>`` block: nothing after a call changes the calls before it). A call that never
  parses (invalid JSON, an undeclared tool, cut off by ``max_tokens``) is content, never a
  half-sent call. Other formats ([TOOL_CALLS], ``<|python_tag|>``, ``<function=…>``, a bare
  JSON reply), where a later marker or value can still turn the calls into content, are sent
  by ``finish``.
"""

from __future__ import annotations

import logging

from kvwarm.server.tools import ToolCall, parse_tool_calls

Json = dict[str, object]

log = logging.getLogger(__name__)

_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<function=")
_STABLE_MARKER = "<tool_call>"  # the parser's first choice: no later marker overrides it


class ToolStream:
    """``feed`` returns (content safe to show now, call deltas); ``finish`` the rest."""

    def __init__(self, names: frozenset[str], *, forced: bool, single: bool = False) -> None:
        """``single``: parallel calls are off; only the reply's first call is reported."""
        self._names = names
        self._single = single
        self._held = bool(names) and forced  # a forced reply is all call: show no content
        self._text = ""
        self._shown = 0
        self._sent: list[ToolCall] = []

    def feed(self, fragment: str) -> tuple[str, list[Json]]:
        self._text += fragment
        content = self._content()
        if not self._held or not any(c in fragment for c in "}]>"):
            return content, []  # a call only completes with a closing bracket or tag
        return content, self._stream_calls()

    def _content(self) -> str:
        if not self._names:
            out = self._text[self._shown :]
            self._shown = len(self._text)
            return out
        if self._held:
            return ""
        pending = self._text[self._shown :]
        if not self._text[: self._shown].strip() and pending.lstrip().startswith(("{", "[")):
            self._held = True  # may be a bare JSON call: decide at the end
            return ""
        cut = len(pending)
        for marker in _MARKERS:
            at = pending.find(marker)
            if at >= 0:
                cut = min(cut, at)
                self._held = True
            else:  # keep back a tail that could grow into the marker
                for k in range(min(len(marker) - 1, len(pending)), 0, -1):
                    if pending.endswith(marker[:k]):
                        cut = min(cut, len(pending) - k)
                        break
        out = pending[:cut]
        self._shown += cut
        return out

    def _calls(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse_tool_calls(self._text, self._names)
        return content, calls[:1] if self._single else calls

    def _stream_calls(self) -> list[Json]:
        if _STABLE_MARKER not in self._text:
            return []
        _, calls = self._calls()
        out = [_header(i, call) for i, call in enumerate(calls) if i >= len(self._sent)]
        self._sent.extend(calls[len(self._sent) :])
        return out

    def finish(self) -> tuple[str, list[Json], bool]:
        """(content not yet shown, the call deltas still due, whether the reply is calls)."""
        content, calls = self._calls()
        if not calls:
            rest = self._text[self._shown :]
            self._shown = len(self._text)
            return rest, [], False
        rest = content[self._shown :] if content.startswith(self._text[: self._shown]) else ""
        if [(c.name, c.arguments) for c in calls[: len(self._sent)]] != [
            (c.name, c.arguments) for c in self._sent
        ]:  # cannot happen while the parser keeps earlier <tool_call> blocks as they were
            log.error("streamed tool calls differ from the reply's: %r", self._text)
        out = [_header(i, call) for i, call in enumerate(calls) if i >= len(self._sent)]
        return rest, out, True


def _header(index: int, call: ToolCall) -> Json:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
