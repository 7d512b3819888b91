"""The configuration surface as a whole (found by the settings review): a typo in any source is
an error or at least said, never silently nothing; messages name the setting and what it
takes."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwarm.errors import ConfigError
from kvwarm.settings import (
    Settings,
    add_settings_arguments,
    default_text,
    env_var,
    load_settings,
    settings_reference,
)
from kvwarm.settings.flags import field_extra


@pytest.mark.parametrize(
    ("var", "meant"),
    [
        ("KVWARM_N_CTXX", "KVWARM_N_CTX"),
        ("KVWARM_NCTX", "KVWARM_N_CTX"),
        ("KVWARM_N_PARALEL", "KVWARM_N_PARALLEL"),
        ("KVWARM_MODEL_DIR", "KVWARM_MODELS_DIR"),
        ("KVWARM_API_KEYS", "KVWARM_API_KEY"),
        ("kvwarm_cache_dirr", "KVWARM_CACHE_DIR"),
    ],
)
def test_a_misspelled_environment_setting_is_refused(var: str, meant: str) -> None:
    """It was ignored: ``KVWARM_API_KEYS=secret`` served with no key at all."""
    with pytest.raises(ConfigError, match=f"{var} is not a kvwarm setting; did you mean {meant}"):
        load_settings({}, {var: "5"})


def test_another_kvwarm_variable_is_logged_and_the_known_ones_are_quiet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    known = {
        "KVWARM_MODEL": "x.gguf",  # the library's default model, not a setting
        "KVWARM_STUB_DECODE_DELAY_S": "0",
        "KVWARM_TEST_GPU_LAYERS": "99",  # the test suite's
        "KVWARM_GEMMA": "/m.gguf",
        "KVWARM_POLICY_MIN_TOKENS": "64",  # checked with the policy
        "OTHER_TOOL_SETTING": "1",
    }
    with caplog.at_level(logging.WARNING, logger="kvwarm.settings.sources"):
        load_settings({}, known)
        assert not caplog.records
        load_settings({}, {"KVWARM_SOMETHING_ELSE_ENTIRELY": "1"})
    assert [r.getMessage() for r in caplog.records] == [
        "environment variable KVWARM_SOMETHING_ELSE_ENTIRELY is not a kvwarm setting; ignored"
    ]


def test_every_setting_is_still_read_from_its_variable(tmp_path: Path) -> None:
    config = tmp_path / "kvwarm.toml"
    config.write_text("n_parallel = 2\n")
    settings = load_settings({}, {"KVWARM_N_CTX": "2048", "KVWARM_CONFIG": str(config)})
    assert (settings.n_ctx, settings.n_parallel) == (2048, 2)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("n_ctx = 4096.5", "{config} setting n_ctx: expected an integer, got 4096.5"),
        ('n_ctx = "lots"', "{config} setting n_ctx: expected an integer, got 'lots'"),
        ("port = nan", "{config} setting port: expected an integer, got nan"),
        ('request_timeout_s = "soon"', "request_timeout_s: expected a number, got 'soon'"),
        ("request_timeout_s = [1]", "request_timeout_s: expected a number, got [1]"),
        ("deterministic = 1", "deterministic: expected a boolean, got 1"),
        ("ram_quota_bytes = 1.5", "ram_quota_bytes: expected a size like 512M or 20G, got 1.5"),
        ("flash_attn = 1", "flash_attn: expected one of auto, on, off, got 1"),
    ],
)
def test_a_value_of_the_wrong_type_says_what_the_setting_takes(
    tmp_path: Path, toml: str, message: str
) -> None:
    """They said "expected a string, got float" (of an integer setting) or Python's "invalid
    literal for int() with base 10"; and "config file setting ...", not which file (found by
    review: the default one, or $KVWARM_CONFIG's, had to be guessed)."""
    config = tmp_path / "kvwarm.toml"
    config.write_text(toml + "\n")
    with pytest.raises(ConfigError) as caught:
        load_settings({"config": str(config)}, {})
    assert message.format(config=f"config file {config}") in str(caught.value)
    assert f"config file {config} setting " in str(caught.value)


def test_a_models_dir_that_does_not_exist_is_refused_at_start(tmp_path: Path) -> None:
    """The server started with it, logged a warning and served no model at all."""
    missing = tmp_path / "modles"
    with pytest.raises(ConfigError, match=f"models_dir {missing} does not exist"):
        load_settings({"models_dir": str(missing)}, {})
    afile = tmp_path / "a.gguf"
    afile.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="is not a directory"):
        load_settings({}, {"KVWARM_MODELS_DIR": str(afile)})
    (tmp_path / "models").mkdir()
    assert load_settings({"models_dir": str(tmp_path / "models")}, {}).models == ()


