"""Miss and partial-hit reasons on the stub (issue 25): every completion's
``stats.reuse`` says what the planner found and why it reused no more. Each test produces one
reason on purpose (``kvwarm.cache.explain.MissReason``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import LOW_GATES, make_engine, stub_config

from kvwarm.backends.base import ContextParams
from kvwarm.backends.stub import StubBackend
from kvwarm.cache.explain import MissReason, ReuseReport
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import Completion, GenerationOptions
from kvwarm.errors import StateRestoreError

GREEDY = GenerationOptions(max_tokens=4, temperature=0.0)
P = "The system prompt says: be brief and kind. Question: what is a cache? " * 2
OTHER = "Entirely different words that share nothing."


def reuse(out: Completion) -> ReuseReport:
    assert out.stats.reuse is not None
    assert out.stats.reuse.reused_tokens == out.stats.cached_tokens
    return out.stats.reuse


def run(engine: Engine, model: Model, prompt: str, **kw: object) -> Completion:
    out = model.complete(prompt, GREEDY, **kw)  # type: ignore[arg-type]
    engine.cache.flush()
    return out


def test_no_prefix_then_last_token_then_new_tokens(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    first = run(engine, model, P)
    assert reuse(first).reason is MissReason.NO_PREFIX
    assert reuse(first).found_tokens == 0
    again = run(engine, model, P)  # the row holds P and the reply, not P's final logits
    r = reuse(again)
    assert r.reason is MissReason.LAST_TOKEN
    assert r.found_tokens == first.stats.prompt_tokens == r.reused_tokens + 1
    longer = run(engine, model, P + " And one more question.")
    r = reuse(longer)
    assert r.reason is MissReason.NEW_TOKENS
    assert r.reused_tokens == r.found_tokens >= first.stats.prompt_tokens


def test_a_prewarmed_prompt_is_reused_whole(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    model.prewarm(P)
    engine.cache.flush()
    model.evict()
    engine.cache.flush()
    out = run(engine, model, P)
    r = reuse(out)
    assert r.reason is MissReason.NONE
    assert r.reused_tokens == out.stats.prompt_tokens


def test_deterministic_mode_trims_to_the_batch_boundary(engine: Engine) -> None:
    model = engine.load_model(config=stub_config(deterministic=True, n_batch=16))
    first = run(engine, model, P)
    n = first.stats.prompt_tokens
    assert n % 16, "the prompt must not end on a boundary for this test"
    out = run(engine, model, P + " More.")
    r = reuse(out)
    assert r.reason is MissReason.ALIGNED_TRIM
    assert r.found_tokens >= n
    assert r.reused_tokens == out.stats.cached_tokens and r.reused_tokens % 16 == 0
    assert r.reused_tokens < r.found_tokens


def test_an_evicted_row_is_named_with_its_tier_and_policy(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    first = run(engine, model, P)
    model.evict()  # the slot's live KV goes; only rows could serve now
    engine.cache.flush()
    assert engine.cache.evict_bytes(1 << 40).rows > 0
    out = run(engine, model, P + " More.")
    r = reuse(out)
    assert r.reason is MissReason.EVICTED
    assert (r.tier, r.detail) == ("ram", "lru")
    assert r.found_tokens >= first.stats.prompt_tokens and r.reused_tokens == 0
    assert r.age_s is not None and r.age_s >= 0.0


def test_a_deleted_row_is_named_too(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    run(engine, model, P)
    model.evict()
    engine.cache.flush()
    for row in engine.cache.rows():
        engine.cache.delete(row.key)
    r = reuse(run(engine, model, P + " More."))
    assert (r.reason, r.detail) == (MissReason.EVICTED, "deleted")


def test_an_expired_row_is_named_with_its_ttl_class() -> None:
    tiny = (0.001, 0.001, 0.001)  # the shortest TTL the config takes
    cache = CacheConfig(tiers=(TierConfig("ram", 64 << 20),), ttl_seconds=tiny)
    eng = Engine(EngineConfig(cache=cache, policy=LOW_GATES))
    try:
        model = eng.load_model(config=stub_config())
        run(eng, model, P)
        model.evict()
        eng.cache.flush()
        deadline = time.monotonic() + 10
        while eng.cache.rows() and time.monotonic() < deadline:  # until a millisecond passed
            eng.cache.gc()
        assert eng.cache.rows() == []
        r = reuse(run(eng, model, P + " More."))
        assert (r.reason, r.detail, r.tier) == (MissReason.EXPIRED, "short", "ram")
        assert r.found_tokens > 0
    finally:
        eng.close()


def test_an_unreadable_row_is_named_and_prefilled_cold(tmp_path: Path) -> None:
    eng = make_engine(tmp_path)
    try:
        model = eng.load_model(config=replace(stub_config(), save_tier="disk"))
        run(eng, model, P)
        model.evict()
        eng.cache.flush()
        files = [f for f in (tmp_path / "disk").rglob("*") if f.is_file()]
        assert files
        for f in files:
            f.write_bytes(b"")  # every row and chunk: truncated
        out = run(eng, model, P + " More.")
        r = reuse(out)
        assert r.reason is MissReason.UNREADABLE
        assert r.detail in ("corrupt", "missing")
        assert out.stats.cached_tokens == 0 and r.found_tokens > 0
    finally:
        eng.close()


def test_a_row_of_another_context_is_named_but_never_another_salts(engine: Engine) -> None:
    a = engine.load_model(config=stub_config())
    wide = replace(stub_config(), context=ContextParams(n_ctx=1024, n_batch=16, n_ubatch=16))
    b = engine.load_model(model_id="b", config=wide)
    assert a.namespace() != b.namespace()
    run(engine, a, P)
    r = reuse(run(engine, b, P))
    assert (r.reason, r.detail) == (MissReason.OTHER_NAMESPACE, "context")
    assert r.found_tokens >= len(a.tokenize(P)) and r.reused_tokens == 0
    # Alice's row under model a: Alice on model b is told; Bob on model b is not.
    run(engine, a, OTHER, cache_salt="alice")
    r = reuse(run(engine, b, OTHER, cache_salt="alice"))
    assert r.reason is MissReason.OTHER_NAMESPACE
    r = reuse(run(engine, b, OTHER + " Go.", cache_salt="bob"))
    assert r.reason is MissReason.NO_PREFIX and r.found_tokens == 0


def test_a_recurrent_state_cannot_resume_where_the_prompts_diverge(engine: Engine) -> None:
    backend = StubBackend(memory_kind="recurrent")
    model = engine.load_model(config=stub_config(backend=backend))
    # They diverge one token past a multiple of 8 (the cold save's alignment): the longest
    # whole-prefix row is shorter than what the prompts share.
    shared = len(model.tokenize(P + "QQ: "))
    assert shared % 8, shared
    run(engine, model, P + "QQ: alpha?")
    model.evict()
    engine.cache.flush()
    out = run(engine, model, P + "QQ: beta?")
    r = reuse(out)
    assert r.reason is MissReason.MEMORY_FLOOR
    assert r.found_tokens > r.reused_tokens


def test_prompt_logprobs_reuse_nothing(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    run(engine, model, P)
    out = model.complete(P, replace(GREEDY, prompt_logprobs=0))
    r = reuse(out)
    assert r.reason is MissReason.PROMPT_LOGPROBS and r.reused_tokens == 0
    assert r.found_tokens == out.stats.prompt_tokens


def test_a_failed_restore_is_named(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    run(engine, model, P)
    model.evict()
    engine.cache.flush()
    ctx = model._worker.rt.ctx

    def refuse(*args: object) -> int:
        raise StateRestoreError("refused on purpose")

    ctx.kv_unpack = refuse  # type: ignore[method-assign]
    ctx.kv_unpack_chunks = refuse  # type: ignore[method-assign]
    out = run(engine, model, P + " More.")
    r = reuse(out)
    assert r.reason is MissReason.RESTORE_FAILED and out.stats.cached_tokens == 0


@pytest.fixture
def blocked() -> Iterator[tuple[Engine, threading.Event]]:
    """An engine whose one writer thread is held by a job until the event is set."""
    cache = CacheConfig(tiers=(TierConfig("ram", 64 << 20),), writer_threads=1, writer_queue=16)
    eng = Engine(EngineConfig(cache=cache, policy=LOW_GATES))
    release, started = threading.Event(), threading.Event()

    def hold() -> bool:
        started.set()
        release.wait()
        return True

    writer = eng.cache._writer  # type: ignore[attr-defined]
    assert writer.submit(hold)
    assert started.wait(30)
    try:
        yield eng, release
    finally:
        release.set()
        eng.close()


def test_a_save_still_in_flight_is_named(blocked: tuple[Engine, threading.Event]) -> None:
    eng, release = blocked
    model = eng.load_model(config=stub_config())
    first = model.complete(P, GREEDY)  # its saves wait behind the held writer
    model.complete(OTHER, GREEDY)  # the slot now holds other tokens
    r = reuse(model.complete(P + " More.", GREEDY))
    assert (r.reason, r.tier) == (MissReason.SAVE_IN_FLIGHT, "ram")
    assert r.found_tokens >= first.stats.prompt_tokens
    release.set()
    eng.cache.flush()
    model.complete(OTHER, GREEDY)
    r = reuse(model.complete(P + " More.", GREEDY))
    assert r.reason in (MissReason.NEW_TOKENS, MissReason.LAST_TOKEN)
    assert r.reused_tokens >= first.stats.prompt_tokens


def test_a_dropped_save_is_named(blocked: tuple[Engine, threading.Event]) -> None:
    eng, _ = blocked
    writer = eng.cache._writer  # type: ignore[attr-defined]
    while writer.submit(lambda: True):  # fill the queue behind the held job
        pass
    model = eng.load_model(config=stub_config())
    first = model.complete(P, GREEDY)
    model.complete(OTHER, GREEDY)
    r = reuse(model.complete(P + " More.", GREEDY))
    assert (r.reason, r.detail) == (MissReason.SAVE_DROPPED, "queue_full")
    assert r.found_tokens >= first.stats.prompt_tokens


def test_a_row_evicted_between_lookup_and_read_is_named_evicted(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    run(engine, model, P)
    model.evict()
    engine.cache.flush()
    cache = engine.cache
    original = cache.open_row

    def evicted_first(key: bytes, **kw: int) -> object:
        cache.evict_bytes(1 << 40)  # the row leaves after the lookup found it
        return original(key, **kw)  # type: ignore[arg-type]

    cache.open_row = evicted_first  # type: ignore[method-assign,assignment]
    try:
        out = run(engine, model, P + " More.")
    finally:
        cache.open_row = original  # type: ignore[method-assign]
    r = reuse(out)
    assert (r.reason, r.detail) == (MissReason.EVICTED, "lru")
    assert out.stats.cached_tokens == 0


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_an_exact_hit_that_finishes_at_admission_still_says_why(max_tokens: int) -> None:
    """A row's stored logits answer a 0- or 1-token request inside admission; its stats
    explain the reuse like any other request's."""
    engine = make_engine()
    try:
        model = engine.load_model(config=stub_config())
        prompt = list(range(1, 60))
        model.prewarm(prompt)  # a row of the whole prompt with its final logits
        assert engine.cache.flush(10)
        model.evict()  # only the row can serve it
        out = model.complete(
            prompt, GenerationOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
        assert out.stats.cached_tokens == len(prompt) and out.stats.cache_hit == "exact"
        assert out.stats.reuse is not None
        assert out.stats.reuse.reused_tokens == len(prompt)
    finally:
        engine.close()
