"""LoRA on the real embedded model, with a tiny adapter made at test time (``lora_fixture``).

Backend level: attaching changes the logits, scale 0 and detaching give the base logits bit
for bit, the adapter's digest is the file's, and any close order is safe. Engine level: the
adapter set is part of the cache namespace, so rows never cross adapter sets, and detaching
brings the base rows back. Prompts are short (prefill ~200 tok/s on CI).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from tests.backends.lora_fixture import make_embd_lora, make_lora, make_odd_lora
from tests.engine.conftest import make_engine

from kvwarm.backends import get_backend
from kvwarm.backends.base import BackendContext, BackendModel, ContextParams
from kvwarm.cache.types import PolicyConfig
from kvwarm.embedded import default_model_path
from kvwarm.engine.api import ModelConfig
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import AdapterError, BackendError, HandleClosedError, InvalidRequestError

pytestmark = pytest.mark.model

CTX = ContextParams(n_ctx=128, n_batch=16, n_ubatch=16, n_seq_max=1, n_threads=2)
PROMPT = "The capital of France is"
GREEDY = GenerationOptions(max_tokens=4, temperature=0.0, deterministic=True)


@pytest.fixture(scope="module")
def lora_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "tiny-lora.gguf"
    return make_lora(default_model_path(), out, rank=4, seed=0)


@pytest.fixture(scope="module")
def bmodel() -> Iterator[BackendModel]:
    m = get_backend("llama_cpp").load_model(str(default_model_path()))
    yield m
    m.close()


@pytest.fixture
def bctx(bmodel: BackendModel) -> Iterator[BackendContext]:
    c = bmodel.new_context(CTX)
    yield c
    c.close()


def last_logits(model: BackendModel, ctx: BackendContext, prompt: str = PROMPT) -> bytes:
    ctx.clear()
    ctx.prefill(0, model.tokenize(prompt), 0)
    return bytes(ctx.logits())


# ---- backend ------------------------------------------------------------------------------


def test_adapter_changes_logits_and_scale_zero_restores_them(
    bmodel: BackendModel, bctx: BackendContext, lora_path: Path
) -> None:
    base = last_logits(bmodel, bctx)
    adapter = bmodel.load_adapter(str(lora_path))
    try:
        bctx.set_adapters([(adapter, 1.0)])
        with_lora = last_logits(bmodel, bctx)
        assert with_lora != base
        diff = np.abs(np.frombuffer(with_lora, np.float32) - np.frombuffer(base, np.float32))
        assert float(diff.max()) > 1.0  # a visible change, not rounding noise

        bctx.set_adapters([(adapter, 0.0)])
        assert last_logits(bmodel, bctx) == base

        bctx.set_adapters([(adapter, 1.0)])
        assert last_logits(bmodel, bctx) == with_lora  # deterministic under the adapter

        bctx.set_adapters([])
        assert last_logits(bmodel, bctx) == base
    finally:
        bctx.set_adapters([])
        adapter.close()


def test_adapter_sha256_is_the_files(bmodel: BackendModel, lora_path: Path) -> None:
    adapter = bmodel.load_adapter(str(lora_path))
    try:
        assert adapter.sha256 == hashlib.sha256(lora_path.read_bytes()).digest()
        assert adapter.path == str(lora_path)
    finally:
        adapter.close()


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
def test_an_adapters_size_is_its_lora_tensors_bytes(
    bmodel: BackendModel, lora_path: Path, kind: str
) -> None:
    """Found by review (lorabudget): an adapter's weights were counted in no memory budget.
    ``size_bytes`` is what llama.cpp copies into its buffers: each LoRA tensor's
    ``ggml_nbytes`` (gguf-py's ``n_bytes``, quantised blocks included)."""
    path = lora_path
    if kind != "f32":
        out = lora_path.with_name(f"size-{kind}.gguf")
        path = make_lora(default_model_path(), out, rank=32, f16=kind == "f16", q8_0=kind == "q8_0")
    tensors = gguf.GGUFReader(str(path)).tensors
    expected = sum(int(t.n_bytes) for t in tensors if t.name.endswith((".lora_a", ".lora_b")))
    adapter = bmodel.load_adapter(str(path))
    try:
        assert adapter.size_bytes == expected > 0
    finally:
        adapter.close()


def test_f16_adapter_loads_and_acts(
    bmodel: BackendModel, bctx: BackendContext, lora_path: Path
) -> None:
    path16 = make_lora(default_model_path(), lora_path.with_name("f16.gguf"), f16=True)
    base = last_logits(bmodel, bctx)
    adapter = bmodel.load_adapter(str(path16))
    try:
        bctx.set_adapters([(adapter, 1.0)])
        assert last_logits(bmodel, bctx) != base
    finally:
        bctx.set_adapters([])
        adapter.close()


def test_close_order_adapter_last(lora_path: Path) -> None:
    """Model and context closed while the adapter is attached and open: nothing is freed
    under a dependent, and the adapter's own close frees everything without a crash."""
    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    ctx = model.new_context(CTX)
    adapter = model.load_adapter(str(lora_path))
    ctx.set_adapters([(adapter, 1.0)])
    base_logits = last_logits(model, ctx)
    assert len(base_logits) == 4 * model.facts.n_vocab
    model.close()  # deferred: the context and the adapter still hold it
    ctx.close()  # frees the context, releases the adapter
    with pytest.raises(HandleClosedError):
        ctx.set_adapters([])
    with pytest.raises(HandleClosedError):
        model.load_adapter(str(lora_path))
    adapter.close()  # last dependent: frees the adapter, then the model
    adapter.close()  # idempotent
    model.close()
    ctx.close()


def test_close_order_adapter_first(lora_path: Path) -> None:
    """Adapter closed while attached: it stays alive until the context lets go of it."""
    model = get_backend("llama_cpp").load_model(str(default_model_path()))
    ctx = model.new_context(CTX)
    adapter = model.load_adapter(str(lora_path))
    ctx.set_adapters([(adapter, 1.0)])
    with_lora = last_logits(model, ctx)
    adapter.close()  # deferred: still attached
    assert last_logits(model, ctx) == with_lora  # still applied, memory still valid
    with pytest.raises(HandleClosedError):
        ctx.set_adapters([(adapter, 1.0)])  # a closed adapter cannot be attached again
    ctx.set_adapters([])  # releases and frees it
    ctx.close()
    model.close()


# ---- engine -------------------------------------------------------------------------------


def test_engine_adapter_namespaces(lora_path: Path) -> None:
    policy = PolicyConfig(
        min_tokens=4,
        cold_min_tokens=8,
        boundary_trim_tokens=0,
        boundary_align_tokens=8,
        continued_interval=10_000,
        session_resume_wait_ms=2000,
    )
    eng = make_engine(policy=policy)
    try:
        model = eng.load_model(
            config=ModelConfig(
                context=ContextParams(
                    n_ctx=256, n_batch=8, n_ubatch=8, n_threads=2, n_threads_batch=2
                ),
                deterministic=True,
            )
        )
        base_fp = model.info().fingerprint
        # >= 8 tokens (cold_min_tokens), a multiple of 8 not needed: a finished request
        # saves its row, then an identical prompt is an exact hit.
        prompt = "Here is a list of the planets of the solar system: Mercury"

        base = model.complete(prompt, GREEDY)
        assert base.stats.cache_hit == "cold"
        eng.cache.flush()
        model.evict()
        again = model.complete(prompt, GREEDY)
        assert again.stats.cache_hit == "exact"
        assert again.completion_tokens == base.completion_tokens

        info = model.load_adapter(lora_path, 1.0)
        assert info.sha256 == hashlib.sha256(lora_path.read_bytes()).hexdigest()
        assert [a.handle for a in model.list_adapters()] == [info.handle]
        lora_fp = model.info().fingerprint
        assert lora_fp != base_fp

        with_lora = model.complete(prompt, GREEDY)
        assert with_lora.stats.cache_hit == "cold"  # base rows never serve the adapter
        assert with_lora.completion_tokens != base.completion_tokens
        eng.cache.flush()
        model.evict()
        lora_again = model.complete(prompt, GREEDY)
        assert lora_again.stats.cache_hit == "exact"  # its own rows do
        assert lora_again.completion_tokens == with_lora.completion_tokens

        # A rejected scale changes nothing: not the recorded scale, not the namespace, and
        # later adapter changes still apply.
        with pytest.raises(InvalidRequestError):
            model.set_adapter_scale(info.handle, float("nan"))
        assert model.list_adapters()[0].scale == 1.0
        assert model.info().fingerprint == lora_fp

        model.set_adapter_scale(info.handle, 0.5)
        half_fp = model.info().fingerprint
        assert half_fp not in (base_fp, lora_fp)
        assert model.complete(prompt, GREEDY).stats.cache_hit == "cold"

        model.detach_adapter(info.handle)
        assert model.list_adapters() == []
        assert model.info().fingerprint == base_fp
        back = model.complete(prompt, GREEDY)
        assert back.stats.cache_hit == "exact"  # the base row from before the adapter
        assert back.completion_tokens == base.completion_tokens
    finally:
        eng.close()


def test_engine_embeddings_follow_the_adapter_set(lora_path: Path) -> None:
    """The embedding context is a second context: it must carry the adapters the model has
    (found by review: it never got any, so a model with a LoRA attached embedded silently as
    the base model). Created before the load, it follows a load, and a detach."""
    eng = make_engine()
    try:
        model = eng.load_model(
            config=ModelConfig(
                context=ContextParams(n_ctx=128, n_batch=16, n_ubatch=16, n_threads=2)
            )
        )
        base = model.embed([PROMPT])[0]  # creates the embedding context, no adapter
        info = model.load_adapter(lora_path, 1.0)
        with_lora = model.embed([PROMPT])[0]
        assert not np.allclose(with_lora, base)
        model.set_adapter_scale(info.handle, 0.0)
        assert model.embed([PROMPT])[0] == base  # scale 0 is the base model, bit for bit
        model.set_adapter_scale(info.handle, 1.0)
        assert model.embed([PROMPT])[0] == with_lora
        model.detach_adapter(info.handle)
        assert model.embed([PROMPT])[0] == base
    finally:
        eng.close()


def test_an_adapter_that_makes_the_logits_nan_fails_its_requests_not_the_model(
    lora_path: Path,
) -> None:
    """An adapter scale of 1e30 overflows the model: every logit is NaN. Every sampler then
    picked an arbitrary token and reported NaN logprobs (found by review: '....' with
    logprobs [nan, ...], NaN that strict JSON cannot carry). Each request now fails with a
    BackendError that says so, greedy, sampled or scored, and the model serves again once
    the scale is sane."""
    eng = make_engine()
    try:
        model = eng.load_model(
            config=ModelConfig(
                context=ContextParams(n_ctx=128, n_batch=16, n_ubatch=16, n_threads=2)
            )
        )
        info = model.load_adapter(lora_path, 1e30)
        for opts in (
            GenerationOptions(max_tokens=3, temperature=0.0),
            GenerationOptions(max_tokens=3, temperature=0.8, seed=1, logprobs=1),
        ):
            with pytest.raises(BackendError, match="NaN logits"):
                model.complete(PROMPT, opts)
        model.set_adapter_scale(info.handle, 1.0)
        out = model.complete(PROMPT, GenerationOptions(max_tokens=3, temperature=0.0, logprobs=1))
        assert out.completion_tokens and all(math.isfinite(x.logprob) for x in out.logprobs or [])
    finally:
        eng.close()


def test_an_adapter_of_other_dimensions_is_refused_saying_why(
    bmodel: BackendModel, lora_path: Path
) -> None:
    """A LoRA made for a model of the same architecture but other sizes: llama.cpp refuses it
    (never an assert), and the error carries its reason."""
    misfit = make_lora(default_model_path(), lora_path.with_name("misfit.gguf"), misfit=8)
    with pytest.raises(AdapterError, match=r"does not fit this model: .*incorrect shape"):
        bmodel.load_adapter(str(misfit))
    eng = make_engine()
    try:
        model = eng.load_model(
            config=ModelConfig(
                context=ContextParams(n_ctx=128, n_batch=16, n_ubatch=16, n_threads=2)
            )
        )
        with pytest.raises(AdapterError, match="incorrect shape"):
            model.load_adapter(misfit)
        assert model.list_adapters() == []
        still = model.complete(PROMPT, GenerationOptions(max_tokens=2, temperature=0.0))
        assert still.completion_tokens  # the model still serves
    finally:
        eng.close()


def test_files_at_paths_that_are_not_utf8_load(tmp_path: Path, lora_path: Path) -> None:
    """A Linux path is bytes: one that is not UTF-8 arrives as a str with surrogates
    (``os.fsdecode``), and ``str.encode()`` raised UnicodeEncodeError for it, so the model or
    adapter at such a path could not be loaded (found by review); ``os.fsencode`` gives back
    the bytes."""
    model_link = os.fsdecode(os.fsencode(tmp_path) + b"/model-\xff.gguf")
    adapter_link = os.fsdecode(os.fsencode(tmp_path) + b"/adapter-\xfe.gguf")
    os.symlink(default_model_path(), model_link)
    os.symlink(lora_path, adapter_link)
    model = get_backend("llama_cpp").load_model(model_link)
    try:
        model.load_adapter(adapter_link).close()
    finally:
        model.close()


@pytest.mark.parametrize(
    ("dtype", "outer", "which", "match"),
    [
        (np.int32, 1, "lora_a", "ggml type"),
        (np.int8, 1, "lora_a", "ggml type"),
        (np.float64, 1, "lora_a", "ggml type"),
        (np.float32, 2, "lora_a", r"has shape 576x4x2; it must be a matrix"),
        (np.float32, 3, "lora_b", r"has shape 4x576x3; it must be a matrix"),
    ],
)
def test_an_adapter_llama_cpp_takes_but_cannot_run_is_refused_at_load(
    bmodel: BackendModel,
    tmp_path: Path,
    dtype: type[np.generic],
    outer: int,
    which: str,
    match: str,
) -> None:
    """Found by review: llama.cpp checks only a LoRA tensor's first two dimensions and not its
    type, so these loaded and attached, and the first decode under them killed the process
    (i32/i8/f64: SIGSEGV in the CPU matmul; a third dimension: ``GGML_ASSERT(ggml_can_mul_mat
    (a, b))``). They are refused before llama.cpp sees them, and the model still serves."""
    odd = make_odd_lora(
        default_model_path(), tmp_path / "odd.gguf", dtype=dtype, outer=outer, which=which
    )
    with pytest.raises(AdapterError, match=match):
        bmodel.load_adapter(str(odd))
    ctx = bmodel.new_context(CTX)
    try:
        assert np.isfinite(np.frombuffer(last_logits(bmodel, ctx), dtype=np.float32)).all()
    finally:
        ctx.close()


def test_an_adapter_with_an_empty_tensor_is_refused_at_load(
    bmodel: BackendModel, tmp_path: Path
) -> None:
    """Found by review: a LoRA pair of rank 0 (tensors with no elements) beside a pair of
    rank 4 loaded and attached, and the first decode under it aborted the process
    (``GGML_ASSERT(!ggml_is_transposed(a))``: an empty tensor's strides read as
    transposed). It is refused before llama.cpp sees it, and the model still serves."""
    empty = make_odd_lora(default_model_path(), tmp_path / "empty.gguf", rank=0)
    with pytest.raises(AdapterError, match=r"has shape 576x0; .*no elements"):
        bmodel.load_adapter(str(empty))
    ctx = bmodel.new_context(CTX)
    try:
        assert np.isfinite(np.frombuffer(last_logits(bmodel, ctx), dtype=np.float32)).all()
    finally:
        ctx.close()


_T = gguf.GGUFValueType


@pytest.mark.parametrize(
    ("key", "value", "vtype", "match"),
    [
        ("adapter.lora.alpha", 4.0, _T.FLOAT64, "alpha is a GGUF float64, not the float32"),
        ("adapter.lora.alpha", 4, _T.UINT32, "alpha is a GGUF uint32"),
        ("adapter.lora.alpha", "4", _T.STRING, "alpha is a GGUF string"),
        ("adapter.lora.alpha", [4.0, 4.0], _T.ARRAY, "alpha is a GGUF array"),
        ("general.type", 7, _T.UINT32, "general.type is a GGUF uint32, not the string"),
        ("adapter.type", 1, _T.UINT32, "adapter.type is a GGUF uint32"),
        ("adapter.lora.alpha", math.nan, _T.FLOAT32, "alpha is nan, not a finite number"),
        ("adapter.lora.alpha", math.inf, _T.FLOAT32, "alpha is inf, not a finite number"),
    ],
)
def test_adapter_keys_llama_cpp_would_abort_on_or_run_as_nan_are_refused(
    bmodel: BackendModel, tmp_path: Path, key: str, value: object, vtype: object, match: str
) -> None:
    """Found by review: an adapter whose alpha was a float64 (or a uint32, a string, an
    array), or whose general.type or adapter.type was no string, aborted the process as
    llama.cpp loaded it (``GGML_ASSERT(type_to_gguf_type<T>::value == type)``: gguf.cpp's
    typed getters assert); one whose alpha was NaN or infinite loaded, and every logit and
    embedding under it was NaN. Each is an ``AdapterError`` before llama.cpp reads the file,
    and the model goes on."""
    bad = make_odd_lora(
        default_model_path(),
        tmp_path / "keys.gguf",
        keys={key: (value, vtype)},  # type: ignore[dict-item]
    )
    with pytest.raises(AdapterError, match=match):
        bmodel.load_adapter(str(bad))
    ok = make_odd_lora(default_model_path(), tmp_path / "ok.gguf", dtype=np.float32)
    bmodel.load_adapter(str(ok)).close()


def test_an_activated_lora_is_refused_not_run_over_whole_prompts(
    bmodel: BackendModel, tmp_path: Path
) -> None:
    """Found by review: an aLoRA (``adapter.alora.invocation_tokens``) acts only from its
    invocation tokens on in llama-server; kvwarm loaded it as a plain LoRA and ran it over
    whole prompts, silently another model than the adapter's. It is refused, and freed."""
    alora = make_lora(default_model_path(), tmp_path / "alora.gguf", invocation=(504, 3575))
    with pytest.raises(AdapterError, match="activated LoRA"):
        bmodel.load_adapter(str(alora))
    plain = make_lora(default_model_path(), tmp_path / "plain.gguf")
    bmodel.load_adapter(str(plain)).close()


def test_requests_of_different_sets_side_by_side_give_what_each_gives_alone(
    lora_path: Path,
) -> None:
    """llama.cpp applies adapters to a whole context, not per sequence: kvwarm runs slots of
    different sets in passes of their own (``Runtime.use_adapters`` before each). On the real
    model, a request under the adapter and one without, decoding at once in two slots (not
    deterministic mode, which gives each slot passes of its own anyway), each give the greedy
    tokens they give alone; with the two sets in one pass, one of them ran under the other's
    adapters (checked by disabling the split: the adapted reply came out as another)."""
    eng = make_engine()
    try:
        model = eng.load_model(
            config=ModelConfig(
                context=ContextParams(n_ctx=128, n_batch=16, n_ubatch=16, n_threads=2),
                n_parallel=2,
            )
        )
        info = model.load_adapter(lora_path, 0.0)
        opts = GenerationOptions(max_tokens=6, temperature=0.0)
        under = GenerationOptions(max_tokens=6, temperature=0.0, lora=((info.handle, 1.0),))
        prompts = ("The capital of France is", "The capital of Spain is")
        together = [model.submit(prompts[0], opts), model.submit(prompts[1], under)]
        plain, adapted = (s.result() for s in together)
        assert model.complete(prompts[0], opts).completion_tokens == plain.completion_tokens
        assert model.complete(prompts[1], under).completion_tokens == adapted.completion_tokens
        assert model.complete(prompts[1], opts).completion_tokens != adapted.completion_tokens
    finally:
        eng.close()


def test_an_adapter_file_replaced_while_it_loads_is_refused(
    bmodel: BackendModel, lora_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter's digest is folded into the cache namespace; found by review: a file
    replaced after the digest was taken and before llama.cpp read it loaded the other
    adapter under the first one's namespace (its KV later restored for the wrong adapter)."""
    from kvwarm.backends.llama import adapter as adapter_module

    path = tmp_path / "swapped.gguf"
    path.write_bytes(lora_path.read_bytes())
    other = make_lora(default_model_path(), tmp_path / "other.gguf", seed=7)
    checked = adapter_module._check_tensors

    def swap_then_check(p: str, facts: object) -> None:
        os.replace(other, path)  # between the digest and llama.cpp's read
        checked(p, facts)  # type: ignore[arg-type]

    monkeypatch.setattr(adapter_module, "_check_tensors", swap_then_check)
    with pytest.raises(AdapterError, match="changed while it was loading"):
        bmodel.load_adapter(str(path))
    monkeypatch.undo()
    bmodel.load_adapter(str(path)).close()  # loads once it holds still


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendModel]:
    """A tiny random llama whose output is a weight of its own (``output.weight``)."""
    from tests.tinymodels import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("untied") / "llama.gguf", "llama")
    m = get_backend("llama_cpp").load_model(str(path))
    yield m
    m.close()


