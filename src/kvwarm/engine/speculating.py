"""What a model that will speculate needs decided before it loads, from its GGUF header.

A model verifies drafts only where it speculates and generates: a reranker (pooling ``rank``,
its GGUF's or its config's) and an encoder (``{arch}.attention.causal`` false: an embedding
model such as BERT's) never generate, so they never verify a draft whatever their
``spec_type``; nor does a model whose state cannot roll a rejected draft back (a recurrent
or hybrid architecture: speculation is off for it, ``describe.speculation``). That is known
from the header before the weights load (``verifies_drafts``), and it decides the load: a
model that verifies drafts exactly (``needs_exact_rows``: its ``spec_exact``) loads its
weights where its verify rows can be exact (``ModelParams.exact_rows``: unrepacked), and may
need llama.cpp's tiled K-quant kernel off for the whole process (``GGML_CPU_TILED_MM=0``;
docs/configuration.md, "Exact, or off"). A model that cannot generate, or need not be
exact, pays for neither.

The kernel switch is the process's, read by ggml once, at its first matrix product, and set
through the environment, which is not safe to change while another thread may read it. So a
process decides at its start, in its main thread before any other thread starts
(``untile_at_start``: ``kvwarm serve`` over every model it may load, ``complete`` and
``chat`` over theirs, ``cache explain`` over its server's, ``kvwarm.load_model`` before the
default engine exists; a library user calls it before making an ``Engine``). A model's load
does it only as the fallback of a process that did not, and only while it is the process's
sole thread (``backends/llama/native.untile_for_exact_rows``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from kvwarm.backends import get_backend
from kvwarm.backends.base import POOLING_BY_ID, Backend
from kvwarm.engine.config import ModelConfig
from kvwarm.errors import ModelNotFoundError
from kvwarm.gguf_meta import architecture

log = logging.getLogger(__name__)

#: The header keys (``{arch}.NAME``) that say whether a model generates.
_KEYS = ("pooling_type", "attention.causal")


#: The architectures whose memory holds a recurrent state (llama.cpp's
#: ``llm_arch_is_recurrent`` and ``llm_arch_is_hybrid``, the pinned 0.3.36's names): a verify
#: pass would move it past the draft's rejected tokens with no way back, so such a model never
#: verifies one (``MemoryKind.lookahead`` is 0 for it once loaded).
RECURRENT_ARCHS = frozenset(
    {
        *("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"),
        *("jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h"),
        *("nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next"),
        *("qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01"),
    }
)


def verifies_drafts(cfg: ModelConfig, path: str | os.PathLike[str]) -> bool:
    """Whether the model at ``path``, loaded with ``cfg``, will verify drafts: it speculates
    (``cfg.speculative``, not deterministic), generates (its pooling, ``cfg``'s or its
    GGUF's, is not ``rank``; its attention is causal) and can roll a draft back (its
    architecture is not in ``RECURRENT_ARCHS``). Read from the GGUF's header, before
    anything loads; a file whose header cannot be read (a stub backend's name) is taken at
    its configuration's word, as llama.cpp would refuse it anyway."""
    if not cfg.speculative or cfg.deterministic:
        return False
    try:
        arch, header = architecture(path, _KEYS)
    except (OSError, ValueError):
        arch, header = None, {}
    if arch in RECURRENT_ARCHS:
        return False
    found = header.get("pooling_type")
    pooling = None
    if isinstance(found, int) and 0 <= found < len(POOLING_BY_ID):
        pooling = POOLING_BY_ID[found]
    return header.get("attention.causal") is not False and cfg.speculates_with(pooling)


def needs_exact_rows(cfg: ModelConfig, path: str | os.PathLike[str]) -> bool:
    """Whether the model at ``path``, loaded with ``cfg``, must keep its verify rows one-token
    passes' bit for bit: it verifies drafts (``verifies_drafts``) and its ``spec_exact`` says
    they must be exact. A model with ``spec_exact`` false speculates as llama-server does, on
    the kernels that are fastest (the tiled kernel, its weights repacked): its verify rows
    may differ in their last bits anyway, and keeping them exact would cost it a slower
    prefill (Gemma 3 270M: 1.21x) and slower verify passes for nothing."""
    return cfg.spec_exact and verifies_drafts(cfg, path)


def untile_at_start(
    models: Iterable[tuple[str | os.PathLike[str] | None, ModelConfig]],
    *,
    backend: str | Backend = "llama_cpp",
) -> bool:
    """Called at a process's start, in its main thread before any other thread runs, with the
    models it will load (a file, None for the backend's default model, and its config; a
    config without a backend runs on ``backend``): turns llama.cpp's tiled K-quant kernel off
    for the process where one of them will verify drafts exactly (``needs_exact_rows``) with weights
    that kernel multiplies, and nobody set ``GGML_CPU_TILED_MM``; True if it did. Every model
    of the process then computes without it, and its cache keys say so
    (``BackendModel.kernels``: ``untiled``). A model not found is left to its load to report.
    Called with other threads running, it refuses (``native.untile_for_exact_rows``)."""
    for path, cfg in models:
        chosen = cfg.backend or backend
        runs_on = get_backend(chosen) if isinstance(chosen, str) else chosen
        if runs_on.name != "llama_cpp":
            continue
        try:
            located = runs_on.locate(path)
        except ModelNotFoundError:
            continue
        if not needs_exact_rows(cfg, located):
            continue
        # Imported here: only a llama.cpp model has this kernel (the module loads no library).
        from kvwarm.backends.llama.model import untile_for_verifying

        if untile_for_verifying(str(located)):
            return True
    return False


def kernel_environment() -> dict[str, str]:
    """This process's kernel switch as environment variables (``GGML_CPU_TILED_MM``, where it
    is set), for a process it starts to load its models (a ``kvwarm cluster`` replica): set
    there before anything runs, as ``untile_at_start`` set it here."""
    from kvwarm.backends.llama.native import TILED_SWITCH

    value = os.environ.get(TILED_SWITCH)
    return {} if value is None else {TILED_SWITCH: value}
