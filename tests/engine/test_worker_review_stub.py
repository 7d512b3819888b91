"""Cancellation and failure paths of the worker's scheduling, checked in review
(engine/worker), on the stub: its KV poisons wrongly reused cells, so a slot left dirty
shows in a later request's text."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import BackendError

PROMPT = "The system prompt says: be brief and kind. Question: what is a cache? " * 2
SAMPLED = GenerationOptions(max_tokens=8, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)


def _alone(n: int) -> list[str]:
    with make_engine() as eng:
        model = eng.load_model(config=stub_config(n_parallel=3))
        return [model.complete(PROMPT, SAMPLED, seed=7 + i).text for i in range(n)]


def test_cancelling_the_first_choice_between_prefill_chunks_frees_every_slot_clean() -> None:
    alone = _alone(3)
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=3, backend=backend))  # type: ignore[arg-type]
        assert len(model.tokenize(PROMPT)) > 2 * 16  # several chunks of n_batch 16
        first, *forks = model.streams(PROMPT, SAMPLED, n=3)
        backend.gate.step(1)  # one chunk in
        first.cancel()
        backend.gate.set()
        assert first.result().stats.finish_reason == "cancelled"
        assert [f.result().stats.finish_reason for f in forks] == ["cancelled", "cancelled"]
        assert model.status().active == 0
        again = [s.result().text for s in model.streams(PROMPT, SAMPLED, n=3)]
        assert again == alone


def test_a_fork_cancelled_while_it_waits_leaves_the_others_as_alone() -> None:
    alone = _alone(3)
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=3, backend=backend))  # type: ignore[arg-type]
        first, second, third = model.streams(PROMPT, SAMPLED, n=3)
        backend.gate.step(1)
        second.cancel()
        backend.gate.set()
        assert second.result().stats.finish_reason == "cancelled"
        assert [first.result().text, third.result().text] == [alone[0], alone[2]]
        assert model.status().active == 0
        again = [s.result().text for s in model.streams(PROMPT, SAMPLED, n=3)]
        assert again == alone


def test_cancelling_the_first_choice_after_the_fork_leaves_the_forks_running() -> None:
    alone = _alone(3)
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=3, backend=backend))  # type: ignore[arg-type]
        n_chunks = -(-len(model.tokenize(PROMPT)) // 16)
        first, *forks = model.streams(PROMPT, SAMPLED, n=3)
        backend.gate.step(n_chunks + 1)  # prefilled, forked, one decode
        first.cancel()
        backend.gate.set()
        assert first.result().stats.finish_reason == "cancelled"
        assert [f.result().text for f in forks] == alone[1:]
        again = [s.result().text for s in model.streams(PROMPT, SAMPLED, n=3)]
        assert again == alone


def test_an_unexpected_error_in_one_slots_draft_touches_no_other_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slot's own step (its draft, its sampling, its stop check, its saves) raising
    something other than a ``KvwarmError`` escaped the tick, and the loop then failed every
    active request; only the slot whose step raised may be touched (``loop.py``: "any failure
    is confined to the requests it touches"). An n-gram drafter's fault now ends that
    request's drafting only: it decodes plainly (a fault in sampling still fails it, below)."""
    from kvwarm.engine.worker.drafts import Drafter

    def broken(self: Drafter, *args: object, **kwargs: object) -> list[int]:
        raise RuntimeError("a drafter bug")

    monkeypatch.setattr(Drafter, "propose", broken)
    greedy = GenerationOptions(max_tokens=8, temperature=0.0)
    with make_engine() as eng:
        model = eng.load_model(config=stub_config(n_parallel=2))
        alone = model.complete("another prompt entirely", greedy).text
        copied = model.complete(PROMPT, greedy, spec_type="none").text
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        plain = model.stream("another prompt entirely", greedy, spec_type="none")
        drafting = model.stream(PROMPT, greedy, spec_type="ngram-simple")
        backend.gate.set()
        assert drafting.result().text == copied
        assert plain.result().text == alone
        assert model.status().active == 0
        assert model.complete(PROMPT, greedy, spec_type="none").text  # the worker goes on


def _raising_on_call(monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """``token_logprob`` (only requests asking for logprobs call it) raises on its nth call."""
    from kvwarm.engine.worker import sampling

    real, calls = sampling.token_logprob, [0]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError("a sampling bug")
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "token_logprob", flaky)


