"""Speculative decoding on the real embedded model (llama.cpp): the verify pass's rows are a
one-token pass's logits (flash attention on), so greedy and seeded replies, and their
logprobs, are plain decoding's, token for token, while drafts copied from the prompt are
accepted. With f16 KV that holds only while the KV view is under 512 cells (llama.cpp's
split-KV kernel for one-token passes), so a speculating model's ``auto`` cells are q8_0, and a
model given f16 does not speculate unless ``spec_exact`` is false.
Short prompts: prefill is ~200 tokens/s on 2 cores."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tests.childkit import run_child
from tests.conftest import FREE_DRAFT_PASSES
from tests.engine.conftest import make_engine

from kvwarm.backends.base import BackendContext, BatchToken, ContextParams
from kvwarm.backends.llama import kv_layout, model_file
from kvwarm.buffers import u8
from kvwarm.engine.api import Engine, ModelConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import MAX_DRAFT_TOKENS, Completion, GenerationOptions
from kvwarm.engine.worker.drafts import Cost, PassCost
from kvwarm.errors import ConfigError

pytestmark = pytest.mark.model

CODE = (
    "def area(width, height):\n"
    "    if width < 0 or height < 0:\n"
    "        raise ValueError('negative size')\n"
    "    return width * height\n"
)
MESSAGES = [{"role": "user", "content": f"Repeat this code exactly:\n\n{CODE}"}]


@contextmanager
def generous_engine() -> Iterator[Engine]:
    """An engine whose models draft generously (one more token costs 5% of a pass, a GPU's
    trade-off), so long drafts and rejections are both verified whatever this CPU's timing."""
    with pytest.MonkeyPatch.context() as patch, make_engine() as engine:
        patch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05)))
        yield engine


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    with generous_engine() as engine:
        config = ModelConfig(
            context=ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2),
            spec_type="ngram-simple",
            spec_ngram_n=3,
            spec_draft_max=32,
        )
        yield engine.load_model(config=config)


def test_greedy_reply_is_plain_decodings(model: Model) -> None:
    opts = GenerationOptions(max_tokens=48, temperature=0.0)
    # Salts keep each run cold, so both start from the same prefill.
    plain = model.chat(MESSAGES, options=opts, spec_type="none", cache_salt="plain")
    spec = model.chat(MESSAGES, options=opts, cache_salt="spec")
    assert spec.completion_tokens == plain.completion_tokens
    assert "width * height" in spec.text  # it copied ...
    assert spec.stats.accepted_tokens >= 16  # ... much of it from drafts
    assert model.info().flash_attn == "auto"  # llama.cpp's auto: flash attention on


@pytest.mark.parametrize("kind", ["ngram-map-k4v", "ngram-cache"])
def test_greedy_reply_is_plain_decodings_by_counted_ngrams(model: Model, kind: str) -> None:
    """The two types that draft from counts (a key's continuations; next tokens of 1- to
    4-grams), chosen per request: the same reply, much of it from drafts."""
    opts = GenerationOptions(max_tokens=48, temperature=0.0)
    plain = model.chat(MESSAGES, options=opts, spec_type="none", cache_salt=f"plain-{kind}")
    spec = model.chat(MESSAGES, options=opts, spec_type=kind, cache_salt=kind)
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens >= 8


def test_filler_rows_keep_greedy_and_seeded_replies_plain_decodings(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify passes filled to a whole tile of 4 rows (drafts capped at 5: 6 rows and 2
    filler rows a pass, as a CPU whose matrix kernel takes 4 rows at a time pays for the
    rows past a multiple): the filler's rows, after the draft's, change none of its logits,
    and their cells are removed with the rejected draft's, so greedy and seeded replies and
    their logprobs are plain decoding's."""
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05, tile=4, step=1.0)))
    before = model.status().filler_rows
    for opts, salt in (
        (GenerationOptions(max_tokens=40, temperature=0.0, spec_draft_max=5), "filler"),
        (
            GenerationOptions(
                max_tokens=32, temperature=0.8, seed=11, logprobs=2, spec_draft_max=5
            ),
            "filler-s",
        ),
    ):
        plain = model.chat(MESSAGES, options=opts, spec_type="none", cache_salt=f"{salt}-plain")
        spec = model.chat(MESSAGES, options=opts, cache_salt=salt)
        assert spec.completion_tokens == plain.completion_tokens
        assert spec.logprobs == plain.logprobs
        assert spec.stats.accepted_tokens > 0
        after = model.status().filler_rows
        assert after > before
        before = after


