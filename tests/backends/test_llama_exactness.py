"""Real-model guarantees of the llama.cpp backend (embedded SmolLM2-135M, short prompts).

The central one (``kvwarm.alignment``): a restore truncated to an n_batch-aligned boundary,
followed by a prefill of the rest, reproduces a cold prefill's logits bit for bit.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvwarm.backends.base import (
    BackendContext,
    BatchToken,
    ContextParams,
    ModelParams,
    SamplingParams,
    json_schema_to_grammar,
)
from kvwarm.backends.llama import LlamaBackend, LlamaModel
from kvwarm.embedded import default_model_path
from kvwarm.errors import BackendError, ModelLoadError, ModelNotFoundError, StateRestoreError

pytestmark = pytest.mark.model

# 64, not smaller: on this build batches of <= 32 rows happen to give row-identical logits
# whatever the split, which would make the alignment tests unable to fail.
N_BATCH = 64
PARAMS = ContextParams(n_ctx=256, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=2)
PROMPT = (
    "In a small village by the sea, the fishermen woke before dawn. They mended nets, "
    "sang old songs and argued about the weather, the price of fish and the mayor's dog. "
    "By noon the boats were out past the lighthouse, and the children ran along the harbour "
    "wall counting sails, shouting names, and guessing who would bring home the biggest catch. "
    "In the evening the whole village gathered in the square, where lanterns hung from the "
    "old chestnut tree, a fiddler played until his strings frayed, and the baker handed out "
    "warm bread to anyone who could tell a story the others had never heard before that night. "
    "Nobody went home early."
)


@pytest.fixture(scope="module")
def llama() -> Iterator[LlamaModel]:
    model = LlamaBackend().load_model(str(default_model_path()))
    yield model
    model.close()


@pytest.fixture(scope="module")
def tokens(llama: LlamaModel) -> list[int]:
    toks = llama.tokenize(PROMPT)
    assert 2 * N_BATCH < len(toks) < 3 * N_BATCH + 20, len(toks)
    return toks


@pytest.fixture
def lctx(llama: LlamaModel) -> Iterator[BackendContext]:
    context = llama.new_context(PARAMS)
    yield context
    context.close()


def _greedy(llama: LlamaModel, ctx: BackendContext, pos: int, n: int = 8) -> list[int]:
    sampler = llama.new_sampler(SamplingParams(temperature=0))
    out = []
    try:
        for _ in range(n):
            token = sampler.sample(ctx, -1)
            out.append(token)
            ctx.decode([BatchToken(token, pos, 0, logits=True)])
            pos += 1
    finally:
        sampler.close()
    return out


def _cold(llama: LlamaModel, ctx: BackendContext, tokens: list[int]) -> tuple[bytes, list[int]]:
    ctx.clear()
    ctx.prefill(0, tokens, 0)
    logits = bytes(ctx.logits())
    return logits, _greedy(llama, ctx, len(tokens))


def test_facts_of_embedded_model(llama: LlamaModel) -> None:
    facts = llama.facts
    assert (facts.n_vocab, facts.n_layer, facts.n_embd) == (49152, 30, 576)
    assert facts.file_type == 3 and facts.quant_bits == 4  # Q4_1
    assert facts.metadata["general.architecture"] == "llama"
    assert facts.chat_template and "<|im_start|>" in facts.chat_template


def test_aligned_restore_is_bit_identical(
    llama: LlamaModel, lctx: BackendContext, tokens: list[int]
) -> None:
    cold_logits, cold_greedy = _cold(llama, lctx, tokens)
    boundary = 2 * N_BATCH
    lctx.clear()
    lctx.prefill(0, tokens[:boundary], 0)
    blob = lctx.kv_pack(0)
    lctx.clear()
    assert lctx.kv_unpack(0, blob) == boundary
    lctx.prefill(0, tokens[boundary:], boundary)
    assert bytes(lctx.logits()) == cold_logits
    assert _greedy(llama, lctx, len(tokens)) == cold_greedy


def test_longer_row_trimmed_to_boundary_is_bit_identical(
    llama: LlamaModel, lctx: BackendContext, tokens: list[int]
) -> None:
    cold_logits, cold_greedy = _cold(llama, lctx, tokens)
    blob = lctx.kv_pack(0)  # prompt + 8 generated tokens: longer than what we reuse
    boundary = N_BATCH
    lctx.clear()
    lctx.kv_unpack(0, memoryview(blob))
    lctx.seq_rm(0, boundary, -1)
    assert lctx.seq_pos_max(0) == boundary - 1
    lctx.prefill(0, tokens[boundary:], boundary)
    assert bytes(lctx.logits()) == cold_logits
    assert _greedy(llama, lctx, len(tokens)) == cold_greedy


def test_unaligned_restore_is_not_identical(
    llama: LlamaModel, lctx: BackendContext, tokens: list[int]
) -> None:
    # The control that shows the two tests above can fail: restoring at a boundary that is not
    # a multiple of n_batch makes the following chunk a batch shape the cold run never used.
    cold_logits, _ = _cold(llama, lctx, tokens)
    lctx.clear()
    lctx.prefill(0, tokens[:20], 0)
    blob = lctx.kv_pack(0)
    lctx.clear()
    lctx.kv_unpack(0, blob)
    lctx.prefill(0, tokens[20:], 20)
    assert bytes(lctx.logits()) != cold_logits


def test_prefill_chunks_fall_on_absolute_multiples(
    llama: LlamaModel, lctx: BackendContext, tokens: list[int]
) -> None:
    # Start mid-chunk: the first chunk must end at the next multiple of n_batch, so this run
    # and a cold run decode identical batches from there on.
    cold_logits, _ = _cold(llama, lctx, tokens)
    lctx.clear()
    lctx.prefill(0, tokens[:N_BATCH], 0)
    lctx.prefill(0, tokens[N_BATCH : N_BATCH + 5], N_BATCH)
    lctx.seq_rm(0, N_BATCH, -1)  # drop the odd-shaped chunk again
    lctx.prefill(0, tokens[N_BATCH:], N_BATCH)
    assert bytes(lctx.logits()) == cold_logits


def test_seeded_sampling_reproducible(llama: LlamaModel, lctx: BackendContext) -> None:
    prompt = llama.tokenize("Once upon a time")

    def run(seed: int) -> list[int]:
        lctx.clear()
        lctx.prefill(0, prompt, 0)
        sampler = llama.new_sampler(SamplingParams(temperature=1.0, seed=seed))
        out, pos = [], len(prompt)
        try:
            for _ in range(12):
                token = sampler.sample(lctx, -1)
                out.append(token)
                lctx.decode([BatchToken(token, pos, 0, logits=True)])
                pos += 1
        finally:
            sampler.close()
        return out

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_json_schema_grammar_completion_parses(llama: LlamaModel, lctx: BackendContext) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    prompt = llama.tokenize("Give a person as JSON: ")
    lctx.prefill(0, prompt, 0)
    sampler = llama.new_sampler(
        SamplingParams(temperature=0.0, grammar=json_schema_to_grammar(schema))
    )
    out, pos = [], len(prompt)
    try:
        for _ in range(60):
            token = sampler.sample(lctx, -1)
            if llama.is_eog(token):
                break
            out.append(token)
            lctx.decode([BatchToken(token, pos, 0, logits=True)])
            pos += 1
        else:
            pytest.fail(f"no end of generation; got {llama.detokenize(out)!r}")
    finally:
        sampler.close()
    doc = json.loads(llama.detokenize(out))
    assert isinstance(doc["name"], str) and isinstance(doc["age"], int)


def test_embedded_chat_template(llama: LlamaModel) -> None:
    text = llama.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_progress_callback_called_and_can_cancel() -> None:
    seen: list[float] = []

    def progress(fraction: float) -> bool:
        seen.append(fraction)
        return True

    model = LlamaBackend().load_model(str(default_model_path()), ModelParams(progress=progress))
    model.close()
    assert seen and seen[-1] == pytest.approx(1.0)
    with pytest.raises(ModelLoadError):
        LlamaBackend().load_model(str(default_model_path()), ModelParams(progress=lambda f: False))


def test_vocab_only_model_tokenizes_but_has_no_context() -> None:
    model = LlamaBackend().load_model(str(default_model_path()), ModelParams(vocab_only=True))
    try:
        assert model.detokenize(model.tokenize("hello world")) == "hello world"
        with pytest.raises(ModelLoadError):
            model.new_context(PARAMS)
    finally:
        model.close()


def test_native_log_lines_reach_python_logging(
    llama: LlamaModel, lctx: BackendContext, caplog: pytest.LogCaptureFixture
) -> None:
    toks = llama.tokenize("log lines")
    lctx.prefill(0, toks, 0)
    blob = bytearray(lctx.kv_pack(0))
    # Layer 0's K type (after the cells, v_trans and n_layer) made f32: llama.cpp logs why
    # it refuses it (the cells themselves pass kvwarm's checks and reach llama.cpp).
    struct.pack_into("<i", blob, 16 + 12 * len(toks) + 8, 0)
    with (
        caplog.at_level(logging.WARNING, logger="kvwarm.llama_cpp"),
        pytest.raises(StateRestoreError),
    ):
        lctx.kv_unpack(0, bytes(blob))
    assert any(r.name == "kvwarm.llama_cpp" for r in caplog.records)


def test_logits_are_zero_copy(llama: LlamaModel, lctx: BackendContext) -> None:
    lctx.prefill(0, llama.tokenize("zero copy"), 0)
    a = np.frombuffer(lctx.logits(), dtype=np.float32)
    b = np.frombuffer(lctx.logits(), dtype=np.float32)
    assert a.ctypes.data == b.ctypes.data  # both views point into llama.cpp's buffer


def test_missing_model_file_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        LlamaBackend().load_model(str(tmp_path / "absent.gguf"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(1024))
    with pytest.raises(ModelLoadError):
        LlamaBackend().load_model(str(garbage))


def test_greedy_fast_path_picks_what_the_native_chain_picks(
    llama: LlamaModel, lctx: BackendContext, tokens: list[int]
) -> None:
    from kvwarm.backends.llama.context import LlamaContext
    from kvwarm.backends.llama.sampler import LlamaSampler

    assert isinstance(lctx, LlamaContext)
    eog = tuple(t for t in range(llama.facts.n_vocab) if llama.is_eog(t))
    # Penalising the prompt's own tokens hits the branch where the maximum is itself biased.
    penalised = tuple((t, -5.0) for t in sorted(set(tokens[1:24])))
    for bias in ((), tuple((t, float("-inf")) for t in eog), ((tokens[3], 30.0),), penalised):
        params = SamplingParams(temperature=0.0, logit_bias=bias)
        fast = llama.new_sampler(params)
        assert isinstance(fast, LlamaSampler) and fast._argmax_only
        lctx.clear()
        for pos, tok in enumerate(tokens[:24]):
            lctx.decode([BatchToken(tok, pos, 0, True)])
            # The native chain (same biases, greedy) on the same logits row, read live and as
            # a row's stored logits (an exact hit samples those).
            expected = lctx.sample_with(fast._chain, 0)
            assert fast.sample(lctx, 0) == expected
            assert fast.sample_logits(bytes(lctx.logits(0))) == expected
        fast.close()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias=((5, 2.0), (6, -1.0))),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=0, repeat_penalty=1.2),
        SamplingParams(temperature=0.8, seed=3, grammar='root ::= "yes" | "no"'),
    ],
    ids=["greedy", "greedy-biased", "sampled", "greedy-penalised", "grammar"],
)
@pytest.mark.parametrize("where", ["low", "last"])
def test_one_nan_logit_fails_every_sampler(
    llama: LlamaModel, lctx: BackendContext, tokens: list[int], params: SamplingParams, where: str
) -> None:
    """One NaN anywhere in a row (not only where the maximum is, and not only a row all NaN
    as an overflowing adapter makes) is found by each sampler's one pass over it (plain
    greedy: its argmax, which numpy points at the first NaN; the others: a max): the sample
    fails with ``BackendError``, from the context's row and from stored logits alike, and a
    verify pass's batched argmax marks that row (-1) and only that one."""
    lctx.prefill(0, tokens[:12], 0)
    lctx.decode([BatchToken(t, 12 + i, 0, logits=True) for i, t in enumerate(tokens[12:15])])
    row = np.frombuffer(lctx.logits(1), dtype=np.float32)
    assert row.flags.writeable  # llama.cpp's own buffer, poked here as an overflow would
    at = int(row.argmin()) if where == "low" else row.size - 1
    row[at] = np.nan
    sampler = llama.new_sampler(params)
    try:
        with pytest.raises(BackendError, match="NaN logits"):
            sampler.sample(lctx, 1)
        with pytest.raises(BackendError, match="NaN logits"):
            sampler.sample_logits(row.tobytes())
        rows = sampler.argmax_rows(lctx, 0, 3)
        if rows is not None:
            assert rows[1] == -1 and rows[0] >= 0 and rows[2] >= 0
            assert [rows[0], rows[2]] == [sampler.sample(lctx, 0), sampler.sample(lctx, 2)]
    finally:
        sampler.close()


