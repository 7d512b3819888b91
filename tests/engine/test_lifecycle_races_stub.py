"""A request's lifecycle under concurrency (review "races"), on the stub: what other threads
see of a request between its queue and its slot, and how requests end when their model is
unloaded under them. Every wait is on an event the worker reaches, never on time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm.backends.stub.context import StubContext
from kvwarm.engine.model import Model
from kvwarm.engine.request import Request
from kvwarm.engine.types import GenerationOptions
from kvwarm.engine.worker.admission import Admission, Planned, Restored
from kvwarm.engine.worker.slots import Slot
from kvwarm.errors import EngineClosedError

PROMPT = "The system prompt says: be brief and kind. Question: what is a cache? " * 2


class _HeldAdmission:
    """Holds the worker inside ``Admission.restore`` (where a row is read from a tier and
    unpacked: milliseconds to seconds) until ``release`` is set; ``entered`` is set as it
    waits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.kinds: list[str] = []  # the plans' kinds (``Plan.kind``)
        real = Admission.restore

        def held(admission: Admission, planned: Planned, req: Request) -> Restored:
            self.kinds.append(planned.plan.kind)
            self.entered.set()
            assert self.release.wait(60)
            return real(admission, planned, req)

        monkeypatch.setattr(Admission, "restore", held)


@pytest.fixture
def model() -> Iterator[Model]:
    with make_engine() as eng:
        yield eng.load_model(config=stub_config(n_parallel=2))


def test_a_request_being_admitted_counts_as_queued(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a request the worker had taken off the queue and was admitting (its
    prompt's row looked up, read and unpacked) was neither ``queued`` nor ``active``, so the
    server's registry took its model for idle (``ModelRegistry._idle``) and could unload it
    under a background response or a keep-alive prewarm, which hold no lease."""
    held = _HeldAdmission(monkeypatch)
    stream = model.submit(PROMPT, max_tokens=4, temperature=0.0)
    try:
        assert held.entered.wait(10)
        status = model.status()
        assert (status.queued, status.active) == (1, 0)
    finally:
        held.release.set()
    assert stream.result().stats.finish_reason in ("length", "stop")
    status = model.status()
    assert (status.queued, status.active) == (0, 0)


def _closing(model: Model) -> None:
    """Wait until ``model``'s worker has been told to stop (``Worker.stop`` notifies its
    condition as it sets the flag)."""
    worker = model._worker
    with worker._cond:
        assert worker._cond.wait_for(lambda: worker._closing, 10)


def test_a_prewarm_cut_short_by_an_unload_raises_instead_of_answering_stats() -> None:
    """Found by review: a prewarm whose model was unloaded in the middle of its prefill
    returned its stats (finish ``cancelled``, no key) as a success; keep-alive then counted
    the entry warm and ``POST /cache/prewarm`` answered 200, though its prompt was not saved."""
    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        tokens = model.tokenize(PROMPT)
        assert len(tokens) > 2 * 16  # several chunks of n_batch 16
        key = eng.cache.key_for(model.namespace(), tokens)
        with ThreadPoolExecutor(2) as pool:
            prewarm = pool.submit(model.prewarm, PROMPT)
            backend.gate.step(1)  # one chunk in; the worker waits before the next
            unload = pool.submit(model.unload)
            _closing(model)
            backend.gate.set()
            with pytest.raises(EngineClosedError, match="unloaded before its prewarm"):
                prewarm.result(60)
            unload.result(60)
        assert not eng.cache.has(key)  # indeed nothing of the whole prompt was saved


def test_a_change_of_the_model_s_adapters_never_reaches_an_embedding_half_done(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: each piece of an embedding resolved the model's LoRA set anew, and a
    change of that set (a job waiting only for idle slots, which an embedding holds none of)
    ran between two pieces: the vectors of one call came from two sets, silently. Every
    piece now embeds under the set its first resolved."""
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"adapter a")
    handle = model.load_adapter(adapter, scale=1.0).handle
    first, second = "one input of about twelve tokens here", "and another of twelve or so"
    assert sum(len(model.tokenize(t)) for t in (first, second)) > 16  # two pieces (n_batch)
    alone = [model.embed(first), model.embed(second)]
    entered, release = threading.Event(), threading.Event()
    real = StubContext._embed

    def held(ctx: StubContext, tokens: Sequence[int], *, normalize: bool) -> list[float]:
        if not entered.is_set():  # the first piece waits until the change is queued
            entered.set()
            assert release.wait(60)
        return real(ctx, tokens, normalize=normalize)

    monkeypatch.setattr(StubContext, "_embed", held)
    worker = model._worker
    with ThreadPoolExecutor(2) as pool:
        vectors = pool.submit(model.embed, [first, second])
        assert entered.wait(10)
        scaled = pool.submit(model.set_adapter_scale, handle, 0.5)
        with worker._cond:  # the change is queued behind the first piece
            assert worker._cond.wait_for(lambda: any(j.needs_idle for j in worker._jobs), 10)
        release.set()
        assert vectors.result(60) == [alone[0][0], alone[1][0]]
        assert scaled.result(60).scale == 0.5
    assert model.embed(second) != alone[1]  # the change did happen, for later calls


