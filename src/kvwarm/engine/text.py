"""Turning generated tokens into text: UTF-8 safe across token boundaries, stop sequences held
back until they can no longer match.

Invariant: the concatenation of every fragment ``TextAssembler`` emits equals the final text,
and no emitted fragment contains (part of) a stop sequence that ends the completion.
"""

from __future__ import annotations

import codecs


class TextAssembler:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=0)
        self._text = ""  # everything decoded so far (before any stop cut)
        self._emitted = 0  # chars of _text already handed out
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        self._text += self._decoder.decode(piece)
        if self._stop:
            # Search only where a new match can start: from the emitted point minus the
            # longest stop length (a stop may straddle earlier, held-back text).
            start = max(0, self._emitted - self._hold)
            cut = -1
            for s in self._stop:
                i = self._text.find(s, start)
                if i != -1 and (cut == -1 or i < cut):
                    cut = i
            if cut != -1:
                self._text = self._text[:cut]
                self.stopped = True
                return self._flush_to(len(self._text))
            return self._flush_to(max(self._emitted, len(self._text) - self._hold + 1))
        return self._flush_to(len(self._text))

    def finish(self) -> str:
        """End of generation: release held-back text (and any dangling partial UTF-8)."""
        if not self.stopped:
            self._text += self._decoder.decode(b"", final=True)
        return self._flush_to(len(self._text))

    @property
    def text(self) -> str:
        return self._text

    def _flush_to(self, end: int) -> str:
        end = min(end, len(self._text))
        if end <= self._emitted:
            return ""
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
