"""Settings of the shared tiers: the s3 tier and a disk directory shared by several hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwarm.cache.types import S3Config
from kvwarm.errors import ConfigError
from kvwarm.settings import load_settings


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(tmp_path / "c"), "XDG_CONFIG_HOME": str(tmp_path / "n"), **extra}


def test_s3_tier_from_env_is_last_and_takes_the_saves(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        KVWARM_S3_BUCKET="rows",
        KVWARM_S3_ENDPOINT_URL="http://127.0.0.1:9000",
        KVWARM_S3_QUOTA_BYTES="5G",
        KVWARM_S3_READ_TIMEOUT_S="3",
    )
    s = load_settings({"s3_prefix": "team/"}, env)
    tiers = s.cache_config().tiers
    assert [t.name for t in tiers] == ["ram", "disk", "s3"]  # local tiers are asked first
    assert tiers[-1].quota_bytes == 5 << 30
    assert tiers[-1].s3 == S3Config(
        bucket="rows",
        prefix="team/",
        endpoint_url="http://127.0.0.1:9000",
        region=None,
        connect_timeout_s=2.0,
        read_timeout_s=3.0,
        max_attempts=2,
    )
    assert s.effective_save_tier() == "s3"  # a bucket is set to share rows
    assert load_settings({"save_tier": "disk"}, env).effective_save_tier() == "disk"


def test_no_bucket_no_s3_tier(tmp_path: Path) -> None:
    s = load_settings({}, _env(tmp_path))
    assert all(t.s3 is None for t in s.cache_config().tiers)
    with pytest.raises(ConfigError, match="s3_bucket"):
        load_settings({"save_tier": "s3"}, _env(tmp_path))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"s3_prefix": "no-slash"}, "s3_prefix"),
        ({"s3_read_timeout_s": 0.0}, "timeout"),
        ({"s3_max_attempts": 0}, "s3_max_attempts"),
    ],
)
def test_bad_s3_settings_are_config_errors(
    tmp_path: Path, flags: dict[str, object], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_settings({"s3_bucket": "rows", **flags}, _env(tmp_path))


def test_cache_dir_shared_marks_the_disk_tier(tmp_path: Path) -> None:
    s = load_settings({"cache_dir_shared": True}, _env(tmp_path))
    disk = next(t for t in s.cache_config().tiers if t.name == "disk")
    assert disk.shared
    assert not next(t for t in load_settings({}, _env(tmp_path)).cache_config().tiers).shared


def test_tiers_by_url_follow_the_built_in_ones_and_may_take_the_saves(tmp_path: Path) -> None:
    url = "redis://127.0.0.1:6379/0?quota=8G&prefix=team/"
    env = _env(tmp_path, KVWARM_TIERS=f"shared={url}", KVWARM_SAVE_TIER="shared")
    s = load_settings({}, env)
    tiers = s.cache_config().tiers
    assert [t.name for t in tiers] == ["ram", "disk", "shared"]
    assert tiers[-1].quota_bytes == 8 << 30 and tiers[-1].root is None
    assert tiers[-1].url == "redis://127.0.0.1:6379/0?prefix=team%2F"
    assert s.effective_save_tier() == "shared"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"KVWARM_TIERS": "redis://h:1/0"}, "NAME=URL"),
        ({"KVWARM_TIERS": "x=redis://h:1/0?quota=lots"}, "quota"),
        ({"KVWARM_SAVE_TIER": "elsewhere"}, "not a configured tier"),
    ],
)
def test_bad_url_tiers_are_config_errors(tmp_path: Path, extra: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_settings({}, _env(tmp_path, **extra))


@pytest.mark.parametrize(
    "spec", ["redis://:s3cret@h:1/0", "redis://h:1/0?password=s3cret", "=redis://u:s3cret@h:1/0"]
)
def test_a_tier_without_its_name_is_refused_without_showing_its_password(
    tmp_path: Path, spec: str
) -> None:
    """Found by review: the NAME=URL error showed the URL whole, its password too."""
    with pytest.raises(ConfigError, match="NAME=URL") as caught:
        load_settings({}, _env(tmp_path, KVWARM_TIERS=spec))
    assert "s3cret" not in str(caught.value) and "***" in str(caught.value)


def test_a_bad_tier_quota_names_the_setting_and_where_it_came_from(tmp_path: Path) -> None:
    """Found by review: ``tier x: quota: expected a size ...`` named neither the setting nor
    its source, unlike every other broken rule (``(tiers from KVWARM_TIERS)``)."""
    env = _env(tmp_path, KVWARM_TIERS="x=ram://?quota=10 parsecs")
    with pytest.raises(ConfigError) as caught:
        load_settings({}, env)
    assert str(caught.value) == (
        "tiers: tier x: quota: expected a size like 512M or 20G, got '10 parsecs' "
        "(tiers from KVWARM_TIERS)"
    )


def test_tiers_take_one_flag_each_as_every_list_setting(tmp_path: Path) -> None:
    """Found by review: ``tiers`` is a list (a TOML list, docs/cache.md: "adds tiers ...,
    each NAME=URL"), yet ``--tiers`` kept only its last value: ``--tiers a=... --tiers
    b=...`` served tier b alone, tier a dropped without a word."""
    from kvwarm.cli import build_parser
    from kvwarm.settings import settings_flags

    for words in (["serve"], ["cache", "stats"]):
        args = build_parser().parse_args(
            [*words, "--tiers", "a=ram://?quota=1M", "--tiers", "b=ram://?quota=2M"]
        )
        s = load_settings(settings_flags(args), _env(tmp_path))
        assert [t.name for t in s.cache_config().tiers][-2:] == ["a", "b"], words
