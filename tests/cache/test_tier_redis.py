"""The redis tier through the cache, configured by URL (a name, a quota, ``redis://``), and the
URL spellings of the built-in stores. The tier contract itself is ``test_tiers.py`` and
``test_tier_chunks.py`` (parametrized over every tier, redis included)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.cache.facadekit import NS, req
from tests.rediskit import RedisServer

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.tiers.files import FileTier
from kvwarm.cache.tiers.objects import REMOTE_CAPABILITIES, ObjectTier
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.tiers.registry import TierOptions, build_tier
from kvwarm.cache.tiers.s3 import s3_config_from_url
from kvwarm.errors import CacheIOError, CacheNetworkError, ConfigError


def _config(url: str) -> CacheConfig:
    return CacheConfig(tiers=(TierConfig("ram", 1 << 20), TierConfig("shared", 1 << 20, url=url)))


def test_a_row_saved_to_redis_is_found_by_another_cache(redis_server: RedisServer) -> None:
    url = redis_server.url()
    with Cache(_config(url), background=False) as writer:
        assert writer.tier_names() == ("ram", "shared")
        key = writer.save(req((5,) * 8, tier="shared"), sync=True)
        assert key is not None and writer.counters()["tier_shared_rows"] == 1
        with Cache(_config(url), background=False) as reader:  # another host, same server
            info = reader.lookup_exact(key)
            assert info is not None and info.tier in ("shared", "ram")
            with reader.open_row(key) as row:
                assert row.tokens == (5,) * 8
            assert reader.lookup_exact(reader.key_for(NS, (6,) * 8)) is None


def test_a_dead_redis_is_a_network_error_then_skipped(tmp_path: Path) -> None:
    server = RedisServer()
    tier = build_tier(TierConfig("shared", 1, url=server.url(down_for_s="60")), TierOptions())
    assert isinstance(tier, ObjectTier) and tier.capabilities == REMOTE_CAPABILITIES
    server.stop()
    with pytest.raises(CacheNetworkError, match="ConnectionError"):
        tier.probe(b"\x01" * 32)
    with pytest.raises(CacheNetworkError, match="marked down"):
        tier.probe(b"\x01" * 32)  # fails at once now, without another connection attempt
    tier.close()


@pytest.fixture
def acl_users(redis_server: RedisServer) -> Iterator[Callable[[str, str], str]]:
    """``add(name, rules)``: an ACL user of the session's server (password "right"), removed
    after; returns a tier URL logging in as that user with the password "right"."""
    import redis

    admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
    made: list[str] = []

    def add(name: str, rules: str) -> str:
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", ">right", *rules.split())
        made.append(name)
        return redis_server.url().replace("redis://", f"redis://{name}:right@", 1)

    yield add
    for name in made:
        admin.execute_command("ACL", "DELUSER", name)
    admin.close()


def test_a_wrong_password_is_a_refusal_not_an_outage(
    acl_users: Callable[[str, str], str], caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: redis-py makes a refused AUTH a ConnectionError, so a wrong password
    was a network fault that marked the store down, to be retried as if the network were."""
    url = acl_users("kvtest", "~* &* +@all").replace(":right@", ":wrong@", 1)
    tier = build_tier(TierConfig("shared", 1, url=url + "&down_for_s=60"), TierOptions())
    with caplog.at_level("ERROR", logger="kvwarm.cache.tiers.redis"):
        for _ in range(3):  # each call asks the server again: nothing is marked down
            with pytest.raises(CacheIOError, match="refused our credentials") as info:
                tier.probe(b"\x01" * 32)
            assert not isinstance(info.value, CacheNetworkError)
            assert "marked down" not in str(info.value) and "wrong" not in str(info.value)
    errors = [r for r in caplog.records if "credentials" in r.getMessage()]
    assert len(errors) == 1  # logged once, clearly, not per call
    tier.close()


def test_a_command_the_user_may_not_run_is_a_refusal(
    acl_users: Callable[[str, str], str],
) -> None:
    url = acl_users("kvping", "~* +ping")
    tier = build_tier(TierConfig("shared", 1, url=url + "&down_for_s=60"), TierOptions())
    for _ in range(2):
        with pytest.raises(CacheIOError, match="does not let this user run it") as info:
            tier.probe(b"\x01" * 32)
        assert not isinstance(info.value, CacheNetworkError)
    tier.close()