def test_a_token_embedding_adapter_llama_cpp_cannot_run_is_refused_at_load(
    bmodel: BackendModel, untied_model: BackendModel, tmp_path: Path
) -> None:
    """Found by review: llama.cpp checks a ``token_embd.weight`` pair only on its ``n_vocab``
    and ``n_embd`` sides, so one whose two ranks differed loaded, and the first decode under
    it aborted the process (``GGML_ASSERT(ggml_can_mul_mat(a, b))``); on a model whose output
    is its token embedding (SmolLM2: no ``output.weight``) the output's product takes the
    flipped pair as a plain one and aborted likewise, whatever the ranks. Both are refused
    before llama.cpp sees them; a well-formed one on an untied model loads and runs."""
    untied_path = untied_model.facts.path
    ranks = make_embd_lora(untied_path, tmp_path / "ranks.gguf", rank_a=4, rank_b=8)
    with pytest.raises(AdapterError, match=r"token_embd.weight.lora_a has rank 4.* lora_b 8"):
        untied_model.load_adapter(str(ranks))
    tied = make_embd_lora(default_model_path(), tmp_path / "tied.gguf")
    with pytest.raises(AdapterError, match="output is its token embedding"):
        bmodel.load_adapter(str(tied))
    ok = untied_model.load_adapter(str(make_embd_lora(untied_path, tmp_path / "ok.gguf")))
    ctx = untied_model.new_context(CTX)
    try:
        ctx.set_adapters([(ok, 1.0)])
        ctx.prefill(0, [1, 2, 3], 0)
        assert np.isfinite(np.frombuffer(bytes(ctx.logits()), dtype=np.float32)).all()
    finally:
        ctx.close()
        ok.close()
