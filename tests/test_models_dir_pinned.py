"""``models_dir.pinned``: a models_dir file is opened once, without following a symlink, and
llama.cpp reads that open file, whatever the directory's name points to by the time it opens
it (found by review: a file swapped for a symlink between the check and llama.cpp's open was
followed out of the directory). The hook is the ``with`` block: the swap happens after the
files are pinned and before anything reads them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.tinymodels import write_reranker

from kvwarm import models_dir
from kvwarm.errors import ModelLoadError


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    (d / "m.gguf").write_bytes(b"GGUF the model")
    (tmp_path / "secret.gguf").write_bytes(b"GGUF outside")
    return d


def _swap(path: Path, target: Path) -> None:
    path.unlink()
    os.symlink(target, path)


def test_a_pinned_file_reads_the_same_after_its_name_becomes_a_symlink(directory: Path) -> None:
    model = directory / "m.gguf"
    with models_dir.pinned(directory, [model]) as opened:
        _swap(model, directory.parent / "secret.gguf")
        assert opened[model].name == "m.gguf"
        assert opened[model].read_bytes() == b"GGUF the model"
    assert not opened[model].parent.exists()  # the links are gone with the block


def test_what_cannot_be_pinned_is_refused(directory: Path) -> None:
    _swap(directory / "m.gguf", directory.parent / "secret.gguf")
    os.mkfifo(directory / "pipe.gguf")
    (directory / "sub.gguf").mkdir()
    cases = {
        "m.gguf": "symlinks are refused",
        "pipe.gguf": "not a regular file",  # and opening it did not block
        "sub.gguf": "not a regular file",
        "gone.gguf": "no longer in models_dir",
    }
    for name, says in cases.items():
        with (
            pytest.raises(ModelLoadError, match=says),
            models_dir.pinned(directory, [directory / name]),
        ):
            pass
    with (
        pytest.raises(ModelLoadError, match="outside models_dir"),
        models_dir.pinned(directory, [directory.parent / "secret.gguf"]),
    ):
        pass


@pytest.mark.model
def test_llama_cpp_loads_a_split_model_through_the_pinned_paths(tmp_path: Path) -> None:
    """The model's other parts are found beside its first by name: the pinned links keep the
    names, so a split model loads, and reads the parts pinned, not what replaced them."""
    from kvwarm.backends.llama import LlamaBackend

    d = tmp_path / "models"
    d.mkdir()
    write_reranker(d / "big.gguf", "decoder", template=None, split_max_tensors=20)
    first = d / "big-00001-of-00002.gguf"
    files = [first, *models_dir.parts(first)]
    assert [f.name for f in files] == ["big-00001-of-00002.gguf", "big-00002-of-00002.gguf"]
    write_reranker(tmp_path / "other.gguf", "decoder", template=None, n_layer=3)
    with models_dir.pinned(d, files) as opened:
        for f in files:
            _swap(f, tmp_path / "other.gguf")
        model = LlamaBackend().load_model(str(opened[first]))
    try:
        assert model.facts.n_layer == 2  # the pinned model's, not the 3 of what replaced it
    finally:
        model.close()
