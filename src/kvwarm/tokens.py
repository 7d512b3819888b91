"""A prompt as the engine and the cache see it, and the token-sequence helpers both sides use.

A ``Prompt`` has one id per position. A text token's id is itself. The positions of a *span*
(an image's or an audio clip's embeddings: content that is not text) hold ids derived from a
hash of the span's decoded content (``span_ids``), each with the top bit of a u32 set, so no
vocabulary id equals one. Everything in the cache that is keyed by tokens (a row's key, the
prefix tree, chunk keys, the miss history) hashes these ids, so two prompts that show the same
picture share its KV, a one-pixel change shares only what precedes the span, and the cache
needs no other change to carry media (SGLang pads an image's positions in its radix tree with
a value derived from the image's hash for the same reason). A text prompt is the span-less
case: its ids are its tokens, untouched.

A span is attended to non-causally and decoded whole, so KV that ends inside one is no state
of any prompt: ``resume_point`` moves a reuse length that falls inside a span back to its
start. The planner applies it to every source.

Invariant: pure; imports nothing of kvwarm.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SPAN_ID_BIT",
    "Prompt",
    "Span",
    "common_prefix",
    "is_span_id",
    "resume_point",
    "span_ids",
    "tail_of",
]

#: Set in every id that stands for a span's position; never set in a vocabulary's ids.
SPAN_ID_BIT = 1 << 31
_ID_MASK = SPAN_ID_BIT - 1
_U32 = next(c for c in ("I", "L") if array(c).itemsize == 4)
DIGEST_BYTES = 32


def is_span_id(token: int) -> bool:
    return token >= SPAN_ID_BIT


def span_ids(digest: bytes, length: int) -> tuple[int, ...]:
    """The ``length`` ids standing for the positions of a span whose content hashes to
    ``digest``: each depends on the digest and its offset, so a span shares nothing with a
    span of other content and a prefix of it is never a prefix of another's."""
    if length <= 0:
        raise ValueError(f"a span has at least one position, got {length}")
    words = array(_U32, hashlib.shake_256(b"kvwarm-span\0" + digest).digest(4 * length))
    return tuple(SPAN_ID_BIT | (w & _ID_MASK) for w in words)


@dataclass(frozen=True, slots=True)
class Span:
    """Positions ``[start, start + length)`` of a prompt filled by content that is not text,
    named by ``digest``, a hash of its decoded content (pixels and size, or samples); ``kind``
    says what it is (``image``, ``audio``)."""

    start: int
    length: int
    digest: bytes
    kind: str = "image"

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt's ids, one per position, and its spans, ascending and disjoint (see the module
    docstring). ``Prompt.text(tokens)`` is the span-less case; ``Prompt.build`` joins text
    tokens and spans."""

    tokens: tuple[int, ...]
    spans: tuple[Span, ...] = ()

    def __post_init__(self) -> None:
        end = 0
        for span in self.spans:
            if span.start < end or span.length <= 0 or span.end > len(self.tokens):
                raise ValueError(f"span {span.start}+{span.length} overlaps or leaves the prompt")
            if len(span.digest) != DIGEST_BYTES:
                raise ValueError(f"a span's digest is {DIGEST_BYTES} bytes")
            end = span.end

    @classmethod
    def text(cls, tokens: Sequence[int]) -> Prompt:
        return cls(tuple(tokens))

    @classmethod
    def build(cls, parts: Sequence[Sequence[int] | tuple[bytes, int, str]]) -> Prompt:
        """A prompt from text token runs and spans ``(digest, length, kind)``, in order."""
        tokens: list[int] = []
        spans: list[Span] = []
        for part in parts:
            if isinstance(part, tuple) and len(part) == 3 and isinstance(part[0], bytes):
                digest, length, kind = part
                spans.append(Span(len(tokens), length, digest, kind))
                tokens.extend(span_ids(digest, length))
            else:
                tokens.extend(part)
        return cls(tuple(tokens), tuple(spans))

    def __len__(self) -> int:
        return len(self.tokens)

    def text_tokens(self) -> list[int]:
        """The ids of the positions that are text (what a vocabulary check looks at)."""
        if not self.spans:
            return list(self.tokens)
        out: list[int] = []
        at = 0
        for span in self.spans:
            out.extend(self.tokens[at : span.start])
            at = span.end
        out.extend(self.tokens[at:])
        return out


def resume_point(spans: Sequence[Span], keep: int) -> int:
    """``keep``, or the start of the span it falls inside: KV ending inside a span is no
    prompt's state."""
    for span in spans:
        if span.start >= keep:
            break
        if keep < span.end:
            return span.start
    return keep


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: slices compare in C, far faster than a Python loop.
    block = 256
    while i + block <= n and a[i : i + block] == b[i : i + block]:
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tail_of(chunk_lens: Sequence[int], upto: int) -> tuple[int, int]:
    """(how many leading chunks end at or before ``upto``, the position the others start
    at): where a read or restore of a row's tail begins when the KV before ``upto`` is held
    elsewhere. The last chunk is always part of the tail."""
    skip = start = 0
    for length in chunk_lens[:-1]:
        if start + length > upto:
            break
        start += length
        skip += 1
    return skip, start
