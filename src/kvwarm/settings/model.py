"""Model settings: how each model is placed and run (GPU offload, flash attention, KV cell
types, threads, mmap/mlock, RoPE/YaRN), which models a server offers besides the configured ones
(a models directory, aliases) and how many stay loaded, and the mapping of settings to the
engine's ``ModelConfig``.

Invariant: each of these settings is declared once, as a field of ``ModelSettings`` (which
``kvwarm.settings.Settings`` extends, so it gets a flag, an env var and a TOML key like every
other setting), and may also be given per model, as a key of a ``[[models]]`` table. A model's
value is its own if given, else the global one. Names and defaults follow llama-server's
(``--n-gpu-layers``/``-ngl``, ``--flash-attn``/``-fa``, ``--cache-type-k``/``-ctk`` ...). Bad
values are ``ConfigError``s raised while settings load, before any native call
(``ModelParams.validate``, ``ContextParams.validate``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, TypeAdapter, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvwarm.backends.base import ContextParams, ModelParams
from kvwarm.backends.chat_template import resolve_template
from kvwarm.errors import ConfigError
from kvwarm.models_dir import is_utf8
from kvwarm.settings.types import (
    Aliases,
    Bool,
    FlashAttnMode,
    Float,
    GpuLayers,
    Int,
    KvTypeName,
    Loras,
    OptInt,
    OptPath,
    OptPooling,
    OptRopeScaling,
    OptSpecType,
    OptStr,
    SplitModeName,
    TensorSplit,
    path_kind,
)

if TYPE_CHECKING:
    from kvwarm.engine.api import ModelConfig
    from kvwarm.settings import Settings
    from kvwarm.settings.types import ModelSpec

ENV_PREFIX = "KVWARM_"


def _flags(*names: str) -> dict[str, Any]:
    return {"aliases": list(names)}


_REPEAT: dict[str, Any] = {"repeatable": True}


class ModelSettings(BaseSettings):
    """The per-model settings; ``Settings`` extends this class."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="forbid", validate_default=False
    )

    n_gpu_layers: GpuLayers = Field(
        default=0,
        description="layers to offload to the GPU: a number, or 'all' (0: CPU only)",
        json_schema_extra=_flags("-ngl", "--gpu-layers"),
    )
    split_mode: SplitModeName = Field(
        default="layer",
        description="how to use several GPUs: none (main GPU only), layer or row",
        json_schema_extra=_flags("-sm"),
    )
    main_gpu: Int = Field(
        default=0,
        description="the GPU for the whole model with split_mode none (intermediate results "
        "with row)",
        json_schema_extra=_flags("-mg"),
    )
    tensor_split: TensorSplit = Field(
        default=(),
        description="each GPU's share of the model, e.g. 3,1 (default: by free memory)",
        json_schema_extra=_flags("-ts"),
    )
    flash_attn: FlashAttnMode = Field(
        default="auto",
        description=(
            "flash attention: auto (off on the CPU alone, llama.cpp's choice with GPU layers), "
            "on or off (a quantised V cache needs it)"
        ),
        json_schema_extra=_flags("-fa"),
    )
    type_k: KvTypeName = Field(
        default="auto",
        description="KV cache cell type of K: auto, f16, q8_0, q4_0 ... (rows are kept apart per "
        "type); auto: f16, or q8_0 in a model that speculates on the CPU (f16 K and V there "
        "would make greedy speculative replies differ from plain decoding's past 256 cells)",
        json_schema_extra={"flag": "--cache-type-k", **_flags("-ctk", "--type-k")},
    )
    type_v: KvTypeName = Field(
        default="auto",
        description="KV cache cell type of V: auto, f16, q8_0, q4_0 ... (quantised: needs "
        "flash_attn); auto: f16, or q8_0 beside a K set to f16 in a model that speculates on "
        "the CPU",
        json_schema_extra={"flag": "--cache-type-v", **_flags("-ctv", "--type-v")},
    )
    chat_template: OptStr = Field(
        default=None,
        description="chat template: a built-in name (chatml, gemma, llama3, mistral) or a Jinja "
        "file; default the GGUF's own, else chatml (with a warning)",
    )
    mmproj: OptPath = Field(
        default=None,
        description="multimodal projector GGUF (llama-server's --mmproj): the model then reads "
        "images (and audio) in chat messages; a models_dir pairs mmproj-NAME.gguf with NAME.gguf",
    )
    swa_full: Bool = Field(
        default=False,
        description="keep sliding-window layers' KV at full size (llama.cpp --swa-full): their "
        "cached states then restore at any prefix, at the memory cost of full attention",
    )
    n_threads: OptInt = Field(
        default=None,
        description="CPU threads for generation (default: every CPU this process may use)",
        json_schema_extra=_flags("-t"),
    )
    n_threads_batch: OptInt = Field(
        default=None,
        description="CPU threads for prompt processing (default: n_threads)",
        json_schema_extra=_flags("-tb"),
    )
    use_mmap: Bool = Field(
        default=True, description="memory-map the model file (false: read it into memory)"
    )
    use_mlock: Bool = Field(
        default=False, description="lock the model in RAM so the OS cannot swap it out"
    )
    rope_scaling: OptRopeScaling = Field(
        default=None,
        description="RoPE scaling: none, linear, yarn or longrope (default: the model's)",
    )
    rope_freq_base: Float = Field(default=0.0, description="RoPE base frequency (0: the model's)")
    rope_freq_scale: Float = Field(
        default=0.0,
        description="RoPE frequency scale; context is extended by 1/scale (0: the model's)",
    )
    yarn_ext_factor: Float = Field(
        default=-1.0, description="YaRN extrapolation mix factor (negative: the model's)"
    )
    yarn_attn_factor: Float = Field(
        default=-1.0, description="YaRN attention magnitude factor (negative: the model's)"
    )
    yarn_beta_fast: Float = Field(
        default=-1.0, description="YaRN low correction dimension (negative: the model's)"
    )
    yarn_beta_slow: Float = Field(
        default=-1.0, description="YaRN high correction dimension (negative: the model's)"
    )
    yarn_orig_ctx: Int = Field(
        default=0, description="YaRN original training context size (0: the model's)"
    )
    pooling: OptPooling = Field(
        default=None,
        description="how the model pools: none, mean, cls, last or rank (a reranker, which then "
        "only ranks: /v1/rerank); default the GGUF's, else mean",
    )
    rerank_max_documents: Int = Field(
        default=1000, description="the most documents one rerank may score (more: a 400)"
    )
    rerank_truncate: Bool = Field(
        default=False,
        description="cut a rerank document whose prompt does not fit n_ctx to fit (default: "
        "refuse the rerank with a 400)",
    )
    spec_type: OptSpecType = Field(
        default=None,
        description="speculative decoding from n-grams of each request's own prompt and reply "
        "(ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache) or from the draft "
        "model (draft-simple), "
        "llama-server's names, or none; greedy replies are plain decoding's (its K cells are "
        "then q8_0 unless type_k/type_v say, see spec_exact); off in deterministic mode; a "
        "request may choose its own (spec_type)",
    )
    draft_model: OptPath = Field(
        default=None,
        description="draft model GGUF for speculative decoding (llama-server's --model-draft): "
        "the model's vocabulary as llama-server accepts it (checked at load: up to 128 tokens "
        "more or fewer), full attention or a sliding window (its draft context then has a "
        "full-size SWA cache), its greedy tokens are drafts, its prompt KV cached like the "
        "model's; spec_type becomes draft-simple unless set (set "
        "to none, only requests that ask for draft-simple use it)",
        json_schema_extra=_flags("-md", "--model-draft"),
    )
    spec_ngram_n: Int = Field(
        default=4,
        description="speculative decoding: how many tokens an n-gram lookup matches",
    )
    spec_draft_max: Int = Field(
        default=48,
        description="speculative decoding: the most tokens one draft holds (at most 62; "
        "each draft is sized to the acceptance seen and what a pass costs)",
        json_schema_extra=_flags("--spec-draft-n-max"),
    )
    spec_exact: Bool = Field(
        default=True,
        description="speculate only where a greedy reply stays bit for bit plain decoding's "
        "(/v1/models' meta.speculative.exact: 'at any length'); false: also where a verify "
        "pass's rows may differ from one-token passes in their last bits (llama-server's way: "
        "f16 KV past 256 cells on the CPU, a GPU), and several slots' drafts share one pass",
    )
    max_queue: Int = Field(
        default=256,
        description="queued requests per model before 429 (in a [[models]] table: that "
        "model's; under kvwarm cluster it sizes the ingress's bound too)",
    )
    # Ollama's and LM Studio's users pin the model they work with: it stays loaded.
    pinned: Bool = Field(
        default=False,
        description="never unload the model when idle, by a request's keep_alive, or to make "
        "room (max_loaded_models, memory_budget); in a [[models]] table: that model alone",
        json_schema_extra={"switch": True},
    )
    # vLLM's --lora-modules: each adapter is also a model name of its own; llama-server's
    # /lora-adapters and per-request "lora" list them by position (server/lora.py).
    lora: Loras = Field(
        default=(),
        description="a LoRA adapter of the first model, served under its own model name, "
        "NAME=PATH (repeatable; in a [[models]] table: that model's adapters)",
        json_schema_extra={"flag": "--lora", **_REPEAT},
    )


