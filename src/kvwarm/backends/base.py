"""The backend protocol: what the engine may ask of a model runtime.

Invariants every implementation keeps:

- Nothing a caller can pass aborts the process. Native failures become ``BackendError``
  subclasses (see ``kvwarm.errors``); preconditions llama.cpp would ``GGML_ASSERT`` on are
  checked in Python first.
- Sequence ids are arguments, never state: a KV blob from ``kv_pack(seq=a)`` restores into any
  ``seq=b`` of any context created from the same model with the same ``ContextParams``.
- ``prefill`` splits its work at absolute positions that are multiples of ``n_batch``; this is
  what makes an aligned restore + prefill bit-identical to a cold prefill (``kvwarm.alignment``).
- Handles are closed once; every use after ``close()`` raises ``HandleClosedError``. Closing a
  model while a context created from it is open defers the native free until the last context
  closes.
- A context is not thread-safe: one thread (the model's worker) drives it. Model-level calls
  (tokenize, detokenize, chat templates) are safe from any thread.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Protocol, get_args, runtime_checkable

KvType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
PoolingType = Literal["mean", "cls", "last", "none"]
#: llama.cpp's ``llama_split_mode``: one GPU, layers spread over GPUs, or rows (tensor parallel).
SplitMode = Literal["none", "layer", "row"]
#: ``auto`` lets llama.cpp enable flash attention where the device supports it.
FlashAttn = Literal["auto", "on", "off"]
#: ``None`` (in ``ContextParams.rope_scaling``): the model's own RoPE scaling.
RopeScaling = Literal["none", "linear", "yarn", "longrope"]

KV_TYPES: tuple[str, ...] = get_args(KvType)
#: KV cell types that are block-quantised: llama.cpp stores V of these only with flash attention.
QUANTIZED_KV_TYPES = frozenset({"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})
SPLIT_MODES: tuple[str, ...] = get_args(SplitMode)
FLASH_ATTN_MODES: tuple[str, ...] = get_args(FlashAttn)
ROPE_SCALINGS: tuple[str, ...] = get_args(RopeScaling)
POOLING_TYPES: tuple[str, ...] = get_args(PoolingType)

_MAX_THREADS = 512
_INT32_MAX = 2**31 - 1
#: Any contiguous buffer a blob or chunk may arrive in.
Buffer = bytes | bytearray | memoryview

#: A load-progress callback: receives a fraction in [0, 1]; returning False aborts the load.
ProgressCallback = Callable[[float], bool]


@dataclass(frozen=True, slots=True)
class ModelParams:
    """Options for loading model weights. Validated by ``validate()``.

    ``n_gpu_layers``: layers offloaded to the GPU (0: none, -1: all, as llama-cpp-python's
    ``Llama`` takes it); a CPU-only build accepts any value and runs on the CPU.
    ``tensor_split``: each GPU's share of the model, in device order; llama.cpp normalises the
    shares, so ``(3, 1)`` and ``(0.75, 0.25)`` are the same split. Empty: llama.cpp's choice
    (proportional to free memory). None of these fields changes a row's bytes or key: where a
    layer runs does not change the KV state's format (see ``ContextParams.kv_hash``).
    """

    n_gpu_layers: int = 0
    split_mode: SplitMode = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    use_mmap: bool = True
    use_mlock: bool = False
    vocab_only: bool = False
    #: Repack weights into llama.cpp's extra CPU buffer types (AMX, CPU_REPACK). None: on,
    #: unless the CPU build uses AMX, whose matmul in the pinned llama.cpp segfaults on the
    #: first multi-token batch (docs/architecture.md, "Layers": the AMX fault).
    use_extra_bufts: bool | None = None
    progress: ProgressCallback | None = field(default=None, compare=False, hash=False)

    def validate(self) -> None:
        from kvwarm.errors import ConfigError

        if isinstance(self.n_gpu_layers, bool) or not isinstance(self.n_gpu_layers, int):
            raise ConfigError(f"n_gpu_layers must be an integer, got {self.n_gpu_layers!r}")
        # int32 in llama.cpp's struct: ctypes would wrap a larger value silently.
        if not -1 <= self.n_gpu_layers <= _INT32_MAX:
            raise ConfigError(
                f"n_gpu_layers must be >= 0 (or -1 for all layers), got {self.n_gpu_layers}"
            )
        if self.split_mode not in SPLIT_MODES:
            raise ConfigError(
                f"split_mode must be one of {', '.join(SPLIT_MODES)}, got {self.split_mode!r}"
            )
        if isinstance(self.main_gpu, bool) or not isinstance(self.main_gpu, int):
            raise ConfigError(f"main_gpu must be an integer, got {self.main_gpu!r}")
        if not 0 <= self.main_gpu <= _INT32_MAX:
            raise ConfigError(f"main_gpu must be >= 0, got {self.main_gpu}")
        check_tensor_split(self.tensor_split)


def check_tensor_split(shares: Sequence[float]) -> None:
    """Each share finite and >= 0, and at least one > 0 (llama.cpp divides by their sum)."""
    from kvwarm.errors import ConfigError

    for share in shares:
        if isinstance(share, bool) or not isinstance(share, int | float):
            raise ConfigError(f"tensor_split shares must be numbers, got {share!r}")
        if not math.isfinite(share) or share < 0:
            raise ConfigError(f"tensor_split shares must be finite and >= 0, got {share!r}")
    if shares and sum(shares) <= 0:
        raise ConfigError("tensor_split must give at least one GPU a share > 0")


@dataclass(frozen=True, slots=True)
class ContextParams:
    """Options for one ``llama_context``. Validated by ``validate()``.

    RoPE/YaRN fields take llama.cpp's conventions: ``rope_scaling`` None, ``rope_freq_base`` and
    ``rope_freq_scale`` 0, ``yarn_*`` factors negative and ``yarn_orig_ctx`` 0 all mean "the
    model's own value". ``flash_attn`` ``auto`` lets llama.cpp decide per device; a quantised V
    cache needs flash attention, so ``type_v`` q8_0/q4_0... with ``flash_attn='off'`` is refused.
    """

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_seq_max: int = 1
    type_k: KvType = "f16"
    type_v: KvType = "f16"
    embeddings: bool = False
    pooling: PoolingType = "mean"
    seed: int = 0
    flash_attn: FlashAttn = "auto"
    rope_scaling: RopeScaling | None = None
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_fast: float = -1.0
    yarn_beta_slow: float = -1.0
    yarn_orig_ctx: int = 0

    def validate(self) -> None:
        from kvwarm.errors import ConfigError

        if self.n_ctx < 16:
            raise ConfigError(f"n_ctx must be >= 16, got {self.n_ctx}")
        if self.n_batch < 1 or self.n_ubatch < 1:
            raise ConfigError("n_batch and n_ubatch must be >= 1")
        if self.n_ubatch > self.n_batch:
            raise ConfigError(f"n_ubatch ({self.n_ubatch}) must be <= n_batch ({self.n_batch})")
        if not 1 <= self.n_seq_max <= 256:
            raise ConfigError(f"n_seq_max must be in [1, 256], got {self.n_seq_max}")
        for name in ("n_threads", "n_threads_batch"):
            value = getattr(self, name)
            # ggml sizes its thread tables by GGML_MAX_N_THREADS (512) and asserts on more.
            if value is not None and not 1 <= value <= _MAX_THREADS:
                raise ConfigError(f"{name} must be in [1, {_MAX_THREADS}], got {value}")
        _one_of("pooling", self.pooling, POOLING_TYPES)
        self._validate_kv()
        self._validate_rope()

    def _validate_kv(self) -> None:
        from kvwarm.errors import ConfigError

        _one_of("type_k", self.type_k, KV_TYPES)
        _one_of("type_v", self.type_v, KV_TYPES)
        _one_of("flash_attn", self.flash_attn, FLASH_ATTN_MODES)
        # llama.cpp refuses this combination at context creation; say why before trying.
        if self.type_v in QUANTIZED_KV_TYPES and self.flash_attn == "off":
            raise ConfigError(
                f"a quantised V cache (type_v={self.type_v}) needs flash attention; "
                "set flash_attn to 'on' or 'auto', or type_v to f16"
            )

    def _validate_rope(self) -> None:
        from kvwarm.errors import ConfigError

        if self.rope_scaling is not None:
            _one_of("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        for name in (
            "rope_freq_base",
            "rope_freq_scale",
            "yarn_ext_factor",
            "yarn_attn_factor",
            "yarn_beta_fast",
            "yarn_beta_slow",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be finite, got {value!r}")
        for name in ("rope_freq_base", "rope_freq_scale"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"{name} must be >= 0 (0: the model's own), got {getattr(self, name)}"
                )
        if not 0 <= self.yarn_orig_ctx <= _INT32_MAX:
            raise ConfigError(
                f"yarn_orig_ctx must be >= 0 (0: the model's own), got {self.yarn_orig_ctx}"
            )

    def kv_hash(self) -> bytes:
        """32 bytes identifying every parameter that shapes the KV state or its numerics.

        ``n_seq_max`` and thread counts are excluded: a sequence's KV bytes do not depend on
        them, and rows must be shareable between a 1-slot and an N-slot context. The KV cell
        types, flash attention (it changes the numerics and whether V is stored transposed) and
        every RoPE/YaRN knob (K is stored rotated) are included. Fields added after the first
        version are hashed only when they differ from their defaults: a context created before
        they existed ran with exactly those defaults, so its rows keep their keys.
        """
        fields = asdict(self)
        for excluded in (
            "n_threads",
            "n_threads_batch",
            "n_seq_max",
            "seed",
            "embeddings",
            "pooling",
        ):
            fields.pop(excluded)
        for name, default in _HASHED_IF_CHANGED.items():
            if fields[name] == default:
                fields.pop(name)
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"kvwarm-ctx-v1\0" + blob).digest()


def _one_of(name: str, value: object, allowed: Sequence[str]) -> None:
    from kvwarm.errors import ConfigError

    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


# Defaults of the ContextParams fields added after kv_hash v1 (see ContextParams.kv_hash).
_HASHED_IF_CHANGED: dict[str, object] = {
    "flash_attn": "auto",
    "rope_scaling": None,
    "rope_freq_base": 0.0,
    "rope_freq_scale": 0.0,
    "yarn_ext_factor": -1.0,
    "yarn_attn_factor": -1.0,
    "yarn_beta_fast": -1.0,
    "yarn_beta_slow": -1.0,
    "yarn_orig_ctx": 0,
}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """A sampler chain. ``temperature <= 0`` means greedy (argmax), ignoring the others."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    grammar: str | None = None
    grammar_root: str = "root"
    # (token, bias) added to the raw logits before any other step; -inf bans a token.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True, slots=True)
