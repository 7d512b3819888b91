"""Media spans in the cache: rows keyed by a prompt's ids (``kvwarm.tokens``) share a span's KV
exactly when they show the same content, across a restart, with no change to the cache."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.cache.facadekit import NS, req

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.tokens import Prompt

CAT = hashlib.sha256(b"64x64 cat").digest()
DOG = hashlib.sha256(b"64x64 dog").digest()
SYSTEM = list(range(1, 41))  # a 40-token system prompt
QUESTION = [101, 102, 103, 104]


def _cache(root: Path) -> Cache:
    return Cache(CacheConfig(tiers=(TierConfig("disk", 1 << 24, root),)), background=False)


def test_rows_share_a_span_only_when_they_show_the_same_content(tmp_path: Path) -> None:
    cat = Prompt.build([SYSTEM, (CAT, 16, "image"), QUESTION])
    same_cat = Prompt.build([SYSTEM, (CAT, 16, "image"), [7, 7]])
    dog = Prompt.build([SYSTEM, (DOG, 16, "image"), QUESTION])
    with _cache(tmp_path) as cache:
        assert cache.save(req(cat.tokens, tier="disk"), sync=True)
        assert cache.key_for(NS, cat.tokens) != cache.key_for(NS, dog.tokens)
    with _cache(tmp_path) as cache:  # a restart: the row is found again by its ids
        again = cache.longest_prefix(NS, cat.tokens)
        assert again is not None and again.n_shared == len(cat)
        # The same picture under another question shares the system prompt and the span...
        same = cache.longest_prefix(NS, same_cat.tokens)
        assert same is not None and same.n_shared == len(SYSTEM) + 16
        # ... another picture only what precedes its span.
        other = cache.longest_prefix(NS, dog.tokens)
        assert other is not None and other.n_shared == len(SYSTEM)
        with cache.open_row(again.row.key) as row:
            assert tuple(row.tokens) == cat.tokens
