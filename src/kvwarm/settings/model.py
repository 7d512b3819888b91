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

from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, TypeAdapter, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvwarm.backends.base import ContextParams, ModelParams
from kvwarm.backends.chat_template import resolve_template
from kvwarm.errors import ConfigError
from kvwarm.settings.types import (
    Aliases,
    Bool,
    FlashAttnMode,
    Float,
    GpuLayers,
    Int,
    KvTypeName,
    OptInt,
    OptPath,
    OptRopeScaling,
    OptStr,
    SplitModeName,
    TensorSplit,
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
        default="f16",
        description="KV cache cell type of K: f16, q8_0, q4_0 ... (rows are kept apart per type)",
        json_schema_extra={"flag": "--cache-type-k", **_flags("-ctk", "--type-k")},
    )
    type_v: KvTypeName = Field(
        default="f16",
        description="KV cache cell type of V: f16, q8_0, q4_0 ... (quantised: needs flash_attn)",
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


def hardware_params(settings: Settings, spec: ModelSpec) -> tuple[ContextParams, ModelParams]:
    """The per-slot ``ContextParams`` and the ``ModelParams`` of ``spec`` under ``settings``."""
    n_parallel = spec.n_parallel or settings.n_parallel
    context = ContextParams(
        n_ctx=spec.n_ctx or settings.n_ctx,
        n_batch=settings.n_batch,
        n_ubatch=min(settings.n_batch, 512),
        n_seq_max=n_parallel,
        **{name: _value(settings, spec, name) for name in _CONTEXT_SETTINGS},
    )
    params = ModelParams(**{name: _value(settings, spec, name) for name in _MODEL_PARAMS})
    return context, params


def check_models(settings: Settings) -> None:
    """The model list (ids, aliases, the cap) and every configured model's parameters,
    validated as the backends will (``ConfigError``)."""
    if not settings.models and settings.models_dir is None:
        raise ConfigError("at least one model (or a models_dir) is required")
    ids = [m.model_id for m in settings.models]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"duplicate model ids: {', '.join(dupes)} (give each an id)")
    shadowing = sorted(alias for alias, _ in settings.aliases if alias in ids)
    if shadowing:
        raise ConfigError(f"aliases {', '.join(shadowing)} are already model ids")
    if settings.model_idle_unload_s < 0 or settings.max_loaded_models < 0:
        raise ConfigError("model_idle_unload_s and max_loaded_models must be >= 0")
    for spec in settings.models:
        try:
            cfg = model_config(settings, spec)
            cfg.validate()  # its context and model params included
            backend = spec.backend or settings.backend
            if cfg.mmproj is not None and backend != "stub" and not Path(cfg.mmproj).is_file():
                raise ConfigError(f"mmproj: no projector file at {cfg.mmproj}")
            template = _value(settings, spec, "chat_template")
            if template is not None:
                resolve_template(template)
        except ConfigError as exc:
            raise ConfigError(f"model {spec.model_id}: {exc}") from exc


def model_config(settings: Settings, spec: ModelSpec) -> ModelConfig:
    """The engine's per-model config for ``spec`` under these settings."""
    from kvwarm.engine.api import ModelConfig

    context, params = hardware_params(settings, spec)
    mmproj = _value(settings, spec, "mmproj")
    return ModelConfig(
        backend=spec.backend,
        context=context,
        model_params=params,
        n_parallel=context.n_seq_max,
        policy=settings.policy,
        save_tier=settings.effective_save_tier(),
        fingerprint_mode=settings.fingerprint_mode,
        deterministic=settings.deterministic,
        max_queue=settings.max_queue,
        chat_template=_value(settings, spec, "chat_template"),
        mmproj=None if mmproj is None else str(mmproj),
        media=settings.media_limits(),
    )
