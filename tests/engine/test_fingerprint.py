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
    from kvwarm.engine.fingerprint import model_fingerprint

    mine, other, single = _split_alike_first(tmp_path)
    assert model_fingerprint(mine, mode, None) != model_fingerprint(other, mode, None)
    assert model_fingerprint(single, mode, None) == fingerprint(single, mode)


def _split_alike_first(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The first parts of two models split in 9 whose first parts are the same file and whose
    other parts differ, and a model in one file (which keeps its key)."""
    from tests.tinymodels import write_reranker

    mine, other = tmp_path / "mine", tmp_path / "other"
    for directory, seed in ((mine, 7), (other, 8)):
        directory.mkdir()
        write_reranker(
            directory / "m.gguf", "decoder", template=None, seed=seed, split_max_tensors=3
        )
    first = "m-00001-of-00009.gguf"
    assert (mine / "m-00009-of-00009.gguf").is_file()
    shutil.copyfile(mine / first, other / first)  # the same first part, other weights after it
    single = tmp_path / "single.gguf"
    write_reranker(single, "decoder", template=None)
    return mine / first, other / first, single


def test_a_file_replaced_after_it_was_hashed_is_not_loaded_under_its_old_key(
    tmp_path: Path,
) -> None:
    """Found by review: the fingerprint was of the file as it was hashed, the weights of the
    file as the backend read it a moment later; a file replaced between the two loaded the
    new weights under the old key (their KV saved, and restored, as the old file's)."""
    from kvwarm.backends.base import ModelParams
    from kvwarm.backends.stub import StubBackend, StubModel
    from kvwarm.cache.types import CacheConfig, TierConfig
    from kvwarm.engine.api import Engine, EngineConfig, ModelConfig
    from kvwarm.errors import ModelLoadError

    f, update = tmp_path / "m.gguf", tmp_path / "update.gguf"
    f.write_bytes(b"old weights" * 100)
    update.write_bytes(b"new weights" * 100)

    class Replaced(StubBackend):
        """A backend that reads the file only once someone replaced it (``os.replace``)."""

        def load_model(self, path: str, params: ModelParams | None = None) -> StubModel:
            if update.exists():
                update.replace(f)
            return super().load_model(path, params)

    cache = CacheConfig(tiers=(TierConfig("ram", 1 << 24),))
    with Engine(EngineConfig(cache=cache)) as engine:
        with pytest.raises(ModelLoadError, match="changed on disk while it loaded"):
            engine.load_model(f, config=ModelConfig(backend=Replaced()))
        # Loaded again, its fingerprint is of the file it now is.
        model = engine.load_model(f, config=ModelConfig(backend=Replaced()))
        assert fingerprint(f, FingerprintMode.SAFE) in model.cache_fingerprints()


@pytest.mark.parametrize("companion", ["draft_model", "mmproj"])
def test_a_companion_file_replaced_after_it_was_read_is_not_loaded_under_the_new_files_key(
    tmp_path: Path, companion: str
) -> None:
    """A draft model (or a projector) was read first and hashed after: a file replaced
    between the two loaded the old weights under the new file's key, so the draft context's
    rows (an image's KV) were saved, and later restored, as the new file's (found by review,
    the gap the model's own load had)."""
    from dataclasses import replace

    from tests.engine.conftest import make_engine, stub_config

    from kvwarm.backends.base import ModelParams, ProjectorParams
    from kvwarm.backends.stub import StubBackend, StubModel
    from kvwarm.backends.stub.projector import StubProjector
    from kvwarm.engine.fingerprint import companion_fingerprint, model_fingerprint, with_projector
    from kvwarm.errors import ModelLoadError

    f, update = tmp_path / "companion.gguf", tmp_path / "update.gguf"
    f.write_bytes(b"old weights" * 100)
    update.write_bytes(b"new weights" * 100)

    class Replaced(StubBackend):
        """A backend whose read of the companion file is followed by its replacement."""

        def load_model(self, path: str, params: ModelParams | None = None) -> StubModel:
            loaded = super().load_model(path, params)
            if path == str(f) and update.exists():
                update.replace(f)
            return loaded

    load_projector = StubModel.load_projector

    def replaced_projector(self: StubModel, path: str, params: ProjectorParams) -> StubProjector:
        loaded = load_projector(self, path, params)
        if path == str(f) and update.exists():
            update.replace(f)
        return loaded

    config = replace(stub_config(1, backend=Replaced()), **{companion: str(f)})
    with make_engine() as engine, pytest.MonkeyPatch.context() as mp:
        mp.setattr(StubModel, "load_projector", replaced_projector)
        with pytest.raises(ModelLoadError, match="changed on disk while it loaded"):
            engine.load_model(config=config)
        # Loaded again, its key is of the file it now is.
        model = engine.load_model(config=config)
        now = companion_fingerprint(f, FingerprintMode.SAFE)
        if companion == "draft_model":
            assert model._draft is not None and model._draft.namespace.fingerprint == now
        else:
            target = model_fingerprint(model.path, FingerprintMode.SAFE, None)
            assert model._fingerprint == with_projector(target, f, FingerprintMode.SAFE)


@pytest.mark.parametrize("mode", [FingerprintMode.SAFE, FingerprintMode.FAST_UNSAFE])
def test_a_split_draft_model_is_every_parts_content(tmp_path: Path, mode: FingerprintMode) -> None:
    """A draft model's key is its file's as a model's is (found by review: only a split draft
    model's first part was hashed, so draft models whose first parts are alike restored each
    other's draft rows)."""
    from kvwarm.engine.fingerprint import companion_fingerprint

    mine, other, single = _split_alike_first(tmp_path)
    assert companion_fingerprint(mine, mode) != companion_fingerprint(other, mode)
    assert companion_fingerprint(single, mode) == fingerprint(single, FingerprintMode.SAFE)
