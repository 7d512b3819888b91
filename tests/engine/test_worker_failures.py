"""Worker failure paths found in review: each test once demonstrated a defect (stub backend)."""

from __future__ import annotations

import threading

import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.cache import Cache
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.request import Done, Failed
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import BackendError, EngineClosedError, GrammarError

PROMPT = "A prompt long enough to be cached by the low test gates, twice over."


def test_exact_hit_with_stored_logits_that_fails_to_sample_frees_its_slot() -> None:
    """Admission: a KvwarmError from on_logits on the stored-logits path reached the admit loop,
    which replies Failed but leaves slot.active set: the slot is never freed (and the loop
    spins, since _has_work sees an active slot that is neither prefilling nor decoding)."""
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config())
        model.prewarm(PROMPT)  # saves the prompt with its final logits
        assert eng.cache.flush(10)
        # Only EOS satisfies this grammar, and ignore_eos bans EOS: sampling raises GrammarError.
        stream = model.stream(
            PROMPT, max_tokens=4, temperature=0.0, grammar='root ::= ""', ignore_eos=True
        )
        with pytest.raises(GrammarError):
            stream.result()
        assert stream.completion is None
        # The request is over: its slot must be free again.
        assert model.status().active == 0
    finally:
        eng.close()


def test_budget_cut_prefill_chunks_are_not_recorded_as_canonical() -> None:
    """A non-deterministic prompt whose chunk is cut by the tick budget (n_batch=16; B's chunks
    are [0,12) [12,16) [16,31) [31,32) [32,40) because A's prompt, then A's decode token,
    share each call) is not aligned-chunk prefill,
    yet slot.canonical (canonical_after) claims the whole prompt, so the row is saved with
    canonical_tokens=None and deterministic restores trust it as bit-identical to cold."""
    backend = GatedBackend()
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        gen = GenerationOptions(max_tokens=60, temperature=0.0, ignore_eos=True)
        # A: short prompt, keeps decoding. B: 40 tokens, admitted while A decodes.
        a = model.stream("Hi.", gen)
        b_prompt = "x" * 39
        b = model.stream(b_prompt, GenerationOptions(max_tokens=1, temperature=0.0))
        backend.gate.set()
        b_done = b.result()
        a.cancel()
        a.result()
        assert eng.cache.flush(10)
        b_tokens = b_done.prompt_tokens
        assert len(b_tokens) == 40
        assert b_done.stats.key is not None
        (row,) = [r for r in eng.cache.rows() if r.key == b_done.stats.key]
        # Positions 0..15 were prefilled as [0, 12) + [12, 16): not canonical.
        assert row.canonical_tokens is not None and row.canonical_tokens <= 15
    finally:
        backend.gate.set()
        eng.close()


def test_parent_key_row_that_diverges_from_the_prompt_does_not_force_a_cold_prefill() -> None:
    """Planning scored the parent row as if all of its n_tokens were shared with the
    prompt (unless it is the very object longest_prefix returned). When the prompt diverges
    inside the parent row (a re-rendered chat turn), that inflated plan ties with / beats the
    real best row; _restore_row then sees shared < keep and drops to a full cold prefill
    instead of using the 68 (or 69) tokens that are really cached."""
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config())
        first = model.tokenize(PROMPT)
        stats = model.prewarm(first)  # the parent row: 69 tokens
        assert stats.key is not None
        # Same tokens except the last one, plus a new turn.
        second = [*first[:-1], first[-1] + 1, *model.tokenize(" next turn", add_special=False)]
        model.prewarm(second[: len(first)])  # another row sharing all 69 with the prompt
        assert eng.cache.flush(10)
        model.evict()  # no live KV: only the cache can serve the next request
        done = model.complete(
            second, GenerationOptions(max_tokens=2, temperature=0.0, parent_key=stats.key)
        )
        assert done.stats.cache_hit == "partial"
        assert done.stats.cached_tokens >= len(first) - 1
    finally:
        eng.close()


