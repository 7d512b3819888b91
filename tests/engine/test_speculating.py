"""Which models verify drafts, known from their GGUF header before they load
(``engine/speculating.verifies_drafts``): only one that speculates and generates. A reranker
(pooling rank) or an encoder (attention not causal: a BERT embedding model) given a
``spec_type`` never verifies a draft, so it loads as any model does (``ModelParams.exact_rows``
off: its weights repacked where the CPU repacks) and never changes the process's kernels.
The files are tiny random-weight GGUFs (``tests/tinymodels.py``): only their headers are read
here, and the engine runs on the stub."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import make_engine
from tests.tinymodels import write_reranker

from kvwarm.backends.base import ModelParams
from kvwarm.backends.stub import StubBackend, StubModel
from kvwarm.engine.api import ModelConfig
from kvwarm.engine.speculating import untile_at_start, verifies_drafts

SPECULATING = ModelConfig(spec_type="ngram-simple")


def _generator(path: Path, arch: str = "llama") -> Path:
    """A GGUF header as most generating models' are: neither a pooling nor a causal key."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("speculating")
    return {
        "generator": _generator(out / "generator.gguf"),
        "reranker": write_reranker(out / "reranker.gguf", "decoder"),  # qwen3, pooling rank
        "cross-encoder": write_reranker(out / "cross-encoder.gguf", "encoder"),
        # A BERT embedding model: pooling mean, attention not causal.
        "embedder": write_reranker(out / "embedder.gguf", "encoder", pooling=1),
        # A causal model pooling its last token (Qwen3-Embedding's shape): it can generate.
        "causal embedder": write_reranker(out / "causal.gguf", "decoder", pooling=3),
        # Generating models whose state cannot roll a rejected draft back.
        "recurrent": _generator(out / "mamba2.gguf", "mamba2"),
        "hybrid": _generator(out / "lfm2.gguf", "lfm2"),
    }


@pytest.mark.parametrize(
    ("name", "config", "verifies"),
    [
        ("generator", SPECULATING, True),
        ("generator", ModelConfig(), False),  # no spec_type
        ("generator", replace(SPECULATING, deterministic=True), False),  # never speculates
        ("generator", replace(SPECULATING, pooling="rank"), False),  # made a reranker
        ("reranker", SPECULATING, False),
        ("reranker", replace(SPECULATING, pooling="mean"), True),  # made a causal embedder
        ("cross-encoder", SPECULATING, False),
        ("embedder", SPECULATING, False),
        ("embedder", replace(SPECULATING, pooling="last"), False),  # still not causal
        ("causal embedder", SPECULATING, True),
        ("recurrent", SPECULATING, False),
        ("hybrid", SPECULATING, False),
    ],
)
def test_a_model_verifies_drafts_only_where_it_speculates_and_generates(
    files: dict[str, Path], name: str, config: ModelConfig, verifies: bool
) -> None:
    assert verifies_drafts(config, files[name]) is verifies


def test_a_file_whose_header_cannot_be_read_is_taken_at_its_configs_word(tmp_path: Path) -> None:
    """A stub backend's model needs no file; a file that is no GGUF is llama.cpp's to refuse."""
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    for path in (tmp_path / "missing.gguf", tmp_path / "junk.gguf", tmp_path):
        assert verifies_drafts(SPECULATING, path)
        assert not verifies_drafts(ModelConfig(), path)


class _Recording(StubBackend):
    """A stub that keeps the parameters each load was given."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[ModelParams] = []

    def load_model(self, path: str, params: ModelParams | None = None) -> StubModel:
        self.loads.append(params or ModelParams())
        return super().load_model(path, params)


@pytest.mark.parametrize(("name", "exact", "exact_rows"), [
    ("reranker", True, False), ("embedder", True, False), ("recurrent", True, False),
    ("hybrid", True, False), ("generator", True, True), ("generator", False, False),
])  # fmt: skip
def test_the_engine_loads_for_exact_rows_only_a_model_that_verifies_drafts(
    files: dict[str, Path], name: str, exact: bool, exact_rows: bool
) -> None:
    """Found by review: a reranker given a ``spec_type`` loaded with ``exact_rows`` (its
    pooling was known only after the load), so its weights were not repacked and its first
    load could turn llama.cpp's tiled kernel off for every model of the process, for drafts
    it never verifies. A recurrent or hybrid model did the same: its speculation is off (it
    cannot roll a draft back), known only from its memory once loaded. A model whose
    ``spec_exact`` is false speculates on the fastest kernels, its weights repacked."""
    backend = _Recording()
    config = replace(SPECULATING, backend=backend, spec_exact=exact)
    with make_engine() as engine:
        engine.load_model(files[name], config=config)
    assert [params.exact_rows for params in backend.loads] == [exact_rows]


def test_a_process_of_stub_models_decides_nothing(files: dict[str, Path]) -> None:
    """Only llama.cpp has the tiled kernel: a stub model, even one that verifies drafts, leaves
    the process's kernels alone (no header or tensor table of a llama.cpp model is read)."""
    stub = replace(SPECULATING, backend="stub")
    assert not untile_at_start([(files["generator"], stub), (None, stub)])
    assert not untile_at_start([(None, SPECULATING)], backend="stub")
