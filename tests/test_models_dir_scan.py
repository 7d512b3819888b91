"""``models_dir.scan``: which files of a models directory are models, under which ids."""

from __future__ import annotations

import logging
import os
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


def test_a_file_whose_name_is_not_utf8_is_skipped_not_a_500(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: a file named ``caf\\xe9.gguf`` (Latin-1) became a model id holding a
    lone surrogate, which no JSON response can encode: ``/health`` and ``/v1/models`` both
    answered 500 for as long as the file was there. No request could name such a model; it
    is skipped, with a warning (once), and the others are served."""
    from fastapi.testclient import TestClient

    from kvwarm.server import create_app
    from kvwarm.settings import load_settings

    d = tmp_path / "models"
    d.mkdir()
    (d / "ok.gguf").write_bytes(b"GGUF")
    bad = os.fsdecode(b"caf\xe9.gguf")
    (d / bad).write_bytes(b"GGUF")
    with caplog.at_level(logging.WARNING, logger="kvwarm.server"):
        assert models_dir.scan(d) == {"ok": d / "ok.gguf"}
        models_dir.scan(d)
    assert [r.getMessage() for r in caplog.records] == [
        "models_dir: skipping 'caf\\udce9.gguf': its name is not UTF-8, so no request can name it"
    ]
    # A projector so named would be named in the model's meta (/v1/models) once it loads.
    (d / os.fsdecode(b"mmproj-\xe9.gguf")).write_bytes(b"GGUF")
    assert models_dir.projector_for(d, d / "ok.gguf", 1) is None
    flags: dict[str, object] = {"models_dir": str(d), "backend": "stub", "cache_dir": "none"}
    settings = load_settings({**flags, "allowed_hosts": ["testserver"]}, {})
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        models = client.get("/v1/models")
        assert models.status_code == 200, models.text
        assert [m["id"] for m in models.json()["data"]] == ["ok"]
        assert client.get("/health").status_code == 200
