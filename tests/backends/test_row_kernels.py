"""Which weights llama.cpp multiplies with another kernel in a pass of several rows than in a
one-token pass (``model_file.several_row_kernels``), so a speculating model's verify rows
would differ from plain decoding's: tinyBLAS for F32/F16/BF16, the tiled kernel for K-quant
and IQ weights in passes of 8 rows or more (on x86 unless ``GGML_CPU_TILED_MM`` is 0), the
repacked GEMM for repacked weights; and that a model whose only such kernel is repacking
gives repacking up when it will verify drafts (``ModelParams.exact_rows``). Tiny random-weight
llama GGUFs quantised by llama.cpp (``tests/tinymodels.py``), 512 wide so K-quants apply."""

from __future__ import annotations

import ast
import os
import platform
import sys
from pathlib import Path

import pytest
from tests.childkit import run_child
from tests.tinymodels import K_QUANT_EMBD, K_QUANT_HEADS, quantize, write_reranker, write_tiny_model

from kvwarm.backends.llama import model_file

pytestmark = pytest.mark.model

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from flash_attn import shape_keys  # noqa: E402  (bench/ is not a package)

X86 = platform.machine().lower() in {"x86_64", "amd64"}
#: ``llama_ftype`` values: all F16, mostly Q6_K, mostly Q4_K (Q4_K_S: Q5_K and Q6_K besides).
FTYPE_F16, FTYPE_Q6_K, FTYPE_Q4_K_S = 1, 18, 14


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("rowkernels")
    keys = shape_keys((512, 8, 4, 1024, 64))
    return {
        ftype: write_tiny_model(out / f"{ftype}.gguf", "llama", stdev=0.02, keys=keys, ftype=ftype)
        for ftype in (FTYPE_F16, FTYPE_Q6_K, FTYPE_Q4_K_S)
    }


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("1", True), ("0", False), (" 0", False), ("off", False)]
)
def test_the_tiled_kernel_is_on_as_ggml_reads_its_switch(
    monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool
) -> None:
    """ggml reads ``GGML_CPU_TILED_MM`` with ``atoi``: unset is on, anything that parses to 0
    (an unparsable word included) is off."""
    if value is None:
        monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    else:
        monkeypatch.setenv("GGML_CPU_TILED_MM", value)
    assert model_file.tiled_kernel_on() == (on and X86)


