"""Media spans in the cache: rows keyed by a prompt's ids (``kvwarm.tokens``) share a span's KV
exactly when they show the same content, across a restart, with no change to the cache."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from pathlib import Path

from tests.cache.chunkkit import PER_TOKEN, split
from tests.cache.facadekit import NS, req

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache.types import SaveReason, SaveRequest
from kvwarm.tokens import Prompt, is_span_id

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


def _span_blob(tokens: tuple[int, ...]) -> bytes:
    """Fake KV in which, as in a span the model attends to both ways (Gemma 3's images), each
    position of a run of span ids depends on the whole run, not only on the ids before it."""
    out = bytearray()
    for p in range(len(tokens)):
        end = p + 1
        while end < len(tokens) and is_span_id(tokens[end - 1]) and is_span_id(tokens[end]):
            end += 1
        out += hashlib.sha256(repr(tokens[:end]).encode()).digest() * (PER_TOKEN // 32)
    return bytes(out)


def _span_request(tokens: tuple[int, ...]) -> SaveRequest:
    return SaveRequest(NS, tokens, _span_blob(tokens), SaveReason.CONTINUED, "ram", split=split)


def test_a_chunk_never_names_a_span_by_only_its_first_ids() -> None:
    """A chunk cut inside a span held KV that depends on the whole span (its positions attend
    both ways) under a key naming only the span's ids before the cut: one 31-bit id where the
    cut fell one position in. Found by review: a picture crafted so that its first span id
    equals another's (2^31 tries, minutes of hashing), shown after the same text with the
    chunk cut one position into the span, made every later save of the other picture's
    prompt reuse the crafted picture's chunk, and its restores serve that KV. No cut falls
    inside a run of span ids now: a chunk holding any of a span holds all of it."""
    prefix = list(range(1, 256))  # a chunk of C = 256 tokens ends one position into the span
    cat = Prompt.build([prefix, (CAT, 16, "image"), QUESTION]).tokens
    dog = list(Prompt.build([prefix, (DOG, 16, "image"), QUESTION]).tokens)
    dog[len(prefix)] = cat[len(prefix)]  # the crafted collision: the same first span id
    dog_tokens = tuple(dog)
    cfg = CacheConfig(tiers=(TierConfig("ram", 1 << 26),), chunk_tokens=256)
    with Cache(cfg, background=False) as cache:
        assert cache.save(_span_request(cat), sync=True)
        key = cache.save(_span_request(dog_tokens), sync=True)
        assert key is not None
        with cache.open_row(key) as row:
            restored = b"".join(bytes(c) for c in row.chunks) if row.chunks else bytes(row.payload)
        assert restored == _span_blob(dog_tokens)
        # The chunk that held the span's first position now holds all of it.
        ends = list(itertools.accumulate(cache.chunk_lens(key)))
        assert ends and len(prefix) + 1 not in ends
        assert not any(
            is_span_id(dog_tokens[e - 1]) and is_span_id(dog_tokens[e]) for e in ends[:-1]
        )


def _window_of(tokens: tuple[int, ...], first: int) -> bytes:
    """A fake iSWA window's cells of ``[first, n)``, each of a span's depending on all of it."""
    cells = _span_blob(tokens)[first * PER_TOKEN :]
    return b"".join(cells[i : i + PER_TOKEN] * 2 for i in range(0, len(cells), PER_TOKEN))


def _window_request(tokens: tuple[int, ...], window: int) -> SaveRequest:
    n, first = len(tokens), len(tokens) - window
    whole = _span_blob(tokens) + _window_of(tokens, first)
    cell = 2 * PER_TOKEN

    def split_rest(data: bytes | bytearray | memoryview, bounds: Sequence[int]) -> list[bytes]:
        cells = memoryview(data)[n * PER_TOKEN :]
        return [
            a.to_bytes(4, "little") + bytes(cells[(a - first) * cell : (b - first) * cell])
            for a, b in itertools.pairwise(bounds)
        ]

    return SaveRequest(
        NS, tokens, b"", SaveReason.FINISH, "ram", split=split,
        rest=lambda data: memoryview(data)[n * PER_TOKEN :], pack=lambda start: (whole, 0),
        rest_span=lambda data: (first, n), split_rest=split_rest,
    )  # fmt: skip


def test_a_window_chunk_never_names_a_span_by_only_its_first_ids() -> None:
    """As for the first cache's chunks (above): an iSWA window's chunks (Gemma 3 is one) are
    cut on a grid, and a grid point one position into a span keyed the window's cells of the
    whole span's positions before it by one span id."""
    prefix = list(range(1, 160))  # the window's grid (chunk_tokens 128 // 4) cuts at 160
    cat = Prompt.build([prefix, (CAT, 16, "image"), QUESTION]).tokens
    dog = list(Prompt.build([prefix, (DOG, 16, "image"), QUESTION]).tokens)
    dog[len(prefix)] = cat[len(prefix)]
    dog_tokens = tuple(dog)
    cfg = CacheConfig(tiers=(TierConfig("ram", 1 << 26),), chunk_tokens=128)
    with Cache(cfg, background=False) as cache:
        assert cache.save(_window_request(cat, 100), sync=True)
        key = cache.save(_window_request(dog_tokens, 100), sync=True)
        assert key is not None
        with cache.open_row(key) as row:
            assert row.rest_chunks
            first = row.rest_from
            window = bytearray()
            for part in row.rest_chunks:
                start = int.from_bytes(bytes(part[:4]), "little")
                window += bytes(part)[4 + max(0, first - start) * 2 * PER_TOKEN :]
        assert bytes(window) == _window_of(dog_tokens, first)
