"""Speculative decoding (engine/worker/drafts.py, sampling.on_verify, tick) on the stub: the
output is plain decoding's, token for token, and the KV holds only what was accepted.

The stub copies (``copy_bias``: what followed the latest earlier occurrence of the last two
tokens is favoured), so drafts from the prompt are accepted, and rejected where it stops
copying. A pass's cost is pinned (``cheap_passes``) so what is drafted never depends on timing.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

import kvwarm.engine.worker.tick as tick_module
from kvwarm.backends.base import AdapterSet, BatchToken, ContextParams, ModelParams
from kvwarm.backends.stub import StubBackend, StubModel
from kvwarm.backends.stub.context import StubContext
from kvwarm.backends.stub.vocab import EOS
from kvwarm.engine.api import Engine, ModelConfig
from kvwarm.engine.model import Model
from kvwarm.engine.stream import CompletionStream
from kvwarm.engine.types import Completion, GenerationOptions
from kvwarm.engine.worker.drafts import Cost, DraftCost, Drafter, PassCost, Predicted
from kvwarm.errors import BackendError, ConfigError, InvalidRequestError, StateRestoreError
from kvwarm.memory import MemoryKindName
from kvwarm.server.budget import memory_of
from kvwarm.tenants import scoped, tenant_id

PASSAGE = "The quick brown fox jumps over the lazy dog while the cat sleeps on the mat. "
PROMPT = f"Copy this: {PASSAGE}{PASSAGE}Again: The quick"
GREEDY = GenerationOptions(max_tokens=60, temperature=0.0)
SAMPLED = GenerationOptions(max_tokens=60, temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=5)


@pytest.fixture(autouse=True)
def cheap_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One more token in a pass costs 5% of a pass (a GPU-like figure), whatever the timing."""
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05)))


def copier(**kw: object) -> StubBackend:
    return StubBackend(copy_bias=kw.pop("copy_bias", 8.0), **kw)  # type: ignore[arg-type]


def spec_config(
    n_parallel: int = 1, *, backend: StubBackend | None = None, **kw: object
) -> ModelConfig:
    base = stub_config(n_parallel, backend=backend or copier(), n_batch=64)
    return replace(base, **{"spec_type": "ngram-simple", **kw})  # type: ignore[arg-type]


@pytest.fixture
def engine() -> Iterator[Engine]:
    eng = make_engine()
    yield eng
    eng.close()


#: The plain runs' cache salt: a speculating run of the same prompt must not replay the plain
#: run's reply from its cached row (drafted whole and never rejected, it would leave the
#: paths these tests exercise, the request's own drafts and their rejection, untested).
PLAIN_SALT = "plain run"


def both(model: Model, prompt: str, opts: GenerationOptions, **kw: object):  # type: ignore[no-untyped-def]
    plain = model.complete(prompt, opts, **{"spec_type": "none", "cache_salt": PLAIN_SALT, **kw})  # type: ignore[arg-type]
    model.evict()
    spec = model.complete(prompt, opts, **kw)  # type: ignore[arg-type]
    model.evict()
    return plain, spec


def held(model: Model, seq: int = 0) -> int:
    """Positions the slot's sequence holds in the context (the worker is idle)."""
    return int(model._worker.rt.ctx.seq_pos_max(seq)) + 1


# ---- the output is plain decoding's -----------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]
)
def test_greedy_output_is_plain_decodings(engine: Engine, kind: str) -> None:
    model = engine.load_model(config=spec_config(spec_type=kind))
    plain, spec = both(model, PROMPT, GREEDY)
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.text == plain.text
    assert plain.stats.drafted_tokens == 0
    assert spec.stats.accepted_tokens > 20  # it copied, most of it from drafts
    assert spec.stats.drafted_tokens >= spec.stats.accepted_tokens


def test_seeded_sampling_is_plain_decodings_token_for_token(engine: Engine) -> None:
    model = engine.load_model(config=spec_config())
    plain, spec = both(model, PROMPT, SAMPLED, logprobs=3)
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.logprobs == plain.logprobs  # the target's logprobs, every one
    assert spec.stats.accepted_tokens > 0
    assert spec.stats.drafted_tokens > spec.stats.accepted_tokens  # some drafts were rejected


def test_sampled_tokens_keep_the_target_distribution(engine: Engine) -> None:
    """Many seeds, one verify pass each: the pending token ``t1`` and the first token sampled
    from a verify pass, ``t2``, against the exact target distribution ``p(t1) p(t2 | t1)``
    (chi-square at p = 0.001, and total variation)."""
    backend = copier(copy_bias=5.5)
    model = engine.load_model(config=spec_config(backend=backend, spec_ngram_n=1))
    prompt = "abcabdabeabfab"
    opts = GenerationOptions(max_tokens=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    toks = model.tokenize(prompt)
    pairs: Counter[tuple[int, int]] = Counter()
    drafted = accepted = 0
    n = 1500
    for seed in range(n):
        done = model.complete(toks, opts, seed=seed)
        pair = (*done.completion_tokens[:2], EOS, EOS)  # an end-of-generation token ends it
        pairs[(pair[0], pair[1])] += 1
        drafted += done.stats.drafted_tokens
        accepted += done.stats.accepted_tokens
    assert drafted > n // 3 and n // 10 < accepted < drafted - n // 10  # both branches, often
    expected = _target(backend, toks, {t1 for t1, _ in pairs})
    # Cells expected at least 5 times each, and one for the rest.
    big = {pair for pair, p in expected.items() if n * p >= 5}
    seen = [pairs.get(pair, 0) for pair in big] + [n - sum(pairs.get(pair, 0) for pair in big)]
    want = [n * expected[pair] for pair in big] + [n - sum(n * expected[pair] for pair in big)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(seen, want, strict=True) if e > 0)
    assert len(big) >= 4
    assert chi2 < _chi2_critical(len(big), 0.001)
    assert 0.5 * sum(abs(o - e) for o, e in zip(seen, want, strict=True)) / n < 0.05


def _target(
    backend: StubBackend, prompt: list[int], firsts: set[int]
) -> dict[tuple[int, int], float]:
    """``p(t1) p(t2 | t1)`` under the stub's logits at temperature 1 (a plain softmax)."""
    bmodel = backend.load_model("stub")
    ctx = bmodel.new_context(ContextParams(n_ctx=256, n_batch=64, n_ubatch=64))
    try:
        ctx.prefill(0, prompt, 0)
        p1 = _softmax(ctx.logits(-1))
        out: dict[tuple[int, int], float] = {}
        for t1 in range(len(p1)):
            if p1[t1] < 1e-6 and t1 not in firsts:
                continue
            if t1 == EOS:
                out[(EOS, EOS)] = float(p1[EOS])
                continue
            ctx.seq_rm(0, len(prompt), -1)
            ctx.decode([BatchToken(t1, len(prompt), 0, True)])
            p2 = _softmax(ctx.logits(0))
            for t2 in np.flatnonzero(p2 > 1e-9):
                out[(t1, int(t2))] = float(p1[t1] * p2[t2])
        return out
    finally:
        ctx.close()
        bmodel.close()


def _softmax(logits: memoryview) -> np.ndarray:
    x = np.frombuffer(logits, dtype=np.float32).astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def _chi2_critical(dof: int, alpha: float) -> float:
    """Wilson-Hilferty: the chi-square quantile of ``1 - alpha`` (good to ~1% for dof > 3)."""
    z = {0.001: 3.0902, 0.01: 2.3263}[alpha]
    k = float(dof)
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def test_stop_string_inside_an_accepted_draft(engine: Engine) -> None:
    model = engine.load_model(config=spec_config())
    greedy = model.complete(PROMPT, GREEDY, spec_type="none").text
    stop = greedy[20:26]  # several tokens, well inside the copied text
    model.evict()
    plain, spec = both(model, PROMPT, GREEDY, stop=[stop])
    assert spec.text == plain.text == greedy[: greedy.index(stop)]
    assert spec.stats.finish_reason == "stop" and spec.stats.stop_sequence == stop
    assert spec.stats.accepted_tokens > 0
    # The sequence holds the prompt and the reply's decoded tokens, no draft past the stop.
    again = model.complete(PROMPT, GREEDY, stop=[stop])
    assert held(model) == len(again.prompt_tokens) + len(again.completion_tokens) - 1


def test_end_of_generation_inside_an_accepted_draft(engine: Engine) -> None:
    """The stub ends a reply after "!": the draft copies past it, the reply ends there as
    plain decoding's does, and the sequence holds nothing of the draft after it."""
    model = engine.load_model(config=spec_config())
    prompt = "Say: abcdefgh! ijklm. Again: abcd"
    past = []
    for opts in (GREEDY, SAMPLED):
        plain = model.complete(prompt, opts, spec_type="none", logprobs=1, cache_salt=PLAIN_SALT)
        plain_held = held(model)
        model.evict()
        # Each its own salt: the greedy run's row would be replayed, ending right at "!".
        spec = model.complete(prompt, opts, logprobs=1, cache_salt=f"t={opts.temperature}")
        assert spec.completion_tokens == plain.completion_tokens and spec.text == "efgh!"
        assert spec.logprobs == plain.logprobs and spec.stats.finish_reason == "stop"
        assert spec.stats.accepted_tokens > 0
        past.append(spec.stats.drafted_tokens > spec.stats.accepted_tokens)
        assert held(model) == plain_held
        model.evict()
    assert any(past)  # a draft ran on past "!" (later ones learn to stop there: CopyEnds)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 23])
def test_max_tokens_mid_draft(engine: Engine, max_tokens: int) -> None:
    model = engine.load_model(config=spec_config())
    opts = replace(GREEDY, max_tokens=max_tokens)
    plain, spec = both(model, PROMPT, opts)
    assert spec.completion_tokens == plain.completion_tokens
    assert len(spec.completion_tokens) == max_tokens and spec.stats.finish_reason == "length"
    spec = model.complete(PROMPT, opts)
    assert held(model) == len(spec.prompt_tokens) + max_tokens - 1  # the last is never decoded


@pytest.mark.parametrize("max_tokens", [23, 41])
def test_filler_rows_pad_a_pass_to_a_whole_tile_and_leave_no_cell(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, max_tokens: int
) -> None:
    """Drafts cut short (here by a draft cap of 5: 6 rows a pass) on a CPU whose matrix kernel
    takes rows 4 at a time, a row costing less than the rows past a multiple: each such pass
    is filled to a whole tile with filler rows, never sampled, their cells removed with the
    rejected draft's. The output and the KV left are plain decoding's."""
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05, tile=4, step=1.0)))
    model = engine.load_model(config=spec_config(spec_draft_max=5))
    ctx = model._worker.rt.ctx
    decode = ctx.decode
    passes: list[int] = []

    def counted(batch: list[BatchToken]) -> None:
        passes.append(len(batch))
        decode(batch)

    monkeypatch.setattr(ctx, "decode", counted)
    opts = replace(GREEDY, max_tokens=max_tokens)
    plain, spec = both(model, PROMPT, opts)
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens > 10
    filler = model.status().filler_rows
    assert filler > 0
    passes.clear()
    spec = model.complete(PROMPT, opts)  # a retry: its earlier reply drafted, 5 at a time
    assert spec.completion_tokens == plain.completion_tokens
    assert held(model) == len(spec.prompt_tokens) + max_tokens - 1  # no filler cell left
    assert model.status().filler_rows > filler
    verify = [rows for rows in passes if 1 < rows <= 8]  # not the prompt's chunks
    assert 8 in verify and all(rows <= 4 or rows == 8 for rows in verify), verify


