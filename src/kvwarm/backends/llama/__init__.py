"""The llama.cpp backend (``get_backend('llama_cpp')``), over the low-level ``llama_cpp`` API.

The implementation is split by handle: ``llama_model`` (weights, vocabulary),
``llama_adapter`` (LoRA), ``llama_context`` (decode; KV state through ``_kv_state``),
``llama_sampler`` (sampler chains and grammars), with ``_native`` holding process-wide glue.
Imports run one way: ``llama_model`` imports the others, none imports it back. Importing this
module loads no native library; the first ``load_model`` does.
"""

from __future__ import annotations

from kvwarm.backends.llama.adapter import LlamaAdapter
from kvwarm.backends.llama.context import LlamaContext
from kvwarm.backends.llama.model import LlamaBackend, LlamaModel
from kvwarm.backends.llama.native import set_native_log_level
from kvwarm.backends.llama.sampler import LlamaSampler

__all__ = [
    "LlamaAdapter",
    "LlamaBackend",
    "LlamaContext",
    "LlamaModel",
    "LlamaSampler",
    "set_native_log_level",
]
