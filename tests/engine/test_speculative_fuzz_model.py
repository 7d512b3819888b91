"""Random requests on the real embedded model, each asked plainly and speculating
(``speckit``: an n-gram type, a draft length, a prediction, greedy or seeded sampling with
penalties, biases, stops, grammars, logprobs, ``n`` up to 3, a follow-up on the live KV, a
prompt near the slot's window): the replies are equal bit for bit, the context holds no cell
past what the slots hold, and the finish rows hold the same tokens. A few fixed seeds;
``bench/spec_fuzz.py`` runs as many as one likes (1,905 seeds in 30 minutes found no
difference in a reply, 2026-11-30)."""

from __future__ import annotations

import pytest
from tests.engine.speckit import (
    cells_check,
    fuzz_config,
    fuzz_engine,
    make_case,
    run_case,
    traced,
)

from kvwarm.backends.base import BatchToken

pytestmark = pytest.mark.model

#: Run in order on one model, so the later ones draft from the earlier ones' rows: together
#: they draft from their own text, from cached rows that replay them and from predictions,
#: reject drafts, take filler rows, and run n > 1, stops, a grammar, a lazy grammar, a JSON
#: schema, follow-ups and a prompt of ~450 tokens (~25 s on 2 cores).
SEEDS = (1, 2, 4, 8, 9, 17, 18, 21, 26, 27, 28)


@pytest.mark.slow
def test_random_requests_speculating_are_plain_decodings() -> None:
    with fuzz_engine() as engine, traced() as paths:
        model = engine.load_model(config=fuzz_config())
        outcomes = [run_case(engine, model, make_case(seed, model)) for seed in SEEDS]
        for out in outcomes:
            assert not out.mismatches, f"{out.line()}\n" + "\n".join(out.mismatches)
        drafted = sum(out.drafted for out in outcomes)
        accepted = sum(out.accepted for out in outcomes)
        assert drafted > accepted > 0  # drafts were verified, some of them rejected
        assert model.status().filler_rows > 0
        assert paths.row_matches > 0 and paths.replays > 0 and paths.predicted > 0, paths
        # The cells check sees a cell the slots do not account for.
        rt = model._worker.rt
        slot = rt.slots[0]

        def stray() -> None:
            rt.ctx.decode([BatchToken(1, len(slot.kv_tokens), slot.seq, True)])

        model._worker.call(stray).result(60)
        wrong = cells_check(model)
        assert wrong and all(line.startswith("slot 0: ") for line in wrong), wrong
