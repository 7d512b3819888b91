"""Turning generated tokens into text: UTF-8 safe across token boundaries, stop sequences held
back until they can no longer match.

Invariants: the concatenation of every fragment ``TextAssembler`` emits equals the final text;
no emitted fragment contains (part of) a stop sequence that ends the completion; the bytes of a
character left incomplete when generation ends (a ``max_tokens`` cut mid-emoji) are dropped,
never emitted as U+FFFD. ``begun`` counts the tokens whose text starts in what was emitted:
the tokens a fragment's logprobs may cover (after a stop, exactly those of the returned text,
a token that holds the text's end and the stop's start included). A logprob token whose bytes
are not whole UTF-8 is named with ``piece_text``'s ``bytes:\\xNN`` form, which
``piece_bytes`` inverts exactly. With ``n_indent`` (llama-server's), a line after a newline
whose first character other than a space or a tab stands in a column below ``n_indent`` (an
empty line's newline included) ends the text there, as a stop sequence would: that
character and what follows are never emitted, the line's indentation is kept.
"""

from __future__ import annotations

import bisect
import codecs


class TextAssembler:
    def __init__(self, stop: tuple[str, ...], *, n_indent: int = 0) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = False  # whether the decoder holds bytes of an unfinished character
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=0)
        self._text = ""  # everything decoded so far (before any stop cut)
        self._emitted = 0  # chars of _text already handed out
        self.stopped = False
        self.matched: str | None = None  # the stop sequence that ended the text, if any
        self._starts: list[int] = []  # per token fed: where its text starts in _text
        self._n_indent = n_indent
        self._line = -1  # where the line whose indentation is undecided starts; -1: none
        self._scanned = 0  # _text before this has been looked at for newlines
        self.indent_cut = False  # whether a line indented less than n_indent ended the text

    def begun(self) -> int:
        """How many of the tokens fed have text that starts in what was emitted so far
        (a token completing a character split across tokens starts where that character
        does)."""
        return bisect.bisect_left(self._starts, self._emitted)

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        self._starts.append(len(self._text))
        if self._pending or not piece.isascii():
            # Part of a character may be held over from a token to the next.
            self._text += self._decoder.decode(piece)
            self._pending = bool(self._decoder.getstate()[0])
        else:
            self._text += piece.decode("ascii")  # what the decoder gives, without its frames
        if self._stop:
            # Search only where a new match can start: from the emitted point minus the
            # longest stop length (a stop may straddle earlier, held-back text).
            start = max(0, self._emitted - self._hold)
            cut = -1
            for s in self._stop:
                i = self._text.find(s, start)
                if i != -1 and (cut == -1 or i < cut):
                    cut, self.matched = i, s
            if cut != -1:
                self._text = self._text[:cut]
                self.stopped = True
        if self._n_indent > 0:
            # Before a stop sequence's cut, a line indented less ends the text first.
            under = self._under_indented()
            if under != -1:
                self._text = self._text[:under]
                self.stopped, self.matched, self.indent_cut = True, None, True
        if self.stopped or not self._stop:
            return self._flush_to(len(self._text))
        return self._flush_to(max(self._emitted, len(self._text) - self._hold + 1))

    def _under_indented(self) -> int:
        """Where in ``_text`` the first character (not a space or a tab) of a line indented
        less than ``n_indent`` stands, the first line (the rest of the one the text began
        on) never counting; -1 if none. Each newline is looked for once; a line's
        indentation is decided by its first such character."""
        text = self._text
        while True:
            if self._line == -1:
                newline = text.find("\n", self._scanned)
                if newline == -1:
                    self._scanned = len(text)
                    return -1
                self._line = newline + 1
            at = self._line
            while at < len(text) and text[at] in " \t":
                at += 1
            if at >= len(text):
                return -1  # only indentation so far: undecided
            if at - self._line < self._n_indent:
                return at
            self._line, self._scanned = -1, at

    def finish(self) -> str:
        """End of generation: release held-back text. Bytes of an unfinished character are
        dropped: the character was cut, and U+FFFD in its place would be invented text."""
        self._decoder.reset()
        self._pending = False
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


_BYTES_PREFIX = "bytes:"


def piece_text(piece: bytes) -> str:
    """One token's text for logprobs: the piece itself if it is whole UTF-8, else OpenAI's
    ``bytes:\\xf0\\x9f`` spelling of its raw bytes (a byte-level token of a longer character)."""
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError:
        return _BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in piece)
    return text


def piece_bytes(text: str) -> bytes:
    """The raw bytes of a ``piece_text`` result."""
    if text.startswith(_BYTES_PREFIX + "\\x"):
        try:
            return bytes.fromhex(text[len(_BYTES_PREFIX) :].replace("\\x", ""))
        except ValueError:
            pass
    return text.encode()
