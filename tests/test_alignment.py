"""The n_batch-alignment rule (``kvwarm.alignment``), and the places that now call it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvwarm.alignment import align_down, canonical_after, canonical_after_chunk, chunk_end
from kvwarm.backends._checks import aligned_chunks
from kvwarm.engine.worker.savegates import aligned_boundary


@given(st.integers(0, 5000), st.integers(1, 600))
def test_align_down_is_the_largest_multiple_not_above(n: int, nb: int) -> None:
    a = align_down(n, nb)
    assert a % nb == 0 and a <= n < a + nb


@given(st.integers(0, 5000), st.integers(1, 600), st.integers(1, 600))
def test_chunk_end_stops_at_the_next_multiple_or_the_stop(start: int, extra: int, nb: int) -> None:
    stop = start + extra
    end = chunk_end(start, stop, nb)
    assert start < end <= stop
    assert end == stop or end % nb == 0
    assert not any(p % nb == 0 for p in range(start + 1, end))  # never crosses a multiple


@given(st.integers(0, 3000), st.integers(1, 700), st.integers(1, 600))
def test_backend_prefill_chunks_follow_the_rule(start: int, n: int, nb: int) -> None:
    chunks = list(aligned_chunks(start, n, nb))
    assert sum(length for _, length in chunks) == n
    for offset, length in chunks:
        assert start + offset + length == chunk_end(start + offset, start + n, nb)


def test_cold_save_boundary_is_aligned_down_after_the_trim() -> None:
    assert aligned_boundary(100, 10, 16) == align_down(90, 16) == 80


def test_canonical_after() -> None:
    assert canonical_after(32, None, 50, 16) == 50  # aligned start: the rest is aligned too
    assert canonical_after(30, None, 50, 16) == 30
    assert canonical_after(32, 20, 50, 16) == 20  # the source was only canonical up to 20


def test_a_chunk_cut_by_the_budget_is_not_canonical_from_its_aligned_start() -> None:
    assert canonical_after_chunk(100, 16, 32, 100, 16) == 100  # ends at a multiple
    assert canonical_after_chunk(100, 32, 40, 40, 16) == 100  # ends at the prompt's end
    assert canonical_after_chunk(100, 20, 28, 100, 16) == 16  # cut short inside [16, 32)
