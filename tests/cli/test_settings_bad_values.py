"""Bad setting values are a ``ConfigError`` (exit status 2, one line naming the setting).

- ``log_level`` was a free string: ``--log-level verbose`` (or ``KVWARM_LOG_LEVEL=verbose``)
  crashed in ``logging.basicConfig`` with a traceback and exit status 1.
- Number settings took ``nan``: ``model_idle_unload_s=nan`` and ``keepalive_interval_s=nan``
  passed every ``< 0`` check, and the background loops' ``Event.wait(nan)`` returned at once,
  spinning a core for the server's whole life.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.cli.test_cli import clean_env

from kvwarm.errors import ConfigError
from kvwarm.settings import Settings, env_var, load_settings


@pytest.mark.parametrize("how", ["flag", "env"])
def test_unknown_log_level_is_a_usage_error_not_a_traceback(tmp_path: Path, how: str) -> None:
    env = clean_env(tmp_path)
    args = [sys.executable, "-m", "kvwarm", "models"]
    if how == "flag":
        args += ["--log-level", "verbose"]
    else:
        env["KVWARM_LOG_LEVEL"] = "verbose"
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert "Traceback" not in result.stderr, result.stderr[-600:]
    assert result.returncode == 2, (result.returncode, result.stderr[-600:])
    assert "log_level" in result.stderr or "log-level" in result.stderr, result.stderr


def test_unknown_log_level_is_refused_by_load_settings() -> None:
    with pytest.raises(ConfigError, match="log"):
        load_settings({"log_level": "verbose"}, {})


@pytest.mark.parametrize("name", ["model_idle_unload_s", "keepalive_interval_s"])
def test_nan_seconds_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=name.replace("_", "[-_]")):
        load_settings({name: "nan"}, {})


@pytest.mark.parametrize("name", ["request_timeout_s", "worker_stall_s"])
def test_negative_seconds_are_refused_not_read_as_off(name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be >= 0"):
        load_settings({name: -1.0}, {})


# --- every number setting, from every source, must be finite (found by review) -------------
# request_timeout_s = nan meant no deadline at all and cluster_save_wait_s = nan no wait;
# the check ran after the sources were merged, so the error did not say where the value came
# from, and sizes, tier URLs and the s3 timeouts (without a bucket) were not checked at all.

FLOAT_SETTINGS = sorted(
    name for name, field in Settings.model_fields.items() if field.annotation is float
)


def test_the_float_settings_are_the_ones_the_review_named() -> None:
    assert {"request_timeout_s", "cluster_save_wait_s", "keepalive_interval_s"} <= set(
        FLOAT_SETTINGS
    )


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
@pytest.mark.parametrize("name", FLOAT_SETTINGS)
@pytest.mark.parametrize("source", ["flag", "environment", "config file"])
def test_a_float_setting_that_is_not_finite_names_its_source_and_setting(
    tmp_path: Path, source: str, name: str, value: str
) -> None:
    flags: dict[str, object] = {}
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    label, where = name, source
    if source == "flag":
        flags[name] = value
        label = "--" + name.replace("_", "-")
    elif source == "environment":
        env[env_var(name)] = value
    else:
        config = tmp_path / "kvwarm.toml"
        # TOML spells them nan, inf, -inf; 1e400 is a float literal too large for a double.
        config.write_text(f"{name} = {value}\n")
        flags["config"] = str(config)
        where = f"config file {config}"  # which one: the default, $KVWARM_CONFIG's, --config
    with pytest.raises(ConfigError, match=re.escape(f"{where} setting {label}: expected a finite")):
        load_settings(flags, env)


@pytest.mark.parametrize("name", ["rope_freq_base", "yarn_ext_factor"])
def test_a_per_model_float_that_is_not_finite_is_refused(tmp_path: Path, name: str) -> None:
    config = tmp_path / "kvwarm.toml"
    config.write_text(f'[[models]]\npath = "default"\n{name} = nan\n')
    with pytest.raises(ConfigError, match=f"{name}: expected a finite number"):
        load_settings({"config": str(config)}, {"XDG_CONFIG_HOME": str(tmp_path)})


@pytest.mark.parametrize("value", ["9" * 400, "1" * 30 + "T", "9223372036854775808"])
def test_a_size_past_int64_is_a_config_error_not_an_overflow(value: str) -> None:
    with pytest.raises(ConfigError, match="environment setting ram_quota_bytes: must be at most"):
        load_settings({}, {"KVWARM_RAM_QUOTA_BYTES": value})


@pytest.mark.parametrize("name", ["s3_connect_timeout_s", "s3_read_timeout_s"])
def test_s3_timeouts_are_checked_without_a_bucket(name: str) -> None:
    with pytest.raises(ConfigError, match="must be > 0"):
        load_settings({name: "-1"}, {})


@pytest.mark.parametrize(
    "query",
    ["connect_timeout_s=nan", "read_timeout_s=inf", "read_timeout_s=-1", "down_for_s=nan"],
)
def test_an_s3_tier_url_option_must_be_finite(query: str) -> None:
    from kvwarm.cache.tiers.s3 import s3_config_from_url

    with pytest.raises(ConfigError, match=query.split("=", maxsplit=1)[0]):
        s3_config_from_url(f"s3://bucket/prefix/?{query}")


@pytest.mark.parametrize("query", ["timeout_s=nan", "down_for_s=inf", "down_for_s=nan"])
def test_a_redis_tier_url_option_must_be_finite(query: str) -> None:
    pytest.importorskip("redis")
    from kvwarm.cache.tiers.redis import RedisStore

    with pytest.raises(ConfigError, match="finite"):
        RedisStore(f"redis://127.0.0.1:1/0?{query}")  # refused before any connection


@pytest.mark.parametrize(
    ("command", "flag"),
    [("serve", "--request-timeout-s"), ("cluster", "--cluster-save-wait-s")],
)
def test_the_cli_refuses_a_nan_deadline(tmp_path: Path, command: str, flag: str) -> None:
    args = [sys.executable, "-m", "kvwarm", command, flag, "nan", "--port", "0"]
    result = subprocess.run(
        args, capture_output=True, text=True, env=clean_env(tmp_path), timeout=120, check=False
    )
    assert "Traceback" not in result.stderr, result.stderr[-600:]
    assert result.returncode == 2, (result.returncode, result.stderr[-600:])
    assert f"flag setting {flag}: expected a finite number" in result.stderr, result.stderr


# --- paths no stat can answer (found by review) --------------------------------------------
# Path.exists / is_dir / is_file raise for a name too long, a directory not searchable or a
# NUL byte (a TOML string may hold one): every command given such a cache_dir, shm_dir,
# models_dir, mmproj, --scan or model path stopped with an OSError's traceback, exit status 1.


def _unstattable(tmp_path: Path) -> Path:
    return tmp_path / ("a" * 300)  # one component past NAME_MAX: ENAMETOOLONG


@pytest.mark.parametrize("name", ["cache_dir", "shm_dir", "models_dir"])
def test_a_directory_no_stat_can_answer_is_a_config_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"{name} .*name too long \({name} from --"):
        load_settings({name: str(_unstattable(tmp_path))}, {})


def test_a_nul_byte_in_a_configured_path_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "kvwarm.toml"
    config.write_text('cache_dir = "/tmp/a\\u0000b"\n')
    with pytest.raises(ConfigError, match=r"cache_dir .*null byte"):
        load_settings({"config": str(config)}, {})


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["cache", "stats", "--cache-dir", "{long}"], 2, "cache_dir"),
        (["models", "--scan", "{long}"], 2, "--scan"),
        (["complete", "hi", "--model", "{long}"], 1, "model file not found"),
    ],
)
def test_the_cli_answers_an_unstattable_path_in_one_line(
    tmp_path: Path, args: list[str], code: int, says: str
) -> None:
    long = str(_unstattable(tmp_path))
    argv = [sys.executable, "-m", "kvwarm", *(a.replace("{long}", long) for a in args)]
    result = subprocess.run(
        argv, capture_output=True, text=True, env=clean_env(tmp_path), timeout=120, check=False
    )
    assert "Traceback" not in result.stderr, result.stderr[-800:]
    assert result.returncode == code, (result.returncode, result.stderr[-800:])
    assert says in result.stderr, result.stderr


@pytest.mark.parametrize("name", ["cache_dir", "models_dir", "shm_dir", "mmproj", "draft_model"])
def test_a_path_naming_a_user_with_no_home_is_a_literal_path(name: str) -> None:
    """``~0`` names user "0", who has no home here: pathlib's ``expanduser`` raised
    RuntimeError out of load_settings (found by the property test in test_settings_surface).
    It is now what a shell makes of it, a literal name, checked as any other path."""
    try:
        loaded = load_settings({}, {env_var(name): "~0/x"})
    except ConfigError:
        return  # refused as a path that does not exist, say: typed, named
    assert str(getattr(loaded, name)) == "~0/x"


@pytest.mark.parametrize(
    ("tier", "needle"),
    [("x=foo://bar", "unknown scheme"), ("a b=ram://", "tier names are")],
)
def test_a_bad_tier_url_is_refused_while_the_settings_load(tier: str, needle: str) -> None:
    """Found by review: the engine refused these only once the server had bound its port and
    started (``no model could be loaded``, exit status 1)."""
    with pytest.raises(ConfigError, match=f"tiers: .*{needle}.*tiers from --tiers"):
        load_settings({"tiers": [tier], "backend": "stub"}, {})


# --- an empty value is refused, not read as false or as "not given" (found by review) ------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("cache_dir", ""),  # the disk tier silently off: nothing survived a restart
        ("spec_exact", ""),  # a boolean silently false
        ("api_docs", "  "),
        ("s3_endpoint_url", ""),  # the s3 tier silently on AWS instead of the endpoint meant
        ("save_tier", ""),
        ("n_threads", ""),
        ("rope_scaling", ""),
        ("models_dir", ""),
    ],
)
def test_an_empty_value_is_refused_not_read_as_false_or_unset(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"environment setting {name}: is empty"):
        load_settings({}, {env_var(name): value, "KVWARM_BACKEND": "stub"})


def test_the_words_for_off_and_default_still_say_it() -> None:
    env = {
        "KVWARM_CACHE_DIR": "none",
        "KVWARM_SPEC_EXACT": "false",
        "KVWARM_N_THREADS": "none",
        "KVWARM_ROPE_SCALING": "model",
    }
    settings = load_settings({}, env)
    assert settings.cache_dir is None and settings.spec_exact is False
    assert settings.n_threads is None and settings.rope_scaling is None


def test_an_empty_key_of_a_models_table_is_refused_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "kvwarm.toml"
    config.write_text('[[models]]\npath = "a.gguf"\n\n[[models]]\nid = ""\npath = "b.gguf"\n')
    with pytest.raises(ConfigError, match="setting models: model 2: id: is empty"):
        load_settings({"config": str(config)}, {})


@pytest.mark.parametrize("where", ["flag", "env"])
def test_an_empty_config_path_is_refused_not_read_as_none_given(tmp_path: Path, where: str) -> None:
    """The user's config file was read instead (here: one that sets port 9009)."""
    user = tmp_path / "kvwarm" / "config.toml"
    user.parent.mkdir()
    user.write_text("port = 9009\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    flags: dict[str, object] = {}
    if where == "flag":
        flags["config"] = ""
    else:
        env["KVWARM_CONFIG"] = " "
    name = "--config" if where == "flag" else "KVWARM_CONFIG"
    with pytest.raises(ConfigError, match=f"{name} is empty"):
        load_settings(flags, env)


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_host_is_refused_not_bound_to_every_interface(value: str) -> None:
    with pytest.raises(ConfigError, match=r"host is empty.*host from --host"):
        load_settings({"host": value, "backend": "stub"}, {})


@pytest.mark.parametrize("name", ["keepalive_interval_s", "model_idle_unload_s"])
def test_seconds_past_what_a_thread_can_wait_are_refused(name: str) -> None:
    """Found by review: ``keepalive_interval_s = 1e10`` loaded, and the keep-alive thread died
    at its first ``Event.wait`` (OverflowError), leaving the keep-alive silently off."""
    with pytest.raises(ConfigError, match=f"{name} must be at most"):
        load_settings({name: "1e10", "backend": "stub"}, {})
    load_settings({name: "86400", "backend": "stub"}, {})


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("KVWARM_ALLOWED_ORIGINS", "http://a.example:3000,http://b.example:3000"),
        ("KVWARM_ALLOWED_ORIGINS", "a.example:3000"),  # a host, not an origin
        ("KVWARM_ALLOWED_ORIGINS", "http://a.example/app"),  # an origin has no path
        ("KVWARM_ALLOWED_ORIGINS", "null"),  # never allowed by the guard
        ("KVWARM_ALLOWED_HOSTS", "a.example,b.example"),
        ("KVWARM_ALLOWED_HOSTS", "http://a.example"),  # a URL, not a Host name
        ("KVWARM_MEDIA_FETCH_HOSTS", "a.example,b.example"),
    ],
)
def test_a_list_in_one_entry_of_a_host_or_origin_setting_is_refused(var: str, value: str) -> None:
    """Found by review: each of these was one entry that no request could ever match, so the
    pages, hosts or image hosts meant were refused at request time, and nothing said why at
    start-up."""
    name = var.removeprefix("KVWARM_").lower()
    with pytest.raises(ConfigError, match=f"{name}: .* is not"):
        load_settings({}, {var: value, "KVWARM_BACKEND": "stub"})


