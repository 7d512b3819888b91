"""The worker's one port to the cache (``engine/worker/cacheport.py``, issue 21): it alone
reads the save policy and looks rows up, and a slot's lifecycle reaches the cache through its
verbs. The stub engine drives a whole request and the port sees each event in order."""

from __future__ import annotations

import ast
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import make_engine, stub_config

from kvwarm.cache.types import PolicyConfig, SaveReason, SaveRequest
from kvwarm.engine.types import GenerationOptions
from kvwarm.engine.worker.cacheport import CachePort

WORKER = Path(__file__).parents[2] / "src" / "kvwarm" / "engine" / "worker"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }


def test_only_the_port_reads_the_save_policy_or_looks_rows_up() -> None:
    for module in sorted(WORKER.glob("*.py")):
        if module.name == "cacheport.py":
            continue
        imported = _imports(module)
        assert "kvwarm.engine.worker.savegates" not in imported, module.name
        source = module.read_text()
        if module.name == "explain.py":
            continue  # its explain_prompt serves `kvwarm cache explain`, with no worker at all
        for call in ("longest_prefix(", "whole_prefixes(", ".save(SaveRequest"):
            assert call not in source, f"{module.name} calls the cache's {call} itself"


def _reaches_the_cache(path: Path) -> list[int]:
    """Lines where a module reads the runtime's cache (``rt.cache``, ``self.rt.cache``)."""
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "cache"
        and (
            (isinstance(node.value, ast.Name) and node.value.id == "rt")
            or (isinstance(node.value, ast.Attribute) and node.value.attr == "rt")
        )
    ]


def test_every_call_from_the_worker_to_the_cache_goes_through_the_port() -> None:
    assert _reaches_the_cache(WORKER / "cacheport.py"), "the check itself finds nothing"
    for module in sorted(WORKER.glob("*.py")):
        if module.name in ("cacheport.py", "runtime.py"):
            continue
        assert _reaches_the_cache(module) == [], f"{module.name} calls the cache past its port"


def test_a_request_reaches_the_cache_through_the_lifecycle_verbs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    for verb in ("lookup", "prefilled", "decoded", "finishing", "finished"):
        original = getattr(CachePort, verb)

        def spy(
            self: CachePort, *args: object, _o: object = original, _v: str = verb, **kw: object
        ) -> object:
            seen.append(_v)
            return _o(self, *args, **kw)  # type: ignore[operator]

        monkeypatch.setattr(CachePort, verb, spy)
    policy = PolicyConfig(
        min_tokens=4, cold_min_tokens=10**6, cold_max_tokens=10**6, continued_interval=2
    )
    engine = make_engine(policy=policy)
    try:
        model = engine.load_model(config=stub_config())
        # ignore_eos: a stub reply that samples EOS among its first tokens would decode fewer
        out = model.complete(list(range(1, 40)), GenerationOptions(max_tokens=5, ignore_eos=True))
        engine.cache.flush()
        assert out.stats.key is not None and engine.cache.has(out.stats.key)
        assert out.stats.completion_tokens == 5
    finally:
        engine.close()
    assert seen[0] == "lookup" and "prefilled" in seen
    assert seen.count("decoded") >= 4  # every generated token but the last goes through it
    assert seen[-2:] == ["finishing", "finished"]


def test_an_exact_repeat_in_a_warm_slot_reads_only_the_rows_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 24: the prompt's row has its final logits and a free slot's live KV holds the
    # prompt; copying the row's KV over that slot was ~12 ms of a ~28 ms exact hit.
    engine = make_engine()
    try:
        model = engine.load_model(config=stub_config(n_parallel=2))
        prompt = [1 + i % 250 for i in range(300)]
        model.prewarm(prompt)
        engine.cache.flush()
        opts = GenerationOptions(max_tokens=3, temperature=0.0)
        first = model.complete(prompt, opts)
        assert first.stats.cached_tokens == len(prompt)
        ctx = model._worker.rt.ctx

        def no_restore(*_: object) -> None:
            raise AssertionError("the row's KV was restored over a slot that held it")

        monkeypatch.setattr(ctx, "kv_unpack", no_restore)
        monkeypatch.setattr(ctx, "kv_unpack_chunks", no_restore)
        monkeypatch.setattr(ctx, "kv_unpack_joined", no_restore)
        again = model.complete(prompt, opts)
        assert again.stats.cached_tokens == len(prompt) and again.stats.cache_hit == "exact"
        assert again.completion_tokens == first.completion_tokens
    finally:
        engine.close()