class _LookupFailsOnce(Cache):
    """A cache whose first prefix lookup raises a non-kvwarm exception (an internal bug)."""

    failed = False

    def longest_prefix(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not self.failed:
            self.failed = True
            raise RuntimeError("internal error during planning")
        return super().longest_prefix(*args, **kwargs)


def test_a_non_kvwarm_error_during_admission_still_ends_the_request() -> None:
    """The admit loop caught only KvwarmError around _start. Anything else escapes to _run,
    whose _fail_all_active only sees requests already in a slot: the popped request never
    gets Done/Failed and its caller waits forever."""
    cache = _LookupFailsOnce(CacheConfig(tiers=(TierConfig("ram", 64 << 20),)))
    eng = Engine(EngineConfig(), cache=cache)
    try:
        model = eng.load_model(config=stub_config())
        first = model.stream(PROMPT, max_tokens=2, temperature=0.0)
        # FIFO: once the second request is done, the worker is past the first one.
        model.complete(PROMPT + " again", max_tokens=2, temperature=0.0)
        event = first._req.channel.get(timeout=0)  # raises TimeoutError: nothing was sent
        assert isinstance(event, Done | Failed)
    finally:
        eng.close()
        cache.close()


def _final(req: object, timeout_s: float = 10.0) -> Done | Failed:
    """The request's final event (bounded: a request never answered fails the test)."""
    while True:
        event = req.channel.get(timeout=timeout_s)  # type: ignore[attr-defined]
        if isinstance(event, Done | Failed):
            return event


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_dies_mid_tick_answers_every_request_with_an_error() -> None:
    """A non-kvwarm error in a forward pass, then another from the cleanup (seq_rm of a broken
    context), killed the thread: fail() had marked the running slot free before its cleanup
    raised, so that request was never answered (its caller waited for ever); the queued one
    was told "unloaded", and nothing said the model could serve nothing more."""
    backend = GatedBackend()
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        running = model.stream("Hi.", max_tokens=50, temperature=0.0, ignore_eos=True)
        backend.gate.step(2)  # its prompt is prefilled: its slot holds KV
        queued = model.stream("Ho.", max_tokens=5, temperature=0.0)
        worker = model._worker
        ctx = worker.rt.ctx

        def broken(*_args: object) -> None:
            raise RuntimeError("the context is broken")

        ctx._inner.decode = broken  # type: ignore[attr-defined]
        ctx.seq_rm = broken  # type: ignore[method-assign]
        backend.gate.set()
        for req in (running._req, queued._req):
            event = _final(req)
            assert isinstance(event, Failed), event
        assert worker._closed.wait(10)
        assert model.worker_failure() is not None
        with pytest.raises(EngineClosedError):
            model.complete("Again.", max_tokens=2)
        assert worker._thread is not None
        worker._thread.join(10)
    finally:
        backend.gate.set()
        eng.close()


class _Died(BaseException):
    """What no handler of the worker's catches but its thread's last one."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_that_dies_inside_an_admission_answers_that_request_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request being admitted is off the queue and in no slot yet: a death there (its
    restore) answered every queued and running request but not it, nor its other choices,
    and their callers waited for ever."""
    from kvwarm.engine.worker.admission import Admission

    def dying(*_args: object) -> None:
        raise _Died()

    monkeypatch.setattr(Admission, "restore", dying)
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config(n_parallel=2))
        group = model.streams(PROMPT, GenerationOptions(max_tokens=4, temperature=1.0), n=2)
        worker = model._worker
        assert worker._closed.wait(10)
        for stream in group:
            event = _final(stream.request)
            assert isinstance(event, Failed), event
            assert isinstance(event.error, EngineClosedError)
        assert model.worker_failure() is not None
    finally:
        eng.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_close_whose_finish_fails_still_answers_the_queue_and_saves() -> None:
    """The close drain finished the running request first: an unexpected error there (its
    finish save) escaped, and the dying thread ran the same drain again, which raised again,
    so the queued request was never answered (its caller waited for ever) and the shutdown
    save of the slots' live KV never ran."""
    backend = GatedBackend()
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        worker = model._worker
        saves: list[object] = []
        save = worker.save_idle_slots

        def counted(*args: object, **kwargs: object) -> int:
            saves.append(args)
            return save(*args, **kwargs)  # type: ignore[arg-type]

        def broken_finish(*_args: object) -> None:
            raise RuntimeError("the finish save failed")

        worker.save_idle_slots = counted  # type: ignore[method-assign]
        unloading: list[threading.Thread] = []

        def hold_until_closing() -> None:  # on the worker: the unload starts meanwhile
            unloading.append(threading.Thread(target=model.unload))
            unloading[0].start()
            with worker._cond:
                assert worker._cond.wait_for(lambda: worker._closing, 10)
            worker.outcomes.finish = broken_finish  # type: ignore[method-assign]

        running = model.stream(PROMPT, max_tokens=400, temperature=0.0, ignore_eos=True)
        # Its prompt is prefilled and the worker waits inside its next forward pass: it holds
        # the one slot (what is submitted next stays queued), and it cannot finish its 400
        # tokens before the job below runs, which is between that pass and the next.
        backend.gate.step(2)
        held = worker.call(hold_until_closing)
        queued = model.stream(PROMPT, max_tokens=2, temperature=0.0)
        backend.gate.set()
        held.result(10)
        unloading[0].join(10)
        for req in (running._req, queued._req):
            assert isinstance(_final(req), Failed)
        assert saves, "the shutdown save never ran"
        assert worker._thread is not None
        worker._thread.join(10)
    finally:
        backend.gate.set()
        eng.close()


def test_a_failed_request_whose_sampler_will_not_close_still_empties_its_sequence() -> None:
    """A failing slot whose sampler raised on close was forgotten (its tokens) while its
    cells stayed in the context: the next request in that slot prefilled over them."""
    backend = GatedBackend()
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        running = model.stream("Hi.", max_tokens=50, temperature=0.0, ignore_eos=True)
        backend.gate.step(2)  # its prompt is prefilled: its slot holds KV
        worker = model._worker
        (slot,) = worker.slots
        assert slot.active is not None and slot.kv_tokens
        sampler = slot.active.sampler

        def refuse() -> None:
            raise BackendError("the sampler will not close")

        sampler.close = refuse  # type: ignore[method-assign]
        worker.rt.ctx._inner.decode = lambda _batch: (_ for _ in ()).throw(  # type: ignore[attr-defined]
            BackendError("decode failed")
        )
        backend.gate.set()
        assert isinstance(_final(running._req), Failed)
        assert worker.call(lambda: worker.rt.ctx.seq_pos_max(slot.seq)).result(10) == -1
    finally:
        backend.gate.set()
        eng.close()
