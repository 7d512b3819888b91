"""What the sampler chain samples, checked against the distribution it must have, on both
backends: five tokens of controlled logits, every other token banned (-inf, as ``ignore_eos``
or a grammar leaves them), many seeded draws, a chi-square test at p = 0.001 (fixed seeds: a
pass or a fail is reproducible). The chain is llama-server's: logit biases, penalties, top-k,
typical, top-p, min-p, then the temperature; so the truncations see the temperature-1
distribution and the temperature only reshapes what they kept."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from kvwarm.backends.base import BackendModel, SamplingParams

TOKENS = (11, 12, 13, 14, 15)
LOGITS = (2.0, 1.0, 0.0, -1.0, -2.0)
BY_TOKEN = dict(zip(TOKENS, LOGITS, strict=True))
#: No truncation: only what a case sets samples otherwise than plain softmax(logits / T).
PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)
DRAWS = 1500
#: The chi-square quantile of 0.999 by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


def _row(model: BackendModel, logits: Sequence[float] = LOGITS, rest: float = -np.inf) -> bytes:
    row = np.full(model.facts.n_vocab, rest, dtype=np.float32)
    row[list(TOKENS)] = logits
    return row.tobytes()


def _draw(model: BackendModel, params: SamplingParams, row: bytes, n: int = DRAWS) -> Counter[int]:
    sampler = model.new_sampler(params)
    try:
        return Counter(sampler.sample_logits(row) for _ in range(n))
    finally:
        sampler.close()


def _softmax(logits: Sequence[float], temperature: float = 1.0) -> list[float]:
    top = max(logits)
    weights = [math.exp((x - top) / temperature) for x in logits]
    return [w / sum(weights) for w in weights]


def _assert_distributed(seen: Counter[int], want: dict[int, float]) -> None:
    """Only tokens of nonzero probability are drawn, and as often as a chi-square test allows
    (bins expecting under 5 draws pooled)."""
    n = sum(seen.values())
    assert set(seen) <= {t for t, p in want.items() if p > 0}, (seen, want)
    bins: list[tuple[float, float]] = []
    pooled = [0.0, 0.0]
    for token, p in want.items():
        if n * p >= 5:
            bins.append((seen[token], n * p))
        else:
            pooled[0] += seen[token]
            pooled[1] += n * p
    if pooled[1] > 0:
        bins.append((pooled[0], pooled[1]))
    if len(bins) < 2:
        return
    chi2 = sum((o - e) ** 2 / e for o, e in bins)
    assert chi2 < CHI2_999[len(bins) - 1], (chi2, seen, want)


def _kept(kept: dict[int, float], temperature: float) -> dict[int, float]:
    """softmax(logit / T) over the ``kept`` tokens (token -> logit); 0 for the others."""
    probs = _softmax(list(kept.values()), temperature)
    want = dict.fromkeys(TOKENS, 0.0)
    want.update(zip(kept, probs, strict=True))
    return want


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.5])
def test_temperature_scales_the_logits(model: BackendModel, temperature: float) -> None:
    params = dataclasses.replace(PLAIN, temperature=temperature)
    _assert_distributed(_draw(model, params, _row(model)), _kept(BY_TOKEN, temperature))


@pytest.mark.parametrize(
    ("knob", "kept"),
    [
        # top_k 2: the two best.
        ({"top_k": 2}, 2),
        # top_p 0.8 over p(T=1) = .636 .234 .086 ...: the first two reach .870 (at T = 2.5,
        # .45 .30 .20 would need three: the temperature comes after).
        ({"top_p": 0.8}, 2),
        # min_p 0.3 of the best's p(T=1): e^-1 = .37 passes, e^-2 = .14 does not (at T = 2.5
        # e^-0.8 = .45 would pass too).
        ({"min_p": 0.3}, 2),
        # typical_p 0.5: entropy .99 nats; surprises .45 1.45 2.45 ...: the most typical are
        # the second (.234), then the first (.636), which passes 0.5 together.
        ({"typical_p": 0.5}, 2),
        # typical_p 0.2: the second alone (.234 > .2).
        ({"typical_p": 0.2}, -1),
    ],
)
def test_each_truncation_sees_the_distribution_before_the_temperature(
    model: BackendModel, knob: dict[str, float], kept: int
) -> None:
    params = dataclasses.replace(PLAIN, **knob, temperature=2.5)  # type: ignore[arg-type]
    keep = {TOKENS[1]: LOGITS[1]} if kept == -1 else dict(list(BY_TOKEN.items())[:kept])
    _assert_distributed(_draw(model, params, _row(model)), _kept(keep, 2.5))


@pytest.mark.parametrize("rest", [-np.inf, -110.0], ids=["banned", "underflowing"])
def test_typical_p_with_candidates_of_probability_zero(model: BackendModel, rest: float) -> None:
    """Found by review: llama.cpp's typical sampler sums -p log p, NaN for a candidate of
    probability 0 (banned, masked by a grammar, or a logit 104 below the best: a float's 0),
    and then kept every candidate: typical_p 0.5 sampled all five tokens."""
    params = dataclasses.replace(PLAIN, typical_p=0.5)
    seen = _draw(model, params, _row(model, rest=rest))
    _assert_distributed(seen, _kept(dict(list(BY_TOKEN.items())[:2]), 1.0))


def test_penalties_count_the_accepted_tokens_in_their_window(model: BackendModel) -> None:
    """llama.cpp's penalties over the last ``repeat_last_n`` accepted tokens: a positive logit
    divided by ``repeat_penalty``, a negative one multiplied, then ``count * frequency +
    presence`` off each token seen."""
    a, b, c, d, e = TOKENS
    penalised = {
        a: 2.0 / 1.5 - 2 * 0.5 - 0.25,
        b: 1.0 / 1.5 - 0.5 - 0.25,
        c: 0.0,
        d: -1.0 * 1.5 - 0.5 - 0.25,
        e: -2.0,
    }
    counts: Counter[int] = Counter()
    for seed in range(600):  # a sampler a draw: each draw would join the next one's history
        sampler = model.new_sampler(
            dataclasses.replace(
                PLAIN, repeat_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25, seed=seed
            )
        )
        try:
            for token in (a, a, b, d, 7):  # 7: outside the row, counted all the same
                sampler.accept(token)
            counts[sampler.sample_logits(_row(model))] += 1
        finally:
            sampler.close()
    _assert_distributed(counts, _kept(penalised, 1.0))


def test_the_penalty_window_is_the_last_64_tokens(model: BackendModel) -> None:
    a, b = TOKENS[0], TOKENS[1]
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    for filler, best in ((63, b), (64, a)):
        sampler = model.new_sampler(params)
        try:
            sampler.accept(a)  # 2.0 - 2 = 0.0 below b's 1.0 while it is in the window
            for _ in range(filler):
                sampler.accept(7)
            assert sampler.sample_logits(_row(model)) == best, filler
        finally:
            sampler.close()


def test_logit_bias_comes_before_the_truncations(model: BackendModel) -> None:
    """A bias moves a token into (or out of) what top-k keeps: +3.5 makes the last token
    (-2.0) the second best (1.5); -100 takes the best out entirely."""
    a, e = TOKENS[0], TOKENS[-1]
    params = dataclasses.replace(PLAIN, top_k=2, logit_bias=((e, 3.5), (a, -100.0)))
    want = _kept({TOKENS[1]: 1.0, e: 1.5}, 1.0)
    _assert_distributed(_draw(model, params, _row(model)), want)
    forced = dataclasses.replace(PLAIN, logit_bias=((e, 100.0),))
    assert _draw(model, forced, _row(model), 200) == Counter({e: 200})