@pytest.mark.timeout(60)
def test_an_unexpected_error_in_one_decode_fails_that_request_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    greedy = GenerationOptions(max_tokens=8, temperature=0.0)
    with make_engine() as eng:
        alone = eng.load_model(config=stub_config()).complete("another prompt", greedy).text
    _raising_on_call(monkeypatch, 3)  # the third generated token's logprob
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        scored = model.stream(PROMPT, greedy, logprobs=1)
        plain = model.stream("another prompt", greedy)
        backend.gate.set()
        with pytest.raises(BackendError, match="a sampling bug"):
            scored.result()
        assert plain.result().text == alone
        assert model.status().active == 0


@pytest.mark.timeout(60)
def test_an_unexpected_error_in_one_choices_first_token_leaves_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forks sample their first tokens in turn; one raising left the later ones in
    ``generate`` with no token to decode: their slots busy for ever."""
    opts = replace(SAMPLED, logprobs=1)
    with make_engine() as eng:
        model = eng.load_model(config=stub_config(n_parallel=3))
        alone = [model.complete(PROMPT, opts, seed=7 + i).text for i in range(3)]
    _raising_on_call(monkeypatch, 2)  # the second fork's first token (forks sample first)
    with make_engine() as eng:
        model = eng.load_model(config=stub_config(n_parallel=3))
        first, second, third = model.streams(PROMPT, opts, n=3)
        with pytest.raises(BackendError, match="a sampling bug"):
            third.result()
        assert [first.result().text, second.result().text] == alone[:2]
        assert model.status().active == 0


def test_a_queue_head_that_cannot_be_seated_does_not_spin_the_loop_during_an_encode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The only active slot waits for its image's encode; an n = 2 group queued behind it
    cannot be seated (one slot free). The loop went round without pause for the whole
    encode (seconds on a CPU, a core taken from the encode itself) because a queue and a
    free slot counted as work."""
    import threading

    from tests.engine.mediakit import image_chat, png
    from tests.engine.test_media_stub import media_config

    from kvwarm.backends.stub import StubBackend
    from kvwarm.engine.worker.tick import Tick

    rounds, spun = [0], threading.Event()
    run = Tick.run

    def counted(self: Tick) -> Any:
        rounds[0] += 1
        if rounds[0] > 500:
            spun.set()
        return run(self)

    monkeypatch.setattr(Tick, "run", counted)
    backend = StubBackend()
    backend.encode_gate = threading.Event()
    with make_engine() as eng:
        model = eng.load_model(config=media_config(2, backend=backend))
        held = model.stream_chat(image_chat(png(5), "What is it?"), options=SAMPLED)
        group = model.streams(PROMPT, SAMPLED, n=2)
        spinning = spun.wait(1.0)  # a spinning loop passes 500 rounds in milliseconds
        backend.encode_gate.set()
        assert held.result().completion_tokens
        assert all(s.result().completion_tokens for s in group)
        assert not spinning, f"{rounds[0]} rounds while one encode ran"


def test_drafts_leave_room_for_a_waiting_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts are made before the plan; a speculating request's drafts took the whole pass's
    room and a prompt admitted beside it (decode_first) prefilled nothing until that request
    had generated its last token."""
    from tests.engine.test_speculative_stub import PROMPT as COPY_ME
    from tests.engine.test_speculative_stub import copier

    from kvwarm.engine.worker.drafts import Cost, PassCost
    from kvwarm.engine.worker.forks import Forks
    from kvwarm.engine.worker.outcomes import Outcomes

    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05)))
    events: list[tuple[str, int]] = []
    prefilled, finish = Forks.prefilled, Outcomes.finish

    def on_prefilled(self: Forks, slot: Any, *args: Any) -> None:
        events.append(("prefilled", len(slot.active.req.prompt_tokens)))
        prefilled(self, slot, *args)

    def on_finish(self: Outcomes, slot: Any, *args: Any, **kwargs: Any) -> None:
        events.append(("finished", len(slot.active.req.prompt_tokens)))
        finish(self, slot, *args, **kwargs)

    monkeypatch.setattr(Forks, "prefilled", on_prefilled)
    monkeypatch.setattr(Outcomes, "finish", on_finish)
    with make_engine() as eng:
        backend = GatedBackend()
        backend._stub = copier()  # copies, so its drafts are accepted
        config = replace(stub_config(2, backend=backend, n_batch=16), spec_type="ngram-simple")  # type: ignore[arg-type]
        model = eng.load_model(config=config)
        copying = model.stream(COPY_ME, GenerationOptions(max_tokens=120, temperature=0.0))
        n_chunks = -(-len(copying.prompt_tokens) // 16)
        backend.gate.step(n_chunks + 1)  # prefilled, and generating (and drafting)
        late = model.stream("word " * 8, GenerationOptions(max_tokens=2, temperature=0.0))
        backend.gate.set()
        done = copying.result()
        late.result()
    assert done.stats.drafted_tokens > 0
    n_late = len(late.prompt_tokens)
    n_copy = len(done.prompt_tokens)
    assert events.index(("prefilled", n_late)) < events.index(("finished", n_copy)), events


def test_a_cancelled_requests_failing_finish_save_fails_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request cancelled mid-generation is finished (and finish-saved) at the top of the
    tick, outside the per-slot containment: its save raising failed every active request."""
    from kvwarm.engine.worker.cacheport import CachePort
    from kvwarm.errors import CacheIOError

    finished = CachePort.finished

    def refusing(self: CachePort, slot: Any, *args: Any) -> None:
        act = slot.active
        if act is not None and act.req.cancelled.is_set():
            raise CacheIOError("the tier refused the save")
        finished(self, slot, *args)

    monkeypatch.setattr(CachePort, "finished", refusing)
    greedy = GenerationOptions(max_tokens=40, temperature=0.0)
    with make_engine() as eng:
        alone = eng.load_model(config=stub_config()).complete("another prompt", greedy).text
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        doomed = model.stream(PROMPT, replace(greedy, max_tokens=50))
        plain = model.stream("another prompt", greedy)
        backend.gate.step(12)  # both prefilled, generating
        assert not plain.done
        doomed.cancel()
        backend.gate.set()
        assert doomed.result().stats.finish_reason == "cancelled"  # answered before the save
        assert plain.result().text == alone
        assert model.status().active == 0


