"""Media spans encoded off the worker thread: a prompt's images and audio go through the
projector's encoder on a thread of its own while the worker keeps decoding every slot.

Invariants: encodes run one at a time, in the order they were started (one thread; the
projector keeps its output in one buffer), each on a thread that ends with it (below); only
spans the slot did not restore are encoded
(admission starts them once it knows what it kept); when one finishes, the worker is woken
(``wake``), so a slot waiting for its span never spins the loop. An encode that fails fails
only its request, with a typed error.

Why a thread per encode: llama.cpp's CPU backend runs on OpenMP, and libgomp keeps a pool of
team threads for every thread that ever ran a parallel region, until that thread exits. A
long-lived encoder thread kept its pool, so the process held more OpenMP threads than CPUs
and libgomp throttled every barrier's spinning to ~100 iterations (its rule when managed
threads outnumber CPUs): after a model's first image every decode of the worker waited on
futexes at each of a graph's barriers, 6 -> 10 ms a SmolLM2 token on 2 cores, text requests
too. A thread that exits frees its pool, as llama-server's single loop never makes one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvwarm.backends.base import Projector
from kvwarm.engine.prompts import SpanMedia
from kvwarm.errors import BackendError, KvwarmError

log = logging.getLogger(__name__)


class Encoder:
    def __init__(self, name: str, projector: Projector, wake: Callable[[], None]) -> None:
        self.projector = projector
        self._name = name
        self._wake = wake
        self._pool: ThreadPoolExecutor | None = None

    def non_causal(self, kind: str) -> bool:
        """Whether a span of ``kind`` attends to itself both ways (decoded in one ubatch)."""
        return kind in self.projector.facts.non_causal

    def start(self, shown: SpanMedia) -> Future[bytes]:
        """The embeddings of ``shown``'s span, encoded on the encoder's thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvwarm-{self._name}-encode")
        future = self._pool.submit(self._encode, shown)
        future.add_done_callback(lambda _: self._wake())
        return future

    def _encode(self, shown: SpanMedia) -> bytes:
        """``shown``'s encode, on a thread that ends with it (the module's docstring)."""
        done: list[bytes] = []
        failed: list[BaseException] = []

        def run() -> None:
            try:
                done.append(self._encode_here(shown))
            except BaseException as exc:  # handed to the future below
                failed.append(exc)

        thread = threading.Thread(target=run, name=f"kvwarm-{self._name}-encoding", daemon=True)
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return done[0]

    def _encode_here(self, shown: SpanMedia) -> bytes:
        try:
            return self.projector.encode(shown.media, shown.index)
        except KvwarmError:
            raise
        except Exception as exc:  # a bug in a backend: still only this request's failure
            log.exception("encoding a %s failed", shown.media.kind)
            raise BackendError(f"encoding the {shown.media.kind} failed: {exc!r}") from exc

    def close(self) -> None:
        """Stop taking encodes; the one running (if any) finishes on its thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