class ServingSettings(BaseSettings):
    """Which models a server offers besides the configured ones, and how many stay loaded;
    ``Settings`` extends this class too."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="forbid", validate_default=False
    )

    models_dir: OptPath = Field(
        default=None,
        description="also serve every *.gguf file in DIR, each loaded on its first request",
    )
    # Tools that hard-code a model name (gpt-4o-mini ...) then work unchanged.
    aliases: Aliases = Field(
        default=(),
        description="another name for a model, ALIAS=MODEL (repeatable), "
        "e.g. gpt-4o-mini=smollm2-135m-instruct",
        json_schema_extra={"flag": "--alias", **_REPEAT},
    )
    model_idle_unload_s: Float = Field(
        default=0.0,
        description="unload a model unused this many seconds; its next request reloads it "
        "(0: never)",
    )
    max_loaded_models: Int = Field(
        default=0,
        description="most models loaded at once; one more unloads the least recently used idle "
        "one (0: no limit)",
    )


#: The settings a ``[[models]]`` table may override.
MODEL_SETTING_NAMES: tuple[str, ...] = tuple(ModelSettings.model_fields)
_CONTEXT_SETTINGS = (
    "type_k", "type_v", "flash_attn", "swa_full", "n_threads", "n_threads_batch", "rope_scaling",
    "rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor",
    "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx",
)  # fmt: skip
_MODEL_PARAMS = (
    "n_gpu_layers", "split_mode", "main_gpu", "tensor_split", "use_mmap", "use_mlock",
)  # fmt: skip


@cache
def _adapter(cls: type[BaseSettings], name: str) -> TypeAdapter[Any]:
    return TypeAdapter(cls.model_fields[name].rebuild_annotation())


def parse_field(cls: type[BaseSettings], name: str, value: object, label: str) -> object:
    """``value`` parsed as the setting ``name`` of ``cls``; ``ConfigError`` naming ``label``."""
    try:
        return _adapter(cls, name).validate_python(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        error = first.get("ctx", {}).get("error")
        message = str(error) if isinstance(error, Exception) else first["msg"]
        raise ConfigError(f"{label}: {message}") from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{label}: {exc}") from exc


def model_options(values: Mapping[str, object], model: str) -> tuple[tuple[str, object], ...]:
    """The per-model settings of a ``[[models]]`` table, parsed; unknown keys are an error."""
    unknown = sorted(set(values) - set(MODEL_SETTING_NAMES))
    if unknown:
        raise ConfigError(
            f"model {model}: unknown keys {', '.join(unknown)} (a model takes path, id, "
            f"backend, n_ctx, n_parallel and {', '.join(MODEL_SETTING_NAMES)})"
        )
    return tuple(
        (name, parse_field(ModelSettings, name, values[name], f"model {model}: {name}"))
        for name in sorted(values)
    )


def _value(settings: ModelSettings, spec: ModelSpec, name: str) -> Any:
    return dict(spec.options).get(name, getattr(settings, name))


def max_queue(settings: Settings, spec: ModelSpec | None) -> int:
    """``spec``'s ``max_queue``: its ``[[models]]`` table's, else the global one (``spec``
    None: a model the settings do not name)."""
    return int(settings.max_queue if spec is None else _value(settings, spec, "max_queue"))


def is_pinned(settings: Settings, spec: ModelSpec) -> bool:
    """``spec``'s ``pinned``: its ``[[models]]`` table's, else the global one."""
    return bool(_value(settings, spec, "pinned"))


def model_slots(settings: Settings, spec: ModelSpec) -> int:
    """``spec``'s ``n_parallel``: its ``[[models]]`` table's, else the global one."""
    return settings.n_parallel if spec.n_parallel is None else spec.n_parallel


def hardware_params(settings: Settings, spec: ModelSpec) -> tuple[ContextParams, ModelParams]:
    """The per-slot ``ContextParams`` and the ``ModelParams`` of ``spec`` under ``settings``."""
    n_parallel = model_slots(settings, spec)
    context = ContextParams(
        n_ctx=settings.n_ctx if spec.n_ctx is None else spec.n_ctx,
        n_batch=settings.n_batch,
        n_ubatch=min(settings.n_batch, 512),
        n_seq_max=n_parallel,
        **{name: _value(settings, spec, name) for name in _CONTEXT_SETTINGS},
    )
    params = ModelParams(**{name: _value(settings, spec, name) for name in _MODEL_PARAMS})
    return context, params


def model_lora(settings: Settings, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """``spec``'s LoRA adapters (name, path): its ``[[models]]`` table's ``lora``, else, for
    the first configured model alone, the global ``lora`` (an adapter fits one model, so it is
    never every model's)."""
    own = dict(spec.options)
    if "lora" in own:
        return tuple(own["lora"])  # type: ignore[arg-type]
    first = settings.models[0] if settings.models else None
    return tuple(settings.lora) if spec == first else ()


#: GGUF metadata a LoRA adapter is checked by before any model loads.
_ADAPTER_KEYS = ("general.type", "adapter.type", "general.architecture")


def check_lora(settings: Settings) -> None:
    """Every configured LoRA adapter: a unique name that no model or alias has, and, for a
    backend that reads files, a GGUF LoRA adapter made for its model's architecture
    (``ConfigError`` before anything loads; tensor shapes are llama.cpp's to check when the
    model loads, which then fails with its reason)."""
    if settings.lora and not settings.models:
        raise ConfigError("lora names adapters of the first configured model; there is none")
    taken = {m.model_id for m in settings.models} | {alias for alias, _ in settings.aliases}
    seen: dict[str, str] = {}
    for spec in settings.models:
        for name, path in model_lora(settings, spec):
            if name in taken:
                raise ConfigError(f"LoRA adapter {name!r} has the name of a model or alias")
            if name in seen:
                raise ConfigError(
                    f"LoRA adapter {name!r} is given twice (models {seen[name]} and "
                    f"{spec.model_id}): each adapter's name is a model name of its own"
                )
            seen[name] = spec.model_id
            if (spec.backend or settings.backend) != "stub":
                _check_adapter_file(name, path, spec)


def _check_adapter_file(name: str, path: str, spec: ModelSpec) -> None:
    from kvwarm.embedded import default_model_path
    from kvwarm.gguf_meta import metadata_of

    label = f"LoRA adapter {name} ({path})"
    file = Path(os.path.expanduser(path))
    if path_kind(file, label) != "file":
        raise ConfigError(f"{label}: no such file")
    try:
        meta = metadata_of(file, _ADAPTER_KEYS)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{label}: not a readable GGUF file ({exc})") from exc
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ConfigError(f"{label}: not a LoRA adapter (a GGUF with adapter.type = lora)")
    base = Path(os.path.expanduser(spec.path)) if spec.path else default_model_path()
    try:
        base_arch = metadata_of(base, ("general.architecture",)).get("general.architecture")
    except (OSError, ValueError):
        return  # the model's own load says what is wrong with it
    arch = meta.get("general.architecture")
    if base_arch is not None and arch != base_arch:
        raise ConfigError(
            f"{label} is for the {arch!r} architecture; model {spec.model_id} is "
            f"{base_arch!r}: it does not fit"
        )


def check_models(settings: Settings) -> None:
    """The model list (ids, aliases, the cap) and every configured model's parameters,
    validated as the backends will (``ConfigError``)."""
    if not settings.models and settings.models_dir is None:
        raise ConfigError("at least one model (or a models_dir) is required")
    models_dir = settings.models_dir
    kind = None if models_dir is None else path_kind(models_dir, "models_dir")
    if kind is not None and kind != "dir":
        # Found by review: the server started, logged one warning and served no model.
        what = "does not exist" if kind == "missing" else "is not a directory"
        raise ConfigError(f"models_dir {models_dir} {what}")
    ids = [m.model_id for m in settings.models]
    names = [
        *(("model id", i) for i in ids),
        *(("alias", alias) for alias, _ in settings.aliases),
        *(("LoRA adapter", a) for spec in settings.models for a, _ in model_lora(settings, spec)),
    ]
    for what, name in names:
        if not is_utf8(name):
            # Found by review: a file named in Latin-1 gave an id holding a lone surrogate
            # (os.fsdecode's), which no JSON response encodes: /health answered 500.
            raise ConfigError(
                f"{what} {name!r} is not UTF-8 text, which no request can name; give it a "
                "name that is (ID=PATH for a model)"
            )
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"duplicate model ids: {', '.join(dupes)} (give each an id)")
    shadowing = sorted(alias for alias, _ in settings.aliases if alias in ids)
    if shadowing:
        raise ConfigError(f"aliases {', '.join(shadowing)} are already model ids")
    if settings.model_idle_unload_s < 0 or settings.max_loaded_models < 0:
        raise ConfigError("model_idle_unload_s and max_loaded_models must be >= 0")
    check_lora(settings)
    from kvwarm.backends import BACKEND_NAMES

    for spec in settings.models:
        backend = spec.backend or settings.backend
        if backend not in BACKEND_NAMES:
            # Found by review: the server started and then could load no model (exit 1).
            which = f"model {spec.model_id}: backend" if spec.backend else "backend"
            raise ConfigError(f"{which} {backend!r} is not one of {', '.join(BACKEND_NAMES)}")
    for spec in settings.models:
        for name in ("n_ctx", "n_parallel"):
            # Found by review: ``n_ctx = 0`` in a [[models]] table read as "not given" and the
            # model silently ran with the global value.
            own = getattr(spec, name)
            if own is not None and own < 1:
                raise ConfigError(f"model {spec.model_id}: {name} must be >= 1, got {own}")
        try:
            cfg = model_config(settings, spec)
            cfg.validate()  # its context and model params included
            backend = spec.backend or settings.backend
            mmproj = cfg.mmproj
            if (
                mmproj is not None
                and backend != "stub"
                and path_kind(Path(mmproj), "mmproj") != "file"
            ):
                raise ConfigError(f"mmproj: no projector file at {cfg.mmproj}")
            draft = cfg.draft_model
            if (
                draft is not None
                and backend != "stub"
                and path_kind(Path(draft), "draft_model") != "file"
            ):
                raise ConfigError(f"draft_model: no GGUF at {draft}")
            template = _value(settings, spec, "chat_template")
            if template is not None:
                resolve_template(template)
        except ConfigError as exc:
            raise ConfigError(f"model {spec.model_id}: {exc}") from exc


