"""Settings: one declaration per setting, one loader, precedence flags > env > file > defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvwarm.embedded import EMBEDDED_MODEL_ID, embedded_model_path, model_id_for
from kvwarm.errors import ConfigError
from kvwarm.settings import (
    ModelSpec,
    Settings,
    add_settings_arguments,
    env_var,
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


def test_cache_eviction_reaches_the_cache_config() -> None:
    assert load_settings({}, {}).cache_config().eviction == "lru"
    assert load_settings({}, {"KVWARM_CACHE_EVICTION": "lfu"}).cache_config().eviction == "lfu"
    s = load_settings(_flags("--cache-eviction", "lfu"), {"KVWARM_CACHE_EVICTION": "lru"})
    assert s.cache_config().eviction == "lfu"


def test_cache_chunk_tokens_reaches_the_cache_config() -> None:
    assert load_settings({}, {}).cache_config().chunk_tokens == 256
    env = {"KVWARM_CACHE_CHUNK_TOKENS": "1024"}
    assert load_settings({}, env).cache_config().chunk_tokens == 1024
    assert load_settings({}, {"KVWARM_CACHE_CHUNK_TOKENS": "0"}).cache_config().chunk_tokens == 0


def test_cache_state_history_reaches_the_cache_config() -> None:
    assert load_settings({}, {}).cache_config().state_history == 2
    env = {"KVWARM_CACHE_STATE_HISTORY": "-1"}
    assert load_settings({}, env).cache_config().state_history == -1


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
        ({"KVWARM_CACHE_EVICTION": "mru"}, "cache_eviction"),
        ({"KVWARM_CACHE_CHUNK_TOKENS": "384"}, "cache_chunk_tokens"),
        ({"KVWARM_CACHE_CHUNK_TOKENS": "-256"}, "cache_chunk_tokens"),
        ({"KVWARM_CACHE_STATE_HISTORY": "-2"}, "cache_state_history"),
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


def test_a_config_file_that_is_not_utf8_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tomllib decodes the file before parsing it and lets ``UnicodeDecodeError`` escape: a
    config saved as Latin-1 (or a model given as ``--config``) was a traceback, exit 1, from
    every command (found by review). Now a ``ConfigError`` naming the file: one line, exit 2."""
    from kvwarm.cli import main

    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"n_ctx = 512\n# caf\xe9 au lait\n")
    with pytest.raises(ConfigError, match=r"latin1\.toml is not valid TOML: .*not UTF-8.*0xe9"):
        load_settings({"config": str(latin1)}, {})
    code = main(["cache", "stats", "--cache-dir", "none", "--config", str(latin1)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"kvwarm: error: config file {latin1} is not valid TOML"), err
    assert err.count("\n") == 1, err


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


def test_every_setting_has_a_flag_an_env_var_a_toml_key_and_help(tmp_path: Path) -> None:
    """One declaration per setting: the field alone yields all four ways to set it."""
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, tuple(Settings.model_fields))
    help_text = " ".join(parser.format_help().split())
    for name, field in Settings.model_fields.items():
        assert field.description, name
        assert f"${env_var(name)}" in help_text, name
    # A setting added to the class is settable from TOML and env without any other table.
    config = tmp_path / "c.toml"
    config.write_text("n_threads = 3\nmax_queue = 7\n")
    s = load_settings({"config": str(config)}, {"KVWARM_MAX_QUEUE": "9"})
    assert (s.n_threads, s.max_queue) == (3, 9)
    assert load_settings(_flags("--max-queue", "11"), {"KVWARM_MAX_QUEUE": "9"}).max_queue == 11


def test_replace_validates_and_keeps_the_rest() -> None:
    base = Settings(port=9, cache_dir=None)
    changed = base.replace(n_ctx=512, api_key="k")
    assert (changed.port, changed.n_ctx, changed.api_key, base.api_key) == (9, 512, "k", None)
    with pytest.raises(ValueError, match="expected an integer, got 'lots'"):
        base.replace(n_ctx="lots")


