"""The stub backend's fake LoRA adapters.

Invariant: an adapter holds its model open until it is closed (``_lifetime``), like a
llama.cpp adapter; its file digest salts the logits of the contexts it is attached to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvwarm.backends.lifetime import Lifetime

if TYPE_CHECKING:
    from kvwarm.backends.stub import StubModel


class StubAdapter:
    """A fake LoRA adapter: its file digest salts the logits of contexts it is attached to."""

    def __init__(self, model: StubModel, path: str, digest: bytes, size_bytes: int) -> None:
        self.model = model
        self._path = path
        self._sha256 = digest
        self._size_bytes = size_bytes  # notional: the file's bytes, as its weights
        self._life = Lifetime("adapter", model._release)

    @property
    def path(self) -> str:
        return self._path

    @property
    def sha256(self) -> bytes:
        return self._sha256

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    @property
    def lifetime(self) -> Lifetime:
        return self._life

    def close(self) -> None:
        self._life.close()
