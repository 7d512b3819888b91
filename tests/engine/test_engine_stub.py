"""Engine behaviour on the stub backend: request path, cache use, queueing, errors."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.types import Completion, GenerationOptions
from kvwarm.errors import (
    ContextOverflowError,
    EngineClosedError,
    InvalidRequestError,
    ModelExistsError,
    UnknownModelError,
)

GREEDY = GenerationOptions(max_tokens=12, temperature=0.0)
PROMPT = "The system prompt says: be brief and kind. Question: what is a cache?"


def test_complete_returns_text_tokens_and_stats(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    out = model.complete(PROMPT, GREEDY)
    assert out.text
    assert out.tokens == out.prompt_tokens + out.completion_tokens
    assert out.stats.prompt_tokens == len(model.tokenize(PROMPT))
    assert 0 < out.stats.completion_tokens <= 12
    assert out.stats.cache_hit == "cold"
    assert out.stats.cached_tokens == 0
    assert out.stats.finish_reason in ("stop", "length")


def test_repeat_prompt_is_served_from_cache_with_same_output(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    first = model.complete(PROMPT, GREEDY)
    engine.cache.flush()
    model.evict()  # drop live KV so the second request must restore from the cache
    second = model.complete(PROMPT, GREEDY)
    assert second.text == first.text
    assert second.stats.cache_hit == "exact"
    assert second.stats.cached_tokens >= second.stats.prompt_tokens - 1
    assert engine.cache.counters()["hits_exact"] == 1  # a row holding the whole prompt


def test_live_slot_kv_is_reused_without_the_cache(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    model.complete(PROMPT, GREEDY)
    again = model.complete(PROMPT + " And a follow-up.", GREEDY)
    assert again.stats.cache_hit == "partial"
    assert again.stats.cached_tokens >= len(model.tokenize(PROMPT)) - 1


def test_stateless_multiturn_hits_from_turn_two(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    messages: list[dict[str, object]] = [{"role": "system", "content": "You are terse."}]
    previous_prompt = 0
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question number {turn}?"})
        out = model.chat(messages, options=GREEDY)
        if turn == 0:
            assert out.stats.cache_hit == "cold"
        else:
            assert out.stats.cache_hit == "partial"
            # Everything up to and including the previous turn's prompt came from KV.
            assert out.stats.cached_tokens >= previous_prompt
        previous_prompt = out.stats.prompt_tokens
        messages.append({"role": "assistant", "content": out.text})
        model.evict()  # force the next turn through the cache, not the slot's live KV


def test_parent_key_resumes_the_previous_turn(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    first = model.complete(PROMPT, GREEDY)
    assert first.stats.key is not None
    follow = (
        first.prompt_tokens
        + first.completion_tokens
        + tuple(model.tokenize(" ok?", add_special=False))
    )
    model.evict()
    second = model.complete(
        list(follow), GenerationOptions(max_tokens=4, temperature=0.0, parent_key=first.stats.key)
    )
    assert engine.cache.counters()["hits_resume"] >= 1
    assert second.stats.cached_tokens >= len(first.prompt_tokens) + len(first.completion_tokens) - 1


def test_concurrent_agents_share_a_system_prompt(engine: Engine) -> None:
    model = engine.load_model(config=stub_config(n_parallel=2))
    system = "You are one of four agents. Shared instructions: " + "follow the plan. " * 6
    n_system = len(model.tokenize(system))
    streams = [model.stream(system + f"Agent {i}: go.", GREEDY) for i in range(4)]
    results = [s.result() for s in streams]
    reused = [r.stats.cached_tokens for r in results[1:]]
    # The first agent pays for the shared prompt; every later one reuses it (from a live slot
    # via seq_cp / affinity, or from the cache).
    assert results[0].stats.cached_tokens == 0 or results[1].stats.cached_tokens == 0
    assert sum(1 for r in results if r.stats.cached_tokens >= n_system - 8) >= 2
    assert all(c > 0 for c in reused[1:])


def test_models_never_share_rows_and_reload_keeps_the_cache(engine: Engine) -> None:
    a = engine.load_model("a.gguf", model_id="a", config=stub_config())
    b = engine.load_model("b.gguf", model_id="b", config=stub_config())
    a.complete(PROMPT, GREEDY)
    engine.cache.flush()
    out_b = b.complete(PROMPT, GREEDY)
    assert out_b.stats.cache_hit == "cold"
    engine.unload_model("a")
    with pytest.raises(UnknownModelError):
        engine.get_model("a")
    a2 = engine.load_model("a.gguf", model_id="a", config=stub_config())
    again = a2.complete(PROMPT, GREEDY)
    assert again.stats.cache_hit == "exact"


def test_disk_tier_serves_hits_after_restart(tmp_path: Path) -> None:
    eng = make_engine(tmp_path)
    cfg = replace(stub_config(), save_tier="disk")
    model = eng.load_model(config=cfg)
    first = model.complete(PROMPT, GREEDY)
    eng.close()
    eng2 = make_engine(tmp_path)
    try:
        model2 = eng2.load_model(config=cfg)
        second = model2.complete(PROMPT, GREEDY)
        assert second.stats.cache_hit == "exact"
        assert second.text == first.text
    finally:
        eng2.close()


def test_cancel_mid_stream_ends_with_stats() -> None:
    """The worker is held between tokens: cancel must end the request there, as "cancelled",
    long before max_tokens (a cancel that does nothing runs it to its end and fails this)."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        opts = GenerationOptions(max_tokens=200, temperature=0.0, stop=(), ignore_eos=True)
        stream = model.stream("Tell me a long story", opts)
        backend.gate.step(3)  # the prefill and two tokens; the worker waits before the next
        it = iter(stream)
        first = next(it)
        assert first
        stream.cancel()
        stream.cancel()  # idempotent
        backend.gate.set()
        rest = "".join(it)
        done = stream.completion
        assert done is not None
        assert done.stats.finish_reason == "cancelled"
        assert 1 <= done.stats.completion_tokens <= 4
        assert done.text == first + rest
        # The model is free for the next request.
        assert model.complete("hi", GenerationOptions(max_tokens=2, temperature=0.0)).text
    finally:
        eng.close()


