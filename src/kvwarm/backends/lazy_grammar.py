"""A lazy grammar's trigger: where in a reply a grammar starts to hold (llama-server's
``grammar_lazy``: a tool call's grammar, once the model writes its format's opener).

Invariants (``SamplingParams.grammar_triggers``; both backends' samplers keep them):

- Until a trigger word appears in the sampled text the reply is free, sampled as without a
  grammar; the prompt's tokens (``Sampler.accept``) are never searched.
- The token that completes a trigger may carry text after it (SmolLM2 writes ``>.`` as one
  token): the grammar is given the trigger and that text, and starts only if it accepts them
  all; otherwise the reply stays free (the call is then as unconstrained as without a lazy
  grammar) and the search goes on from the byte after the refused trigger's start: the rest
  of that token's text may hold another trigger (tried in turn), or begin one the next token
  completes (found by review: that text was dropped). llama.cpp's own lazy sampler
  (``llama_sampler_init_grammar_lazy_patterns``) replays that text unchecked and its
  ``std::runtime_error`` ends the process (measured: ``Sure <tool_call>.`` with SmolLM2),
  which is why the laziness lives here, over an ordinary grammar.
- A start pattern (``grammar_start_patterns``, llama-server's ``PATTERN_FULL`` triggers: Llama
  3.x's bare-JSON call, which has no opener) is a regular expression that must match the
  reply's text from its very start: the grammar starts once the reply so far begins with a
  match, given the text from the pattern's first group on (from the start without a group).
  Only the reply's first ``MAX_TRIGGER_BYTES`` bytes are looked at, and only until a grammar
  first starts or refuses its start: a reply of ordinary text stays free.
- Once the grammar's text is complete (it admits end-of-generation, even where it could
  also go on: a trailing space), the reply is free again, searched for the next trigger
  (more text, another call), unless ``grammar_once``: then the grammar holds to the end, as
  a whole-reply grammar does.
"""

from __future__ import annotations

import re

from kvwarm.backends.base import SamplingParams
from kvwarm.errors import InvalidRequestError
from kvwarm.unicode import encode_utf8

#: A request's bounds: llama-server's formats need one or two words of a dozen bytes.
MAX_TRIGGERS = 16
MAX_TRIGGER_BYTES = 128


class TriggerWatch:
    """Finds the first trigger word in a reply's pieces, as they are sampled."""

    def __init__(
        self, triggers: tuple[bytes, ...], starts: tuple[re.Pattern[bytes], ...] = ()
    ) -> None:
        self._triggers = triggers
        self._keep = max((len(t) for t in triggers), default=1) - 1  # split across pieces
        self._tail = b""
        self._starts = starts
        self._head = b""  # the reply's text so far, while a start pattern may match it
        self._heading = bool(starts)

    def feed(self, piece: bytes) -> bytes | None:
        """The text the grammar must start with, when ``piece`` completes a trigger (that
        trigger and what follows it in ``piece``; the earliest, if several end in it); None
        when it does not. Without a match, the text is kept as far as a trigger could still
        start in it. A start pattern that matches the reply so far comes first."""
        if self._heading:
            self._head += piece
            for pattern in self._starts:
                if match := pattern.match(self._head):
                    self._heading, self._tail = False, b""
                    return self._head[match.start(1) if pattern.groups else 0 :]
            if len(self._head) > MAX_TRIGGER_BYTES:
                self._heading, self._head = False, b""
        return self._find(piece)

    def _find(self, piece: bytes) -> bytes | None:
        """The trigger search of ``feed``: the earliest trigger that ends in ``piece``."""
        if not self._triggers:
            return None
        text = self._tail + piece
        starts = [
            at
            for t in self._triggers
            if (at := text.find(t, 0)) >= 0 and at + len(t) > len(self._tail)
        ]
        if starts:
            self._tail = b""
            return text[min(starts) :]
        self._tail = text[-self._keep :] if self._keep else b""
        return None

    def refused(self, start: bytes) -> bytes | None:
        """The grammar refused ``start`` (what ``feed`` or this returned last): the reply's
        start is past, and the rest of ``start``, from its second byte on, is searched as a
        new piece. Returns the next text to try, as ``feed`` does; each is shorter, so a
        caller's loop ends."""
        self._tail = b""
        self._heading, self._head = False, b""
        return self._find(start[1:])

    def clear(self) -> None:
        """Search afresh from the next piece on (a grammar just started, was refused or let
        go): the reply's start is past, so start patterns are done."""
        self._tail = b""
        self._heading, self._head = False, b""

    def restart(self) -> None:
        """A new reply: search it from its start, start patterns included."""
        self._tail = b""
        self._heading, self._head = bool(self._starts), b""


def trigger_watch(params: SamplingParams) -> TriggerWatch | None:
    """The watch of ``params``' triggers, None for a grammar that holds from the start;
    ``InvalidRequestError`` for triggers without a grammar, empty or beyond the bounds, or a
    start pattern that does not compile."""
    triggers = params.grammar_triggers
    patterns = params.grammar_start_patterns
    if not triggers and not patterns:
        if params.grammar_once:
            raise InvalidRequestError(
                "grammar_once is for a lazy grammar: give grammar_triggers", param="grammar_once"
            )
        return None
    param = "grammar_triggers" if triggers else "grammar_start_patterns"
    if params.grammar is None:
        raise InvalidRequestError(f"{param} start a grammar: give one", param=param)
    if len(triggers) + len(patterns) > MAX_TRIGGERS:
        raise InvalidRequestError(
            f"at most {MAX_TRIGGERS} grammar_triggers and grammar_start_patterns in all",
            param=param,
        )
    words = tuple(encode_utf8(t, param="grammar_triggers") for t in triggers)
    if any(not w or len(w) > MAX_TRIGGER_BYTES or b"\0" in w for w in words):
        raise InvalidRequestError(
            f"each of grammar_triggers must be 1 to {MAX_TRIGGER_BYTES} bytes, without NUL",
            param="grammar_triggers",
        )
    return TriggerWatch(words, tuple(_start_pattern(p) for p in patterns))


def _start_pattern(pattern: str) -> re.Pattern[bytes]:
    """``pattern`` compiled over bytes (a reply's pieces may split a character)."""
    param = "grammar_start_patterns"
    source = encode_utf8(pattern, param=param)
    if not source or len(source) > MAX_TRIGGER_BYTES:
        raise InvalidRequestError(
            f"each of grammar_start_patterns must be 1 to {MAX_TRIGGER_BYTES} bytes", param=param
        )
    try:
        return re.compile(source)
    except re.error as e:
        raise InvalidRequestError(
            f"grammar_start_patterns: {pattern!r} is no regular expression ({e})", param=param
        ) from None