@pytest.mark.parametrize("banned", ["first", "second"])
def test_a_banned_token_stays_banned_where_its_logit_is_infinite(
    llama: LlamaModel, lctx: BackendContext, tokens: list[int], banned: str
) -> None:
    """A bias of -inf bans a token (``ignore_eos`` bans the end-of-generation ones that way).
    Where the model's logit for it is +inf too (an overflow short of NaN), their sum is NaN,
    and an argmax lands on it: plain greedy, row by row (``sample``, ``sample_logits``) and
    a verify pass's rows at once (``argmax_rows``), must all pick the other +inf token."""
    lctx.prefill(0, tokens[:12], 0)
    lctx.decode([BatchToken(t, 12 + i, 0, logits=True) for i, t in enumerate(tokens[12:15])])
    row = np.frombuffer(lctx.logits(1), dtype=np.float32)
    low, high = 10, 20
    row[low] = row[high] = np.inf  # llama.cpp's own buffer, poked as an overflow would
    ban, keep = (low, high) if banned == "first" else (high, low)
    sampler = llama.new_sampler(SamplingParams(temperature=0, logit_bias=((ban, -np.inf),)))
    try:
        assert sampler.sample(lctx, 1) == keep
        assert sampler.sample_logits(row.tobytes()) == keep
        rows = sampler.argmax_rows(lctx, 0, 3)
        assert rows is not None and rows[1] == keep
    finally:
        sampler.close()
