"""``Model``: one loaded model — its worker thread, its slots, its adapters. A thin front: it
validates on the caller's thread and hands work to the worker (``worker``), the adapter set
(``adapters``) and the embedding context (``embeddings``).

Invariants: every public call either returns or raises a ``KvwarmError`` subclass; a request
is validated (prompt length, grammar, bias) before it is queued, so the worker only ever sees
requests it can run; a parent_key wait happens on the caller's thread and never stalls other
slots (``docs/architecture.md``, "Engine"); a call an unload overtakes on the caller's thread
(past its ready check, before its use of the native model) raises ``EngineClosedError``, as
the check would have (``_overtaken_as_closed``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Concatenate, ParamSpec, Protocol, TypeVar, Unpack

from kvwarm.backends import get_backend
from kvwarm.backends.base import (
    DEFAULT_KV_TYPE,
    EXACT_AT_ANY_LENGTH,
    Adapter,
    AdapterSet,
    Backend,
    BackendModel,
    ContextMemory,
    MediaSpan,
    PoolingType,
    Projector,
    ProjectorParams,
    concrete_kv,
)
from kvwarm.backends.chat_template import BUILTIN_TEMPLATES, FALLBACK_TEMPLATE, resolve_template
from kvwarm.cache.formats.key import effective_fingerprint
from kvwarm.cache.types import Namespace, PolicyConfig, SaveReason, TierName, TtlClass
from kvwarm.engine.adapters import Adapters
from kvwarm.engine.cancel import Cancellation, check_wait
from kvwarm.engine.config import ModelConfig
from kvwarm.engine.describe import (
    LoadProgress,
    ModelState,
    model_info,
    model_status,
    not_generating,
    speculation,
    warn_if_past_training,
)
from kvwarm.engine.embeddings import Embedder
from kvwarm.engine.fingerprint import (
    FileIdentity,
    companion_fingerprint,
    file_identity,
    model_fingerprint,
    parse_mode,
    with_projector,
)
from kvwarm.engine.ops import Message
from kvwarm.engine.options import GenerationOverrides, merge_options
from kvwarm.engine.prompts import (
    ChatMedia,
    ExtraFile,
    FimFit,
    MediaPrompt,
    chat_prompt,
    check_chat_size,
    fim_tokens,
    leads_with_system,
    longest_piece,
    shows_system,
    span_digest,
    system_folded,
)
from kvwarm.engine.request import RequestKind, check_tokens
from kvwarm.engine.rerank import Ranker, RerankLimits
from kvwarm.engine.speculating import needs_exact_rows
from kvwarm.engine.stream import CompletionStream
from kvwarm.engine.submit import Submitter
from kvwarm.engine.types import (
    AdapterInfo,
    Capability,
    Completion,
    CompletionStats,
    GenerationOptions,
    ModelInfo,
    ModelStatus,
    Reranking,
    check_flag,
    check_lora,
)
from kvwarm.engine.worker.batching import strategy
from kvwarm.engine.worker.draftmodel import DraftModel, check_vocab
from kvwarm.engine.worker.loop import Worker, WorkerConfig
from kvwarm.engine.worker.runtime import LoraChoice
from kvwarm.errors import (
    AdapterError,
    CapabilityError,
    ConfigError,
    EngineClosedError,
    HandleClosedError,
    InvalidRequestError,
    ModelLoadError,
)
from kvwarm.media import Audio
from kvwarm.tokens import Prompt, span_ids

if TYPE_CHECKING:
    from kvwarm.engine.engine import Engine
    from kvwarm.engine.ops import ModelOps

#: What the generation calls take: text, token ids, a ``Prompt`` (ids and media spans: only
#: one without spans, whose content it does not carry), or a ``MediaPrompt`` (a prompt and the
#: media its spans show, as ``chat_prompt`` builds it).
PromptInput = str | Sequence[int] | Prompt | MediaPrompt


log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _overtaken_as_closed(
    method: Callable[Concatenate[Model, _P], _R],
) -> Callable[Concatenate[Model, _P], _R]:
    """``method``, which uses the native model on its caller's thread after
    ``_check_ready``: where an unload freed the model in between, its ``HandleClosedError``
    is the ``EngineClosedError`` the check would have raised. Found by the stress harness
    (``tests/engine/test_concurrency_stress_stub.py``): a request racing a reload got
    "model is closed", a backend error (the server's 500), where the model had gone (503)."""

    @functools.wraps(method)
    def call(self: Model, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except HandleClosedError as exc:
            if self._state == "ready":
                raise
            raise EngineClosedError(f"model {self.id!r} is {self._state}") from exc

    return call


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
        self._state: ModelState = "loading"
        # Held through unload(): a second caller returns once the model is closed, not while
        # the first is still saving and freeing it (found by review: Engine.close then closed
        # the cache under this model's shutdown saves). Re-entrant for a callback inside it.
        self._unload_lock = threading.RLock()
        mode = parse_mode(cfg.fingerprint_mode)
        self.fingerprint_mode = mode
        self.backend = get_backend(backend_spec) if isinstance(backend_spec, str) else backend_spec
        phases = LoadProgress(progress, mode, path.is_file())
        hashed = file_identity(path)
        self._fingerprint = model_fingerprint(path, mode, cfg.fingerprint, phases.hashing())
        #: This load's own salt: the namespace of an adapter set whose sum llama.cpp orders by
        #: address, in deterministic mode (``_namespace_of``).
        self._load_salt = os.urandom(16)
        # A model that will verify drafts (its header says it generates) exactly (its
        # spec_exact) loads its weights where its verify rows can be exact; a reranker or an
        # encoder given a spec_type, or a model that need not be exact, does not pay for that.
        exact_rows = needs_exact_rows(cfg, path)
        params = replace(cfg.model_params, progress=phases.weights(), exact_rows=exact_rows)
        self._bmodel: BackendModel = self.backend.load_model(str(path), params)
        try:
            # Found by review: a file replaced (or rewritten) after it was hashed and before
            # llama.cpp read it loaded the new weights under the old file's fingerprint, so
            # their KV was saved, and later restored, as the old file's.
            _check_unchanged(path, hashed)
        except BaseException:
            self._bmodel.close()
            raise
        self._projector: Projector | None = None
        self._draft: DraftModel | None = None
        #: The context as configured, before the backend resolved its ``auto`` values.
        self._context_given = cfg.context
        facts = self._bmodel.facts
        ran = self._bmodel.context_params(
            cfg.context,
            deterministic=cfg.deterministic,
            speculative=cfg.speculates_with(facts.pooling),
            exact=cfg.spec_exact,
        )
        #: How it pools: the setting's, else the GGUF's, else the context's (mean).
        self.pooling: PoolingType = cfg.pooling or facts.pooling or ran.pooling
        if self.pooling == "rank":
            # A reranker's slots pool their sequences by rank (llama-server's --rerank); an
            # encoder's prompt runs whole, in one ubatch, so a ubatch is a whole batch.
            ran = replace(ran, embeddings=True, pooling="rank")
            if not facts.causal:
                ran = replace(ran, n_ubatch=ran.n_batch)
        elif not facts.causal:
            # An encoder (a BERT embedding model) keeps no KV cache: it only embeds, and its
            # worker's context pools too (stateless). Found by review: it was made as a
            # generator's, which llama.cpp cannot give such a model, and the load failed.
            ran = replace(ran, embeddings=True, pooling=self.pooling)
        self.config = cfg = replace(cfg, context=ran)
        #: The projector's file as ``info()`` shows it (the server's models_dir loads read it
        #: through another path, ``models_dir.pinned``, and set its name here).
        self.mmproj_path: str | None = cfg.mmproj
        self.chat_template_name, self._template = self._chat_template(cfg.chat_template)
        self._longest_lock = threading.Lock()
        self._longest: int | None = None  # bytes of the longest token (a chat's size bound)
        self._system_shown: bool | None = None  # prompts.shows_system of its template, once
        try:
            if cfg.mmproj is not None:
                self._projector = self._load_projector(cfg.mmproj)
            self._start_worker()
        except BaseException:
            if self._projector is not None:
                self._projector.close()
            if self._draft is not None:
                self._draft.close()
            self._bmodel.close()
            raise
        # Each adapter is measured as it loads where it could make an exact model's verify
        # passes differ (an f32 adapter's products take tinyBLAS for several rows).
        exact: Callable[[Adapter], str] | None = None
        if cfg.spec_exact and self._verify_exactness == EXACT_AT_ANY_LENGTH:
            bmodel, running = self._bmodel, self._ctx.params
            exact = lambda adapter: bmodel.verify_exactness(running, ((adapter, 1.0),))  # noqa: E731

        self._adapters = Adapters(self._bmodel, self._worker, self._links.refresh, exact)
        if exact is not None:
            self._worker.rt.adapters_exact = self._adapters.exact_set
        self._seen: dict[bytes, None] = {}  # fingerprints of requests' own adapter sets
        self._seen_lock = threading.Lock()
        self._submitter = Submitter(
            self._bmodel,
            self._worker,
            self._engine.cache,
            self.config,
            self.policy,
            self._adapters.check,
            non_causal=() if self._projector is None else self._projector.facts.non_causal,
        )
        self._embedder = Embedder(
            self._bmodel,
            replace(cfg.context, pooling=self.pooling),
            self._worker,
            adapters=self._adapters.resolve,
        )
        ctx = cfg.context
        self._ranker = Ranker(
            self._bmodel,
            self._worker,
            RerankLimits(
                limit=ctx.n_ctx if facts.causal else min(ctx.n_ctx, ctx.n_ubatch),
                max_documents=cfg.rerank_max_documents,
                truncate=cfg.rerank_truncate,
            ),
            whole=not facts.causal,
            deterministic=cfg.deterministic,
            n_batch=ctx.n_batch,
        )
        try:
            for spec in cfg.lora:
                try:
                    self._adapters.load(spec.path, spec.scale, name=spec.name)
                except AdapterError as exc:
                    raise AdapterError(
                        f"LoRA adapter {spec.name or spec.path} of model {model_id}: {exc}"
                    ) from exc
        except BaseException:
            self._free_after_failed_load()
            raise
        self._state = "ready"

    def _load_projector(self, mmproj: str) -> Projector:
        """The ``--mmproj`` projector, its fingerprint folded into the model's: an image's KV
        depends on the projector that encoded it."""
        path = Path(os.path.expanduser(mmproj))
        threads = self.config.context.n_threads_batch or self.config.context.n_threads
        gpu = self.config.model_params.n_gpu_layers != 0
        read = file_identity(path)
        projector = self._bmodel.load_projector(str(path), ProjectorParams(threads, gpu))
        try:
            fingerprint = with_projector(self._fingerprint, path, self.fingerprint_mode)
            _check_unchanged(path, read)
            self._fingerprint = fingerprint
        except BaseException:
            projector.close()
            raise
        log.info(
            "model %s reads %s through %s",
            self.id,
            " and ".join(projector.facts.kinds),
            path.name,
        )
        return projector

    def _load_draft(self, draft_path: str) -> DraftModel:
        """The ``--draft-model``: its weights (``ConfigError`` unless it has this model's
        vocabulary), a context of its own with one sequence per slot (a sliding-window draft
        model's with a full-size SWA cache, so a rejected draft's cells can be removed, as
        llama-server gives its draft context), and its own cache namespace (its fingerprint,
        its context's hash)."""
        cfg = self.config
        path = Path(os.path.expanduser(draft_path))
        read = file_identity(path)
        bmodel = self.backend.load_model(str(path), replace(cfg.model_params, progress=None))
        try:
            check_vocab(self._bmodel, bmodel, str(path))
            # Hashed after its weights were read, as it was when they were.
            fingerprint = companion_fingerprint(path, self.fingerprint_mode)
            _check_unchanged(path, read)
            # The cells this model's were given: a draft's verify rows are never compared, so
            # ``auto`` is f16 there (the exact type costs a draft prefill 1.5x).
            given = self._context_given
            windowed = bmodel.facts.memory_kind == "swa" and bmodel.facts.n_swa > 0
            ran = bmodel.context_params(
                replace(
                    cfg.context,
                    embeddings=False,
                    type_k=concrete_kv(given.type_k),
                    type_v=concrete_kv(given.type_v),
                    swa_full=cfg.context.swa_full or windowed,
                ),
                deterministic=False,
                speculative=True,
            )
            total = replace(
                ran, n_ctx=ran.n_ctx * cfg.n_parallel, n_seq_max=cfg.n_parallel, kv_unified=True
            )
            kv_tag = bmodel.kv_tag(ran)
            ctx = bmodel.new_context(total)
            try:
                if ctx.memory.lookahead(0) is not None:  # recurrent, hybrid: no roll back
                    raise ConfigError(
                        f"draft model {path}: its {ctx.memory.describe()} memory cannot roll "
                        "a rejected draft back"
                    )
                # Its own namespace even where the draft model is the model itself: the draft
                # context's rows are whole blobs of its prompts, never mixed with the model's.
                kv_hash = ran.kv_hash(kv_tag)
                ctx_hash = hashlib.sha256(b"kvwarm draft context\0" + kv_hash).digest()
                namespace = Namespace(fingerprint, bmodel.facts.file_type & 0xFF, ctx_hash)
                log.info("model %s drafts with %s", self.id, path.name)
                return DraftModel(
                    bmodel,
                    ctx,
                    namespace,
                    n_seq=cfg.n_parallel,
                    quant_bits=bmodel.facts.quant_bits,
                    path=str(path),
                    n_ctx_slot=ran.n_ctx,
                    n_target_vocab=self._bmodel.facts.n_vocab,
                    relative_size=bmodel.facts.size_bytes / max(1, self._bmodel.facts.size_bytes),
                )
            except BaseException:
                ctx.close()
                raise
        except BaseException:
            bmodel.close()
            raise

    def _log_speculation(self, spec: str, *, generates: bool) -> None:
        """Say at load what speculation chose where the configuration did not say it (a
        model that never generates, given a ``spec_type`` shared by every model, is no news:
        no warning)."""
        cfg, given = self.config, self._context_given
        if not cfg.speculative or not generates:
            return
        if spec.startswith("off"):
            log.warning("model %s: speculative decoding is %s", self.id, spec)
            return
        chosen = [
            f"{name} {getattr(cfg.context, name)}"
            for name in ("type_k", "type_v")
            if getattr(given, name) == "auto" and getattr(cfg.context, name) != DEFAULT_KV_TYPE
        ]
        if chosen:
            log.info(
                "model %s speculates with KV cells %s (auto), with which a verify pass's rows "
                "are one-token passes %s; set type_k and type_v to choose",
                self.id,
                " and ".join(chosen),
                self._verify_exactness,
            )
        if self._verify_exactness not in (None, EXACT_AT_ANY_LENGTH):
            log.warning(
                "model %s: speculation is exact only %s (spec_exact = false)",
                self.id,
                self._verify_exactness,
            )

    def _start_worker(self) -> None:
        cfg = self.config
        self.facts = facts = self._bmodel.facts
        warn_if_past_training(self.id, cfg.context.n_ctx, facts.n_ctx_train)
        # Deterministic models of several slots give each slot a KV stream of its own: a
        # slot's cells then sit where a one-slot context would put them, whatever the other
        # slots hold (issue 23). One slot keeps the unified buffer and its scratch sequence
        # (chunked rows restore in place through it; a stream of its own could not share).
        total = replace(
            cfg.context,
            n_ctx=cfg.context.n_ctx * cfg.n_parallel,
            n_seq_max=cfg.n_parallel,
            kv_unified=not (cfg.deterministic and cfg.n_parallel > 1),
        )
        # Read as the context is made (llama.cpp reads its rotation switch then).
        kv_tag = self._bmodel.kv_tag(cfg.context, deterministic=cfg.deterministic)
        self._ctx = self._bmodel.new_context(total)
        #: Where a verify pass's rows are one-token passes (and so a greedy speculative reply
        #: plain decoding's): ``BackendModel.verify_exactness``, asked (it may measure) only
        #: where nothing else turns speculation off; None elsewhere.
        self._verify_exactness: str | None = None
        never = not_generating(facts, self.capabilities)
        if not speculation(cfg, self._ctx.memory, None, never).startswith("off"):
            self._verify_exactness = self._bmodel.verify_exactness(total)
        spec = speculation(cfg, self._ctx.memory, self._verify_exactness, never)
        self._log_speculation(spec, generates=never is None)
        if cfg.draft_model is not None:
            if spec.startswith("off"):
                # Its weights and its context would take memory for drafts never asked for
                # (and a reranker's vocabulary need not be the draft model's: a server's
                # --draft-model applies to every model it loads). Said as a warning only
                # where the model could have speculated.
                log.log(
                    logging.WARNING if never is None else logging.INFO,
                    "model %s: not loading the draft model %s: speculation is %s",
                    self.id,
                    Path(cfg.draft_model).name,
                    spec,
                )
            else:
                try:
                    self._draft = self._load_draft(cfg.draft_model)
                except BaseException:
                    self._ctx.close()
                    raise
        self._ctx_hash = cfg.context.kv_hash(kv_tag)
        self._namespace = Namespace(self._fingerprint, facts.file_type & 0xFF, self._ctx_hash)
        self._links = _Links(self)
        self._worker = Worker(
            self.id,
            self._bmodel,
            self._ctx,
            self._engine.cache,
            WorkerConfig(
                n_parallel=cfg.n_parallel,
                n_ctx_slot=cfg.context.n_ctx,
                n_batch=cfg.context.n_batch,
                n_ubatch=cfg.context.n_ubatch,
                policy=self.policy,
                save_tier=self.save_tier,
                quant_bits=facts.quant_bits,
                fingerprint_mode=self.fingerprint_mode,
                max_queue=cfg.max_queue,
                strategy=strategy(cfg.batch_strategy),
                whole=self.pooling == "rank" and not facts.causal,
                spec_type=cfg.default_spec_type,
                spec_ngram_n=cfg.spec_ngram_n,
                spec_draft_max=cfg.spec_draft_max,
                speculates=not spec.startswith("off"),
                verify_together=not cfg.spec_exact and self._ctx.memory.trimmable,
            ),
            self._links.namespace,
            self._links.resolve,
            projector=self._projector,
            draft=self._draft,
        )

    def _free_after_failed_load(self) -> None:
        """A model whose configured adapter did not load: stop its worker and free it all."""
        self._state = "closed"
        if self._worker.stop(None, 60.0):
            self._free_native()
        else:
            self._worker.after_exit(self._free_native)

    # ---- identity -----------------------------------------------------------------------

    def namespace(self) -> Namespace:
        """The current cache namespace: model fingerprint folded with attached adapters."""
        return self._namespace

    def _refresh_namespace(self, adapters: Sequence[tuple[bytes, float]]) -> None:
        self._namespace = self._namespace_of(adapters)

    def _namespace_of(self, adapters: Sequence[tuple[bytes, float]]) -> Namespace:
        fp = effective_fingerprint(self._fingerprint, list(adapters))
        if self.config.deterministic and _order_varies(adapters):
            # llama.cpp adds such a set's products in an order set by where the adapters lie
            # in memory (docs/internals.md, "Three or more LoRA adapters"): the same within
            # this load, another after a restart or on a replica. Deterministic mode promises
            # a restore is the bits a cold run here computes, so its rows stay in this load.
            fp = hashlib.sha256(b"kvwarm-load\0" + fp + self._load_salt).digest()
        return Namespace(fp, self._namespace.quant, self._ctx_hash)

    def _resolve_lora(self, choice: LoraChoice | None) -> tuple[AdapterSet, Namespace]:
        """A request's adapter set and namespace (worker thread, at admission)."""
        if choice is None:
            return self._adapters.applied(), self._namespace
        adapters = self._adapters.resolve(choice)
        ns = self._namespace_of([(a.sha256, s) for a, s in adapters])
        with self._seen_lock:
            self._seen[ns.fingerprint] = None
        return adapters, ns

    def cache_fingerprints(self) -> frozenset[bytes]:
        """The fingerprints of the namespaces this model's cached rows live in, as far as it
        knows: its own (now and without adapters), each loaded adapter's alone at scale 1 (an
        adapter served as a model of its own), and every set its requests ran under."""
        own = [self._fingerprint, self._namespace.fingerprint]
        alone = [
            self._namespace_of([(bytes.fromhex(a.sha256), 1.0)]).fingerprint
            for a in self.list_adapters()
        ]
        with self._seen_lock:
            seen = list(self._seen)
        return frozenset((*own, *alone, *seen))

    def draft_namespaces(self) -> frozenset[Namespace]:
        """The namespaces its draft model's cached rows live in, as far as it knows
        (``DraftModel.used``); none without one. Whole namespaces, not fingerprints: the
        draft model's file may be served as a model of its own, whose rows are its own."""
        draft = self._draft
        return frozenset() if draft is None else draft.used()

    def info(self) -> ModelInfo:
        return model_info(
            self.id,
            self.path,
            self.backend.name,
            self.config,
            self.facts,
            fingerprint=self._namespace.fingerprint,
            mode=self.fingerprint_mode,
            save_tier=self.save_tier,
            adapters=self.list_adapters(),
            chat_template_name=self.chat_template_name,
            context_memory=self._context_memory(),
            projector=(
                None
                if self._projector is None
                else replace(
                    self._projector.facts, path=self.mmproj_path or self._projector.facts.path
                )
            ),
            capabilities=self.capabilities,
            pooling=self.pooling,
            draft_model=None if self._draft is None else self._draft.path,
            draft_bytes=0 if self._draft is None else self._draft.size_bytes,
            verify_exactness=self._verify_exactness,
        )

    @property
    def capabilities(self) -> tuple[Capability, ...]:
        """What it can be asked to do: a reranker only ranks (its slots pool by rank), an
        encoder (attention not causal) only embeds."""
        if self.pooling == "rank":
            return ("rerank",)
        return ("generate", "embed") if self.facts.causal else ("embed",)

    def _require(self, capability: Capability) -> None:
        if capability in self.capabilities:
            return
        if capability == "rerank":
            raise CapabilityError(
                f"model {self.id!r} is not a reranker (its pooling is {self.pooling}; a "
                "reranker's is rank: set pooling to rank to rank with it)",
                param="model",
            )
        if "embed" in self.capabilities:
            raise CapabilityError(
                f"model {self.id!r} is an encoder (its attention is not causal): it can only "
                "embed (/v1/embeddings), not generate text",
                param="model",
            )
        raise CapabilityError(
            f"model {self.id!r} is a reranker: it can only rerank (/v1/rerank), not "
            f"{'embed' if capability == 'embed' else 'generate text'}",
            param="model",
        )

    def _context_memory(self) -> ContextMemory:
        """The generation context's buffers, the embedding context's once it exists, and the
        draft model's (``--draft-model``: a context of ``n_ctx`` cells per slot of its own)."""
        embedder = getattr(self, "_embedder", None)  # None while the model loads
        parts = [self._ctx.memory_bytes]
        if embedder is not None:
            parts.append(embedder.memory_bytes())
        if self._draft is not None:
            parts.append(self._draft.ctx.memory_bytes)
        return ContextMemory(sum(p.kv_bytes for p in parts), sum(p.other_bytes for p in parts))

    def stalled_for(self) -> float:
        """Seconds the worker's current iteration has run without ticking (0.0 when idle)."""
        worker = getattr(self, "_worker", None)
        return 0.0 if worker is None else float(worker.stalled_for())

    def worker_failure(self) -> str | None:
        """Why the worker thread died, if it did (the model then refuses every request until
        it is unloaded and loaded again); None while it runs or after a clean stop."""
        worker = getattr(self, "_worker", None)
        failure = None if worker is None else worker.failure
        return None if failure is None else f"its worker died: {failure!r}"

    def status(self) -> ModelStatus:
        return model_status(self.id, self._state, self.config, self._worker)

    # ---- text ---------------------------------------------------------------------------

    @_overtaken_as_closed
    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        self._check_ready()
        return self._bmodel.tokenize(
            text,
            add_special=check_flag(add_special, "add_special"),
            parse_special=check_flag(parse_special, "parse_special"),
        )

    @_overtaken_as_closed
    def detokenize(self, tokens: Sequence[int]) -> str:
        self._check_ready()
        return self._bmodel.detokenize(_token_ids(tokens))

    @_overtaken_as_closed
    def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        self._check_ready()
        bmodel = self._bmodel
        return [bmodel.token_to_piece(t, special=True) for t in _token_ids(tokens)]

    @_overtaken_as_closed
    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The template's render of ``messages`` as they are (no system message folded:
        ``chat_prompt`` folds; the server probes the template through this)."""
        self._check_ready()
        return self._bmodel.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=check_flag(add_generation_prompt, "add_generation_prompt"),
            template=self._template,
        )

    def _chat_template(self, chosen: str | None) -> tuple[str, str | None]:
        """(name, source) of the template chats render with; source None: the GGUF's own."""
        if chosen is not None:
            return resolve_template(chosen)
        if self._bmodel.facts.chat_template:
            return "gguf", None
        if self.pooling == "rank":  # a reranker never chats: nothing to warn about
            return f"{FALLBACK_TEMPLATE} (fallback)", BUILTIN_TEMPLATES[FALLBACK_TEMPLATE]
        log.warning(
            "model %s carries no chat template: chats use %s (set chat_template to choose)",
            self.id,
            FALLBACK_TEMPLATE,
        )
        return f"{FALLBACK_TEMPLATE} (fallback)", BUILTIN_TEMPLATES[FALLBACK_TEMPLATE]

    # ---- generation ---------------------------------------------------------------------

    def complete(
        self,
        prompt: PromptInput,
        options: GenerationOptions | None = None,
        **overrides: Unpack[GenerationOverrides],
    ) -> Completion:
        return self.submit(prompt, options, **overrides).result()

    @_overtaken_as_closed
    def stream(
        self,
        prompt: PromptInput,
        options: GenerationOptions | None = None,
        **overrides: Unpack[GenerationOverrides],
    ) -> CompletionStream:
        """Start a request whose stream yields text fragments as they are generated."""
        opts = merge_options(options, overrides)
        tokens, text = self._prompt_tokens(prompt, opts)
        return self._submit(tokens, opts, text)

    @_overtaken_as_closed
    def submit(
        self,
        prompt: PromptInput,
        options: GenerationOptions | None = None,
        **overrides: Unpack[GenerationOverrides],
    ) -> CompletionStream:
        """Start a request that sends no per-token events: its stream yields nothing and ends
        with the completion. For callers that only want the result; it spares the waiting
        thread one wake-up per token."""
        opts = merge_options(options, overrides)
        tokens, text = self._prompt_tokens(prompt, opts)
        return self._submit(tokens, opts, text, fragments=False)

    @_overtaken_as_closed
    def streams(
        self,
        prompt: PromptInput,
        options: GenerationOptions | None = None,
        *,
        n: int,
        fragments: bool = True,
        **overrides: Unpack[GenerationOverrides],
    ) -> list[CompletionStream]:
        """``n`` choices for one prompt, prefilled once (``engine/worker/forks.py``): one stream
        each. Choice ``i`` samples with ``seed + i`` when a seed is given (else each draws
        its own). ``fragments=False``: the streams yield nothing and end with the result.
        ``n`` may not exceed ``n_parallel`` (``InvalidRequestError``)."""
        opts = merge_options(options, overrides)
        tokens, text = self._prompt_tokens(prompt, opts)
        return self._submit_n(tokens, opts, text, n, fragments)

    @_overtaken_as_closed
    def chat_streams(
        self,
        messages: Sequence[Message],
        *,
        n: int,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
        fragments: bool = True,
        **overrides: Unpack[GenerationOverrides],
    ) -> list[CompletionStream]:
        """``streams`` for a chat."""
        opts = merge_options(options, overrides)
        prompt, text = self.chat_prompt(messages, tools=tools)
        return self._submit_n(prompt, opts, text, n, fragments)

    def chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
        prefill: str = "",
        **overrides: Unpack[GenerationOverrides],
    ) -> Completion:
        """A chat's reply. ``prefill``: text the reply continues and does not repeat
        (Anthropic's trailing assistant message), as ``stream_chat`` places it."""
        opts = merge_options(options, overrides)
        prompt, text = self._prefilled_chat(messages, tools, prefill)
        return self._submit(prompt, opts, text, fragments=False).result()

    @_overtaken_as_closed
    def stream_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        options: GenerationOptions | None = None,
        prefill: str = "",
        **overrides: Unpack[GenerationOverrides],
    ) -> CompletionStream:
        """A chat's reply as it is generated. ``prefill``: text the reply continues (its
        fragments and text do not repeat it), placed after the template's generation prompt
        as plain text (special-token text in it stays text); the chat may show images."""
        opts = merge_options(options, overrides)
        prompt, text = self._prefilled_chat(messages, tools, prefill)
        return self._submit(prompt, opts, text)

    def _prefilled_chat(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, object]] | None,
        prefill: str,
    ) -> tuple[MediaPrompt, str]:
        prompt, text = self.chat_prompt(messages, tools=tools)
        if not prefill:
            return prompt, text
        tail = self._bmodel.tokenize(prefill, add_special=False, parse_special=False)
        return prompt.extended(tail), text + prefill

    @_overtaken_as_closed
    def prewarm(
        self,
        prompt: PromptInput,
        *,
        ttl_class: TtlClass = TtlClass.LONG,
        add_special: bool = True,
        cache_salt: str | None = None,
    ) -> CompletionStats:
        """Prefill ``prompt`` and save it (with its final logits), generating nothing. With a
        ``cache_salt`` the row serves only requests with the same salt. ``EngineClosedError``
        if the model is unloaded before it is done. The cache's upkeep, not a request: it
        counts in ``status()``'s ``prewarms`` (and ``prewarm_*``), never in its ``requests``,
        their tokens and prefill time, nor in the cache's hits and misses."""
        self._check_ready()
        self._require("generate")
        if not isinstance(ttl_class, TtlClass):
            raise InvalidRequestError(
                f"ttl_class must be a kvwarm.TtlClass ({', '.join(TtlClass.__members__)}), "
                f"got {ttl_class!r}",
                param="ttl_class",
            )
        opts = GenerationOptions(
            max_tokens=0, temperature=0.0, add_special=add_special, cache_salt=cache_salt
        )
        opts.validate()
        ids: MediaPrompt
        if isinstance(prompt, str):
            tokens = self._bmodel.tokenize(prompt, add_special=add_special, parse_special=True)
            ids, text = MediaPrompt(Prompt.text(tokens)), prompt
        elif isinstance(prompt, Prompt | MediaPrompt):
            ids, text = self._checked(prompt), ""
        else:
            _check_prompt_type(prompt)
            ids, text = MediaPrompt(Prompt.text(check_tokens(prompt, self.facts.n_vocab))), ""
        n = len(ids.prompt)
        if n < self.policy.min_tokens:
            # Found by review: a prefix under min_tokens was prefilled and no row saved (no
            # save writes one, and no lookup probes one), answered like a success: a
            # keep-alive entry then prefilled it again every period for nothing.
            raise InvalidRequestError(
                f"a prewarm of {n} tokens saves nothing: rows are at least min_tokens "
                f"({self.policy.min_tokens}) long",
                param="prompt",
            )
        stream = self._submit(
            ids, opts, text, kind="prewarm", ttl=ttl_class, fragments=False, upkeep=True
        )
        stats = stream.result().stats
        if stats.finish_reason == "cancelled":
            # Only an unload cancels a prewarm (its stream is this call's). Found by review:
            # its stats came back as a success although no row of the prompt was saved, and
            # keep-alive counted the entry warm (a rerank raises the same for its documents).
            raise EngineClosedError(
                f"model {self.id!r} was unloaded before its prewarm finished: the prompt was "
                "not saved"
            )
        return stats

    @_overtaken_as_closed
    def prewarm_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        ttl_class: TtlClass = TtlClass.LONG,
        cache_salt: str | None = None,
    ) -> CompletionStats:
        """Prefill and save the prompt every chat that starts with ``messages`` begins with
        (rendered without a generation prompt), its images and audio included: a later chat
        with the same messages first, the same pictures among them, restores past them."""
        prompt, _ = self.chat_prompt(messages, tools=tools, add_generation_prompt=False)
        return self.prewarm(prompt, ttl_class=ttl_class, cache_salt=cache_salt)

    def _prompt_tokens(
        self, prompt: PromptInput, opts: GenerationOptions
    ) -> tuple[MediaPrompt, str]:
        self._check_ready()
        if isinstance(prompt, Prompt | MediaPrompt):
            return self._checked(prompt), ""
        _check_prompt_type(prompt)
        if isinstance(prompt, str):
            tokens = self._bmodel.tokenize(
                prompt, add_special=opts.add_special, parse_special=opts.parse_special
            )
            return MediaPrompt(Prompt.text(tokens)), prompt
        return MediaPrompt(Prompt.text(check_tokens(prompt, self.facts.n_vocab))), ""

    def _checked(self, given: Prompt | MediaPrompt) -> MediaPrompt:
        """A prompt whose text positions are this vocabulary's ids and whose spans this model
        can decode: each with the media it shows (a bare ``Prompt``'s spans name content it
        does not carry), of a kind its projector reads, of the size its layout gives."""
        mp = given if isinstance(given, MediaPrompt) else None
        prompt = given.prompt if isinstance(given, MediaPrompt) else given
        check_tokens(prompt.text_tokens(), self.facts.n_vocab)
        if not prompt.spans:
            return mp or MediaPrompt(prompt)
        kinds = sorted({span.kind for span in prompt.spans})
        projector = self._projector
        if projector is None:
            raise InvalidRequestError(
                f"model {self.id!r} cannot read {' or '.join(kinds)} input: it has no "
                "multimodal projector (load it with --mmproj)",
                param="prompt",
            )
        if mp is None:
            raise InvalidRequestError(
                "a Prompt with spans names its media by digest only: pass a MediaPrompt (a "
                "prompt and its media, as Model.chat_prompt builds it) or chat messages",
                param="prompt",
            )
        layouts: dict[bytes, list[int]] = {}
        for i, (span, shown) in enumerate(zip(prompt.spans, mp.media, strict=True)):
            if span.kind not in projector.facts.kinds or shown.media.kind != span.kind:
                raise InvalidRequestError(
                    f"a {span.kind} span this model's projector cannot decode", param="prompt"
                )
            rate = projector.facts.audio_sample_rate
            if isinstance(shown.media, Audio) and shown.media.sample_rate != rate:
                # mtmd takes samples without their rate and reads them at its own: a clip at
                # another was encoded as another sound, and saved under this clip's name.
                raise InvalidRequestError(
                    f"span {i} shows a clip at {shown.media.sample_rate} Hz; this model's "
                    f"projector reads clips at {rate} Hz (kvwarm.media.load_media resamples)",
                    param="prompt",
                )
            # The span's ids are the cache's name for its content: ids naming other content
            # than the media decoded there would save that KV under the other's name.
            if span.digest != span_digest(shown.media, shown.index):
                raise InvalidRequestError(
                    f"span {i} names another {span.kind} than the one the prompt carries for "
                    "it (its digest is not span_digest of that media)",
                    param="prompt",
                )
            if prompt.tokens[span.start : span.end] != span_ids(span.digest, span.length):
                raise InvalidRequestError(
                    f"span {i}'s positions do not hold its span ids (kvwarm.tokens.span_ids)",
                    param="prompt",
                )
            lengths = layouts.get(shown.media.digest)
            if lengths is None:
                pieces = projector.layout(shown.media)
                lengths = [p.n_tokens for p in pieces if isinstance(p, MediaSpan)]
                layouts[shown.media.digest] = lengths
            if shown.index >= len(lengths) or lengths[shown.index] != span.length:
                laid = lengths[shown.index] if shown.index < len(lengths) else 0
                raise InvalidRequestError(
                    f"span {i} has {span.length} positions; this model's projector lays that "
                    f"{span.kind} out in {laid}",
                    param="prompt",
                )
        return mp

    @_overtaken_as_closed
    def chat_tokens(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[tuple[int, ...], str]:
        """The prompt tokens of a chat and its rendered text. Message content is plain text:
        special-token text in it stays text (``kvwarm.engine.prompts``). Prewarm a chat prefix
        with these tokens so that it matches what ``stream_chat`` sends. A chat with images
        or audio has spans, which ids alone cannot carry: ``chat_prompt``."""
        prompt, text = self.chat_prompt(
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )
        if prompt.media:
            raise InvalidRequestError(
                "this chat holds images or audio: its prompt is more than token ids "
                "(use chat, stream_chat or chat_prompt)",
                param="messages",
            )
        return prompt.prompt.tokens, text

    @_overtaken_as_closed
    def count_chat_tokens(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        prefill: str = "",
    ) -> int:
        """The length of the prompt ``stream_chat`` would send, its media's spans counted."""
        prompt, _ = self._prefilled_chat(messages, tools, prefill)
        return len(prompt.prompt.tokens)

    @_overtaken_as_closed
    def chat_prompt(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[MediaPrompt, str]:
        """The prompt of a chat, with its images and audio (content parts of type ``image``
        (bytes, a path, a data: URI or a ``kvwarm.media.Image``), ``image_url`` (a data:
        URI), ``audio``, ``input_audio``), decoded under ``ModelConfig.media``, and its
        rendered text (each medium shown as ``<__media__>``). Under a template that shows no
        system message (Gemma 2's refuses one), the leading system messages open the first
        user turn (``prompts.system_folded``), as the server's chat APIs send them: found by
        review, a library chat with a system prompt was an ``InvalidRequestError`` there, or
        lost its text under a template that drops it, and a ``--prewarm-system`` warmed
        nothing."""
        self._check_ready()
        check_chat_size(messages, self.config.context.n_ctx, self._longest_piece)
        if leads_with_system(messages) and not self._shows_system():
            messages = system_folded(messages)  # checked: a list of messages
        return chat_prompt(
            self._bmodel,
            messages,
            tools=tools,
            add_generation_prompt=check_flag(add_generation_prompt, "add_generation_prompt"),
            template=self._template,
            media=ChatMedia(self._projector, self.config.media),
        )

    def _shows_system(self) -> bool:
        """``prompts.shows_system`` of the template chats render with, probed once (two
        threads at once both probe, to the same answer)."""
        if self._system_shown is None:
            self._system_shown = shows_system(
                lambda messages: self._bmodel.apply_chat_template(messages, template=self._template)
            )
        return self._system_shown

    def _longest_piece(self) -> int:
        """``prompts.longest_piece``, computed once (under a lock: one pass, not several)."""
        with self._longest_lock:
            if self._longest is None:
                self._longest = longest_piece(self._bmodel)
            return self._longest

    def _submit_n(
        self, prompt: MediaPrompt, opts: GenerationOptions, text: str, n: int, fragments: bool
    ) -> list[CompletionStream]:
        self._check_ready()
        self._require("generate")
        fragments = check_flag(fragments, "fragments")
        return [s.keep(self) for s in self._submitter.group(prompt, opts, text, n, fragments)]

    @_overtaken_as_closed
    def infill_tokens(
        self,
        prefix: str,
        suffix: str,
        *,
        prompt: str = "",
        extra: Sequence[ExtraFile] = (),
        n_predict: int | None = None,
    ) -> list[int]:
        """The fill-in-the-middle prompt for the text between ``prefix`` (then ``prompt``)
        and ``suffix``, with ``extra`` files as context (``engine/prompts.py``); generate from
        it with ``complete``/``stream``. ``n_predict``: llama-server's ``/infill`` prompt for
        a reply of that many tokens (its repository header always, cut as it cuts:
        ``FimFit.for_context``, this model's context and llama-server's default batch, never
        this model's ``n_batch``); None: nothing cut, the header only with ``extra``.
        ``FimNotSupportedError`` if the model has no FIM tokens."""
        self._check_ready()
        fit = None
        if n_predict is not None:
            if isinstance(n_predict, bool) or not isinstance(n_predict, int) or n_predict < 0:
                raise InvalidRequestError(
                    f"n_predict must be a count (0 or more), not {n_predict!r}", param="n_predict"
                )
            fit = FimFit.for_context(self.config.context.n_ctx, n_predict)
        return fim_tokens(self._bmodel, prefix, suffix, prompt=prompt, extra=extra, fit=fit)

    def _check_ready(self) -> None:
        if self._state != "ready":
            raise EngineClosedError(f"model {self.id!r} is {self._state}")

    def _submit(
        self,
        prompt: MediaPrompt,
        opts: GenerationOptions,
        text: str,
        kind: RequestKind = "generate",
        ttl: TtlClass = TtlClass.SHORT,
        *,
        fragments: bool = True,
        upkeep: bool = False,
    ) -> CompletionStream:
        self._check_ready()
        self._require("generate")
        stream = self._submitter.one(
            prompt, opts, text, kind, ttl, fragments=fragments, upkeep=upkeep
        )
        return stream.keep(self)

    # ---- embeddings ---------------------------------------------------------------------

    @_overtaken_as_closed
    def embed(
        self,
        inputs: str | Sequence[str | Sequence[int]],
        *,
        normalize: bool = True,
        lora: LoraChoice | None = None,
        timeout_s: float | None = None,
        cancel: Cancellation | None = None,
    ) -> list[list[float]]:
        """One pooled vector per input. An input is text (tokenized with BOS) or token ids,
        used exactly as given: ids are never detokenized and tokenized again. ``lora``: the
        adapters to embed under, as ``GenerationOptions.lora`` (None: the model's own set).
        Past ``timeout_s`` seconds (None: no deadline) the inputs not yet embedded are
        dropped and ``RequestTimeoutError`` is raised; once ``cancel`` is cancelled (from any
        thread), ``RequestCancelledError``."""
        self._check_ready()
        self._require("embed")
        check_lora(lora)
        self._adapters.check(lora)
        return self._embedder.embed(
            inputs,
            normalize=check_flag(normalize, "normalize"),
            lora=lora,
            timeout_s=timeout_s,
            cancel=cancel,
        )

    # ---- reranking ----------------------------------------------------------------------

    @_overtaken_as_closed
    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        top_n: int | None = None,
        max_tokens_per_doc: int | None = None,
        cache_salt: str | None = None,
        lora: LoraChoice | None = None,
        timeout_s: float | None = None,
        cancel: Cancellation | None = None,
    ) -> Reranking:
        """The ``documents`` by relevance to ``query``, best first, at most ``top_n`` (a
        reranker only: ``CapabilityError`` otherwise). Each document is scored in a slot of
        its own, batched like any request; a decoder reranker's documents share the prompt
        before the document (instruction and query), prefilled once (``engine/rerank.py``).
        ``max_tokens_per_doc`` cuts each document to that many tokens (Cohere's). A
        document whose prompt does not fit ``n_ctx`` is ``ContextOverflowError``, or cut to
        fit with ``rerank_truncate``. Past ``timeout_s`` seconds (None: no deadline) the
        documents not yet scored are cancelled and ``RequestTimeoutError`` is raised; once
        ``cancel`` is cancelled (from any thread), ``RequestCancelledError``. ``lora``: the
        adapters to score under, as ``GenerationOptions.lora`` (None: the model's own set);
        its documents' KV lives in that set's namespace."""
        self._check_ready()
        self._require("rerank")
        check_lora(lora)
        self._adapters.check(lora)
        return self._ranker.rerank(
            query,
            documents,
            top_n=top_n,
            max_tokens_per_doc=max_tokens_per_doc,
            cache_salt=cache_salt,
            # Every document under one set: the one named, else the model's as the call begins.
            lora=lora if lora is not None else self._adapters.applied_choice(),
            timeout_s=timeout_s,
            cancel=cancel,
        )

    # ---- adapters -----------------------------------------------------------------------

    def load_adapter(
        self, path: str | os.PathLike[str], scale: float = 1.0, *, name: str = ""
    ) -> AdapterInfo:
        """Load a LoRA adapter and attach it at ``scale`` to the model's own set (0: loaded,
        off except for requests that name it in ``GenerationOptions.lora``)."""
        self._check_ready()
        return self._adapters.load(path, scale, name=name)

    def set_adapter_scale(self, handle: int, scale: float) -> AdapterInfo:
        self._check_ready()
        return self._adapters.set_scale(handle, scale)

    def detach_adapter(self, handle: int) -> None:
        self._check_ready()
        self._adapters.detach(handle)

    def list_adapters(self) -> list[AdapterInfo]:
        return self._adapters.list()

    # ---- lifecycle ----------------------------------------------------------------------

    def evict(self) -> int:
        """Synchronously save every idle slot's live KV (reason ``evict``), then release what
        a row now holds (KV whose save failed stays live: the only copy). Returns the number
        of rows saved."""
        self._check_ready()
        return self._worker.call(
            lambda: self._worker.save_idle_slots(SaveReason.EVICT, release=True)
        ).result()

    def unload(self, timeout_s: float | None = None) -> None:
        """Cancel queued and running requests, save live KV (bounded), free native state.
        Idempotent and thread-safe: a call while another thread unloads the model returns
        once that unload has finished."""
        check_wait(timeout_s)  # before anything changes: a bad one leaves the model as it was
        with self._unload_lock:
            if self._state in ("unloading", "closed"):
                return
            self._state = "unloading"
            limit = timeout_s if timeout_s is not None else self.policy.evict_save_timeout_ms / 1e3
            try:
                if not _teardown(self._worker, self._native(), limit):
                    log.warning(
                        "model %s: the worker did not stop within %.1f s; its native state is "
                        "freed when it does",
                        self.id,
                        limit,
                    )
            finally:
                self._state = "closed"
                self._engine._forget(self.id)

    def __enter__(self) -> Model:
        """``with engine.load_model(...) as model:`` unloads it at the block's end."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.unload()

    def teardown(self) -> Callable[[float], bool]:
        """What ``unload`` does to the worker and the native state, given a time limit, as a
        function that holds no reference to this model: an engine dropped unclosed runs it
        (``Engine``'s finalizer)."""
        return functools.partial(_teardown, self._worker, self._native())

    def _native(self) -> tuple[_Closable, ...]:
        """What holds native state, in the order it is freed (the model itself last)."""
        return (
            self._embedder,
            self._ctx,
            self._adapters,
            *((self._projector,) if self._projector is not None else ()),
            *((self._draft,) if self._draft is not None else ()),
            self._bmodel,
        )

    def _free_native(self) -> None:
        _close_all(self._native())


class _Closable(Protocol):
    def close(self) -> None: ...


def _close_all(parts: Sequence[_Closable]) -> None:
    for part in parts:
        part.close()


def _teardown(worker: Worker, parts: Sequence[_Closable], timeout_s: float) -> bool:
    """Stop ``worker`` (cancelling its requests, saving its idle slots' live KV) and free
    ``parts``; whether the worker stopped within ``timeout_s``. If it did not, it is still
    inside a tick and may hold a numpy array over the context's logits, which llama_free
    would unmap under it: it frees them itself when it ends."""
    stopped = worker.stop(
        lambda: worker.save_idle_slots(SaveReason.SHUTDOWN, release=True), timeout_s
    )
    free = functools.partial(_close_all, parts)
    if stopped:
        free()
    else:
        worker.after_exit(free)
    return stopped


class _Links:
    """The model as its worker and its adapter set call back into it (its namespace, a
    request's adapter set, a change of its own set), through a weak reference. Found by
    review: the worker's thread held the model through bound methods, so an engine dropped
    without ``close()`` kept its models' threads and native memory for the process's life
    (~120 MiB a SmolLM2 engine). The namespace last seen stays for the worker's shutdown
    saves, which run after the model is gone."""

    def __init__(self, model: Model) -> None:
        self._model = weakref.ref(model)
        self._last: Namespace = model._namespace

    def namespace(self) -> Namespace:
        model = self._model()
        if model is not None:
            self._last = model.namespace()
        return self._last

    def resolve(self, choice: LoraChoice | None) -> tuple[AdapterSet, Namespace]:
        model = self._model()
        if model is None:
            raise EngineClosedError("the model was dropped")
        return model._resolve_lora(choice)

    def refresh(self, adapters: Sequence[tuple[bytes, float]]) -> None:
        model = self._model()
        if model is not None:
            model._refresh_namespace(adapters)
            self._last = model.namespace()


if TYPE_CHECKING:
    _IMPLEMENTS: type[ModelOps] = Model  # every operation of ``engine.ops``, in-process


def _check_unchanged(path: Path, before: FileIdentity) -> None:
    """``ModelLoadError`` unless ``path`` is the file it was (``before``) when it began to be
    read and hashed: its fingerprint and its weights are then of one file. The draft model and
    the projector are read first and hashed after (found by review: a file replaced between
    the two loaded the old weights under the new file's key), the model the other way round."""
    if file_identity(path) != before:
        raise ModelLoadError(
            f"{path} changed on disk while it loaded (its fingerprint need not be of the "
            "weights read): load it again"
        )


def _check_prompt_type(prompt: object) -> None:
    """``InvalidRequestError`` unless ``prompt`` is a text or a sequence (of token ids, checked
    later). Found by review: None or a number raised TypeError (``prewarm`` too); bytes passed
    as token ids."""
    if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
        raise InvalidRequestError(
            f"the prompt is a text or a list of token ids, not {type(prompt).__name__}",
            param="prompt",
        )


def _token_ids(tokens: object) -> list[int]:
    """``tokens`` as a list to check, or ``InvalidRequestError``. Found by review, as for a
    prompt: ``detokenize(None)`` raised TypeError, a generator ValueError (it was read twice),
    and bytes were taken for token ids."""
    if isinstance(tokens, str | bytes | bytearray) or not isinstance(tokens, Sequence):
        raise InvalidRequestError(
            f"tokens must be a list of token ids, not {type(tokens).__name__}", param="tokens"
        )
    return list(tokens)


def _order_varies(adapters: Sequence[tuple[bytes, float]]) -> bool:
    """Whether llama.cpp's sum over ``adapters`` (sha256, scale) may run in an order that
    depends on their addresses: it keeps those of a non-zero float32 scale in a
    ``std::unordered_map`` keyed by pointer, whose iteration libstdc++ fixes for two (the
    reverse of insertion) but not for three; other standard libraries hash a pointer's bits,
    so for two already (docs/internals.md, "Three or more LoRA adapters")."""
    live = sum(1 for _, s in adapters if struct.unpack("<f", struct.pack("<f", s))[0] != 0.0)
    return live >= (3 if sys.platform == "linux" else 2)
