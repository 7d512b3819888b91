"""llama.cpp LoRA adapters.

Invariant: an adapter is one of its model's dependents (``_lifetime``): it holds the model open
and is freed before it. Its digest is of the file's bytes, folded into the cache namespace.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvwarm.backends.lifetime import Lifetime
from kvwarm.backends.llama import native as _native
from kvwarm.errors import AdapterError

if TYPE_CHECKING:
    from kvwarm.backends.llama.model import LlamaModel


class LlamaAdapter:
    """A LoRA adapter; freed before its model (it is one of the model's dependents)."""

    def __init__(self, model: LlamaModel, path: str) -> None:
        if "\0" in path or not Path(path).is_file():
            raise AdapterError(f"no adapter file at {path!r}")
        try:
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
        except OSError as exc:
            raise AdapterError(f"cannot read adapter {path!r}: {exc}") from exc
        self._path = path
        self._sha256 = digest.digest()
        self.model = model
        lib = model._lib
        model.lifetime.acquire()
        try:
            with model.lifetime.using(), _native.captured_log() as lines:
                ptr = lib.llama_adapter_lora_init(model.native, os.fsencode(path))
        except BaseException:
            model.lifetime.release()
            raise
        if not ptr:
            model.lifetime.release()
            raise AdapterError(
                f"adapter {path!r} does not fit this model{_why(lines)} (an adapter must be "
                "made for this model's architecture and tensor shapes)"
            )
        self._ptr: object = ptr
        self._lib = lib
        self._life = Lifetime("adapter", self._free)

    @property
    def path(self) -> str:
        return self._path

    @property
    def sha256(self) -> bytes:
        return self._sha256

    @property
    def native(self) -> object:
        return self._ptr

    @property
    def lifetime(self) -> Lifetime:
        return self._life

    def close(self) -> None:
        self._life.close()

    def _free(self) -> None:
        self._lib.llama_adapter_lora_free(self._ptr)
        self._ptr = None
        self.model.lifetime.release()


def _why(lines: list[str]) -> str:
    """llama.cpp's reason for refusing an adapter, from its log ("model arch and LoRA arch
    mismatch", "tensor 'blk.0.attn_q.weight' has incorrect shape ..."): the line that says
    what failed, without the function-name prefix."""
    for line in lines:
        text = line.strip()
        if "failed to apply lora adapter:" in text:
            return ": " + text.split("failed to apply lora adapter:", 1)[1].strip()
    return ""
