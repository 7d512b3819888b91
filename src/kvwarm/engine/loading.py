"""What a model load reports: one progress fraction over its phases, and whether the context
it is given fits what the model was trained on.

Invariant: the fraction handed to a load-progress callback never goes backwards and reaches 1.0
only when the weights are in memory. A ``safe`` fingerprint reads the whole file before
llama.cpp reads it again, so hashing gets its share of the bar (by bytes, the same work as
reading the weights); without it the bar would sit at 0% through the hash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvwarm.cache.types import FingerprintMode

log = logging.getLogger("kvwarm.engine")

Progress = Callable[[float], bool]

_HASH_SHARE = 0.5


class LoadProgress:
    """Splits one user callback into the hashing phase and the weights phase."""

    def __init__(self, progress: Progress | None, mode: FingerprintMode, has_file: bool) -> None:
        self._progress = progress
        self._hash_share = _HASH_SHARE if mode is FingerprintMode.SAFE and has_file else 0.0
        self._last = 0.0

    def _report(self, fraction: float) -> bool:
        assert self._progress is not None
        self._last = max(self._last, min(1.0, fraction))
        return self._progress(self._last)

    def hashing(self) -> Callable[[int, int], None] | None:
        """The fingerprint's ``(done, total)`` callback, or None if nothing listens."""
        if self._progress is None or self._hash_share == 0.0:
            return None
        share = self._hash_share

        def on_bytes(done: int, total: int) -> None:
            # Hashing cannot be cancelled half-way; a cancel is honoured by the weights phase.
            self._report(share * done / total if total else share)

        return on_bytes

    def weights(self) -> Progress | None:
        """The backend's load callback (fraction of the weights read), or None."""
        if self._progress is None:
            return None
        share = self._hash_share
        return lambda fraction: self._report(share + (1.0 - share) * fraction)


def warn_if_past_training(model_id: str, n_ctx_slot: int, n_ctx_train: int) -> None:
    """One accurate warning when a request may run past the model's training context.

    (llama.cpp's own warning compares the whole unified KV buffer, all slots together, with
    ``n_ctx_train``, so kvwarm demotes it: see ``backends._native``.)
    """
    if n_ctx_train > 0 and n_ctx_slot > n_ctx_train:
        log.warning(
            "model %s: n_ctx %d per request is more than the %d tokens it was trained on; "
            "output past %d tokens may degrade unless RoPE scaling extends it "
            "(--rope-scaling, --rope-freq-scale)",
            model_id,
            n_ctx_slot,
            n_ctx_train,
            n_ctx_train,
        )
