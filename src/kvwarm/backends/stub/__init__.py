"""A deterministic, pure-Python backend with the same protocol and errors as llama.cpp.

Model: byte-level. Token ``b + 3`` is the byte ``b``; 0 is ``<unk>``, 1 is BOS ``<s>``, 2 is
EOS ``</s>``; fill-in-the-middle tokens follow the bytes, and a model whose path names ``fim``
reports them (``ModelFacts.fim``), like a GGUF of a code model; one whose path names ``copy``
copies from its context (``StubBackend.copy_bias``). Each KV cell of a sequence
holds ``(pos, token, h)`` where ``h`` chains the previous cell's ``h`` with ``(token, pos)`` —
so a cell depends on the whole prefix, exactly as real KV does, and a restore + prefill is
"bit-identical" to cold iff the prefix matches. Logits are a pure function of the last cell's
``h`` (and the attached adapters), so greedy output depends on the prompt; after a ``!`` the
EOS token wins, so generations end.

Invariants: no native code, no randomness outside seeded samplers; every check the llama.cpp
backend makes is made here too, by the same code (``_checks``, and ``front.ContextFront`` for
the context), with the same exception types; lifetimes follow
``_lifetime`` (a model outlives its contexts, samplers and adapters). The context and its KV
blobs live in ``stub_context``; the vocabulary's fixed ids in ``stub_vocab``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from kvwarm.backends import _checks
from kvwarm.backends.base import (
    EXACT_AT_ANY_LENGTH,
    AdapterSet,
    ContextParams,
    FimTokens,
    ModelFacts,
    ModelParams,
    ProjectorParams,
    Sampler,
    SamplingParams,
    concrete_kv,
)
from kvwarm.backends.chat_template import render_chat
from kvwarm.backends.lifetime import Lifetime
from kvwarm.backends.stub.adapter import StubAdapter
from kvwarm.backends.stub.context import StubContext
from kvwarm.backends.stub.kv_codec import CELL
from kvwarm.backends.stub.projector import StubProjector
from kvwarm.backends.stub.sampler import StubSampler
from kvwarm.backends.stub.vocab import (
    BOS,
    EOS,
    FIM_MID,
    FIM_PAD,
    FIM_PRE,
    FIM_REP,
    FIM_SEP,
    FIM_SUF,
    FIM_TEXT,
    N_BYTE_TOKENS,
    N_EMBD,
    N_VOCAB,
    OFFSET,
    UNK,
)
from kvwarm.errors import (
    AdapterError,
    ConfigError,
    ModelLoadError,
)
from kvwarm.memory import MEMORY_KINDS, MemoryKindName
from kvwarm.unicode import encode_utf8

log = logging.getLogger(__name__)

_SPECIAL_TEXT = {BOS: "<s>", EOS: "</s>", **FIM_TEXT}

#: A stub reranker's prompt (a model whose path names ``reranker``): the query before the
#: document, as Qwen3-Reranker's, so every document of a query shares a prefix.
STUB_RERANK_TEMPLATE = (
    "<|system|>\nJudge whether the document answers the query: yes or no.\n"
    "<|query|>\n{query}\n<|document|>\n{document}\n<|assistant|>\n"
)

STUB_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


#: ``copy_bias`` of a stub model whose path names ``copy``: greedy output then copies.
COPY_BIAS = 8.0

# What a stub model reports as its weights (``ModelFacts.size_bytes``): a notional figure, so
# the memory budget's arithmetic (``server/budget.py``) has something to add up.
STUB_WEIGHTS_BYTES = 64 << 20


class StubBackend:
    """Factory of stub models.

    ``prefill_delay_s`` / ``decode_delay_s`` add simulated latency (per prefilled or embedded
    token / per ``decode`` call) for engine tests; ``cell_bytes`` (>= 16) sets the KV blob
    size per token.
    ``memory_kind`` / ``n_swa`` model llama.cpp's memory kinds (``kvwarm.memory``): a sliding
    window keeps only its last ``n_swa`` cells, a recurrent (or hybrid) state only its last
    one and refuses to be trimmed; a token decoded without the cells it needs gets a poisoned
    hash, so a wrong restore shows in the output as it would on a real model.
    ``weights_bytes`` is what its models report as weights (notional; a context reports
    ``cell_bytes`` per cell as KV), for the memory budget's arithmetic.

    A model whose path names ``reranker`` is a decoder reranker (pooling ``rank``, causal,
    two labels, ``STUB_RERANK_TEMPLATE``); one naming ``cross-encoder`` an encoder (pooling
    ``rank``, not causal, one raw score, ``[BOS] query [EOS] document [EOS]``), whose
    contexts keep nothing after a decode, as a BERT's has no KV cache.
    ``copy_bias`` > 0 makes it copy, as real models do from their context (an "induction"
    head): the token that followed the latest earlier occurrence of the current token gets
    that much added to its logit, so greedy output repeats what the prompt holds (speculative
    decoding's tests need drafts that are accepted, and some that are not).
    """

    @classmethod
    def from_env(cls) -> StubBackend:
        """Default options, with the simulated latency of ``KVWARM_STUB_PREFILL_DELAY_S`` (per
        prefilled token) and ``KVWARM_STUB_DECODE_DELAY_S`` (per decode step) when set: how a
        test or a bench gives processes it does not construct (a cluster's replicas) the
        pace of a real model. ``ConfigError`` for a value that is not a number >= 0."""
        delays = []
        for name in ("KVWARM_STUB_PREFILL_DELAY_S", "KVWARM_STUB_DECODE_DELAY_S"):
            raw = os.environ.get(name, "0")
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not value >= 0:  # also refuses nan
                raise ConfigError(f"{name} must be a number of seconds >= 0, got {raw!r}")
            delays.append(value)
        return cls(prefill_delay_s=delays[0], decode_delay_s=delays[1])

    def __init__(
        self,
        *,
        prefill_delay_s: float = 0.0,
        decode_delay_s: float = 0.0,
        cell_bytes: int = 32,
        n_ctx_train: int = 8192,
        memory_kind: MemoryKindName = "full",
        n_swa: int = 0,
        weights_bytes: int = STUB_WEIGHTS_BYTES,
        media_tokens: int = 16,
        copy_bias: float = 0.0,
    ) -> None:
        if cell_bytes < CELL.size or cell_bytes > 0xFFFF:
            raise ValueError(f"cell_bytes must be in [{CELL.size}, 65535]")
        if memory_kind not in MEMORY_KINDS or (memory_kind == "swa") != (n_swa > 0):
            raise ValueError(f"memory_kind {memory_kind!r} with n_swa={n_swa}")
        self.memory_kind: MemoryKindName = memory_kind
        self.n_swa = n_swa
        self.prefill_delay_s = prefill_delay_s
        self.decode_delay_s = decode_delay_s
        self.cell_bytes = cell_bytes
        self.n_ctx_train = n_ctx_train
        self.weights_bytes = weights_bytes  # notional: what its models report as weights
        self.media_tokens = media_tokens  # positions of one image's span (stub projector)
        #: Set to an Event to hold every projector encode until it is set; an error message
        #: to make every encode fail (tests).
        self.encode_gate: threading.Event | None = None
        self.encode_error: str | None = None
        self.copy_bias = copy_bias

    @property
    def name(self) -> str:
        return "stub"

    def locate(self, path: str | os.PathLike[str] | None) -> Path:
        """Any name will do: a stub model needs no file (one that exists is fingerprinted)."""
        return Path("stub.gguf") if path is None else Path(os.path.expanduser(path))

    def load_model(self, path: str, params: ModelParams | None = None) -> StubModel:
        params = params or ModelParams()
        params.validate()  # the same checks, and errors, as the llama.cpp backend
        if params.progress is not None:
            for fraction in (0.0, 1.0):
                if params.progress(fraction) is False:
                    raise ModelLoadError(f"loading {path!r} was cancelled by the progress callback")
        return StubModel(self, str(path), params)


class StubModel:
    """A byte-level fake model. Any ``path`` loads; it only seeds the model's identity."""

    def __init__(self, backend: StubBackend, path: str, params: ModelParams | None = None) -> None:
        self._backend = backend
        self.params = params or ModelParams()  # what a llama.cpp load would have been given
        self._id = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little")
        name = Path(path).name
        reranker = "reranker" in name
        encoder = "cross-encoder" in name
        #: What its contexts add to the logit of the token its context suggests (``copy``).
        self.copy_bias = backend.copy_bias or (COPY_BIAS if "copy" in Path(path).name else 0.0)
        self._facts = ModelFacts(
            path=path,
            n_vocab=N_VOCAB,
            n_ctx_train=backend.n_ctx_train,
            n_embd=N_EMBD,
            n_layer=1,
            size_bytes=backend.weights_bytes,
            n_params=0,
            description="kvwarm stub (byte-level)",
            file_type=1,  # LLAMA_FTYPE_MOSTLY_F16
            quant_bits=16,
            bos=BOS,
            eos=EOS,
            add_bos=True,
            chat_template=STUB_CHAT_TEMPLATE,
            metadata={"general.architecture": "stub", "general.name": "kvwarm-stub"},
            memory_kind=backend.memory_kind,
            n_swa=backend.n_swa,
            fim=(
                FimTokens(FIM_PRE, FIM_SUF, FIM_MID, FIM_PAD, FIM_REP, FIM_SEP)
                if "fim" in name
                else None
            ),
            pooling="rank" if reranker or encoder else None,
            causal=not encoder,
            n_cls_out=2 if reranker else 1,
            rerank_template=STUB_RERANK_TEMPLATE if reranker else None,
            add_eos=encoder,
        )
        self._life = Lifetime("model", lambda: None)

    @property
    def facts(self) -> ModelFacts:
        self._life.check()
        return self._facts

    @property
    def model_id(self) -> int:
        return self._id

    @property
    def backend(self) -> StubBackend:
        return self._backend

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        encode_utf8(text, param="prompt")  # the same typed error as llama.cpp's backend
        with self._life.using():
            out = [BOS] if add_special else []
            if not parse_special:
                out.extend(b + OFFSET for b in text.encode())
                return out
            rest = text
            while rest:
                hits = [(rest.find(s), t, s) for t, s in _SPECIAL_TEXT.items() if s in rest]
                if not hits:
                    out.extend(b + OFFSET for b in rest.encode())
                    break
                at, token, s = min(hits)
                out.extend(b + OFFSET for b in rest[:at].encode())
                out.append(token)
                rest = rest[at + len(s) :]
            return out

    def detokenize(
        self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False
    ) -> str:
        with self._life.using():
            _checks.check_tokens(tokens, N_VOCAB)
            toks = list(tokens)
            if remove_special:
                if toks and toks[0] == BOS:
                    toks = toks[1:]
                if toks and toks[-1] == EOS:
                    toks = toks[:-1]
            return b"".join(self._piece(t, unparse_special) for t in toks).decode(
                "utf-8", errors="replace"
            )

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        with self._life.using():
            _checks.check_tokens([token], N_VOCAB)
            return self._piece(token, special)

    @staticmethod
    def _piece(token: int, special: bool) -> bytes:
        if OFFSET <= token < N_BYTE_TOKENS:
            return bytes([token - OFFSET])
        return _SPECIAL_TEXT.get(token, "").encode() if special else b""

    def is_eog(self, token: int) -> bool:
        with self._life.using():
            _checks.check_tokens([token], N_VOCAB)
            return token == EOS

    def vocabulary(self) -> tuple[tuple[bytes, ...], frozenset[int]]:
        with self._life.using():
            return tuple(self._piece(t, True) for t in range(N_VOCAB)), frozenset({EOS})

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        template: str | None = None,
    ) -> str:
        with self._life.using():
            return render_chat(
                template or STUB_CHAT_TEMPLATE,
                messages,
                bos_token=_SPECIAL_TEXT[BOS],
                eos_token=_SPECIAL_TEXT[EOS],
                add_generation_prompt=add_generation_prompt,
                tools=tools,
            )

    def context_params(
        self,
        params: ContextParams,
        *,
        deterministic: bool,
        speculative: bool = False,
        exact: bool = True,
    ) -> ContextParams:
        # No attention kernels to choose between: every cell type is exact; ``auto`` is f16.
        return replace(params, type_k=concrete_kv(params.type_k), type_v=concrete_kv(params.type_v))

    @property
    def kernels(self) -> str:
        return ""  # one way to compute

    def kv_tag(self, params: ContextParams, *, deterministic: bool = False) -> str:
        return ""  # one way to compute and store

    def verify_exactness(self, params: ContextParams, adapters: AdapterSet = ()) -> str:
        return EXACT_AT_ANY_LENGTH  # its logits are a function of the prefix alone

    def new_context(self, params: ContextParams) -> StubContext:
        params.validate()
        with self._life.using():
            self._life.acquire()
        return StubContext(self, params)

    def new_sampler(self, params: SamplingParams) -> Sampler:
        with self._life.using():
            self._life.acquire()
            try:
                return StubSampler(
                    params,
                    n_vocab=N_VOCAB,
                    piece=lambda t: self._piece(t, False),
                    is_eog=lambda t: t == EOS,
                    on_free=self._life.release,
                )
            except BaseException:
                self._life.release()
                raise

    def load_adapter(self, path: str) -> StubAdapter:
        with self._life.using():
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise AdapterError(f"cannot read adapter {path!r}: {exc}") from exc
            self._life.acquire()
            return StubAdapter(self, path, hashlib.sha256(data).digest(), len(data))

    def load_projector(self, path: str, params: ProjectorParams) -> StubProjector:
        """Any path loads (its name naming ``audio`` adds audio to what it reads)."""
        with self._life.using():
            return StubProjector(self, str(path), params)

    def close(self) -> None:
        self._life.close()

    def _release(self) -> None:
        self._life.release()


__all__ = [
    "BOS",
    "EOS",
    "N_EMBD",
    "N_VOCAB",
    "OFFSET",
    "STUB_RERANK_TEMPLATE",
    "UNK",
    "StubBackend",
    "StubContext",
    "StubModel",
]