@pytest.mark.skipif(not X86, reason="the tiled kernel is an x86 kernel")
def test_each_kernel_is_named_where_it_applies(
    tiny: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    assert "(F16), which llamafile's tinyBLAS" in model_file.several_row_kernels(tiny[FTYPE_F16])
    assert "(Q6_K), which llama.cpp's tiled kernel" in model_file.several_row_kernels(
        tiny[FTYPE_Q6_K]
    )
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    assert model_file.several_row_kernels(tiny[FTYPE_Q6_K]) == ""
    assert model_file.several_row_kernels(tiny[FTYPE_Q4_K_S]) == ""
    repacked = model_file.several_row_kernels(tiny[FTYPE_Q4_K_S], repacked=True)
    assert "(Q4_K), repacked" in repacked
    assert "tinyBLAS" in model_file.several_row_kernels(tiny[FTYPE_F16])  # whatever the switch


PROBE = """
import sys
from kvwarm.backends.base import ContextParams, ModelParams
from kvwarm.backends.llama import LlamaBackend
params = ContextParams(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, flash_attn="on",
                       type_k="q8_0", type_v="f16")
for exact_rows in (False, True):
    model = LlamaBackend().load_model(sys.argv[1], ModelParams(exact_rows=exact_rows))
    print("EXACT", exact_rows, model.verify_exactness(params))
    print("PROBE", exact_rows, model._probe_verify_rows(params, ()))
    model.close()
"""


def _exactness(path: Path, tiled: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("GGML_CPU_TILED_MM", None)
    if tiled is not None:
        env["GGML_CPU_TILED_MM"] = tiled
    done, lines = run_child(PROBE, str(path), prefixes=("EXACT", "PROBE"), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {" ".join(line.split()[:2]): line.split(maxsplit=2)[2] for line in lines}


@pytest.mark.skipif(not X86, reason="the tiled kernel is an x86 kernel")
def test_a_k_quant_models_rows_differ_while_the_tiled_kernel_is_on(tiny: dict[int, Path]) -> None:
    """Measured by the load's probe as the static rule says: a Q6_K model's verify rows differ
    from one-token passes while the tiled kernel is on (a child process: ggml reads the switch
    once); with ``GGML_CPU_TILED_MM=0`` they are exact, and the model says so."""
    on = _exactness(tiny[FTYPE_Q6_K], None)
    assert int(on["PROBE False"]) > 0
    assert on["EXACT False"].startswith("no: its weight") and "tiled kernel" in on["EXACT False"]
    off = _exactness(tiny[FTYPE_Q6_K], "0")
    assert off["PROBE False"] == "0"
    assert off["EXACT False"] == "at any length"


@pytest.mark.skipif(not X86, reason="repacking is measured on x86")
def test_a_speculating_model_gives_up_repacking_where_it_is_the_only_kernel_change(
    tiny: dict[int, Path],
) -> None:
    """With the tiled kernel off, a Q4_K model's only kernel change is repacking (where the
    CPU repacks, as it does without AMX): loaded to verify drafts (``exact_rows``) its weights
    are not repacked, and it is exact; loaded otherwise it keeps repacking, and the static
    rule names it."""
    from kvwarm.backends.llama import native

    if native.amx_in_use():
        pytest.skip("weights are never repacked where AMX is in use")
    off = _exactness(tiny[FTYPE_Q4_K_S], "0")
    assert "(Q4_K), repacked" in off["EXACT False"]
    assert off["EXACT True"] == "at any length"
    assert off["PROBE True"] == "0"


UNTILE = """
import os, sys
from kvwarm.backends.base import ContextParams, ModelParams
from kvwarm.backends.llama import LlamaBackend
params = ContextParams(n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, flash_attn="on",
                       type_k="q8_0", type_v="f16")
backend = LlamaBackend()
if sys.argv[2] == "context-first":  # another model's context before: ggml may have read it
    other = backend.load_model(sys.argv[1])
    other.new_context(params).close()
if sys.argv[2] == "thread-first":  # another thread runs: setting the variable is not safe
    import threading
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
model = backend.load_model(sys.argv[1], ModelParams(exact_rows=True))
print("EXACT", model.verify_exactness(params))
print("ENV", os.environ.get("GGML_CPU_TILED_MM"))
print("KERNELS", repr(model.kernels))
"""


@pytest.mark.skipif(not X86, reason="the tiled kernel is an x86 kernel")
@pytest.mark.parametrize(
    ("tiled", "order", "exact", "env", "kernels"),
    [
        (None, "first", "at any length", "0", "'untiled'"),  # off for the process, and exact
        ("1", "first", "no: its weight", "1", "''"),  # the user's choice is kept
        (None, "context-first", "no: its weight", None, "''"),  # too late: ggml may have read it
        (None, "thread-first", "no: its weight", None, "''"),  # not safe: another thread runs
    ],
)
def test_a_speculating_k_quant_model_turns_the_tiled_kernel_off_while_it_still_can(
    tiny: dict[int, Path],
    tiled: str | None,
    order: str,
    exact: str,
    env: str | None,
    kernels: str,
) -> None:
    """The first model of a process that will verify drafts (``exact_rows``) with K-quant
    weights sets ``GGML_CPU_TILED_MM=0`` where nobody set it (``native.untile_for_exact_rows``,
    the fallback of a process that did not decide at its start) and is exact; a value given
    is kept, after a context was made it is too late (ggml reads the variable once), and
    while another thread runs it is not safe (C's ``setenv`` beside a ``getenv``), so the
    model says it is not exact. ``kernels`` says which way it computes, for its cache keys."""
    environ = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    if tiled is not None:
        environ["GGML_CPU_TILED_MM"] = tiled
    done, lines = run_child(
        UNTILE, str(tiny[FTYPE_Q6_K]), order, prefixes=("EXACT", "ENV", "KERNELS"), env=environ
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(line.split(maxsplit=1) for line in lines)
    assert said["EXACT"].startswith(exact)
    assert said["ENV"] == str(env)
    assert said["KERNELS"] == kernels


ENGINE = """
import os, sys
from kvwarm.engine.api import ModelConfig
from tests.engine.conftest import make_engine
config = ModelConfig(spec_type="ngram-simple")
if sys.argv[2] == "start":  # as kvwarm serve does, before its threads start
    from kvwarm.engine.api import untile_at_start
    print("TURNED", untile_at_start([(sys.argv[1], config)]))
with make_engine() as engine:
    model = engine.load_model(sys.argv[1], config=config)
    print("ENV", os.environ.get("GGML_CPU_TILED_MM"))
    print("KERNELS", repr(model._bmodel.kernels))
    tags = ("", "untiled", "unrepacked", "untiled,unrepacked")
    keyed = [t for t in tags if model.config.context.kv_hash(t) == model.namespace().ctx_hash]
    print("KEYED", repr(keyed))
    print("EXACT", model.info().speculation_exact)
    print("SPECULATION", model.info().speculation)
"""


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Q4_K_S model that cannot generate: a reranker (qwen3, pooling rank), 512 wide so
    K-quants apply. (A BERT embedding model, the other kind, loads into no engine: it keeps
    no KV cache; ``tests/engine/test_speculating.py`` reads its header.)"""
    out = tmp_path_factory.mktemp("pooled")
    wide = {"n_embd": K_QUANT_EMBD, "n_head": K_QUANT_HEADS}
    return {"reranker": quantize(write_reranker(out / "rr.gguf", "decoder", **wide), FTYPE_Q4_K_S)}


@pytest.mark.skipif(not X86, reason="the tiled kernel is an x86 kernel")
@pytest.mark.parametrize(
    ("name", "tiled", "start", "said"),
    [
        # Cannot generate: neither repacking nor the process's kernel given up.
        ("reranker", None, "start", {"TURNED": "False", "ENV": "None", "KERNELS": "''"}),
        ("reranker", "0", "no", {"ENV": "0", "KERNELS": "'untiled'"}),  # repacked all the same
        # Generates: the kernel off at the start, the weights unrepacked; exact.
        ("generator", None, "start", {"TURNED": "True", "ENV": "0", "EXACT": "at any length",
                                      "KERNELS": "'untiled,unrepacked'"}),
        # Nothing decided at the start: the engine's load finds its cache threads running
        # and leaves the switch alone, so the model is not exact (and says why).
        ("generator", None, "no", {"ENV": "None", "KERNELS": "''"}),
    ],
)  # fmt: skip
def test_only_a_model_that_generates_pays_for_exact_kernels(
    tiny: dict[int, Path],
    pooled: dict[str, Path],
    name: str,
    tiled: str | None,
    start: str,
    said: dict[str, str],
) -> None:
    """A reranker given a ``spec_type`` never verifies a draft, which its GGUF header says
    before it loads (``engine/speculating.verifies_drafts``): it loads its weights repacked
    and leaves llama.cpp's tiled kernel on for the process, and its cache keys hash the
    kernels it was loaded with (found by review: it loaded unrepacked and, first in a
    process, turned the kernel off for every model). A model that generates gets both where
    its process decided at its start (``untile_at_start``: a child process, as ggml reads the
    switch once); an engine's own load no longer sets the variable, as other threads (the
    cache's) run by then."""
    from kvwarm.backends.llama import native

    if native.amx_in_use():
        pytest.skip("weights are never repacked where AMX is in use")
    path = tiny[FTYPE_Q4_K_S] if name == "generator" else pooled[name]
    environ = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    if tiled is not None:
        environ["GGML_CPU_TILED_MM"] = tiled
    prefixes = ("TURNED", "ENV", "KERNELS", "KEYED", "EXACT", "SPECULATION")
    done, lines = run_child(ENGINE, str(path), start, prefixes=prefixes, env=environ)
    assert done.returncode == 0, done.stderr[-3000:]
    got = dict(line.split(maxsplit=1) for line in lines)
    assert {k: got.get(k) for k in said} == said, got
    assert got["KEYED"] == repr([ast.literal_eval(got["KERNELS"])])  # what it loaded with
    if name == "generator" and start == "no":
        assert got["SPECULATION"].startswith("off: a verify pass's rows differ"), got
        assert "tiled kernel" in got["SPECULATION"]
        assert "tiled K-quant kernel left on" in done.stderr


DEFAULT_ENGINE = """
import os, sys
import kvwarm
model = kvwarm.load_model(sys.argv[1], spec_type="ngram-simple", n_ctx=512, n_batch=64)
print("ENV", os.environ.get("GGML_CPU_TILED_MM"))
print("EXACT", model.info().speculation_exact)
kvwarm.default_engine().close()
"""


@pytest.mark.skipif(not X86, reason="the tiled kernel is an x86 kernel")
def test_the_default_engines_first_model_decides_before_the_engine_starts(
    tiny: dict[int, Path],
) -> None:
    """``kvwarm.load_model``'s first call decides the process's kernels for its model before
    it makes the default engine (whose cache threads would make its load's fallback refuse),
    so the five-line example speculates exactly with a K-quant model too."""
    environ = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    done, lines = run_child(
        DEFAULT_ENGINE, str(tiny[FTYPE_Q6_K]), prefixes=("ENV", "EXACT"), env=environ
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert dict(line.split(maxsplit=1) for line in lines) == {"ENV": "0", "EXACT": "at any length"}


@pytest.mark.parametrize(
    ("info", "columns"),
    [
        (b"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | LLAMAFILE = 1 | OPENMP = 1 | ", 4),
        (b"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 | ", 2),
        (b"CPU : SSE3 = 1 | AVX = 1 | LLAMAFILE = 1 | ", 2),
        (b"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | OPENMP = 1 | ", 1),  # no llamafile
        (b"CPU : NEON = 1 | ARM_FMA = 1 | DOTPROD = 1 | LLAMAFILE = 1 | ", 1),  # not x86's kernel
        (b"CPU : AVX2 = 1 | AVX512_VNNI = 1 | LLAMAFILE = 1 | ", 2),  # a VNNI flag is not AVX512
    ],
)
def test_tinyblas_columns_follow_the_build(info: bytes, columns: int) -> None:
    """tinyBLAS's Q8_0 kernel multiplies 4 rows at a time with 32 vector registers (AVX-512),
    2 with 16 (``sgemm.cpp``: ``VECTOR_REGISTERS``), as ``llama_print_system_info`` says."""
    from kvwarm.backends.llama import native

    assert native._columns_of(info) == columns


@pytest.mark.parametrize(
    ("info", "vectors"),
    [
        (b"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | LLAMAFILE = 1 | ", "avx512"),
        (b"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | REPACK = 1 | ", "avx2"),
        (b"CPU : SSE3 = 1 | AVX = 1 | ", "avx"),
        (b"CPU : AVX = 0 | AVX2 = 1 | AVX512_VNNI = 1 | ", "avx2"),
        (b"CPU : NEON = 1 | ARM_FMA = 1 | ", "none"),
    ],
)
def test_the_builds_vector_set_names_its_references(info: bytes, vectors: str) -> None:
    """The widest x86 vector set the CPU backend was built for: the tests' llama-server
    references are recorded per set (``tests/references.py``), whose sums differ."""
    from kvwarm.backends.llama import native

    assert native._vector_set_of(info) == vectors


def test_the_embedded_models_tinyblas_share_is_its_tied_q8_0_output() -> None:
    """SmolLM2-135M: Q4_1 layers (vec_dot) and a tied Q8_0 output (tinyBLAS), 30 of 96 MB;
    loaded, its facts say how a pass's rows are tiled where its weights run on the CPU."""
    import kvwarm.embedded
    from kvwarm.backends.base import ModelParams
    from kvwarm.backends.llama import LlamaBackend, native

    path = kvwarm.embedded.default_model_path()
    share = model_file.WeightKernels.of(path).column_share()
    assert share == pytest.approx(30.08 / 96.44, abs=0.002)
    facts = LlamaBackend().load_model(str(path), ModelParams()).facts
    columns = native.tinyblas_columns()
    assert facts.pass_tile == columns
    assert facts.pass_tile_share == (round(share, 4) if columns > 1 else 0.0)


@pytest.mark.skipif(not X86, reason="repacking and tinyBLAS's Q4_0 kernel are x86's here")
def test_repacked_q4_0_weights_leave_tinyblas(tmp_path: Path) -> None:
    """Q4_0 weights loaded into the extra buffer types go to the repacked GEMM, not
    tinyBLAS: they count in the share only where they are not repacked."""
    keys = shape_keys((512, 8, 4, 1024, 64))
    path = write_tiny_model(tmp_path / "q4_0.gguf", "llama", stdev=0.02, keys=keys, ftype=2)
    kernels = model_file.WeightKernels.of(path)
    assert kernels.column_share() > 0.5
    assert kernels.column_share(repacked=True) < kernels.column_share()
