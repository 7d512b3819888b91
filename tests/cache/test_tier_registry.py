"""Tiers are plug-ins: a tier registered by name works without touching the facade."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from tests.cache.facadekit import NS, req

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.protocols import StoredRow, Tier, TierCapabilities
from kvwarm.cache.tiers.files import FILE_CAPABILITIES, FileTier
from kvwarm.cache.tiers.ram import RamTier
from kvwarm.cache.tiers.registry import (
    TierOptions,
    register_tier,
    registered_tiers,
    unregister_tier,
)
from kvwarm.errors import ConfigError


class SharedRam(RamTier):
    """A RAM tier claiming to be shared, as a remote store (s3) would: probed on a miss."""

    probes: ClassVar[list[bytes]] = []

    @property
    def capabilities(self) -> TierCapabilities:
        return TierCapabilities(persistent=True, shared=True, local=False)

    def probe(self, key: bytes) -> StoredRow | None:
        SharedRam.probes.append(key)
        return super().probe(key)


@pytest.fixture
def registered() -> Iterator[None]:
    def make(config: TierConfig, options: TierOptions) -> Tier:
        return SharedRam(config.quota_bytes, name=config.name)

    register_tier("remote", make, needs_root=False)
    SharedRam.probes = []
    yield
    unregister_tier("remote")


def test_a_registered_tier_is_configured_saved_to_probed_and_evicted(registered: None) -> None:
    assert "remote" in registered_tiers()
    cfg = CacheConfig(tiers=(TierConfig("ram", 1 << 20), TierConfig("remote", 1 << 20)))
    with Cache(cfg, background=False) as c:
        assert c.tier_names() == ("ram", "remote")
        key = c.save(req((7,) * 8, tier="remote"), sync=True)
        assert key is not None and c.counters()["tier_remote_rows"] == 1
        with c.open_row(key) as row:
            assert row.info.tier == "remote" and row.tokens == (7,) * 8
        missing = c.key_for(NS, (8,) * 8)
        assert c.lookup_exact(missing) is None and SharedRam.probes == [missing]
        assert c.evict_bytes(1, ["remote"]).rows == 1 and not c.rows()


def test_unknown_and_unregistered_names_are_config_errors(registered: None) -> None:
    unregister_tier("remote")
    with pytest.raises(ConfigError, match="unknown tier 'remote'"):
        Cache(CacheConfig(tiers=(TierConfig("remote", 1),)), background=False)
    with pytest.raises(ConfigError, match="tier names"):
        register_tier("no/slashes", lambda c, o: RamTier(1), needs_root=False)


def test_file_tiers_state_their_capabilities(tmp_path: Path) -> None:
    tier = FileTier("ram_file", tmp_path, 1)
    assert tier.capabilities == FILE_CAPABILITIES and FILE_CAPABILITIES.shared
    assert not RamTier(1).capabilities.shared and not RamTier(1).capabilities.persistent


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("file://{root}?shraed=1", "unknown URL option 'shraed'"),
        ("file://{root}?shared=ture", "shared='ture': expected 1 or 0"),
        ("file://{root}?shared=1&prefix=x", "unknown URL option 'prefix'"),
        ("ram://?qouta=1G", "unknown URL option 'qouta'"),
    ],
)
def test_a_file_or_ram_url_refuses_options_it_does_not_take(
    tmp_path: Path, url: str, said: str
) -> None:
    """Found by review: file:// and ram:// URLs ignored every option but ``shared``, and
    ``shared`` any value but a true one: ``?shraed=1`` or ``?shared=ture`` opened a
    directory several hosts share as one process's own (whose evictions delete the chunks
    the other hosts' rows name), without a word. The s3 URL already refused them."""
    config = TierConfig("x", 1 << 20, url=url.format(root=tmp_path / "rows"))
    with pytest.raises(ConfigError, match=said):
        Cache(CacheConfig(tiers=(TierConfig("ram", 1 << 20), config)), background=False)
    assert not (tmp_path / "rows").exists()
    shared = TierConfig("x", 1 << 20, url=f"file://{tmp_path / 'rows'}?shared=true")
    with Cache(CacheConfig(tiers=(shared,)), background=False) as c:
        assert c.tier_capabilities()["x"].shared
