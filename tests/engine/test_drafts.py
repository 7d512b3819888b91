"""The parts of speculative decoding's drafts (engine/worker/drafts.py): the n-gram index,
the draft budget, ngram-map-k's caps, the pass cost's fit."""

from __future__ import annotations

from kvwarm.engine.worker.drafts import DraftBudget, Drafter, NgramIndex, PassCost


def test_ngram_index_finds_the_latest_earlier_occurrence() -> None:
    index = NgramIndex(2, [1, 2, 3, 1, 2, 4, 1, 2])
    assert index.lookup() == 3  # [1, 2] at 3 (then 4), not at 6 (the tail itself)
    index.extend([9])
    assert index.lookup() is None
    assert NgramIndex(3, [1, 2]).lookup() is None


def test_budget_drafts_nothing_when_nothing_pays() -> None:
    budget = DraftBudget()
    assert budget.length(16, 0.05) >= 3  # a fresh request tries
    assert budget.length(16, 1.5) == 0  # a pass that costs what two decodes do never pays
    for _ in range(6):
        budget.verified(4, 0)
    assert budget.length(16, 0.25) == 0  # every draft failed: not worth a CPU's pass
    assert 1 <= budget.length(16, 0.02) <= 2  # on a GPU a short draft still pays
    for _ in range(60):
        budget.skipped()
    assert budget.length(16, 0.25) > 0  # the evidence faded: it tries again
    for _ in range(8):
        budget.verified(16, 16)
    assert budget.length(16, 0.15) >= 8


def test_map_k_caps_a_key_by_its_last_acceptance() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    drafter = Drafter("ngram-map-k", 2, 16, prompt)
    first = drafter.propose([], 16, 0.01)
    assert len(first) >= 3 and first == [7, 8, 9, 10, 11, 5, 6][: len(first)]
    drafter.verified(len(first), 1)
    # The same key again: at most one more token than were accepted; ngram-simple: no cap.
    assert drafter.propose([], 16, 0.01) == [7, 8]
    simple = Drafter("ngram-simple", 2, 16, prompt)
    simple.propose([], 16, 0.01)
    simple.verified(len(first), 1)
    assert len(simple.propose([], 16, 0.01)) >= 3


def test_pass_cost_compares_verify_passes_with_the_plain_ones_before_them() -> None:
    cost = PassCost()
    assert cost.cost == PassCost.DEFAULT  # nothing seen yet
    for _ in range(5):
        cost.observe(1, 0, 0.010)
    cost.observe(1, 4, 0.014)
    assert cost.cost == PassCost.DEFAULT  # one sample is not enough
    # The machine gets three times slower (another process): the pairs still say 10%.
    for _ in range(15):
        cost.observe(1, 0, 0.030)
    for _ in range(3):
        cost.observe(1, 4, 0.042)
        cost.observe(1, 0, 9.0)  # one pass stalled for seconds: the median ignores it
    assert abs(cost.cost - 0.1) < 1e-9
    cost.observe(2, 3, 0.1)  # no plain pass of two slots yet: no sample
    assert abs(cost.cost - 0.1) < 1e-9