def test_a_speculating_model_makes_room_for_its_longest_verify_pass_as_it_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llama.cpp grows its logits buffer when a pass wants more rows than any before (a new
    allocation whose pages fault in as the logits land: a first 48-row pass of Gemma 3 took
    324 ms against 288-292 after): a speculating model runs one pass of its longest verify
    pass's rows as it loads (its pending token, ``spec_draft_max``, a tile's filler) and
    leaves the context empty; a model that does not speculate runs none."""
    from kvwarm.backends.llama.context import LlamaContext

    passes: list[tuple[int, int]] = []
    decode = LlamaContext._decode

    def counted(self: LlamaContext, batch: list[BatchToken]) -> None:
        passes.append((len(batch), sum(t.logits for t in batch)))
        decode(self, batch)

    monkeypatch.setattr(LlamaContext, "_decode", counted)
    context = ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2)
    with make_engine() as engine:
        spec = engine.load_model(
            config=ModelConfig(context=context, spec_type="ngram-simple", spec_draft_max=20)
        )
        rows = 20 + spec._worker.rt.pass_cost.tile
        # The load's last pass (the exactness probe's, on a context of its own, come first).
        assert passes[-1] == (rows, rows) and passes.count((rows, rows)) == 1
        assert spec._worker.rt.ctx.seq_pos_max(0) == -1
        opts = GenerationOptions(max_tokens=24, temperature=0.0)
        reply = spec.chat(MESSAGES, options=opts)
        plain = spec.chat(MESSAGES, options=opts, spec_type="none", cache_salt="reserve-plain")
        assert reply.completion_tokens == plain.completion_tokens
        passes.clear()
        engine.load_model(model_id="plain", config=ModelConfig(context=context))
        assert not any(n > 1 and wanted == n for n, wanted in passes), passes


def test_seeded_reply_and_logprobs_are_plain_decodings(model: Model) -> None:
    opts = GenerationOptions(max_tokens=32, temperature=0.8, seed=11, logprobs=2)
    plain = model.chat(MESSAGES, options=opts, spec_type="none", cache_salt="plain-s")
    spec = model.chat(MESSAGES, options=opts, spec_type="ngram-map-k", cache_salt="spec-s")
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.logprobs == plain.logprobs
    assert spec.stats.drafted_tokens > 0


def test_an_earlier_reply_replayed_from_its_row_keeps_plain_decodings_text(model: Model) -> None:
    """A request whose prompt differs from an earlier one's only at its start (the bench's
    "Request N.") is replayed the earlier reply from its cached row (``Drafter._follow_rows``)
    for as long as it writes the same, and its text is plain decoding's where the two replies
    part ("This function takes two parameters" against "... takes a width")."""
    opts = GenerationOptions(max_tokens=40, temperature=0.0)

    def ask(r: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Request {r}. Repeat this code exactly:\n\n{CODE}"}]

    plain = model.chat(ask(2), options=opts, spec_type="none", cache_salt="replay-plain")
    model.chat(ask(1), options=opts, cache_salt="replay")  # its finish row: the earlier reply
    spec = model.chat(ask(2), options=opts, cache_salt="replay")
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens >= 24


def test_a_prediction_is_drafted_and_greedy_and_seeded_replies_are_plain_decodings(
    model: Model,
) -> None:
    """OpenAI's predicted outputs on llama.cpp: a reply that copies nothing of its prompt is
    drafted from its prediction (the plain reply with a word changed, an edit the model does
    not make), greedy and seeded; each reply, and a seeded one's logprobs, are plain
    decoding's."""
    messages = [{"role": "user", "content": "Write four short lines about rain in a city."}]
    opts = GenerationOptions(max_tokens=40, temperature=0.0)
    plain = model.chat(messages, options=opts, spec_type="none", cache_salt="pred-plain")
    alone = model.chat(messages, options=opts, cache_salt="pred-alone")
    words = plain.text.split(" ")
    assert len(words) > 8, plain.text
    edited = " ".join([*words[:4], "umbrella" if words[4] != "umbrella" else "street", *words[5:]])
    spec = model.chat(messages, options=opts, prediction=edited, cache_salt="pred-spec")
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens >= alone.stats.accepted_tokens + 16
    seeded = GenerationOptions(max_tokens=32, temperature=0.8, seed=3, logprobs=2)
    plain_s = model.chat(messages, options=seeded, spec_type="none", cache_salt="pred-plain-s")
    spec_s = model.chat(messages, options=seeded, prediction=plain_s.text, cache_salt="pred-s")
    assert spec_s.completion_tokens == plain_s.completion_tokens
    assert spec_s.logprobs == plain_s.logprobs
    assert spec_s.stats.accepted_tokens > 0


def _assert_verify_rows_are_one_token_passes(
    ctx: BackendContext, prompt: list[int], follow: list[int], redo: int
) -> None:
    """After ``prompt``: each row of one pass of ``follow`` equals the one-token pass at its
    position, and so does each of ``redo`` tokens decoded one by one after a trim that keeps
    5 (as a verify pass that accepted 4 drafts would)."""
    n = len(prompt)
    ctx.prefill(0, prompt, 0)
    one = []
    for i, token in enumerate(follow):
        ctx.decode([BatchToken(token, n + i, 0, True)])
        one.append(np.frombuffer(ctx.logits(0), np.float32).copy())
    ctx.seq_rm(0, n, -1)
    ctx.decode([BatchToken(t, n + i, 0, True) for i, t in enumerate(follow)])
    rows = [np.frombuffer(ctx.logits(i), np.float32).copy() for i in range(len(follow))]
    ctx.seq_rm(0, n + 5, -1)
    for i, token in enumerate(follow[5 : 5 + redo], start=5):
        ctx.decode([BatchToken(token, n + i, 0, True)])
        rows[i] = np.frombuffer(ctx.logits(0), np.float32).copy()
    for i in range(len(follow)):
        assert np.array_equal(rows[i], one[i]), f"position {n + i} differs"


def test_a_verify_pass_row_is_a_one_token_pass(model: Model) -> None:
    """What exactness rests on (``docs/internals.md``, "Speculative decoding"): with flash
    attention, the logits of each row of a pass of up to 63 tokens of one sequence equal a
    one-token pass's at that position, and so does everything decoded after a trim."""
    bmodel = model._bmodel
    prompt = bmodel.tokenize(CODE)
    params = ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, flash_attn="on")
    ctx = bmodel.new_context(params)
    try:
        rows_max = MAX_DRAFT_TOKENS + 1  # the longest verify pass of one sequence
        follow = [prompt[i % len(prompt)] for i in range(rows_max)]
        _assert_verify_rows_are_one_token_passes(ctx, prompt, follow, redo=15)
    finally:
        ctx.close()


def test_past_512_cells_a_one_token_pass_is_not_a_verify_row(model: Model) -> None:
    """Where exactness ends (``docs/internals.md``, "Speculative decoding"): once the KV view
    holds 512 cells, a one-token pass on two threads takes llama.cpp's split-KV attention,
    which no pass of several rows takes, so a verify row's logits are no longer a one-token
    pass's. Below 512 cells they are (the test above). If this starts failing, llama.cpp
    changed the kernel and speculation may be exact again at any length: say so in the docs."""
    bmodel = model._bmodel
    params = ContextParams(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, flash_attn="on")
    ctx = bmodel.new_context(params)
    try:
        prompt = (bmodel.tokenize(CODE) * 20)[:300]  # 300 cells in use: a view of 512
        follow = [prompt[i] for i in range(3)]
        n = len(prompt)
        ctx.prefill(0, prompt, 0)
        ctx.decode([BatchToken(follow[0], n, 0, True)])
        one = np.frombuffer(ctx.logits(0), np.float32).copy()
        ctx.seq_rm(0, n, -1)
        ctx.decode([BatchToken(t, n + i, 0, True) for i, t in enumerate(follow)])
        row = np.frombuffer(ctx.logits(0), np.float32).copy()
        assert not np.array_equal(one, row)
        ctx.seq_rm(0, 200, -1)  # 200 cells: a view of 256, where the two agree again
        ctx.decode([BatchToken(follow[0], 200, 0, True)])
        one = np.frombuffer(ctx.logits(0), np.float32).copy()
        ctx.seq_rm(0, 200, -1)
        ctx.decode([BatchToken(t, 200 + i, 0, True) for i, t in enumerate(follow)])
        assert np.array_equal(one, np.frombuffer(ctx.logits(0), np.float32))
    finally:
        ctx.close()


