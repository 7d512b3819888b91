"""The projector (``--mmproj``) and the media limits: flag, env, TOML, a models directory's
pairing, and bad values as ``ConfigError``s before anything loads."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvwarm import models_dir
from kvwarm.errors import ConfigError
from kvwarm.media import MediaLimits
from kvwarm.settings import add_settings_arguments, load_settings, model_config, settings_flags

ENV = {"XDG_CONFIG_HOME": "/nonexistent-kvwarm-test"}


def _flags(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return settings_flags(parser.parse_args(list(argv)))


def test_mmproj_and_media_limits_from_flag_env_and_toml(tmp_path: Path) -> None:
    proj = tmp_path / "mmproj-x.gguf"
    proj.write_bytes(b"GGUF")
    s = load_settings(
        _flags(
            "--mmproj", str(proj), "--media-max-items", "3", "--media-format", "png",
            "--media-format", "jpeg", "--media-max-bytes", "1M",
            "--media-max-request-bytes", "64M",
        ),
        ENV,
    )  # fmt: skip
    cfg = model_config(s, s.models[0])
    assert cfg.mmproj == str(proj)
    assert cfg.media == MediaLimits(
        max_bytes=1 << 20, max_pixels=16 << 20, max_audio_s=300.0, max_items=3,
        formats=("png", "jpeg"), max_request_bytes=64 << 20,
    )  # fmt: skip
    env = load_settings({}, {**ENV, "KVWARM_MMPROJ": str(proj)})
    assert model_config(env, env.models[0]).mmproj == str(proj)
    config = tmp_path / "c.toml"
    config.write_text(
        f'[[models]]\npath = "a.gguf"\nid = "seeing"\nmmproj = "{proj}"\n'
        '[[models]]\npath = "b.gguf"\nid = "blind"\n'
    )
    t = load_settings({"config": str(config), "backend": "stub"}, ENV)
    assert [model_config(t, m).mmproj for m in t.models] == [str(proj), None]


def test_bad_media_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mmproj: no projector file"):
        load_settings(_flags("--mmproj", str(tmp_path / "missing.gguf")), ENV).check()
    with pytest.raises(ConfigError, match="media_formats: unknown formats tiff"):
        load_settings(_flags("--media-format", "tiff"), ENV).check()
    with pytest.raises(ConfigError, match="media_max_pixels must be >= 1, got 0"):
        load_settings(_flags("--media-max-pixels", "0"), ENV).check()


def test_a_models_directory_pairs_projectors_with_their_models(tmp_path: Path) -> None:
    for name in ("gemma.gguf", "mmproj-gemma.gguf", "smol.gguf", "smol.mmproj.gguf", "plain.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    found = models_dir.scan(tmp_path)
    assert sorted(found) == ["gemma", "plain", "smol"]  # a projector is never a model
    pairs = {
        name: models_dir.projector_for(tmp_path, path, len(found)) for name, path in found.items()
    }
    assert pairs == {
        "gemma": tmp_path / "mmproj-gemma.gguf",
        "smol": tmp_path / "smol.mmproj.gguf",
        "plain": None,
    }
    one = tmp_path / "one"
    one.mkdir()
    (one / "gemma-3-4b-it-Q4_K_M.gguf").write_bytes(b"GGUF")
    (one / "mmproj-model-f16.gguf").write_bytes(b"GGUF")
    (model,) = models_dir.scan(one).values()
    assert models_dir.projector_for(one, model, 1) == one / "mmproj-model-f16.gguf"
