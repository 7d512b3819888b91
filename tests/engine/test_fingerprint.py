from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from kvwarm.cache.types import FingerprintMode
from kvwarm.embedded import default_model_path
from kvwarm.engine.fingerprint import fingerprint, parse_mode
from kvwarm.errors import ConfigError


def test_safe_is_the_sha256_of_the_file(tmp_path: Path) -> None:
    f = tmp_path / "m.bin"
    f.write_bytes(b"weights" * 1000)
    assert fingerprint(f, FingerprintMode.SAFE) == hashlib.sha256(f.read_bytes()).digest()


@pytest.mark.model
def test_fingerprint_follows_content_not_path(tmp_path: Path) -> None:
    src = default_model_path()
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(src, copy)
    for mode in (FingerprintMode.SAFE, FingerprintMode.GGUF_CHUNKED):
        assert fingerprint(copy, mode) == fingerprint(src, mode)
    # Corrupting the metadata region changes the chunked fingerprint.
    with copy.open("r+b") as f:
        f.seek(64)
        byte = f.read(1)
        f.seek(64)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert fingerprint(copy, FingerprintMode.GGUF_CHUNKED) != fingerprint(
        src, FingerprintMode.GGUF_CHUNKED
    )


def test_fast_unsafe_needs_a_supplied_digest(tmp_path: Path) -> None:
    f = tmp_path / "m.bin"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError):
        fingerprint(f, FingerprintMode.FAST_UNSAFE)
    digest = bytes(range(32))
    assert fingerprint(f, FingerprintMode.FAST_UNSAFE, digest) == digest
    with pytest.raises(ConfigError):
        fingerprint(f, FingerprintMode.SAFE, digest)


def test_mode_names_parse_and_bad_ones_fail() -> None:
    assert parse_mode("gguf_chunked") is FingerprintMode.GGUF_CHUNKED
    with pytest.raises(ConfigError):
        parse_mode("sloppy")


def test_chunked_mode_rejects_a_non_gguf_file(tmp_path: Path) -> None:
    from kvwarm.errors import ModelLoadError

    f = tmp_path / "m.gguf"
    f.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(ModelLoadError):
        fingerprint(f, FingerprintMode.GGUF_CHUNKED)


@pytest.mark.parametrize("mode", [FingerprintMode.SAFE, FingerprintMode.GGUF_CHUNKED])
def test_a_split_model_is_every_parts_content(tmp_path: Path, mode: FingerprintMode) -> None:
    """Found by review: only the first part was hashed, so two models whose first parts are
    alike (the tokenizer and the first tensors of one base) shared a cache key."""
    from tests.tinymodels import write_reranker

    from kvwarm.engine.fingerprint import model_fingerprint

    mine, other = tmp_path / "mine", tmp_path / "other"
    for directory, seed in ((mine, 7), (other, 8)):
        directory.mkdir()
        write_reranker(
            directory / "m.gguf", "decoder", template=None, seed=seed, split_max_tensors=3
        )
    first = "m-00001-of-00009.gguf"
    assert (mine / "m-00009-of-00009.gguf").is_file()
    shutil.copyfile(mine / first, other / first)  # the same first part, other weights after it
    assert model_fingerprint(mine / first, mode, None) != model_fingerprint(
        other / first, mode, None
    )
    # A model in one file keeps its key.
    single = tmp_path / "single.gguf"
    write_reranker(single, "decoder", template=None)
    assert model_fingerprint(single, mode, None) == fingerprint(single, mode)
