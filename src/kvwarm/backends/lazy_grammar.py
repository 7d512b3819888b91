"""A lazy grammar's trigger: where in a reply a grammar starts to hold (llama-server's
``grammar_lazy``: a tool call's grammar, once the model writes its format's opener).

Invariants (``SamplingParams.grammar_triggers``; both backends' samplers keep them):

- Until a trigger word appears in the sampled text the reply is free, sampled as without a
  grammar; the prompt's tokens (``Sampler.accept``) are never searched.
- The token that completes a trigger may carry text after it (SmolLM2 writes ``>.`` as one
  token): the grammar is given the trigger and that text, and starts only if it accepts them
  all; otherwise the reply stays free (the call is then as unconstrained as without a lazy
  grammar) and the search goes on after that token. llama.cpp's own lazy sampler
  (``llama_sampler_init_grammar_lazy_patterns``) replays that text unchecked and its
  ``std::runtime_error`` ends the process (measured: ``Sure <tool_call>.`` with SmolLM2),
  which is why the laziness lives here, over an ordinary grammar.
- Once the grammar's text is complete (it admits end-of-generation, even where it could
  also go on: a trailing space), the reply is free again, searched for the next trigger
  (more text, another call), unless ``grammar_once``: then the grammar holds to the end, as
  a whole-reply grammar does.
"""

from __future__ import annotations

from kvwarm.backends.base import SamplingParams
from kvwarm.errors import InvalidRequestError
from kvwarm.unicode import encode_utf8

#: A request's bounds: llama-server's formats need one or two words of a dozen bytes.
MAX_TRIGGERS = 16
MAX_TRIGGER_BYTES = 128


class TriggerWatch:
    """Finds the first trigger word in a reply's pieces, as they are sampled."""

    def __init__(self, triggers: tuple[bytes, ...]) -> None:
        self._triggers = triggers
        self._keep = max(len(t) for t in triggers) - 1  # a trigger split across pieces
        self._tail = b""

    def feed(self, piece: bytes) -> bytes | None:
        """The text the grammar must start with, when ``piece`` completes a trigger (that
        trigger and what follows it in ``piece``; the earliest, if several end in it); None
        when it does not. Without a match, the text is kept as far as a trigger could still
        start in it."""
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

    def clear(self) -> None:
        """Search afresh from the next piece on (a grammar just started or was refused)."""
        self._tail = b""


def trigger_watch(params: SamplingParams) -> TriggerWatch | None:
    """The watch of ``params``' triggers, None for a grammar that holds from the start;
    ``InvalidRequestError`` for triggers without a grammar, empty or beyond the bounds."""
    triggers = params.grammar_triggers
    if not triggers:
        if params.grammar_once:
            raise InvalidRequestError(
                "grammar_once is for a lazy grammar: give grammar_triggers", param="grammar_once"
            )
        return None
    if params.grammar is None:
        raise InvalidRequestError(
            "grammar_triggers start a grammar: give one", param="grammar_triggers"
        )
    if len(triggers) > MAX_TRIGGERS:
        raise InvalidRequestError(
            f"at most {MAX_TRIGGERS} grammar_triggers", param="grammar_triggers"
        )
    words = tuple(encode_utf8(t, param="grammar_triggers") for t in triggers)
    if any(not w or len(w) > MAX_TRIGGER_BYTES or b"\0" in w for w in words):
        raise InvalidRequestError(
            f"each of grammar_triggers must be 1 to {MAX_TRIGGER_BYTES} bytes, without NUL",
            param="grammar_triggers",
        )
    return TriggerWatch(words)
