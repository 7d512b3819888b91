"""Recurrent (Mamba) and hybrid (LFM2: attention plus a short-convolution state) models on the
real backend, as tiny random-weight GGUFs (``tests/tinymodels.py``): their state can never be
rolled back, so every reuse must be a whole checkpoint, and in deterministic mode every answer
(tokens and logprobs) equals a cold run's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from tests.engine import memkit, restorekit
from tests.engine.memkit import same
from tests.tinymodels import write_tiny_model

from kvwarm.backends import get_backend
from kvwarm.backends.base import ContextParams
from kvwarm.engine.api import Engine
from kvwarm.engine.config import ModelConfig
from kvwarm.engine.model import Model
from kvwarm.engine.speculating import verifies_drafts
from kvwarm.engine.types import Completion, GenerationOptions
from kvwarm.errors import StateRestoreError

pytestmark = pytest.mark.model

N_BATCH = 32
OPTS = GenerationOptions(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
POLICY = memkit.exact_policy(N_BATCH, min_tokens=8, cold_min_tokens=16)
ARCHS = {"mamba": "recurrent", "lfm2": "hybrid"}


def engine(tmp: Path | None) -> Engine:
    # Chunks of 32 tokens: these short rows are then manifests where the memory allows it.
    return memkit.engine(tmp, POLICY, ram=64 << 20, chunk_tokens=N_BATCH)


def load(eng: Engine, path: str, *, det: bool = True, n_parallel: int = 1) -> Model:
    return memkit.load(eng, path, n_ctx=256, n_batch=N_BATCH, det=det, n_parallel=n_parallel)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    arch = str(request.param)
    yield str(write_tiny_model(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch))


@pytest.fixture(scope="module")
def randomised(tiny: str) -> Iterator[tuple[restorekit.Target, restorekit.Reference]]:
    """The model as a target of ``restorekit``'s random cases, and its reference."""
    target = restorekit.Target(
        name=Path(tiny).stem,
        n_batch=N_BATCH,
        tokens=(1, 120),
        lengths=(4, 110),
        path=tiny,
        n_ctx=256,
    )
    reference = restorekit.Reference(target)
    yield target, reference
    reference.close()


def cold(path: str, tokens: Sequence[int], *, det: bool = True) -> Completion:
    eng = engine(None)
    try:
        out = load(eng, path, det=det).complete(list(tokens), OPTS)
        assert out.stats.cached_tokens == 0
        return out
    finally:
        eng.close()


def tokens(seed: int, n: int) -> list[int]:
    return [1 + (seed * 31 + i * 17) % 120 for i in range(n)]


SYSTEM = tokens(1, 90)


def test_the_kind_is_read_from_the_model(tiny: str) -> None:
    eng = engine(None)
    try:
        info = load(eng, tiny).info()
        assert info.memory == ARCHS[Path(tiny).stem]
    finally:
        eng.close()


def test_a_spec_type_gives_no_exact_kv_cells_to_a_state_that_cannot_roll_back(tiny: str) -> None:
    """``auto`` KV cells become q8_0 only in a model that speculates: a recurrent or hybrid
    state cannot roll a rejected draft back, so with a ``spec_type`` it still runs (and
    keys its rows) as f16, not paying q8_0's prefill for drafts it never verifies, and its
    weights load as any model's (``speculating.RECURRENT_ARCHS``, checked here against
    llama.cpp's own memory kind)."""
    eng = engine(None)
    try:
        cfg = ModelConfig(
            context=ContextParams(n_ctx=256, n_batch=N_BATCH, n_ubatch=N_BATCH),
            spec_type="ngram-simple",
        )
        model = eng.load_model(tiny, config=cfg)
        assert model.info().speculation.startswith("off")
        # Known from the header before the load too: its weights loaded as any model's
        # (repacked where the CPU repacks), not for verify rows it never has.
        assert not verifies_drafts(cfg, tiny)
        ran = model.config.context
        assert (ran.type_k, ran.type_v) == ("f16", "f16")
    finally:
        eng.close()


def test_every_reuse_is_a_whole_checkpoint_and_bit_identical(tiny: str, tmp_path: Path) -> None:
    a = [*SYSTEM, *tokens(2, 15)]
    b = [*SYSTEM, *tokens(3, 12)]
    c = [*SYSTEM, *tokens(4, 12)]
    shorter = a[:100]
    eng = engine(tmp_path)

    def rows() -> set[int]:
        eng.cache.flush()
        return {r.n_tokens for r in eng.cache.rows()}

    try:
        model = load(eng, tiny)
        first = model.complete(a, OPTS)
        same(first, cold(tiny, a))
        assert {96, len(a)} <= rows()  # the aligned cold save, the prompt-end checkpoint
        # A hybrid's rows are its attention cache as chunks (shared) plus its recurrent state
        # in the row; a recurrent state alone is stored whole.
        chunked = [r.logical_bytes > r.size for r in eng.cache.rows()]
        assert all(chunked) if ARCHS[Path(tiny).stem] == "hybrid" else not any(chunked)

        model.evict()  # from here on only rows can serve, until the live-KV case below
        again = model.complete(a, OPTS)
        assert again.stats.cached_tokens == len(a)  # with the stored logits: no decode
        same(again, first)

        model.evict()
        sibling = model.complete(b, OPTS)  # shares 90 tokens with rows of 96+: none usable
        assert sibling.stats.cached_tokens == 0
        same(sibling, cold(tiny, b))
        assert 64 in rows()  # it checkpointed where it diverged (aligned: deterministic)

        for prompt, hit in ((c, 64), (shorter, 96)):
            model.evict()
            out = model.complete(prompt, OPTS)
            assert out.stats.cached_tokens == hit  # whole checkpoints only, never a rollback
            same(out, cold(tiny, prompt))

        # Live KV: the slot holds `shorter` and its reply; a prompt extending all of it
        # resumes there (deterministic: down to the aligned, canonical part, a checkpoint).
        follow = [*out.tokens[:-1], 5, 6]
        ext = model.complete(follow, OPTS)
        assert ext.stats.cached_tokens in rows()
        same(ext, cold(tiny, follow))
        rows()
    finally:
        eng.close()

    restarted = engine(tmp_path)
    try:
        model = load(restarted, tiny, n_parallel=2)
        after = model.complete(a, OPTS)
        assert after.stats.cached_tokens == len(a)
        same(after, first)
    finally:
        restarted.close()


