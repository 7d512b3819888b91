"""The configuration surface as a whole (found by the settings review): a typo in any source is
an error or at least said, never silently nothing; messages name the setting and what it
takes."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from kvwarm.errors import ConfigError
from kvwarm.settings import (
    Settings,
    add_settings_arguments,
    default_text,
    load_settings,
    settings_reference,
)


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
        ("n_ctx = 4096.5", "config file setting n_ctx: expected an integer, got 4096.5"),
        ('n_ctx = "lots"', "config file setting n_ctx: expected an integer, got 'lots'"),
        ("port = nan", "config file setting port: expected an integer, got nan"),
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
    literal for int() with base 10"."""
    config = tmp_path / "kvwarm.toml"
    config.write_text(toml + "\n")
    with pytest.raises(ConfigError) as caught:
        load_settings({"config": str(config)}, {})
    assert message in str(caught.value)


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