def test_requests_queue_fifo() -> None:
    """Six requests for one slot, all submitted while the worker is held: they are admitted in
    submission order."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        opts = GenerationOptions(max_tokens=6, temperature=0.0)
        streams = [model.stream(f"request {i}", opts) for i in range(6)]
        assert model.status().queued >= 5  # the gate holds the first: the rest must wait
        backend.gate.set()
        done = [s.result() for s in streams]
        admitted = [
            s._req.submitted + d.stats.queue_ms / 1e3 for s, d in zip(streams, done, strict=True)
        ]
        assert admitted == sorted(admitted)
    finally:
        eng.close()


def test_async_stream_matches_sync(engine: Engine) -> None:
    """The same prompt, greedy: the async stream yields exactly the sync completion's text."""
    model = engine.load_model(config=stub_config())
    sync = model.complete(PROMPT, GREEDY)

    async def run() -> tuple[str, str]:
        stream = model.stream(PROMPT, GREEDY)
        parts = [p async for p in stream]
        done = await stream.aresult()
        return "".join(parts), done.text

    joined, text = asyncio.run(run())
    assert sync.text
    assert joined == text == sync.text


def test_bad_options_are_clear_errors(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    with pytest.raises(InvalidRequestError):
        model.complete("x", temperature=-1.0)
    with pytest.raises(InvalidRequestError):
        model.complete("x", no_such_option=1)
    with pytest.raises(InvalidRequestError):
        model.complete([])
    with pytest.raises(InvalidRequestError):
        model.complete([10**9])
    with pytest.raises(ContextOverflowError):
        model.complete("y" * 600)
    with pytest.raises(ModelExistsError):
        engine.load_model(model_id=model.id, config=stub_config())


def test_unloaded_model_refuses_requests(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    model.unload()
    with pytest.raises(EngineClosedError):
        model.complete("x")


def test_prewarm_makes_the_first_request_hit(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    system = "System: you answer in one word. "
    stats = model.prewarm(system)
    assert stats.completion_tokens == 0
    engine.cache.flush()
    model.evict()
    out = model.complete(system + "Colour of the sky?", GREEDY)
    assert out.stats.cache_hit == "partial"
    assert out.stats.cached_tokens >= len(model.tokenize(system)) - 1


def test_stop_sequences_cut_the_text(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    free = model.complete(PROMPT, GenerationOptions(max_tokens=30, temperature=0.0))
    if len(free.text) < 4:
        pytest.fail(f"stub produced too little text to test stops: {free.text!r}")
    stop = free.text[2:4]
    cut = model.complete(PROMPT, GenerationOptions(max_tokens=30, temperature=0.0, stop=(stop,)))
    assert cut.stats.finish_reason == "stop"
    assert stop not in cut.text
    assert free.text.startswith(cut.text)
    # Which stop string ended it is reported (Anthropic's stop_sequence needs it).
    assert cut.stats.stop_sequence == stop and free.stats.stop_sequence is None


def test_embeddings_are_normalised(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    vecs = model.embed(["hello", "world"])
    assert len(vecs) == 2
    for v in vecs:
        assert abs(sum(x * x for x in v) - 1.0) < 1e-4


@pytest.mark.parametrize("prompt", [None, 5, 1.5, b"ab", bytearray(b"ab")])
def test_a_prompt_that_is_neither_text_nor_token_ids_is_refused(
    engine: Engine, prompt: object
) -> None:
    """Found by review: None or a number raised TypeError, bytes became token ids, and
    tokenize() of a non-string raised AttributeError."""
    model = engine.load_model(config=stub_config())
    with pytest.raises(InvalidRequestError):
        model.complete(prompt, GREEDY)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        model.tokenize(prompt)  # type: ignore[arg-type]


@pytest.mark.parametrize("inputs", [[1, 2, 3], [None], [1.5], 5, None, b"ab", [b"ab"]])
def test_embed_refuses_what_is_neither_text_nor_token_ids(engine: Engine, inputs: object) -> None:
    """Found by review: a flat list of ids, None or a number raised TypeError from iterating
    it, and bytes passed as token ids."""
    model = engine.load_model(config=stub_config())
    with pytest.raises(InvalidRequestError):
        model.embed(inputs)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens", [None, 5, b"ab", "ab", (t for t in [100]), [True], [1.0]])
def test_detokenize_refuses_what_is_not_a_list_of_token_ids(engine: Engine, tokens: object) -> None:
    """Found by review, as for a prompt: None raised TypeError, a generator ValueError (read
    twice, once by the check), and bytes or a text were read as token ids."""
    model = engine.load_model(config=stub_config())
    for call in (model.detokenize, model.token_pieces):
        with pytest.raises(InvalidRequestError):
            call(tokens)  # type: ignore[arg-type]
    assert model.detokenize((100, 101)) == "ab"
    assert model.token_pieces([100, 1]) == [b"a", b"<s>"]


def test_adapter_changes_the_namespace_and_rows_never_cross(engine: Engine, tmp_path: Path) -> None:
    model = engine.load_model(config=stub_config())
    base_fp = model.info().fingerprint
    model.complete(PROMPT, GREEDY)
    engine.cache.flush()
    adapter = tmp_path / "lora.gguf"
    adapter.write_bytes(b"fake adapter weights")
    info = model.load_adapter(adapter, scale=0.5)
    assert model.info().fingerprint != base_fp
    with_adapter = model.complete(PROMPT, GREEDY)
    assert with_adapter.stats.cache_hit == "cold"
    model.detach_adapter(info.handle)
    assert model.info().fingerprint == base_fp
    back = model.complete(PROMPT, GREEDY)
    assert back.stats.cache_hit == "exact"


@pytest.mark.parametrize("scale", ["x", None, 2**2000, float("nan"), True])
def test_a_bad_adapter_scale_loads_nothing_and_leaks_nothing(
    engine: Engine, tmp_path: Path, scale: object
) -> None:
    """Found by review: the scale was converted after the native load, so a scale that was no
    number raised ValueError/TypeError and left the adapter loaded, unlisted, and holding the
    model open: unloading it never freed it."""
    model = engine.load_model(config=stub_config())
    adapter = tmp_path / "lora.gguf"
    adapter.write_bytes(b"fake adapter weights")
    life = model._bmodel._life  # type: ignore[attr-defined]  # the stub model's
    before = life.dependents
    with pytest.raises(InvalidRequestError):
        model.load_adapter(adapter, scale=scale)  # type: ignore[arg-type]
    assert model.list_adapters() == []
    assert life.dependents == before
    info = model.load_adapter(adapter, scale=0.5)
    with pytest.raises(InvalidRequestError):
        model.set_adapter_scale(info.handle, scale)  # type: ignore[arg-type]
    assert model.list_adapters()[0].scale == 0.5
    model.unload()
    assert life.freed


def test_evict_saves_and_releases_live_kv(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    model.complete(PROMPT, GREEDY)
    engine.cache.flush()
    for row in engine.cache.rows():  # make the slot's live KV the only copy
        engine.cache.delete(row.key)
    assert model.evict() == 1
    assert engine.cache.counters()["saves_evict"] == 1
    (row,) = engine.cache.rows()
    assert row.reason.name == "EVICT"
    # The live KV is released: the next identical request restores from the evict row.
    again = model.complete(PROMPT, GREEDY)
    assert again.stats.cache_hit == "exact"
    assert engine.cache.counters()["hits_exact"] == 1
    assert model.evict() == 1 or engine.cache.rows()  # evicting again is harmless


def test_concurrent_callers_from_threads_all_complete(engine: Engine) -> None:
    model = engine.load_model(config=stub_config(n_parallel=2))
    results: list[str] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        out = model.complete(f"thread {i} asks", GenerationOptions(max_tokens=5, temperature=0.0))
        with lock:
            results.append(out.text)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8


def test_ignore_eos_generates_exactly_max_tokens(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    natural = model.complete(PROMPT, GenerationOptions(max_tokens=200, temperature=0.0))
    assert natural.stats.finish_reason == "stop"  # the stub ends after a '!'
    forced = model.complete(
        PROMPT, GenerationOptions(max_tokens=40, temperature=0.0, ignore_eos=True)
    )
    assert forced.stats.completion_tokens == 40
    assert forced.stats.finish_reason == "length"


def test_logit_bias_steers_and_bad_bias_is_rejected(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    (z,) = model.tokenize("z", add_special=False)
    out = model.complete(
        PROMPT, GenerationOptions(max_tokens=5, temperature=0.0, logit_bias={z: 100.0})
    )
    assert out.text == "zzzzz"
    with pytest.raises(InvalidRequestError):
        model.complete(PROMPT, GenerationOptions(logit_bias={10**7: 1.0}))
    with pytest.raises(InvalidRequestError):
        model.complete(PROMPT, GenerationOptions(logit_bias={z: 1000.0}))


def test_parent_key_waits_for_the_in_flight_finish_save() -> None:
    from tests.cache.facadekit import GatedTier
    from tests.engine.conftest import LOW_GATES

    from kvwarm.cache import Cache
    from kvwarm.cache.protocols import ReservationBook, StoredRow
    from kvwarm.cache.types import CacheConfig, SaveReason, SaveRequest

    class FinishGate(GatedTier):
        """Parks only finish saves, so cold and evict saves go straight through."""

        def store(
            self, key: bytes, request: SaveRequest, book: ReservationBook
        ) -> StoredRow | None:
            if request.reason is SaveReason.FINISH:
                return super().store(key, request, book)
            return self._inner.store(key, request, book)

    tier = FinishGate()
    cache = Cache(CacheConfig(), tiers=[tier])
    eng = Engine(EngineConfig(policy=LOW_GATES), cache=cache)
    try:
        model = eng.load_model(config=stub_config())
        tier.gate.clear()  # the next save parks inside the tier: in flight, not published
        first = model.complete(PROMPT, GREEDY)
        assert first.stats.key is not None
        assert tier.entered.wait(10)
        assert eng.cache.lookup_exact(first.stats.key) is None  # not yet published
        model.evict()  # its evict save is the in-flight key (skipped); live KV is released
        follow = list(first.tokens) + model.tokenize(" ok?", add_special=False)
        result: list[object] = []
        started = threading.Event()

        def second_turn() -> None:
            started.set()
            opts = GenerationOptions(max_tokens=4, temperature=0.0, parent_key=first.stats.key)
            result.append(model.complete(follow, opts))

        t = threading.Thread(target=second_turn)
        t.start()
        assert started.wait(10)
        tier.gate.set()
        t.join(30)
        (second,) = result
        assert isinstance(second, Completion)
        assert eng.cache.counters()["hits_resume"] == 1
        assert second.stats.cached_tokens >= len(first.tokens) - 1
    finally:
        tier.gate.set()
        eng.close()
        cache.close()


def test_submit_sends_no_fragments_but_the_same_completion(engine: Engine) -> None:
    model = engine.load_model(config=stub_config())
    streamed = model.stream(PROMPT, GREEDY)
    pieces = list(streamed)
    quiet = model.submit(PROMPT, GREEDY)
    assert list(quiet) == []  # no per-token events at all
    assert quiet.completion is not None
    assert quiet.completion.text == "".join(pieces) == streamed.result().text


def test_a_caller_who_got_its_answer_sees_its_slot_free(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer goes out before the finish save is packed (the pack runs while the reply
    travels); the slot was marked idle only after the pack, so /metrics read right after a
    reply could show it busy (seen once as a flaky test_metrics_parse_and_count). The pack
    is held here until the caller has looked."""
    from kvwarm.engine.worker.cacheport import CachePort

    packing, looked = threading.Event(), threading.Event()
    finished = CachePort.finished

    def held_finish(self: CachePort, *args: object, **kwargs: object) -> None:
        packing.set()
        assert looked.wait(30), "the test never looked"
        finished(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CachePort, "finished", held_finish)
    model = engine.load_model(config=stub_config(n_parallel=2))
    out = model.complete("a prompt long enough to be saved when it finishes " * 4, max_tokens=4)
    assert out.completion_tokens and packing.is_set()  # answered; its pack not yet run
    status = model.status()
    looked.set()
    assert (status.active, status.free_slots) == (0, 2), status


def test_a_prompt_value_runs_as_its_tokens_and_media_is_refused_clearly(engine: Engine) -> None:
    """A span-less ``Prompt`` is the text case; a prompt with an image span is refused with a
    typed error naming the prompt (no backend decodes media yet), before anything is queued."""
    import hashlib

    from kvwarm.tokens import Prompt

    model = engine.load_model(config=stub_config())
    tokens = model.tokenize(PROMPT)
    by_tokens = model.complete(tokens, GREEDY)
    by_prompt = model.complete(Prompt.text(tokens), GREEDY)
    assert by_prompt.text == by_tokens.text and by_prompt.prompt_tokens == tuple(tokens)
    picture = Prompt.build([tokens[:5], (hashlib.sha256(b"px").digest(), 16, "image"), tokens[5:]])
    with pytest.raises(InvalidRequestError, match="cannot read image input") as info:
        model.complete(picture, GREEDY)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        model.complete(Prompt.text([*tokens, 10**9]), GREEDY)  # not this vocabulary's id
    assert model.status().active == 0


def test_parent_key_finds_the_previous_turn_another_process_saved(tmp_path: Path) -> None:
    """A replica that never saw the conversation: the previous turn's row is only in the
    shared directory, where another process (here another engine) published it; the wait for
    ``parent_key`` looks there, so the whole previous turn is restored, not just what the
    prefix probes happen to ask for."""
    from tests.engine.conftest import LOW_GATES

    from kvwarm.cache.types import CacheConfig, TierConfig

    def engine() -> Engine:
        tier = TierConfig("disk", 256 << 20, tmp_path / "shared", shared=True)
        return Engine(EngineConfig(cache=CacheConfig(tiers=(tier,)), policy=LOW_GATES))

    with engine() as one, engine() as other:
        first_model = one.load_model(config=stub_config())
        first = first_model.complete(PROMPT, GREEDY)
        assert first.stats.key is not None
        one.cache.flush()  # published in the shared directory
        model = other.load_model(config=stub_config())
        follow = list(first.tokens) + model.tokenize(" ok?", add_special=False)
        opts = GenerationOptions(max_tokens=4, temperature=0.0, parent_key=first.stats.key)
        second = model.complete(follow, opts)
        assert second.stats.cached_tokens >= len(first.tokens) - 1