@pytest.mark.parametrize("edge", ["window end", "sliding window"])
def test_filler_rows_stay_within_their_drafts_reach(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, edge: str
) -> None:
    """A copy drafted up to the last position its pass may reach: the slot's window's end
    (n_ctx 230), or a sliding window's (240), past which a rejected draft could not be rolled
    back (``MemoryKind.lookahead``). Its last verify pass ends between tiles, and the filler
    rows that would make it whole lie past that edge, so it takes none (``Active.pad_room``):
    taken, they were a position past the window (``ContextOverflowError``), or cost the
    window cells its next token attends to (the rollback's ``StateRestoreError``). The step
    is a fifth of a pass, so the draft goes to the edge rather than leave its last tokens to
    a pass of their own (priced without the filler it cannot take: ``Cost.reach``)."""
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05, tile=4, step=0.2)))
    if edge == "window end":
        cfg = spec_config()
        cfg = replace(cfg, context=replace(cfg.context, n_ctx=230))
        last, opts = 229, replace(GREEDY, max_tokens=500)
    else:
        cfg = spec_config(backend=copier(memory_kind="swa", n_swa=240))
        last, opts = 239, replace(GREEDY, max_tokens=120)
    model = engine.load_model(config=cfg)
    ctx = model._worker.rt.ctx
    decode = ctx.decode
    verified: list[tuple[int, int]] = []  # each verify pass's rows and its last position

    def watched(batch: list[BatchToken]) -> None:
        rows = [t for t in batch if t.logits]
        if len(rows) > 1:
            verified.append((len(rows), rows[-1].pos))
        decode(batch)

    monkeypatch.setattr(ctx, "decode", watched)
    plain, spec = both(model, PROMPT, opts)
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.finish_reason == plain.stats.finish_reason
    edge_rows = [rows for rows, top in verified if top == last]
    # The passes that reached the edge end between tiles (they took no filler), none past it.
    assert edge_rows and all(rows % 4 for rows in edge_rows), verified
    assert max(top for _, top in verified) == last