def test_a_fork_cancelled_while_its_group_is_queued_is_answered_at_once_and_needs_no_slot() -> None:
    """``Worker.cancel`` answers a queued request at once, but a fork of a queued ``n > 1``
    group is not in the queue itself: it stayed unanswered until the whole group was seated,
    and the group still waited for a free slot for it (found by review)."""
    alone = _alone(1)
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        busy = model.stream("another prompt", GenerationOptions(max_tokens=30, temperature=0.0))
        backend.gate.step(1)  # seated and prefilling: one slot is left
        first, second = model.streams(PROMPT, SAMPLED, n=2)
        assert model.status().queued == 1
        second.cancel()
        assert second.request.answered  # at once, while its group is still queued
        assert second.result().stats.finish_reason == "cancelled"
        # The first choice alone fits the free slot: it runs beside the busy request.
        backend.gate.step(3)
        assert model.status().active == 2
        backend.gate.set()
        assert first.result().text == alone[0]
        busy.result()
        assert model.status().active == 0


def test_abandoned_queued_streams_count_against_no_max_queue_and_leave_at_once() -> None:
    """A stream collected unread cancels its request by setting its event alone (its
    finalizer takes no lock): the request stayed queued until it reached a free slot, so a
    queue of abandoned requests refused new ones with max_queue while nothing waited, and
    they were answered only once the busy slot was free (found by review)."""
    with make_engine() as eng:
        backend = GatedBackend()
        config = replace(stub_config(n_parallel=1, backend=backend), max_queue=2)
        model = eng.load_model(config=config)  # type: ignore[arg-type]
        busy = model.stream("another prompt", GenerationOptions(max_tokens=30, temperature=0.0))
        backend.gate.step(1)  # seated: the one slot is busy
        dropped = [model.stream(f"prompt {i}", SAMPLED) for i in range(2)]
        requests = [s.request for s in dropped]
        del dropped  # collected: their requests are cancelled
        assert all(r.cancelled.is_set() for r in requests)
        late = model.stream(PROMPT, SAMPLED)  # QueueFullError before the fix
        backend.gate.step(1)
        assert all(r.answered for r in requests)  # without waiting for the busy slot
        assert model.status().queued == 1
        backend.gate.set()
        assert late.result().text == _alone(1)[0]
        busy.result()


def test_an_abandoned_group_at_the_queue_s_head_holds_no_request_behind_it() -> None:
    """An ``n = 2`` group whose streams were collected while it waited at the queue's head for
    two free slots kept waiting for them, and the single request behind it with it, though
    the group would be dropped unseated (found by review)."""
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        busy = model.stream("another prompt", GenerationOptions(max_tokens=30, temperature=0.0))
        backend.gate.step(1)  # seated: one slot is left
        group = model.streams(PROMPT, SAMPLED, n=2)
        behind = model.stream("a single request", SAMPLED)
        head = group[0].request
        del group
        backend.gate.step(1)
        assert head.answered
        assert model.status().active == 2  # the single request runs beside the busy one
        backend.gate.set()
        assert behind.result().stats.finish_reason == "length"
        busy.result()