class BatchToken:
    """One token in a mixed decode batch. ``logits`` asks for this position's logits."""

    token: int
    pos: int
    seq: int
    logits: bool = False


@dataclass(frozen=True, slots=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle tokens (llama.cpp's ``llama_vocab_fim_*``): a model
    with ``pre``, ``suf`` and ``mid`` can infill; ``rep``/``sep`` (repository and file
    separators, for extra context files) and ``pad`` may be absent."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """Static facts about loaded weights."""

    path: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    size_bytes: int
    n_params: int
    description: str
    file_type: int  # LLAMA_FTYPE_* from general.file_type; the cache key's quant byte.
    quant_bits: int  # nominal bits per weight of file_type (4 for Q4_*), 16 for F16...
    bos: int | None
    eos: int | None
    add_bos: bool
    chat_template: str | None
    metadata: Mapping[str, str]
    fim: FimTokens | None = None  # None: the model cannot fill in the middle


@runtime_checkable
class Sampler(Protocol):
    """A stateful sampler chain bound to one model's vocabulary."""

    def sample(self, ctx: BackendContext, index: int) -> int:
        """Sample from the logits of batch row ``index`` (-1: last) and accept the token."""
        ...

    def sample_logits(self, logits: bytes | memoryview) -> int:
        """Sample from raw float32 logits (n_vocab of them) and accept the token.

        Used for an exact cache hit whose row stored its final logits: no decode needed.
        """
        ...

    def accept(self, token: int) -> None:
        """Feed a token chosen elsewhere (e.g. prompt history for repetition penalties)."""
        ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Adapter(Protocol):
    """A loaded LoRA adapter."""

    @property
    def path(self) -> str: ...

    @property
    def sha256(self) -> bytes:
        """Digest of the adapter file; folded into the effective fingerprint."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class KvCodec(Protocol):
    """Cuts one context's KV blobs (``kv_pack``) into per-token-range chunks and back.

    A *chunk* covers the token positions ``[start, start + n_cells)`` of one sequence: every
    layer's K and V for those positions and their per-cell metadata, behind a small envelope
    that names the codec, the cell layout (cell types, layers, row sizes, V transposed or not),
    ``start`` and ``n_cells``, sealed by a CRC32 of the envelope (``backends/kv_chunk.py``).
    Chunk bytes depend only on the cells' content, not on the sequence id or on where the cells
    sat in the context (so equal prefixes give equal chunks in every process). Layouts:
    ``docs/architecture.md``, "KV state layout".

    Guarantees:

    - ``join(split(blob, [0, b1, ..., n]))`` is byte-identical to ``blob`` when ``blob`` came
      from ``kv_pack(0)`` of a sequence whose cells are in position order (always the case for
      a sequence prefilled alone or restored from a blob); from another seq id, the result is
      that blob with the id set to 0. ``join`` of the first ``j`` chunks equals ``kv_pack(0)``
      of the same sequence trimmed (``seq_rm``) to the end of chunk ``j``.
    - Every length and count is checked before it is used; anything malformed, truncated,
      reordered or made with another layout (cell type, model shape, backend) raises
      ``StateRestoreError`` and nothing reaches the native library.
    - Pure and thread-safe: a codec reads no native state, so the cache's writer threads may
      split and join while the worker decodes, and it stays usable after its context closed.
    - Chunk payloads are fresh, contiguous ``bytes`` (each byte copied once from the blob);
      ``join`` writes each byte once into one preallocated ``bytearray`` that ``kv_unpack``
      reads in place. K/V values themselves are opaque here: the cache's CRC guards them.
    """

    def split(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        """One chunk per range ``[bounds[i], bounds[i+1])`` of token positions.

        ``bounds`` is strictly increasing with ``0 <= bounds[0]`` and ``bounds[-1] <= n``, the
        blob's cell count; ``[0, ..., n]`` covers the whole blob, a later first bound emits
        only the chunks a store lacks. ``StateRestoreError`` for a blob whose structure this
        codec does not know (e.g. several KV streams, a sliding-window model) or whose cells
        are not exactly positions ``0..n-1``; ``InvalidRequestError`` for bad ``bounds``.
        """
        ...

    def join(self, chunks: Sequence[Buffer]) -> bytearray:
        """A blob ``kv_unpack`` accepts, from chunks covering ``[0, n)`` in order
        (``[]``: an empty sequence)."""
        ...

    def chunk_range(self, chunk: Buffer) -> tuple[int, int]:
        """``(start, n_cells)`` of one chunk, after checking its envelope and layout."""
        ...


@runtime_checkable
class BackendContext(Protocol):
    """One inference context with ``n_seq_max`` sequences, driven by a single thread."""

    @property
    def params(self) -> ContextParams: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_batch(self) -> int: ...

    def decode(self, batch: Sequence[BatchToken]) -> None:
        """One forward pass over ``len(batch) <= n_batch`` tokens, possibly of several seqs.

        Afterwards, ``logits(i)`` / ``Sampler.sample(ctx, i)`` are valid for every row ``i``
        that asked for logits, until the next decode. Raises ``ContextOverflowError`` if a
        position is >= n_ctx, ``InvalidRequestError`` for bad token ids or seq ids.
        """
        ...

    def prefill(self, seq: int, tokens: Sequence[int], start_pos: int) -> None:
        """Decode ``tokens`` at positions ``start_pos…`` of ``seq``, chunk boundaries at
        absolute multiples of ``n_batch``; logits of the last token are kept (index -1)."""
        ...

    def logits(self, index: int = -1) -> memoryview:
        """float32 logits (n_vocab) of batch row ``index``; ``NoLogitsError`` if none."""
        ...

    def kv_pack(self, seq: int) -> bytes:
        """The sequence's KV state as one blob (``llama_state_seq_get_data``)."""
        ...

    def kv_unpack(self, seq: int, data: bytes | bytearray | memoryview) -> int:
        """Restore a blob into ``seq`` (cleared first) without copying it; returns the number
        of token positions now in the sequence. ``StateRestoreError`` on a bad blob."""
        ...

    @property
    def kv_codec(self) -> KvCodec:
        """This context's chunk codec (pure, any thread, outlives the context)."""
        ...

    def kv_split(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        """``kv_codec.split``; ``HandleClosedError`` after close."""
        ...

    def kv_join(self, chunks: Sequence[Buffer]) -> bytearray:
        """``kv_codec.join``; ``HandleClosedError`` after close."""
        ...

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Remove positions ``[p0, p1)`` (``p1 < 0``: to the end) from ``seq``."""
        ...

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Share positions ``[p0, p1)`` of ``src`` with ``dst`` (no copy of tensors)."""
        ...

    def seq_pos_max(self, seq: int) -> int:
        """Largest position held by ``seq``, -1 if empty."""
        ...

    def clear(self) -> None:
        """Drop every sequence's KV state."""
        ...

    def embed(self, tokens: Sequence[int], *, normalize: bool = True) -> list[float]:
        """Pooled embedding of ``tokens`` (context must have ``embeddings=True``)."""
        ...

    def set_adapters(self, adapters: Sequence[tuple[Adapter, float]]) -> None:
        """Replace the attached LoRA adapters (each with its scale)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class BackendModel(Protocol):
    """Loaded weights and vocabulary. Thread-safe except for the contexts it creates."""

    @property
    def facts(self) -> ModelFacts: ...

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]: ...

    def detokenize(
        self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False
    ) -> str: ...

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        """Raw bytes of one token; may be a partial UTF-8 sequence."""
        ...

    def is_eog(self, token: int) -> bool:
        """End-of-generation token (EOS, EOT, …)."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        template: str | None = None,
    ) -> str:
        """Render messages with the GGUF's own (Jinja) chat template, or ``template``."""
        ...

    def new_context(self, params: ContextParams) -> BackendContext: ...

    def new_sampler(self, params: SamplingParams) -> Sampler:
        """``GrammarError`` if the grammar does not compile."""
        ...

    def load_adapter(self, path: str) -> Adapter: ...

    def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """Factory of models. ``name`` is 'llama_cpp' or 'stub'."""

    @property
    def name(self) -> str: ...

    def locate(self, path: str | os.PathLike[str] | None) -> Path:
        """The weights ``path`` names (None: this backend's default model).
        ``ModelNotFoundError`` if this backend needs a file and there is none."""
        ...

    def load_model(self, path: str, params: ModelParams | None = None) -> BackendModel: ...


def json_schema_to_grammar(schema: Mapping[str, object] | str) -> str:
    """GBNF for a JSON schema (llama-cpp-python's converter); ``GrammarError`` if unsupported."""
    from kvwarm.backends.grammar import schema_to_gbnf

    return schema_to_gbnf(schema)