def test_a_draft_is_priced_with_only_the_filler_its_reach_holds(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Tick._propose`` prices each draft with the rows its pass may take past its first
    (``Cost.reach``: its window's end here, n_ctx 230), so a draft that reaches that edge is
    not priced with filler ``Tick._pad`` cannot add."""
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05, tile=4, step=1.0)))
    cfg = spec_config()
    model = engine.load_model(config=replace(cfg, context=replace(cfg.context, n_ctx=230)))
    seen: list[tuple[int, int, int | None]] = []  # (tokens generated, limit, cost's reach)
    propose = Drafter.propose

    def spied(
        self: Drafter, generated: Sequence[int], limit: int, cost: Cost, *, end: bool = False
    ) -> list[int]:
        seen.append((len(generated), limit, cost.reach))
        return propose(self, generated, limit, cost, end=end)

    monkeypatch.setattr(Drafter, "propose", spied)
    plain, spec = both(model, PROMPT, replace(GREEDY, max_tokens=500))
    assert spec.completion_tokens == plain.completion_tokens and spec.stats.accepted_tokens > 0
    # The pending token (the last generated) at n = prompt + generated - 1: rows up to 229.
    n_prompt = len(spec.prompt_tokens)
    assert seen and all(reach == 229 - (n_prompt + g - 1) for g, _, reach in seen), seen
    assert any(limit == reach for _, limit, reach in seen)


def test_no_filler_where_a_row_costs_more_than_the_step(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.5, tile=8, step=0.3)))
    model = engine.load_model(config=spec_config())
    plain, spec = both(model, PROMPT, replace(GREEDY, max_tokens=23))
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens > 0 and model.status().filler_rows == 0


def test_window_end_mid_draft(engine: Engine) -> None:
    cfg = spec_config()
    cfg = replace(cfg, context=replace(cfg.context, n_ctx=230))
    model = engine.load_model(config=cfg)
    opts = replace(GREEDY, max_tokens=500)
    plain, spec = both(model, PROMPT, opts)
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.finish_reason == "length" and spec.stats.accepted_tokens > 0


def test_n_choices_each_speculate(engine: Engine) -> None:
    model = engine.load_model(config=spec_config(n_parallel=3))
    group = [s.result() for s in model.streams(PROMPT, SAMPLED, n=3)]
    model.evict()
    plain = [s.result() for s in model.streams(PROMPT, SAMPLED, n=3, spec_type="none")]
    assert [g.completion_tokens for g in group] == [p.completion_tokens for p in plain]
    assert sum(g.stats.drafted_tokens for g in group) > 0


def test_grammar_refusing_a_draft_token_ends_the_draft(engine: Engine) -> None:
    model = engine.load_model(config=spec_config())
    grammar = 'root ::= " brown fox jumps over the lazy cat" | " brown fox jumps high"'
    plain, spec = both(model, PROMPT, GREEDY, grammar=grammar)
    assert spec.text == plain.text == " brown fox jumps over the lazy cat"
    assert 0 < spec.stats.accepted_tokens < spec.stats.drafted_tokens  # " dog" was refused


def test_streamed_fragments_are_plain_decodings(engine: Engine) -> None:
    model = engine.load_model(config=spec_config())
    plain = "".join(model.stream(PROMPT, GREEDY, spec_type="none"))
    model.evict()
    stream = model.stream(PROMPT, GREEDY)
    assert "".join(stream) == plain
    assert stream.result().stats.accepted_tokens > 0


def test_request_switch_and_draft_cap(engine: Engine) -> None:
    model = engine.load_model(config=replace(spec_config(), spec_type="none"))
    assert model.complete(PROMPT, GREEDY).stats.drafted_tokens == 0
    model.evict()
    on = model.complete(PROMPT, GREEDY, spec_type="ngram-map-k", spec_draft_max=3)
    assert on.stats.accepted_tokens > 0
    assert on.stats.drafted_tokens <= 3 * len(on.completion_tokens)
    model.evict()
    assert (
        model.complete(
            PROMPT, GREEDY, spec_type="ngram-simple", spec_draft_max=0
        ).stats.drafted_tokens
        == 0
    )
    with pytest.raises(InvalidRequestError) as bad:
        model.complete(PROMPT, GREEDY, spec_type="draft-eagle3")
    assert bad.value.param == "spec_type"
    with pytest.raises(InvalidRequestError) as bad:
        model.complete(PROMPT, GREEDY, spec_draft_max=63)
    assert bad.value.param == "spec_draft_max"


def test_nothing_to_copy_drafts_nothing(engine: Engine) -> None:
    model = engine.load_model(config=spec_config(backend=StubBackend()))  # a stub that never copies
    done = model.complete("Tell me something new.", replace(GREEDY, max_tokens=40))
    assert done.stats.drafted_tokens == 0


# ---- the KV and the cache -------------------------------------------------------------------


def test_reply_kv_is_the_accepted_tokens_only(engine: Engine) -> None:
    """The stub's cells chain by hash: KV with a rejected draft cell left in it, or missing
    an accepted one, would change every later logit. A follow-up prompt that continues the
    speculative reply, reusing its live KV, must answer as a cold run of the same prompt."""
    model = engine.load_model(config=spec_config())
    plain = model.complete(PROMPT, SAMPLED, spec_type="none", cache_salt=PLAIN_SALT)
    plain_held = held(model)
    model.evict()
    first = model.complete(PROMPT, SAMPLED)
    assert first.completion_tokens == plain.completion_tokens
    assert 0 < first.stats.accepted_tokens < first.stats.drafted_tokens
    assert held(model) == plain_held  # no draft cell left behind, none missing
    follow = [*first.tokens, *model.tokenize(" And then", add_special=False)]
    warm = model.complete(follow, GREEDY, spec_type="none")
    assert warm.stats.cached_tokens == plain_held
    model.evict()
    with make_engine() as other:
        cold = other.load_model(config=spec_config()).complete(follow, GREEDY, spec_type="none")
    assert warm.completion_tokens == cold.completion_tokens


def test_finish_row_restores_to_plain_output(engine: Engine) -> None:
    model = engine.load_model(config=spec_config())
    first = model.complete(PROMPT, GREEDY)
    model.evict()  # the live KV goes; the finish row remains
    follow = [*first.tokens, *model.tokenize(" Next:", add_special=False)]
    restored = model.complete(follow, GREEDY)
    assert restored.stats.cached_tokens >= len(first.tokens) - 8  # from the row
    with make_engine() as other:
        cold = other.load_model(config=spec_config()).complete(follow, GREEDY, spec_type="none")
    assert restored.completion_tokens == cold.completion_tokens


def test_finish_row_after_rejected_drafts_holds_the_accepted_tokens_and_restores_cold(
    engine: Engine,
) -> None:
    """A sampled reply whose drafts were partly rejected: its finish row holds the prompt and
    the reply's decoded tokens, nothing of a rejected draft, and a prompt continuing it,
    restored from that row with the live KV gone, answers as a cold run does."""
    model = engine.load_model(config=spec_config())
    first = model.complete(PROMPT, SAMPLED, logprobs=1)
    assert 0 < first.stats.accepted_tokens < first.stats.drafted_tokens
    assert first.stats.key is not None and engine.cache.flush()
    # An end-of-generation token ended it: every reply token was decoded (the end is none).
    assert first.stats.finish_reason == "stop" and first.stats.stop_sequence is None
    assert engine.cache.row_tokens(first.stats.key) == first.tokens
    model.evict()  # the live KV goes; the finish row remains
    follow = [*first.tokens, *model.tokenize(" Next:", add_special=False)]
    restored = model.complete(follow, SAMPLED, logprobs=2, spec_type="none")
    assert restored.stats.cached_tokens == len(first.tokens)
    with make_engine() as other:
        cold = other.load_model(config=spec_config()).complete(
            follow, SAMPLED, logprobs=2, spec_type="none"
        )
    assert restored.completion_tokens == cold.completion_tokens
    assert restored.logprobs == cold.logprobs


def test_a_refused_removal_fails_the_request_and_clears_its_slot(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = engine.load_model(config=spec_config())
    ctx = model._worker.rt.ctx
    real = ctx.seq_rm

    def refuse(seq: int, p0: int = 0, p1: int = -1) -> None:
        if p0 > 0:
            raise StateRestoreError("this memory cannot remove those positions")
        real(seq, p0, p1)

    monkeypatch.setattr(ctx, "seq_rm", refuse)
    with pytest.raises(StateRestoreError):
        model.complete(PROMPT, SAMPLED)
    assert held(model) == 0 and model.status().active == 0
    monkeypatch.setattr(ctx, "seq_rm", real)
    plain = model.complete(PROMPT, GREEDY, spec_type="none")
    model.evict()
    assert model.complete(PROMPT, GREEDY).completion_tokens == plain.completion_tokens


def test_a_removal_that_leaves_cells_behind_is_caught(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = engine.load_model(config=spec_config())
    ctx = model._worker.rt.ctx
    real = ctx.seq_rm
    monkeypatch.setattr(ctx, "seq_rm", lambda s, p0=0, p1=-1: None if p0 > 0 else real(s, p0, p1))
    with pytest.raises(StateRestoreError, match="rejected draft"):
        model.complete(PROMPT, SAMPLED)
    assert held(model) == 0


def test_a_window_left_short_by_a_verify_pass_is_caught(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp gives a verify pass's later ubatch a cell that the draft's earlier rows masked
    (``find_slot`` masks by the sequence's current last position): after the rejected part is
    removed, the window lacks positions the next token attends to, and llama.cpp reports it
    only by a higher ``seq_pos_min`` (``test_speculative_model``, the backend test). The
    rollback's check must see it: it asked ``live_floor`` of the ``keep`` tokens left, which is
    never above ``keep``, so it could not fail and the request decoded on with a short window."""
    window = 128  # the stub copies what its window shows
    cfg = spec_config(backend=copier(memory_kind="swa", n_swa=window))
    model = engine.load_model(config=replace(cfg, context=replace(cfg.context, swa_full=True)))
    ctx = model._worker.rt.ctx
    # What llama.cpp reports after a verify pass that lost its window's two lowest cells.
    short = lambda seq: max(0, ctx.seq_pos_max(seq) + 3 - window)  # noqa: E731
    monkeypatch.setattr(ctx, "seq_pos_min", short)
    with pytest.raises(StateRestoreError, match="rejected draft"):
        model.complete(PROMPT, SAMPLED)
    assert held(model) == 0 and model.status().active == 0


# ---- batching, cancellation ----------------------------------------------------------------


class _Spy:
    def __init__(self, inner: object, batches: list[list[BatchToken]]) -> None:
        self._inner, self._batches = inner, batches

    def decode(self, batch: list[BatchToken]) -> None:
        self._batches.append(list(batch))
        self._inner.decode(batch)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def _three_copies(model: Model) -> tuple[list[list[BatchToken]], Callable[[], None]]:
    """Three copying prompts at once on ``model`` (3 slots), each drafting and accepting: the
    batches of its calls, and a check that each reply is its prompt's alone, plain."""
    batches: list[list[BatchToken]] = []
    rt = model._worker.rt
    rt.ctx = _Spy(rt.ctx, batches)  # type: ignore[assignment]
    prompts = [PROMPT, PROMPT.replace("Copy", "Echo"), PROMPT.replace("Copy", "Take")]
    streams = [model.stream(prompt, GREEDY) for prompt in prompts]
    together = [stream.result() for stream in streams]
    assert all(done.stats.accepted_tokens > 20 for done in together)

    def check_alone() -> None:
        for done, prompt in zip(together, prompts, strict=True):
            model.evict()
            alone = model.complete(prompt, GREEDY, spec_type="none")
            assert done.completion_tokens == alone.completion_tokens

    return batches, check_alone


def test_one_verify_pass_a_call_its_rows_last(engine: Engine) -> None:
    """Three slots speculating at once in one unified KV buffer: each call verifies at most
    one slot's draft, and that draft's rows are the call's last, so its rejected cells are the
    top of the cells in use when they are removed. Two drafts in one call left the first's
    rejected cells between the slots', and the next pass put another slot's tokens there,
    below its earlier cells: a real model attends in cell order, and a greedy reply changed
    (``test_speculative_model``; found by specrev's review). The other slots' tokens still
    share those calls."""
    model = engine.load_model(config=spec_config(n_parallel=3))
    batches, check_alone = _three_copies(model)
    verifying = shared = 0
    for batch in batches:
        rows = Counter(t.seq for t in batch if t.logits)
        drafts = [seq for seq, count in rows.items() if count > 1]
        assert len(drafts) <= 1, "two slots verified their drafts in one call"
        if drafts:
            verifying += 1
            tail = batch[len(batch) - rows[drafts[0]] :]
            assert all(t.seq == drafts[0] and t.logits for t in tail)
            shared += any(t.seq != drafts[0] for t in batch)
    assert verifying > 3 and shared > 0
    check_alone()


def test_slots_verify_together_where_replies_need_not_be_plain_decodings(engine: Engine) -> None:
    """``spec_exact = false`` (what a GPU needs to speculate at all): three slots speculating
    at once verify their drafts in one call, each slot's rows together and wanting logits,
    instead of a call each; cell order is then not kept, which the stub does not model, so
    its replies are still each request's alone."""
    model = engine.load_model(config=spec_config(n_parallel=3, spec_exact=False))
    assert model._worker.rt.cfg.verify_together
    batches, check_alone = _three_copies(model)
    shared = 0
    for batch in batches:
        rows = Counter(t.seq for t in batch if t.logits)
        drafts = [seq for seq, count in rows.items() if count > 1]
        for seq in drafts:  # a slot's rows lie together, in position order
            at = [j for j, t in enumerate(batch) if t.seq == seq]
            assert at == list(range(at[0], at[0] + len(at)))
            first = batch[at[0]].pos
            assert [batch[j].pos for j in at] == list(range(first, first + len(at)))
        shared += len(drafts) > 1
    assert shared > 0, "no call verified two slots' drafts"
    check_alone()


class _Whole(_Spy):
    """A ``_Spy`` that checks, before each call, that every slot's sequence holds exactly the
    cells of its ``kv_tokens`` (positions ``0 .. n - 1``, those tokens: no rejected draft's
    or filler row's cell left, none missing) and that the call fits ``n_batch``; what it
    found wrong is in ``wrong``. ``hook``: called with each batch before it runs (a test's
    hook: it may raise, as a failed ``llama_decode`` does, or cancel a request)."""

    def __init__(self, model: Model, batches: list[list[BatchToken]]) -> None:
        rt = model._worker.rt
        super().__init__(rt.ctx, batches)
        self._rt = rt
        self.wrong: list[str] = []
        self.hook: Callable[[list[BatchToken]], None] = lambda batch: None
        rt.ctx = self  # type: ignore[assignment]

    def check(self) -> None:
        cells = self._inner._seqs  # type: ignore[attr-defined]  # the stub's, by sequence
        for slot in self._rt.slots:
            held = cells[slot.seq]
            at = sorted(held)
            if at != list(range(len(at))) or [held[p].token for p in at] != slot.kv_tokens:
                self.wrong.append(f"seq {slot.seq}: {len(at)} cells, {len(slot.kv_tokens)} tokens")

    def decode(self, batch: list[BatchToken]) -> None:
        self.check()
        if len(batch) > self._rt.cfg.n_batch:
            self.wrong.append(f"a call of {len(batch)} tokens")
        self.hook(batch)
        super().decode(batch)


def _together(batch: Sequence[BatchToken]) -> int:
    """How many slots' drafts ``batch`` verifies (slots with more than one row of logits)."""
    rows = Counter(t.seq for t in batch if t.logits)
    return sum(count > 1 for count in rows.values())


def _at_once(model: Model, start: Callable[[], list[CompletionStream]]) -> list[CompletionStream]:
    """``start``'s requests, all queued before the worker admits any: the same ticks, and so
    the same calls, every run."""
    gate = threading.Event()
    held = model._worker.call(gate.wait)
    try:
        streams = start()
    finally:
        gate.set()
    held.result()
    return streams


def _alone(cfg: ModelConfig, prompt: str, opts: GenerationOptions, **kw: object) -> Completion:
    """``prompt``'s reply, decoded plainly in a model of its own."""
    with make_engine() as other:
        plain = other.load_model(config=cfg)
        return plain.complete(prompt, opts, **{**kw, "spec_type": "none"})  # type: ignore[arg-type]


def test_slots_verifying_together_each_end_as_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify_together``: four slots, their drafts in shared calls, each ending its own way
    inside its rows (a grammar refusing a draft token, a stop string, ``max_tokens``), one
    prompt prefilled beside them, and filler rows after the last slot's draft (a tile of 4):
    each reply and its logprobs are what the request gets alone, and before every call each
    sequence holds exactly its tokens' cells, none of a rejected draft or filler row."""
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05, tile=4, step=1.0)))
    cfg = spec_config(n_parallel=4, spec_exact=False, spec_draft_max=5)
    grammar = 'root ::= " brown fox jumps over the lazy cat" | " brown fox jumps high"'
    wanted: list[tuple[str, GenerationOptions, dict[str, object]]] = [
        (PROMPT, GREEDY, {"grammar": grammar, "logprobs": 1}),
        (PROMPT.replace("Copy", "Echo"), GREEDY, {"stop": ["the quick brown the quick"]}),
        (PROMPT.replace("Copy", "Take"), replace(GREEDY, max_tokens=23), {"logprobs": 2}),
        (f"Other: {PASSAGE * 6}Again: The quick", SAMPLED, {"logprobs": 2}),
    ]
    model = engine.load_model(config=cfg)
    assert model._worker.rt.cfg.verify_together
    batches: list[list[BatchToken]] = []
    spy = _Whole(model, batches)
    streams = _at_once(
        model,
        lambda: [model.stream(prompt, opts, **kw) for prompt, opts, kw in wanted],  # type: ignore[arg-type]
    )
    done = [stream.result() for stream in streams]
    model._worker.call(spy.check).result()
    assert spy.wrong == []
    assert any(_together(batch) > 1 for batch in batches), "no call verified two drafts"
    assert model.status().filler_rows > 0
    for one, (prompt, opts, kw) in zip(done, wanted, strict=True):
        alone = _alone(cfg, prompt, opts, **kw)
        assert one.completion_tokens == alone.completion_tokens
        assert one.logprobs == alone.logprobs
        assert one.stats.finish_reason == alone.stats.finish_reason
    assert done[0].text == " brown fox jumps over the lazy cat"
    assert done[1].stats.stop_sequence is not None
    assert len(done[2].completion_tokens) == 23


