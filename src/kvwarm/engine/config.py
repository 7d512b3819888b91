"""Engine and model configuration: frozen values, validated before anything native is built.

Invariant: ``validate()`` raises ``ConfigError`` naming the first bad field, so a bad
configuration never reaches llama.cpp (``docs/architecture.md``, "Engine").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import TypedDict

from kvwarm.backends.base import (
    POOLING_TYPES,
    Backend,
    ContextParams,
    FlashAttn,
    KvType,
    ModelParams,
    PoolingType,
    RopeScaling,
    SplitMode,
)
from kvwarm.backends.params import check_field_types
from kvwarm.cache.types import CacheConfig, PolicyConfig, TierName
from kvwarm.cache.validate import validate_policy
from kvwarm.engine.fingerprint import parse_mode
from kvwarm.engine.types import MAX_DRAFT_TOKENS, SPEC_TYPES, SpecType
from kvwarm.engine.worker.batching import StrategyName, strategy
from kvwarm.errors import ConfigError
from kvwarm.media import MediaLimits


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """A LoRA adapter to load with its model: its file, the name it is served under, and the
    scale it is attached at (0: loaded but off until a request or ``set_adapter_scale`` turns
    it on). Handles are given in order, from 1."""

    path: str
    name: str = ""
    scale: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Per-model options. ``context.n_ctx`` is the window of *one* request (slot); the
    context is created with ``n_ctx * n_parallel`` cells shared by ``n_parallel`` slots."""

    backend: str | Backend | None = None  # a name, an instance, or None: the engine's default
    context: ContextParams = field(default_factory=ContextParams)
    model_params: ModelParams = field(default_factory=ModelParams)
    n_parallel: int = 1
    policy: PolicyConfig | None = None  # None: the engine's default policy
    save_tier: TierName | None = None  # None: the engine's first configured tier
    fingerprint_mode: str = "safe"
    fingerprint: bytes | None = None
    deterministic: bool = False
    #: ``--chat-template``: a built-in template's name (``backends.chat_template``) or a Jinja
    #: file's path. None: the GGUF's own, else chatml (with a warning, as llama-server).
    chat_template: str | None = None
    max_queue: int = 256
    batch_strategy: StrategyName = "decode_first"
    #: ``--mmproj``: the multimodal projector GGUF whose images (and audio) this model reads
    #: (llama.cpp's ``mtmd``); None: text only.
    mmproj: str | None = None
    #: What a request's images and audio may be (``kvwarm.media``).
    media: MediaLimits = field(default_factory=MediaLimits)
    #: ``--pooling``: how the model pools, over what its GGUF declares (None: the GGUF's,
    #: else mean). ``rank`` makes it a reranker (``Model.rerank``; it then only ranks).
    pooling: PoolingType | None = None
    #: The most documents one rerank may score (more: ``InvalidRequestError``).
    rerank_max_documents: int = 1000
    #: A rerank document whose prompt does not fit the context: its end is cut to fit
    #: (True) or the rerank refused (False: ``ContextOverflowError``).
    rerank_truncate: bool = False
    #: Speculative decoding (``engine/worker/drafts.py``): the draft source of requests that
    #: do not choose one (``SpecType``; llama-server's ``--spec-type``; None: "draft-simple"
    #: with a ``draft_model``, else "none", ``default_spec_type``), the n-gram size its
    #: lookups match, and the most tokens one draft may hold. Off in deterministic mode.
    spec_type: SpecType | None = None
    spec_ngram_n: int = 4
    spec_draft_max: int = 48
    #: Speculate only where a verify pass's rows are bit for bit one-token passes, so that a
    #: greedy reply is plain decoding's (``BackendModel.verify_exactness``: "at any length");
    #: False also speculates where they may differ in their last bits (llama-server's way).
    spec_exact: bool = True
    #: ``--draft-model``: a smaller GGUF of the same vocabulary whose greedy tokens are drafts
    #: (``spec_type`` "draft-simple", the default when one is given), with a context of its own
    #: (``engine/worker/draftmodel.py``). None: none.
    draft_model: str | None = None
    #: LoRA adapters loaded with the model (``AdapterError`` fails the load: one that does not
    #: fit the model's architecture or tensor shapes).
    lora: tuple[LoraSpec, ...] = ()

    @property
    def default_spec_type(self) -> SpecType:
        """The draft source of requests that do not choose one: ``spec_type`` where given
        ("none" included: a draft model is then only for requests that ask for it), else
        "draft-simple" with a draft model (found by review: a "none" given was taken for
        not given, and ``--spec-type none --draft-model X`` drafted every request)."""
        if self.spec_type is not None:
            return self.spec_type
        return "none" if self.draft_model is None else "draft-simple"

    @property
    def speculative(self) -> bool:
        """Whether requests of this model may speculate: it has a draft source, its own or
        a draft model that requests may choose."""
        return self.default_spec_type != "none" or self.draft_model is not None

    def speculates_with(self, gguf_pooling: PoolingType | None) -> bool:
        """``speculative`` for a model whose GGUF pools as given: a reranker (pooling rank,
        this config's or the GGUF's) never generates, so it never verifies a draft, and its
        ``auto`` KV cells need not be the exact type (``BackendModel.context_params``)."""
        pooling = self.pooling or gguf_pooling or self.context.pooling
        return self.speculative and pooling != "rank"

    def validate(self) -> None:
        check_field_types(self)
        self.context.validate()
        self.media.validate()
        self.model_params.validate()
        if not 1 <= self.n_parallel <= 64:
            raise ConfigError(f"n_parallel must be in [1, 64], got {self.n_parallel}")
        if self.n_parallel > self.context.n_batch:
            # Every generating slot puts one token in each tick's batch.
            raise ConfigError(
                f"n_parallel ({self.n_parallel}) must be <= n_batch ({self.context.n_batch})"
            )
        if self.max_queue < 1:
            raise ConfigError("max_queue must be >= 1")
        if self.deterministic and self.context.flash_attn == "off":
            # Measured (tests/engine/test_chunks_model.py): without flash attention, llama.cpp's
            # attention is not invariant to where a sequence's cells sit in the KV buffer, and
            # exact hits from restored rows differed from cold runs in the last bits.
            raise ConfigError(
                "deterministic mode needs flash attention: set flash_attn to 'auto' or 'on'"
            )
        parse_mode(self.fingerprint_mode)
        strategy(self.batch_strategy)
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ConfigError(
                f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}"
            )
        if self.rerank_max_documents < 1:
            raise ConfigError("rerank_max_documents must be >= 1")
        if self.spec_type is not None and self.spec_type not in SPEC_TYPES:
            raise ConfigError(
                f"spec_type must be one of {', '.join(SPEC_TYPES)}; got {self.spec_type!r}"
            )
        if self.spec_type == "draft-simple" and self.draft_model is None:
            raise ConfigError("spec_type 'draft-simple' needs a draft_model")
        if self.draft_model is not None and self.mmproj is not None:
            raise ConfigError("a draft_model cannot draft for a model with an mmproj")
        if self.speculative and self.context.flash_attn == "off":
            # Measured (docs/internals.md, "Speculative decoding"): without flash attention a
            # verify pass's rows differ from one-token passes' and greedy replies changed.
            raise ConfigError(
                "speculative decoding needs flash attention: set flash_attn to 'auto' or 'on'"
            )
        if not 1 <= self.spec_ngram_n <= 64:
            raise ConfigError(f"spec_ngram_n must be in [1, 64], got {self.spec_ngram_n}")
        if not 0 <= self.spec_draft_max <= MAX_DRAFT_TOKENS:
            raise ConfigError(
                f"spec_draft_max must be in [0, {MAX_DRAFT_TOKENS}], got {self.spec_draft_max}"
            )
        if self.policy is not None:
            validate_policy(self.policy)
        names = [spec.name for spec in self.lora if spec.name]
        if len(set(names)) != len(names):
            raise ConfigError(f"LoRA adapter names must differ: {', '.join(names)}")
        for spec in self.lora:
            if isinstance(spec.scale, bool) or not isinstance(spec.scale, int | float):
                raise ConfigError(f"LoRA adapter {spec.path}: scale must be a number")
            if not math.isfinite(spec.scale):
                raise ConfigError(f"LoRA adapter {spec.path}: scale must be finite")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    # The backend of a model whose ``ModelConfig.backend`` is None: a name, or an instance.
    backend: str | Backend = "llama_cpp"
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    def validate(self) -> None:
        """``ConfigError`` for a field of the wrong kind, before the cache is built. Found by
        review: a ``cache`` or ``policy`` of another type was an ``AttributeError`` from
        inside, and a backend that is no backend (``5``, ``"llama"``) was taken, every load
        then failing. The cache's own fields are the cache's check (``Cache``)."""
        for name, kind in (("cache", CacheConfig), ("policy", PolicyConfig)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ConfigError(
                    f"EngineConfig.{name} must be a {kind.__name__}, not {type(value).__name__}"
                )
        if isinstance(self.backend, str):
            from kvwarm.backends import BACKEND_NAMES

            if self.backend not in BACKEND_NAMES:
                raise ConfigError(
                    f"unknown backend {self.backend!r}; expected one of {', '.join(BACKEND_NAMES)}"
                )
        elif not isinstance(self.backend, Backend):
            raise ConfigError(
                f"EngineConfig.backend must be a string or Backend, got {self.backend!r}"
            )
        validate_policy(self.policy)


class ModelOptions(TypedDict, total=False):
    """Flat keywords for ``load_model``, the way ``llama_cpp.Llama`` and vLLM's ``LLM`` take
    them. Each replaces the field of the same name in ``ModelConfig``, its ``context``
    (``ContextParams``) or its ``model_params`` (``ModelParams``)."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_threads: int | None
    n_threads_batch: int | None
    type_k: KvType
    type_v: KvType
    flash_attn: FlashAttn
    rope_scaling: RopeScaling | None
    rope_freq_base: float
    rope_freq_scale: float
    yarn_ext_factor: float
    yarn_attn_factor: float
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_orig_ctx: int
    n_gpu_layers: int
    split_mode: SplitMode
    main_gpu: int
    tensor_split: tuple[float, ...]
    use_mmap: bool
    use_mlock: bool
    n_parallel: int
    deterministic: bool
    backend: str | Backend | None
    policy: PolicyConfig | None
    save_tier: TierName | None
    fingerprint_mode: str
    max_queue: int
    batch_strategy: StrategyName
    mmproj: str | None
    media: MediaLimits
    chat_template: str | None
    pooling: PoolingType | None
    rerank_max_documents: int
    rerank_truncate: bool
    spec_type: SpecType
    spec_ngram_n: int
    spec_draft_max: int
    spec_exact: bool
    draft_model: str | None
    lora: tuple[LoraSpec, ...]


def with_options(cfg: ModelConfig, options: ModelOptions) -> ModelConfig:
    """``cfg`` with the flat ``options`` applied (``ConfigError`` for an unknown name).

    ``n_batch`` given without ``n_ubatch`` also caps ``n_ubatch`` (llama.cpp's own rule), so
    ``n_batch=64`` alone is a valid configuration.
    """
    if not options:
        return cfg
    groups: dict[str, dict[str, object]] = {"context": {}, "model_params": {}, "": {}}
    for name, given in options.items():
        # A list, as llama_cpp.Llama takes it: the config's fields are (hashable) tuples.
        value = tuple(given) if isinstance(given, list) else given
        if name in _CONTEXT_FIELDS:
            groups["context"][name] = value
        elif name in _MODEL_FIELDS:
            groups["model_params"][name] = value
        elif name in _CONFIG_FIELDS:
            groups[""][name] = value
        else:
            raise ConfigError(f"unknown model option {name!r}")
    ctx = groups["context"]
    n_batch = ctx.get("n_batch")
    if isinstance(n_batch, int) and "n_ubatch" not in ctx:  # anything else: validate says
        ctx["n_ubatch"] = min(cfg.context.n_ubatch, n_batch)
    return replace(
        cfg,
        context=replace(cfg.context, **ctx),  # type: ignore[arg-type]
        model_params=replace(cfg.model_params, **groups["model_params"]),  # type: ignore[arg-type]
        **groups[""],  # type: ignore[arg-type]
    )


# ``pooling`` is the model's (``ModelConfig.pooling``): it decides what the model is; the
# context field of that name is how the model then runs each of its contexts.
_CONTEXT_FIELDS = frozenset(f.name for f in fields(ContextParams)) - {"pooling"}
_MODEL_FIELDS = frozenset(f.name for f in fields(ModelParams)) - {"progress"}
_CONFIG_FIELDS = frozenset(f.name for f in fields(ModelConfig)) - {"context", "model_params"}
