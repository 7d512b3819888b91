"""The library as a program meets it: streams left half-read, engines never closed, models used
after they are closed (stub backend; found by the library review)."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from pathlib import Path

from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.engine.request import Done, Request
from kvwarm.engine.types import CompletionStats, GenerationOptions

LONG = GenerationOptions(max_tokens=200, temperature=0.0, stop=(), ignore_eos=True)


def _final(req: Request) -> CompletionStats:
    """The stats ``req`` was answered with, read from its channel (its stream is gone)."""
    while not req.answered:
        req.channel.get(timeout=60)
    assert isinstance(req.outcome, Done), req.outcome
    return req.outcome.completion.stats


def test_a_stream_left_with_break_is_cancelled() -> None:
    """``for piece in model.stream(...): break`` frees the slot: the request ends "cancelled"
    after a few tokens, not at its max_tokens (it ran to 200 before)."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        stream = model.stream("Tell me a long story", LONG)
        req = stream.request
        backend.gate.step(3)  # the prefill and two tokens; the worker waits before the next
        for piece in stream:
            assert piece
            break
        del stream
        gc.collect()
        backend.gate.set()
        stats = _final(req)
        assert stats.finish_reason == "cancelled"
        assert stats.completion_tokens < 10
    finally:
        eng.close()


def test_a_stream_dropped_unread_is_cancelled_before_it_is_seated() -> None:
    """A queued request whose stream is dropped is never seated: the next one gets the slot."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        first = model.stream("the first one", LONG)
        dropped = model.stream("the dropped one", LONG)
        req = dropped.request
        del dropped
        gc.collect()
        first.cancel()
        backend.gate.set()
        first.result()
        stats = _final(req)
        assert (stats.finish_reason, stats.completion_tokens) == ("cancelled", 0)
    finally:
        eng.close()


def test_an_async_stream_left_with_break_is_cancelled() -> None:
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        stream = model.stream("Tell me a long story", LONG)
        req = stream.request
        backend.gate.step(3)

        async def read_one() -> None:
            async for piece in stream:
                assert piece
                break

        asyncio.run(read_one())  # the loop's shutdown closes the abandoned async generator
        del stream
        gc.collect()
        backend.gate.set()
        assert _final(req).finish_reason == "cancelled"
    finally:
        eng.close()


def test_a_kept_stream_is_never_cancelled_and_forks_keep_their_group() -> None:
    """Only a stream nobody holds is abandoned: ``n > 1`` choices whose first stream was
    dropped still run (cancelling the first of a queued group cancels the whole group), and
    are cancelled once every choice's stream is gone."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        short = GenerationOptions(max_tokens=5, temperature=0.0, stop=(), ignore_eos=True)
        first, second = model.streams("two choices", short, n=2)
        head = first.request
        del first
        gc.collect()
        backend.gate.set()
        assert second.result().stats.finish_reason == "length"
        assert _final(head).finish_reason == "length"

        backend.gate.clear()
        first, second = model.streams("two more", LONG, n=2)
        reqs = [first.request, second.request]
        del first, second
        gc.collect()
        backend.gate.set()
        assert [_final(r).finish_reason for r in reqs] == ["cancelled", "cancelled"]
    finally:
        eng.close()


_UNCLOSED = """
import sys
from pathlib import Path
from tests.engine.conftest import LOW_GATES, stub_config
from kvwarm import CacheConfig, Engine, EngineConfig, TierConfig
disk = TierConfig("disk", 1 << 30, Path(sys.argv[1]))
engine = Engine(EngineConfig(cache=CacheConfig(tiers=(disk,)), policy=LOW_GATES))
model = engine.load_model(config=stub_config())
out = model.complete(sys.argv[2], max_tokens=4, temperature=0.0)
print(out.stats.cache_hit, out.stats.cached_tokens)
"""


def test_an_engine_never_closed_is_closed_at_exit(tmp_path: Path) -> None:
    """A program that ends without ``engine.close()`` keeps what it computed: its saves still
    queued and its slots' live KV reach the disk tier, and the next run restores from them
    (nothing was on disk before: the next run prefilled cold)."""
    prompt = "a prompt long enough to be worth a row on disk, " * 4
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _UNCLOSED, str(tmp_path / "disk"), prompt],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert done.returncode == 0, done.stderr
        hit, cached = done.stdout.split()
        runs.append((hit, int(cached)))
    assert runs[0] == ("cold", 0)
    assert runs[1][0] != "cold" and runs[1][1] > 0, runs