def test_a_cache_over_a_redis_that_refuses_us_misses_and_goes_on(
    acl_users: Callable[[str, str], str],
) -> None:
    url = acl_users("kvtest2", "~* &* +@all").replace(":right@", ":wrong@", 1)
    with Cache(_config(url), background=False) as cache:
        assert cache.lookup_exact(cache.key_for(NS, (5,) * 8)) is None
        assert cache.counters()["store_errors"] >= 1


def test_the_built_in_stores_by_url(tmp_path: Path) -> None:
    nvme = build_tier(TierConfig("nvme", 5, url=f"file://{tmp_path}/rows"), TierOptions())
    assert isinstance(nvme, FileTier) and nvme.name == "nvme" and nvme.quota_bytes == 5
    assert nvme.root == tmp_path / "rows"
    assert not nvme.capabilities.shared or nvme.capabilities.local
    nvme.close()
    fast = build_tier(TierConfig("fast", 7, url="ram://"), TierOptions())
    assert isinstance(fast, RamTier) and fast.name == "fast"
    cfg = s3_config_from_url("s3://bkt/some/prefix?endpoint=http://127.0.0.1:9&region=eu-1")
    assert (cfg.bucket, cfg.prefix, cfg.endpoint_url, cfg.region) == (
        "bkt",
        "some/prefix/",
        "http://127.0.0.1:9",
        "eu-1",
    )


def test_bad_tier_urls_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown scheme"):
        Cache(_config("gopher://x"), background=False)
    with pytest.raises(ConfigError, match="tier names"):
        Cache(CacheConfig(tiers=(TierConfig("a/b", 1, url="ram://"),)), background=False)
    with pytest.raises(ConfigError, match="root"):
        bad = TierConfig("x", 1, root=tmp_path, url="ram://")
        Cache(CacheConfig(tiers=(bad,)), background=False)
    with pytest.raises(ConfigError, match="unknown options"):
        s3_config_from_url("s3://bkt/p/?endpiont=http://x")
    with pytest.raises(ConfigError, match="packs='sometimes': expected 1 or 0"):
        s3_config_from_url("s3://bkt/p/?packs=sometimes")


@pytest.mark.parametrize(
    ("option", "packs"), [("", True), ("&packs=1", True), ("&packs=off", False)]
)
def test_packs_is_a_switch_of_s3_and_redis_urls(option: str, packs: bool) -> None:
    """``packs=0`` keeps saves to chunk objects (a rolling upgrade); reads take packs either way."""
    assert s3_config_from_url(f"s3://bkt/p/?region=eu-1{option}").packs is packs
    tier = build_tier(
        TierConfig("shared", 1, url=f"redis://127.0.0.1:1/0?prefix=x/{option}"), TierOptions()
    )
    try:
        assert tier.capabilities.packs and tier.capabilities.pack_writes is packs
    finally:
        tier.close()


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:s3cret@127.0.0.1:6379/0?timeout_s=soon",  # our option's bad value
        "redis://:s3cret@127.0.0.1:port/0",  # a port that is not a number
        "redis://user:s3cret@127.0.0.1/0?db=zero",  # the client's own refusal
        "http://user:s3cret@127.0.0.1/",  # not a redis URL
        "gopher://user:s3cret@127.0.0.1/",  # no store of that scheme
        # The password as an option, which redis-py takes (found by review: shown whole).
        "redis://127.0.0.1:6379/0?password=s3cret&timeout_s=soon",
        "redis://127.0.0.1/0?db=zero&password=s3cret",
        "redis://:s3cret@127.0.0.1:6379/0?packs=sometimes",  # our switch's bad value
        # An s3 tier's credentials come from boto3's own sources, never its URL; one put
        # there anyway is not shown (found by review: the s3 tier's errors showed it).
        "s3://rows/team/?secret_access_key=s3cret",  # not an option of ours
        "s3://AKIAEXAMPLE:s3cret@rows/team/",  # no bucket of that name
        "s3://rows/team/?max_attempts=many&aws_session_token=s3cret",
    ],
)
def test_a_bad_tier_url_is_a_config_error_that_does_not_show_its_password(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Cache(_config(url), background=False)
    assert "s3cret" not in str(caught.value) and "***" in str(caught.value)