def test_model_ids_follow_one_rule_in_settings_and_engine() -> None:
    """``ModelSpec.model_id`` and ``Engine.load_model`` name a model the same way."""
    from kvwarm.cache.types import CacheConfig, TierConfig
    from kvwarm.engine.api import Engine, EngineConfig

    assert ModelSpec().model_id == model_id_for(None) == EMBEDDED_MODEL_ID
    assert ModelSpec(path="/m/Foo.GGUF").model_id == model_id_for("/m/Foo.GGUF") == "Foo"
    assert ModelSpec(path="/m/bar").model_id == "bar"
    embedded = embedded_model_path()
    if embedded is not None:  # the embedded file keeps its short id however it is named
        assert ModelSpec(path=str(embedded)).model_id == EMBEDDED_MODEL_ID
    cache = CacheConfig(tiers=(TierConfig("ram", 1 << 20),))
    with Engine(EngineConfig(cache=cache, backend="stub")) as engine:
        assert engine.load_model("/m/stub-x.gguf").id == ModelSpec(path="/m/stub-x.gguf").model_id


def test_tenant_settings_default_off_and_reach_the_cache(tmp_path: Path) -> None:
    base = load_settings({}, {})
    assert (base.store_prompt_text, base.cache_salt_from_auth) == (False, False)
    assert base.cache_config().store_prompt_text is False
    config = tmp_path / "c.toml"
    config.write_text("store_prompt_text = true\n")
    env = {"KVWARM_CONFIG": str(config), "KVWARM_CACHE_SALT_FROM_AUTH": "1"}
    s = load_settings({}, env)
    assert (s.store_prompt_text, s.cache_salt_from_auth) == (True, True)
    assert s.cache_config().store_prompt_text is True
    off = load_settings(_flags("--store-prompt-text", "false"), env)
    assert off.cache_config().store_prompt_text is False
    with pytest.raises(ConfigError, match="cache_salt_from_auth"):
        load_settings({}, {"KVWARM_CACHE_SALT_FROM_AUTH": "maybe"})


def test_cluster_settings_are_flags_of_kvwarm_cluster_only() -> None:
    from kvwarm.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["cluster", "--replicas", "3", "--ray-address", "ray://h:10001"])
    s = load_settings(settings_flags(args), {})
    assert (s.replicas, s.ray_address, s.cluster_busy_requests) == (3, "ray://h:10001", 0)
    assert s.node_ip is None  # a local Ray stays on loopback unless asked
    assert s.cluster_routing == "events"
    joined = parser.parse_args(["cluster", "--address", "10.0.0.5:6379"])
    assert load_settings(settings_flags(joined), {}).ray_address == "10.0.0.5:6379"
    routed = parser.parse_args(["cluster", "--cluster-routing", "mine"])
    assert load_settings(settings_flags(routed), {}).cluster_routing == "mine"  # checked by deploy
    opened = parser.parse_args(["cluster", "--node-ip", "10.0.0.5"])
    assert load_settings(settings_flags(opened), {}).node_ip == "10.0.0.5"
    assert s.cluster_save_wait_s == 5.0
    waits = parser.parse_args(["cluster", "--cluster-save-wait-s", "0.5"])
    assert load_settings(settings_flags(waits), {}).cluster_save_wait_s == 0.5
    assert load_settings({}, {"KVWARM_CLUSTER_SAVE_WAIT_S": "0"}).cluster_save_wait_s == 0.0
    assert load_settings({}, {"KVWARM_REPLICAS": "5"}).replicas == 5  # env works for both
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--replicas", "3"])  # not a serve flag
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--node-ip", "10.0.0.5"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--cluster-routing", "prefix"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--cluster-save-wait-s", "1"])
    with pytest.raises(ConfigError, match="cluster_save_wait_s"):
        load_settings({}, {"KVWARM_CLUSTER_SAVE_WAIT_S": "-1"})
    with pytest.raises(ConfigError, match="replicas"):
        load_settings({}, {"KVWARM_REPLICAS": "0"})
