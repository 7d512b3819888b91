"""``ModelTotals`` (server/totals.py): an unloaded instance's counts are folded in once and
never read live again, whichever instance of its id unloaded after it."""

from __future__ import annotations

from dataclasses import dataclass

from kvwarm.engine.types import ModelStatus
from kvwarm.server.totals import ModelTotals


@dataclass(eq=False)
class Instance:
    """One load of a model: its counts (a ``ServedModel`` as far as totals read it)."""

    requests: int

    def status(self) -> ModelStatus:
        return ModelStatus("a", "ready", 0, 0, 1, self.requests, 0, 0, 0, 0.0, 0.0)


def test_a_reading_listing_an_instance_retired_before_another_counts_it_once() -> None:
    """A reading listed the first load (``/metrics`` lists the registry's entries before it
    takes the totals' lock); meanwhile it unloaded, a second load served and unloaded too.
    The first is folded in already: it is not read live on top (found by review: only the
    id's last instance was remembered as folded in, so the first counted twice)."""
    totals = ModelTotals()
    first, second = Instance(3), Instance(5)
    totals.retire("a", first)
    totals.retire("a", second)
    snap = totals.snapshot([("a", first)])
    assert snap.statuses == []
    assert snap.totals["a"]["requests"] == 8
    totals.retire("a", first)  # a second unload of the same instance folds nothing in
    assert totals.snapshot([]).totals["a"]["requests"] == 8


def test_a_live_instance_adds_to_what_unloaded() -> None:
    totals = ModelTotals()
    totals.retire("a", Instance(3))
    live = Instance(2)
    snap = totals.snapshot([("a", live)])
    assert [s.requests for s in snap.statuses] == [2]
    assert snap.totals["a"]["requests"] == 5
