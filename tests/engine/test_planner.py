from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvwarm.alignment import canonical_after
from kvwarm.engine.planner import Plan, better, common_prefix, usable_length


@given(st.lists(st.integers(0, 3), max_size=600), st.lists(st.integers(0, 3), max_size=600))
def test_common_prefix_matches_a_plain_loop(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(a, b) == n


def test_default_mode_keeps_all_but_the_last_prompt_token() -> None:
    assert usable_length(100, 100, canonical=None, n_batch=16, deterministic=False) == (99, False)
    assert usable_length(37, 100, canonical=None, n_batch=16, deterministic=False) == (37, False)


def test_deterministic_mode_trims_to_aligned_canonical_kv() -> None:
    assert usable_length(37, 100, canonical=None, n_batch=16, deterministic=True) == (32, False)
    assert usable_length(90, 100, canonical=40, n_batch=16, deterministic=True) == (32, False)
    assert usable_length(100, 100, canonical=None, n_batch=16, deterministic=True) == (96, False)


def test_stored_logits_serve_an_exact_prompt_without_decoding() -> None:
    got = usable_length(
        50, 50, canonical=None, n_batch=16, deterministic=True, row_tokens=50, row_has_logits=True
    )
    assert got == (50, True)
    # A row whose tail was generated one token at a time is not canonical: no shortcut.
    got = usable_length(
        50, 50, canonical=30, n_batch=16, deterministic=True, row_tokens=50, row_has_logits=True
    )
    assert got == (16, False)
    # A longer row's logits belong to its own last token, not to this prompt's.
    got = usable_length(
        50, 50, canonical=None, n_batch=16, deterministic=False, row_tokens=60, row_has_logits=True
    )
    assert got == (49, False)


def test_better_prefers_more_reuse_then_the_cheaper_source() -> None:
    row = Plan("row", 40, row_key=b"k")
    own = Plan("self", 40)
    assert better(row, own) is own
    assert better(own, Plan("row", 41)).kind == "row"


def test_canonical_after_restores() -> None:
    assert canonical_after(32, None, 100, 16) == 100
    assert canonical_after(33, None, 100, 16) == 33
    assert canonical_after(32, 20, 100, 16) == 20