def test_where_speculation_is_exact_is_reported(model: Model) -> None:
    """``verify_exactness`` says what the two tests above and the one below measure: f16 or
    f32 KV (f32 is cast to f16 for flash attention) on two threads is exact only while the
    view is under 512 cells; quantised or bf16 K or V, one thread, or a context too small for
    such a view never takes the split-KV kernel."""
    bmodel = model._bmodel
    base = ContextParams(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, flash_attn="on")
    within = "while the context uses at most 256 KV cells"
    assert bmodel.verify_exactness(base).startswith(within)
    assert "2 CPU threads" in bmodel.verify_exactness(base)
    assert bmodel.verify_exactness(replace(base, type_k="f32", type_v="f16")).startswith(within)
    for k, v in [("q8_0", "q8_0"), ("bf16", "bf16"), ("f16", "q8_0"), ("q4_0", "f16")]:
        assert bmodel.verify_exactness(replace(base, type_k=k, type_v=v)) == "at any length"
    assert bmodel.verify_exactness(replace(base, n_threads=1)) == "at any length"
    assert bmodel.verify_exactness(replace(base, n_ctx=256)) == "at any length"
    # Several sequences: a prefill chunk beside a draft makes a pass of 64 rows or more,
    # whose every row f16 cells attend with the tiled kernel.
    several = replace(base, n_threads=1, n_seq_max=2)
    assert bmodel.verify_exactness(several).startswith("while no pass holds 64 rows or more")
    both = bmodel.verify_exactness(replace(base, n_seq_max=2))
    assert both.startswith(within + " and no pass holds 64 rows or more")
    assert bmodel.verify_exactness(replace(base, flash_attn="off")).startswith("no:")
    # The fixture left its cells ``auto``: a model that speculates gets q8_0, exact throughout.
    info = model.info()
    assert (info.type_k, info.type_v, info.speculation_exact) == ("q8_0", "f16", "at any length")


def test_auto_kv_cells_are_the_exact_type_only_where_f16_would_not_be(model: Model) -> None:
    """``context_params`` resolves ``auto`` cells: q8_0 where the model speculates on the CPU
    with both cells of a split-KV type; f16 where it does not speculate, is deterministic (it
    then never speculates), or a cell given already leaves the split-KV and tiled kernels; a
    type given is never changed. Each result is exact at any length wherever it speculates
    exactly; a model whose ``spec_exact`` is false keeps f16."""
    bmodel = model._bmodel
    base = ContextParams(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, flash_attn="on")

    def cells(
        params: ContextParams, speculative: bool = True, det: bool = False
    ) -> tuple[str, str]:
        ran = bmodel.context_params(params, deterministic=det, speculative=speculative)
        if speculative and not det:
            assert bmodel.verify_exactness(ran) == "at any length"
        return ran.type_k, ran.type_v

    assert cells(base) == ("q8_0", "f16")
    assert cells(base, speculative=False) == ("f16", "f16")
    assert cells(base, det=True) == ("f16", "f16")
    assert cells(replace(base, n_threads=1)) == ("q8_0", "f16")  # several slots' passes
    assert cells(replace(base, type_k="f16")) == ("f16", "q8_0")
    assert cells(replace(base, type_v="f32")) == ("q8_0", "f32")
    assert cells(replace(base, type_k="bf16")) == ("bf16", "f16")
    given = replace(base, type_k="f16", type_v="f16")
    assert bmodel.context_params(given, deterministic=False, speculative=True) == given
    # Replies that need not be plain decoding's (spec_exact false): f16, as llama-server's,
    # flash attention still as a speculating model's.
    loose = bmodel.context_params(base, deterministic=False, speculative=True, exact=False)
    assert (loose.type_k, loose.type_v, loose.flash_attn) == ("f16", "f16", "on")


def test_a_model_given_f16_kv_speculates_only_if_spec_exact_is_false() -> None:
    """f16 cells given on two threads and 1,024 cells: a verify row could differ from a
    one-token pass past 256 cells, so the model does not speculate (``/v1/models`` says why and
    how to) and a copy-heavy request drafts nothing; ``spec_exact=False`` speculates there,
    saying where it is exact."""
    context = ContextParams(
        n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=2, type_k="f16", type_v="f16"
    )
    opts = GenerationOptions(max_tokens=24, temperature=0.0)
    with make_engine() as engine:
        exact = engine.load_model(
            model_id="exact", config=ModelConfig(context=context, spec_type="ngram-simple")
        )
        info = exact.info()
        assert info.speculation.startswith("off: a verify pass's rows are one-token passes' only")
        assert "type_k and type_v at auto" in info.speculation
        assert info.speculation_exact is None
        assert exact.chat(MESSAGES, options=opts).stats.drafted_tokens == 0
        loose = engine.load_model(
            model_id="loose",
            config=ModelConfig(context=context, spec_type="ngram-simple", spec_exact=False),
        )
        info = loose.info()
        assert info.speculation == "on"
        assert (info.speculation_exact or "").startswith("while the context uses at most 256")
        assert loose.chat(MESSAGES, options=opts).stats.drafted_tokens > 0


@pytest.mark.parametrize(
    ("type_k", "type_v"), [("q8_0", "q8_0"), ("bf16", "bf16"), ("f16", "q8_0"), ("q8_0", "f16")]
)
def test_past_512_cells_quantised_kv_keeps_every_verify_row_a_one_token_pass(
    model: Model, type_k: str, type_v: str
) -> None:
    """The way to exactness at any length on the CPU: KV of a type the split-KV (and the tiled)
    kernel does not take is attended row by row in every pass, so past 512 cells each row of
    the longest verify pass is still a one-token pass's logits, and so is what follows a trim."""
    bmodel = model._bmodel
    params = ContextParams(
        n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2, flash_attn="on",
        type_k=type_k, type_v=type_v,
    )  # fmt: skip
    assert bmodel.verify_exactness(params) == "at any length"
    ctx = bmodel.new_context(params)
    try:
        prompt = (bmodel.tokenize(CODE) * 20)[:300]  # 300 cells in use: a view of 512
        follow = prompt[: MAX_DRAFT_TOKENS + 1]
        _assert_verify_rows_are_one_token_passes(ctx, prompt, follow, redo=7)
    finally:
        ctx.close()


