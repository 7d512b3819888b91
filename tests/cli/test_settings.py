"""Settings: one dataclass, one loader, precedence flags > env > file > defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvwarm.errors import ConfigError
from kvwarm.settings import (
    ModelSpec,
    Settings,
    add_settings_arguments,
    load_settings,
    settings_flags,
    user_cache_dir,
)


def _flags(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return settings_flags(parser.parse_args(list(argv)))


def test_defaults_serve_the_embedded_model_with_a_disk_tier(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "c"), "XDG_CONFIG_HOME": str(tmp_path / "none")}
    s = load_settings({}, env)
    assert s.models == (ModelSpec(),)
    assert s.models[0].model_id == "smollm2-135m-instruct"
    assert s.cache_dir == tmp_path / "c" / "kvwarm"
    assert [t.name for t in s.cache_config().tiers] == ["ram", "disk"]
    assert s.effective_save_tier() == "disk"


def test_user_cache_dir_falls_back_to_home() -> None:
    assert user_cache_dir({}) == Path.home() / ".cache" / "kvwarm"


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    config = tmp_path / "kvwarm.toml"
    config.write_text(
        'port = 1111\nn_ctx = 1024\nhost = "0.0.0.0"\n'
        "[policy]\nmin_tokens = 100\ncold_min_tokens = 200\n"
    )
    env = {
        "KVWARM_CONFIG": str(config),
        "KVWARM_PORT": "2222",
        "KVWARM_N_CTX": "2048",
        "KVWARM_POLICY_COLD_MIN_TOKENS": "300",
    }
    s = load_settings(_flags("--port", "3333", "--policy", "boundary_trim_tokens=0"), env)
    assert s.port == 3333  # flag
    assert s.n_ctx == 2048  # env over file
    assert s.host == "0.0.0.0"  # file over default
    assert s.policy.min_tokens == 100  # file
    assert s.policy.cold_min_tokens == 300  # env beats file, key by key
    assert s.policy.boundary_trim_tokens == 0  # flag


def test_models_from_flags_env_and_file(tmp_path: Path) -> None:
    s = load_settings(_flags("--model", "a=/x/a.gguf", "--model", "/y/b.gguf"), {})
    assert [(m.model_id, m.path) for m in s.models] == [("a", "/x/a.gguf"), ("b", "/y/b.gguf")]
    s = load_settings({}, {"KVWARM_MODELS": "one=/m/1.gguf, default"})
    assert [m.model_id for m in s.models] == ["one", "smollm2-135m-instruct"]
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nid = "s"\npath = "stub"\nbackend = "stub"\nn_ctx = 256\n')
    s = load_settings({"config": str(config)}, {})
    assert s.models == (ModelSpec(path="stub", id="s", backend="stub", n_ctx=256),)


def test_cache_dir_none_disables_the_disk_tier() -> None:
    s = load_settings(_flags("--cache-dir", "none"), {})
    assert s.cache_dir is None
    assert [t.name for t in s.cache_config().tiers] == ["ram"]
    assert s.effective_save_tier() == "ram"


def test_sizes_accept_suffixes() -> None:
    s = load_settings({}, {"KVWARM_DISK_QUOTA_BYTES": "2G", "KVWARM_MAX_BODY_BYTES": "512k"})
    assert s.disk_quota_bytes == 2 << 30
    assert s.max_body_bytes == 512 << 10


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KVWARM_PORT": "eighty"}, "port"),
        ({"KVWARM_PORT": "70000"}, "port"),
        ({"KVWARM_DETERMINISTIC": "maybe"}, "deterministic"),
        ({"KVWARM_POLICY_NOPE": "1"}, "nope"),
        ({"KVWARM_SAVE_TIER": "tape"}, "save_tier"),
        ({"KVWARM_MODELS": "a=/x,a=/y"}, "duplicate"),
        ({"KVWARM_CACHE_DIR": "none", "KVWARM_SAVE_TIER": "disk"}, "disk"),
    ],
)
def test_bad_values_are_config_errors_naming_the_setting(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_settings({}, env)


def test_bad_config_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("port = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings({"config": str(broken)}, {})
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("colour = 'blue'\n")
    with pytest.raises(ConfigError, match="colour"):
        load_settings({"config": str(unknown)}, {})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings({"config": str(tmp_path / "missing.toml")}, {})


def test_default_config_file_is_read_when_present(tmp_path: Path) -> None:
    (tmp_path / "kvwarm").mkdir()
    (tmp_path / "kvwarm" / "config.toml").write_text("[kvwarm]\nport = 4321\n")
    assert load_settings({}, {"XDG_CONFIG_HOME": str(tmp_path)}).port == 4321


def test_base_settings_are_the_defaults_layer() -> None:
    base = Settings(port=9, cache_dir=None)
    s = load_settings({}, {"KVWARM_N_CTX": "512"}, base=base)
    assert (s.port, s.n_ctx, s.cache_dir) == (9, 512, None)


def test_max_tokens_limit_from_every_source(tmp_path: Path) -> None:
    assert Settings().max_tokens_limit == 4096
    config = tmp_path / "limit.toml"
    config.write_text("max_tokens_limit = 1000\n")
    assert load_settings({"config": str(config)}, {}).max_tokens_limit == 1000
    env = {"KVWARM_CONFIG": str(config), "KVWARM_MAX_TOKENS_LIMIT": "2000"}
    assert load_settings({}, env).max_tokens_limit == 2000
    assert load_settings(_flags("--max-tokens-limit", "3000"), env).max_tokens_limit == 3000
    with pytest.raises(ConfigError, match="max_tokens_limit"):
        load_settings({}, {"KVWARM_MAX_TOKENS_LIMIT": "0"})
    with pytest.raises(ConfigError, match="max_tokens_limit"):
        load_settings({}, {"KVWARM_MAX_TOKENS_LIMIT": "100", "KVWARM_DEFAULT_MAX_TOKENS": "200"})
