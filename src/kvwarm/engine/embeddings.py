"""Embeddings: pooled vectors from a separate, lazily created embedding context.

Invariants: the embedding context is created and used only on the model's worker thread (as a
job between ticks), so it never races the generation context; inputs are validated on the
caller's thread before any job is queued (``docs/architecture.md``, "Engine").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvwarm.backends.base import BackendContext, BackendModel, ContextParams
from kvwarm.engine.worker import Worker


class Embedder:
    def __init__(self, bmodel: BackendModel, params: ContextParams, worker: Worker) -> None:
        self._bmodel = bmodel
        self._params = params
        self._worker = worker
        self._ctx: BackendContext | None = None

    def embed(self, token_lists: Sequence[Sequence[int]], *, normalize: bool) -> list[list[float]]:
        """One vector per token list (each at most ``params.n_ctx`` tokens, checked by the
        caller)."""
        limit = self._params.n_ctx

        def run() -> list[list[float]]:
            if self._ctx is None:
                self._ctx = self._bmodel.new_context(
                    replace(
                        self._params,
                        embeddings=True,
                        n_seq_max=1,
                        n_batch=max(self._params.n_batch, limit),
                        n_ubatch=max(self._params.n_ubatch, limit),
                    )
                )
            ctx = self._ctx
            return [ctx.embed(toks, normalize=normalize) for toks in token_lists]

        return self._worker.call(run).result()

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