def test_a_follow_up_turn_packs_only_the_tokens_its_tier_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 24: a chat's next turn saved by packing the whole sequence (~27 MB for 1,200
    # tokens of the embedded model) while the tier already held all but its last ~60.
    opts = GenerationOptions(max_tokens=4, temperature=0.0)
    system = [1 + i % 200 for i in range(300)]
    engine = make_engine()
    try:
        model = engine.load_model(config=stub_config())
        ctx = model._worker.rt.ctx
        starts: list[int] = []
        pack_tail = ctx.kv_pack_tail

        def spy(seq: int, start: int) -> tuple[bytes, int]:
            starts.append(start)
            return pack_tail(seq, start)

        monkeypatch.setattr(ctx, "kv_pack_tail", spy)
        first = model.complete(system, opts)
        engine.cache.flush()
        assert all(s > 0 for s in starts)  # only a published cold row's chunks are held
        starts.clear()
        turn = [*system, *first.completion_tokens, *range(210, 240)]
        second = model.complete(turn, opts)
        engine.cache.flush()
        held = len(system) + len(first.completion_tokens) - 1  # the first finish row
        # The first turn's chunks are published (flushed): this turn's saves (its cold save,
        # its finish save) copy out none of those tokens.
        assert starts and min(starts) >= held
        assert second.stats.key is not None and engine.cache.has(second.stats.key)
        # The row made of held chunks and the packed tail restores like a cold prefill.
        model.prewarm(list(range(100, 140)))  # the slot now holds something else
        third = [*turn, *second.completion_tokens, 7, 8, 9]
        warm = model.complete(third, opts)
        assert warm.stats.cached_tokens >= len(turn)
    finally:
        engine.close()
    cold_engine = make_engine()
    try:
        cold = cold_engine.load_model(config=stub_config()).complete(third, opts)
        assert cold.stats.cached_tokens == 0
        assert warm.completion_tokens == cold.completion_tokens
    finally:
        cold_engine.close()


def test_evict_keeps_live_kv_until_its_in_flight_save_publishes_or_saves_it_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An idle slot whose finish save is still being written is evicted only once that save
    ends; when it fails, the eviction's own sync save keeps the KV (no saved data is lost)."""
    from kvwarm.cache.facade import Cache
    from kvwarm.cache.store.core import CacheCore
    from kvwarm.errors import CacheIOError

    gate, parked = threading.Event(), threading.Event()
    store_row, settled = CacheCore.store_row, Cache.settled
    failed: list[SaveReason] = []

    def failing_finish(self: CacheCore, key: bytes, request: SaveRequest, *a: object) -> object:
        if request.reason is SaveReason.FINISH and not failed:
            failed.append(request.reason)
            gate.wait(30)
            raise CacheIOError("the disk went away")
        return store_row(self, key, request, *a)  # type: ignore[arg-type]

    def spy(self: Cache, key: bytes, timeout_s: float) -> bool:
        parked.set()
        return settled(self, key, timeout_s)

    monkeypatch.setattr(CacheCore, "store_row", failing_finish)
    monkeypatch.setattr(Cache, "settled", spy)
    engine = make_engine()
    try:
        model = engine.load_model(config=stub_config())
        out = model.complete(list(range(1, 40)), GenerationOptions(max_tokens=5, ignore_eos=True))
        assert out.stats.key is not None and engine.cache.has(out.stats.key)  # in flight
        evicted = ThreadPoolExecutor(1).submit(model.evict)
        assert parked.wait(30)  # the eviction waits on the save in flight...
        gate.set()  # ...which fails
        assert evicted.result(30) == 1
        assert failed == [SaveReason.FINISH]
        row = engine.cache.lookup_exact(out.stats.key)
        assert row is not None and row.reason is SaveReason.EVICT
    finally:
        gate.set()
        engine.close()


