"""``test_random_restores_stub.py``'s seeded random sessions (``restorekit.py``) on a real
sliding-window model: a tiny random-weight Gemma 3 (``tests/tinymodels.py``) whose window is
32 tokens and whose sixth layer attends to everything, with 8-token batches; and on one of two
layers, both sliding-window ones (no layer attends to everything: its iSWA memory's first KV
cache holds cells but no layer, which every deterministic request failed on, ``n_layer=0``).

What the stub cannot show and this can: llama.cpp's own sliding-window cache (which cells a
saved state holds, which it masks), its state packed and unpacked (``settle_layout`` after every
chunk) and cut into window chunks by the real codecs, under random restores from rows (whole or
chunked), copies between slots and restarts on the disk tier, while prompts, their prefixes,
siblings and follow-up turns cross the window at random points; every answer must be a cold
run's tokens and logprobs. Gemma 3 270M (``test_memory_kinds_model.py``) needs prompts past its
512-token window, seconds each; here a step costs milliseconds.

What it cannot see: numerics that depend on the pass a cell was computed in. This model is too
small for that (with the n_batch alignment or ``settle_layout`` removed, it still passes);
those rules are proved on SmolLM2 and Gemma 3 270M (``test_llama_exactness.py``,
``test_memory_kinds_model.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.engine import restorekit
from tests.tinymodels import N_VOCAB, gemma3_keys, write_tiny_model

pytestmark = [pytest.mark.model, pytest.mark.slow]

WINDOW = 32
N_BATCH = 8
SEEDS = range(3)


@pytest.fixture(scope="module", params=[6, 2], ids=["one-full-layer", "all-sliding"])
def randomised(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[restorekit.Target, restorekit.Reference]]:
    """The model as a target of ``restorekit``'s random cases, and its reference. Six
    layers: llama.cpp makes the sixth a full-attention one; two: both sliding-window."""
    n_layer: int = request.param
    path = tmp_path_factory.mktemp("swa") / f"gemma3-swa32-{n_layer}.gguf"
    write_tiny_model(path, "gemma3", keys=gemma3_keys(WINDOW, n_layer=n_layer), ftype=3)  # Q4_1
    target = restorekit.Target(
        name=f"gemma3-swa32-{n_layer}",
        n_batch=N_BATCH,
        tokens=(1, N_VOCAB - 8),
        lengths=(4, 110),
        n_swa=WINDOW,
        path=str(path),
        n_ctx=256,
    )
    reference = restorekit.Reference(target)
    yield target, reference
    reference.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_random_restores_across_a_sliding_window_equal_cold_runs(
    randomised: tuple[restorekit.Target, restorekit.Reference], tmp_path: Path, seed: int
) -> None:
    target, reference = randomised
    restorekit.run(target, seed, 16, tmp_path, reference)
