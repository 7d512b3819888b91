"""Public value types of the engine: request options, results, statistics, model info.

Invariant: a request's sampling defaults are the sampler's (``SamplingParams``): they are
written once, there, and ``GenerationOptions`` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from kvwarm.backends.base import SamplingParams
from kvwarm.cache.explain import ReuseReport

CacheHitKind = Literal["exact", "partial", "cold"]
FinishReason = Literal["stop", "length", "cancelled"]
#: The line stop that ended a reply (``GenerationOptions.n_indent``, ``t_max_predict_ms``).
LineStop = Literal["n_indent", "t_max_predict_ms"]

#: Speculative decoding's draft sources, named as llama-server's ``--spec-type`` names the ones
#: that mean the same (``engine/worker/drafts.py``): "none" (plain decoding), "ngram-simple"
#: (the latest earlier occurrence of the last n tokens in the request's own prompt and reply
#: proposes what followed it), "ngram-map-k" (the same lookup, with each n-gram's drafts capped
#: by how many of its last draft were accepted), "ngram-mod" (each drafted token is what followed
#: the latest earlier occurrence of the n tokens before it, the draft included, so a draft
#: may pass from one occurrence to another), "ngram-map-k4v" (the continuations of the last n
#: tokens are counted, up to 4 distinct ones, and the most frequent is drafted when it is at
#: least twice as frequent as the others together), "ngram-cache" (each drafted token the most
#: frequent follower of the last 4, 3, 2 or 1 tokens, counted in the request's text, else in
#: its tenant's cached rows under stricter thresholds), "draft-simple" (a draft model's greedy
#: tokens: the model's ``draft_model``, ``engine/worker/draftmodel.py``).
SpecType = Literal[
    "none",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "draft-simple",
]
SPEC_TYPES: tuple[str, ...] = get_args(SpecType)
#: Most tokens one draft may hold (a verify pass is one more than its draft). On the CPU a
#: pass of up to 63 tokens of one sequence computes each row as a one-token pass would (flash
#: attention on; measured, ``tests/engine/test_speculative_model.py``; 64 and more run another
#: kernel).
MAX_DRAFT_TOKENS = 62

_SAMPLER = SamplingParams()

#: Longest ``cache_salt`` accepted, in characters: room for a tenant id and a caller's salt,
#: small enough that hashing it is free.
MAX_CACHE_SALT_CHARS = 1024

#: ``GenerationOptions`` fields that are sampler knobs, passed to ``SamplingParams`` unchanged
#: (the server maps its optional request fields of the same names onto these).
SAMPLING_OPTIONS: tuple[str, ...] = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
)

_INT_OPTIONS = (
    "max_tokens",
    "top_k",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "spec_draft_max",
    "n_indent",
    "t_max_predict_ms",
)
_BOOL_OPTIONS = ("deterministic", "add_special", "parse_special", "ignore_eos")
# None allowed
_OPTIONAL = frozenset({"seed", "logprobs", "prompt_logprobs", "spec_draft_max", "deterministic"})
_FLOAT_OPTIONS = tuple(name for name in SAMPLING_OPTIONS if name != "top_k")
_INT32_MAX = (1 << 31) - 1
# llama.cpp's LLAMA_DEFAULT_SEED: its sampler draws a fresh seed for it (so -1 means random,
# as in llama-server).
RANDOM_SEED = 0xFFFF_FFFF


def sampler_seed(seed: int | None) -> int | None:
    """The 32-bit seed both backends' samplers use: any integer modulo 2**32; None, and
    ``RANDOM_SEED`` (so -1 too), for a fresh random one."""
    if seed is None:
        return None
    low = seed & 0xFFFF_FFFF
    return None if low == RANDOM_SEED else low


_MIN_REPEAT_PENALTY = 1e-6
#: The most stop strings a request may give (OpenAI's own limit is 4).
_MAX_STOP = 16
#: Largest per-request LoRA scale magnitude: llama.cpp takes a float32, and a scale this large
#: already overflows a model's activations (NaN logits, which fail the request, never the model).
MAX_LORA_SCALE = 1e6
#: ``GenerationOptions.preserved_tokens``: how many texts, and how long each (a token's text;
#: each is tokenized once per request).
MAX_PRESERVED_TOKENS = 64
MAX_PRESERVED_CHARS = 256


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """Per-request options. Validated by ``validate()`` (``InvalidRequestError``)."""

    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    temperature: float = _SAMPLER.temperature
    top_k: int = _SAMPLER.top_k
    top_p: float = _SAMPLER.top_p
    min_p: float = _SAMPLER.min_p
    typical_p: float = _SAMPLER.typical_p
    repeat_penalty: float = _SAMPLER.repeat_penalty
    frequency_penalty: float = _SAMPLER.frequency_penalty
    presence_penalty: float = _SAMPLER.presence_penalty
    seed: int | None = _SAMPLER.seed
    grammar: str | None = None
    json_schema: Mapping[str, object] | None = None
    #: A lazy ``grammar`` (llama-server's ``grammar_lazy``): the reply is free until one of
    #: these words appears in it, then the grammar, whose text starts with that word, holds;
    #: once complete the reply is free again until the next one (a tool call's grammar: text
    #: and more calls may follow), or with ``grammar_once`` it ends there.
    grammar_triggers: tuple[str, ...] = ()
    #: Regular expressions the lazy grammar also starts at, matched against the reply's text
    #: from its start (llama-server's ``PATTERN_FULL`` triggers: Llama 3.x's bare-JSON call);
    #: the grammar's text starts at the pattern's first group (its whole match without one).
    grammar_start_patterns: tuple[str, ...] = ()
    grammar_once: bool = False
    parent_key: bytes | None = None
    deterministic: bool | None = None  # None: the model's default
    add_special: bool = True  # prepend BOS etc. when tokenizing a text prompt
    parse_special: bool = True  # special-token text in the prompt becomes special tokens
    logprobs: int | None = None  # top-N alternatives per generated token (0: chosen only)
    # top-N alternatives per prompt token (0: the token's own only). The prompt is then
    # prefilled from its first token with logits at every position: no KV is reused for it.
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None  # token id -> bias added to its logit
    ignore_eos: bool = False  # never sample end-of-generation tokens (benchmarks, fixed lengths)
    #: Texts of special tokens that stay in the reply's text (llama-server's
    #: ``preserved_tokens``): a control token's text is otherwise left out of it, as EOS's and
    #: the template's markup are. Each text the vocabulary holds as one token is written into
    #: the reply where that token is generated (the server's tool-call markers, such as
    #: Mistral's ``[TOOL_CALLS]``, so its parser sees them); any other text is plain text
    #: there anyway.
    preserved_tokens: tuple[str, ...] = ()
    # Requests share cached rows and live KV only when they share a salt (None: the unsalted,
    # shared namespace). A tenant's secret: never logged, never written to a row file.
    cache_salt: str | None = None
    # Speculative decoding for this request: a ``SpecType`` name ("none" turns it off; None:
    # the model's ``spec_type``) and the most tokens one draft may hold (None: the model's).
    # A speed hint only: the output is the same either way, and where the model or the request
    # cannot speculate (``ModelInfo.speculation``) it decodes plainly.
    spec_type: str | None = None
    spec_draft_max: int | None = None
    #: Text the reply is expected to repeat for the most part (OpenAI's predicted outputs: a
    #: file sent back with a few lines changed). Where the request speculates with an n-gram
    #: ``spec_type`` other than ngram-cache, it is drafted as an earlier reply given in the
    #: same place would be (``engine/worker/drafts.py``, ``Predicted``), with "ngram-simple"
    #: where the model's own ``spec_type`` is "none"; a ``spec_type`` "none" given with it
    #: turns that off. A speed hint only, as at OpenAI: the reply is what the model writes
    #: either way, and where the model cannot speculate it is not used. Its tokens past the
    #: model's context are not used either.
    prediction: str | None = None
    #: The LoRA adapters this request runs under, as (handle, scale) pairs of the model's
    #: loaded adapters (``Model.list_adapters``); an adapter not listed is off for it (scale
    #: 0, as llama-server's per-request ``lora``). None: the model's adapters at their own
    #: scales. Requests of different sets never share a forward pass, cached rows or live KV
    #: (``engine/adapters.py``).
    lora: tuple[tuple[int, float], ...] | None = None
    #: llama-server's line stops of code completion (llama.vim's, llama.vscode's), 0: off.
    #: ``n_indent``: the reply ends at a line (after its first) whose first character other
    #: than a space or a tab stands in a column below this, an empty line included; that
    #: character and what follows are no part of it. ``t_max_predict_ms``: the reply ends
    #: with a newline generated more than this many milliseconds after its first token.
    #: Either ends it with ``finish_reason`` "length" and says so in ``stopped_by``.
    n_indent: int = 0
    t_max_predict_ms: int = 0

    def validate(self) -> None:
        from kvwarm.errors import InvalidRequestError

        for f in fields(self):
            value = getattr(self, f.name)
            # NaN slips through every range comparison below, and JSON parsers accept NaN and
            # 1e999; no sampling option has a meaning for a non-finite number.
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidRequestError(f"{f.name} must be a finite number", param=f.name)
        self._check_types()
        for name in ("max_tokens", "n_indent", "t_max_predict_ms"):
            if getattr(self, name) < 0:
                raise InvalidRequestError(f"{name} must be >= 0", param=name)
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError("temperature must be in [0, 100]", param="temperature")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0", param="top_k")
        if self.top_k > _INT32_MAX:
            # A C int in llama.cpp: ctypes would keep its low 32 bits (2**32 + 1 is top_k=1).
            raise InvalidRequestError(f"top_k must be <= {_INT32_MAX}", param="top_k")
        # 0 is in OpenAI's and Anthropic's range: llama.cpp's top-p keeps at least one token.
        if not 0.0 <= self.top_p <= 1.0:
            raise InvalidRequestError("top_p must be in [0, 1]", param="top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p must be in [0, 1]", param="min_p")
        if not 0.0 <= self.typical_p <= 1.0:
            raise InvalidRequestError("typical_p must be in [0, 1]", param="typical_p")
        if not _MIN_REPEAT_PENALTY <= self.repeat_penalty <= 10.0:
            # llama.cpp divides a repeated token's float32 logit by it: a vanishing penalty made
            # the logit inf, which a grammar or stored-logits request then refused as a token
            # "the grammar forbids".
            raise InvalidRequestError(
                f"repeat_penalty must be in [{_MIN_REPEAT_PENALTY:g}, 10]", param="repeat_penalty"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2]", param=name)
        self._check_stop()
        if self.grammar is not None and self.json_schema is not None:
            raise InvalidRequestError("give grammar or json_schema, not both", param="grammar")
        self._check_text()
        self._check_triggers()
        self._check_preserved()
        self._check_salt()
        self._check_lora()
        if self.parent_key is not None and len(self.parent_key) != 32:
            raise InvalidRequestError("parent_key must be 32 bytes", param="parent_key")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise InvalidRequestError(f"{name} must be in [0, 20]", param=name)
        self._check_spec()
        for token, bias in (self.logit_bias or {}).items():
            # A C int32 in llama.cpp: a larger id would overflow (the vocab check comes later).
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 1 << 31:
                raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(
                    "logit_bias values must be in [-100, 100]", param="logit_bias"
                )

    def _check_types(self) -> None:
        """Numbers are numbers (a bool is not): a string would be a ``TypeError`` below, and a
        float reaching a C int a ``ctypes.ArgumentError`` on the worker thread."""
        from kvwarm.errors import InvalidRequestError

        for name in _INT_OPTIONS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequestError(f"{name} must be an integer", param=name)
        for name in _FLOAT_OPTIONS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequestError(f"{name} must be a number", param=name)
        if not isinstance(self.stop, tuple | list):
            # Found by review: stop=5 was a TypeError (object of type 'int' has no len()).
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        if self.logit_bias is not None and not isinstance(self.logit_bias, Mapping):
            raise InvalidRequestError("logit_bias must map token ids to biases", param="logit_bias")
        # Found by review: these were taken for their truth, so ignore_eos="false" generated
        # to max_tokens, add_special="no" added BOS, and deterministic="no" asked for a
        # bit-identical request; all without a word.
        for name in _BOOL_OPTIONS:
            value = getattr(self, name)
            if not (value is None and name in _OPTIONAL):
                check_flag(value, name)
        if self.parent_key is not None and not isinstance(self.parent_key, bytes):
            # It was a TypeError for a number or a list, and a 32-character str passed and was
            # waited for (session_resume_wait_ms) as a key no row can have.
            raise InvalidRequestError(
                "parent_key must be bytes: a previous completion's stats.key (bytes.fromhex "
                f"of its hex), not {type(self.parent_key).__name__}",
                param="parent_key",
            )
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise InvalidRequestError(
                    f"logit_bias of token {token!r} must be a number", param="logit_bias"
                )

    def _check_stop(self) -> None:
        """At most 16 stop strings, none empty: an empty one would match at every position,
        and dropping it silently (as the server did) hid the client's mistake."""
        from kvwarm.errors import InvalidRequestError

        if len(self.stop) > _MAX_STOP:
            raise InvalidRequestError(
                f"stop must be at most {_MAX_STOP} strings, not {len(self.stop)}", param="stop"
            )
        for i, s in enumerate(self.stop):
            if not isinstance(s, str):
                raise InvalidRequestError(
                    f"stop must be strings: item {i} is {type(s).__name__}", param="stop"
                )
            if not s:
                raise InvalidRequestError(
                    f"stop must not hold an empty string (item {i}): an empty stop sequence "
                    "would match everywhere; leave it out",
                    param="stop",
                )

    def _check_text(self) -> None:
        """Stop strings, grammar, schema and prediction reach ``str.encode``: no lone
        surrogates."""
        from kvwarm.errors import InvalidRequestError
        from kvwarm.unicode import encode_utf8, find_lone_surrogate

        for s in self.stop:
            encode_utf8(s, param="stop")
        if self.prediction is not None:
            encode_utf8(self.prediction, param="prediction")
        if self.grammar is not None:
            encode_utf8(self.grammar, param="grammar")
        if self.json_schema is not None and find_lone_surrogate(self.json_schema) is not None:
            raise InvalidRequestError(
                "json_schema contains a lone UTF-16 surrogate", param="json_schema"
            )

    def _check_triggers(self) -> None:
        from kvwarm.backends.lazy_grammar import trigger_watch
        from kvwarm.errors import InvalidRequestError

        triggers = self.grammar_triggers
        starts = self.grammar_start_patterns
        for name, value in (("grammar_triggers", triggers), ("grammar_start_patterns", starts)):
            if not isinstance(value, tuple | list) or not all(isinstance(t, str) for t in value):
                raise InvalidRequestError(f"{name} must be a list of strings", param=name)
        if not isinstance(self.grammar_once, bool):
            raise InvalidRequestError("grammar_once must be true or false", param="grammar_once")
        if self.json_schema is not None and (triggers or starts):
            name = "grammar_triggers" if triggers else "grammar_start_patterns"
            raise InvalidRequestError(
                f"{name} start a grammar (GBNF), not a json_schema", param=name
            )
        trigger_watch(
            SamplingParams(
                grammar=self.grammar,
                grammar_triggers=tuple(triggers),
                grammar_start_patterns=tuple(starts),
                grammar_once=self.grammar_once,
            )
        )

    def _check_preserved(self) -> None:
        from kvwarm.errors import InvalidRequestError
        from kvwarm.unicode import encode_utf8

        kept = self.preserved_tokens
        if (
            not isinstance(kept, tuple | list)
            or len(kept) > MAX_PRESERVED_TOKENS
            or not all(isinstance(t, str) and 0 < len(t) <= MAX_PRESERVED_CHARS for t in kept)
        ):
            raise InvalidRequestError(
                f"preserved_tokens must be a list of at most {MAX_PRESERVED_TOKENS} non-empty "
                f"strings of at most {MAX_PRESERVED_CHARS} characters",
                param="preserved_tokens",
            )
        for text in kept:
            encode_utf8(text, param="preserved_tokens")

    def _check_spec(self) -> None:
        from kvwarm.errors import InvalidRequestError

        if self.spec_type is not None and self.spec_type not in SPEC_TYPES:
            raise InvalidRequestError(
                f"spec_type must be one of {', '.join(SPEC_TYPES)}; got {self.spec_type!r}",
                param="spec_type",
            )
        n = self.spec_draft_max
        if n is not None and not 0 <= n <= MAX_DRAFT_TOKENS:
            raise InvalidRequestError(
                f"spec_draft_max must be in [0, {MAX_DRAFT_TOKENS}]", param="spec_draft_max"
            )

    def _check_salt(self) -> None:
        from kvwarm.errors import InvalidRequestError
        from kvwarm.unicode import encode_utf8

        salt = self.cache_salt
        if salt is None:
            return
        if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError(
                f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters",
                param="cache_salt",
            )
        encode_utf8(salt, param="cache_salt")

    def _check_lora(self) -> None:
        check_lora(self.lora)

    def salt_bytes(self) -> bytes | None:
        """The salt as the cache folds it into a namespace (``cache.key.salted_namespace``)."""
        return None if self.cache_salt is None else self.cache_salt.encode("utf-8")

    def sampling(
        self, grammar: str | None, banned: tuple[int, ...] = (), preserved: Iterable[int] = ()
    ) -> SamplingParams:
        """The sampler chain for these options; ``banned`` tokens get a bias of -inf;
        ``preserved``: the special tokens whose text the reply keeps (``Request.preserved``)."""
        bias = dict(self.logit_bias or {})
        for token in banned:
            bias[token] = float("-inf")
        knobs = {name: getattr(self, name) for name in SAMPLING_OPTIONS}
        return SamplingParams(
            logit_bias=tuple(sorted(bias.items())),
            seed=sampler_seed(self.seed),
            grammar=grammar,
            grammar_triggers=tuple(self.grammar_triggers),
            grammar_start_patterns=tuple(self.grammar_start_patterns),
            grammar_once=self.grammar_once,
            preserved_tokens=tuple(sorted(preserved)),
            **knobs,
        )


