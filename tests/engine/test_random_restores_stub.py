"""A seeded, randomised differential test of cache restores, on the stub's four memory kinds:
full attention, a sliding window, a recurrent state, and a hybrid (``restorekit.py``).

Each case is a list of steps drawn from a seed and run on one engine in deterministic mode:
prompts that are fresh (often sharing the first prompt's prefix), exact repeats, prefixes,
siblings, extensions, the reference reply cut anywhere, and follow-up turns over it; several
prompts sent together; streams cancelled after a few fragments; evictions of the live KV,
cache flushes, and restarts (a new engine on the same disk tier, with another number of
slots). Each case draws tiny RAM and disk quotas (so rows are evicted), a chunk size, a
checkpoint gap and a continued-save interval; cut points favour batch and window boundaries.

What it guards: every answer equals the same prompt's answered cold (a fresh salt on an engine
that saves nothing): the same tokens and logprobs, top alternatives included, or a prefix of
them for a cancelled stream; ``0 <= cached_tokens <= len(prompt)``; and the model's prefill
counter grew by exactly the prompts less what they reused (at most that, with a cancel). So a
restore of anything but exactly the prefix it claims, a reuse below a state's floor, stored
logits used for another prompt, a miscounted reuse, or an error on the way fails here.

What it cannot see: hit rates (a cache that never hits, or falls back to a cold prefill, passes),
and anything that depends on the pass a token was computed in: the stub hashes each cell from
the one before it alone, so a restore of state computed in a pass of another shape, or a
skipped ``settle_layout``, looks exact here. The two defects of that sort this test's first
version found on Gemma (chunks keyed by tokens alone, a copied window cut below its pack) have
their own tests in ``test_memory_kinds_model.py``; ``test_memory_kinds_archs.py`` runs these
cases on tiny Mamba and LFM2 models (marked slow).

A failure names the seed, the case's setup and every step up to the failing one, with what
each reused and prefilled. The steps depend on the seed alone (and cold answers), so
``-k "swa and 3"`` replays that case; only the timing of requests sent together varies.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.engine.restorekit import Reference, Target, run

from kvwarm.backends.stub.vocab import N_BYTE_TOKENS

KINDS = {"full": 0, "swa": 24, "recurrent": 0, "hybrid": 0}  # kind -> window
SEEDS = range(10)
N_STEPS = 24


def target(kind: str) -> Target:
    return Target(
        name=f"stub-{kind}",
        n_batch=16,
        tokens=(1, N_BYTE_TOKENS - 1),
        lengths=(4, 120),
        n_swa=KINDS[kind],
        stub_kind=kind,
    )


@pytest.fixture(scope="module")
def references() -> Iterator[dict[str, Reference]]:
    """One reference engine per kind, shared by its seeds (it keeps their cold answers)."""
    refs: dict[str, Reference] = {}
    yield refs
    for ref in refs.values():
        ref.close()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_random_restores_equal_cold_runs(
    tmp_path: Path, references: dict[str, Reference], kind: str, seed: int
) -> None:
    t = target(kind)
    if kind not in references:
        references[kind] = Reference(t)
    run(t, seed, N_STEPS, tmp_path, references[kind])
