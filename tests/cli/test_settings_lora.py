"""The ``lora`` setting (``NAME=PATH``): from flags, env and TOML (globally: the first model's;
in a ``[[models]]`` table: that model's) to ``ModelConfig.lora``; an adapter that is no LoRA
adapter, is missing, or was made for another architecture is a ``ConfigError`` before any
model loads (``settings/model.py``). Real GGUF headers, written with the ``gguf`` package; no
model is loaded."""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import pytest
from tests.backends.lora_fixture import make_lora

from kvwarm.embedded import default_model_path
from kvwarm.errors import ConfigError
from kvwarm.settings import add_settings_arguments, load_settings, model_config, settings_flags

# Reads the embedded model's GGUF header (never loads it): fractions of a second.
pytestmark = pytest.mark.model

ENV = {"XDG_CONFIG_HOME": "/nonexistent-kvwarm-test"}


def _flags(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return settings_flags(parser.parse_args(list(argv)))


@pytest.fixture(scope="module")
def smol_lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "smol-lora.gguf"
    return make_lora(default_model_path(), out, rank=2, layers=(0,))


def _foreign_adapter(path: Path, arch: str) -> Path:
    """A LoRA adapter header for another architecture (no tensors: the check reads the
    header only)."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 4.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_lora_from_flags_env_and_toml_reaches_the_first_models_config(
    smol_lora: Path, tmp_path: Path
) -> None:
    flags = load_settings(_flags("--lora", f"sql={smol_lora}", "--lora", str(smol_lora)), ENV)
    assert flags.lora == (("sql", str(smol_lora)), ("smol-lora", str(smol_lora)))
    cfg = model_config(flags, flags.models[0])
    assert [(s.name, s.path, s.scale) for s in cfg.lora] == [
        ("sql", str(smol_lora), 0.0),
        ("smol-lora", str(smol_lora), 0.0),
    ]
    env = load_settings({}, {**ENV, "KVWARM_LORA": f"sql={smol_lora}"})
    assert env.lora == (("sql", str(smol_lora)),)
    config = tmp_path / "c.toml"
    config.write_text(
        f'[[models]]\nid = "m"\nlora = {{ sql = "{smol_lora}" }}\n'
        f'[[models]]\nid = "n"\nbackend = "stub"\npath = "stub-n"\n'
    )
    toml = load_settings({"config": str(config)}, ENV)
    by_id = {spec.model_id: model_config(toml, spec) for spec in toml.models}
    assert [s.name for s in by_id["m"].lora] == ["sql"] and by_id["n"].lora == ()


def test_a_global_lora_is_the_first_models_alone(smol_lora: Path) -> None:
    s = load_settings(
        _flags("--model", "m=default", "--model", "n=default", "--lora", f"x={smol_lora}"), ENV
    )
    assert [len(model_config(s, spec).lora) for spec in s.models] == [1, 0]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (("--lora", "x="), "expected NAME=PATH"),
        (("--lora", "x=/no/such.gguf"), "no such file"),
        (("--model", "m=default", "--lora", "m={lora}"), "name of a model or alias"),
        (("--alias", "gpt=m", "--model", "m=default", "--lora", "gpt={lora}"), "model or alias"),
        (("--lora", "x={lora}", "--lora", "x={lora}"), "given twice"),
        (("--lora", "x={model}"), "not a LoRA adapter"),
        (("--lora", "x={garbage}"), "not a readable GGUF"),
        (("--lora", "x={foreign}"), "'gemma3' architecture; model .* is 'llama'"),
        (("--models-dir", "{dir}", "--lora", "x={lora}"), "first configured model; there is none"),
    ],
)
def test_an_adapter_that_cannot_fit_is_refused_at_startup(
    smol_lora: Path, tmp_path: Path, argv: tuple[str, ...], error: str
) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    files = {
        "lora": smol_lora,
        "model": default_model_path(),
        "garbage": garbage,
        "foreign": _foreign_adapter(tmp_path / "foreign.gguf", "gemma3"),
        "dir": tmp_path,
    }
    with pytest.raises(ConfigError, match=error):
        load_settings(_flags(*(a.format(**files) for a in argv)), ENV)


def test_two_models_may_not_serve_one_adapter_name(smol_lora: Path, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        f'[[models]]\nid = "m"\nlora = ["x={smol_lora}"]\n'
        f'[[models]]\nid = "n"\nlora = ["x={smol_lora}"]\n'
    )
    with pytest.raises(ConfigError, match="given twice"):
        load_settings({"config": str(config)}, ENV)


def test_the_stub_backend_takes_any_file(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"stub adapter")
    s = load_settings(
        _flags("--backend", "stub", "--model", "m=stub-m", "--lora", f"x={fake}"), ENV
    )
    assert model_config(s, s.models[0]).lora[0].path == str(fake)