def test_a_finish_save_that_raises_at_unload_fails_no_other_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a slot's finish save raising anything but a ``KvwarmError`` as an
    unload drained the slots escaped the drain: a clean unload became the worker's death
    (``Worker.failure`` set) and the other running requests were failed "worker died"
    instead of ending cancelled with their text. A tick confines it to its slot; so does the
    drain now."""
    from kvwarm.engine.worker.cacheport import CachePort

    real = CachePort.finished
    broken: list[int] = []

    def finished(port: CachePort, slot: Slot, held: bool, logits: bytes | None) -> None:
        if not broken:
            broken.append(slot.seq)
            raise RuntimeError("a save bug")
        real(port, slot, held, logits)

    with make_engine() as eng:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        streams = [
            model.stream(p, max_tokens=64, temperature=0.0)
            for p in ("one prompt here, please", "another prompt, different")
        ]
        backend.gate.step(2)  # both prefilled and generating
        monkeypatch.setattr(CachePort, "finished", finished)
        with ThreadPoolExecutor(1) as pool:
            unload = pool.submit(model.unload)
            _closing(model)
            backend.gate.set()
            unload.result(60)
        assert broken
        assert [s.result().stats.finish_reason for s in streams] == ["cancelled", "cancelled"]
        assert model._worker.failure is None


def test_a_change_of_the_model_s_adapters_never_reaches_a_rerank_half_done(
    tmp_path: Path,
) -> None:
    """Found by review: each document of a rerank took the model's LoRA set when it was
    admitted, and a change of that set (a job that waits only for the slots then active)
    ran between two documents: one ranking scored under two sets, silently. A rerank now
    names the set it began under for all its documents."""
    from tests.engine.test_rerank_stub import QUERY, RecordingBackend
    from tests.engine.test_rerank_stub import config as rerank_config

    docs = [f"document number {i} about the sea" for i in range(4)]
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"adapter a")
    with make_engine() as eng:
        backend = RecordingBackend()
        model = eng.load_model(
            "stub-reranker.gguf",
            model_id="r",
            config=rerank_config(1, backend=backend),  # one document at a time
        )
        handle = model.load_adapter(adapter, scale=1.0).handle

        def scores() -> list[float]:
            ranked = model.rerank(QUERY, docs)
            return [s for _, s in sorted((r.index, r.relevance_score) for r in ranked.results)]

        before = scores()
        backend.gate = threading.Event()  # every pass waits until the change is queued
        backend.entered.clear()
        worker = model._worker
        with ThreadPoolExecutor(2) as pool:
            ranking = pool.submit(scores)
            assert backend.entered.wait(10)
            scaled = pool.submit(model.set_adapter_scale, handle, 0.5)
            with worker._cond:
                assert worker._cond.wait_for(lambda: any(j.needs_idle for j in worker._jobs), 10)
            backend.gate.set()
            assert ranking.result(60) == before
            assert scaled.result(60).scale == 0.5
        assert scores() != before  # the change did happen, for later calls


def test_a_request_cancelled_while_its_row_is_restored_leaves_its_slot_clean(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked in review (no bug): a cancel that comes while the worker restores the
    request's row (admission, off the queue and not yet in a slot) is answered cancelled
    once it is seated, saves nothing of a partial prompt, frees the slot, and the slot's KV
    then serves the same prompt exactly as a cold run (the stub poisons wrongly kept
    cells)."""
    greedy = GenerationOptions(max_tokens=6, temperature=0.0)
    longer = PROMPT + "And one more question after that?"
    cold = model.complete(longer, greedy).text
    model.evict()  # the slots' KV saved and let go: the next request restores a row
    held = _HeldAdmission(monkeypatch)
    stream = model.stream(longer, greedy)
    try:
        assert held.entered.wait(10)
        assert held.kinds == ["row"]
        stream.cancel()
    finally:
        held.release.set()
    done = stream.result()
    assert done.stats.finish_reason == "cancelled" and done.stats.key is None
    status = model.status()
    assert (status.queued, status.active) == (0, 0)
    monkeypatch.undo()
    assert model.complete(longer, greedy).text == cold


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.stream(PROMPT, max_tokens=2),
        lambda m: m.submit(PROMPT, max_tokens=2, json_schema={"type": "integer"}),
        lambda m: m.tokenize(PROMPT),
        lambda m: m.chat_tokens([{"role": "user", "content": "hi"}]),
    ],
    ids=["stream", "submit_schema", "tokenize", "chat_tokens"],
)
def test_a_call_that_an_unload_overtakes_is_engine_closed(
    call: Callable[[Model], object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the stress harness (seed 9 of 150, once): a request whose caller had passed
    the model's ready check when an unload freed the model got the backend's
    ``HandleClosedError`` ("model is closed", a 500 from the server) from its tokenizing or
    its grammar's check, not ``EngineClosedError`` (a 503: the model went away). Here the
    unload runs right after the check passes, on the caller's thread, as a reload's would
    between two of its lines."""
    with make_engine() as eng:
        model = eng.load_model(config=stub_config(n_parallel=1))
        real = Model._check_ready
        done = threading.Event()

        def overtaken(self: Model) -> None:
            real(self)
            if not done.is_set():
                done.set()
                self.unload()

        monkeypatch.setattr(Model, "_check_ready", overtaken)
        with pytest.raises(EngineClosedError):
            call(model)
        assert done.is_set()