def test_good_hosts_and_origins_still_load() -> None:
    flags: dict[str, object] = {
        "allowed_origins": ["http://a.example:3000", "https://b.example/", "*"],
        "allowed_hosts": ["kv.lan", "kv.lan:8000", "[::1]:8000", "*"],
        "media_fetch_hosts": ["img.example", "img.example:8443", "*"],
        "backend": "stub",
    }
    settings = load_settings(flags, {})
    assert settings.allowed_origins[0] == "http://a.example:3000"


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ({"cache_dir": "none", "cache_dir_shared": "true"}, "cache_dir_shared has no effect"),
        ({"cache_dir": "none", "disk_quota_bytes": "1G"}, "disk_quota_bytes has no effect"),
        ({"shm_quota_bytes": "4G"}, "shm_quota_bytes has no effect"),
        ({"s3_endpoint_url": "http://minio:9000"}, "s3_endpoint_url has no effect"),
        ({"memory_budget": "8G", "ram_quota_bytes": "1G"}, "ram_quota_bytes has no effect"),
    ],
)
def test_a_setting_the_others_make_do_nothing_is_refused(
    tmp_path: Path, given: dict[str, str], needle: str
) -> None:
    """Found by review: each was taken and silently ignored (a shared directory that is no
    tier, a quota of a tier that is off, a budget that overrides the RAM quota given)."""
    env = {"XDG_CONFIG_HOME": str(tmp_path), "KVWARM_BACKEND": "stub"}
    with pytest.raises(ConfigError, match=needle):
        load_settings({}, {**env, **{env_var(k): v for k, v in given.items()}})
    # With what turns them on, they load.
    on = {"cache_dir": str(tmp_path / "c"), "shm_dir": str(tmp_path / "shm"), "s3_bucket": "b"}
    fixed = {k: v for k, v in {**on, **given}.items() if k != "memory_budget"}
    if "cache_dir" in given:
        fixed["cache_dir"] = on["cache_dir"]
    load_settings({}, {**env, **{env_var(k): v for k, v in fixed.items()}})


