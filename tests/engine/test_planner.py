from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvwarm.alignment import canonical_after
from kvwarm.cache.explain import MissReason
from kvwarm.engine.worker.planner import (
    Plan,
    RowCandidate,
    better,
    choose,
    recheck_row,
    trim_reason,
    trim_restored,
    usable_length,
)
from kvwarm.engine.worker.slots import Slot
from kvwarm.tokens import Span, common_prefix


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


def _slot(seq: int, kv: list[int], canonical: int, last_used: float = 0.0) -> Slot:
    return Slot(seq=seq, kv_tokens=kv, canonical=canonical, last_used=last_used)


def test_choose_prefers_the_slot_holding_the_prompt_then_the_cheaper_source() -> None:
    prompt = list(range(40))
    warm = _slot(1, prompt[:30], 30, last_used=5.0)
    empty = _slot(0, [], 0)
    row = RowCandidate(b"k" * 32, n_shared=30, n_tokens=30, canonical=None, has_logits=False)
    slot, plan = choose(
        prompt, free=[empty, warm], slots=[empty, warm], row=row, n_batch=16, deterministic=False
    )
    assert slot is warm and plan == Plan("self", 30, shared=30)


def test_choose_copies_from_a_busy_slot_into_an_empty_one() -> None:
    prompt = list(range(40))
    busy = _slot(1, prompt[:20], 20)
    empty = _slot(0, [], 0)
    slot, plan = choose(
        prompt, free=[empty], slots=[empty, busy], row=None, n_batch=16, deterministic=True
    )
    assert slot is empty and plan.kind == "copy" and plan.src_seq == 1 and plan.keep == 16


def test_choose_takes_a_longer_row_with_its_logits() -> None:
    prompt = list(range(40))
    row = RowCandidate(b"k" * 32, n_shared=40, n_tokens=40, canonical=None, has_logits=True)
    empty = _slot(0, [], 0)
    _, plan = choose(prompt, free=[empty], slots=[empty], row=row, n_batch=16, deterministic=False)
    assert (plan.kind, plan.keep, plan.use_logits, plan.row_key) == ("row", 40, True, row.key)


def test_a_row_that_changed_is_rescored_by_the_same_rules() -> None:
    assert recheck_row(32, 40, 50, canonical=None, n_batch=16, det=True) == 32
    assert recheck_row(32, 20, 50, canonical=None, n_batch=16, det=True) == 16
    assert recheck_row(32, 20, 50, canonical=None, n_batch=16, det=False) == 20


def test_an_unpacked_row_is_trimmed_to_what_it_holds() -> None:
    # Stored logits serve an exact prompt only.
    assert trim_restored(50, 50, 50, use_logits=True, n_batch=16, det=True) == (50, True)
    assert trim_restored(50, 50, 50, use_logits=False, n_batch=16, det=False) == (49, False)
    # A blob with fewer cells than its tokens claim: keep what it holds, aligned, no logits.
    assert trim_restored(50, 40, 50, use_logits=True, n_batch=16, det=True) == (32, False)


def test_choose_never_reuses_live_kv_of_another_namespace() -> None:
    from kvwarm.cache.types import Namespace

    alice = Namespace(b"\x01" * 32, 2, b"\x0a" * 32)
    bob = Namespace(b"\x01" * 32, 2, b"\x0b" * 32)
    prompt = list(range(40))
    idle = _slot(1, prompt[:30], 30, last_used=5.0)
    busy = _slot(2, prompt[:30], 30)
    empty = _slot(0, [], 0)
    idle.kv_namespace = busy.kv_namespace = alice
    for ns, kinds in ((bob, {"none"}), (None, {"none"}), (alice, {"self"})):
        slot, plan = choose(
            prompt,
            free=[empty, idle],
            slots=[empty, idle, busy],
            row=None,
            n_batch=16,
            deterministic=False,
            namespace=ns,
        )
        assert plan.kind in kinds, ns
        if plan.kind == "none":
            assert slot is empty and plan.keep == 0  # a cold prompt spares the warm slot
    # Only the busy slot holds the prefix: copied for its own namespace, never for another.
    _, plan = choose(
        prompt,
        free=[empty],
        slots=[empty, busy],
        row=None,
        n_batch=16,
        deterministic=False,
        namespace=alice,
    )
    assert (plan.kind, plan.src_seq) == ("copy", 2)
    _, plan = choose(
        prompt,
        free=[empty],
        slots=[empty, busy],
        row=None,
        n_batch=16,
        deterministic=False,
        namespace=bob,
    )
    assert plan.kind == "none"


def test_trim_reason_reads_the_planner_rules_back() -> None:
    def why(shared: int, n: int, keep: int, **kw: object) -> MissReason:
        args: dict[str, object] = {"canonical": None, "n_batch": 16, "deterministic": False}
        return trim_reason(shared, n, keep, **{**args, **kw})  # type: ignore[arg-type]

    assert why(100, 100, 100) is MissReason.NONE
    assert why(100, 100, 99) is MissReason.LAST_TOKEN
    assert why(60, 100, 60) is MissReason.NEW_TOKENS
    assert why(0, 100, 0) is MissReason.NO_PREFIX
    assert why(60, 100, 48, deterministic=True) is MissReason.ALIGNED_TRIM
    assert why(60, 100, 32, deterministic=True, canonical=40) is MissReason.ALIGNED_TRIM
    assert why(60, 100, 0, floor=80) is MissReason.MEMORY_FLOOR  # a whole state of 80
    assert why(60, 100, 0, deterministic=True, floor=60) is MissReason.MEMORY_FLOOR