@dataclass(frozen=True, slots=True)
class CompletionStats:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens restored from the cache or a slot's live KV
    completion_tokens: int
    #: From its admission to its prompt's KV complete: its caller's time to the first token
    #: less the queue. A fork's (``n > 1``) is its wait for the first choice's prefill, which
    #: the model's prefill time (``ModelStatus.prefill_ms``) counts once, not per choice.
    prefill_ms: float
    generation_ms: float
    queue_ms: float
    cache_hit: CacheHitKind
    finish_reason: FinishReason
    key: bytes | None  # key of the finish save (prompt + reply): pass as the next parent_key
    stop_sequence: str | None = None  # the ``stop`` string that ended the reply, if one did
    #: The line stop that ended the reply, if one did (``finish_reason`` then "length", as
    #: llama-server's "limit"; neither ``max_tokens`` nor the context was used up).
    stopped_by: LineStop | None = None
    #: What the planner found and why it reused no more (``kvwarm.cache.explain``); None for
    #: a request that never reached a slot (cancelled while queued) or a fork (``n > 1``)
    #: that ended before it got the first choice's prompt KV.
    reuse: ReuseReport | None = None
    #: Speculative decoding: tokens drafted for verify passes, and how many of them the model
    #: accepted (llama-server's ``draft_n`` and ``draft_n_accepted``); 0 and 0 without it.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: Tokens sampled (an end-of-generation token included), and the milliseconds from the
    #: first one's sampling to the last one's: the decode steps alone, what llama-server
    #: times as ``predicted_n`` and ``predicted_ms`` (``generation_ms`` starts before the
    #: first token is sampled and ends with the reply's finish). ``decode_steps``: the tokens
    #: of that time, the first coming from the prompt's pass (``sampled_tokens - 1``; a sum of
    #: them over a multi-prompt request's replies).
    sampled_tokens: int = 0
    decode_steps: int = 0
    decode_ms: float = 0.0

    @property
    def decode_per_second(self) -> float:
        """Tokens a second over the decode steps (llama-server's ``predicted_per_second``);
        0 where no step was timed."""
        if self.decode_steps <= 0 or self.decode_ms <= 0.0:
            return 0.0
        return self.decode_steps * 1e3 / self.decode_ms

    @property
    def ttft_ms(self) -> float:
        return self.queue_ms + self.prefill_ms

    @property
    def written_tokens(self) -> int:
        """Prompt tokens this request prefilled and saved with its reply's finish row (``key``),
        0 where no row was saved: what the wire formats report as written to the cache
        (Anthropic's ``cache_creation_input_tokens``, Responses' ``cache_write_tokens``)."""
        return self.prompt_tokens - self.cached_tokens if self.key is not None else 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    prompt_tokens: tuple[int, ...]
    completion_tokens: tuple[int, ...]
    stats: CompletionStats
    logprobs: tuple[TokenLogprob, ...] | None = None
    # With ``prompt_logprobs``: one entry per prompt token after the first (the first has no
    # context to be predicted from).
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    #: A rerank document's relevance score (its request scores, generating nothing); None for
    #: a generation.
    score: float | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        """The full token list: prompt then completion."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class RerankResult:
    """One document of a rerank: its index in the request and its relevance score (a
    decoder reranker's p("yes"), a cross-encoder's raw score: llama-server's numbers)."""

    index: int
    relevance_score: float


@dataclass(frozen=True, slots=True)
class Reranking:
    """``Model.rerank``'s answer: the documents best first (ties: the earlier document
    first), at most ``top_n``; ``prompt_tokens`` every document's prompt counted in full (as
    llama-server counts them), ``cached_tokens`` of those reused instead of prefilled (the
    query's prefix shared between documents, from another slot or a cache row)."""

    results: tuple[RerankResult, ...]
    prompt_tokens: int
    cached_tokens: int = 0


#: What a model can be asked to do: ``generate`` (completions, chats, prewarm) and ``embed``,
#: or, for a model whose pooling is rank, ``rerank`` alone.
Capability = Literal["generate", "embed", "rerank"]


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    handle: int
    path: str
    scale: float
    sha256: str
    name: str = ""  # the name it was loaded under (``ModelConfig.lora``), if any
    #: What it holds in memory: its LoRA tensors' bytes (``Adapter.size_bytes``).
    size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    path: str
    backend: str
    n_ctx: int
    n_batch: int
    n_parallel: int
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    size_bytes: int
    description: str
    fingerprint: str  # hex, effective (adapters folded)
    fingerprint_mode: str
    save_tier: str
    chat_template: bool
    #: The template chats render with: "gguf" (the file's own), a built-in name ("chatml",
    #: "gemma", ...; "chatml (fallback)" for a GGUF with none), or "file:<sha256 prefix>".
    chat_template_name: str = "gguf"
    adapters: tuple[AdapterInfo, ...] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    # How it runs (ModelParams / ContextParams), as /v1/models reports it.
    n_gpu_layers: int = 0
    flash_attn: str = "auto"
    type_k: str = "f16"
    type_v: str = "f16"
    #: What a saved or live state can resume from (``kvwarm.memory``): "full", "swa",
    #: "recurrent" or "hybrid"; ``n_swa`` the sliding window (0 unless "swa"); ``swa_full``
    #: whether the context keeps full-size SWA layers (then their state trims like "full").
    memory: str = "full"
    n_swa: int = 0
    swa_full: bool = False
    #: What it holds in memory: its weights (``size_bytes``: llama_model_size), its context's
    #: KV (and recurrent-state) buffers, and all its context's buffers (KV, output, compute).
    #: An embeddings context, made on first use, is not counted.
    kv_bytes: int = 0
    context_bytes: int = 0
    #: What it can be asked to do, and how it pools (``rank``: a reranker; the setting
    #: ``pooling`` overrides what the GGUF declares).
    capabilities: tuple[Capability, ...] = ("generate", "embed")
    pooling: str = "mean"
    #: Speculative decoding: the draft source requests get unless they choose
    #: (``GenerationOptions.spec_type``), and whether this model can speculate at all: "on",
    #: "on while a sequence is shorter than its N-token window", or "off: " and why (a memory
    #: that cannot roll back, deterministic mode).
    spec_type: str = "none"
    speculation: str = "on"
    #: Where a greedy speculative reply is token for token plain decoding's
    #: (``BackendModel.verify_exactness``: "at any length", "while ..."); None where the model
    #: cannot speculate.
    speculation_exact: str | None = None
    #: The draft model's GGUF (``ModelConfig.draft_model``; None: none) and its weights (its
    #: context's buffers count in ``kv_bytes`` and ``context_bytes``).
    draft_model: str | None = None
    draft_bytes: int = 0
    #: Its multimodal projector (``--mmproj``): the file, what it reads ("image", "audio";
    #: empty: text only) and what it holds in memory (weights and compute buffers).
    mmproj: str | None = None
    media: tuple[str, ...] = ()
    projector_bytes: int = 0
    #: Its loaded LoRA adapters' weights (each one's ``AdapterInfo.size_bytes``), loaded at
    #: scale 0 or not: llama.cpp holds them all the same.
    adapter_bytes: int = 0


# "fork": holds one of an n > 1 request's other choices, waiting for the first choice's
# prompt to be prefilled (``engine/worker/forks.py``).
SlotPhase = Literal["idle", "prefill", "generate", "fork"]


@dataclass(frozen=True, slots=True)
class SlotStatus:
    """One slot as its worker last published it (between ticks; see ``Worker.slot_statuses``).

    ``n_tokens`` is the length of the sequence the slot holds in the context (kept after a
    request ends, so the next one sharing its prefix can reuse it); ``canonical`` of them came
    from aligned prefill. The request fields are zero (and ``cache_hit`` None) while idle.
    """

    seq: int
    phase: SlotPhase
    n_tokens: int
    canonical: int
    last_used: float  # unix seconds: when its last request ended (or the slot was made)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    cache_hit: CacheHitKind | None = None


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """A model's live counters and slots (``Model.status``). ``state`` is ``failed`` once its
    worker thread died (``Model.worker_failure``): it serves nothing from then on, and offers
    no free slot."""

    id: str
    state: Literal["loading", "ready", "unloading", "closed", "failed"]
    queued: int
    active: int
    n_parallel: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    #: The prefills run, once each: an ``n > 1`` request's forks add none (their
    #: ``CompletionStats.prefill_ms`` is their wait for the first choice's).
    prefill_ms: float
    generation_ms: float
    kv_cells_used: int = 0  # context cells the slots hold (an external router's load signal)
    kv_cells: int = 0  # the context's cells: n_ctx for each of the n_parallel slots
    slots: tuple[SlotStatus, ...] = ()
    prefilled_tokens: int = 0  # prompt tokens run through the model (not restored or forked)
    #: Speculative decoding: tokens drafted and accepted (finished requests), the slots'
    #: passes that verified a draft, and the filler rows that padded such passes to a whole
    #: tile of the CPU's matrix kernel (``drafts.Cost.pad``).
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0
    filler_rows: int = 0
    #: The cache's upkeep (``Model.prewarm``: keep-alive's re-warms, ``/cache/prewarm``,
    #: ``--prewarm-system``), none of it in the counts above: prewarms ended, their prompt
    #: tokens, of them reused and run through the model, and their prefill time.
    prewarms: int = 0
    prewarm_prompt_tokens: int = 0
    prewarm_cached_tokens: int = 0
    prewarm_prefilled_tokens: int = 0
    prewarm_ms: float = 0.0

    @property
    def free_slots(self) -> int:
        """Slots a request could take now: none unless the model is ready (found by review: a
        model whose worker died offered all its slots, to a cluster's router among others)."""
        return max(0, self.n_parallel - self.active) if self.state == "ready" else 0

    @property
    def kv_cache_usage(self) -> float:
        """Share of the context's cells in use, 0..1 (what vLLM calls kv_cache_usage_perc)."""
        return self.kv_cells_used / self.kv_cells if self.kv_cells else 0.0


def check_lora(lora: object) -> None:
    """``InvalidRequestError`` unless ``lora`` is None or (handle, scale) pairs: each handle
    once, each scale finite and within ``MAX_LORA_SCALE`` (``GenerationOptions.lora``, the
    ``lora`` of ``Model.embed``)."""
    from kvwarm.errors import InvalidRequestError

    if lora is None:
        return
    if not isinstance(lora, tuple | list):
        raise InvalidRequestError("lora must be a list of (handle, scale)", param="lora")
    seen: set[int] = set()
    for item in lora:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidRequestError("lora must be a list of (handle, scale)", param="lora")
        handle, scale = item
        if isinstance(handle, bool) or not isinstance(handle, int) or handle < 0:
            raise InvalidRequestError(f"lora handle {handle!r} is not an id", param="lora")
        if handle in seen:
            raise InvalidRequestError(f"lora lists adapter {handle} twice", param="lora")
        seen.add(handle)
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise InvalidRequestError(f"lora scale {scale!r} is not a number", param="lora")
        if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
            raise InvalidRequestError(
                f"lora scale {scale!r} must be finite and within +-{MAX_LORA_SCALE:g}",
                param="lora",
            )


def check_flag(value: object, name: str) -> bool:
    """A switch, which must be a bool (``InvalidRequestError``): found by review, strings were
    taken for their truth without a word (``ignore_eos="false"`` generated to ``max_tokens``,
    ``embed(..., normalize="no")`` normalized, ``add_special="no"`` added BOS)."""
    from kvwarm.errors import InvalidRequestError

    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, not {value!r}", param=name)
    return value
