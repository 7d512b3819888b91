"""The Prompt type: ids that stand for media spans, and where a prompt may be resumed."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwarm.tokens import SPAN_ID_BIT, Prompt, Span, is_span_id, resume_point, span_ids

RED = hashlib.sha256(b"red pixels").digest()
BLUE = hashlib.sha256(b"blue pixels").digest()


def test_span_ids_depend_on_content_and_offset_and_are_never_vocabulary_ids() -> None:
    red = span_ids(RED, 16)
    assert red == span_ids(RED, 16)  # the same content, the same ids, in every process
    assert span_ids(RED, 4) == red[:4]  # an id depends on its offset, not the span's length
    assert all(is_span_id(t) and t < 1 << 32 for t in red)  # a u32 the cache can store
    blue = span_ids(BLUE, 16)
    assert all(a != b for a, b in zip(red, blue, strict=True))
    assert len(set(red)) == 16  # no two positions of a span alike
    with pytest.raises(ValueError):
        span_ids(RED, 0)


def test_a_built_prompt_places_its_spans_between_text() -> None:
    p = Prompt.build([[1, 2, 3], (RED, 4, "image"), [7, 8]])
    assert len(p) == 9
    assert p.tokens[:3] == (1, 2, 3) and p.tokens[-2:] == (7, 8)
    assert p.tokens[3:7] == span_ids(RED, 4)
    assert p.spans == (Span(3, 4, RED, "image"),)
    assert p.text_tokens() == [1, 2, 3, 7, 8]
    assert Prompt.text([5, 6]) == Prompt((5, 6))
    assert Prompt.text([5, 6]).text_tokens() == [5, 6]


def test_spans_that_overlap_or_leave_the_prompt_are_refused() -> None:
    ids = tuple(range(10))
    with pytest.raises(ValueError):
        Prompt(ids, (Span(2, 4, RED), Span(5, 2, BLUE)))
    with pytest.raises(ValueError):
        Prompt(ids, (Span(8, 4, RED),))
    with pytest.raises(ValueError):
        Prompt(ids, (Span(1, 2, b"short"),))
    with pytest.raises(ValueError):
        Prompt(ids, (Span(1, 0, RED),))


def test_a_resume_point_inside_a_span_moves_to_its_start() -> None:
    spans = (Span(4, 8, RED), Span(20, 4, BLUE))
    assert [resume_point(spans, k) for k in (0, 4, 5, 11, 12, 13, 21, 24, 30)] == [
        0, 4, 4, 4, 12, 13, 20, 24, 30,
    ]  # fmt: skip
    assert resume_point((), 7) == 7


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), max_size=6), st.integers(0, 80))
def test_a_resume_point_never_ends_a_span_early(gaps: list[tuple[int, int]], keep: int) -> None:
    spans: list[Span] = []
    at = 0
    for gap, length in gaps:
        spans.append(Span(at + gap, length, RED))
        at += gap + length
    got = resume_point(spans, keep)
    assert got <= keep
    assert not any(s.start < got < s.end for s in spans)
    assert got == keep or any(s.start == got for s in spans)


def test_the_top_bit_is_what_marks_a_span_id() -> None:
    assert not is_span_id(SPAN_ID_BIT - 1) and is_span_id(SPAN_ID_BIT)