def test_greedy_reply_past_512_cells_is_plain_decodings_with_q8_0_kv() -> None:
    """End to end where f16 KV is not exact (3 of 6 such replies differed, docs/internals.md):
    a prompt of over 256 tokens, so every pass sees a view of 512 cells or more, with q8_0 KV.
    The model reports it exact at any length, and the copy is drafted and plain decoding's."""
    functions = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(14))
    messages = [{"role": "user", "content": f"Repeat this code exactly:\n\n{functions}"}]
    with generous_engine() as engine:
        config = ModelConfig(
            context=ContextParams(
                n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2, type_k="q8_0", type_v="q8_0"
            ),
            spec_type="ngram-simple",
            spec_ngram_n=3,
            spec_draft_max=32,
        )
        model = engine.load_model(config=config)
        assert model.info().speculation_exact == "at any length"
        opts = GenerationOptions(max_tokens=64, temperature=0.0)
        plain = model.chat(messages, options=opts, spec_type="none", cache_salt="plain")
        spec = model.chat(messages, options=opts, cache_salt="spec")
    assert len(plain.prompt_tokens) > 256
    assert spec.completion_tokens == plain.completion_tokens
    assert "return x * 1 + 1" in spec.text
    assert spec.stats.accepted_tokens >= 16


def empty_slots(model: Model) -> None:
    """On the worker thread: every slot's KV dropped, so the next prompts take the cells
    from the first in order."""
    for slot in model._worker.rt.slots:
        model._worker.rt.reset_seq(slot)


@contextmanager
def three_q8_0_slots(n_ctx: int) -> Iterator[Model]:
    """The embedded model in three slots of ``n_ctx`` cells each, q8_0 cells (exact at any
    length), drafting generously (a GPU's trade-off) so drafts are long and many."""
    with generous_engine() as engine:
        context = ContextParams(
            n_ctx=n_ctx, n_batch=64, n_ubatch=64, n_threads=2, type_k="q8_0", type_v="q8_0"
        )
        config = ModelConfig(
            context=context, spec_type="ngram-simple", spec_ngram_n=3, spec_draft_max=32,
            n_parallel=3,
        )  # fmt: skip
        yield engine.load_model(config=config)


@pytest.mark.slow
def test_concurrent_speculative_replies_are_plain_decodings_with_q8_0_kv() -> None:
    """Three requests at once, each slot verifying its drafts while the others decode, in a
    context whose slots already hold other requests' cells (cleared as these are seated): with
    q8_0 KV every reply and its logprobs are that request's plain reply alone, bit for bit,
    as they are for plain decoding at once (checked first). Found by specrev's review: two
    verify passes in one call left the first one's rejected cells between the slots' cells,
    the next pass put another slot's tokens there, below that slot's earlier cells, and
    attention adds cells in cell order: one reply's logprobs differed from its 17th token on."""
    texts = [
        CODE,
        '{"name": "Ada", "age": 36, "langs": ["en", "fr"], "city": "London", "job": "analyst"}',
        "The harbour light turns every night at nine, and the keeper writes it down in a book.",
    ]
    chats = [[{"role": "user", "content": f"Repeat this exactly:\n\n{text}"}] for text in texts]
    with three_q8_0_slots(1536) as model:
        opts = GenerationOptions(max_tokens=60, temperature=0.0, logprobs=0)

        def at_once(kind: str, salt: str) -> list[Completion]:
            # Every run from empty slots, admitted in one tick (the worker held until all are
            # queued): a run's company and its cells' places are then the same every time.
            gate = threading.Event()
            held = model._worker.call(lambda: (empty_slots(model), gate.wait()))
            streams = [
                model.stream_chat(chat, options=opts, spec_type=kind, cache_salt=f"{salt}{i}")
                for i, chat in enumerate(chats)
            ]
            gate.set()
            held.result()
            return [stream.result() for stream in streams]

        def by_itself(i: int, chat: list[dict[str, str]]) -> Completion:
            model._worker.call(lambda: empty_slots(model)).result()
            return model.chat(chat, options=opts, spec_type="none", cache_salt=f"alone{i}")

        # Salts keep every request cold: each prefills its prompt and decodes its reply.
        alone = [by_itself(i, chat) for i, chat in enumerate(chats)]
        plain = at_once("none", "plain")
        spec = at_once("ngram-simple", "spec")
    for one, batched, drafted in zip(alone, plain, spec, strict=True):
        assert batched.completion_tokens == one.completion_tokens
        assert batched.logprobs == one.logprobs
        assert drafted.completion_tokens == one.completion_tokens
        assert drafted.logprobs == one.logprobs
    assert sum(done.stats.accepted_tokens for done in spec) >= 40


class _Calls:
    """Records a context's ``decode`` calls (patched on the instance: the sampler takes only
    a ``LlamaContext``): how many slots each call verifies a draft of (more than one row of
    logits)."""

    def __init__(self, ctx: BackendContext) -> None:
        self._ctx, self._decode, self.verifying = ctx, ctx.decode, list[int]()

    def __enter__(self) -> _Calls:
        self._ctx.decode = self._record  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._ctx.decode  # type: ignore[attr-defined]

    def _record(self, batch: list[BatchToken]) -> None:
        rows: dict[int, int] = {}
        for t in batch:
            rows[t.seq] = rows.get(t.seq, 0) + t.logits
        self.verifying.append(sum(count > 1 for count in rows.values()))
        self._decode(batch)