def model_config(settings: Settings, spec: ModelSpec) -> ModelConfig:
    """The engine's per-model config for ``spec`` under these settings."""
    from kvwarm.engine.api import LoraSpec, ModelConfig

    context, params = hardware_params(settings, spec)
    mmproj = _value(settings, spec, "mmproj")
    draft = _value(settings, spec, "draft_model")
    return ModelConfig(
        backend=spec.backend,
        context=context,
        model_params=params,
        n_parallel=context.n_seq_max,
        policy=settings.policy,
        save_tier=settings.effective_save_tier(),
        fingerprint_mode=settings.fingerprint_mode,
        deterministic=settings.deterministic,
        max_queue=_value(settings, spec, "max_queue"),
        chat_template=_value(settings, spec, "chat_template"),
        pooling=_value(settings, spec, "pooling"),
        rerank_max_documents=_value(settings, spec, "rerank_max_documents"),
        rerank_truncate=_value(settings, spec, "rerank_truncate"),
        spec_type=_value(settings, spec, "spec_type"),
        spec_ngram_n=_value(settings, spec, "spec_ngram_n"),
        spec_draft_max=_value(settings, spec, "spec_draft_max"),
        spec_exact=_value(settings, spec, "spec_exact"),
        draft_model=None if draft is None else str(Path(os.path.expanduser(draft))),
        # Loaded off (scale 0): the model serves itself; a request names an adapter to use it.
        lora=tuple(
            LoraSpec(str(Path(os.path.expanduser(path))), name)
            for name, path in model_lora(settings, spec)
        ),
        mmproj=None if mmproj is None else str(mmproj),
        media=settings.media_limits(),
    )