def test_default_mode_reuses_only_whole_states(tiny: str) -> None:
    """Without deterministic mode the planner still never trims: siblings meet at the
    checkpoint where they diverge, and each answer is the cold one's tokens."""
    eng = engine(None)
    try:
        model = load(eng, tiny, det=False)
        outs = []
        for tail in (2, 3, 4):
            model.evict()
            eng.cache.flush()
            prompt = [*SYSTEM, *tokens(tail, 10)]
            out = model.complete(prompt, OPTS)
            assert out.completion_tokens == cold(tiny, prompt, det=False).completion_tokens
            if out.stats.cached_tokens:
                assert out.stats.cached_tokens in {r.n_tokens for r in eng.cache.rows()}
            outs.append(out)
        shared = len(SYSTEM) + next(
            i for i, (x, y) in enumerate(zip(tokens(2, 10), tokens(3, 10), strict=True)) if x != y
        )
        assert outs[2].stats.cached_tokens >= shared
    finally:
        eng.close()


def test_a_hybrid_blob_is_its_attention_chunks_then_its_rest(tiny: str) -> None:
    """The codec cuts a hybrid model's blob in its attention cache alone; what follows (the
    recurrent state) is its rest, and the chunks joined then the rest are the blob again,
    which restores. A recurrent state alone has no cache to cut: no rest either."""
    model = get_backend("llama_cpp").load_model(tiny)
    ctx = model.new_context(ContextParams(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2))
    try:
        prompt = tokens(5, 40)
        ctx.prefill(0, prompt, 0)
        blob = ctx.kv_pack(0)
        if ARCHS[Path(tiny).stem] != "hybrid":
            with pytest.raises(StateRestoreError):
                ctx.kv_codec.rest(blob)
            return
        rest = bytes(ctx.kv_codec.rest(blob))
        chunks = ctx.kv_split(blob, [0, 16, 40])
        assert 0 < len(rest) < len(blob)
        assert bytes(ctx.kv_join(chunks)) + rest == blob
        assert ctx.kv_unpack(1, bytes(ctx.kv_join(chunks)) + rest) == len(prompt)
        with pytest.raises(StateRestoreError):  # the attention cache alone is not a state
            ctx.kv_unpack(1, ctx.kv_join(chunks))
        assert ctx.seq_pos_max(1) == -1  # a refused restore leaves the sequence empty
    finally:
        ctx.close()
        model.close()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_random_restores_equal_cold_runs(
    randomised: tuple[restorekit.Target, restorekit.Reference], tmp_path: Path, seed: int
) -> None:
    """``test_random_restores_stub.py``'s seeded random sessions, on real recurrent and hybrid
    state (fewer and shorter: each restart loads the model)."""
    target, reference = randomised
    restorekit.run(target, seed, 16, tmp_path, reference)


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2-VL text model: full attention under M-RoPE, whose KV cells carry
    ``llama_kv_cell_ext`` (24 bytes a cell, which the chunk codec does not read)."""
    return str(write_tiny_model(tmp_path_factory.mktemp("qwen2vl") / "qwen2vl.gguf", "qwen2vl"))


@pytest.mark.parametrize(("det", "n_parallel"), [(True, 2), (False, 1)], ids=["streams", "unified"])
def test_an_mrope_models_rows_are_stored_whole_and_restore(
    qwen2vl: str, tmp_path: Path, det: bool, n_parallel: int
) -> None:
    """Its rows are stored whole and restored through ``kv_unpack``, whose cell check now
    reads ext cells and must pass what llama.cpp wrote. Deterministic with two slots, one KV
    stream a sequence: every pack was refused before, so nothing was ever saved."""
    a = [*SYSTEM, *tokens(2, 15)]
    eng = engine(tmp_path)
    try:
        model = load(eng, qwen2vl, det=det, n_parallel=n_parallel)
        first = model.complete(a, OPTS)
        eng.cache.flush()
        rows = list(eng.cache.rows())
        assert rows and all(r.logical_bytes <= r.size for r in rows)  # whole, no chunks
        model.evict()
        again = model.complete(a, OPTS)
        # Deterministic: the aligned canonical prefix (3 x 32); else all but the last token.
        assert again.stats.cached_tokens == (96 if det else len(a) - 1)
        if det:
            same(again, first)
            same(first, cold(qwen2vl, a))
    finally:
        eng.close()