def test_evict_keeps_live_kv_whose_own_save_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save failing (the tier is gone), the slot's live KV is the only copy of the
    prompt: evict saves nothing and must keep it, so the same prompt still reuses it."""
    from kvwarm.cache.store.core import CacheCore
    from kvwarm.errors import CacheIOError

    def failing(self: CacheCore, key: bytes, request: SaveRequest, *a: object) -> object:
        raise CacheIOError("the disk went away")

    monkeypatch.setattr(CacheCore, "store_row", failing)
    opts = GenerationOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = make_engine()
    try:
        model = engine.load_model(config=stub_config())
        prompt = list(range(1, 60))
        first = model.complete(prompt, opts)
        assert engine.cache.flush(10)
        assert engine.cache.rows() == []  # every save failed
        assert model.evict() == 0
        again = model.complete(prompt, opts)
        assert again.completion_tokens == first.completion_tokens
        # All but the last token, whose logits the request needs.
        assert again.stats.cached_tokens == len(prompt) - 1, "evict dropped the only copy"
    finally:
        engine.close()


def test_a_state_that_cannot_be_packed_is_a_dropped_save_not_a_failed_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llama.cpp refusing to copy a state out (``BackendError``) or no memory for the blob,
    at a cold-save pause mid-prefill, a finish save or evict: the requests are answered,
    the worker goes on, and the cache counts dropped saves."""
    from kvwarm.backends.stub.context import StubContext
    from kvwarm.errors import BackendError

    failures: list[type[BaseException]] = [BackendError, MemoryError]

    def refuse(self: StubContext, *a: object) -> object:
        exc = failures[0]
        failures.reverse()  # alternate the two kinds
        raise exc("no state for you")

    monkeypatch.setattr(StubContext, "kv_pack", refuse)
    monkeypatch.setattr(StubContext, "kv_pack_tail", refuse)
    opts = GenerationOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = make_engine()  # LOW_GATES: cold saves from 16 tokens
    try:
        model = engine.load_model(config=stub_config(n_parallel=2))
        prompts = [list(range(1, 90)), list(range(2, 70))]
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda p: model.complete(p, opts), prompts))
        assert [o.stats.completion_tokens for o in outs] == [4, 4]
        assert engine.cache.flush(10)
        assert engine.cache.rows() == []
        assert engine.cache.counters()["saves_dropped"] >= 2  # cold and finish saves
        assert model.evict() == 0  # its own saves fail too: the KV stays live
        again = model.complete(prompts[0], opts)
        assert again.stats.completion_tokens == 4 and again.stats.cached_tokens > 0
    finally:
        engine.close()


def test_a_finish_row_keeps_its_logits_only_when_it_is_the_prompt() -> None:
    # Issue 38: every finish save stored its final logits (1 MiB a row on Gemma 3's 262k
    # vocabulary), which only a prompt ending at the reply can use; no chat turn sends one.
    policy = PolicyConfig(min_tokens=4, cold_min_tokens=10**6, cold_max_tokens=10**6)
    engine = make_engine(policy=policy)
    try:
        model = engine.load_model(config=stub_config())
        opts = GenerationOptions(max_tokens=6, temperature=0.0, ignore_eos=True)
        prompt = [1 + i % 200 for i in range(40)]
        replied = model.complete(prompt, opts)
        one = model.complete([7 + i % 90 for i in range(40)], replace(opts, max_tokens=1))
        engine.cache.flush()
        rows = {r.key: r for r in engine.cache.rows()}
        assert replied.stats.key is not None and one.stats.key is not None
        long_row = rows[replied.stats.key]
        assert long_row.n_tokens == len(prompt) + 5  # the last sampled token was not decoded
        assert not long_row.has_logits
        assert rows[one.stats.key].has_logits  # the row is the prompt: its repeat decodes nothing
        # The continuation prompt (prompt + reply) still restores all but its last token and
        # samples what a cold run samples.
        cont = list(prompt) + list(replied.completion_tokens[:-1])
        assert engine.cache.key_for(long_row.namespace, cont) == long_row.key
        again = model.complete(cont, replace(opts, max_tokens=3))
        assert again.stats.cached_tokens == len(cont) - 1
    finally:
        engine.close()
    cold_engine = make_engine()
    try:
        cold = cold_engine.load_model(config=stub_config()).complete(
            cont, replace(opts, max_tokens=3)
        )
    finally:
        cold_engine.close()
    assert again.completion_tokens == cold.completion_tokens