@pytest.mark.slow
def test_slots_verify_together_without_spec_exact_and_keep_each_sequence_whole() -> None:
    """``spec_exact=False`` (what a GPU needs to speculate at all): three requests at once
    verify their drafts in shared calls, not a call each. Cell order is then not kept, so a
    near tie may flip, as on a GPU; what must hold is that nothing else changes: each slot's
    KV holds exactly its tokens' cells (no rejected cell left), and each reply is, token by
    token, what a cold pass over prompt and reply picks there or a near tie of it."""
    texts = [
        CODE,
        '{"name": "Ada", "age": 36, "langs": ["en", "fr"], "city": "London", "job": "analyst"}',
        "The harbour light turns every night at nine, and the keeper writes it down in a book.",
    ]
    chats = [[{"role": "user", "content": f"Repeat this exactly:\n\n{text}"}] for text in texts]
    with generous_engine() as engine:
        context = ContextParams(
            n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=2, type_k="q8_0", type_v="q8_0"
        )
        config = ModelConfig(
            context=context, spec_type="ngram-simple", spec_ngram_n=3, spec_draft_max=32,
            n_parallel=3, spec_exact=False,
        )  # fmt: skip
        model = engine.load_model(config=config)
        rt = model._worker.rt
        assert rt.cfg.verify_together
        opts = GenerationOptions(max_tokens=60, temperature=0.0)
        gate = threading.Event()
        with _Calls(rt.ctx) as calls:
            # Admitted in one tick: the worker is held until all three are queued.
            held = model._worker.call(gate.wait)
            streams = [
                model.stream_chat(chat, options=opts, cache_salt=f"t{i}")
                for i, chat in enumerate(chats)
            ]
            gate.set()
            held.result()
            done = [stream.result() for stream in streams]

        def held_cells() -> list[tuple[int, int, int]]:
            out = []
            for slot in rt.slots:
                layout = kv_layout.parse_blob(u8(rt.ctx.kv_pack(slot.seq)))
                out.append((len(slot.kv_tokens), layout.n_cells, rt.ctx.seq_pos_max(slot.seq)))
            return out

        for tokens, cells, top in model._worker.call(held_cells).result():
            assert cells == tokens and top == tokens - 1
        assert max(calls.verifying) >= 2, "no call verified two slots' drafts"
        assert all(one.stats.accepted_tokens > 0 for one in done)
        for i, one in enumerate(done):
            cold = model.complete(
                [*one.prompt_tokens, *one.completion_tokens],
                GenerationOptions(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                spec_type="none",
                cache_salt=f"cold{i}",
            )
            assert cold.prompt_logprobs is not None
            scored = cold.prompt_logprobs[len(one.prompt_tokens) - 1 :]
            for token, entry in zip(one.completion_tokens, scored, strict=False):
                assert entry.token == token
                assert entry.logprob >= entry.top[0][2] - 1.0, (i, token, entry)


@pytest.mark.slow
def test_n_choices_after_earlier_requests_are_plain_decodings_with_q8_0_kv() -> None:
    """``n = 3`` in slots that held an earlier group's choices: every choice, speculating,
    is the plain choice a fresh context gave (tokens and logprobs). Found by specrev's review:
    a fork slot's old KV was cleared only once the first choice's prompt was prefilled, so its
    cells were free below the prompt's and each choice's next tokens took them, out of
    position order; plain decoding's choices then depended on what the slots held before, and
    speculation's differed from them (8 of 9 choices over three groups)."""
    with three_q8_0_slots(1024) as model:
        for opts in (
            GenerationOptions(max_tokens=40, temperature=0.0, logprobs=1),
            GenerationOptions(max_tokens=40, temperature=0.7, seed=3, logprobs=1),
        ):
            fresh = [  # the first group of each: new salts, so every group prefills cold
                s.result()
                for s in model.chat_streams(
                    MESSAGES, n=3, options=opts, spec_type="none", cache_salt=f"a{opts.seed}"
                )
            ]
            spec = [
                s.result()
                for s in model.chat_streams(MESSAGES, n=3, options=opts, cache_salt=f"b{opts.seed}")
            ]
            for plain, drafted in zip(fresh, spec, strict=True):
                assert drafted.completion_tokens == plain.completion_tokens
                assert drafted.logprobs == plain.logprobs
            assert all(done.stats.accepted_tokens > 0 for done in spec)


def test_gemma_3_is_not_exact_and_does_not_speculate(
    gemma_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 270M's Q4_K and Q6_K weights take llama.cpp's tiled kernel in passes of 8 rows
    or more and ``vec_dot`` in one-token passes (on x86, while ``GGML_CPU_TILED_MM`` is not
    0: here the user's 1, which kvwarm keeps), so its verify rows differ from one-token passes
    at any length and whatever the KV cells (14-16 of 16 rows at 100 and 300 cells): the
    model does not speculate and says why; ``spec_exact=False`` speculates (only inside its
    window), and says it is not exact."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")
    if not model_file.tiled_kernel_on():
        pytest.skip("the tiled kernel is an x86 kernel")
    context = ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2)
    with make_engine() as engine:
        config = ModelConfig(context=context, spec_type="ngram-simple", chat_template="gemma")
        model = engine.load_model(gemma_path, config=config)
        info = model.info()
        assert info.speculation.startswith("off: a verify pass's rows differ from one-token")
        assert "tiled kernel" in info.speculation
        assert info.speculation_exact is None
        loose = engine.load_model(
            gemma_path, model_id="loose", config=replace(config, spec_exact=False)
        )
        info = loose.info()
        assert "512-token sliding window" in info.speculation
        assert (info.speculation_exact or "").startswith("no: ")


#: The copy both Gemma 3 child scripts below decode: a function to give back renamed.
GEMMA_COPY = r"""source = (
    "def merge(left, right):\n"
    "    result = []\n"
    "    while left and right:\n"
    "        result.append(left.pop(0) if left[0] <= right[0] else right.pop(0))\n"
    "    return result + left + right\n"
)
prompt = "Original:\n\n" + source + "\nThe same function, renamed to join:\n\ndef join("
opts = GenerationOptions(max_tokens=40, temperature=0.0)
"""
GEMMA_UNTILED = r"""
import sys
from kvwarm.backends.base import ContextParams
from kvwarm.engine.api import ModelConfig, untile_at_start
from kvwarm.engine.types import GenerationOptions
from tests.engine.conftest import make_engine
{GEMMA_COPY}context = ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2)
config = ModelConfig(context=context, spec_type="ngram-simple")
if sys.argv[2] == "start":  # what kvwarm serve does before its threads start
    untile_at_start([(sys.argv[1], config)])
with make_engine() as engine:
    model = engine.load_model(sys.argv[1], config=config)
    print("EXACT", model.info().speculation_exact)
    keyed = model.namespace().ctx_hash == model.config.context.kv_hash("untiled,unrepacked")
    print("KEYED", keyed)
    plain = model.complete(prompt, opts, spec_type="none")
    spec = model.complete(prompt, opts, cache_salt="again")
    print("SAME", spec.completion_tokens == plain.completion_tokens)
    print("ACCEPTED", spec.stats.accepted_tokens)
""".replace("{GEMMA_COPY}", GEMMA_COPY)


@pytest.mark.parametrize(("tiled", "start"), [("0", "no"), (None, "start")])
def test_gemma_3_speculates_exactly_with_the_tiled_kernel_off(
    gemma_path: str, tiled: str | None, start: str
) -> None:
    """With ``GGML_CPU_TILED_MM=0`` in its environment, or unset in a process that decided
    its kernels at its start, before its engine's threads (``untile_at_start``, as ``kvwarm
    serve`` does, which turns the kernel off for a speculating K-quant model; a child
    process, since ggml reads the variable once), Gemma 3 270M's only other kernel change is
    repacking its Q4_K weights, which a speculating model gives up
    (``ModelParams.exact_rows``): it speculates exactly at any length (inside its window),
    and a greedy reply that copies is plain decoding's, drafts accepted; both kernel changes
    are hashed into its cache keys (``BackendModel.kernels``)."""
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    if tiled is not None:
        env["GGML_CPU_TILED_MM"] = tiled
    done, lines = run_child(
        GEMMA_UNTILED, gemma_path, start, prefixes=("EXACT", "KEYED", "SAME", "ACCEPTED"), env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(line.split(maxsplit=1) for line in lines)
    assert (said.get("EXACT"), said.get("SAME")) == ("at any length", "True"), said
    assert said["KEYED"] == "True"  # rows of other kernels are never restored as its own
    assert int(said["ACCEPTED"]) > 0


@pytest.fixture(scope="module")
def tiny_swa(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Gemma 3 with a 32-token window, its weights Q4_1 (no tinyBLAS
    kernel for several rows): a sliding-window model whose verify rows are exact."""
    from tests.tinymodels import gemma3_keys, write_tiny_model

    path = tmp_path_factory.mktemp("swa") / "gemma3-swa32.gguf"
    return str(write_tiny_model(path, "gemma3", keys=gemma3_keys(32), ftype=3))  # Q4_1


def test_sliding_window_model_speculates_inside_its_window_exactly(tiny_swa: str) -> None:
    """A sliding-window model whose drafts come from its own cached reply to the same prompt
    (a random-weight model copies nothing, and a draft model must roll back): drafts are
    verified while a pass stays inside the 32-token window and the model decodes plainly
    past it; the reply crosses the window and is plain decoding's throughout."""
    opts = GenerationOptions(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompt = [(7 * i) % 100 + 3 for i in range(12)]
    with generous_engine() as engine:
        config = ModelConfig(
            context=ContextParams(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2),
            spec_type="ngram-simple",
            spec_draft_max=8,
        )
        model = engine.load_model(tiny_swa, config=config)
        info = model.info()
        assert "32-token sliding window" in info.speculation
        assert info.speculation_exact == "at any length"
        plain = model.complete(prompt, opts, spec_type="none")
        assert engine.cache.flush()  # its row, whose reply the next request drafts from
        spec = model.complete(prompt, opts)
    assert len(prompt) < 32 < len(prompt) + len(plain.completion_tokens)
    assert spec.completion_tokens == plain.completion_tokens
    assert 0 < spec.stats.accepted_tokens <= 32 - len(prompt)  # drafts only inside the window


def _window_after_verify(path: str, how: str, n_ubatch: int = 128) -> int:
    """The verifying sequence's lowest SWA position once a 9-row verify pass (positions
    100..108, all but its first row rejected) is rolled back, in a unified full-size window
    (32 tokens) whose head crawls over that sequence's masked cells: another sequence refilled
    a cleared one's hole and went on past it, as a slot seated after another's reply does.
    ``how``: "after" (another sequence's pass once the rollback is done: kvwarm's order),
    "before" (that pass between verify and rollback), "split" (the pass shares the verify's
    call ahead of its rows, over ubatches of ``n_ubatch``)."""
    from kvwarm.backends.llama.model import LlamaBackend

    bmodel = LlamaBackend().load_model(path)
    params = ContextParams(
        n_ctx=512, n_batch=128, n_ubatch=n_ubatch, n_seq_max=3, n_threads=1,
        flash_attn="on", swa_full=True,
    )  # fmt: skip
    ctx = bmodel.new_context(params)
    try:
        a, b, c = 0, 1, 2
        toks = [(7 * i) % 100 + 3 for i in range(300)]
        ctx.prefill(c, toks[:100], 0)  # cells 0..99
        ctx.prefill(a, toks[:100], 0)  # cells 100..199
        ctx.prefill(b, toks[:40], 0)  # cells 200..239
        ctx.seq_rm(c, 0, -1)
        for i in range(40, 200):  # the hole, then A's masked cells up to its position 59
            ctx.decode([BatchToken(toks[i], i, b, True)])
        verify = [BatchToken(toks[100 + j], 100 + j, a, True) for j in range(9)]
        other = [BatchToken(toks[200 + j], 200 + j, b, j == 7) for j in range(8)]
        ctx.decode(other[:5] + verify if how == "split" else verify)
        if how == "before":
            ctx.decode(other)
        ctx.seq_rm(a, 101, -1)
        if how == "after":
            ctx.decode(other)
        assert ctx.seq_pos_max(a) == 100
        return ctx.seq_pos_min(a)
    finally:
        ctx.close()
        bmodel.close()


def test_a_verify_pass_keeps_its_window_only_as_kvwarm_orders_it(tiny_swa: str) -> None:
    """What speculation in a full-size window rests on (``docs/internals.md``, "Speculative
    decoding"): llama.cpp's ``find_slot`` frees a cell masked by its sequence's *current* last
    position, so while a verify pass's draft is held its earlier cells look free. Another
    sequence's tokens placed then, or the pass's own later ubatch, take cells the window
    needs once the rejected draft is removed (llama.cpp then drops the sequence's positions
    up to them: ``seq_pos_min`` rises, nobody's KV is attended in their place). kvwarm rolls
    back right after the call whose last rows are the pass, before any other call, and keeps
    a pass within one ubatch (``Tick._run_call``): the window is whole, position 101 needs
    ``[69, 101)``. If "before" or "split" starts keeping it too, llama.cpp changed."""
    assert _window_after_verify(tiny_swa, "after") <= 101 - 32
    assert _window_after_verify(tiny_swa, "split", n_ubatch=128) <= 101 - 32
    assert _window_after_verify(tiny_swa, "before") > 101 - 32
    assert _window_after_verify(tiny_swa, "split", n_ubatch=8) > 101 - 32


@pytest.mark.parametrize("other_rows", [1, 5])
def test_a_verify_pass_split_in_its_own_stream_keeps_its_window(
    tiny_swa: str, other_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-sequence streams (``kv_unified`` false): llama.cpp splits a call over its
    sequences in equal parts (``split_equal``, consecutive sequence ids), so a 9-row verify
    pass of sequence 1 beside sequence 0's decode row or 5-token chunk is split, its later
    rows placed while the earlier ones are held (``find_slot`` logs sequence 1 holding up to
    position 100 or 104). In a stream of its own that takes no cell the window needs: the
    stream holds this sequence alone, its cells in position order from cell 0 and never more
    positions than cells, so the later part meets empty cells past the head (here after an
    earlier, longer reply was trimmed back and with the other sequence decoding before the
    rollback). The window stays whole and the next logits are a fresh context's (a cell
    lost in a unified buffer: 0.78). kvwarm sends no verify pass to such a context at all
    (``test_per_sequence_streams_never_hold_a_verify_pass``); if that changes, this is why
    ``Tick._splits_verify`` may keep guarding the unified buffer alone."""
    import re

    from kvwarm.backends.llama import native
    from kvwarm.backends.llama.model import LlamaBackend

    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "1")  # find_slot logs each placement
    bmodel = LlamaBackend().load_model(tiny_swa)
    params = ContextParams(
        n_ctx=768, n_batch=128, n_ubatch=128, n_seq_max=3, n_threads=1, flash_attn="on",
        swa_full=True, kv_unified=False,
    )  # fmt: skip
    toks = [(7 * i) % 100 + 3 for i in range(300)]
    b, a = 0, 1
    ctx = bmodel.new_context(params)
    fresh = bmodel.new_context(replace(params, n_ctx=256, n_seq_max=1))
    try:
        ctx.prefill(a, toks[:150], 0)
        ctx.seq_rm(a, 100, -1)  # an earlier, longer reply trimmed back
        ctx.prefill(b, toks[:40], 0)
        verify = [BatchToken(toks[100 + j], 100 + j, a, True) for j in range(9)]
        other = [BatchToken(toks[200 + j], 40 + j, b, True) for j in range(other_rows)]
        with native.captured_log() as lines:
            ctx.decode(other + verify)
        held = re.findall(r"stream\[1\] min\[1\] = +\d+, max\[1\] = +(\d+)", "".join(lines))
        assert str(99 + other_rows) in held, held  # the pass's later part placed on its own
        ctx.decode([BatchToken(toks[250], 40 + other_rows, b, True)])
        ctx.seq_rm(a, 101, -1)
        assert (ctx.seq_pos_min(a), ctx.seq_pos_max(a)) == (0, 100)
        ctx.decode([BatchToken(toks[101], 101, a, True)])
        got = np.frombuffer(ctx.logits(-1), dtype=np.float32).copy()
        fresh.prefill(0, toks[:102], 0)
        want = np.frombuffer(fresh.logits(-1), dtype=np.float32)
        assert float(np.max(np.abs(got - want))) < 0.01
    finally:
        fresh.close()
        ctx.close()
        bmodel.close()


@pytest.mark.slow
def test_f32_and_f16_adapters_requests_decode_plainly_and_a_q8_0_adapters_speculate(
    tmp_path: Path,
) -> None:
    """LoRA products take kernels by a pass's rows too: an f32 or f16 adapter's are tinyBLAS's
    for several rows and ``vec_dot``'s for one (up to 11 of 11 probe rows differed on SmolLM2,
    and how many depended on the KV cells: differences too small to survive a cell's rounding
    vanish, so no probe can clear such an adapter). Each adapter's tensor types are read as it
    loads: a request under an f32 or f16 one decodes plainly; under a Q8_0 one it speculates,
    and its reply is plain decoding's."""
    from tests.backends.lora_fixture import make_lora

    import kvwarm.embedded

    base = str(kvwarm.embedded.default_model_path())
    adapters = {
        "f32": make_lora(base, tmp_path / "f32.gguf", scale_hint=0.5),
        "f16": make_lora(base, tmp_path / "f16.gguf", scale_hint=0.5, f16=True),
        "q8_0": make_lora(base, tmp_path / "q8.gguf", scale_hint=0.5, q8_0=True, rank=32),
    }
    with generous_engine() as engine:
        config = ModelConfig(
            context=ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2),
            spec_type="ngram-simple",
            spec_ngram_n=3,
        )
        model = engine.load_model(config=config)
        handles = {
            name: model.load_adapter(path, scale=0.0).handle for name, path in adapters.items()
        }
        opts = GenerationOptions(max_tokens=32, temperature=0.0)
        replies = {}
        for name, handle in handles.items():
            under = replace(opts, lora=((handle, 0.2),))  # the model still copies
            plain = model.chat(MESSAGES, options=under, spec_type="none", cache_salt=name)
            spec = model.chat(MESSAGES, options=under, cache_salt=name + "-spec")
            assert spec.completion_tokens == plain.completion_tokens
            replies[name] = spec
    assert replies["f32"].stats.drafted_tokens == replies["f16"].stats.drafted_tokens == 0
    assert replies["q8_0"].stats.accepted_tokens > 0


# ---- a draft model (--draft-model) -----------------------------------------------------------


@pytest.fixture(scope="module")
def drafted() -> Iterator[Model]:
    """SmolLM2 drafting for itself: the same vocabulary, so its drafts are mostly accepted
    (its passes priced at nothing: at their cost, no draft pays)."""
    import kvwarm.embedded
    from kvwarm.engine.worker.drafts import DraftCost

    path = str(kvwarm.embedded.default_model_path())
    with make_engine() as engine, pytest.MonkeyPatch.context() as patch:
        patch.setattr(DraftCost, "per_token", lambda self, plain: 0.0)
        config = ModelConfig(
            context=ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2),
            draft_model=path,
            spec_draft_max=8,
        )
        yield engine.load_model(path, config=config)


def test_draft_model_greedy_reply_is_plain_decodings(drafted: Model) -> None:
    info = drafted.info()
    assert info.spec_type == "draft-simple" and info.draft_model is not None
    opts = GenerationOptions(max_tokens=40, temperature=0.0)
    plain = drafted.chat(MESSAGES, options=opts, spec_type="none", cache_salt="plain")
    spec = drafted.chat(MESSAGES, options=opts, cache_salt="draft")
    assert spec.completion_tokens == plain.completion_tokens
    assert spec.stats.accepted_tokens >= 10  # the draft model is the model: it guesses well


def test_draft_model_prompt_kv_is_restored_from_the_cache(drafted: Model) -> None:
    """The draft context's prompt KV is saved under the draft model's own namespace, and a
    later request's first draft restores it instead of prefilling the prompt again."""
    draft = drafted._draft
    assert draft is not None
    opts = GenerationOptions(max_tokens=8, temperature=0.0)
    messages = [{"role": "user", "content": f"Repeat this code, please:\n\n{CODE}"}]
    first = drafted.chat(messages, options=opts, cache_salt="restore")
    drafted._worker.call(lambda: draft.reset(0)).result()  # the draft context forgets it
    assert drafted._engine.cache.flush()
    prefilled, restored = draft.prefilled_tokens, draft.restored_tokens
    again = drafted.chat(messages, options=opts, cache_salt="restore")
    assert again.completion_tokens == first.completion_tokens
    assert draft.restored_tokens - restored >= len(first.prompt_tokens) - 1
    assert draft.prefilled_tokens - prefilled <= 1
    # Another tenant's salt is another draft namespace: nothing of it is restored.
    drafted._worker.call(lambda: draft.reset(0)).result()
    restored = draft.restored_tokens
    drafted.chat(messages, options=opts, cache_salt="someone else")
    assert draft.restored_tokens == restored


def test_a_draft_model_of_another_vocabulary_is_refused(tmp_path: Path) -> None:
    from tests.tinymodels import write_tiny_model

    other = write_tiny_model(tmp_path / "mamba.gguf", "mamba")  # 128 tokens
    config = ModelConfig(
        context=ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_threads=2),
        draft_model=str(other),
    )
    with make_engine() as engine, pytest.raises(ConfigError, match="vocabulary"):
        engine.load_model(config=config)