def test_a_rule_broken_names_where_each_value_came_from(tmp_path: Path) -> None:
    """A range or cross-setting rule named no source: a wrong value had to be hunted down in
    the config file, the environment and the flags."""
    config = tmp_path / "kvwarm.toml"
    config.write_text("n_ctx = 0\n")
    with pytest.raises(ConfigError) as caught:
        load_settings({}, {"KVWARM_CONFIG": str(config)})
    assert str(caught.value) == f"n_ctx must be >= 1 (n_ctx from config file {config})"
    with pytest.raises(ConfigError, match=r"\(replicas from KVWARM_REPLICAS\)$"):
        load_settings({}, {"KVWARM_REPLICAS": "0"})
    with pytest.raises(ConfigError, match=r"got 384 \(cache_chunk_tokens from --cache-chunk-tok"):
        load_settings({"cache_chunk_tokens": "384"}, {})
    # The last source wins, and is the one named.
    with pytest.raises(ConfigError, match=r"\(n_threads from --n-threads\)$"):
        load_settings({"n_threads": "-1"}, {"KVWARM_N_THREADS": "2"})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # The engine refused it once the server had started (exit status 1).
        ({"tiers": ["disk=file:///tmp/elsewhere?quota=1G"]}, "tiers: tier disk configured twice"),
        ({"tiers": ["a=ram://?quota=1M", "a=ram://?quota=2M"]}, "tiers: tier a configured twice"),
        ({"tiers": ["nothing"]}, "tiers: a tier is NAME=URL"),
        # "media limits must be positive" named none of them.
        ({"media_max_bytes": "0"}, "media_max_bytes must be >= 1, got 0"),
        ({"media_max_items": "-1"}, "media_max_items must be >= 0, got -1"),
    ],
)
def test_tier_and_media_errors_name_their_setting(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(flags, {})


def test_configuration_md_lists_every_setting_with_its_default() -> None:
    """Ten settings (fingerprint_mode, ram_quota_bytes, default_max_tokens, the keep-alive
    bounds, worker_stall_s, allowed_hosts ...) were documented nowhere but in --help."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = settings_reference()
    assert table in docs, (
        "docs/configuration.md's 'Every setting' table is not the code's: paste "
        "kvwarm.settings.settings_reference() there"
    )
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(Settings.model_fields)
    assert "| `n_ctx` | `--n-ctx` | 4096 |" in table
    assert "| `ram_quota_bytes` | `--ram-quota-bytes` | 1G |" in table


def test_help_shows_each_default() -> None:
    """``kvwarm serve --help`` showed no default at all."""
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    text = " ".join(parser.format_help().split())
    for name in ("n_ctx", "ram_quota_bytes", "keepalive_max_entries", "flash_attn"):
        assert f"($KVWARM_{name.upper()}; default: {default_text(name)})" in text, name


# --- a property test over the loader ------------------------------------------------------------

_NAMES = sorted(Settings.model_fields)
_SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.booleans(),
    st.sampled_from(["0", "1", "-1", "4096", "1G", "nan", "all", "none", "on", "a=b", "x=/y"]),
)
_TOML_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=3))
_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=12,
) | st.sampled_from(["0", "2", "-5", "4096", "512M", "nan", "inf", "true", "auto", "a=b"])


def _toml(value: object) -> str:
    """``value`` written as TOML (json's string escapes are TOML's basic-string escapes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("-inf" if value < 0 else "inf") if math.isinf(value) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    file=st.dictionaries(st.sampled_from(_NAMES), _TOML_VALUES, max_size=3),
    env=st.dictionaries(st.sampled_from(_NAMES), _TEXT, max_size=3),
    flags=st.dictionaries(st.sampled_from(_NAMES), _TEXT, max_size=3),
)
def test_any_values_from_any_source_load_or_are_a_config_error(
    tmp_path_factory: pytest.TempPathFactory,
    file: dict[str, object],
    env: dict[str, str],
    flags: dict[str, str],
) -> None:
    """Whatever a file, the environment and the flags hold, ``load_settings`` returns settings
    or raises ``ConfigError``: never another exception (a traceback at start)."""
    config = tmp_path_factory.mktemp("cfg") / "kvwarm.toml"
    config.write_text("".join(f"{name} = {_toml(value)}\n" for name, value in file.items()))
    environ = {env_var(name): value for name, value in env.items()}
    environ["KVWARM_CONFIG"] = str(config)
    environ["XDG_CACHE_HOME"] = str(config.parent / "cache")
    given_flags: dict[str, object] = {
        name: [value] if field_extra(Settings, name).get("repeatable") else value
        for name, value in flags.items()
    }
    try:
        loaded = load_settings(given_flags, environ)
    except ConfigError:
        return
    loaded.cache_config()  # what serve builds from it next
    loaded.media_limits()


@settings(max_examples=100, deadline=None)
@given(
    file=st.none() | st.integers(16, 1 << 20),
    env=st.none() | st.integers(16, 1 << 20),
    flag=st.none() | st.integers(16, 1 << 20),
)
def test_precedence_is_flag_then_environment_then_file_then_default(
    tmp_path_factory: pytest.TempPathFactory, file: int | None, env: int | None, flag: int | None
) -> None:
    config = tmp_path_factory.mktemp("cfg") / "kvwarm.toml"
    config.write_text("" if file is None else f"n_ctx = {file}\nport = {file % 65536}\n")
    environ = {"KVWARM_CONFIG": str(config)}
    if env is not None:
        environ["KVWARM_N_CTX"] = str(env)
    flags = {} if flag is None else {"n_ctx": str(flag)}
    loaded = load_settings(flags, environ)
    expected = next((v for v in (flag, env, file) if v is not None), Settings().n_ctx)
    assert loaded.n_ctx == expected
    assert loaded.port == (8000 if file is None else file % 65536)  # untouched by the others


@pytest.mark.parametrize("name", ["cache_dir", "shm_dir"])
def test_a_cache_directory_that_is_a_file_is_refused_at_start(tmp_path: Path, name: str) -> None:
    """The engine refused it only once the server had started (exit status 1)."""
    afile = tmp_path / "rows"
    afile.write_text("")
    with pytest.raises(ConfigError, match=f"{name} {afile} is not a directory"):
        load_settings({name: str(afile)}, {})
    assert getattr(load_settings({name: str(tmp_path / "new")}, {}), name) == tmp_path / "new"


def test_an_unknown_backend_is_refused_at_start(tmp_path: Path) -> None:
    """The server started, then could load no model (exit status 1)."""
    with pytest.raises(ConfigError, match=r"backend 'llama' is not one of llama_cpp, stub"):
        load_settings({}, {"KVWARM_BACKEND": "llama"})
    config = tmp_path / "kvwarm.toml"
    config.write_text('[[models]]\nid = "m"\npath = "m.gguf"\nbackend = "sub"\n')
    with pytest.raises(ConfigError, match=r"model m: backend 'sub' is not one of"):
        load_settings({"config": str(config)}, {})


@pytest.mark.parametrize("name", ["api_key", "admin_key"])
@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_key_is_refused_not_read_as_no_key(name: str, value: str) -> None:
    """``KVWARM_API_KEY=`` (a secret never filled in) served every model with no key."""
    with pytest.raises(ConfigError, match=f"environment setting {name}: is empty"):
        load_settings({}, {env_var(name): value})
    assert getattr(load_settings({}, {env_var(name): "s3cret"}), name) == "s3cret"
    assert getattr(load_settings({}, {}), name) is None


def test_log_levels_help_names_every_level_it_accepts() -> None:
    """``--help`` said "debug, info, warning, error"; critical loads too."""
    description = Settings.model_fields["log_level"].description or ""
    for level in ("debug", "info", "warning", "error", "critical"):
        assert load_settings({"log_level": level}, {}).log_level == level
        assert level in description, level


def test_a_policy_variable_without_its_key_says_how_to_give_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: ``KVWARM_POLICY=min_tokens=64`` was logged as "not a kvwarm setting;
    ignored", then stopped the command with "environment setting policy: expected a table of
    policy values": neither true, nor a word of ``KVWARM_POLICY_<KEY>``."""
    needle = r"KVWARM_POLICY_<KEY> \(KVWARM_POLICY_MIN_TOKENS="
    with (
        caplog.at_level(logging.WARNING, logger="kvwarm.settings.sources"),
        pytest.raises(ConfigError, match=needle),
    ):
        load_settings({}, {"KVWARM_POLICY": "min_tokens=64"})
    assert not caplog.records
    assert load_settings({}, {"KVWARM_POLICY_MIN_TOKENS": "64"}).policy.min_tokens == 64


def test_help_names_the_config_file_read_by_default() -> None:
    """``--config``'s help said "TOML file ($KVWARM_CONFIG)": not that a file is read
    without it (``user_config_file``), whose settings then apply unasked."""
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "default: $XDG_CONFIG_HOME/kvwarm/config.toml, else ~/.config/kvwarm/config.toml" in text


@pytest.mark.parametrize(
    ("var", "meant"),
    [
        ("KVWARM_CACHE_TYPE_K", "KVWARM_TYPE_K"),  # the flag --cache-type-k as a variable
        ("KVWARM_CACHE_TYPE_V", "KVWARM_TYPE_V"),
        ("KVWARM_MODEL_DRAFT", "KVWARM_DRAFT_MODEL"),
        ("KVWARM_ADDRESS", "KVWARM_RAY_ADDRESS"),
    ],
)
def test_a_flags_name_as_a_variable_is_refused_naming_the_settings(var: str, meant: str) -> None:
    """Found by review: the Model settings table leads with ``--cache-type-k``, and
    ``KVWARM_CACHE_TYPE_K=q8_0`` was only logged as ignored: the server ran f16 cells. A
    variable spelled after one of a setting's flags is that setting's name misspelled."""
    with pytest.raises(ConfigError, match=f"{var} is not a kvwarm setting; did you mean {meant}"):
        load_settings({}, {var: "q8_0"})
    # KVWARM_MODEL (the flag --model's spelling) is the default model's path, read elsewhere.
    load_settings({}, {"KVWARM_MODEL": "x.gguf"})


# One setting of each kind: (name, TOML value, env value, flag value, what each loads as).
_KINDS = [
    ("spec_exact", "false", "true", "false", (False, True, False)),  # bool
    ("n_batch", "256", "128", "64", (256, 128, 64)),  # int
    ("request_timeout_s", "11.5", "12", "13.25", (11.5, 12.0, 13.25)),  # float
    ("ram_quota_bytes", '"2G"', "3G", "4M", (2 << 30, 3 << 30, 4 << 20)),  # size
    (
        "allowed_origins",
        '["http://a:1", "http://b:2"]',
        "http://c:3",
        ["http://d:4"],
        (("http://a:1", "http://b:2"), ("http://c:3",), ("http://d:4",)),
    ),  # list
    ("aliases", '{ x = "m" }', "y=m", ["z=m"], ((("x", "m"),), (("y", "m"),), (("z", "m"),))),
]


@pytest.mark.parametrize(("name", "toml", "env", "flag", "loaded"), _KINDS)
def test_precedence_holds_for_every_kind_of_setting(
    tmp_path: Path, name: str, toml: str, env: str, flag: object, loaded: tuple[object, ...]
) -> None:
    """flags > environment > config file > default, whatever the setting's type (the
    property test above draws integers only); a list or a table is replaced whole, not
    merged (only the policy merges, key by key)."""
    config = tmp_path / "kvwarm.toml"
    config.write_text(f'{name} = {toml}\n[[models]]\nid = "m"\npath = "stub-m"\nbackend = "stub"\n')
    environ = {"KVWARM_CONFIG": str(config), "XDG_CACHE_HOME": str(tmp_path)}
    assert getattr(load_settings({}, environ), name) == loaded[0]
    environ[env_var(name)] = env
    assert getattr(load_settings({}, environ), name) == loaded[1]
    assert getattr(load_settings({name: flag}, environ), name) == loaded[2]


def test_a_models_tables_value_wins_over_every_global_source(tmp_path: Path) -> None:
    """docs/configuration.md: a [[models]] table's value wins (the flag's included) for that
    model; the global value, from whichever source, applies to the others."""
    from kvwarm.settings.model import hardware_params

    config = tmp_path / "kvwarm.toml"
    config.write_text(
        'n_gpu_layers = 7\n[[models]]\nid = "a"\npath = "stub-a"\nn_gpu_layers = 3\n'
        'n_ctx = 512\n[[models]]\nid = "b"\npath = "stub-b"\n'
    )
    environ = {"KVWARM_CONFIG": str(config), "KVWARM_BACKEND": "stub", "KVWARM_N_GPU_LAYERS": "9"}
    loaded = load_settings({"n_gpu_layers": "11", "n_ctx": "2048"}, environ)
    a, b = (hardware_params(loaded, spec) for spec in loaded.models)
    assert (a[1].n_gpu_layers, a[0].n_ctx) == (3, 512)
    assert (b[1].n_gpu_layers, b[0].n_ctx) == (11, 2048)


def test_list_variables_split_on_commas_where_the_docs_say_so() -> None:
    """docs/configuration.md: a list setting's variable takes one entry, but models, lora,
    aliases (several, separated by commas) and tensor_split (its shares)."""
    env = {
        "KVWARM_BACKEND": "stub",
        "KVWARM_MODELS": "a=stub-a,b=stub-b",
        "KVWARM_ALIASES": "x=a,y=b",
        "KVWARM_TENSOR_SPLIT": "3,1",
        "KVWARM_PREWARM_SYSTEM": "Be brief, and kind.",
    }
    loaded = load_settings({}, env)
    assert [m.model_id for m in loaded.models] == ["a", "b"]
    assert loaded.aliases == (("x", "a"), ("y", "b")) and loaded.tensor_split == (3.0, 1.0)
    assert loaded.prewarm_system == ("Be brief, and kind.",)
