"""``models_dir.scan``: which files of a models directory are models, under which ids."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvwarm import models_dir


def test_two_files_of_one_model_id_serve_the_first_and_the_other_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: ``big.gguf`` beside a split ``big-00001-of-00002.gguf`` (both id
    ``big``), or ``x.gguf`` beside ``x.GGUF``, left one file unreachable without a word (it
    was neither listed nor loadable). The first by name is served, and a warning, once per
    file rather than on every rescan, names the other."""
    d = tmp_path / "models"
    d.mkdir()
    for name in ("big.gguf", "big-00001-of-00002.gguf", "big-00002-of-00002.gguf"):
        (d / name).write_bytes(b"GGUF")
    for name in ("x.gguf", "x.GGUF", "y.gguf"):
        (d / name).write_bytes(b"GGUF")
    with caplog.at_level(logging.WARNING, logger="kvwarm.server"):
        found = models_dir.scan(d)
        assert models_dir.scan(d) == found  # a rescan warns no more
    assert found == {"big": d / "big-00001-of-00002.gguf", "x": d / "x.GGUF", "y": d / "y.gguf"}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "big.gguf" in messages[0] and "big-00001-of-00002.gguf" in messages[0]
    assert "x.gguf" in messages[1] and "x.GGUF" in messages[1]
