"""llama.cpp LoRA adapters.

Invariant: an adapter is one of its model's dependents (``_lifetime``): it holds the model open
and is freed before it. Its digest is of the file's bytes, folded into the cache namespace.
Its tensors' types and outer dimensions are checked before llama.cpp loads it
(``_check_tensors``): llama.cpp checks only the first two dimensions, and a tensor it takes
but cannot multiply aborts or crashes the process at the first forward pass (an empty tensor,
a token embedding pair that cannot run: ``_check_token_embd``). So are the types
of the keys llama.cpp reads (``_check_keys``): its typed getters abort on any other.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kvwarm import gguf_meta
from kvwarm.backends.lifetime import Lifetime
from kvwarm.backends.llama import model_file
from kvwarm.backends.llama import native as _native
from kvwarm.errors import AdapterError
from kvwarm.models_dir import parts

if TYPE_CHECKING:
    from kvwarm.backends.base import ModelFacts
    from kvwarm.backends.llama.model import LlamaModel


class LlamaAdapter:
    """A LoRA adapter; freed before its model (it is one of the model's dependents)."""

    def __init__(self, model: LlamaModel, path: str) -> None:
        if "\0" in path or not Path(path).is_file():
            raise AdapterError(f"no adapter file at {path!r}")
        try:
            before = _identity(path)
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
        except OSError as exc:
            raise AdapterError(f"cannot read adapter {path!r}: {exc}") from exc
        #: What llama.cpp holds of it: its LoRA tensors' bytes (``_check_tensors``).
        self._size_bytes = _check_tensors(path, model.facts)
        _check_keys(path)
        #: A weight of it multiplied by another kernel for several rows than for one ("" if
        #: none): requests under it do not speculate (``LlamaModel.verify_exactness``).
        self.row_kernels = model_file.several_row_kernels(path, adapter=True)
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
        try:
            changed = _identity(path) != before
        except OSError:
            changed = True
        if changed:
            # Found by review: the digest names the bytes the namespace is folded from; a file
            # replaced between the digest and llama.cpp's read gave KV of one adapter under
            # the other's namespace, restored later for the adapter it does not belong to.
            lib.llama_adapter_lora_free(ptr)
            model.lifetime.release()
            raise AdapterError(f"adapter {path!r} changed while it was loading; load it again")
        if int(lib.llama_adapter_get_alora_n_invocation_tokens(ptr)) > 0:
            # Found by review: an activated LoRA is trained to act only from its invocation
            # tokens on (llama-server finds them in each prompt); kvwarm would run it over
            # whole prompts, silently not the adapter it is.
            lib.llama_adapter_lora_free(ptr)
            model.lifetime.release()
            raise AdapterError(
                f"adapter {path!r} is an activated LoRA (aLoRA: adapter.alora.invocation_tokens), "
                "which kvwarm does not run: it would apply it to whole prompts, not from its "
                "invocation tokens on"
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
    def size_bytes(self) -> int:
        return self._size_bytes

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


def _identity(path: str) -> tuple[int, int, int, int]:
    """What changes when a file is rewritten or replaced: device, inode, size, mtime."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _why(lines: list[str]) -> str:
    """llama.cpp's reason for refusing an adapter, from its log ("model arch and LoRA arch
    mismatch", "tensor 'blk.0.attn_q.weight' has incorrect shape ..."): the line that says
    what failed, without the function-name prefix."""
    for line in lines:
        text = line.strip()
        if "failed to apply lora adapter:" in text:
            return ": " + text.split("failed to apply lora adapter:", 1)[1].strip()
    return ""


#: The keys ``llama_adapter_lora_init`` reads, with the GGUF type it reads each as
#: (``gguf_get_val_str``, ``gguf_get_val_f32``): those assert the type (a GGML_ASSERT, an
#: abort of the whole process) where a mismatch is no error it could report.
_KEY_TYPES = {
    "general.type": 8,
    "general.architecture": 8,
    "adapter.type": 8,
    "adapter.lora.alpha": 6,
}


@contextmanager
def _reading(path: str) -> Iterator[None]:
    """Reading the adapter file at ``path``: a file that is no GGUF, or that cannot be read,
    is the caller's ``AdapterError``."""
    try:
        yield
    except ValueError as exc:
        raise AdapterError(
            f"adapter {path!r} is not a GGUF file llama.cpp can read: {exc}"
        ) from exc
    except OSError as exc:
        raise AdapterError(f"cannot read adapter {path!r}: {exc}") from exc


def _check_keys(path: str) -> None:
    """``AdapterError`` for an adapter whose keys llama.cpp reads are of another type than
    it reads them as, or whose ``adapter.lora.alpha`` is not a finite number. Found by
    review: an adapter whose alpha was a float64 (or a uint32, a string, an array), or whose
    ``general.type`` or ``adapter.type`` was no string, aborted the process as it loaded
    (``GGML_ASSERT(type_to_gguf_type<T>::value == type)`` in gguf.cpp); one whose alpha was
    NaN or infinite loaded, and every output under it was NaN."""
    with _reading(path):
        found = gguf_meta.values_of(path, _KEY_TYPES.__contains__)
    if problem := gguf_meta.mistyped(found, _KEY_TYPES):
        raise AdapterError(
            f"adapter {path!r}: {problem} llama.cpp reads it as (it would abort the process)"
        )
    alpha = found.values.get("adapter.lora.alpha")
    if isinstance(alpha, float) and not math.isfinite(alpha):
        raise AdapterError(
            f"adapter {path!r}: adapter.lora.alpha is {alpha}, not a finite number (every "
            "output under it would be NaN)"
        )


#: ggml type ids a LoRA tensor may have: those ``convert_lora_to_gguf.py`` writes, which every
#: backend multiplies. Found by review: an adapter of i8, i16, i32 or f64 tensors loaded, and
#: the first forward pass under it crashed the process (SIGSEGV in the CPU backend's matmul).
_LORA_TYPES = {0: "f32", 1: "f16", 8: "q8_0", 30: "bf16"}


def _nbytes(tensor: gguf_meta.TensorInfo) -> int:
    """A LoRA tensor's bytes as ggml holds it (``model_file.tensor_nbytes``; its type is one
    of ``_LORA_TYPES``, all in ``model_file.GGML_BLOCKS``)."""
    size = model_file.tensor_nbytes(tensor)
    assert size is not None, tensor.ggml_type
    return size


def _check_tensors(path: str, facts: ModelFacts) -> int:
    """The bytes llama.cpp holds of the adapter at ``path``: its LoRA tensors' (it copies
    each into a buffer of its type; norms it skips), counted in the memory budget. Found by
    review (lorabudget): an adapter was in no term of the budget, so a server under one
    loaded adapters past it.

    ``AdapterError`` for an adapter llama.cpp would load but could not run: a LoRA tensor
    of a type no matmul takes, or of dimensions past the two llama.cpp checks that the
    weight it adapts lacks. Found by review: an adapter whose ``lora_a`` was ``[n_in, rank,
    2]`` loaded and attached, and the first decode under it died on
    ``GGML_ASSERT(ggml_can_mul_mat(a, b))``. A mixture-of-experts weight (``*_exps``) is one
    matrix per expert, so its LoRA tensors have the model's expert count as third dimension;
    every other LoRA tensor is a matrix. Tensors llama.cpp skips (norms) are not checked.
    A pair for the token embedding is checked as ``_check_token_embd`` says."""
    arch = facts.metadata.get("general.architecture", "")
    experts = facts.metadata.get(f"{arch}.expert_count", "")
    embd: dict[str, gguf_meta.TensorInfo] = {}
    size = 0
    with _reading(path), gguf_meta.tensors_of(path) as tensors:
        for tensor in tensors:
            size += _check_tensor(path, tensor, experts)
            if tensor.name in _EMBD_PAIR:
                embd[tensor.name] = tensor
    if embd:
        _check_token_embd(path, embd, facts.path)
    return size


#: The LoRA pair of the token embedding, which llama.cpp reads flipped (``build_inp_embd``).
_EMBD_PAIR = ("token_embd.weight.lora_a", "token_embd.weight.lora_b")


def _check_token_embd(path: str, pair: Mapping[str, gguf_meta.TensorInfo], model_path: str) -> None:
    """``AdapterError`` for a ``token_embd.weight`` pair no forward pass can run. llama.cpp
    looks A's rows up by token and multiplies them by B, so A is ``[rank, n_vocab]`` and B
    ``[rank, n_embd]``, and its loader checks only their ``n_vocab`` and ``n_embd`` sides.
    Found by review: a pair whose two ranks differed loaded, and the first decode under it
    aborted the process (``GGML_ASSERT(ggml_can_mul_mat(a, b))``); so did any such pair on a
    model whose output is its token embedding (no ``output.weight``: SmolLM2, Gemma), whose
    output product is named ``token_embd.weight`` too and takes the flipped pair as a plain
    one, which can fit only where ``n_vocab`` is ``n_embd``."""
    a, b = pair.get(_EMBD_PAIR[0]), pair.get(_EMBD_PAIR[1])
    if a is not None and b is not None and a.shape[0] != b.shape[0]:
        raise AdapterError(
            f"adapter {path!r}: token_embd.weight.lora_a has rank {a.shape[0]} and its "
            f"lora_b {b.shape[0]}; they must be equal (llama.cpp would abort the process)"
        )
    if not _has_tensor(model_path, "output.weight"):
        raise AdapterError(
            f"adapter {path!r} adapts token_embd.weight, but this model's output is its token "
            "embedding (no output.weight), which llama.cpp cannot run under such an adapter "
            "(it would abort the process)"
        )


def _has_tensor(model_path: str, name: str) -> bool:
    """Whether the model at ``model_path`` (its split parts too) has a tensor ``name``; a
    table that cannot be read says no."""
    for part in (Path(model_path), *parts(Path(model_path))):
        try:
            with gguf_meta.tensors_of(part) as tensors:
                if any(t.name == name for t in tensors):
                    return True
        except (OSError, ValueError):
            return False
    return False


def _check_tensor(path: str, tensor: gguf_meta.TensorInfo, experts: str) -> int:
    """``_check_tensors`` for one tensor of the table (read as it is checked); its bytes in
    memory (0: one llama.cpp does not load)."""
    if not tensor.name.endswith((".lora_a", ".lora_b")):
        return 0  # llama.cpp skips norms and refuses any other name itself
    if tensor.ggml_type not in _LORA_TYPES:
        raise AdapterError(
            f"adapter {path!r}: LoRA tensor {tensor.name!r} is of ggml type "
            f"{tensor.ggml_type}; a LoRA tensor is {', '.join(_LORA_TYPES.values())} "
            "(as convert_lora_to_gguf.py writes them)"
        )
    if 0 in tensor.shape:
        # Found by review: a pair of rank 0 loaded, and the first decode under it aborted the
        # process (GGML_ASSERT(!ggml_is_transposed(a)): an empty tensor's strides).
        raise AdapterError(
            f"adapter {path!r}: LoRA tensor {tensor.name!r} has shape "
            f"{'x'.join(map(str, tensor.shape))}; it has no elements"
        )
    outer = list(tensor.shape[2:])
    while outer and outer[-1] == 1:
        outer.pop()
    wanted = [int(experts)] if "_exps." in tensor.name and experts.isdigit() else []
    if outer != wanted:
        shape = "x".join(map(str, tensor.shape))
        what = (
            f"one matrix for each of the model's {wanted[0]} experts"
            if wanted
            else "a matrix (two dimensions)"
        )
        raise AdapterError(
            f"adapter {path!r}: LoRA tensor {tensor.name!r} has shape {shape}; it must be "
            f"{what} (hint: maybe wrong base model?)"
        )
    return _nbytes(tensor)
