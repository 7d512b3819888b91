"""A row larger than its tier's quota is refused before it costs the tier anything. Found by
review: a disk tier stored it, then its quota check evicted every other row and the new one
too; the ram tier evicted every other row to make room, then refused it. Either way a tier
of sound rows was emptied by a save that could never be kept (a long context's row in a
small ``ram_file`` tier, say). Whole rows and rows in chunks, a chunked row counting the
chunks it reuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.cache.chunkkit import PER_TOKEN, chunked_request
from tests.cache.facadekit import NS, req

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.types import SaveRequest, TierName

QUOTA = 1_000_000


def config(tier: TierName, root: Path) -> CacheConfig:
    tiers = (TierConfig("ram", QUOTA),)
    if tier == "disk":
        tiers += (TierConfig("disk", QUOTA, root),)
    return CacheConfig(tiers=tiers, chunk_tokens=128)


def small(i: int, tier: TierName, chunked: bool) -> SaveRequest:
    if chunked:
        return chunked_request(NS, [i] * 200, tier=tier)
    return req((i,) * 200, 200_000, tier=tier)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_row_larger_than_the_quota_is_refused_and_evicts_nothing(
    tmp_path: Path, tier: TierName, chunked: bool
) -> None:
    with Cache(config(tier, tmp_path / "rows"), background=False) as c:
        kept = [c.save(small(i, tier, chunked), sync=True) for i in range(3)]
        assert all(kept)
        big = (
            chunked_request(NS, [9] * (QUOTA // PER_TOKEN + 100), tier=tier)
            if chunked
            else req((9,) * 200, QUOTA + 1, tier=tier)
        )
        assert c.save(big, sync=True) is None
        counters = c.counters()
        assert counters["save_failures"] == 1 and counters["evictions"] == 0
        assert sorted(r.key for r in c.rows()) == sorted(k for k in kept if k is not None)


def test_a_chunked_row_counts_the_chunks_it_reuses(tmp_path: Path) -> None:
    """Its new bytes alone fit (a tail over stored chunks), but the row, which names them,
    could not stay under the quota: refused too, and the chunks it would reuse stay."""
    with Cache(config("disk", tmp_path / "rows"), background=False) as c:
        prefix = list(range(600))  # 600 KB of chunks
        assert c.save(chunked_request(NS, prefix, tier="disk"), sync=True)
        assert c.save(chunked_request(NS, prefix + [7] * 500, tier="disk"), sync=True) is None
        assert [r.n_tokens for r in c.rows()] == [600]
        assert c.counters()["evictions"] == 0


def test_a_save_the_checked_out_rows_leave_no_room_for_evicts_nothing() -> None:
    """Found by review: the ram tier evicted every row it could for a save's room, then
    refused the save, as the rest of its quota was a row being restored: the evicted rows
    were lost for nothing. It refuses first; once the restore is done the save has room."""
    with Cache(CacheConfig(tiers=(TierConfig("ram", QUOTA),)), background=False) as c:
        restoring = c.save(req((1,) * 10, 600_000), sync=True)
        others = [c.save(req((i,) * 10, 150_000), sync=True) for i in (2, 3)]
        assert restoring is not None and all(others)
        with c.open_row(restoring):
            assert c.save(req((4,) * 10, 500_000), sync=True) is None
            assert len(c.rows()) == 3 and c.counters()["evictions"] == 0
        assert c.save(req((4,) * 10, 500_000), sync=True) is not None
        assert c.lookup_exact(restoring) is None  # the oldest went, now that it could