@pytest.mark.parametrize("event", ["cancelled", "failed"])
def test_one_slot_of_a_call_verifying_together_ends_alone(engine: Engine, event: str) -> None:
    """In the first call that verifies several slots' drafts, one slot's request is cancelled,
    or the call fails for its tokens (a ``llama_decode`` error: the call is retried a slot at a
    time, and that slot's call fails again). That request ends; the others' replies are what
    each gets alone, and no sequence keeps a cell of the calls."""
    cfg = spec_config(n_parallel=3, spec_exact=False)
    prompts = [PROMPT, PROMPT.replace("Copy", "Echo"), PROMPT.replace("Copy", "Take")]
    wanted = [(prompts[0], GREEDY), (prompts[1], GREEDY), (prompts[2], SAMPLED)]
    model = engine.load_model(config=cfg)
    batches: list[list[BatchToken]] = []
    spy = _Whole(model, batches)
    streams: list[CompletionStream] = []
    hit: list[set[int]] = []  # the slots of each call that held slot 1's tokens, from then on

    def hook(batch: list[BatchToken]) -> None:
        rows = Counter(t.seq for t in batch if t.logits)
        if 1 not in rows or not (hit or (rows[1] > 1 and _together(batch) > 1)):
            return
        hit.append(set(rows))
        if event == "failed":
            raise BackendError("llama_decode failed with code -3")
        streams[1].cancel()

    spy.hook = hook
    streams += _at_once(
        model, lambda: [model.stream(prompt, opts, logprobs=1) for prompt, opts in wanted]
    )
    if event == "failed":
        with pytest.raises(BackendError):
            streams[1].result()
    else:
        assert streams[1].result().stats.finish_reason == "cancelled"
    # The shared call, then (failed) slot 1's retry alone; nothing of slot 1's after.
    assert len(hit[0]) > 1 and hit[1:] == ([{1}] if event == "failed" else [])
    done = [streams[0].result(), streams[2].result()]
    model._worker.call(spy.check).result()
    assert spy.wrong == []
    for one, (prompt, opts) in zip(done, wanted[::2], strict=True):
        alone = _alone(cfg, prompt, opts, logprobs=1)
        assert one.completion_tokens == alone.completion_tokens
        assert one.logprobs == alone.logprobs