GEMMA_DRAFTS_FOR_ITSELF = r"""
import sys
from dataclasses import replace
from kvwarm.backends.base import ContextParams
from kvwarm.engine.api import ModelConfig
from kvwarm.engine.types import GenerationOptions
from kvwarm.engine.worker.draftmodel import DraftModel
from tests.engine.conftest import make_engine
{FREE_DRAFT_PASSES}
{GEMMA_COPY}# 2048 cells: more than the window's cache would hold without swa_full (512 + a batch).
context = ContextParams(n_ctx=2048, n_batch=64, n_ubatch=64, n_threads=2)
config = ModelConfig(context=context, draft_model=sys.argv[1], spec_draft_max=8)

class NoRows:
    def draft_prefix(self, ns, tokens, min_shared): return None
    def draft_whole_rows(self, ns, tokens): return []
    def draft_restored(self): pass
    def save_draft(self, *args): pass

with make_engine() as engine:
    model = engine.load_model(sys.argv[1], config=config)
    draft = model._draft
    print("EXACT", model.info().speculation_exact)
    print("SWAFULL", draft.ctx.memory.swa_full, model._worker.rt.ctx.memory.swa_full)
    windowed = draft.model.new_context(replace(draft.ctx.params, swa_full=False))
    kv = draft.ctx.memory_bytes.kv_bytes
    print("KV", kv > windowed.memory_bytes.kv_bytes,
          model.info().kv_bytes >= kv + model._ctx.memory_bytes.kv_bytes)
    windowed.close()
    plain = model.complete(prompt, opts, spec_type="none", cache_salt="plain")
    spec = model.complete(prompt, opts, cache_salt="draft")
    print("SAME", spec.completion_tokens == plain.completion_tokens)
    print("ACCEPTED", spec.stats.accepted_tokens, spec.stats.drafted_tokens)
    # The live sequence, its drafts rolled back (seq_rm), drafts what a fresh context drafts.
    text = [*spec.prompt_tokens, *spec.completion_tokens[:12]]
    n = len(spec.prompt_tokens)
    ns = draft.namespace_for(b"draft")  # the request's: its live KV is reused
    held = len(draft.held[0])
    def both():
        live = draft.propose(NoRows(), 0, ns, text, n, 8)
        fresh = DraftModel(draft.model, draft.model.new_context(draft.ctx.params), draft.namespace,
                           n_seq=1, quant_bits=16, path="fresh", n_ctx_slot=draft.n_ctx_slot)
        for _ in range(10):
            again = fresh.propose(NoRows(), 0, draft.namespace, text, n, 8)
            if len(fresh.held[0]) >= len(text):
                break
        fresh.ctx.close()
        return live, again
    live, again = model._worker.call(both).result()
    print("PROPOSE", live == again and len(live) > 0, held > len(text), live, again)
    # Its prompt's KV, saved in its own namespace, restored by the next request's first draft.
    model._worker.call(lambda: draft.reset(0)).result()
    assert engine.cache.flush()
    restored = draft.restored_tokens
    model.complete(prompt, opts, cache_salt="draft")
    print("RESTORED", draft.restored_tokens - restored >= len(spec.prompt_tokens) - 1)
""".replace("{GEMMA_COPY}", GEMMA_COPY).replace("{FREE_DRAFT_PASSES}", FREE_DRAFT_PASSES)


