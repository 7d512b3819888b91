"""One worker thread per model: owns the ``llama_context`` and every slot's sequence.

The thread's rooms: ``admission`` (a queued request gets a slot and its prompt KV, planned by
the pure ``planner``), ``tick`` (one round of forward passes), ``sampling`` (logits to the next
token), ``cacheport`` (the one port to the cache: what a request reuses, what is saved
when) and ``outcomes`` (how a request leaves its slot).
This module is the loop around them: the queue, jobs, and shutdown.

Invariants:
- Only this thread touches the context (decode, pack, unpack, seq ops). Other threads talk to
  it through ``submit`` (requests, FIFO) and ``call`` (jobs run between ticks).
- A save's bytes are packed here, between decode calls, and handed to the cache's writer pool;
  async saves never block a tick.
- A request's namespace (effective fingerprint) and adapter set are fixed when it is admitted
  to a slot; changes of the model's set are jobs that wait until no slot is active, so they
  never affect a running request. Slots of different adapter sets never share a forward pass.
- Any failure is confined to the requests it touches; the loop itself never dies while the
  model is loaded (an unexpected error fails the in-flight requests and clears their KV).
- Other threads see the slots through ``slot_statuses()``: frozen copies this thread
  publishes (``Runtime.publish``) after each round and before any answer. Only the ``active``
  count reads live slots (one attribute each, never the context).

See ``docs/architecture.md``, "Engine".
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from kvwarm.backends.base import BackendContext, BackendModel, Projector
from kvwarm.cache.api import CacheApi
from kvwarm.cache.types import Namespace, SaveReason
from kvwarm.engine.request import Failed, Request
from kvwarm.engine.types import SlotStatus
from kvwarm.engine.worker.admission import Admission
from kvwarm.engine.worker.cacheport import CachePort
from kvwarm.engine.worker.draftmodel import DraftModel
from kvwarm.engine.worker.drafts import PassCost
from kvwarm.engine.worker.encoder import Encoder
from kvwarm.engine.worker.forks import Forks
from kvwarm.engine.worker.outcomes import Outcomes, unexpected
from kvwarm.engine.worker.runtime import Resolver, Runtime, WorkerConfig, WorkerStats
from kvwarm.engine.worker.sampling import Sampling
from kvwarm.engine.worker.slots import Slot
from kvwarm.engine.worker.tick import Tick
from kvwarm.errors import EngineClosedError, QueueFullError

__all__ = ["Worker", "WorkerConfig", "WorkerStats"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True, eq=False)
class _Job:
    fn: Callable[[], object]
    future: Future[object]
    needs_idle: bool


#: How long the loop's thread waits with nothing to do before it leaves, when other models'
#: workers share the process (``_start_thread``).
IDLE_EXIT_S = 0.25
#: The workers of this process that have not ended: with one, its thread stays (a new thread's
#: first pass costs ~10 ms more than a warm one's: SmolLM2, a cached 2-token request, 26 ms
#: against 16); with more, an idle one's leaves.
_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()
_WORKERS_LOCK = threading.Lock()


def _others_alive(worker: Worker) -> bool:
    with _WORKERS_LOCK:
        return any(w is not worker for w in _WORKERS)


class Worker:
    def __init__(
        self,
        name: str,
        model: BackendModel,
        ctx: BackendContext,
        cache: CacheApi,
        config: WorkerConfig,
        namespace: Callable[[], Namespace],
        resolve: Resolver | None = None,
        *,
        projector: Projector | None = None,
        draft: DraftModel | None = None,
    ) -> None:
        self.name = name
        self.cfg = config
        # When the iteration now running began (None while waiting for work): one that runs
        # long (a grammar or decode stuck in native code) is reported by stalled_for().
        self._iteration_since: float | None = None
        slots = [Slot(seq=i) for i in range(config.n_parallel)]
        self.rt = Runtime(name, model, ctx, cache, config, namespace, slots, resolve)
        self.rt.draft = draft
        facts = model.facts
        self.rt.pass_cost = PassCost(tile=facts.pass_tile, share=facts.pass_tile_share)
        self._cond = threading.Condition()
        if projector is not None:
            self.rt.encoder = Encoder(name, projector, self._wake)
        # A pass over the vocabulary (~0.3 s for Gemma's 262,144): paid while the model
        # loads, not by its first request (which, after a restart, is a cache hit).
        self.rt.learn_vocabulary()
        self.rt.reserve_verify_rows()
        self.slots = slots
        self.stats = self.rt.stats
        self.port = CachePort(self.rt)
        self.outcomes = Outcomes(self.rt, self.port)
        forks = Forks(self.rt, Sampling(self.rt, self.outcomes), self.outcomes)
        self.admission = Admission(self.rt, forks, self.outcomes, self.port)
        self.tick = Tick(self.rt, forks, self.outcomes, self.port)
        self._queue: deque[Request] = deque()
        # Requests taken off the queue and not yet shown in a slot (under _cond): still
        # waiting for their slot, so ``queued`` counts them (``_admit``).
        self._admitting = 0
        # The request ``_admit`` took off the queue and has not seated or answered yet
        # (worker thread only): in neither the queue nor a slot, so a death answers it here.
        self._seating: Request | None = None
        self._jobs: deque[_Job] = deque()
        self._closing = False
        self._shutdown_save: Callable[[], object] | None = None
        self._closed = threading.Event()
        # What killed the thread, if it died (not stopped): the model can serve nothing more.
        self.failure: BaseException | None = None
        self._exited = False  # the thread has left _run (under _cond)
        self._on_exit: list[Callable[[], object]] = []
        self.rt.publish()
        with _WORKERS_LOCK:
            _WORKERS.add(self)
        self._running = False  # a thread is in _run (under _cond)
        self._threads = 0  # threads started, for names and tests
        self._thread: threading.Thread | None = None  # the latest one
        with self._cond:
            self._start_thread()

    def _start_thread(self) -> None:
        """Start the loop's thread unless one runs or the worker has ended (under _cond).

        The thread leaves ``_run`` after ``IDLE_EXIT_S`` with nothing to do while other
        models' workers share the process, and the next request, job or stop starts
        another. llama.cpp's passes run on OpenMP, and libgomp keeps a pool of threads for
        every thread that ran a pass until that thread exits; once the threads it manages
        outnumber the CPUs it cuts every barrier's spinning short, so an idle model's
        long-lived worker slowed every other model's passes (``docs/internals.md``, "OpenMP
        thread pools")."""
        if self._running or self._exited:
            return
        self._running = True
        self._threads += 1
        name = (
            f"kvwarm-{self.name}" if self._threads == 1 else f"kvwarm-{self.name}-{self._threads}"
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- called from other threads -------------------------------------------------------

    def submit(self, req: Request, *more: Request) -> None:
        """Queue ``req`` (and ``more`` right behind it, all or none: a rerank's documents)."""
        with self._cond:
            if self._closing:
                raise EngineClosedError(f"model {self.name!r} is shut down")
            # Not one whose stream was abandoned (``stream._abandoned``): it is cancelled
            # but still queued until the worker drops it (``_drop_abandoned``).
            waiting = sum(1 for r in self._queue if r.counted and not r.cancelled.is_set())
            if waiting >= self.cfg.max_queue:
                raise QueueFullError(
                    f"model {self.name!r} has {waiting} queued requests (max_queue)"
                )
            self._queue.append(req)
            self._queue.extend(more)
            self._start_thread()
            self._cond.notify_all()

    def call(self, fn: Callable[[], T], *, needs_idle: bool = False) -> Future[T]:
        """Run ``fn`` on the worker thread between ticks (after active slots drain if
        ``needs_idle``)."""
        fut: Future[T] = Future()
        with self._cond:
            if self._closing:
                raise EngineClosedError(f"model {self.name!r} is shut down")
            self._jobs.append(_Job(fn, fut, needs_idle))  # type: ignore[arg-type]
            self._start_thread()
            self._cond.notify_all()
        return fut

    def cancel(self, req: Request) -> None:
        """Cancel ``req``: answered here at once if still queued, or a fork of a queued group
        (even while the worker is inside a forward pass), else observed by the worker between
        tokens."""
        req.cancelled.set()
        with self._cond:
            try:
                self._queue.remove(req)
            except ValueError:
                queued = self._drop_queued_fork(req)
            else:
                queued = True
            self._cond.notify_all()
        if queued:
            self.outcomes.cancelled_unstarted(req)

    def _drop_queued_fork(self, req: Request) -> bool:
        """Take ``req`` out of the queued ``n > 1`` group it is a fork of, if any (under
        _cond): the group is seated without it and waits for no slot of its (found by review:
        a cancelled fork stayed unanswered until its group was seated, and the group still
        waited for a free slot for it)."""
        for queued in self._queue:
            if any(f is req for f in queued.forks):
                queued.forks = tuple(f for f in queued.forks if f is not req)
                return True
        return False

    @property
    def queued(self) -> int:
        """Requests waiting for a slot: queued, or being admitted (their prompt KV looked up
        and restored) and not yet shown in one. With ``active`` read after it, a request is
        counted by one or the other from ``submit`` to its answer (found by review: while a
        request was admitted, a restore from disk among it, it was in neither, so the
        registry took its model for idle and unloaded it under a background response)."""
        with self._cond:
            return len(self._queue) + self._admitting

    @property
    def active(self) -> int:
        """Slots serving a request, from the published view (any thread; may lag a tick): a
        caller who got its answer sees its slot free (``Runtime.publish``)."""
        return sum(1 for s in self.rt.view if s.phase != "idle")

    @property
    def kv_cells_used(self) -> int:
        """Context cells the slots' sequences hold (from the published view: may lag a tick)."""
        return sum(s.n_tokens for s in self.rt.view)

    def slot_statuses(self) -> tuple[SlotStatus, ...]:
        """The slots as of the end of the worker's last round (any thread; no lock)."""
        return self.rt.view

    def stop(self, shutdown_save: Callable[[], object] | None, timeout_s: float) -> bool:
        """Cancel everything, run ``shutdown_save`` on the worker, and end the thread; whether
        it ended within ``timeout_s`` (if not, it is still using the context: see
        ``after_exit``)."""
        with self._cond:
            if self._closing:
                pending_stop = True
            else:
                pending_stop = False
                self._closing = True
                self._shutdown_save = shutdown_save
                self._start_thread()  # an idle worker's thread has left: one to close it
                self._cond.notify_all()
        if not pending_stop:
            for req in list(self._queue):
                req.cancelled.set()
        return self._closed.wait(timeout_s)

    def after_exit(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once the thread has ended: now if it has, else on the thread as it ends.
        For freeing what the thread may still be using (a context whose logits it reads)."""
        with self._cond:
            if not self._exited:
                self._on_exit.append(fn)
                return
        fn()

    # ---- worker-thread helpers for jobs ---------------------------------------------------

    def save_idle_slots(self, reason: SaveReason, *, release: bool) -> int:
        """Sync-save every idle slot's live KV (evict / shutdown). Worker thread only."""
        return self.port.evicting(reason, release=release)

    def invalidate_live_kv(self) -> None:
        """Forget every idle slot's live KV (after the adapter set changed)."""
        for slot in self.slots:
            if slot.active is None:
                self.rt.reset_seq(slot)

    # ---- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        idle = False  # left for want of work: the worker goes on, a later thread resumes it
        try:
            while True:
                with self._cond:
                    while not self._has_work() and not self._closing:
                        woken = self._cond.wait(IDLE_EXIT_S)
                        if woken or self._has_work() or self._closing:
                            continue
                        if _others_alive(self):
                            self._running, idle = False, True
                            return
                    closing = self._closing
                if closing:
                    self._drain_on_close()
                    return
                self._iteration_since = time.monotonic()
                waiting = False
                try:
                    self._run_jobs()
                    self._admit()
                    waiting = self.tick.run() == "waiting"
                except Exception as exc:  # never let the loop die: fail what is in flight
                    log.exception("worker %s: unexpected error; failing active requests", self.name)
                    self.outcomes.fail_all_active(exc)
                finally:
                    self._iteration_since = None
                self.rt.publish()
                if waiting:  # not a stall: an encode runs on its own thread
                    self._wait_for_encodes()
        except BaseException as exc:
            log.exception("worker %s: thread is dying; refusing further requests", self.name)
            with self._cond:
                self._closing = True
                self.failure = exc
            self._fail_on_death(exc)
            raise
        finally:
            if not idle:
                self._end()

    def _end(self) -> None:
        """The worker's end, on its last thread (stopped, or dead)."""
        with _WORKERS_LOCK:
            _WORKERS.discard(self)
        self.rt.join_buf.release()  # the restore buffer (tens of MiB) goes with the worker
        if self.rt.encoder is not None:
            self.rt.encoder.close()
        self.rt.publish()
        with self._cond:
            self._exited = True
            on_exit, self._on_exit = self._on_exit, []
        self._closed.set()
        for fn in on_exit:
            try:
                fn()
            except Exception:
                log.exception("worker %s: cleanup after exit failed", self.name)

    def _wake(self) -> None:
        """An encode finished (any thread): the loop may be waiting for it."""
        with self._cond:
            self._cond.notify_all()

    def _wait_for_encodes(self) -> None:
        """Nothing could run this round but spans whose embeddings are still being encoded:
        sleep until an encode finishes or anything else happens (a request, a job, a cancel,
        a close: each notifies), instead of spinning the loop."""
        with self._cond:
            if self._closing or self._cancelled_or_encoded():
                return
            # Only what could run now ends the wait: a job behind one that needs idle slots,
            # or a queue whose head cannot be seated (its n > 1 wants more free slots, its
            # ``after`` is unanswered, a job needs idle), spun the loop for the whole encode
            # (found by review).
            if self._jobs and not self._jobs[0].needs_idle:
                return
            if self._admissible():
                return
            self._cond.wait()

    def _admissible(self) -> bool:
        """Whether ``_admit`` could seat the queue's head now (under _cond)."""
        if self._blocked_by_idle_job():
            return False
        return self._head_fits(sum(1 for s in self.slots if s.active is None))

    def _head_fits(self, free: int) -> bool:
        """Whether the queue's head may be seated in ``free`` slots now (under _cond). n > 1
        waits at the head of the queue (FIFO) until all its slots are free; Model refuses an
        n above n_parallel, so it never waits for ever. A request ``after`` another waits
        there until that one is answered: it is ahead in the queue or in a slot, so it is
        answered in time."""
        if not self._queue or len(self._queue[0].group) > free:
            return False
        after = self._queue[0].after
        return after is None or after.answered

    def _cancelled_or_encoded(self) -> bool:
        for slot in self.slots:
            act = slot.active
            if act is None:
                continue
            if act.req.cancelled.is_set() or any(f.done() for f in act.encodes.values()):
                return True
        return False

    def stalled_for(self) -> float:
        """Seconds the current loop iteration has run (0.0 while idle): a healthy worker ticks
        many times a second, so a large value means it is stuck."""
        since = self._iteration_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def _has_work(self) -> bool:
        if any(s.active is not None for s in self.slots):
            return True
        if self._jobs:
            return True
        return bool(self._queue) and not self._blocked_by_idle_job()

    def _blocked_by_idle_job(self) -> bool:
        return any(j.needs_idle for j in self._jobs)

    def _run_jobs(self) -> None:
        idle = all(s.active is None for s in self.slots)
        while True:
            with self._cond:
                if not self._jobs or (self._jobs[0].needs_idle and not idle):
                    return
                job = self._jobs.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(job.fn())
            except BaseException as exc:
                job.future.set_exception(exc)

    def _admit(self) -> bool:
        """Seat queued requests, FIFO, while a slot is free (not while a job needs idle);
        whether any was seated. Each is counted as ``queued`` until its slot is published
        (what was seated shows busy during a long pass)."""
        seated = False
        self._drop_abandoned()
        if self._blocked_by_idle_job():
            return seated
        while True:
            free = [s for s in self.slots if s.active is None]
            if not free:
                return seated
            with self._cond:
                if not self._head_fits(len(free)):
                    return seated
                req = self._queue.popleft()
                after = req.after
                self._admitting += 1
            self._seating = req
            try:
                if req.cancelled.is_set() or (after is not None and not after.finished):
                    self.outcomes.ended_like(req, after)
                    self._seating = None
                    continue
                self.admission.admit(req, free)
                self._seating = None
                seated = True
                self.rt.publish()
            finally:
                with self._cond:
                    self._admitting -= 1

    def _drop_abandoned(self) -> None:
        """Answer and take out of the queue every request (or fork of a queued group) that
        was cancelled without ``cancel``: its stream was collected unread, whose finalizer
        only sets its event (it may run on this thread, inside ``_cond``). Found by review:
        such a request stayed queued until it reached a free slot, counted against
        ``max_queue`` (a 429 with nothing waiting), and a group among them still waited at
        the queue's head for as many free slots as it had choices. Not once closing:
        ``stop`` sets every queued request's event, and they are answered "unloaded"."""
        with self._cond:
            if self._closing:
                return
            gone = [r for r in self._queue if r.cancelled.is_set()]
            for req in gone:
                self._queue.remove(req)
            for req in self._queue:
                if any(f.cancelled.is_set() for f in req.forks):
                    gone += [f for f in req.forks if f.cancelled.is_set()]
                    req.forks = tuple(f for f in req.forks if not f.cancelled.is_set())
        for req in gone:
            self.outcomes.cancelled_unstarted(req)

    def _fail_on_death(self, exc: BaseException) -> None:
        """The thread is dying of ``exc``: every request in a slot, queued or waiting on a job
        gets an error. Not a finish save: a tick cut short may have left a slot's KV other
        than its tokens say (found by review: the running requests were answered "cancelled"
        and saved, one whose cleanup raised was never answered)."""
        err = EngineClosedError(f"model {self.name!r} stopped: its worker died ({exc!r})")
        err.__cause__ = exc
        for slot in self.slots:
            act = slot.active
            if act is None:
                continue
            try:
                self.outcomes.fail(slot, err)
            except Exception:
                log.exception("worker %s: failing a slot as the worker died", self.name)
            for one in act.req.group:
                one.answer(Failed(err))  # a no-op for those answered just now
        # Found by review: a death inside a request's admission (its restore, its seating)
        # left it in no slot and off the queue, and its caller waited for ever.
        seating, self._seating = self._seating, None
        for one in () if seating is None else seating.group:
            one.answer(Failed(err))
        self._fail_waiting(err)
        self._shutdown_save_once()

    def _fail_waiting(self, err: EngineClosedError) -> None:
        """Answer every queued request and pending job with ``err`` (taken under the lock: a
        client's cancel removes from the queue meanwhile)."""
        with self._cond:
            queued, self._queue = list(self._queue), deque()
            jobs, self._jobs = list(self._jobs), deque()
        for req in queued:
            for one in req.group:
                one.answer(Failed(err))
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(err)

    def _shutdown_save_once(self) -> None:
        """The save ``stop`` asked for (idle slots' live KV), at most once, even on a death."""
        save, self._shutdown_save = self._shutdown_save, None
        if save is not None:
            try:
                save()
            except Exception:
                log.exception("worker %s: shutdown save failed", self.name)

    def _drain_on_close(self) -> None:
        for slot in self.slots:
            if slot.active is not None:
                try:
                    self.outcomes.finish(slot, "cancelled", None)
                except Exception as exc:  # its finish save: this slot's alone, as in a tick
                    # Found by review: it escaped, and a clean unload became the worker's
                    # death (``failure`` set, the other slots failed "worker died").
                    self.outcomes.fail(slot, unexpected(exc, self.name))
        self._fail_waiting(EngineClosedError(f"model {self.name!r} was unloaded"))
        self._shutdown_save_once()
