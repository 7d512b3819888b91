"""On the stub: a ram tier too small for a prompt's row in front of a disk tier. The row goes
to the disk (the finish save, and the synchronous evict save of the slot's KV), so a restart
restores it; before, every save was refused ("larger than the tier's quota: not saved"), the
evict kept the KV live ("could not be saved; kept live") and the restart prefilled cold."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
from tests.cache.facadekit import req
from tests.engine.conftest import LOW_GATES, stub_config

from kvwarm.cache.types import CacheConfig, PolicyConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.types import CompletionStats, GenerationOptions

GREEDY = GenerationOptions(max_tokens=8, temperature=0.0)
PROMPT = "The system prompt says: be brief and kind. Question: what is a cache?"


def engine(
    root: Path, ram: int = 256, chunk_tokens: int = 256, policy: PolicyConfig = LOW_GATES
) -> Engine:
    tiers = (TierConfig("ram", ram), TierConfig("disk", 1 << 20, root))  # ram: a few cells
    cache = CacheConfig(tiers=tiers, chunk_tokens=chunk_tokens)
    return Engine(EngineConfig(cache=cache, policy=policy))


#: Finish saves only: a cold save beside a turn's finish save could hold the small ram
#: tier's room while the other needs it (``CacheCore._holder``), which is not what is tested.
FINISH_ONLY = replace(LOW_GATES, cold_min_tokens=100_000)


def exact_after_restart(root: Path, prompt: str, text: str, **tiers: object) -> CompletionStats:
    """A new engine over the same disk serves ``prompt`` as an exact hit, ``text`` again;
    its stats."""
    eng = engine(root, **tiers)  # type: ignore[arg-type]
    try:
        model = eng.load_model(config=stub_config())
        again = model.complete(prompt, GREEDY)
        assert again.stats.cache_hit == "exact"
        assert again.text == text
        return again.stats
    finally:
        eng.close()


def test_rows_too_large_for_ram_are_saved_to_disk_and_restored_after_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "disk"
    with caplog.at_level(logging.INFO, logger="kvwarm"):
        eng = engine(root)
        try:
            model = eng.load_model(config=stub_config())
            assert model.info().save_tier == "ram"
            first = model.complete(PROMPT, GREEDY)
            assert eng.cache.flush()
            assert model.evict() == 1
            rows = eng.cache.rows()
            assert rows and {r.tier for r in rows} == {"disk"}
            counters = eng.cache.counters()
            assert counters["save_failures"] == 0 and counters["saves_spilled"] >= 1
        finally:
            eng.close()
    assert "kept live" not in caplog.text and "not saved" not in caplog.text
    again = exact_after_restart(root, PROMPT, first.text)
    assert again.cached_tokens >= again.prompt_tokens - 1


def test_a_conversation_that_outgrows_ram_is_packed_whole_for_the_disk(tmp_path: Path) -> None:
    """Its first turn's row fits the ram tier, in chunks; the next turn's row does not, and
    ram holds its leading chunks, so the save packs only its tail for ram, then packs it
    again from the start for the disk, which has none of them: the row restores whole after
    a restart."""
    root = tmp_path / "disk"
    longer = PROMPT + " And what does it keep when the memory runs out, and where?"
    eng = engine(root, ram=4500, chunk_tokens=16, policy=FINISH_ONLY)
    try:
        model = eng.load_model(config=stub_config())
        model.complete(PROMPT, GREEDY)
        assert eng.cache.flush()
        assert {r.tier for r in eng.cache.rows()} == {"ram"}
        second = model.complete(longer, GREEDY)
        assert eng.cache.flush()
        counters = eng.cache.counters()
        assert counters["saves_spilled"] >= 1 and counters["save_failures"] == 0
        assert counters["tier_ram_bytes"] <= 4500
    finally:
        eng.close()
    exact_after_restart(root, longer, second.text, ram=4500, chunk_tokens=16, policy=FINISH_ONLY)


def test_a_save_a_checked_out_row_leaves_no_room_in_ram_goes_to_disk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The prompt's row fits the ram tier alone, not beside a row a restore has checked out
    (which no eviction can move): refused by ram for room, the finish save and then the evict
    save were lost ("could not be saved; kept live") and a restart prefilled cold. Now the
    row goes to the disk, as when ram is quiet it would have gone to ram."""
    root = tmp_path / "disk"
    with caplog.at_level(logging.INFO, logger="kvwarm"):
        eng = engine(root, ram=4500, chunk_tokens=16, policy=FINISH_ONLY)
        try:
            model = eng.load_model(config=stub_config())
            blocker = eng.cache.save(req((1, 2, 3), 2000), sync=True)  # 2 KB of the 4.5 KB
            assert blocker is not None
            with eng.cache.open_row(blocker):
                first = model.complete(PROMPT, GREEDY)  # its row: ~3 KB in 16-token chunks
                assert eng.cache.flush()
                assert model.evict() == 1
            tiers = {r.key: r.tier for r in eng.cache.rows()}
            assert tiers.pop(blocker) == "ram" and set(tiers.values()) == {"disk"}
            counters = eng.cache.counters()
            assert counters["save_failures"] == 0 and counters["saves_spilled"] >= 1
            assert counters["tier_ram_bytes"] <= 4500
        finally:
            eng.close()
    assert "kept live" not in caplog.text and "no room for" not in caplog.text
    exact_after_restart(root, PROMPT, first.text, ram=4500, chunk_tokens=16, policy=FINISH_ONLY)
