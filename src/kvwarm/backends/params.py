"""Parameters of a model load and of a context: types, defaults, validation and the context's
cache-namespace hash. Pure data: no native calls (``docs/architecture.md``, "Layers").

Invariant: ``ContextParams.kv_hash`` of unchanged defaults is byte-for-byte the hash older
versions wrote, so existing cache rows keep their keys.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args, get_origin

#: A KV cell type. ``auto`` is the backend's choice (``BackendModel.context_params``): f16,
#: except where a model speculates and f16 would make a verify pass's rows differ from one-token
#: passes (llama.cpp on the CPU: q8_0 there, ``docs/internals.md``, "Numerics"). A context
#: created with ``auto`` unresolved runs f16 (``concrete_kv``), and hashes as f16.
KvType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1", "auto"]
#: How a context pools a sequence's outputs: ``rank`` scores it with the model's classifier head
#: (a reranker: one value per label, ``ModelFacts.n_cls_out``).
PoolingType = Literal["mean", "cls", "last", "none", "rank"]
#: llama.cpp's ``llama_split_mode``: one GPU, layers spread over GPUs, or rows (tensor parallel).
SplitMode = Literal["none", "layer", "row"]
#: ``auto`` lets llama.cpp enable flash attention where the device supports it.
FlashAttn = Literal["auto", "on", "off"]
#: ``None`` (in ``ContextParams.rope_scaling``): the model's own RoPE scaling.
RopeScaling = Literal["none", "linear", "yarn", "longrope"]

KV_TYPES: tuple[str, ...] = get_args(KvType)
#: What ``auto`` is where nothing chose for it.
DEFAULT_KV_TYPE: KvType = "f16"
#: KV cell types that are block-quantised: llama.cpp stores V of these only with flash attention.
QUANTIZED_KV_TYPES = frozenset({"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})
SPLIT_MODES: tuple[str, ...] = get_args(SplitMode)
FLASH_ATTN_MODES: tuple[str, ...] = get_args(FlashAttn)
ROPE_SCALINGS: tuple[str, ...] = get_args(RopeScaling)
POOLING_TYPES: tuple[str, ...] = get_args(PoolingType)
#: The pooling types by llama.cpp's ``llama_pooling_type`` id, the value of a GGUF's
#: ``{arch}.pooling_type``.
POOLING_BY_ID: tuple[PoolingType, ...] = ("none", "mean", "cls", "last", "rank")

_MAX_THREADS = 512
_INT32_MAX = 2**31 - 1
#: Any contiguous buffer a blob or chunk may arrive in.
Buffer = bytes | bytearray | memoryview
#: A buffer ``kv_join`` may write into (a writable ``memoryview`` or a ``bytearray``).
WritableBuffer = bytearray | memoryview

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
    #: The model will verify drafts (it speculates and generates: the engine reads that from
    #: its GGUF header, ``engine/speculating.verifies_drafts``): where ``use_extra_bufts`` is
    #: None and repacking is all that would make a verify pass's rows differ from one-token
    #: passes' (a repacked product takes a GEMM for several rows and a GEMV for one), its
    #: weights load without the extra buffer types (``LlamaModel``;
    #: ``BackendModel.verify_exactness``). A llama.cpp load with it also turns the tiled
    #: kernel off where its process did not decide at its start and still can
    #: (``backends/llama/model.untile_for_verifying``).
    exact_rows: bool = False
    progress: ProgressCallback | None = field(default=None, compare=False, hash=False)

    def validate(self) -> None:
        from kvwarm.errors import ConfigError

        check_field_types(self)
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
    model's own value". ``flash_attn`` ``auto`` lets llama.cpp decide per device, unless the
    backend resolves it first (``BackendModel.context_params``: the engine's llama models run
    ``off`` on the CPU alone); a quantised V cache needs flash attention, so ``type_v``
    q8_0/q4_0... with ``flash_attn='off'`` is refused. ``type_k``/``type_v`` ``auto`` are the
    backend's choice in the same way (f16 unless the model speculates, ``KvType``).
    """

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_seq_max: int = 1
    type_k: KvType = "auto"
    type_v: KvType = "auto"
    embeddings: bool = False
    pooling: PoolingType = "mean"
    seed: int = 0
    flash_attn: FlashAttn = "auto"
    #: llama.cpp's full-size SWA cache: sliding-window layers keep every position, so their
    #: state trims like full attention (``kvwarm.memory``), at the cost of a full-size KV
    #: buffer for those layers too. Changes what a saved state holds, so it is hashed.
    swa_full: bool = False
    #: One KV buffer for every sequence (llama.cpp's ``kv_unified``), or a stream of
    #: ``n_ctx / n_seq_max`` cells per sequence. With streams a sequence's cells sit where a
    #: one-sequence context would put them whatever the others hold, and each forward pass
    #: over one sequence spans only its own cells: deterministic mode's layout. Saved states
    #: are stored in the one-stream form either way, so it is not hashed.
    kv_unified: bool = True
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

        check_field_types(self)
        if self.n_ctx < 16:
            raise ConfigError(f"n_ctx must be >= 16, got {self.n_ctx}")
        if self.n_batch < 1 or self.n_ubatch < 1:
            raise ConfigError("n_batch and n_ubatch must be >= 1")
        if self.n_ubatch > self.n_batch:
            raise ConfigError(f"n_ubatch ({self.n_ubatch}) must be <= n_batch ({self.n_batch})")
        for name in ("n_ctx", "n_batch"):
            # Found by review: llama.cpp's structs, positions and llama_batch_init take 32-bit
            # ints, and ctypes wraps a larger value silently: n_batch 2**32 + 64 made a context
            # of 64 and a batch the first prefill wrote past (a segfault).
            if getattr(self, name) > _INT32_MAX:
                raise ConfigError(f"{name} must be <= {_INT32_MAX}, got {getattr(self, name)}")
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

    def kv_hash(self, kernels: str = "") -> bytes:
        """32 bytes identifying every parameter that shapes the KV state or its numerics, and
        ``kernels``: the model's matrix kernels where they are not the machine's defaults
        (``BackendModel.kernels``; hashed only when not "", so default rows keep their keys).

        ``n_seq_max``, ``kv_unified`` and thread counts are excluded: a sequence's KV bytes
        (in the one-stream form rows are stored in) do not depend on them, and rows must be
        shareable between a 1-slot and an N-slot context. (Except a deterministic
        model's ``n_threads`` where a one-token pass may split the cells among the threads: the
        backend tags that count, ``BackendModel.kv_tag``, resolving None as the process runs
        it.) The KV cell types,
        flash attention (it changes the numerics and whether V is stored transposed) and
        every RoPE/YaRN knob (K is stored rotated) are included. Fields added after the first
        version are hashed only when they differ from their defaults: a context created before
        they existed ran with exactly those defaults, so its rows keep their keys.
        """
        fields = asdict(self)
        for excluded in (
            "n_threads",
            "n_threads_batch",
            "n_seq_max",
            "kv_unified",
            "seed",
            "embeddings",
            "pooling",
        ):
            fields.pop(excluded)
        # ``auto`` unresolved runs, and so hashes, as f16.
        fields["type_k"], fields["type_v"] = concrete_kv(self.type_k), concrete_kv(self.type_v)
        for name, default in _HASHED_IF_CHANGED.items():
            if fields[name] == default:
                fields.pop(name)
        if kernels:
            fields["kernels"] = kernels
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"kvwarm-ctx-v1\0" + blob).digest()


