"""One streamed chat choice: engine fragments in, the ``delta`` chunks OpenAI streams out.

Invariants: the content deltas, concatenated, are the content a non-streamed response gives;
the logprobs of every generated token go out exactly once, with the content they belong to (a
token whose text is held back, by the engine or by the tool-call filter, sends its logprob
with the text that follows it, or with the last chunk); tool calls go out as the tool-call
filter (``tool_stream``) reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwarm.engine.request import Fragment
from kvwarm.engine.types import Completion, TokenLogprob
from kvwarm.server import convert
from kvwarm.server.tool_stream import ToolStream

Json = dict[str, object]


@dataclass(frozen=True, slots=True)
class Delta:
    """One chunk's choice: its delta, its logprobs (or None), its finish reason (or None)."""

    delta: Json
    logprobs: Json | None = None
    finish: str | None = None


class ChatChoiceStream:
    def __init__(self, names: frozenset[str], *, forced: bool, logprobs: bool) -> None:
        self._tools = ToolStream(names, forced=forced)
        self._want_logprobs = logprobs
        self._pending: list[TokenLogprob] = []
        self._fed_logprobs = False

    def feed(self, fragment: Fragment) -> list[Delta]:
        self._pending.extend(fragment.logprobs)
        self._fed_logprobs = self._fed_logprobs or bool(fragment.logprobs)
        out: list[Delta] = []
        text, calls = self._tools.feed(fragment.text)
        if text:
            out.append(Delta({"content": text}, self._take_logprobs()))
        out.extend(Delta({"tool_calls": [call]}) for call in calls)
        return out

    def finish(self, done: Completion) -> list[Delta]:
        out: list[Delta] = []
        rest, calls, any_call = self._tools.finish()
        if rest:
            out.append(Delta({"content": rest}, self._take_logprobs()))
        out.extend(Delta({"tool_calls": [call]}) for call in calls)
        reason = "tool_calls" if any_call else convert.finish_reason(done.stats)
        if not self._fed_logprobs and done.logprobs:
            # A stream whose fragments carry no logprobs (a cluster replica streams text only):
            # the completion's logprobs go out with the last chunk.
            self._pending = list(done.logprobs)
        out.append(Delta({}, self._take_logprobs() if self._pending else None, reason))
        return out

    def _take_logprobs(self) -> Json | None:
        if not self._want_logprobs:
            return None
        items, self._pending = self._pending, []
        return convert.chat_logprobs(items)