@pytest.mark.parametrize(
    ("tier", "needle"),
    [
        ("x=ram://?quotaa=1G", "unknown URL option 'quotaa'"),
        ("x=file://relative/dir", "absolute local path"),
        ("x=file:///srv/kv?shraed=1", "unknown URL option 'shraed'"),
        ("x=s3://bucket/p/?regoin=eu", "unknown options regoin"),
    ],
)
def test_a_tier_url_option_is_checked_while_the_settings_load(tier: str, needle: str) -> None:
    """Found by review: what a tier's factory refuses of its URL was refused only when the
    engine built the tiers, after the server had started (exit status 1)."""
    with pytest.raises(ConfigError, match=f"tiers: .*{needle}.*tiers from --tiers"):
        load_settings({"tiers": [tier], "backend": "stub"}, {})


@pytest.mark.parametrize("name", ["cache_dir", "shm_dir"])
def test_a_tier_directory_that_cannot_be_created_is_refused(tmp_path: Path, name: str) -> None:
    """Found by review: a dangling link, or a path under a file, passed as "does not exist
    yet", and the engine failed to create it once the server had started (exit status 1)."""
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "nowhere")
    a_file = tmp_path / "file"
    a_file.write_text("")
    for root, needle in ((dangling, "which does not exist"), (a_file / "sub", "cannot be created")):
        with pytest.raises(ConfigError, match=f"{name} .*{needle}"):
            load_settings({name: str(root), "backend": "stub"}, {})
    load_settings({name: str(tmp_path / "new" / "deeper"), "backend": "stub"}, {})