def concrete_kv(name: KvType) -> KvType:
    """The cell type a context runs for ``name``: ``auto`` left unresolved is f16."""
    return DEFAULT_KV_TYPE if name == "auto" else name


def check_field_types(obj: object) -> None:
    """``ConfigError`` naming the first field of the dataclass ``obj`` whose value is not of
    its declared type (an integer field holds an int and not a bool, a ``Literal`` one of its
    values, a tuple its items' type). Found by review: ``load_model(n_ctx="4096")`` raised
    ``TypeError: '<' not supported``, ``deterministic="no"`` loaded a deterministic model (a
    string is true), ``n_batch="64"`` a ``ValueError`` from ``int()``."""
    from kvwarm.errors import ConfigError

    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        hint = hints[f.name]
        if _conforms(value, hint) is False:
            raise ConfigError(f"{f.name} must be {_describe(hint)}, got {value!r}")


def _conforms(value: object, hint: object) -> bool | None:
    """Whether ``value`` is of type ``hint``; None where this cannot tell (a protocol)."""
    origin = get_origin(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in get_args(hint))
    if origin in (typing.Union, types.UnionType):
        seen = [_conforms(value, arg) for arg in get_args(hint)]
        return True if True in seen else (None if None in seen else False)
    if origin is tuple:
        args = get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            seen = [_conforms(item, args[0]) for item in value]
            return False if False in seen else (None if None in seen else True)
        return None
    if origin is collections.abc.Callable:
        return callable(value)
    if isinstance(hint, type):
        try:
            return isinstance(value, hint)
        except TypeError:  # a protocol that is not runtime-checkable
            return None
    return None


def _describe(hint: object) -> str:
    names = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if hint is type(None):
        return "None"
    origin = get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(str, get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in get_args(hint))
    if origin is tuple:
        return "a tuple"
    return getattr(hint, "__name__", str(hint))


def _one_of(name: str, value: object, allowed: Sequence[str]) -> None:
    from kvwarm.errors import ConfigError

    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


# Defaults of the ContextParams fields added after kv_hash v1 (see ContextParams.kv_hash).
_HASHED_IF_CHANGED: dict[str, object] = {
    "flash_attn": "auto",
    "swa_full": False,
    "rope_scaling": None,
    "rope_freq_base": 0.0,
    "rope_freq_scale": 0.0,
    "yarn_ext_factor": -1.0,
    "yarn_attn_factor": -1.0,
    "yarn_beta_fast": -1.0,
    "yarn_beta_slow": -1.0,
    "yarn_orig_ctx": 0,
}
