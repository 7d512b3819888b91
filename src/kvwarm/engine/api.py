"""The public Python API: an ``Engine`` owns one cache and many ``Model``s.

Five lines::

    import kvwarm
    model = kvwarm.load_model()          # the embedded default model
    print(model.complete("Once upon a time").text)

Invariants: a model id is loaded at most once per engine; unloading a model never touches the
cache's rows (a reload finds them again); every public call either returns or raises a
``KvwarmError`` subclass.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvwarm.backends import get_backend
from kvwarm.backends.base import (
    Adapter,
    Backend,
    BackendContext,
    BackendModel,
    ContextParams,
    ModelParams,
    json_schema_to_grammar,
)
from kvwarm.cache import Cache
from kvwarm.cache.key import effective_fingerprint
from kvwarm.cache.types import (
    CacheConfig,
    Namespace,
    PolicyConfig,
    SaveReason,
    TierName,
    TtlClass,
)
from kvwarm.embedded import EMBEDDED_MODEL_ID, default_model_path, embedded_model_path
from kvwarm.engine.batching import StrategyName, strategy
from kvwarm.engine.fingerprint import fingerprint, parse_mode
from kvwarm.engine.request import Request, RequestKind
from kvwarm.engine.stream import CompletionStream
from kvwarm.engine.types import (
    AdapterInfo,
    Completion,
    CompletionStats,
    GenerationOptions,
    ModelInfo,
    ModelStatus,
)
from kvwarm.engine.worker import Worker, WorkerConfig
from kvwarm.errors import (
    AdapterError,
    ConfigError,
    ContextOverflowError,
    EngineClosedError,
    InvalidRequestError,
    ModelExistsError,
    ModelNotFoundError,
    UnknownModelError,
)

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
Message = Mapping[str, object]


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
    max_queue: int = 256
    batch_strategy: StrategyName = "decode_first"

    def validate(self) -> None:
        self.context.validate()
        if not 1 <= self.n_parallel <= 64:
            raise ConfigError(f"n_parallel must be in [1, 64], got {self.n_parallel}")
        if self.n_parallel > self.context.n_batch:
            # Every generating slot puts one token in each tick's batch.
            raise ConfigError(
                f"n_parallel ({self.n_parallel}) must be <= n_batch ({self.context.n_batch})"
            )
        if self.max_queue < 1:
            raise ConfigError("max_queue must be >= 1")
        parse_mode(self.fingerprint_mode)
        strategy(self.batch_strategy)
        if self.policy is not None:
            _validate_policy(self.policy)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    backend: str = "llama_cpp"
    policy: PolicyConfig = field(default_factory=PolicyConfig)


def _validate_policy(p: PolicyConfig) -> None:
    from kvwarm.cache.policy import validate_policy

    validate_policy(p)


class Engine:
    """Owns one cache (tiers configured once) and any number of loaded models."""

    def __init__(self, config: EngineConfig | None = None, *, cache: Cache | None = None) -> None:
        """``cache``: use this (already built) cache instead of one from ``config.cache``;
        the caller keeps ownership and closes it."""
        self.config = config or EngineConfig()
        _validate_policy(self.config.policy)
        self._owns_cache = cache is None
        self.cache = cache if cache is not None else Cache(self.config.cache)
        self._models: dict[str, Model] = {}
        self._lock = threading.Lock()
        self._closed = False

    def load_model(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        model_id: str | None = None,
        config: ModelConfig | None = None,
        progress: Callable[[float], bool] | None = None,
    ) -> Model:
        """Load a GGUF (default: ``$KVWARM_MODEL`` or the embedded model) under ``model_id``."""
        cfg = config or ModelConfig()
        cfg.validate()
        if self._closed:
            raise EngineClosedError("engine is closed")
        backend = cfg.backend or self.config.backend
        backend_name = backend if isinstance(backend, str) else backend.name
        if path is None:
            resolved = default_model_path() if backend_name != "stub" else Path("stub.gguf")
        else:
            resolved = Path(path).expanduser()
        if backend_name != "stub" and not resolved.is_file():
            raise ModelNotFoundError(f"model file not found: {resolved}")
        mid = model_id or _auto_id(resolved)
        if not mid or ("/" in mid and len(mid) > 200):
            raise ConfigError(f"invalid model id {mid!r}")
        tiers = set(self.cache.tier_names())
        save_tier = cfg.save_tier or self.cache.tier_names()[0]
        if save_tier not in tiers:
            raise ConfigError(
                f"save_tier {save_tier!r} is not a configured cache tier ({sorted(tiers)})"
            )
        with self._lock:
            if mid in self._models:
                raise ModelExistsError(f"a model with id {mid!r} is already loaded")
            self._models[mid] = _LOADING  # reserve the id while loading outside the lock
        try:
            model = Model(
                self,
                mid,
                resolved,
                backend,
                cfg,
                save_tier,
                cfg.policy or self.config.policy,
                progress,
            )
        except BaseException:
            with self._lock:
                self._models.pop(mid, None)
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                self._models[mid] = model
        if closed:  # the engine closed while this model loaded: do not leak it
            model.unload()
            raise EngineClosedError("engine was closed while the model loaded")
        return model

    def get_model(self, model_id: str) -> Model:
        model = self._models.get(model_id)
        if model is None or model is _LOADING:
            raise UnknownModelError(f"no loaded model with id {model_id!r}")
        return model

    def list_models(self) -> list[ModelInfo]:
        return [m.info() for m in list(self._models.values()) if m is not _LOADING]

    def unload_model(self, model_id: str) -> None:
        model = self.get_model(model_id)
        model.unload()

    def _forget(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)

    def status(self) -> dict[str, object]:
        return {
            "models": [m.status() for m in list(self._models.values()) if m is not _LOADING],
            "cache": dict(self.cache.counters()),
        }

    def close(self, timeout_s: float = 30.0) -> None:
        """Unload every model (bounded shutdown saves), then drain and close the cache."""
        if self._closed:
            return
        self._closed = True
        for model in [m for m in list(self._models.values()) if m is not _LOADING]:
            try:
                model.unload(timeout_s=timeout_s)
            except Exception:
                log.exception("error unloading %s", model.id)
        if self._owns_cache:
            self.cache.close(timeout_s)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _auto_id(path: Path) -> str:
    embedded = embedded_model_path()
    if embedded is not None and path.resolve() == embedded.resolve():
        return EMBEDDED_MODEL_ID
    name = path.name
    return name[:-5] if name.lower().endswith(".gguf") else name


class Model:
    """A loaded model: its worker thread, its slots, its adapters."""

    def __init__(
        self,
        engine: Engine,
        model_id: str,
        path: Path,
        backend_spec: str | Backend,
        cfg: ModelConfig,
        save_tier: TierName,
        policy: PolicyConfig,
        progress: Callable[[float], bool] | None,
    ) -> None:
        self._engine = engine
        self.id = model_id
        self.path = path
        self.config = cfg
        self.policy = policy
        self.save_tier: TierName = save_tier
        self._adapters: dict[int, tuple[Adapter, float]] = {}
        self._next_adapter = 1
        self._adapter_lock = threading.Lock()
        self._state = "loading"
        self._embed_ctx: BackendContext | None = None
        mode = parse_mode(cfg.fingerprint_mode)
        self.fingerprint_mode = mode
        self.backend = get_backend(backend_spec) if isinstance(backend_spec, str) else backend_spec
        if self.backend.name == "stub" and not path.is_file():
            import hashlib

            self._fingerprint = hashlib.sha256(b"stub:" + str(path).encode()).digest()
        else:
            self._fingerprint = fingerprint(path, mode, cfg.fingerprint)
        params = cfg.model_params
        if progress is not None:
            params = replace(params, progress=progress)
        self._bmodel: BackendModel = self.backend.load_model(str(path), params)
        try:
            facts = self._bmodel.facts
            self.facts = facts
            total = replace(
                cfg.context, n_ctx=cfg.context.n_ctx * cfg.n_parallel, n_seq_max=cfg.n_parallel
            )
            self._ctx = self._bmodel.new_context(total)
            self._ctx_hash = cfg.context.kv_hash()
            self._namespace = Namespace(self._fingerprint, facts.file_type & 0xFF, self._ctx_hash)
            self._worker = Worker(
                model_id,
                self._bmodel,
                self._ctx,
                engine.cache,
                WorkerConfig(
                    n_parallel=cfg.n_parallel,
                    n_ctx_slot=cfg.context.n_ctx,
                    n_batch=cfg.context.n_batch,
                    n_ubatch=cfg.context.n_ubatch,
                    policy=policy,
                    save_tier=save_tier,
                    quant_bits=facts.quant_bits,
                    fingerprint_mode=mode,
                    max_queue=cfg.max_queue,
                    strategy=strategy(cfg.batch_strategy),
                ),
                self.namespace,
            )
        except BaseException:
            self._bmodel.close()
            raise
        self._state = "ready"

    # ---- identity -----------------------------------------------------------------------

    def namespace(self) -> Namespace:
        """The current cache namespace: model fingerprint folded with attached adapters."""
        return self._namespace

    def _refresh_namespace(self) -> None:
        adapters = [(a.sha256, scale) for a, scale in self._adapters.values()]
        fp = effective_fingerprint(self._fingerprint, adapters)
        self._namespace = Namespace(fp, self._namespace.quant, self._ctx_hash)

    def info(self) -> ModelInfo:
        f = self.facts
        return ModelInfo(
            id=self.id,
            path=str(self.path),
            backend=self.backend.name,
            n_ctx=self.config.context.n_ctx,
            n_batch=self.config.context.n_batch,
            n_parallel=self.config.n_parallel,
            n_vocab=f.n_vocab,
            n_ctx_train=f.n_ctx_train,
            n_embd=f.n_embd,
            size_bytes=f.size_bytes,
            description=f.description,
            fingerprint=self._namespace.fingerprint.hex(),
            fingerprint_mode=self.fingerprint_mode.name.lower(),
            save_tier=self.save_tier,
            chat_template=f.chat_template is not None,
            adapters=tuple(self.list_adapters()),
            metadata=dict(f.metadata),
        )

    def status(self) -> ModelStatus:
        s = self._worker.stats
        state = self._state
        return ModelStatus(
            id=self.id,
            state=state,  # type: ignore[arg-type]
            queued=self._worker.queued,
            active=self._worker.active,
            n_parallel=self.config.n_parallel,
            requests=s.requests,
            prompt_tokens=s.prompt_tokens,
            cached_tokens=s.cached_tokens,
            completion_tokens=s.completion_tokens,
            prefill_ms=s.prefill_ms,
            generation_ms=s.generation_ms,
        )

    # ---- text ---------------------------------------------------------------------------

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        self._check_ready()
        return self._bmodel.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._check_ready()
        return self._bmodel.detokenize(tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return self._bmodel.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )

    # ---- generation ---------------------------------------------------------------------

    def complete(
        self, prompt: Prompt, options: GenerationOptions | None = None, **overrides: object
    ) -> Completion:
        return self.submit(prompt, options, **overrides).result()

    def stream(
        self, prompt: Prompt, options: GenerationOptions | None = None, **overrides: object
    ) -> CompletionStream:
        """Start a request whose stream yields text fragments as they are generated."""
        opts = _options(options, overrides)
        tokens, text = self._prompt_tokens(prompt, opts)
        return self._submit(tokens, opts, text)

    def submit(
        self, prompt: Prompt, options: GenerationOptions | None = None, **overrides: object
    ) -> CompletionStream:
        """Start a request that sends no per-token events: its stream yields nothing and ends
        with the completion. For callers that only want the result; it spares the waiting
        thread one wake-up per token."""
        opts = _options(options, overrides)
        tokens, text = self._prompt_tokens(prompt, opts)
        return self._submit(tokens, opts, text, fragments=False)

    def chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
        **overrides: object,
    ) -> Completion:
        opts = _options(options, overrides)
        tokens, text = self._chat_tokens(messages, tools)
        return self._submit(tokens, opts, text, fragments=False).result()

    def stream_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
        **overrides: object,
    ) -> CompletionStream:
        opts = _options(options, overrides)
        tokens, text = self._chat_tokens(messages, tools)
        return self._submit(tokens, opts, text)

    def _prompt_tokens(
        self, prompt: Prompt, opts: GenerationOptions
    ) -> tuple[tuple[int, ...], str]:
        self._check_ready()
        if isinstance(prompt, str):
            tokens = self._bmodel.tokenize(
                prompt, add_special=opts.add_special, parse_special=opts.parse_special
            )
            return tuple(tokens), prompt
        return tuple(self._check_tokens(prompt)), ""

    def _chat_tokens(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, object]] | None
    ) -> tuple[tuple[int, ...], str]:
        self._check_ready()
        prompt = self.apply_chat_template(messages, tools=tools)
        # The template already carries any BOS/special tokens as text.
        return tuple(self._bmodel.tokenize(prompt, add_special=False, parse_special=True)), prompt

    def prewarm(
        self, prompt: Prompt, *, ttl_class: TtlClass = TtlClass.LONG, add_special: bool = True
    ) -> CompletionStats:
        """Prefill ``prompt`` and save it (with its final logits), generating nothing."""
        self._check_ready()
        opts = GenerationOptions(max_tokens=0, temperature=0.0, add_special=add_special)
        if isinstance(prompt, str):
            tokens = self._bmodel.tokenize(prompt, add_special=add_special, parse_special=True)
            text = prompt
        else:
            tokens, text = self._check_tokens(prompt), ""
        stream = self._submit(
            tuple(tokens), opts, text, kind="prewarm", ttl=ttl_class, fragments=False
        )
        return stream.result().stats

    def _check_ready(self) -> None:
        if self._state != "ready":
            raise EngineClosedError(f"model {self.id!r} is {self._state}")

    def _check_tokens(self, tokens: Sequence[int]) -> list[int]:
        n_vocab = self.facts.n_vocab
        out = []
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
                raise InvalidRequestError(
                    f"token {t!r} is not a valid id for this vocabulary (0..{n_vocab - 1})",
                    param="prompt",
                )
            out.append(t)
        return out

    def _submit(
        self,
        tokens: tuple[int, ...],
        opts: GenerationOptions,
        text: str,
        kind: RequestKind = "generate",
        ttl: TtlClass = TtlClass.SHORT,
        *,
        fragments: bool = True,
    ) -> CompletionStream:
        if self._state != "ready":
            raise EngineClosedError(f"model {self.id!r} is {self._state}")
        n_ctx = self.config.context.n_ctx
        if not tokens:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(tokens) >= n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(tokens)} tokens; this model's context holds {n_ctx} "
                "(the prompt must leave room for at least one generated token)",
                n_tokens=len(tokens),
                n_ctx=n_ctx,
            )
        grammar = opts.grammar
        if opts.json_schema is not None:
            grammar = json_schema_to_grammar(opts.json_schema)
        deterministic = (
            opts.deterministic if opts.deterministic is not None else self.config.deterministic
        )
        if opts.parent_key is not None:
            # Wait here, on the caller's thread, for an in-flight save of the previous turn;
            # once published, the worker's prefix lookup finds it. Never stalls other slots.
            self._engine.cache.lookup_exact_or_wait(
                opts.parent_key, self.policy.session_resume_wait_ms / 1e3
            )
        req = Request(
            prompt_tokens=tokens,
            options=opts,
            grammar=grammar,
            deterministic=deterministic,
            kind=kind,
            ttl_class=ttl,
            prompt_text=text,
            fragments=fragments,
        )
        if grammar is not None or opts.logit_bias:
            # Build once here so a bad grammar or bias is the caller's error, not the worker's.
            self._bmodel.new_sampler(opts.sampling(grammar)).close()
        self._worker.submit(req)
        return CompletionStream(req, self._worker.cancel)

    # ---- embeddings ---------------------------------------------------------------------

    def embed(self, texts: str | Sequence[str], *, normalize: bool = True) -> list[list[float]]:
        self._check_ready()
        items = [texts] if isinstance(texts, str) else list(texts)
        if not items:
            raise InvalidRequestError("no input to embed", param="input")
        token_lists = []
        limit = self.config.context.n_ctx
        for t in items:
            toks = self._bmodel.tokenize(t, add_special=True, parse_special=False)
            if not toks:
                raise InvalidRequestError("cannot embed an empty string", param="input")
            if len(toks) > limit:
                raise ContextOverflowError(
                    f"input has {len(toks)} tokens; the embedding context holds {limit}",
                    n_tokens=len(toks),
                    n_ctx=limit,
                )
            token_lists.append(toks)

        def run() -> list[list[float]]:
            if self._embed_ctx is None:
                self._embed_ctx = self._bmodel.new_context(
                    replace(
                        self.config.context,
                        embeddings=True,
                        n_seq_max=1,
                        n_batch=max(self.config.context.n_batch, limit),
                        n_ubatch=max(self.config.context.n_ubatch, limit),
                    )
                )
            ctx = self._embed_ctx
            return [ctx.embed(toks, normalize=normalize) for toks in token_lists]

        return self._worker.call(run).result()

    # ---- adapters -----------------------------------------------------------------------

    def load_adapter(self, path: str | os.PathLike[str], scale: float = 1.0) -> AdapterInfo:
        if not Path(path).is_file():
            raise AdapterError(f"adapter file not found: {path}")
        adapter = self._bmodel.load_adapter(str(path))
        with self._adapter_lock:
            handle = self._next_adapter
            self._next_adapter += 1
            self._adapters[handle] = (adapter, float(scale))
        try:
            self._apply_adapters()
        except BaseException:
            with self._adapter_lock:
                self._adapters.pop(handle, None)
            adapter.close()
            raise
        return self._adapter_info(handle)

    def set_adapter_scale(self, handle: int, scale: float) -> AdapterInfo:
        with self._adapter_lock:
            if handle not in self._adapters:
                raise AdapterError(f"no adapter with handle {handle}")
            adapter, old = self._adapters[handle]
            self._adapters[handle] = (adapter, float(scale))
        try:
            self._apply_adapters()
        except BaseException:
            # A rejected scale (e.g. NaN) must not stay recorded: it would be reported by
            # list_adapters and make every later load_adapter fail to apply the set.
            with self._adapter_lock:
                current = self._adapters.get(handle)
                if current is not None and current[0] is adapter:
                    self._adapters[handle] = (adapter, old)
            raise
        return self._adapter_info(handle)

    def detach_adapter(self, handle: int) -> None:
        with self._adapter_lock:
            if handle not in self._adapters:
                raise AdapterError(f"no adapter with handle {handle}")
            adapter, scale = self._adapters.pop(handle)
        try:
            self._apply_adapters()
        except BaseException:
            # Still attached natively: keep listing it, or it could never be detached.
            with self._adapter_lock:
                self._adapters[handle] = (adapter, scale)
            raise
        adapter.close()

    def list_adapters(self) -> list[AdapterInfo]:
        with self._adapter_lock:
            items = sorted(self._adapters.items())
        return [AdapterInfo(h, a.path, scale, a.sha256.hex()) for h, (a, scale) in items]

    def _adapter_info(self, handle: int) -> AdapterInfo:
        adapter, scale = self._adapters[handle]
        return AdapterInfo(handle, adapter.path, scale, adapter.sha256.hex())

    def _apply_adapters(self) -> None:
        def run() -> None:
            self._ctx.set_adapters(list(self._adapters.values()))
            # Live KV was computed under the old adapter set; it must not be reused.
            self._worker.invalidate_live_kv()
            self._refresh_namespace()

        # needs_idle: no running request ever sees an adapter change mid-way.
        self._worker.call(run, needs_idle=True).result()

    # ---- lifecycle ----------------------------------------------------------------------

    def evict(self) -> int:
        """Synchronously save every idle slot's live KV (reason ``evict``), then release it.
        Returns the number of rows saved."""
        return self._worker.call(
            lambda: self._worker.save_idle_slots(SaveReason.EVICT, release=True)
        ).result()

    def unload(self, timeout_s: float | None = None) -> None:
        """Cancel queued and running requests, save live KV (bounded), free native state."""
        if self._state in ("unloading", "closed"):
            return
        self._state = "unloading"
        limit = timeout_s if timeout_s is not None else self.policy.evict_save_timeout_ms / 1e3
        self._worker.stop(
            lambda: self._worker.save_idle_slots(SaveReason.SHUTDOWN, release=True), limit
        )
        try:
            if self._embed_ctx is not None:
                self._embed_ctx.close()
            self._ctx.close()
            for adapter, _ in self._adapters.values():
                adapter.close()
            self._bmodel.close()
        finally:
            self._state = "closed"
            self._engine._forget(self.id)


_LOADING: Model = object.__new__(Model)  # placeholder reserving an id during a load


def _options(
    options: GenerationOptions | None, overrides: Mapping[str, object]
) -> GenerationOptions:
    opts = options or GenerationOptions()
    if overrides:
        fields = set(GenerationOptions.__dataclass_fields__)
        unknown = set(overrides) - fields
        if unknown:
            raise InvalidRequestError(
                f"unknown option(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0]
            )
        if "stop" in overrides and isinstance(overrides["stop"], list | str):
            stop = overrides["stop"]
            overrides = {**overrides, "stop": (stop,) if isinstance(stop, str) else tuple(stop)}
        try:
            opts = replace(opts, **overrides)  # type: ignore[arg-type]
        except TypeError as exc:
            raise InvalidRequestError(str(exc)) from exc
    opts.validate()
    return opts


# ---- the module-level default engine (for the five-line example) ----------------------

_default: Engine | None = None
_default_lock = threading.Lock()


def default_engine() -> Engine:
    """The process-wide engine used by ``kvwarm.load_model``; created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Engine()
        return _default


def load_model(
    path: str | os.PathLike[str] | None = None,
    *,
    model_id: str | None = None,
    config: ModelConfig | None = None,
) -> Model:
    return default_engine().load_model(path, model_id=model_id, config=config)


def unload_model(model_id: str) -> None:
    default_engine().unload_model(model_id)


def list_models() -> list[ModelInfo]:
    return default_engine().list_models()
