"""Streaming a chat reply that may hold tool calls: content shown as it comes, calls streamed
as OpenAI streams them.

OpenAI's shape, per call ``i``: one delta ``{"index": i, "id", "type": "function",
"function": {"name", "arguments": ""}}`` as soon as the name is known, then deltas
``{"index": i, "function": {"arguments": <fragment>}}`` whose concatenation is the call's
arguments JSON.

Invariants:

- Text that may be the start of a call (a marker, a tail that could grow into one, a reply
  that starts as bare JSON) is held back from the content; ``finish`` parses the whole reply
  with ``tools.parse_tool_calls``, the same parser as a non-streamed response.
- A call is streamed only for a declared tool, in order, and only while the scan of the reply
  so far (``scan_calls``) sees its arguments as a JSON object or array: those fragments are the
  model's own text, so their concatenation is exactly the arguments the model wrote. Whatever
  the scan could not stream (arguments given as a JSON string, a name after its arguments) is
  sent whole by ``finish``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from kvwarm.server.tools import parse_tool_calls

Json = dict[str, object]

_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<function=")
_FUNCTION_TAG = re.compile(r"<function=([\w.\-]+)>\s*$")
_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class PartialCall:
    """A call as far as the reply so far shows it (offsets into the scanned text)."""

    name: str | None = None
    args_start: int = -1
    args_end: int = -1  # -1: the arguments are not complete yet
    args_string: bool = False  # arguments given as a JSON string: not streamed piecewise


def _string_end(text: str, start: int) -> int:
    """Index just past the JSON string opening at ``start``; -1 if it is not closed yet."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return -1


