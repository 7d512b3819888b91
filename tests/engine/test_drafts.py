"""The parts of speculative decoding's drafts (engine/worker/drafts.py): the n-gram index,
the draft budget, ngram-map-k's caps, the pass cost's fit."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from types import SimpleNamespace

import pytest

import kvwarm.engine.worker.drafts as drafts_module
from kvwarm.cache.types import Namespace, RowInfo, SaveReason, TtlClass
from kvwarm.engine.worker.draftmodel import check_vocab
from kvwarm.engine.worker.drafts import (
    ROW_UNSURE_MAX,
    TRUST_CONTEXT,
    CopyEnds,
    Cost,
    DraftBudget,
    DraftCost,
    Drafter,
    NgramIndex,
    PassCost,
    Predicted,
    RowDrafts,
    RowMatch,
    RowTrust,
    SentenceEnds,
    match_prior,
    overlapping,
    with_predicted,
)
from kvwarm.errors import ConfigError
from kvwarm.tenants import scoped, tenant_id, tenant_of


def test_ngram_index_finds_the_latest_earlier_occurrence() -> None:
    index = NgramIndex(2, [1, 2, 3, 1, 2, 4, 1, 2])
    assert index.lookup() == 3  # [1, 2] at 3 (then 4), not at 6 (the tail itself)
    index.extend([9])
    assert index.lookup() is None
    assert NgramIndex(3, [1, 2]).lookup() is None


def test_ngram_index_prefers_the_occurrence_matching_more_of_the_tail() -> None:
    """ "over 2,900 ... over 2,300": the reply quoting the first must not be drafted the
    second's continuation just because it is the later one."""
    text = [9, 1, 2, 3, 7, 7, 8, 1, 2, 3, 5, 5, 9, 1, 2, 3]
    index = NgramIndex(3, text)
    assert index.lookup() == 1  # [9, 1, 2, 3] matches at 0; the later [1, 2, 3] only 3
    assert index.occurrences((1, 2, 3)) == [1, 7]
    gpu = Cost(0.0, 0.02)
    assert Drafter("ngram-simple", 3, 4, text).propose([], 4, gpu) == [7, 7, 8, 1]
    tie = [1, 2, 3, 7, 1, 2, 3, 5, 1, 2, 3]
    assert NgramIndex(3, tie).lookup() == 4  # equally long matches: the latest


def test_budget_drafts_nothing_when_nothing_pays() -> None:
    gpu, cpu = Cost(0.0, 0.02), Cost(1.0, 0.4)
    budget = DraftBudget()
    assert budget.length(32, gpu) >= 16  # a fresh request tries, long on a GPU ...
    assert 1 <= budget.length(32, cpu) <= 8  # ... shorter where a verify pass costs more
    assert budget.length(32, Cost(3.0, 1.0)) == 0  # a pass that costs that much never pays
    for _ in range(6):
        budget.verified(4, 0)
    assert budget.length(32, cpu) == 0  # every draft failed: not worth a CPU's pass
    assert 1 <= budget.length(32, gpu) <= 4  # on a GPU a short draft still pays
    for _ in range(80):
        budget.skipped()
    assert budget.length(32, cpu) > 0  # the evidence faded: it tries again
    for _ in range(8):
        budget.verified(32, 32)
    assert budget.length(32, cpu) >= 16


def test_a_draft_models_own_passes_price_its_drafts() -> None:
    """A draft model's draft of ``k`` tokens costs ``k`` of its passes besides the verify pass
    (``DraftCost.total``): one as costly as the model drafts nothing, whatever the acceptance
    and even where verify rows are nearly free (a GPU); a cheap one drafts long where its
    drafts hold. Found by review (issue 39): the verify pass alone was priced, so SmolLM2
    drafting for itself drafted long on a CPU, slower than plain decoding."""
    cpu, gpu = Cost(0.4, 0.3), Cost(0.02, 0.01)
    same, cheap = DraftCost(1.0), DraftCost(0.05)
    mediocre, sure = DraftBudget(), DraftBudget()
    for _ in range(8):
        mediocre.verified(4, 2)
        sure.verified(16, 16)
    assert 0.4 < mediocre.acceptance() < 0.8 and sure.acceptance() > 0.95
    for budget in (DraftBudget(), mediocre, sure):
        assert budget.length(16, cpu) > 0  # the verify pass alone: it drafts ...
        for target in (cpu, gpu):
            assert budget.length(16, same.total(target, None)) == 0  # ... not at its cost
    assert 1 <= mediocre.length(16, cheap.total(cpu, None)) <= 4
    assert sure.length(16, cheap.total(cpu, None)) >= 12
    assert sure.length(16, cheap.total(gpu, None)) == 16
    assert cheap.total(cpu, None) == Cost(0.4, 0.35, row=0.3)  # a filler row: the verify row


def test_a_draft_models_cost_is_measured_robustly_and_comes_back_to_its_prior() -> None:
    """``DraftCost``: its prior until ``_MIN`` passes are timed, then the lower quartile of the
    recent ones over the model's plain pass (``PassCost.plain``), so passes stalled by another
    process move it little; once nothing was drafted for ``_WINDOW_S`` seconds or ``_STALE``
    drafts, the prior comes back (a cost measured under a stall is measured again)."""
    now = [0.0]
    cost = DraftCost(0.1, clock=lambda: now[0])
    for _ in range(DraftCost._MIN - 1):
        cost.observe(0.02)
    assert cost.per_token(0.01) == 0.1  # too few passes yet: the prior
    cost.observe(0.02)
    assert cost.per_token(0.01) == pytest.approx(2.0)  # twice the model's pass
    assert cost.per_token(None) == 0.1  # the model's pass not timed yet: the prior
    for _ in range(8):
        cost.observe(1.0)  # stalled
    for _ in range(20):
        cost.observe(0.021)
    assert cost.per_token(0.01) == pytest.approx(2.1)
    now[0] += DraftCost._WINDOW_S + 1
    assert cost.per_token(0.01) == 0.1  # none recent: the prior, tried and timed again
    for _ in range(DraftCost._MIN):
        cost.observe(0.05)
    assert cost.per_token(0.01) == pytest.approx(4.0)  # the bound: ``_MAX``
    for _ in range(DraftCost._STALE - 1):
        cost.idle()
    assert cost.per_token(0.01) == pytest.approx(4.0)
    cost.idle()
    assert cost.per_token(0.01) == 0.1


def test_pass_cost_plain_is_one_slots_lower_quartile() -> None:
    cost = PassCost(clock=lambda: 0.0)
    for seconds in (0.5, 0.4):
        cost.observe(2, 0, seconds)
        cost.observe(1, 0, seconds)
    assert cost.plain() is None  # fewer than ``_MIN_PLAIN``
    for seconds in (0.2, 0.3, 9.0):
        cost.observe(2, 0, seconds)
    assert cost.plain() == 0.3  # two slots' where one slot's are too few
    for seconds in (0.1, 0.15, 0.2, 0.25):
        cost.observe(1, 0, seconds)
    assert cost.plain() == 0.15
    cost.observe(1, 4, 0.01)  # a verify pass: no plain pass
    assert cost.plain() == 0.15


def test_a_draft_near_the_requests_end_goes_to_it_where_the_rest_would_cost_a_pass() -> None:
    """Where the request stops ``limit`` tokens on (its max_tokens), a draft a few tokens
    short of that leaves them to a pass of their own, which a CPU pays for nearly whole: the
    budget drafts to the end when that costs less per token than the two passes."""
    cpu = Cost(0.9, 0.42)
    budget = DraftBudget()
    assert budget.length(30, cpu, 0.99) == 24  # alone, the pass's ratio peaks 6 short
    assert budget.length(30, cpu, 0.99, end=True) == 30
    # Far from the end, the end is for a later pass; with little likely kept, it stays away.
    assert budget.length(40, cpu, 0.99, end=True) == 24
    assert budget.length(40, cpu, 0.95, end=True) == budget.length(40, cpu, 0.95) == 10


def test_map_k_caps_a_key_by_its_last_acceptance() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    drafter = Drafter("ngram-map-k", 2, 16, prompt)
    first = drafter.propose([], 16, Cost(0.0, 0.01))
    assert len(first) >= 3 and first == [7, 8, 9, 10, 11, 5, 6][: len(first)]
    drafter.verified(len(first), 1)
    # The same key again: at most one more token than were accepted; ngram-simple: no cap.
    assert drafter.propose([], 16, Cost(0.0, 0.01)) == [7, 8]
    simple = Drafter("ngram-simple", 2, 16, prompt)
    simple.propose([], 16, Cost(0.0, 0.01))
    simple.verified(len(first), 1)
    assert len(simple.propose([], 16, Cost(0.0, 0.01))) >= 3


def test_pass_cost_fits_its_fixed_and_per_token_parts_from_pairs_of_passes() -> None:
    now = [0.0]
    cost = PassCost(clock=lambda: now[0])
    assert cost.cost == PassCost.PRIOR  # nothing seen yet
    for _ in range(5):
        cost.observe(1, 0, 0.010)
    cost.observe(2, 3, 0.1)  # no plain pass of two slots yet: no sample
    assert cost.cost == PassCost.PRIOR
    # The truth: a draft of k costs 1 + 1.0 + 0.4 k one-token passes. The machine gets three
    # times slower meanwhile (another process): the pairs still say so.
    for _ in range(15):
        cost.observe(1, 0, 0.030)
    for k in (1, 4, 8, 16, 32) * 5:
        cost.observe(1, k, 0.030 * (2.0 + 0.4 * k))
    for _ in range(3):
        cost.observe(1, 8, 0.030 * 40)  # passes stalled for a second: they move it little
    fit = cost.cost
    assert abs(fit.fixed - 1.0) < 0.15 and abs(fit.per_token - 0.4) < 0.02
    assert Cost(1.0, 0.4).of(0) == 1.0 and Cost(1.0, 0.4).of(5) == 4.0
    # Two minutes with no verify pass (nothing drafted at that cost): the prior is back, so
    # drafts are tried and timed again.
    now[0] = 200.0
    assert cost.cost == PassCost.PRIOR


