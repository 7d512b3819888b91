"""A local row's chunk files read by the restoring thread and a helper together
(``chunking.load_chunks`` with a helper pool): the payloads come back in order, a busy helper
never holds a restore up, a bad chunk read on either thread fails the read, and a torn,
extended, flipped or missing chunk file through the cache is a dropped row, never a misread."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.cache.chunkkit import blob, chunked_request, join
from tests.cache.tierkit import NS

from kvwarm.cache import Cache, CacheConfig, TierConfig
from kvwarm.cache import facade as facade_mod
from kvwarm.cache.store.chunking import load_chunks
from kvwarm.errors import CacheFormatError, CacheKeyError

KEYS = [bytes([i]) * 32 for i in range(6)]
#: Long enough for a thread that is scheduled to take a chunk; a failure, never a wait.
GUARD_S = 30.0


class FakeTier:
    """Chunks ``KEYS[i]`` hold ``i`` repeated; ``load_chunk`` runs ``on_load`` first."""

    def __init__(self, on_load: object = None, bad: int | None = None) -> None:
        self.threads: dict[int, int] = {}
        self._on_load = on_load
        self._bad = bad

    def load_chunk(self, key: bytes, buffer: memoryview | None = None) -> memoryview:
        i = KEYS.index(key)
        self.threads[i] = threading.get_ident()
        if callable(self._on_load):
            self._on_load(i)
        if i == self._bad:
            raise CacheFormatError(f"chunk {i} is corrupt")
        data = bytes([i]) * (100 + i)
        if buffer is not None and buffer.nbytes == len(data):
            buffer[:] = data
            return buffer
        return memoryview(data)


@pytest.fixture
def helper() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("arena", [False, True])
def test_the_caller_and_a_helper_each_read_chunks_and_the_payloads_keep_their_order(
    helper: ThreadPoolExecutor, arena: bool
) -> None:
    both = threading.Event()
    first_reader: list[int] = []

    def on_load(i: int) -> None:
        # Whichever thread takes a chunk first holds it until the other has taken one.
        me = threading.get_ident()
        if not first_reader:
            first_reader.append(me)
            assert both.wait(GUARD_S), "the second thread never took a chunk"
        elif me != first_reader[0]:
            both.set()

    tier = FakeTier(on_load)
    sizes = [100 + i for i in range(len(KEYS))]
    buf = bytearray(sum(sizes)) if arena else None
    views = load_chunks(tier, KEYS, buf, sizes if arena else (), helper)  # type: ignore[arg-type]
    assert [bytes(v) for v in views] == [bytes([i]) * (100 + i) for i in range(len(KEYS))]
    assert len(set(tier.threads.values())) == 2
    if buf is not None:
        assert all(v.obj is buf for v in views)  # each read into its own slice of the arena


def test_a_busy_helper_never_holds_the_read_up(helper: ThreadPoolExecutor) -> None:
    gate = threading.Event()
    helper.submit(gate.wait, GUARD_S)  # its one thread is busy elsewhere
    try:
        tier = FakeTier()
        views = load_chunks(tier, KEYS, None, (), helper)  # type: ignore[arg-type]
        assert [bytes(v)[0] for v in views] == list(range(len(KEYS)))
        assert set(tier.threads.values()) == {threading.get_ident()}
    finally:
        gate.set()


@pytest.mark.parametrize("bad", [0, 3, 5])
def test_a_bad_chunk_fails_the_read_whichever_thread_reads_it(
    helper: ThreadPoolExecutor, bad: int
) -> None:
    tier = FakeTier(bad=bad)
    with pytest.raises(CacheFormatError, match=f"chunk {bad} is corrupt"):
        load_chunks(tier, KEYS, None, (), helper)  # type: ignore[arg-type]


@pytest.mark.parametrize("damage", ["flip", "torn", "cut_one", "extend", "remove", "symlink"])
@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_damaged_chunk_file_read_beside_a_helper_drops_the_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str, victim: int
) -> None:
    monkeypatch.setattr(facade_mod, "LOCAL_READ_HELPERS", 1)
    root = tmp_path / "kvc"
    cfg = CacheConfig(tiers=(TierConfig("disk", 1 << 30, root=root),), chunk_tokens=256)
    tokens = list(range(600))
    with Cache(cfg, background=False) as cache:
        key = cache.save(chunked_request(NS, tokens, tier="disk"), sync=True)
        assert key is not None
        with cache.open_row(key) as row:  # read by both threads: the saved blob
            assert len(row.chunks) == 3 and join(row.chunks) == blob(tokens)
        files = sorted(root.glob("*.kvk"))
        assert len(files) == 3
        path = files[victim]
        data = path.read_bytes()
        if damage == "flip":
            path.write_bytes(data[:-7] + bytes([data[-7] ^ 0x04]) + data[-6:])
        elif damage == "torn":  # a writer's half-written file under the final name
            path.write_bytes(data[: len(data) // 2])
        elif damage == "cut_one":
            path.write_bytes(data[:-1])
        elif damage == "extend":
            path.write_bytes(data + b"\0" * 64)
        elif damage == "remove":
            path.unlink()
        else:  # the same bytes behind a link: never opened through it
            real = tmp_path / "elsewhere.kvk"
            real.write_bytes(data)
            path.unlink()
            os.symlink(real, path)
        with pytest.raises((CacheFormatError, CacheKeyError)), cache.open_row(key):
            pass
        assert cache.lookup_exact(key) is None