@pytest.mark.slow
def test_gemma_3_drafts_for_itself_with_a_full_size_window(gemma_path: str) -> None:
    """Gemma 3 270M, a sliding-window model (a standard draft model for larger Gemma 3), as
    its own draft model: its draft context gets a full-size SWA cache (the model's own context
    does not; the extra memory is in the model's ``kv_bytes``), rejected drafts roll back
    (its next draft is a fresh context's), the greedy reply is plain decoding's with drafts
    accepted, and its prompt KV is restored from its own namespace. Found on main: refused
    ("its swa(512) memory cannot roll a rejected draft back"). A child process with the tiled
    kernel off, so that Gemma's verify rows are exact (see the test above)."""
    env = {**os.environ, "GGML_CPU_TILED_MM": "0"}
    done, lines = run_child(
        GEMMA_DRAFTS_FOR_ITSELF,
        gemma_path,
        prefixes=("EXACT", "SWAFULL", "KV", "SAME", "ACCEPTED", "PROPOSE", "RESTORED"),
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(line.split(maxsplit=1) for line in lines)
    assert said["EXACT"] == "at any length", said
    assert said["SWAFULL"] == "True False" and said["KV"] == "True True", said
    assert said["PROPOSE"].startswith("True True"), said  # it held more: rolled back
    assert (said["SAME"], said["RESTORED"]) == ("True", "True"), said
    accepted, drafted = map(int, said["ACCEPTED"].split())
    assert accepted >= 10 and drafted >= accepted, said


def test_a_speculating_models_pass_cost_prices_its_row_tiles() -> None:
    """The worker's ``PassCost`` starts from the loaded model's row tiles
    (``ModelFacts.pass_tile``: SmolLM2's tied Q8_0 output, multiplied by tinyBLAS 4 rows at
    a time on AVX-512) and their step (the share of the weight bytes read once more)."""
    with make_engine() as engine:
        model = engine.load_model(
            config=ModelConfig(
                context=ContextParams(n_ctx=256, n_threads=2), spec_type="ngram-simple"
            )
        )
        facts = model._worker.rt.model.facts  # type: ignore[attr-defined]
        # Its fit, not its ``cost`` property: this module's ``generous_engine`` patches that.
        cost = model._worker.rt.pass_cost._estimate()  # type: ignore[attr-defined]
        assert (cost.tile, cost.step) == (facts.pass_tile, facts.pass_tile_share)
        if facts.pass_tile > 1:  # an x86 build with llamafile
            assert 0.25 < cost.step < 0.4 and cost.of(7) < cost.of(6) + cost.per_token
