"""``ModelParams`` / ``ContextParams`` to llama.cpp's ``llama_model_params`` and
``llama_context_params`` structs (llama-cpp-python 0.3.36 field names).

Invariants:

- Every value is validated (``ModelParams.validate`` / ``ContextParams.validate``, plus the
  device count only llama.cpp knows) before a struct is filled, so no setting reaches a native
  call that could assert on it.
- The structs start from llama.cpp's own defaults (``llama_*_default_params``); only the fields
  kvwarm exposes are set, so a field added upstream keeps its upstream default.
- ``NativeModelParams.keep`` holds every ctypes object a struct points to (the tensor-split
  array, the progress callback): C reads them during ``llama_model_load_from_file``, so they
  must outlive that call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from kvwarm.backends.base import ContextParams, ModelParams, concrete_kv
from kvwarm.backends.llama import native as _native
from kvwarm.errors import ConfigError

# llama_model_params.load_mode values (LLAMA_LOAD_MODE_*).
_LOAD_NONE, _LOAD_MMAP, _LOAD_MLOCK, _LOAD_MMAP_MLOCK = 0, 1, 2, 3
# llama_split_mode, llama_flash_attn_type, llama_rope_scaling_type.
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
ROPE_SCALING = {None: -1, "none": 0, "linear": 1, "yarn": 2, "longrope": 3}
_POOLING_UNSPECIFIED = -1


@dataclass(slots=True)
class NativeModelParams:
    """A filled ``llama_model_params`` and the ctypes objects it points to."""

    struct: object
    keep: list[object]


def model_params(
    lib: ModuleType, params: ModelParams, on_progress: Callable[[float, object], bool] | None
) -> NativeModelParams:
    """The ``llama_model_params`` for ``params``; ``on_progress`` becomes the C callback."""
    params.validate()
    max_devices = int(lib.llama_max_devices())
    if len(params.tensor_split) > max_devices:
        raise ConfigError(
            f"tensor_split has {len(params.tensor_split)} shares but this llama.cpp build "
            f"supports at most {max_devices} devices"
        )
    mp = lib.llama_model_default_params()
    keep: list[object] = []
    mp.n_gpu_layers = params.n_gpu_layers
    mp.split_mode = SPLIT_MODES[params.split_mode]
    mp.main_gpu = params.main_gpu
    if params.tensor_split:
        # llama.cpp reads llama_max_devices() floats from this pointer.
        shares = (ctypes.c_float * max_devices)(*params.tensor_split)
        keep.append(shares)
        mp.tensor_split = ctypes.cast(shares, ctypes.POINTER(ctypes.c_float))
    mp.vocab_only = params.vocab_only
    extra = params.use_extra_bufts  # None: off only where AMX would crash (ModelParams)
    mp.use_extra_bufts = (not _native.amx_in_use()) if extra is None else extra
    if params.use_mmap:
        mp.load_mode = _LOAD_MMAP_MLOCK if params.use_mlock else _LOAD_MMAP
    else:
        mp.load_mode = _LOAD_MLOCK if params.use_mlock else _LOAD_NONE
    if on_progress is not None:
        callback = lib.llama_progress_callback(on_progress)
        keep.append(callback)
        mp.progress_callback = callback
    return NativeModelParams(mp, keep)


def context_params(lib: ModuleType, params: ContextParams, *, scratch_seqs: int = 0) -> object:
    """The ``llama_context_params`` for ``params`` (validated first), with ``scratch_seqs``
    sequences more than ``params.n_seq_max`` for the context's own use."""
    params.validate()
    cp = lib.llama_context_default_params()
    cp.n_ctx = params.n_ctx
    cp.n_batch = params.n_batch
    cp.n_ubatch = params.n_ubatch
    cp.n_seq_max = params.n_seq_max + scratch_seqs
    # llama.cpp reserves a graph of one token per sequence and asserts that its outputs fit
    # n_outputs_max (n_batch when left 0): more sequences than n_batch would GGML_ASSERT.
    cp.n_outputs_max = max(params.n_batch, cp.n_seq_max)
    threads = params.n_threads or _native.default_threads()
    cp.n_threads = threads
    cp.n_threads_batch = params.n_threads_batch or threads
    cp.type_k = _native.GGML_TYPES[concrete_kv(params.type_k)]
    cp.type_v = _native.GGML_TYPES[concrete_kv(params.type_v)]
    cp.flash_attn_type = FLASH_ATTN[params.flash_attn]
    cp.swa_full = params.swa_full
    cp.rope_scaling_type = ROPE_SCALING[params.rope_scaling]
    cp.rope_freq_base = params.rope_freq_base
    cp.rope_freq_scale = params.rope_freq_scale
    cp.yarn_ext_factor = params.yarn_ext_factor
    cp.yarn_attn_factor = params.yarn_attn_factor
    cp.yarn_beta_fast = params.yarn_beta_fast
    cp.yarn_beta_slow = params.yarn_beta_slow
    cp.yarn_orig_ctx = params.yarn_orig_ctx
    cp.embeddings = params.embeddings
    cp.pooling_type = _native.POOLING[params.pooling] if params.embeddings else _POOLING_UNSPECIFIED
    # One KV buffer shared by all sequences, unless the caller asks for a stream per sequence
    # (ContextParams.kv_unified). Unified makes seq_cp share cells instead of copying tensors;
    # n_ctx is then both each sequence's position limit and the total cell budget of all
    # sequences together. With streams llama.cpp gives each sequence n_ctx / n_seq_max cells
    # and writes the stream count into every blob (LlamaContext stores the one-stream form).
    cp.kv_unified = params.kv_unified
    cp.no_perf = True
    return cp
