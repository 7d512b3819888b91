"""Chunked rows through the engine on the stub backend: what saves write and store (real
bytes on disk), and restores from chunks, with boundaries that are and are not multiples of
n_batch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import LOW_GATES, stub_config

from kvwarm.backends.base import ContextParams
from kvwarm.backends.stub import StubBackend
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, Model
from kvwarm.engine.types import GenerationOptions

CELL_BYTES = 8192  # KV bytes a token: a real model holds more (23 KB for the 135M one)
GREEDY = GenerationOptions(max_tokens=8, temperature=0.0, deterministic=True)


def _engine(root: Path, chunk_tokens: int) -> Engine:
    tiers = (TierConfig("disk", 1 << 32, root),)
    cache = CacheConfig(tiers=tiers, chunk_tokens=chunk_tokens, writer_queue=64)
    return Engine(EngineConfig(cache=cache, policy=LOW_GATES))


def _model(engine: Engine, n_ctx: int = 2048) -> Model:
    cfg = stub_config(backend=StubBackend(cell_bytes=CELL_BYTES), deterministic=True)
    context = ContextParams(n_ctx=n_ctx, n_batch=16, n_ubatch=16)
    return engine.load_model(config=replace(cfg, context=context))


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "rows"


def _stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.suffix in (".kvc", ".kvk"))


def _distinct_tokens(rows: Sequence[Sequence[int]]) -> int:
    """Positions in the trie of every row's tokens: how many distinct prefixes hold KV."""
    trie: dict[int, dict[int, object]] = {}
    count = 0
    for tokens in rows:
        node = trie
        for t in tokens:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                count += 1
            node = nxt  # type: ignore[assignment]
    return count


@pytest.mark.parametrize("chunk_tokens", [16, 24, 64])
def test_restores_from_chunks_equal_the_first_run(root: Path, chunk_tokens: int) -> None:
    with _engine(root, chunk_tokens) as engine:
        model = _model(engine)
        prompt = "The quick brown fox jumps over the lazy dog. " * 5
        first = model.complete(prompt, GREEDY)
        engine.cache.flush()
        assert engine.cache.counters()["chunks_written"] >= 2
        model.evict()  # drop live KV: the next request restores from the chunks
        again = model.complete(prompt, GREEDY)
        assert again.stats.cache_hit == "exact"
        assert again.completion_tokens == first.completion_tokens
        follow = model.complete(prompt + "And then?", GREEDY)
        assert follow.stats.cache_hit in ("partial", "exact")


def test_a_hundred_conversations_store_their_system_prompt_once(root: Path) -> None:
    """100 conversations over a 1,000-token system prompt: stored bytes (files on disk) stay
    within 1.1x of the distinct tokens' KV."""
    system = "".join(f"Rule {i}: answer briefly, cite sources. " for i in range(27))[:999]
    with _engine(root, 256) as engine:
        model = _model(engine)
        assert len(model.tokenize(system)) == 1000
        saved: list[tuple[int, ...]] = []
        for conv in range(100):
            out = model.complete(system + f"User {conv} asks: what is item {conv * 7}?", GREEDY)
            saved.append(tuple(out.tokens))
            if conv == 0:
                assert out.stats.cache_hit == "cold"
            else:
                assert out.stats.cached_tokens >= 1000 - 16  # trimmed to an n_batch multiple
            engine.cache.flush()  # the next conversation finds this one's rows
            model.evict()
        engine.cache.flush()
        rows = engine.cache.rows()
        stored = _stored_bytes(root)
        snap = engine.cache.counters()
    distinct = _distinct_tokens(saved)
    assert len(rows) >= 100
    assert distinct < 1000 + 100 * 60
    assert stored <= 1.1 * distinct * CELL_BYTES, (stored, distinct * CELL_BYTES, snap)


def test_kv_cell_types_are_part_of_every_chunk_key() -> None:
    """Chunks of one cell type never serve another: the types are in the context hash, and
    so in the namespace every chunk key hashes."""
    from kvwarm.cache.formats.chunkfmt import chunk_keys
    from kvwarm.cache.types import Namespace

    tokens = list(range(600))
    keys = set()
    for kv_type in ("f16", "q8_0", "q4_0"):
        ctx = ContextParams(type_k=kv_type, type_v=kv_type)  # type: ignore[arg-type]
        ns = Namespace(b"\x01" * 32, 0, ctx.kv_hash())
        keys.add(chunk_keys(ns, tokens, (256, 256, 88)))
    assert len(keys) == 3
