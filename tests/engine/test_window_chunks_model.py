"""Gemma 3 270M's sliding window (n_swa 512) stored in chunks (KVC version 4), deterministic
mode: two checkpoints of one conversation share all but their newest window cells and two
conversations share their system prompt's window (asserted from the files on disk), and every
restore gives a cold run's tokens and logprobs bit for bit: from the tier that saved it, after
a restart, and from a shared directory (read there, then from the local copy it is promoted
to).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
from tests.engine import memkit
from tests.engine.memkit import same

from kvwarm.backends import kv_chunk
from kvwarm.buffers import u8
from kvwarm.cache.formats import chunkfmt, kvc
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import Completion, GenerationOptions

pytestmark = [pytest.mark.model, pytest.mark.slow]

N_BATCH = 256
OPTS = GenerationOptions(max_tokens=4, temperature=0.0, logprobs=2)
POLICY = memkit.exact_policy(N_BATCH)
SYSTEM = memkit.GEMMA_SYSTEM


def _engine(tiers: Sequence[TierConfig]) -> Engine:
    cache = CacheConfig(tiers=(TierConfig("ram", 512 << 20), *tiers), chunk_tokens=N_BATCH)
    return Engine(EngineConfig(cache=cache, policy=POLICY))


def _load(eng: Engine, path: str) -> Model:
    return memkit.load(eng, path, n_ctx=1536, n_batch=N_BATCH)


def _cold(path: str, tokens: list[int]) -> Completion:
    eng = memkit.engine(None, POLICY, ram=512 << 20)
    try:
        out = memkit.load(eng, path, n_ctx=1536, n_batch=N_BATCH).complete(tokens, OPTS)
        assert out.stats.cached_tokens == 0
        return out
    finally:
        eng.close()


def _manifests(root: Path) -> dict[int, kvc.KvcFields]:
    """Every row on disk by its length, read from its file."""
    out = {}
    for path in root.glob("*.kvc"):
        fields = kvc.parse(path.read_bytes()).meta.fields
        out[len(fields.tokens)] = fields
    return out


def _window_cell_bytes(root: Path, key: bytes) -> tuple[int, int]:
    """(cells, bytes a cell) of a window chunk file."""
    obj = (root / f"{key.hex()}.kvk").read_bytes()
    payload = chunkfmt.parse(obj, key)
    view = kv_chunk.parse(u8(payload), kv_chunk.CODEC_LLAMA)
    assert view.flags == kv_chunk.FLAG_REST
    return view.n_cells, view.body.size // view.n_cells


def test_windows_are_shared_and_every_restore_is_exact(tmp_path: Path, gemma_path: str) -> None:
    disk = tmp_path / "disk"
    eng = _engine([TierConfig("disk", 1 << 30, disk)])
    try:
        model = _load(eng, gemma_path)
        system = model.tokenize(SYSTEM * 20, add_special=True)[:600]
        a = [*system, *model.tokenize("Q: who kept the light?", add_special=False)]
        b = [*system, *model.tokenize("Q: when was the school built?", add_special=False)]
        first = model.complete(a, OPTS)
        same(first, _cold(gemma_path, a))
        a2 = [*a, *first.completion_tokens, *model.tokenize(" Q: and then?", add_special=False)]
        model.evict()
        eng.cache.flush()
        # Deterministic: resumes where a canonical prefix aligned to n_batch was saved.
        follow = model.complete(a2, OPTS)
        assert follow.stats.cached_tokens >= 512
        same(follow, _cold(gemma_path, a2))
        model.evict()
        eng.cache.flush()
        other = model.complete(b, OPTS)
        assert other.stats.cached_tokens >= 512
        same(other, _cold(gemma_path, b))
        model.evict()
        assert eng.cache.flush()
    finally:
        eng.close()

    rows = _manifests(disk)
    windowed = {n: f for n, f in rows.items() if f.rest_chunks is not None}
    assert windowed and all(n in windowed for n in rows if n >= N_BATCH)  # chunked: version 4
    by_key = {n: set(f.rest_chunks.keys) for n, f in windowed.items()}  # type: ignore[union-attr]
    ends_a = [n for n, f in windowed.items() if f.tokens == tuple(a2[:n])]
    ends_b = [n for n, f in windowed.items() if f.tokens == tuple(b[:n]) and n > len(system)]
    a_rows = sorted(n for n in ends_a if n > len(system))
    assert len(a_rows) >= 2 and ends_b
    # Two checkpoints of one conversation share their window's cells but the newest: past 512
    # (their canonical prefix aligned to n_batch) chunks are keyed apart by the deterministic
    # rule, and the longer one's window starts a grid cell or so later.
    # (Cut every 64 positions: a window below 512 is 7 or 8 chunks.)
    lo, hi = a_rows[0], a_rows[-1]
    assert len(by_key[lo] - by_key[hi]) <= 3 and len(by_key[lo] & by_key[hi]) >= 6
    # ... and two conversations share their system prompt's window.
    assert len(by_key[a_rows[0]] & by_key[max(ends_b)]) >= 6
    # In bytes: each window cell is stored about once, not once per checkpoint.
    keys = set().union(*by_key.values())
    cells = stored = 0
    for key in keys:
        n, cell = _window_cell_bytes(disk, key)
        cells += n
        stored += (disk / f"{key.hex()}.kvk").stat().st_size
    restored = sum(512 * cell for _ in windowed)  # what the rows' windows restore
    assert cells <= 512 + sum(n - 512 for n in windowed) + 32 * len(windowed)
    assert stored < restored / 2

    # A restart restores from disk, bit for bit.
    eng = _engine([TierConfig("disk", 1 << 30, disk)])
    try:
        again = _load(eng, gemma_path).complete(a2, OPTS)
        assert again.stats.cached_tokens >= 512
        same(again, follow)
    finally:
        eng.close()

    # From a directory other hosts share: read there (and promoted to RAM), then from RAM.
    shared = tmp_path / "shared"
    shutil.copytree(disk, shared)
    eng = _engine([TierConfig("disk", 1 << 30, shared, shared=True)])
    try:
        model = _load(eng, gemma_path)
        for _ in range(2):
            out = model.complete(b, OPTS)
            assert out.stats.cached_tokens >= 512
            same(out, other)
            model.evict()
            assert eng.cache.flush()
        assert eng.cache.counters()["promotions"] >= 1
    finally:
        eng.close()


def test_damaged_window_chunks_fall_back_cold_and_the_next_save_heals_them(
    tmp_path: Path, gemma_path: str
) -> None:
    """Every window chunk of a conversation's checkpoints damaged on disk (a payload byte:
    their heads are intact, so the startup scan keeps them). After a restart the restore
    meets the damage: a cold prefill, the same reply as before; the bad chunks go to
    ``quarantine/``, the save writes them again, and the next restart restores the prompt
    bit for bit. (Before, the checkpoints sharing those chunks kept them: the save reused
    them and every restart prefilled cold again.)"""
    disk = tmp_path / "disk"
    nb = 64

    def engine() -> Engine:
        tiers = (TierConfig("ram", 256 << 20), TierConfig("disk", 1 << 30, disk))
        cache = CacheConfig(tiers=tiers, chunk_tokens=nb)
        return Engine(EngineConfig(cache=cache, policy=memkit.exact_policy(nb)))

    def run(tokens: list[int] | None = None) -> tuple[list[int], Completion]:
        eng = engine()
        try:
            model = memkit.load(eng, gemma_path, n_ctx=1024, n_batch=nb)
            if tokens is None:
                tokens = model.tokenize(SYSTEM * 4, add_special=True)[:250]
            out = model.complete(tokens, OPTS)
            model.evict()
            assert eng.cache.flush()
            return tokens, out
        finally:
            eng.close()

    tokens, first = run()
    rest_keys = {k for f in _manifests(disk).values() if f.rest_chunks for k in f.rest_chunks.keys}
    assert len(rest_keys) >= 8
    for key in rest_keys:
        path = disk / f"{key.hex()}.kvk"
        data = bytearray(path.read_bytes())
        data[-3] ^= 1
        path.write_bytes(bytes(data))
    _, damaged = run(tokens)
    assert damaged.stats.cached_tokens == 0
    assert damaged.stats.reuse is not None and damaged.stats.reuse.detail == "corrupt"
    same(damaged, first)
    aside = {p.name for p in (disk / "quarantine").iterdir()}
    assert aside and aside <= {f"{k.hex()}.kvk" for k in rest_keys}
    _, healed = run(tokens)
    assert healed.stats.cached_tokens > 0
    same(healed, first)