@pytest.mark.parametrize("source", ["lora", "draft model"])
def test_n_choices_verify_together(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """Two requests of two choices each (forks: their drafts come in the same ticks), under
    two LoRA adapters (``_by_adapters``: a call each, each verifying its choices' drafts
    together) or drafted by a draft model: every choice, and its logprobs, is plain
    decoding's, and no sequence keeps a cell of a rejected draft."""
    cfg = spec_config(n_parallel=4, spec_exact=False)
    if source == "draft model":
        monkeypatch.setattr(DraftCost, "per_token", lambda self, plain: 0.0)
        cfg = replace(cfg, spec_type=None, draft_model="draft-stub.gguf")

    def replies(model: Model, **kw: object) -> list[Completion]:
        sets: list[dict[str, object]] = [{}, {}]
        if source == "lora":
            for i, name in enumerate(("a.gguf", "b.gguf")):
                (tmp_path / name).write_bytes(name.encode())
                handle = model.load_adapter(tmp_path / name, scale=0.0).handle
                sets[i] = {"lora": ((handle, 1.0),)}
        prompts = [PROMPT, PROMPT.replace("Copy", "Echo")]
        streams = _at_once(
            model,
            lambda: [
                stream
                for prompt, lora in zip(prompts, sets, strict=True)
                for stream in model.streams(prompt, SAMPLED, n=2, logprobs=1, **lora, **kw)  # type: ignore[arg-type]
            ],
        )
        return [stream.result() for stream in streams]

    model = engine.load_model(config=cfg)
    batches: list[list[BatchToken]] = []
    spy = _Whole(model, batches)
    together = replies(model)
    model._worker.call(spy.check).result()
    assert spy.wrong == []
    assert any(_together(batch) > 1 for batch in batches), "no call verified two drafts"
    with make_engine() as other:
        plain = replies(other.load_model(config=cfg), spec_type="none")
    for one, alone in zip(together, plain, strict=True):
        assert one.completion_tokens == alone.completion_tokens
        assert one.logprobs == alone.logprobs


@pytest.mark.parametrize(
    ("exact", "draft_max", "rows"), [(True, 10, 11), (False, 10, 33), (False, 30, 64)]
)
def test_room_for_logits_is_made_for_the_longest_call(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, exact: bool, draft_max: int, rows: int
) -> None:
    """As it loads, a speculating model makes room for the logits of its longest call: one
    slot's verify pass (its token, ``spec_draft_max`` drafted, a tile's filler), or where
    slots verify together every slot's (3 here, a tile of 1), within ``n_batch`` (64)."""
    reserved: list[int] = []
    monkeypatch.setattr(StubContext, "_reserve_outputs", lambda self, n: reserved.append(n))
    config = spec_config(n_parallel=3, spec_exact=exact, spec_draft_max=draft_max)
    model = engine.load_model(config=config)
    assert model._worker.rt.pass_cost.tile == 1
    assert reserved == [rows]


@pytest.mark.parametrize("swa_full", [False, True])
def test_a_sliding_window_never_verifies_together(engine: Engine, swa_full: bool) -> None:
    """``spec_exact = false`` beside a sliding window: a call still verifies one draft (a
    window's verify pass must not straddle ubatches, ``_splits_verify``, which looks at the
    call's last rows alone), with or without a full-size window cache."""
    cfg = spec_config(n_parallel=3, spec_exact=False, backend=copier(memory_kind="swa", n_swa=240))
    model = engine.load_model(config=replace(cfg, context=replace(cfg.context, swa_full=swa_full)))
    assert not model._worker.rt.cfg.verify_together
    batches: list[list[BatchToken]] = []
    spy = _Whole(model, batches)
    prompts = [PROMPT, PROMPT.replace("Copy", "Echo"), PROMPT.replace("Copy", "Take")]
    opts = replace(GREEDY, max_tokens=120)
    streams = _at_once(model, lambda: [model.stream(prompt, opts) for prompt in prompts])
    assert all(stream.result().stats.accepted_tokens > 0 for stream in streams)
    assert spy.wrong == []
    assert max(_together(batch) for batch in batches) == 1


def test_a_sliding_windows_verify_pass_is_never_split_over_ubatches(engine: Engine) -> None:
    """A full-size window (``swa_full``), calls of up to 64 tokens in ubatches of 16: a verify
    pass split over two ubatches let llama.cpp give the later one a cell masked only for the
    draft's earlier rows, which the window needs again once the rejected part is removed (on
    a tiny Gemma 3 its next logits then differed from a fresh context's by 0.78, where a pass
    in one ubatch differed by cell order's 0.11: ``test_speculative_model``). So every verify
    pass lies within one ubatch: a draft is shorter than a ubatch, and a pass that would
    straddle a boundary runs in a call of its own. Replies stay what each request gets alone."""
    ub = 16
    cfg = spec_config(n_parallel=3, backend=copier(memory_kind="swa", n_swa=128))
    cfg = replace(cfg, context=replace(cfg.context, swa_full=True, n_ubatch=ub))
    long_prompt = f"Other: {PASSAGE * 6}Again: The quick"
    wanted = [(PROMPT, GREEDY), (long_prompt, SAMPLED), (f"Third {PROMPT}", SAMPLED)]
    alone = []
    for prompt, opts in wanted:
        with make_engine() as other:
            plain = other.load_model(config=cfg)
            alone.append(plain.complete(prompt, opts, spec_type="none"))
    model = engine.load_model(config=cfg)
    batches: list[list[BatchToken]] = []
    rt = model._worker.rt
    rt.ctx = _Spy(rt.ctx, batches)  # type: ignore[assignment]
    first = model.stream(PROMPT, GREEDY)
    next(iter(first))  # it generates before the others are admitted
    streams = [first, *(model.stream(p, o) for p, o in wanted[1:])]
    for stream, plain in zip(streams, alone, strict=True):
        assert stream.result().completion_tokens == plain.completion_tokens
    verifying = shared = 0
    for batch in batches:
        rows = Counter(t.seq for t in batch if t.logits)
        drafts = [seq for seq, count in rows.items() if count > 1]
        if drafts:
            verifying += 1
            start = len(batch) - rows[drafts[0]]
            assert start // ub == (len(batch) - 1) // ub, "a verify pass spans two ubatches"
            shared += start > 0
    assert verifying > 3 and shared > 0


def test_a_slot_prefills_beside_verify_passes(engine: Engine) -> None:
    """A prompt prefilled in the same passes as another slot's drafts: every reply (and its
    logprobs) is what the same request decodes alone."""
    long_prompt = f"Other: {PASSAGE * 6}Again: The quick"
    third = f"Third {PROMPT}"
    wanted = [(PROMPT, GREEDY), (long_prompt, SAMPLED), (third, SAMPLED)]
    alone = []
    for prompt, opts in wanted:
        with make_engine() as other:
            plain = other.load_model(config=spec_config(n_parallel=3))
            alone.append(plain.complete(prompt, opts, spec_type="none", logprobs=2))
    model = engine.load_model(config=spec_config(n_parallel=3))
    batches: list[list[BatchToken]] = []
    rt = model._worker.rt
    rt.ctx = _Spy(rt.ctx, batches)  # type: ignore[assignment]
    first = model.stream(PROMPT, GREEDY, logprobs=2)
    next(iter(first))  # it generates before the others are admitted
    streams = [first, *(model.stream(p, o, logprobs=2) for p, o in wanted[1:])]
    for stream, plain in zip(streams, alone, strict=True):
        done = stream.result()
        assert done.completion_tokens == plain.completion_tokens
        assert done.logprobs == plain.logprobs
    mixed = [
        batch
        for batch in batches
        if any(not t.logits for t in batch) and sum(1 for t in batch if t.logits) > 2
    ]
    assert mixed, "no pass prefilled a prompt beside a verify pass"


def test_cancel_while_speculating() -> None:
    with make_engine() as eng:
        gated = GatedBackend()
        gated._stub = copier()
        model = eng.load_model(config=spec_config(backend=gated))  # type: ignore[arg-type]
        stream = model.stream(PROMPT, GREEDY)
        gated.gate.step(3)  # prefill, then a pass or two
        stream.cancel()
        gated.gate.set()
        done = stream.result()
        assert done.stats.finish_reason == "cancelled"
        assert held(model) == len(done.prompt_tokens) + len(done.completion_tokens) - 1


# ---- where it is off ------------------------------------------------------------------------


def test_deterministic_mode_does_not_speculate(engine: Engine) -> None:
    model = engine.load_model(config=spec_config(deterministic=True))
    assert model.info().speculation.startswith("off: deterministic")
    assert model.complete(PROMPT, GREEDY).stats.drafted_tokens == 0
    relaxed = engine.load_model("relaxed", config=spec_config())
    assert relaxed.info().speculation == "on" and relaxed.info().spec_type == "ngram-simple"
    assert relaxed.complete(PROMPT, GREEDY, deterministic=True).stats.drafted_tokens == 0


def test_per_sequence_streams_never_hold_a_verify_pass(engine: Engine) -> None:
    """Per-sequence KV streams (``kv_unified`` false) come only with a deterministic model of
    several slots, and such a model drafts for no request, not even one that asks for drafts
    with ``deterministic`` false. So ``Tick._splits_verify`` guards the unified buffer alone:
    llama.cpp would split a verify pass sharing a call with a lower sequence's rows
    (``split_equal``: equal parts per sequence), which in a stream of its own loses no cell
    (``test_a_verify_pass_split_in_its_own_stream_keeps_its_window``), but nothing sends one."""
    model = engine.load_model(config=spec_config(2, deterministic=True))
    assert model._worker.rt.ctx.params.kv_unified is False
    ask = {"deterministic": False, "spec_type": "ngram-simple"}
    first = model.stream(PROMPT, GREEDY, **ask)  # type: ignore[arg-type]
    next(iter(first))
    second = model.complete(f"Third {PROMPT}", GREEDY, prediction=PASSAGE, **ask)  # type: ignore[arg-type]
    assert first.result().stats.drafted_tokens == second.stats.drafted_tokens == 0
    relaxed = engine.load_model("relaxed", config=spec_config(2))
    assert relaxed.complete(PROMPT, GREEDY, **ask).stats.drafted_tokens > 0  # type: ignore[arg-type]


class _Inexact(StubBackend):
    """A stub whose models report ``exactness`` for their verify rows (``with_adapter``
    where an adapter is attached), counting the asks."""

    def __init__(self, exactness: str, with_adapter: str = "", **kw: object) -> None:
        super().__init__(copy_bias=8.0, **kw)  # type: ignore[arg-type]
        self.exactness, self.with_adapter, self.asked = exactness, with_adapter, 0

    def load_model(self, path: str, params: ModelParams | None = None) -> StubModel:
        model = super().load_model(path, params)
        backend = self

        def verify_exactness(p: ContextParams, adapters: AdapterSet = ()) -> str:
            backend.asked += 1
            return backend.with_adapter if adapters else backend.exactness

        model.verify_exactness = verify_exactness  # type: ignore[method-assign]
        return model


@pytest.mark.parametrize(
    "exactness",
    ["while the context uses at most 256 KV cells (f16 KV ...)", "no: 3 of 11 rows differed"],
)
def test_a_model_not_exact_at_any_length_speculates_only_with_spec_exact_false(
    engine: Engine, exactness: str
) -> None:
    """Where a verify pass's rows are not one-token passes at any length, a greedy reply could
    differ from plain decoding's: the model does not speculate (and says why) unless its
    ``spec_exact`` is false, which speculates and says where it is exact."""
    strict = _Inexact(exactness)
    model = engine.load_model("strict", config=spec_config(backend=strict))
    info = model.info()
    assert info.speculation.startswith("off: a verify pass's rows ")
    assert "spec_exact = false" in info.speculation
    assert ("type_k and type_v at auto" in info.speculation) == exactness.startswith("while")
    assert info.speculation_exact is None
    assert model.complete(PROMPT, GREEDY).stats.drafted_tokens == 0
    loose = _Inexact(exactness)
    model = engine.load_model("loose", config=spec_config(backend=loose, spec_exact=False))
    assert (model.info().speculation, model.info().speculation_exact) == ("on", exactness)
    assert model.complete(PROMPT, GREEDY).stats.accepted_tokens > 0
    assert strict.asked == loose.asked == 1


def test_exactness_is_measured_only_where_a_model_could_speculate(engine: Engine) -> None:
    """``verify_exactness`` may run passes to measure: a model that cannot speculate for
    another reason (deterministic, a memory that cannot roll back) is not asked."""
    for kw in ({"deterministic": True}, {}):
        backend = _Inexact("at any length", **({} if kw else {"memory_kind": "recurrent"}))
        engine.load_model(f"m{len(kw)}", config=spec_config(backend=backend, **kw))
        assert backend.asked == 0


def test_a_request_under_an_adapter_that_is_not_exact_decodes_plainly(
    engine: Engine, tmp_path: Path
) -> None:
    """Each adapter is measured as it loads (an f32 LoRA's products take tinyBLAS for several
    rows on the CPU): a request whose set holds one that makes verify rows differ decodes
    plainly, as does the model under it as its own set; one whose adapters are exact
    speculates; ``spec_exact=False`` measures nothing and speculates under any."""
    files = [tmp_path / name for name in ("exact.gguf", "inexact.gguf")]
    for f in files:
        f.write_bytes(f.name.encode())
    backend = _Inexact("at any length", with_adapter="at any length")
    model = engine.load_model("m", config=spec_config(backend=backend))
    exact = model.load_adapter(files[0], scale=0.0).handle
    backend.with_adapter = "no: 9 of 11 rows differed"
    inexact = model.load_adapter(files[1], scale=0.0).handle
    assert backend.asked == 3  # the model, then each adapter as it loaded

    def drafted(handle: int) -> int:
        opts = replace(GREEDY, lora=((handle, 1.0),))
        plain = model.complete(PROMPT, replace(opts, spec_type="none"))
        model.evict()
        spec = model.complete(PROMPT, opts)
        model.evict()
        assert spec.completion_tokens == plain.completion_tokens
        return spec.stats.accepted_tokens

    assert drafted(exact) > 0
    assert drafted(inexact) == 0
    model.set_adapter_scale(inexact, 1.0)  # the model's own set now holds it
    assert model.complete(PROMPT, GREEDY).stats.drafted_tokens == 0
    loose_backend = _Inexact("at any length", with_adapter="no: 9 of 11 rows differed")
    loose = engine.load_model("loose", config=spec_config(backend=loose_backend, spec_exact=False))
    handle = loose.load_adapter(files[1], scale=0.0).handle
    assert loose_backend.asked == 1  # the model alone
    opts = replace(GREEDY, lora=((handle, 1.0),))
    assert loose.complete(PROMPT, opts).stats.accepted_tokens > 0


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_memory_that_cannot_roll_back_does_not_speculate(
    engine: Engine, kind: MemoryKindName
) -> None:
    model = engine.load_model(config=spec_config(backend=copier(memory_kind=kind)))
    assert model.info().speculation == f"off: a {kind} memory cannot roll a rejected draft back"
    assert model.complete(PROMPT, GREEDY).stats.drafted_tokens == 0


def test_sliding_window_speculates_only_inside_its_window(engine: Engine) -> None:
    window = 240
    model = engine.load_model(config=spec_config(backend=copier(memory_kind="swa", n_swa=window)))
    assert "shorter than its 240-token sliding window" in model.info().speculation
    opts = replace(GREEDY, max_tokens=120)
    plain, spec = both(model, PROMPT, opts)
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens > 0
    assert len(spec.prompt_tokens) + 120 > window  # it went on past the window, plainly


def test_full_size_window_speculates_everywhere(engine: Engine) -> None:
    cfg = spec_config(backend=copier(memory_kind="swa", n_swa=128))
    cfg = replace(cfg, context=replace(cfg.context, swa_full=True))
    model = engine.load_model(config=cfg)
    assert model.info().speculation == "on"
    plain, spec = both(model, PROMPT, replace(GREEDY, max_tokens=120))
    assert spec.completion_tokens == plain.completion_tokens and spec.stats.accepted_tokens > 20


# ---- drafts from the cache ------------------------------------------------------------------


def test_drafts_from_the_namespaces_rows_and_no_other(engine: Engine) -> None:
    """A stub that never copies: a reply's own text suggests nothing, but the reply an earlier
    request of the same namespace got is in a cached row, and drafts come from it. Another
    tenant (another cache salt) gets none of them."""
    model = engine.load_model(config=spec_config(backend=StubBackend()))
    prompt = "Tell me about the harbour, the lighthouse and the keeper's family."
    opts = replace(GREEDY, max_tokens=40)
    first = model.complete(prompt, opts, cache_salt="tenant-a")
    assert first.stats.accepted_tokens == 0 and first.stats.key is not None
    assert engine.cache.lookup_exact_or_wait(first.stats.key, 30.0) is not None  # published
    model.evict()
    again = model.complete(prompt, opts, cache_salt="tenant-a")
    assert again.completion_tokens == first.completion_tokens
    assert again.stats.accepted_tokens >= 30  # the earlier reply, from its row
    other = model.complete(prompt, opts, cache_salt="tenant-b")
    assert other.completion_tokens == first.completion_tokens  # the same model, the same reply
    assert other.stats.drafted_tokens == 0  # but nothing of tenant-a's rows
    # A key's salt (``tenants.scoped``) names the tenant whose share of the index it counts
    # in; the salts above are no key's, the shared tenant's.
    keyed = scoped("s", "a key")
    model.complete(prompt, replace(opts, max_tokens=4), cache_salt=keyed)
    rows = model._worker.rt.row_drafts  # type: ignore[attr-defined]
    assert rows is not None and rows.held(tenant_id("a key")) > 0
    assert rows.held(None) > 0


def test_only_a_greedy_request_trusts_an_earlier_reply(engine: Engine) -> None:
    """A retried request's cached reply is drafted as near-certain (``RowTrust``) only where
    the request samples greedily: a sampled one keeps each draft token only with its
    probability, so its drafts neither lean on nor teach the trust."""
    model = engine.load_model(config=spec_config(backend=StubBackend()))
    trust = model._worker.rt.row_trust
    prompt = "Tell me about the harbour, the lighthouse and the keeper's family."
    first = model.complete(prompt, replace(GREEDY, max_tokens=40))
    assert first.stats.key is not None
    assert engine.cache.lookup_exact_or_wait(first.stats.key, 30.0) is not None
    model.evict()
    # Barely sampled: it follows the earlier reply, drafts from it, and keeps most drafts.
    sampled = model.complete(prompt, replace(GREEDY, max_tokens=40, temperature=0.05, seed=7))
    assert sampled.stats.drafted_tokens > 0  # it drafted from the row, untrusted
    assert (trust.yes, trust.no) == (0.0, 0.0)
    model.evict()
    again = model.complete(prompt, replace(GREEDY, max_tokens=40))
    assert again.completion_tokens == first.completion_tokens
    assert trust.yes > 0  # a greedy retry: trusted, and its whole draft held


# ---- a draft model ------------------------------------------------------------------------------


@pytest.mark.usefixtures("free_draft_passes")
def test_a_draft_model_drafts_and_the_output_is_plain_decodings(engine: Engine) -> None:
    """The stub drafting for itself (the same vocabulary): its greedy tokens are drafts, the
    reply is plain decoding's; a request may still choose n-grams or none."""
    model = engine.load_model(
        config=replace(spec_config(), spec_type=None, draft_model="draft-stub.gguf")
    )
    assert model.info().spec_type == "draft-simple"  # a draft model drafts unless told otherwise
    assert model.info().draft_model == "draft-stub.gguf"
    plain, spec = both(model, PROMPT, GREEDY)
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens > 20
    draft = model._draft
    assert draft is not None and len(draft.held[0]) > len(spec.prompt_tokens)  # it decoded
    ngram = model.complete(PROMPT, GREEDY, spec_type="ngram-simple")
    assert ngram.completion_tokens == plain.completion_tokens


def test_a_draft_model_as_costly_as_the_model_drafts_nothing(engine: Engine) -> None:
    """A draft of ``k`` tokens costs ``k`` passes of the draft model besides its verify pass
    (``DraftCost``): a draft model as large as the model (its weights' size: the prior) makes
    every drafted token cost more than the pass it could save, so the budget drafts nothing and
    the draft model never runs, not even its prefill. Found by review (issue 39): the budget
    priced the verify pass alone, and the stub drafting for itself drafted every copy, as
    SmolLM2 or Gemma 3 270M drafting for themselves did, slower than plain decoding."""
    model = engine.load_model(
        config=replace(spec_config(), spec_type=None, draft_model="draft-stub.gguf")
    )
    plain, spec = both(model, PROMPT, GREEDY)
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.drafted_tokens == 0
    draft = model._draft
    assert draft is not None and draft.prefilled_tokens == draft.restored_tokens == 0


@pytest.mark.usefixtures("free_draft_passes")
def test_a_draft_model_told_spec_type_none_drafts_only_for_requests_that_ask(
    engine: Engine,
) -> None:
    """``spec_type = "none"`` beside a ``draft_model`` is said: requests decode plainly unless
    they choose a draft source (found by review: it became draft-simple as if not given, so
    ``--spec-type none --draft-model X`` drafted every request)."""
    model = engine.load_model(
        config=replace(spec_config(), spec_type="none", draft_model="draft-stub.gguf")
    )
    assert model.info().spec_type == "none"
    assert model.info().speculation == "on" and model.info().draft_model == "draft-stub.gguf"
    plain = model.complete(PROMPT, GREEDY)
    assert plain.stats.drafted_tokens == 0
    model.evict()
    asked = model.complete(PROMPT, GREEDY, spec_type="draft-simple")
    assert asked.completion_tokens == plain.completion_tokens
    assert asked.stats.accepted_tokens > 20


def test_a_model_with_a_draft_model_describes_itself_while_it_unloads(engine: Engine) -> None:
    """``/v1/models`` lists a model while it unloads (its native state already freed): its
    info must not read the closed draft model (found by review: HandleClosedError)."""
    model = engine.load_model(config=replace(spec_config(), draft_model="draft-stub.gguf"))
    before = model.info()
    assert before.draft_bytes > 0
    model.unload()
    assert model.info().draft_bytes == before.draft_bytes


def test_draft_needs_a_draft_model(engine: Engine) -> None:
    model = engine.load_model(config=spec_config())
    with pytest.raises(InvalidRequestError) as bad:
        model.complete(PROMPT, GREEDY, spec_type="draft-simple")
    assert bad.value.param == "spec_type"
    with pytest.raises(ConfigError, match="needs a draft_model"):
        engine.load_model(config=replace(spec_config(), spec_type="draft-simple"))


@pytest.mark.usefixtures("free_draft_passes")
def test_draft_model_catches_up_a_chunk_a_tick_and_restores_its_prompt(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt is prefilled into the draft context one n_batch chunk per tick (no draft
    meanwhile, the slot decodes plainly), saved whole under the draft namespace, and a later
    request of the same prompt restores it rather than prefilling it again."""
    config = replace(spec_config(), spec_type=None, draft_model="draft-stub.gguf")
    model = engine.load_model(config=config)
    draft = model._draft
    assert draft is not None
    chunks: list[int] = []
    prefill = draft.ctx.prefill

    def counted(seq: int, tokens: Sequence[int], start: int) -> None:
        chunks.append(len(tokens))
        prefill(seq, tokens, start)

    monkeypatch.setattr(draft.ctx, "prefill", counted)
    first = model.complete(PROMPT, GREEDY)
    assert len(first.prompt_tokens) > 2 * 64  # three chunks of n_batch 64
    assert chunks[:3] == [64, 64, len(first.prompt_tokens) - 128]
    assert draft.prefilled_tokens >= len(first.prompt_tokens)
    assert first.stats.accepted_tokens > 0
    model._worker.call(lambda: draft.reset(0)).result()
    assert engine.cache.flush()
    prefilled = draft.prefilled_tokens
    before = engine.cache.counters()
    again = model.complete(PROMPT, GREEDY)
    assert again.completion_tokens == first.completion_tokens
    assert draft.restored_tokens >= len(first.prompt_tokens)
    # The draft context's restore is counted apart from the request's own hit.
    after = engine.cache.counters()
    # The main context's prompt is the slot's live KV: one live hit, no row restored.
    outcomes = ("hits_exact", "hits_resume", "hits_longest_prefix", "hits_live", "misses")
    assert {k: after[k] - before[k] for k in outcomes} == {
        "hits_exact": 0,
        "hits_resume": 0,
        "hits_longest_prefix": 0,
        "hits_live": 1,
        "misses": 0,
    }
    assert after["hits_draft_prefix"] - before["hits_draft_prefix"] >= 1
    assert draft.prefilled_tokens - prefilled < 64  # only what the reply added
    # Another tenant in the same slot: neither the live draft KV nor the cached row is its.
    prefilled, restored = draft.prefilled_tokens, draft.restored_tokens
    other = model.complete(PROMPT, GREEDY, cache_salt="another tenant")
    assert other.completion_tokens == first.completion_tokens
    assert draft.restored_tokens == restored
    assert draft.prefilled_tokens - prefilled >= len(first.prompt_tokens)


@pytest.mark.parametrize("why", ["deterministic", "recurrent"])
def test_a_model_that_cannot_speculate_loads_no_draft_model(
    engine: Engine, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: a deterministic model (or one whose memory cannot roll a draft back)
    loaded its ``--draft-model`` too, weights and context, for drafts it never asks for."""
    config = replace(spec_config(), draft_model="draft-stub.gguf")
    if why == "deterministic":
        config = replace(config, deterministic=True)
    else:
        config = spec_config(backend=copier(memory_kind="recurrent"), draft_model="draft-stub.gguf")
    with caplog.at_level("WARNING", logger="kvwarm.engine.model"):
        model = engine.load_model(config=config)
    assert model._draft is None
    info = model.info()
    assert (info.draft_model, info.draft_bytes) == (None, 0)
    assert info.speculation.startswith("off: ")
    assert info.speculation.endswith("; the draft model draft-stub.gguf was not loaded")
    assert "not loading the draft model draft-stub.gguf" in caplog.text
    assert model.complete(PROMPT, GREEDY).stats.drafted_tokens == 0


def test_a_draft_models_memory_counts_with_the_model(engine: Engine) -> None:
    """The draft model's weights and its context are memory the model holds: in ``info()``,
    hence in ``/v1/models`` and the memory budget (found by review: neither was counted, so
    a budget sized the RAM tier as if they took nothing)."""
    plain = engine.load_model("plain", config=spec_config())
    drafted = engine.load_model(
        "drafted", config=replace(spec_config(), draft_model="draft-stub.gguf")
    )
    draft = drafted._draft
    assert draft is not None
    mine, other = drafted.info(), plain.info()
    assert other.draft_bytes == 0
    assert mine.draft_bytes == draft.model.facts.size_bytes > 0
    extra = draft.ctx.memory_bytes
    assert extra.kv_bytes > 0
    assert mine.kv_bytes == other.kv_bytes + extra.kv_bytes
    assert mine.context_bytes == other.context_bytes + extra.total_bytes
    held = memory_of("drafted", drafted)
    assert held.weights_bytes == mine.size_bytes + mine.draft_bytes
    assert held.context_bytes == mine.context_bytes


def test_the_vocabulary_is_read_once_as_a_speculating_model_loads(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end-of-generation tokens and the sentence ends come from one pass over the
    vocabulary while the model loads: the first speculating request read it (~0.1 s of
    SmolLM2's first reply, ~0.3 s of Gemma 3's), and ``is_eog`` once a token took 1.6 s of
    Gemma 3's load."""
    calls = Counter[str]()
    vocabulary, is_eog = StubModel.vocabulary, StubModel.is_eog

    def counted_vocabulary(self: StubModel) -> tuple[tuple[bytes, ...], frozenset[int]]:
        calls["vocabulary"] += 1
        return vocabulary(self)

    def counted_is_eog(self: StubModel, token: int) -> bool:
        calls["is_eog"] += 1
        return is_eog(self, token)

    monkeypatch.setattr(StubModel, "vocabulary", counted_vocabulary)
    monkeypatch.setattr(StubModel, "is_eog", counted_is_eog)
    model = engine.load_model(config=spec_config())
    rt = model._worker.rt  # type: ignore[attr-defined]
    assert calls == {"vocabulary": 1}
    assert rt.sentence_ends is not None and rt.eog_tokens() == (EOS,)
    model.complete("copy this: alpha beta gamma. alpha beta", GREEDY)
    assert calls["vocabulary"] == 1  # the request read none of it
    plain = engine.load_model(config=stub_config(1), model_id="plain")
    assert calls["vocabulary"] == 2 and plain._worker.rt.sentence_ends is None  # type: ignore[attr-defined]


def test_a_failing_ngram_drafter_ends_drafting_and_the_request_decodes_plainly(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault in the n-gram drafter (a bug) was the request's failure; its drafts change no
    token, so the request now goes on without them, the fault logged."""
    from kvwarm.engine.worker.drafts import Drafter

    model = engine.load_model(config=spec_config())
    plain = model.complete(PROMPT, GREEDY, spec_type="none", cache_salt=PLAIN_SALT)
    model.evict()
    calls: list[int] = []

    def broken(self: Drafter, *args: object, **kw: object) -> list[int]:
        calls.append(1)
        raise RuntimeError("drafter bug")

    monkeypatch.setattr(Drafter, "propose", broken)
    with caplog.at_level("ERROR", logger="kvwarm.engine.worker.tick"):
        spec = model.complete(PROMPT, GREEDY)
    assert spec.text == plain.text and spec.completion_tokens == plain.completion_tokens
    assert spec.stats.drafted_tokens == 0
    assert calls == [1]  # asked once, then the request decodes plainly
    assert any("drafting failed" in r.getMessage() and r.exc_info for r in caplog.records)


@pytest.mark.usefixtures("free_draft_passes")
def test_an_unexpected_draft_model_fault_ends_drafting_and_the_request_decodes_plainly(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A draft model's failure ends its request's drafting, never the request
    (``draftmodel.py``'s invariant): that held for a ``KvwarmError`` only, and anything else
    (a bug) failed the request, a 500 for a speed hint (found by review); now it is logged,
    the request decodes plainly and the draft context's sequence is cleared (its state is
    unknown)."""
    from kvwarm.engine.worker.draftmodel import DraftModel

    config = replace(spec_config(), spec_type=None, draft_model="draft-stub.gguf")
    model = engine.load_model(config=config)
    plain = model.complete(PROMPT, GREEDY, spec_type="none", cache_salt=PLAIN_SALT)
    model.evict()
    calls: list[int] = []
    original = DraftModel._propose

    def broken(self: DraftModel, *args: object, **kw: object) -> list[int]:
        calls.append(1)
        self.held[0].append(0)  # what it holds is no longer known
        raise RuntimeError("draft model bug")

    monkeypatch.setattr(DraftModel, "_propose", broken)
    with caplog.at_level("ERROR", logger="kvwarm.engine.worker.draftmodel"):
        spec = model.complete(PROMPT, GREEDY)
    assert spec.text == plain.text and spec.completion_tokens == plain.completion_tokens
    assert spec.stats.drafted_tokens == 0
    assert calls == [1]  # asked once, then the request decodes plainly
    assert any("draft model bug" in str(r.exc_info) for r in caplog.records if r.exc_info)
    draft = model._draft
    assert draft is not None and draft.held[0] == []  # cleared with the context's sequence
    monkeypatch.setattr(DraftModel, "_propose", original)
    model.evict()
    again = model.complete(PROMPT, GREEDY)  # the next request drafts again
    assert again.completion_tokens == plain.completion_tokens and again.stats.accepted_tokens > 0


# ---- a prediction (OpenAI's predicted outputs) ------------------------------------------------


def _reply(model: Model, prompt: str, opts: GenerationOptions, salt: str):  # type: ignore[no-untyped-def]
    done = model.complete(prompt, opts, spec_type="none", cache_salt=salt)
    model.evict()
    return done


def test_a_prediction_is_drafted_and_the_output_is_plain_decodings(engine: Engine) -> None:
    """A stub that never copies: its reply's own text suggests nothing and no cached row of
    the request's salt holds it, so every draft comes from the prediction. The whole reply as
    the prediction is replayed token for token; one with a character changed (an edit the
    model does not make) drafts, has that draft rejected, and picks the copy up again after
    it; the output is plain decoding's either way, and an unrelated prediction changes
    nothing."""
    model = engine.load_model(config=spec_config(backend=StubBackend()))
    prompt = "Tell me about the harbour, the lighthouse and the keeper's family."
    opts = replace(GREEDY, max_tokens=48)
    plain = _reply(model, prompt, opts, "plain")
    text = plain.text
    assert len(text) > 40, text
    assert model.complete(prompt, opts, cache_salt="none").stats.drafted_tokens == 0
    model.evict()

    whole = model.complete(prompt, opts, prediction=plain.text, cache_salt="whole")
    assert whole.completion_tokens == plain.completion_tokens
    assert whole.stats.accepted_tokens >= 40
    model.evict()

    at = len(text) // 3
    edited = text[:at] + ("Z" if text[at] != "Z" else "Y") + text[at + 1 :]
    edit = model.complete(prompt, opts, prediction=edited, cache_salt="edit")
    assert edit.completion_tokens == plain.completion_tokens
    assert edit.stats.drafted_tokens > edit.stats.accepted_tokens  # the edit's draft failed
    assert edit.stats.accepted_tokens >= 20  # the copy before it, and after it
    model.evict()

    other = model.complete(prompt, opts, prediction="Nothing like it at all.", cache_salt="o")
    assert other.completion_tokens == plain.completion_tokens


def test_a_prediction_follows_the_switch_and_the_models_ability(engine: Engine) -> None:
    """A model whose own spec_type is none drafts from a prediction (as ngram-simple); a
    request's spec_type none turns that off; a model that cannot speculate (deterministic)
    decodes plainly, the prediction unused; a prediction that is no text is a 400."""
    prompt = "Tell me about the harbour, the lighthouse and the keeper's family."
    opts = replace(GREEDY, max_tokens=40)
    model = engine.load_model(config=spec_config(backend=StubBackend(), spec_type="none"))
    plain = _reply(model, prompt, opts, "plain")
    drafted = model.complete(prompt, opts, prediction=plain.text, cache_salt="p1")
    assert drafted.completion_tokens == plain.completion_tokens
    assert drafted.stats.accepted_tokens >= 30
    model.evict()
    off = model.complete(prompt, opts, prediction=plain.text, spec_type="none", cache_salt="p2")
    assert off.completion_tokens == plain.completion_tokens
    assert off.stats.drafted_tokens == 0
    for bad in (5, ["a"], "x\ud800"):
        with pytest.raises(InvalidRequestError) as info:
            model.complete(prompt, opts, prediction=bad)  # type: ignore[arg-type]
        assert info.value.param == "prediction"
    engine.unload_model(model.id)
    exact = engine.load_model(
        config=spec_config(backend=StubBackend(), spec_type="none", deterministic=True)
    )
    kept = exact.complete(prompt, opts, prediction=plain.text, cache_salt="p3")
    assert kept.completion_tokens == plain.completion_tokens
    assert kept.stats.drafted_tokens == 0


def test_a_prediction_is_indexed_only_where_its_request_drafts_from_rows(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ngram-cache drafts from next-token counts, never from a row: a prediction is not used
    there, and was indexed all the same (its prompt and predicted tokens, on the worker
    thread: ~80 ms and ~30 MB behind a 120,000-token prompt, held for the whole request)."""
    made: list[int] = []

    class Counted(Predicted):
        __slots__ = ()

        def __init__(self, n: int, prompt: Sequence[int], predicted: Sequence[int]) -> None:
            made.append(len(predicted))
            super().__init__(n, prompt, predicted)

    monkeypatch.setattr(tick_module, "Predicted", Counted)
    model = engine.load_model(config=spec_config(backend=StubBackend()))
    prompt = "Tell me about the harbour, the lighthouse and the keeper's family."
    opts = replace(GREEDY, max_tokens=8)
    model.complete(prompt, opts, prediction="The harbour", spec_type="ngram-cache")
    assert made == []
    model.complete(prompt, opts, prediction="The harbour", spec_type="ngram-simple")
    assert len(made) == 1


@pytest.mark.usefixtures("free_draft_passes")
def test_a_draft_model_loads_beside_a_model_of_a_supplied_fingerprint(
    engine: Engine, tmp_path: Path
) -> None:
    """``fingerprint_mode = "fast_unsafe"`` supplies the model's fingerprint, never its draft
    model's: the draft model's namespace asked for one all the same, and every such model
    with a ``draft_model`` failed to load (found by review: ``ConfigError`` "needs a 32-byte
    fingerprint"). Its file is now hashed whole, as a projector's is; in the other modes its
    fingerprint is what it was (its rows keep their keys)."""
    import gguf

    from kvwarm.engine.fingerprint import FingerprintMode, fingerprint

    draft_file = tmp_path / "draft.gguf"  # a GGUF of metadata only: the stub reads none of it
    writer = gguf.GGUFWriter(str(draft_file), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = replace(
        spec_config(),
        draft_model=str(draft_file),
        fingerprint_mode="fast_unsafe",
        fingerprint=b"\x01" * 32,
    )
    model = engine.load_model(config=config)
    draft = model._draft
    assert draft is not None
    assert draft.namespace.fingerprint == fingerprint(draft_file, FingerprintMode.SAFE)
    plain, spec = both(model, PROMPT, GREEDY, spec_type="draft-simple")
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens > 0
    engine.unload_model(model.id)
    for mode in (FingerprintMode.SAFE, FingerprintMode.GGUF_CHUNKED):
        kept = engine.load_model(
            config=replace(spec_config(), draft_model=str(draft_file), fingerprint_mode=mode.name)
        )
        assert kept._draft is not None
        assert kept._draft.namespace.fingerprint == fingerprint(draft_file, mode)
        engine.unload_model(kept.id)