def _chunked_row(n: int, lens: tuple[int, ...]) -> RowCandidate:
    return RowCandidate(
        b"r" * 32, n_shared=n, n_tokens=n, canonical=None, has_logits=False, chunk_lens=lens
    )


def test_a_row_restores_only_its_chunks_past_the_slots_own_live_kv() -> None:
    # Another conversation over the same 24-token system prompt holds the slot: the row's
    # chunks end at 16, 24 (the prompt's end) and 40; the restore starts at 24.
    prompt = list(range(50))
    other = _slot(0, [*prompt[:24], 900, 901], 26)
    row = _chunked_row(40, (16, 8, 16))
    slot, plan = choose(
        prompt, free=[other], slots=[other], row=row, n_batch=16, deterministic=False, tails=True
    )
    assert slot is other
    assert (plan.kind, plan.keep, plan.base, plan.src_seq) == ("row", 40, 24, 0)
    # Without tails, in deterministic mode (aligned keep 32), or for a row stored whole:
    # the whole row.
    for tails, det, whole_row in ((False, False, row), (True, True, row),
                                  (True, False, _chunked_row(40, ()))):  # fmt: skip
        _, plain = choose(
            prompt, free=[other], slots=[other], row=whole_row, n_batch=16, deterministic=det,
            tails=tails,
        )  # fmt: skip
        assert plain.kind == "row" and plain.base == 0 and plain.keep == (32 if det else 40)


def test_a_tail_restore_copies_its_base_from_the_slot_that_holds_the_most() -> None:
    prompt = list(range(50))
    empty = _slot(0, [], 0)
    busy = _slot(1, prompt[:20], 20)  # generating for another request: a copy of its KV
    row = _chunked_row(40, (16, 8, 16))
    slot, plan = choose(
        prompt, free=[empty], slots=[empty, busy], row=row, n_batch=16, deterministic=False,
        tails=True,
    )  # fmt: skip
    assert slot is empty
    assert (plan.kind, plan.keep, plan.base, plan.src_seq) == ("row", 40, 16, 1)


def test_a_tail_restore_never_starts_past_the_rows_last_chunk_or_its_keep() -> None:
    row = _chunked_row(40, (16, 8, 16))
    assert [row.tail_start(n) for n in (0, 15, 16, 23, 24, 39, 40, 99)] == [
        0, 0, 16, 16, 24, 24, 24, 24,
    ]  # fmt: skip
    # A live slot holding the whole row still leaves the row's last chunk to restore; one
    # holding more than the prompt keeps is bounded by what the row keeps.
    prompt = list(range(30))
    warm = _slot(0, list(range(60)), 60)
    _, plan = choose(
        prompt, free=[warm], slots=[warm], row=_chunked_row(40, (16, 8, 16)), n_batch=16,
        deterministic=False, tails=True,
    )  # fmt: skip
    assert plan.kind == "self"  # the live KV holds all 29 tokens a row would give


def test_no_source_is_resumed_inside_a_span() -> None:
    """A span is decoded whole: KV that ends inside it is no prompt's state, so a keep that
    would end there moves back to the span's start, for rows, live KV and re-checks."""
    spans = (Span(20, 16, b"d" * 32),)
    # A row holding the whole prompt but no logits: all but the last position...
    assert usable_length(40, 40, canonical=None, n_batch=16, deterministic=False, spans=spans) == (
        39,
        False,
    )
    # ... but one sharing up to the middle of the span keeps only what precedes it.
    got = usable_length(30, 40, canonical=None, n_batch=16, deterministic=False, spans=spans)
    assert got == (20, False)
    # Deterministic mode aligns after moving back, and moves back again if that lands inside.
    spans2 = (Span(10, 12, b"d" * 32),)
    assert usable_length(30, 40, canonical=None, n_batch=16, deterministic=True, spans=spans2) == (
        0,
        False,
    )
    # A prompt ending in a span decodes the whole span when the row's logits are missing.
    tail = (Span(30, 10, b"d" * 32),)
    assert usable_length(40, 40, canonical=None, n_batch=16, deterministic=False, spans=tail) == (
        30,
        False,
    )
    assert trim_restored(39, 39, 40, use_logits=False, n_batch=16, det=False, spans=tail) == (
        30,
        False,
    )
    assert recheck_row(39, 33, 40, canonical=None, n_batch=16, det=False, spans=tail) == 30
    # Live KV: a slot whose KV shares into the span is kept only up to its start.
    prompt = list(range(40))
    warm = _slot(0, prompt[:33], 33)
    slot, plan = choose(
        prompt, free=[warm], slots=[warm], row=None, n_batch=16, deterministic=False, spans=tail
    )
    assert slot is warm and (plan.kind, plan.keep) == ("self", 30)
    assert trim_reason(33, 40, 30, canonical=None, n_batch=16, deterministic=False, spans=tail) is (
        MissReason.INSIDE_SPAN
    )