@pytest.mark.parametrize(
    "name",
    [
        "media_formats",  # no format at all: every image and clip refused
        "allowed_origins",
        "allowed_hosts",
        "media_fetch_hosts",
        "tiers",
        "prewarm_system",
        "aliases",
        "lora",
        "tensor_split",
        "models",
    ],
)
def test_an_empty_list_variable_is_refused_not_read_as_no_entries(
    tmp_path: Path, name: str
) -> None:
    """Found by review: ``KVWARM_MEDIA_FORMATS=`` (a variable never filled in) loaded as no
    format at all, so every image and audio clip was refused at request time; the other list
    settings silently dropped what the config file listed. An empty value is refused, as the
    scalar settings' are (docs/configuration.md)."""
    for value in ("", " "):
        with pytest.raises(ConfigError, match=f"environment setting {name}: is empty"):
            load_settings({}, {env_var(name): value, "KVWARM_BACKEND": "stub"})
    config = tmp_path / "kvwarm.toml"
    config.write_text(f'{name} = ""\n')
    with pytest.raises(ConfigError, match=f"config file {config} setting {name}: is empty"):
        load_settings({"config": str(config)}, {"KVWARM_BACKEND": "stub"})
    # An explicit empty TOML list is no slip: it says "none".
    if name not in ("models", "aliases", "lora"):
        config.write_text(f"{name} = []\n")
        loaded = load_settings({"config": str(config)}, {"KVWARM_BACKEND": "stub"})
        assert getattr(loaded, name) == ()


def test_sizes_read_as_docs_configuration_md_says() -> None:
    """The size syntax was documented nowhere; the page now says what these show."""
    for text in ("20G", "20GB", "20GiB", "20 G", "20g"):
        assert load_settings({"disk_quota_bytes": text}, {}).disk_quota_bytes == 20 << 30
    assert load_settings({"disk_quota_bytes": "1.5G"}, {}).disk_quota_bytes == 3 << 29
    for text in ("-1G", "1e9", "20 parsecs", "8P"):
        with pytest.raises(ConfigError, match="flag setting --disk-quota-bytes: expected a size"):
            load_settings({"disk_quota_bytes": text}, {})


@pytest.mark.parametrize(("name", "flag"), [("lora", "--lora"), ("aliases", "--alias")])
def test_an_empty_flag_of_a_pair_list_is_refused(name: str, flag: str) -> None:
    """Found by review: ``--lora ""`` and ``--alias ""`` (a shell variable never filled in)
    loaded as no adapter, no alias, without a word: their one value was split on commas
    into nothing."""
    for value in ("", " ", ","):
        with pytest.raises(ConfigError, match=f"flag setting {flag}: is empty"):
            load_settings({name: [value], "backend": "stub"}, {})