def _string_value(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class _Scan:
    """One pass over the reply: call objects at the top level (or in a top-level array),
    their ``name`` and where their ``arguments`` value lies; or ``<function=name>`` tags
    followed by their arguments object."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.calls: list[PartialCall] = []
        self.stack: list[str] = []
        self.call: PartialCall | None = None
        self.level = -1  # stack depth inside the current call object
        self.args_only = False  # the current object is a <function=name> tag's arguments
        self.key: str | None = None
        self.expect_key = True
        self.awaiting_value = False
        self.value_key: str | None = None
        self.value_start = -1
        self.top_end = 0  # end of the last top-level value

    def run(self) -> list[PartialCall]:
        i, text = 0, self.text
        while i < len(text):
            ch = text[i]
            at_call = self.call is not None and not self.args_only and len(self.stack) == self.level
            if at_call and self.awaiting_value and not ch.isspace():
                self._value_starts(i, ch)
            if ch == '"':
                end = _string_end(text, i)
                if end < 0:
                    break
                if at_call:
                    self._string(i, end)
                i = end
                continue
            if ch in "{[":
                self._open(i, ch)
            elif ch in "}]":
                self._close(i)
            elif at_call and ch == ":":
                self.expect_key, self.awaiting_value = False, True
            elif at_call and ch == ",":
                self._value_ends(i)
                self.expect_key = True
            i += 1
        return self.calls

    def _value_starts(self, i: int, ch: str) -> None:
        assert self.call is not None
        self.awaiting_value = False
        self.value_start, self.value_key = i, self.key
        if self.key in _ARGUMENT_KEYS:
            self.call.args_start = i
            self.call.args_string = ch == '"'

    def _value_ends(self, end: int) -> None:
        """A scalar or string value at call level ends at ``end`` (exclusive)."""
        if self.value_start < 0 or self.call is None:
            return
        if self.value_key in _ARGUMENT_KEYS and self.call.args_end < 0:
            self.call.args_end = len(self.text[:end].rstrip())
        self.value_start = -1

    def _string(self, start: int, end: int) -> None:
        assert self.call is not None
        literal = self.text[start:end]
        if self.expect_key:
            self.key = _string_value(literal)
        elif self.value_start == start:
            if self.value_key == "name":
                self.call.name = _string_value(literal)
            self._value_ends(end)

    def _open(self, i: int, ch: str) -> None:
        top = not self.stack or (len(self.stack) == 1 and self.stack[0] == "[")
        if self.call is None and ch == "{" and top:
            tag = _FUNCTION_TAG.search(self.text, self.top_end, i) if not self.stack else None
            self.call = PartialCall()
            self.args_only = tag is not None
            if tag is not None:
                self.call.name, self.call.args_start = tag.group(1), i
            self.calls.append(self.call)
            self.key, self.expect_key, self.awaiting_value = None, True, False
            self.value_start = -1
            self.stack.append(ch)
            self.level = len(self.stack)
            return
        self.stack.append(ch)

    def _close(self, i: int) -> None:
        if not self.stack:
            return
        self.stack.pop()
        depth = len(self.stack)
        if self.call is not None:
            if depth == self.level - 1:  # the call object itself closes
                if self.args_only:
                    self.call.args_end = i + 1
                else:
                    self._value_ends(i)
                self.call = None
            elif depth == self.level and not self.args_only and self.value_start >= 0:
                if self.value_key in _ARGUMENT_KEYS:
                    self.call.args_end = i + 1
                self.value_start = -1
        if not self.stack:
            self.top_end = i + 1


def scan_calls(text: str) -> list[PartialCall]:
    """The calls that ``text`` (a reply, possibly cut short) shows so far."""
    return _Scan(text).run()


@dataclass(slots=True)
class _Sent:
    id: str
    name: str
    args: str = ""  # argument text sent so far


class ToolStream:
    """``feed`` returns (content safe to show now, call deltas); ``finish`` the rest."""

    def __init__(self, names: frozenset[str], *, forced: bool, single: bool = False) -> None:
        """``single``: parallel calls are off; only the reply's first call is reported."""
        self._names = names
        self._single = single
        self._held = bool(names) and forced  # a forced reply is all call: show no content
        self._text = ""
        self._shown = 0
        self._region = 0 if self._held else -1  # where the calls start in _text; -1: no call
        self._sent: list[_Sent] = []

    def feed(self, fragment: str) -> tuple[str, list[Json]]:
        self._text += fragment
        content = self._content()
        if self._held and self._region < 0:
            self._region = self._shown
        return content, self._stream_calls() if self._region >= 0 else []

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

    def _stream_calls(self) -> list[Json]:
        region = self._text[self._region :]
        out: list[Json] = []
        for index, seen in enumerate(scan_calls(region)):
            if index == len(self._sent):
                if self._single and index > 0:
                    break  # parallel calls off: the first call is the only one
                if seen.name is None or seen.name not in self._names:
                    break  # calls go out in order: wait until this one's name is known
                sent = _Sent("call_" + secrets.token_hex(12), seen.name)
                self._sent.append(sent)
                out.append(_header(index, sent, ""))
            sent = self._sent[index]
            if seen.args_start < 0 or seen.args_string:
                continue
            end = seen.args_end if seen.args_end >= 0 else len(region)
            args = region[seen.args_start : end]
            if args.startswith(sent.args) and len(args) > len(sent.args):
                out.append(_arguments(index, args[len(sent.args) :]))
                sent.args = args
        return out

    def finish(self) -> tuple[str, list[Json], bool]:
        """(content not yet shown, the call deltas still due, whether the reply is calls)."""
        content, calls = parse_tool_calls(self._text, self._names)
        calls = calls[:1] if self._single else calls
        if not calls:
            # Not a call after all, even if a header already went out (a reply cut off by
            # max_tokens inside its call): the finish reason follows the non-streamed
            # response's ("length", "stop"), never "tool_calls" for arguments that never closed.
            rest = self._text[self._shown :]
            self._shown = len(self._text)
            return rest, [], False
        rest = content[self._shown :] if content.startswith(self._text[: self._shown]) else ""
        out: list[Json] = []
        for index, call in enumerate(calls):
            if index >= len(self._sent):
                out.append(_header(index, _Sent(call.id, call.name), call.arguments))
                continue
            sent = self._sent[index]
            if sent.args and _same_json(sent.args, call.arguments):
                continue
            if not sent.args:
                out.append(_arguments(index, call.arguments))
        return rest, out, True


def _same_json(a: str, b: str) -> bool:
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def _header(index: int, sent: _Sent, arguments: str) -> Json:
    return {
        "index": index,
        "id": sent.id,
        "type": "function",
        "function": {"name": sent.name, "arguments": arguments},
    }


def _arguments(index: int, fragment: str) -> Json:
    return {"index": index, "function": {"arguments": fragment}}
