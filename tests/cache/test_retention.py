"""Retention of recurrent and hybrid states (``CacheConfig.state_history``): such a state is
whole, so of one conversation's saved states a local tier keeps the newest, the
``state_history`` below it and those another conversation also extends; older ones go, also
when saves publish out of order; other kinds, checked-out rows and shared tiers are untouched."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tests.cache.tierkit import NS, request

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.explain import MissReason
from kvwarm.cache.formats.key import cache_key

SYSTEM = tuple(range(100, 160))


def _cache(tmp_path: Path, *, history: int = 2, shared: bool = False) -> Cache:
    tier = TierConfig("disk", 1 << 30, tmp_path / "kvc", shared=shared)
    return Cache(CacheConfig(tiers=(tier,), state_history=history), background=False)


def _save(cache: Cache, tokens: tuple[int, ...], memory: str = "recurrent") -> bytes:
    _, req = request(tokens)
    key = cache.save(replace(req, memory=memory), sync=True)
    assert key is not None
    return key


def _turns(n: int, tail: int = 1) -> list[tuple[int, ...]]:
    """A conversation's states over SYSTEM: each the one before plus a turn."""
    out, tokens = [], SYSTEM
    for turn in range(n):
        tokens = (*tokens, *range(1000 * tail + 10 * turn, 1000 * tail + 10 * turn + 5))
        out.append(tokens)
    return out


def _held(cache: Cache) -> set[int]:
    return {r.n_tokens for r in cache.rows()}


def test_a_conversation_keeps_its_newest_states(tmp_path: Path) -> None:
    with _cache(tmp_path) as cache:
        states = _turns(6)
        for tokens in states:
            _save(cache, tokens)
        assert _held(cache) == {len(t) for t in states[-3:]}
        counters = cache.counters()
        assert counters["retention_drops"] == 3 and counters["retention_bytes"] > 0
        # What left is remembered as a miss reason: evicted, by retention.
        report = cache.explain_miss(NS, states[0], 0)
        assert report is not None and report.reason == MissReason.EVICTED
        assert report.detail == "retention"
        assert sorted(p.name for p in (tmp_path / "kvc").glob("*.kvc")) == sorted(
            f"{cache_key(NS, t).hex()}.kvc" for t in states[-3:]
        )


def test_states_published_out_of_order_still_leave(tmp_path: Path) -> None:
    """A turn's checkpoint may publish after the finish save above it (two writer
    threads): the rows already above it count towards what is kept."""
    with _cache(tmp_path) as cache:
        states = _turns(6)
        for turn in range(0, 6, 2):
            _save(cache, states[turn + 1])
            _save(cache, states[turn])
        assert _held(cache) == {len(t) for t in states[-3:]}


def test_a_state_another_conversation_extends_stays(tmp_path: Path) -> None:
    with _cache(tmp_path) as cache:
        _save(cache, SYSTEM)  # the system prompt's checkpoint
        first = _turns(5, tail=1)
        for tokens in first:
            _save(cache, tokens)
        assert len(SYSTEM) not in _held(cache)  # nobody else went on from it yet
        _save(cache, SYSTEM)  # saved again, where a second conversation diverged
        second = _turns(5, tail=2)
        for tokens in second:
            _save(cache, tokens)
        held = _held(cache)
        assert len(SYSTEM) in held  # both conversations extend it
        assert held == {len(SYSTEM), *(len(t) for t in first[-3:]), *(len(t) for t in second[-3:])}


@pytest.mark.parametrize("memory", ["full", "swa", ""])
def test_rows_of_other_memory_kinds_are_left_to_the_quota(tmp_path: Path, memory: str) -> None:
    with _cache(tmp_path) as cache:
        states = _turns(5)
        for tokens in states:
            _save(cache, tokens, memory=memory)
        assert _held(cache) == {len(t) for t in states}
        # A recurrent state over them drops none of theirs either.
        _save(cache, (*states[-1], 7, 7))
        assert len(cache.rows()) == len(states) + 1


def test_a_checked_out_state_is_not_dropped(tmp_path: Path) -> None:
    with _cache(tmp_path) as cache:
        states = _turns(5)
        first = _save(cache, states[0])
        with cache.open_row(first):
            for tokens in states[1:]:
                _save(cache, tokens)
            assert len(states[0]) in _held(cache)


@pytest.mark.parametrize(("history", "shared"), [(-1, False), (2, True)])
def test_no_limit_or_a_shared_tier_keeps_every_state(
    tmp_path: Path, history: int, shared: bool
) -> None:
    with _cache(tmp_path, history=history, shared=shared) as cache:
        states = _turns(5)
        for tokens in states:
            _save(cache, tokens)
        assert _held(cache) == {len(t) for t in states}
        assert cache.counters()["retention_drops"] == 0