def test_pass_cost_priced_out_by_stalled_passes_comes_back_after_plain_passes() -> None:
    """Verify passes stalled by another process (0.7-2.4 s against ~31 ms plain, seen in a
    bench run at load 2-5) fit a cost that drafts nothing; with nothing drafted no sample
    came to correct it, and drafting stayed off for the two minutes the samples lived."""
    cost = PassCost(clock=lambda: 0.0)
    for _ in range(5):
        cost.observe(1, 0, 0.031)
    for k in (8, 16, 32, 48) * 3:
        cost.observe(1, k, 0.031 * 40 * Cost(0.4, 0.3).of(k))
    stalled = cost.cost
    assert stalled.of(8) > 16  # 8 drafted tokens cost more passes than they could save
    for _ in range(PassCost._STALE_PLAIN - 1):
        cost.observe(1, 0, 0.031)
    assert cost.cost == stalled
    cost.observe(1, 0, 0.031)
    assert cost.cost == PassCost.PRIOR  # drafts are tried and timed again


def test_pass_cost_fit_is_theil_sen_with_the_lower_quartile_intercept() -> None:
    """The fit (a loop over the pairs since numpy's calls cost ~0.74 ms cold right after a
    pass) against the numpy formulation it replaced, over random samples with repeated
    draft lengths (pairs of equal length have no slope) and both parities of pair counts."""
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    for _ in range(300):
        cost = PassCost(clock=lambda: 0.0)
        for _ in range(3):
            cost.observe(1, 0, 0.01)
        for _ in range(rng.randint(0, 31)):
            cost.observe(1, rng.choice([1, 2, 4, 8, 16, 33]), 0.01 * rng.uniform(1.0, 20.0))
        points = [(k, PassCost.PRIOR.of(k) - 1.0) for k in PassCost._PRIOR_AT]
        points += [(k, r - 1.0) for _, k, r, _split in cost._samples]
        xy = np.array(points, dtype=np.float64)
        x, y = xy[:, 0], xy[:, 1]
        i, j = np.triu_indices(len(points), 1)
        i, j = i[x[i] != x[j]], j[x[i] != x[j]]
        per_token = float(np.median((y[j] - y[i]) / (x[j] - x[i])))
        fixed = float(np.sort(y - per_token * x)[len(points) // 4])
        assert cost.cost == Cost(
            min(PassCost._MAX_FIXED, max(0.0, fixed)),
            min(PassCost._MAX_PER_TOKEN, max(0.002, per_token)),
        )


def test_cost_of_a_tiled_pass_pays_its_step_past_a_multiple_of_the_tile() -> None:
    """llamafile's tinyBLAS multiplies Q8_0 weights against 4 rows at a time (AVX-512) and
    reads them once more for the rest: 2-4 rows and every multiple of 4 pay no step, 5-7,
    9-11, ... do, so a draft of 7 (8 rows) can cost less than one of 6."""
    cost = Cost(0.5, 0.3, tile=4, step=1.1)
    assert [cost.split(r) for r in range(1, 14)] == [
        False, False, False, False, True, True, True, False, True, True, True, False, True,
    ]  # fmt: skip
    assert cost.of(0) == 1.0 and cost.of(3) == pytest.approx(2.4)  # 4 rows: no step
    assert cost.of(6) == pytest.approx(1.0 + 0.5 + 1.8 + 1.1)
    assert cost.of(7) < cost.of(6)
    assert Cost(0.5, 0.3).of(6) == pytest.approx(3.3)  # no tile: no step, as before


def test_a_split_pass_takes_filler_rows_where_they_cost_less_than_the_step() -> None:
    """``Cost.pad``: up to the next multiple of the tile, where that many rows (each a verify
    row's cost, ``row`` for a draft model's drafts) cost less than the step; ``draft``
    prices a draft with them: Gemma 3 270M took 186 ms for 48 rows and 197 for 47."""
    cost = Cost(0.5, 0.3, tile=4, step=1.1)
    assert [cost.pad(r) for r in range(1, 14)] == [0, 0, 0, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3]
    assert cost.draft(6) == pytest.approx(1.0 + 0.5 + 1.8 + 0.3)  # 7 rows and 1 filler
    assert cost.draft(4) == pytest.approx(1.0 + 0.5 + 1.2 + 0.9)  # 5 rows and 3
    assert cost.draft(7) == cost.of(7) and cost.draft(3) == cost.of(3)  # whole tiles
    small = Cost(0.5, 0.3, tile=4, step=0.5)  # a row costs more than a small step's share
    assert [small.pad(r) for r in (5, 6, 7)] == [0, 0, 1]
    assert small.draft(4) == small.of(4) == pytest.approx(1.0 + 0.5 + 1.2 + 0.5)
    # A draft model's token costs its own pass; a filler row only the verify row.
    drafted = Cost(0.5, 1.3, tile=4, step=1.1, row=0.3)
    assert drafted.pad(6) == 2 and drafted.draft(5) == pytest.approx(1.0 + 0.5 + 6.5 + 0.6)
    assert Cost(0.5, 0.3).pad(5) == 0  # no tile


def test_a_draft_cut_short_by_its_room_drafts_all_of_it_with_filler() -> None:
    """A sure copy whose pass has room for 22 draft tokens (its window, the batch): all 22
    and one filler row (24 rows, Gemma's measured costs), where the step had it stop at 19
    (20 rows), leaving 3 tokens to the next pass."""
    cost = Cost(1.0, 0.26, tile=4, step=1.15)
    sure = DraftBudget()
    for _ in range(6):
        sure.verified(47, 47)
    assert [sure.length(limit, cost, prior=0.9995) for limit in (18, 19, 22)] == [18, 19, 22]
    assert cost.pad(23) == 1 and cost.pad(20) == 0


def test_a_draft_at_the_edge_of_its_reach_is_priced_without_the_filler_it_cannot_take() -> None:
    """``Cost.reach``: the filler follows the draft, so a draft that ends at the last position
    its pass may reach (its window's end, its memory's lookahead, the batch's room) takes none
    (``Tick._pad``) and pays the step: the budget prices it so, and the sure copy of 22 stops
    at 19 (20 rows, a whole tile) where one more row of reach would have drafted all 22."""
    cost = Cost(1.0, 0.26, tile=4, step=1.15)
    sure = DraftBudget()
    for _ in range(6):
        sure.verified(47, 47)
    assert sure.length(22, replace(cost, reach=23), prior=0.9995) == 22  # 23 rows, 1 filler
    assert sure.length(22, replace(cost, reach=22), prior=0.9995) == 19
    assert replace(cost, reach=22).draft(22) == cost.of(22)
    assert replace(cost, reach=23).draft(22) == cost.draft(22) < cost.of(22)
    assert replace(cost, reach=0).draft(4) == cost.of(4)  # beside a prompt's chunk: no filler
    assert replace(cost, reach=0).draft(3) == cost.draft(3) == cost.of(3)  # a whole tile


def test_draft_lengths_snap_to_the_tile_where_the_step_outweighs_a_rows_cost() -> None:
    """Gemma 3 270M's measured costs (one-token passes: ~0.26 a row, a step of ~1.15):
    a likely copy's draft is sized to fill whole tiles of 4 rows, where the plain line
    drafted 6 tokens (7 rows, 56 ms against 8 rows' 44 ms on 2 cores)."""
    budget = DraftBudget()
    plain = budget.length(48, Cost(1.0, 0.26), prior=match_prior(13))
    tiled = budget.length(48, Cost(1.0, 0.26, tile=4, step=1.15), prior=match_prior(13))
    assert (plain + 1) % 4 != 0 and (tiled + 1) % 4 == 0
    # A small step (SmolLM2's tied output is 31% of its bytes) leaves a short draft be.
    assert budget.length(3, Cost(0.4, 0.3, tile=4, step=0.3), prior=0.95) == 3


def test_a_draft_whose_gain_has_stopped_growing_still_reaches_the_next_whole_tile() -> None:
    """The budget stops looking once a longer draft adds next to nothing (a sentence end the
    copy rarely goes past: ``through`` 0.03), but a draft past a multiple of the tile pays a
    step that the next whole tile does not: it stopped at 5 tokens (6 rows) and drafted 3,
    where 7 (8 rows, no step) is worth 4.5% more per unit of cost."""
    budget, cost = DraftBudget(), Cost(0.5, 0.002, tile=4, step=0.3)
    assert budget.length(16, cost, prior=0.5, breaks=(5,), through=0.03) == 7


def test_pass_cost_learns_the_tiles_step_from_split_passes() -> None:
    """With a tile, the step starts at the share of the weight bytes read once more
    (``ModelFacts.pass_tile_share``) and follows what split passes cost above the line that
    whole-tile passes draw; the line is not bent by them."""
    cost = PassCost(clock=lambda: 0.0, tile=4, share=0.9)
    assert cost.cost == Cost(PassCost.PRIOR.fixed, PassCost.PRIOR.per_token, 4, 0.9)
    for _ in range(5):
        cost.observe(1, 0, 0.010)
    truth = Cost(1.2, 0.26, tile=4, step=1.5)
    for k in (3, 7, 11, 15, 31, 47, 6, 8, 10, 16, 33) * 2:
        cost.observe(1, k, 0.010 * truth.of(k))
    fit = cost.cost
    assert fit.tile == 4
    assert abs(fit.per_token - 0.26) < 0.02 and abs(fit.fixed - 1.2) < 0.15
    assert abs(fit.step - 1.5) < 0.1
    # No tile (a GPU, a build without tinyBLAS, no such weight): no step, whatever the share.
    assert PassCost(tile=4, share=0.0).cost.tile == 1
    assert PassCost(tile=1, share=0.9).cost.step == 0.0


def test_a_split_baseline_of_several_slots_is_not_counted_as_a_draft_paying_the_step() -> None:
    """5 slots on a tile of 4: their plain passes pay the step themselves, so a verify pass
    of 6, 7, 9 rows pays none over them and one of 8 or 12 saves it. Counted as paying it
    (its rows alone were looked at), such samples fitted a step of 0 against the 0.27 (1.0
    in one-token passes, over a 5-slot pass of 3.7) that the whole-tile ones save."""
    truth = Cost(0.5, 0.3, tile=4, step=1.0)

    def seconds(rows: int) -> float:
        return 0.010 * truth.of(rows - 1)

    for slots in (5, 6):
        cost = PassCost(clock=lambda: 0.0, tile=4, share=1.0)
        for _ in range(3):
            for _ in range(4):
                cost.observe(slots, 0, seconds(slots))
            for k in range(1, 12):
                cost.observe(slots, k, seconds(slots + k))
        fit, plain = cost.cost, truth.of(slots - 1)
        assert abs(fit.step - truth.step / plain) < 0.02, (slots, fit)
        assert abs(fit.per_token - truth.per_token / plain) < 0.01, (slots, fit)


def test_pass_cost_baseline_is_not_inflated_by_a_new_contexts_slow_first_passes() -> None:
    # A fresh context's first one-token passes, as measured: several times slower than the
    # rest. Against their median a verify pass would look nearly free (the old baseline fit
    # 0.1 per token here); against a low quantile it costs what it does.
    cost = PassCost(clock=lambda: 0.0)
    for seconds in (0.8, 0.12, 0.07):
        cost.observe(1, 0, seconds)
    cost.observe(1, 8, 0.4)  # too few plain passes to compare with: no sample
    assert cost.cost == PassCost.PRIOR
    for seconds in (0.03, 0.010, 0.010, 0.010):
        cost.observe(1, 0, seconds)
    for k in (4, 8, 16, 32) * 3:
        cost.observe(1, k, 0.010 * (1.4 + 0.3 * k))
    fit = cost.cost
    assert abs(fit.per_token - 0.3) < 0.03 and abs(fit.fixed - 0.4) < 0.2


def test_pass_cost_fixed_part_is_not_blown_up_by_a_busy_host() -> None:
    """Another process slows every pass 2-4x for a while, then stops, and single passes
    stall: the fitted fixed cost stays near the truth (the median intercept jumped to 3 and
    more in one timeline of ten; traced in a server: ``Cost(4.0, 0.17)``, which drafts
    nothing short)."""
    fits = []
    for seed in range(30):
        rng = random.Random(seed)
        cost, slow = PassCost(clock=lambda: 0.0), 1.0
        for i in range(120):
            if i % 15 == 0:
                slow = rng.uniform(2, 4) if rng.random() < 0.5 else 1.0
            for k in (0, rng.choice([3, 5, 8, 12, 16, 24, 32, 48])) if i % 3 == 0 else (0,):
                stall = rng.uniform(1.5, 5) if rng.random() < 0.15 else 1.0
                cost.observe(1, k, 0.008 * Cost(0.4, 0.3).of(k) * slow * stall)
        fits.append(cost.cost.fixed)
    assert sorted(fits)[27] < 1.0  # the 90th percentile


class _Rows:
    """What ``RowDrafts`` asks of a cache: a namespace's rows and their tokens."""

    def __init__(self) -> None:
        self.rows: dict[bytes, tuple[Namespace, tuple[int, ...]]] = {}
        self.listed = 0

    def add(self, ns: Namespace, tokens: list[int]) -> None:
        self.rows[bytes([len(self.rows)])] = (ns, tuple(tokens))

    def rows_of(self, ns: Namespace | None = None) -> list[RowInfo]:
        self.listed += 1
        return [
            RowInfo(
                key,
                "ram",
                0,
                len(toks),
                0,
                0.0,
                float(i),
                SaveReason.FINISH,
                TtlClass.SHORT,
                False,
                space,
            )
            for i, (key, (space, toks)) in enumerate(self.rows.items())
            if ns is None or space == ns
        ]

    def row_tokens(self, key: bytes) -> tuple[int, ...] | None:
        return self.rows[key][1] if key in self.rows else None


def _ns(salt: bytes) -> Namespace:
    return Namespace(b"f" * 32, 1, salt.ljust(32, b"\0"))


def _continuation(
    drafts: RowDrafts, ns: Namespace, text: Sequence[int], limit: int
) -> tuple[list[int], int, bool]:
    """What followed ``text``'s last ``n`` tokens in the row that matches most of it
    (``RowDrafts.matches``' first), at most ``limit`` tokens; how many of ``text``'s last
    tokens it matched; whether the row begins with all of ``text``."""
    found = drafts.matches(ns, text)
    if not found:
        return [], 0, False
    best = found[0]
    return list(best.seq[best.at : best.at + limit]), best.matched, best.whole


def _cont(drafts: RowDrafts, ns: Namespace, tail: tuple[int, ...], limit: int) -> list[int]:
    return _continuation(drafts, ns, tail, limit)[0]


def _drafts(cache: _Rows, n: int = 2, **kw: object) -> RowDrafts:
    return RowDrafts(cache.rows_of, cache.row_tokens, n, **kw)  # type: ignore[arg-type]


def test_row_drafts_come_from_the_namespace_alone() -> None:
    cache = _Rows()
    a, b = _ns(b"a"), _ns(b"b")
    cache.add(a, [1, 2, 3, 4, 5, 6])
    cache.add(b, [1, 2, 9, 9, 9])
    drafts = _drafts(cache)
    drafts.refresh(a)
    assert _cont(drafts, a, (2, 3), 8) == [4, 5, 6]
    assert _cont(drafts, b, (2, 3), 8) == []  # b's index was never made
    drafts.refresh(b)
    assert _cont(drafts, b, (1, 2), 8) == [9, 9, 9]
    assert _cont(drafts, a, (1, 2), 2) == [3, 4]
    assert _cont(drafts, a, (9, 9), 8) == []


def test_a_reply_that_copies_its_prompt_is_indexed_though_it_adds_no_n_gram() -> None:
    """A finish row whose reply copies its prompt (a JSON rewrite) holds no n-gram that its
    prompt's row (the cold save before it) lacks; it was not indexed, so the same request
    sent again found no row that replays it (Gemma 3 270M's JSON rewrite drafted from its
    own text on its first retry). A prefix or a copy of an indexed row is still not."""
    cache = _Rows()
    ns = _ns(b"a")
    prompt = [7, 8, *range(20, 60), 5, *range(20, 24)]  # a document, the start of its copy
    reply = list(range(24, 50))  # the copy goes on
    cache.add(ns, prompt)
    drafts = _drafts(cache, 4)
    drafts.refresh(ns)
    drafts.saved(ns, [*prompt, *reply])
    found = drafts.matches(ns, [9, *prompt[1:], *reply[:3]])
    assert found[0].seq == (*prompt, *reply) and found[0].at == len(prompt) + 3
    held = drafts.tokens
    drafts.saved(ns, [*prompt, *reply[:10]])  # a prefix of a row indexed
    drafts.saved(ns, [*prompt, *reply])  # a copy of one
    assert drafts.tokens == held


def test_row_drafts_stay_bounded_and_refresh_at_most_once_a_second() -> None:
    cache = _Rows()
    a, b = _ns(b"a"), _ns(b"b")
    now = [0.0]
    cache.add(a, list(range(100, 160)))
    cache.add(a, list(range(100, 130)))  # a prefix of the first: adds nothing, not kept
    drafts = _drafts(cache, max_tokens=100, clock=lambda: now[0])
    drafts.refresh(a)
    assert drafts.tokens == 60
    cache.add(a, list(range(200, 260)))  # past the bound: taken in, the oldest rows dropped
    drafts.refresh(a)  # too soon: the cache is not even asked
    assert cache.listed == 1
    now[0] = 2.0
    drafts.refresh(a)
    assert cache.listed == 2 and drafts.tokens == 60
    assert _cont(drafts, a, (200, 201), 4) == [202, 203, 204, 205]
    assert _cont(drafts, a, (100, 101), 4) == []
    drafts.saved(a, list(range(400, 420)))  # fits beside it
    assert drafts.tokens == 80 and _cont(drafts, a, (200, 201), 1) == [202]
    # Does not: the index is rebuilt from its newest rows, up to half the bound with it.
    drafts.saved(a, list(range(500, 530)))
    assert drafts.tokens == 50 and _cont(drafts, a, (200, 201), 1) == []
    assert _cont(drafts, a, (400, 401), 1) == [402] and _cont(drafts, a, (500, 501), 1) == [502]
    drafts.saved(a, list(range(600, 701)))  # larger than the whole bound: not indexed
    assert drafts.tokens == 50 and _cont(drafts, a, (600, 601), 1) == []
    now[0] = 4.0
    cache.add(b, list(range(300, 360)))
    drafts.refresh(b)  # b is drafted from now: a, least recent, is dropped whole
    assert drafts.tokens == 60 and _cont(drafts, a, (100, 101), 4) == []
    assert _cont(drafts, b, (300, 301), 2) == [302, 303]
    drafts.saved(b, [7, 8, 9])
    assert _cont(drafts, b, (7, 8), 2) == [9]
    drafts.saved(a, [7, 8, 9])  # a is not indexed (nobody drafts from it): ignored
    assert _cont(drafts, a, (7, 8), 2) == []


def test_one_tenants_rows_never_take_another_tenant_below_its_share() -> None:
    # Found by review: the bound was global, so one tenant drafting from a busy namespace (or
    # from many) dropped every other tenant's index whole.
    cache = _Rows()
    quiet, busy = _ns(b"q"), _ns(b"f")
    now = [0.0]
    for i in range(3):
        cache.add(quiet, list(range(1000 * i, 1000 * i + 30)))
    drafts = _drafts(cache, max_tokens=120, clock=lambda: now[0])
    drafts.refresh(quiet, "q")
    assert drafts.held("q") == 90  # alone: all of the bound is its
    for i in range(10):
        cache.add(busy, list(range(10_000 + 100 * i, 10_000 + 100 * i + 30)))
    drafts.refresh(busy, "f")
    assert drafts.held("f") <= 60 and drafts.held("q") == 60  # its newest rows, its half
    assert drafts.tokens <= 120
    kept = [i for i in range(3) if _cont(drafts, quiet, (1000 * i, 1000 * i + 1), 1)]
    assert len(kept) == 2  # two of its rows: it drafts from them still
    for i in range(50):  # a flood of replies and of other namespaces of the same tenant
        drafts.saved(busy, list(range(20_000 + 100 * i, 20_000 + 100 * i + 25)))
        other = _ns(bytes([i + 1]) + b"f")
        cache.add(other, list(range(30_000 + 100 * i, 30_000 + 100 * i + 40)))
        drafts.refresh(other, "f")
        assert drafts.held("q") == 60 and drafts.tokens <= 120, i
    assert kept == [i for i in range(3) if _cont(drafts, quiet, (1000 * i, 1000 * i + 1), 1)]
    # A share is a floor, not a ceiling: a tenant grows into the room the others leave.
    drafts = _drafts(cache, max_tokens=150, clock=lambda: now[0])
    drafts.refresh(_ns(b"\x01f"), "f")  # one row of 40
    drafts.refresh(quiet, "q")
    assert drafts.held("q") == 90 and drafts.held("f") == 40  # 90 > its share of 75


class _Rows2(_Rows):
    """``_Rows`` for more than 256 rows."""

    def add(self, ns: Namespace, tokens: list[int]) -> None:
        self.rows[len(self.rows).to_bytes(4, "big")] = (ns, tuple(tokens))


class _Visits(OrderedDict[Namespace, object]):
    """A ``RowDrafts``'s namespaces, counting each one read by a pass over them."""

    visited = 0

    def __iter__(self) -> Iterator[Namespace]:
        for ns in super().__iter__():
            _Visits.visited += 1
            yield ns

    def items(self) -> Iterator[tuple[Namespace, object]]:  # type: ignore[override]
        for ns in super().__iter__():
            _Visits.visited += 1
            yield ns, self[ns]

    def values(self) -> Iterator[object]:  # type: ignore[override]
        for _, value in self.items():
            yield value


def test_bringing_the_index_back_within_its_bound_reads_the_namespaces_a_few_times() -> None:
    """One tenant in many small namespaces, another's refresh: half of the first's go. Found
    by review: each namespace dropped read every namespace again, three times (~6 s of the
    worker's thread for 2,000 of 4,000); now a few passes in all, whatever goes."""
    cache = _Rows2()
    drafts = _drafts(cache, max_tokens=3000)
    many = [_ns(i.to_bytes(2, "big") + b"m") for i in range(300)]
    for i, ns in enumerate(many):
        cache.add(ns, list(range(100_000 + 100 * i, 100_000 + 100 * i + 10)))
        drafts.refresh(ns, "a" * 64)
    big = _ns(b"big")
    for j in range(3):
        cache.add(big, list(range(1000 * j, 1000 * j + 500)))
    drafts._spaces = _Visits(drafts._spaces)  # type: ignore[assignment]
    _Visits.visited = 0
    drafts.refresh(big, "b" * 64)
    assert drafts.held("b" * 64) == 1500 and drafts.held("a" * 64) == 1500
    assert _Visits.visited <= 10 * len(many), _Visits.visited


def test_a_save_into_a_full_index_reads_no_other_namespace() -> None:
    """A finish save indexed at once (``saved``), the index full: found by review, each one
    summed every namespace's tokens three times or more (~4-7 ms of the worker's thread with
    4,000 namespaces, per request finished); the totals are kept as they change."""
    cache = _Rows2()
    drafts = _drafts(cache, max_tokens=3000)
    many = [_ns(i.to_bytes(2, "big") + b"m") for i in range(300)]
    for i, ns in enumerate(many):
        cache.add(ns, list(range(100_000 + 100 * i, 100_000 + 100 * i + 10)))
        drafts.refresh(ns, "a" * 64 if i % 2 else None)
    assert drafts.tokens == 3000
    drafts._spaces = _Visits(drafts._spaces)  # type: ignore[assignment]
    _Visits.visited = 0
    for i, ns in enumerate(many[-20:]):
        drafts.saved(ns, list(range(200_000 + 100 * i, 200_000 + 100 * i + 10)))
    assert drafts.tokens == 3000 and drafts.held(None) == drafts.held("a" * 64) == 1500
    assert _Visits.visited == 0


class _Read(tuple[int, ...]):
    """A row's tokens, counting each token read one at a time (a row compared with another
    reads its tokens one by one; hashing its n-grams reads slices)."""

    reads = 0

    def __getitem__(self, i: object) -> object:  # type: ignore[override]
        if isinstance(i, int):
            _Read.reads += 1
        return super().__getitem__(i)  # type: ignore[call-overload]


def test_indexing_many_short_rows_compares_a_row_with_the_others_only_where_it_must() -> None:
    """A row is skipped where an indexed row begins with all of it; found by review, every
    row was compared with every row indexed, and a rebuild of the index (each row indexed
    again, none of them such a prefix) with all before it: 1.15 s of the worker's thread for
    the index of 12-token rows at its bound (26 ms before), 125 ms for 40-token rows. A row
    one of whose n-grams is not indexed is no indexed row's beginning; a rebuild's rows were
    each compared when they were indexed first."""
    cache = _Rows2()
    ns = _ns(b"a")
    now = [0.0]
    rows = 512
    for i in range(rows):  # a template's 3 tokens, then a short reply of the row's own
        cache.add(ns, [1, 2, 3, *range(1000 + 8 * i, 1000 + 8 * i + 8)])
    cache.rows = {key: (space, _Read(toks)) for key, (space, toks) in cache.rows.items()}
    bound = rows * 11 + 64 * 8
    drafts = _drafts(cache, max_tokens=bound, clock=lambda: now[0])
    _Read.reads = 0
    for _ in range(rows // 64):
        drafts.refresh(ns)
        now[0] += 2.0
    assert drafts.tokens == rows * 11
    assert _Read.reads <= 2 * rows, _Read.reads
    for i in range(64):  # replies that copy the rows indexed last: compared, then indexed
        drafts.saved(ns, list(range(1000 + 8 * i, 1000 + 8 * i + 8)))
    assert drafts.tokens == bound
    _Read.reads = 0
    drafts.saved(ns, list(range(50_000, 50_011)))  # past the bound: the index is rebuilt
    assert bound // 2 - 11 < drafts.tokens <= bound // 2
    assert _Read.reads <= rows, _Read.reads
    assert _cont(drafts, ns, (1000, 1001), 1) == [1002]  # the row indexed last is kept
    # A prefix or a copy of a row indexed is still skipped, a row that copies others not.
    held = drafts.tokens
    drafts.saved(ns, [1, 2, 3, *range(1000, 1005)])
    drafts.saved(ns, list(range(50_000, 50_008)))
    assert drafts.tokens == held
    drafts.saved(ns, list(range(50_003, 50_011)))  # each n-gram indexed, not its start
    assert drafts.tokens == held + 8


def test_a_namespaces_tenant_is_its_salts_key() -> None:
    tenant = tenant_id("k")
    assert tenant_of(scoped("s", "k")) == tenant == tenant_of(scoped(None, "k"))
    assert tenant_of(scoped("s", None)) is None and tenant_of(None) is None
    assert tenant_of("plain salt") is None and tenant_of("key:notanid") is None


def test_drafter_drafts_from_a_row_with_a_short_match_only_when_its_own_text_has_none() -> None:
    asked: list[tuple[int, ...]] = []

    def elsewhere(text: Sequence[int]) -> list[RowMatch]:
        asked.append(tuple(text))
        return [RowMatch((5, 7, 42, 43), 2, 2, False)]  # a short match: no replay

    drafter = Drafter("ngram-simple", 2, 8, [1, 2, 3, 1, 2], elsewhere)
    assert drafter.propose([], 8, Cost(0.0, 0.01))[:1] == [3]  # its own prompt has [1, 2] earlier
    assert drafter.propose([7], 8, Cost(0.0, 0.01))[:1] == [42]
    assert asked == [(1, 2, 3, 1, 2), (1, 2, 3, 1, 2, 7)]  # its whole text, each time


def test_a_draft_stops_before_a_media_span() -> None:
    """A span's ids (an image's positions) are no token: drafted as tokens they would fail the
    request's pass (ids outside the vocabulary)."""
    import hashlib

    from kvwarm.tokens import span_ids

    image = list(span_ids(hashlib.sha256(b"picture").digest(), 4))
    prompt = [5, 6, 7, *image, 8, 5, 6]
    draft = Drafter("ngram-simple", 2, 16, prompt).propose([], 16, Cost(0.0, 0.01))
    assert draft == [7]  # what followed [5, 6], up to the picture
    rows = Drafter(
        "ngram-simple", 2, 16, [1, 2], lambda text: [RowMatch((1, 2, 9, *image), 2, 2, False)]
    )
    assert rows.propose([], 16, Cost(0.0, 0.01)) == [9]


def test_match_length_counts_back_from_both_ends() -> None:
    index = NgramIndex(2, [9, 1, 2, 3, 4, 8, 7, 1, 2, 3, 4])
    start = index.lookup()
    assert start == 3  # [3, 4] at 3
    assert index.match_length(start) == 4  # [1, 2, 3, 4] before both; 9 and 7 differ


def test_a_short_match_is_no_copy_on_a_cpu_a_long_one_is() -> None:
    """A chat repeats common phrases: a 4-token match is not worth a CPU's verify pass (it
    would mostly fail), a 24-token one is; a GPU's cheap pass tries both."""
    cpu, gpu = Cost(1.0, 0.4), Cost(0.0, 0.02)
    phrase = [11, 12, 13, 14]
    short = [1, 2, *phrase, 3, 4, 5, 6, 7, 8, 9, 10, 21, *phrase]
    assert Drafter("ngram-simple", 4, 32, short).propose([], 32, cpu) == []
    assert Drafter("ngram-simple", 4, 32, short).propose([], 32, gpu) != []
    passage = list(range(100, 124))
    long = [1, 2, *passage, 3, 4, 5, 6, 7, 8, *passage]
    drafter = Drafter("ngram-simple", 4, 32, long)
    assert drafter.propose([], 32, cpu)[:3] == [3, 4, 5]
    assert match_prior(4) < 0.8 < 0.95 < match_prior(32)


#: Pieces of a toy vocabulary: 2 ends a sentence before a space, 5 whatever follows.
PIECES = [
    *(f"w{i}".encode() for i in range(2)),
    b".",  # 2
    b" It",  # 3
    b"3",  # 4
    b".\n",  # 5
    b"5",  # 6
    b"?",  # 7
    *(f" w{i}".encode() for i in range(8, 40)),
]


def test_a_sentence_ends_at_its_punctuation_before_a_space_or_with_its_own() -> None:
    ends = SentenceEnds(PIECES)
    assert ends.breaks(1, [2, 3, 8]) == [1]  # "." then " It": " It" is a new sentence's
    assert ends.breaks(2, [3, 8]) == [0]  # the sentence ended with the token before the draft
    assert ends.breaks(4, [2, 6]) == []  # "3.5" is a number
    assert ends.breaks(5, [6, 7, 6]) == [0]  # ".\n" ends one whatever follows
    assert ends.breaks(7, [1]) == []  # "?" then "w1": no space, no end


def _learned(crossed: bool, times: int) -> CopyEnds:
    ends = CopyEnds()
    for _ in range(times):
        ends.observe(crossed)
    return ends


#: Twenty words, a sentence end, " It" and ten words more; a reply that quotes the first 16.
PASSAGE = [*range(10, 30), 2, 3, *range(30, 40)]
QUOTING = ([8, 9, *PASSAGE, 0, 1], PASSAGE[:16])


def test_a_copy_learned_to_end_at_sentence_ends_is_drafted_up_to_one() -> None:
    """A reply that quotes one sentence of a passage ends there; drafting the passage on
    wastes a CPU pass's worth of tokens per reply. Copies that stopped at sentence ends make
    the draft stop there; copies that went on make it go on."""
    cpu = Cost(0.4, 0.3)
    prompt, reply = QUOTING
    ends = SentenceEnds(PIECES)
    plain = Drafter("ngram-simple", 4, 48, prompt).propose(reply, 48, cpu)
    assert plain == [26, 27, 28, 29, 2, 3, 30]  # past the sentence end
    stops = _learned(False, 4)
    drafter = Drafter("ngram-simple", 4, 48, prompt, sentence_ends=ends, copy_ends=stops)
    assert drafter.propose(reply, 48, cpu) == [26, 27, 28, 29, 2]  # up to the "." only
    fresh = Drafter("ngram-simple", 4, 48, prompt, sentence_ends=ends, copy_ends=CopyEnds())
    assert fresh.propose(reply, 48, cpu) == [26, 27, 28, 29, 2]  # the prior: one in two
    goes_on = _learned(True, 30)
    drafter = Drafter("ngram-simple", 4, 48, prompt, sentence_ends=ends, copy_ends=goes_on)
    assert drafter.propose(reply, 48, cpu) == plain


def test_copy_ends_learn_from_what_the_model_sampled_at_a_sentence_end() -> None:
    cpu = Cost(0.4, 0.3)
    prompt, reply = QUOTING
    ends = SentenceEnds(PIECES)
    learned = _learned(False, 4)
    before = learned.through
    drafter = Drafter("ngram-simple", 4, 48, prompt, sentence_ends=ends, copy_ends=learned)
    draft = drafter.propose(reply, 48, cpu)
    assert draft[-1] == 2  # stopped right at the sentence end ...
    drafter.verified(len(draft), len(draft), 3)  # ... and the model went on with " It"
    assert learned.through > before
    went_on = learned.through
    draft = drafter.propose(reply, 48, cpu)
    drafter.verified(len(draft), len(draft), 0)  # the reply ended there (an end token)
    assert learned.through < went_on
    ended = learned.through
    draft = drafter.propose(reply, 48, cpu)
    drafter.verified(len(draft), 2)  # a word differed before the end: nothing learned
    assert learned.through == ended
    # A draft past a sentence end: kept up to the end and not after it is a stop.
    learned = _learned(True, 30)
    crossing = Drafter("ngram-simple", 4, 48, prompt, sentence_ends=ends, copy_ends=learned)
    draft = crossing.propose(reply, 48, cpu)
    at = draft.index(3)
    went_on = learned.through
    crossing.verified(len(draft), at)
    assert learned.through < went_on
    learned = _learned(True, 30)
    crossing = Drafter("ngram-simple", 4, 48, prompt, sentence_ends=ends, copy_ends=learned)
    went_on = learned.through
    assert crossing.propose(reply, 48, cpu) == draft
    crossing.verified(len(draft), at + 1)  # " It" kept: the copy went on
    assert learned.through > went_on


def test_ngram_mod_chains_each_token_from_the_n_before_it() -> None:
    """ngram-simple copies one earlier occurrence up to the text's end; ngram-mod looks up
    each drafted token from the n tokens before it, so it goes on around a repeated
    pattern, and passes from one occurrence to a later one."""
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    gpu = Cost(0.0, 0.02)
    assert Drafter("ngram-simple", 2, 10, prompt).propose([], 10, gpu) == [3, 4, 1, 2]
    assert Drafter("ngram-mod", 2, 10, prompt).propose([], 10, gpu) == [3, 4, 1, 2] * 2 + [3, 4]
    # [5, 6] was last followed by 7, but [6, 7] by 9 at its latest occurrence: mod follows it.
    hops = [5, 6, 7, 8, 0, 6, 7, 9, 0, 5, 6]
    assert Drafter("ngram-simple", 2, 4, hops).propose([], 4, gpu) == [7, 8, 0, 6]
    assert Drafter("ngram-mod", 2, 4, hops).propose([], 4, gpu) == [7, 9, 0, 5]


def test_row_drafts_say_how_long_the_match_is() -> None:
    cache = _Rows()
    a = _ns(b"a")
    cache.add(a, [1, 2, 3, 4, 5, 6])
    drafts = _drafts(cache)
    drafts.refresh(a)
    assert _continuation(drafts, a, (9, 2, 3, 4), 8) == ([5, 6], 3, False)
    # The row begins with all of this text: a retry of the same request.
    assert _continuation(drafts, a, (1, 2, 3, 4), 1) == ([5], 4, True)
    assert _continuation(drafts, a, (3,), 8) == ([], 0, False)  # shorter than n
    assert _continuation(drafts, a, [0, 1, 2, 3, 4], 8) == ([5, 6], 4, False)  # not from its start


def test_a_row_draft_that_copies_nothing_of_the_request_is_drafted_a_few_tokens_at_a_time() -> None:
    """Another request's reply (a cached row's) that this request's own text does not hold is
    followed only while the model happens to write the same: such a draft is capped at
    ``ROW_UNSURE_MAX`` tokens, however long the row goes on and however cheap a pass (a chat's
    second story began as the first and then went its own way). A row whose continuation
    copies the request's own text (a JSON document, a quoted passage), or that holds the whole
    request (a retry), is drafted as far as the budget says."""
    free = Cost(0.0, 1e-4)
    prompt = list(range(1, 40))
    story = list(range(100, 140))  # 40 tokens no request's own text holds
    ctx, copy = list(range(200, 240)), list(range(300, 330))
    cache = _Rows()
    ns = _ns(b"a")
    cache.add(ns, [9, *prompt, *story])  # another request's prompt and reply
    cache.add(ns, [*ctx, *copy, 7])  # a reply copying what a later request holds
    drafts = _drafts(cache)
    drafts.refresh(ns)

    def drafter(own: list[int]) -> Drafter:
        return Drafter("ngram-simple", 2, 62, own, lambda text: drafts.matches(ns, text))

    assert drafter(prompt).propose([], 62, free) == story[:ROW_UNSURE_MAX]
    # The row's continuation where this request holds those tokens itself: not capped.
    assert drafter([*copy, *ctx]).propose([], 62, free) == [*copy, 7]
    # A retry: the row begins with the request's whole text.
    assert drafter([9, *prompt]).propose([], 62, free) == story


def test_ngram_map_k4v_drafts_a_continuation_only_where_it_dominates() -> None:
    """llama-server's ngram-map-k4v: the continuations (m = draft_max tokens) of the last n
    tokens are counted, and the most frequent one is drafted only when it followed at least
    twice as often as all the others together; ngram-simple drafts the latest one."""
    gpu = Cost(0.0, 0.02)
    two_to_one = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 1, 2, 6, 7, 8, 9, 9, 1, 2]
    assert Drafter("ngram-simple", 2, 3, two_to_one).propose([], 3, gpu) == [6, 7, 8]
    k4v = Drafter("ngram-map-k4v", 2, 3, two_to_one)
    assert k4v.propose([], 3, gpu) == [3, 4, 5]
    k4v.verified(3, 0)  # rejected outright: that value's next draft holds one token
    assert k4v.propose([], 3, gpu) == [3]
    two_to_two = [*two_to_one[:-2], 1, 2, 6, 7, 8, 9, 1, 2]
    assert Drafter("ngram-map-k4v", 2, 3, two_to_two).propose([], 3, gpu) == []
    # A fifth distinct value is never counted (llama.cpp keeps four per key): eight times
    # [5, 5, 5] after four others is no draft; after three others it dominates.
    fives = [v for _ in range(8) for v in (1, 2, 5, 5, 5, 0)]
    for others, drafted in (4, []), (3, [5, 5, 5]):
        firsts = [v for w in range(10, 10 + others) for v in (1, 2, w, w, w, 0)]
        k4v = Drafter("ngram-map-k4v", 2, 3, [*firsts, *fives, 1, 2])
        assert k4v.propose([], 3, gpu) == drafted
    # A key whose continuation runs up to the text's end is not counted yet.
    assert Drafter("ngram-map-k4v", 2, 3, [1, 2, 3, 1, 2]).propose([], 3, gpu) == []
    assert Drafter("ngram-map-k4v", 2, 3, [1, 2, 3, 4, 1, 2]).propose([], 3, gpu) == [3, 4, 1]


def test_ngram_cache_drafts_each_token_from_next_token_counts() -> None:
    """llama-server's ngram-cache: each drafted token is the most frequent follower of the
    longest last 4-, 3-, 2- or 1-gram whose counts pass its thresholds; the request's own
    text under lax ones, its tenant's rows under strict ones."""
    gpu = Cost(0.0, 0.02)
    # Only the 1-gram [7] was seen before, followed by 8 both times: drafted, where an
    # n-gram lookup of n = 4 has nothing.
    text = [7, 8, 3, 7, 8, 4, 5, 7]
    assert Drafter("ngram-cache", 4, 8, text).propose([], 1, gpu) == [8]
    assert Drafter("ngram-simple", 4, 8, text).propose([], 1, gpu) == []
    # [7] followed once: a 1-gram needs two samples.
    assert Drafter("ngram-cache", 4, 8, [7, 8, 5, 7]).propose([], 1, gpu) == []
    # A copy goes on token by token, the draft's own tokens included in each n-gram.
    copy = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert Drafter("ngram-cache", 4, 8, copy).propose([], 4, gpu) == [4, 5, 6, 9]
    # The rows: a 4-gram seen once is enough in the request's own text, not in the rows
    # (strict: two samples, 66%).
    rows: dict[tuple[int, ...], dict[int, int]] = {(40, 41, 42, 43): {44: 1}}
    own = [40, 41, 42, 43]
    assert Drafter("ngram-cache", 4, 8, own, row_counts=rows.get).propose([], 1, gpu) == []
    rows[(40, 41, 42, 43)] = {44: 2, 45: 1}
    assert Drafter("ngram-cache", 4, 8, own, row_counts=rows.get).propose([], 1, gpu) == [44]
    rows[(40, 41, 42, 43)] = {44: 2, 45: 2}  # 50%: not enough
    assert Drafter("ngram-cache", 4, 8, own, row_counts=rows.get).propose([], 1, gpu) == []


def test_row_counts_come_from_the_namespace_alone_and_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = _Rows()
    a, b = _ns(b"a"), _ns(b"b")
    cache.add(a, [1, 2, 3, 1, 2, 3])
    cache.add(b, [1, 2, 9])
    drafts = _drafts(cache)
    drafts.refresh(a)
    assert drafts.counts(a, (1, 2)) == {3: 2}
    assert drafts.counts(a, (3,)) == {1: 1}
    assert drafts.counts(b, (1, 2)) is None  # b was never drafted from
    drafts.refresh(b)
    assert drafts.counts(b, (1, 2)) == {9: 1}
    assert drafts.counts(a, (1, 2)) == {3: 2}  # b's row is not in a's counts
    drafts.saved(a, [1, 2, 3, 7, 8])  # a reply this worker saved: counted at the next look
    assert drafts.counts(a, (1, 2)) == {3: 3}
    # All namespaces' counts together hold at most COUNT_TOKENS_MAX tokens: counting b's
    # longer row drops a's counts (made again on a's next look, within the bound).
    monkeypatch.setattr(drafts_module, "COUNT_TOKENS_MAX", 12)
    drafts.saved(b, [5, 6, 7, 8, 5, 6, 7, 8])
    assert drafts.counts(b, (5, 6)) == {7: 2}
    assert drafts.counts(a, (1, 2)) == {3: 3}
    assert drafts.counts(b, (5, 6)) == {7: 2}


class _Vocab:
    """What ``check_vocab`` reads of a model: its facts and its vocabulary, in one call."""

    def __init__(self, pieces: list[bytes], eog: set[int], **facts: object) -> None:
        self.facts = SimpleNamespace(
            **{
                "n_vocab": len(pieces),
                "metadata": {"tokenizer.ggml.model": "gpt2"},
                "bos": 1, "eos": 2, "add_bos": True, "add_eos": False,
                **facts,
            }
        )  # fmt: skip
        self._vocab = (tuple(pieces), frozenset(eog))

    def vocabulary(self) -> tuple[tuple[bytes, ...], frozenset[int]]:
        return self._vocab

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        raise AssertionError("one call a token: Gemma's 262k tokens took 2.3 s")


def test_a_draft_vocabulary_is_compared_whole_and_the_first_difference_named() -> None:
    pieces = [b"<unk>", b"<s>", b"</s>", b"<pad>", b"<mask>", b"a", b"b", b"c", b"<eot>"]
    same = _Vocab(pieces, {8})
    check_vocab(same, _Vocab(list(pieces), {8}), "d.gguf")  # type: ignore[arg-type]
    for other, differs in (
        (
            _Vocab([*pieces[:6], b"B", *pieces[7:]], {8}),
            "token 6 differs from the model's (b'B', the model's b'b')",
        ),
        (
            _Vocab([*pieces[:5], b"x", *pieces[6:]], {8}),
            "token 5 differs from the model's (b'x', the model's b'a')",
        ),
    ):
        with pytest.raises(ConfigError) as refused:
            check_vocab(same, other, "d.gguf")  # type: ignore[arg-type]
        assert differs in str(refused.value)  # which token, and how it differs


def test_a_draft_vocabulary_is_accepted_where_llama_cpp_accepts_it() -> None:
    """``common_speculative_are_compatible``: up to 128 tokens more or fewer (Qwen2.5 0.5B's
    151,936 beside 7B's 152,064), ids below 5 and the end-of-generation flags not compared;
    another tokenizer, BOS or EOS (where added), or a larger difference refused."""
    pieces = [b"<unk>", b"<s>", b"</s>", b"<pad>", b"<mask>", *(b"t%d" % i for i in range(300))]
    model = _Vocab(pieces, {2})
    for fine in (
        _Vocab(pieces[:-128], {2}),  # 128 fewer
        _Vocab([*pieces, *(b"[PAD%d]" % i for i in range(128))], {2}),  # 128 more
        _Vocab([b"<UNK>", b"<S>", *pieces[2:]], {2, 7}),  # ids below 5, other EOG flags
        _Vocab(pieces, {2}, add_eos=False, eos=4),  # an EOS not added is not compared
    ):
        check_vocab(model, fine, "d.gguf")  # type: ignore[arg-type]
        check_vocab(fine, model, "d.gguf")  # type: ignore[arg-type]
    for other, why in (
        (_Vocab(pieces[:-129], {2}), "has 176 tokens, the model 305"),
        (_Vocab([*pieces, *(b"x%d" % i for i in range(129))], {2}), "has 434 tokens"),
        (_Vocab(pieces, {2}, metadata={"tokenizer.ggml.model": "llama"}), "llama tokenizer"),
        (_Vocab(pieces, {2}, bos=3), "its BOS token"),
        (_Vocab(pieces, {2}, add_bos=False), "its BOS token"),
        (_Vocab(pieces, {2}, add_eos=True), "its EOS token"),
    ):
        with pytest.raises(ConfigError, match=why):
            check_vocab(model, other, "d.gguf")  # type: ignore[arg-type]


def test_pass_cost_fit_in_numpy_is_the_pairwise_theil_sen_fit() -> None:
    """The fit every verify pass redoes runs in numpy; it must be the same numbers as the
    Theil-Sen fit spelled out pair by pair (median slope, lower-quartile intercept)."""
    import statistics

    def pairwise(c: PassCost) -> Cost:
        points = [(k, c.PRIOR.of(k) - 1.0) for k in c._PRIOR_AT]
        points += [(k, r - 1.0) for _, k, r, _split in c._samples]
        slopes = [
            (y2 - y1) / (x2 - x1)
            for i, (x1, y1) in enumerate(points)
            for x2, y2 in points[i + 1 :]
            if x2 != x1
        ]
        per_token = statistics.median(slopes)
        fixed = sorted(y - per_token * x for x, y in points)[len(points) // 4]
        return Cost(min(4.0, max(0.0, fixed)), min(2.0, max(0.002, per_token)))

    rng = random.Random(1)
    for _ in range(300):
        cost = PassCost(clock=lambda: 0.0)
        for _ in range(3):
            cost.observe(1, 0, 0.006)
        for _ in range(rng.randint(0, 40)):
            k = rng.choice([1, 2, 3, 16, rng.randint(1, 48)])
            cost.observe(1, k, 0.006 * (1 + rng.random() * rng.choice([1, 5, 50])))
        assert cost.cost == pairwise(cost)


def test_row_drafts_remember_only_the_keys_of_rows_the_cache_still_holds() -> None:
    """A namespace drafted from for the life of a server, whose rows the cache keeps replacing
    (new replies saved, old rows evicted): what its index remembers of the rows it looked at
    stays bounded by the rows listed now (found by review: every key ever listed was kept, up
    to 64 more a second, for as long as the namespace was drafted from)."""
    cache = _Rows()
    a = _ns(b"a")
    now = [0.0]
    drafts = _drafts(cache, max_tokens=100, clock=lambda: now[0])
    for i in range(300):
        cache.rows.clear()  # the cache evicted the earlier rows
        cache.rows[i.to_bytes(4, "big")] = (a, tuple(range(1000 + 10 * i, 1010 + 10 * i)))
        now[0] += 2.0
        drafts.refresh(a)
        assert drafts.tokens <= 100
    assert len(drafts._spaces[a].keys) == 1
    # A row kept out by the bound is still not read again while the cache lists it.
    listed = cache.listed
    cache.rows[b"long"] = (a, tuple(range(5000, 5200)))  # more than the bound takes
    for _ in range(3):
        now[0] += 2.0
        drafts.refresh(a)
    assert cache.listed == listed + 3 and drafts._spaces[a].keys == set(cache.rows)


def test_a_row_reply_to_the_same_material_is_drafted_whole_while_such_drafts_hold() -> None:
    """A cached row whose context matches the request's last ``TRUST_CONTEXT`` tokens or more
    and whose continuation copies the request's own text is an earlier reply to the same
    material: on a CPU's pass cost (a drafted token ~0.4 of a pass, the first ~1.3) it is drafted
    in one pass rather than ramped up over four, while ``RowTrust`` says such drafts hold; one
    that fails takes the trust away (the next ramps from the match length), and drafts that
    hold give it back."""
    cpu = Cost(0.9, 0.42)
    doc = list(range(300, 360))  # the material: 60 tokens both requests hold
    ctx = list(range(200, 200 + TRUST_CONTEXT + 4))  # the same place: the last 28 tokens
    reply = [7, *doc]  # the earlier request's reply copies the material
    cache = _Rows()
    ns = _ns(b"a")
    cache.add(ns, [9, *doc, *ctx, *reply])
    drafts = _drafts(cache)
    drafts.refresh(ns)
    trust = RowTrust()

    def drafter() -> Drafter:
        return Drafter(
            "ngram-simple",
            2,
            62,
            [8, *doc, *ctx],
            lambda text: drafts.matches(ns, text),
            row_trust=trust,
        )

    assert trust.trusted
    first = drafter()
    whole = first.propose([], 62, cpu)
    assert len(whole) >= 40 and whole == reply[: len(whole)]
    first.verified(len(whole), 3)  # the model went another way after 3 tokens
    assert not trust.trusted
    ramped = drafter().propose([], 62, cpu)
    assert 0 < len(ramped) < 30 and ramped == reply[: len(ramped)]
    held = drafter()
    held.propose([], 62, cpu)
    held.verified(len(ramped), len(ramped))  # an untrusted one that held counts too
    assert trust.trusted
    # A row with less of the request's context matching is not trusted, whatever the record.
    short = Drafter(
        "ngram-simple",
        2,
        62,
        [8, *doc, *ctx[-TRUST_CONTEXT + 4 :]],
        lambda text: drafts.matches(ns, text),
        row_trust=trust,
    )
    assert len(short.propose([], 62, cpu)) < 30


def test_a_continuation_that_reaches_the_present_goes_on_as_the_loop_it_is() -> None:
    """What followed a match, once it reaches the text's end, repeats with the distance
    between the two occurrences (an overlapping copy); one that stops short is as it was."""
    assert overlapping([7, 8, 9], 3, 8) == [7, 8, 9, 7, 8, 9, 7, 8]
    assert overlapping([7, 8], 3, 8) == [7, 8]  # stopped short of the end: no loop
    assert overlapping([7, 8, 9], 3, 3) == [7, 8, 9]  # as long as asked already
    assert overlapping([], 0, 5) == []


def test_a_reply_caught_in_a_loop_is_drafted_past_one_period_by_a_budget_of_its_own() -> None:
    """A base model's reply looping "<|im_end|>user\n" (Gemma 3 270M on the bench's JSON
    prompt) was drafted one period a pass at most; its early failed copies of the prompt
    kept the request's budget from drafting the loop at all for a dozen passes."""
    loop = [50, 51, 52, 53, 54]
    prompt = [1, 2, 3, 50, 51, 52, 53, 99, 4, 5]  # the loop's start, then something else
    drafter = Drafter("ngram-simple", 4, 48, prompt)
    cheap = Cost(0.0, 0.01)
    # The reply's first copy of the prompt fails, twice: the request's budget falls.
    for _ in range(2):
        assert drafter.propose(loop[:4], 16, cheap)[:3] == [99, 4, 5]
        drafter.verified(3, 0)
    main = drafter.budget.acceptance()
    reply = loop * 4  # the loop, repeated: its match goes back more than two periods
    draft = drafter.propose(reply, 24, cheap)
    assert len(draft) > len(loop) and draft == (loop * 6)[: len(draft)]
    drafter.verified(len(draft), len(draft))
    assert drafter.budget.acceptance() == main  # the loop's evidence is its own
    assert drafter.loop_budget.acceptance() > DraftBudget().acceptance()
    # Once the loop breaks, a rejected loop draft leaves the request's budget as it was.
    drafter.propose(reply + loop, 24, cheap)
    drafter.verified(10, 2)
    assert drafter.budget.acceptance() == main
    # Repeated only once so far: one period, as before (no evidence of a loop yet).
    fresh = Drafter("ngram-simple", 4, 48, [9, 9])
    assert fresh.propose(loop * 2, 24, cheap) == loop


def test_row_drafts_draft_the_occurrence_whose_context_is_the_requests() -> None:
    """An n-gram that occurs many times in a row (a loop's, a template's tag) drafts what
    followed the occurrence that matches most of the request's text, the latest among
    equals: the first occurrence, the only one kept before, sat in the row's prompt and
    drafted the prompt's text (Gemma 3 270M's looping reply: 1 token of 3 kept)."""
    cache = _Rows()
    a = _ns(b"a")
    cache.add(a, [1, 50, 51, 3, 4, 5, 7, 8, 60, 61, 50, 51, 52, 50, 51, 52, 50, 51, 9])
    drafts = _drafts(cache)
    drafts.refresh(a)
    assert _continuation(drafts, a, (0, 7, 8, 60, 61, 50, 51), 4) == ([52, 50, 51, 52], 6, False)
    # Two of the loop's periods match as much: the latest first.
    found = drafts.matches(a, (50, 51, 52, 50, 51))
    assert [(m.at, m.matched) for m in found] == [(18, 5), (15, 5), (12, 2), (3, 2)]


def _replaying(drafts: RowDrafts, ns: Namespace, prompt: list[int], trust: RowTrust) -> Drafter:
    return Drafter(
        "ngram-simple", 4, 48, prompt, lambda text: drafts.matches(ns, text), row_trust=trust
    )


def test_a_row_that_replays_the_request_is_followed_where_its_own_text_matches_too() -> None:
    """An earlier reply given in the same place (the row's context matches the request's last
    ``TRUST_CONTEXT`` tokens or more, and the request has written what the row holds since)
    drafts the rest of that reply, though the request's own text has a match for its last
    tokens: rows were asked only where it had none, so a looping reply whose tags the
    prompt holds too was drafted from the prompt, a few tokens a pass, every time."""
    cpu = Cost(0.33, 0.34)  # Gemma 3 270M's verify passes on 2 cores, measured
    tag = [50, 51, 52, 53]  # a chat template's tag: in the prompt, then looped in the reply
    ctx = list(range(100, 100 + TRUST_CONTEXT + 8))
    prompt = [*tag, 60, *tag, 70, *tag, 61, *ctx]  # the tag, and other tokens after it
    reply = [*tag, 70] * 20
    cache = _Rows()
    ns = _ns(b"a")
    cache.add(ns, [9, *prompt[1:], *reply])  # the earlier request: its prompt differs early
    drafts = _drafts(cache, 4)
    drafts.refresh(ns)
    drafter = _replaying(drafts, ns, prompt, RowTrust())
    assert drafter.propose(reply[:1], 3, cpu) == reply[1:4]  # room for 3 tokens only
    drafter.verified(3, 3, reply[4])
    # Its own text now matches [51, 52, 53, 70] in the prompt (followed by the tag and 61):
    # the row's reply, which the request has followed token for token, is drafted instead.
    assert NgramIndex(4, [*prompt, *reply[:5]]).lookup() is not None
    assert drafter.propose(reply[:5], 48, cpu) == reply[5:53]
    drafter.verified(48, 48)
    # Where the request leaves the row's reply, the row stops replaying it.
    assert drafter.propose([*reply[:53], 71], 48, cpu)[:1] != [reply[54]]
    # Found late (a request's first proposal 70 tokens into its reply, past what a match
    # length counts): the row holds that whole reply and the prompt's end, so it replays it.
    late = _replaying(drafts, ns, prompt, RowTrust())
    assert late.propose(reply[:70], 3, cpu) == reply[70:73] and late._replays
    # A row whose reply began otherwise matches the loop as far back as a match counts, but
    # holds not this reply: it replays nothing.
    other = _Rows()
    other.add(ns, [9, *prompt[1:], 99, *reply[1:]])
    drafts = _drafts(other, 4)
    drafts.refresh(ns)
    late = _replaying(drafts, ns, prompt, RowTrust())
    late.propose(reply[:70], 3, cpu)
    assert drafts.matches(ns, [*prompt, *reply[:70]])[0].matched == 64 and not late._replays


def test_two_earlier_replies_that_went_different_ways_draft_only_what_they_share() -> None:
    """Two rows whose context matches the request's (two earlier rounds of the same prompt)
    and whose replies part after a few tokens draft those few only (the latest, drafted whole
    before, was rejected after 3 tokens: a 48-token pass for 4 tokens on a CPU); once the
    request's next token tells which one it follows, that one is drafted, but not trusted
    whole: replies to this place have gone different ways, and the request may yet go its
    own."""
    cpu = Cost(0.33, 0.34)
    ctx = list(range(100, 100 + TRUST_CONTEXT + 8))
    first = [*range(300, 310), *range(400, 460)]
    second = [*range(300, 310), *range(500, 560)]
    cache = _Rows()
    ns = _ns(b"a")
    cache.add(ns, [1, *ctx, *first])
    cache.add(ns, [2, *ctx, *second])
    drafts = _drafts(cache, 4)
    drafts.refresh(ns)
    own = [*first, *second, 3]  # the request holds both replies' text: sure drafts
    # Another tenant's request in the same place replays nothing of this namespace's rows.
    other = _replaying(drafts, _ns(b"b"), [*own, *ctx], RowTrust())
    assert other.propose(first[:1], 48, cpu) == [] and not drafts.matches(_ns(b"b"), ctx)
    drafter = _replaying(drafts, ns, [*own, *ctx], RowTrust())
    assert drafter.propose(first[:1], 48, cpu) == first[1:10]
    drafter.verified(9, 9, first[10])
    draft = drafter.propose(first[:11], 48, cpu)
    assert 0 < len(draft) < 40 and draft == first[11 : 11 + len(draft)]
    # One row alone, the same place: trusted whole.
    alone = _Rows()
    alone.add(ns, [1, *ctx, *first])
    drafts = _drafts(alone, 4)
    drafts.refresh(ns)
    assert (
        _replaying(drafts, ns, [*own, *ctx], RowTrust()).propose(first[:1], 48, cpu)
        == (first[1:49])
    )


class _Reads(list[int]):
    """A request's text that counts the tokens read from it (iterated, sliced or indexed)."""

    reads = 0

    def __iter__(self) -> Iterator[int]:
        self.reads += len(self)
        return super().__iter__()

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        got = super().__getitem__(i)
        self.reads += len(got) if isinstance(i, slice) else 1
        return got


def test_a_prediction_compares_each_token_of_the_requests_text_once() -> None:
    """A prediction is the request's retry while the reply is its first tokens, and never
    again once the reply parts from it; the drafter asks it each token the reply does not
    follow it (``Drafter._follow_rows``). It compared the whole text (prompt and reply) with
    its own at each: 0.6 ms a token behind a 120,000-token prompt, quadratic in the reply.
    Now each of the text's tokens is compared once."""
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 50_000) for _ in range(5000)]
    predicted = [rng.randrange(1000, 50_000) for _ in range(200)]
    row = Predicted(3, prompt, predicted)
    text = _Reads([*prompt, *predicted[:2]])
    assert [m.whole for m in row.matches(text)] == [True]  # the reply so far is predicted
    text.append(predicted[2])
    assert row.matches(text)[0].whole
    text.append(7)  # the reply parts from the prediction
    assert not any(m.whole for m in row.matches(text))
    text.reads = 0
    for token in predicted[3:60]:  # ... and writes it on: an n-gram match, never a retry
        text.append(token)
        found = row.matches(text)
        assert not any(m.whole for m in found)
    assert found[0].seq[found[0].at] == predicted[60]  # the copy resumes after the edit
    assert text.reads < 57 * 200, text.reads  # its last n tokens, and a few matched back


def test_a_prediction_is_the_clients_word_and_teaches_the_models_row_trust_nothing() -> None:
    """A prediction is drafted whole as a retry's row is, while the model's ``RowTrust`` says
    such drafts hold, but its outcome is not counted there: the trust is shared by every
    client of the model, and a prediction is whatever one client sent (a few that failed at
    once took it from every other client's retries). A retry's row that drafts beside it
    still counts."""
    cpu = Cost(0.9, 0.42)
    prompt = list(range(100, 140))
    predicted = list(range(500, 560))
    trust = RowTrust()

    def drafter(rows: Callable[[Sequence[int]], list[RowMatch]] | None = None) -> Drafter:
        row = with_predicted(Predicted(3, prompt, predicted), rows)
        return Drafter("ngram-simple", 3, 48, prompt, row, row_trust=trust)

    for _ in range(3):  # predictions the model parted from after two tokens
        bad = drafter()
        draft = bad.propose(predicted[:1], 48, cpu)
        assert draft == predicted[1:49]  # drafted whole: the trust holds
        bad.verified(len(draft), 2)
    assert (trust.yes, trust.no) == (0.0, 0.0) and trust.trusted
    # An earlier reply to the same request, cached, drafts beside the prediction: counted.
    cached = (*prompt, *predicted)
    retry = drafter(lambda text: [RowMatch(cached, len(text), min(len(text), 64), True)])
    draft = retry.propose(predicted[:1], 48, cpu)
    assert draft == predicted[1:49]
    retry.verified(len(draft), 2)
    assert trust.no == 1.0


def _follow(drafter: Drafter, reply: Sequence[int], cost: Cost) -> list[tuple[int, int, int]]:
    """Drive ``drafter`` through ``reply`` as a verify loop would: (where, drafted, kept) per
    pass."""
    passes = []
    done = 1
    while done < len(reply):
        draft = drafter.propose(reply[:done], min(48, len(reply) - done), cost)
        kept = 0
        while kept < len(draft) and draft[kept] == reply[done + kept]:
            kept += 1
        drafter.verified(len(draft), kept, None)
        passes.append((done, len(draft), kept))
        done += kept + 1
    return passes


def test_a_prediction_resumes_whole_after_an_edit_it_did_not_have() -> None:
    """After the reply parts from its prediction (an edit), the prediction is one more n-gram
    match, and it was drafted as another request's reply is, ``ROW_UNSURE_MAX`` tokens at a
    time, however long the reply had followed it again: 300 predicted tokens with one changed
    took 44 passes, against 13 for the whole prediction. It is the client's word for what
    the reply repeats, so its drafts now grow with what they keep, as the request's own
    copies do."""
    gpu = Cost(0.0, 0.05)
    rng = random.Random(3)
    predicted = [rng.randrange(1000, 50_000) for _ in range(300)]
    reply = [*predicted[:100], 5, *predicted[101:]]  # prompt: nothing the prediction holds
    prompt = list(range(20_000, 20_040))

    def drafter() -> Drafter:
        row = with_predicted(Predicted(4, prompt, predicted), None)
        return Drafter("ngram-simple", 4, 48, prompt, row, row_trust=RowTrust())

    whole = _follow(drafter(), predicted, gpu)
    edited = _follow(drafter(), reply, gpu)
    after = [drafted for at, drafted, _ in edited if at > 110]
    assert max(after) > ROW_UNSURE_MAX, edited
    assert len(edited) <= len(whole) + 6, (len(whole), edited)
