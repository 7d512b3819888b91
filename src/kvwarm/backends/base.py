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

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, overload, runtime_checkable

from kvwarm.backends.kv_codec import KvCodec

# Parameters are the protocol's vocabulary; they live in params.py and are re-exported here.
from kvwarm.backends.params import (
    DEFAULT_KV_TYPE,
    FLASH_ATTN_MODES,
    KV_TYPES,
    POOLING_BY_ID,
    POOLING_TYPES,
    QUANTIZED_KV_TYPES,
    ROPE_SCALINGS,
    SPLIT_MODES,
    Buffer,
    ContextParams,
    FlashAttn,
    KvType,
    ModelParams,
    PoolingType,
    ProgressCallback,
    RopeScaling,
    SplitMode,
    WritableBuffer,
    check_tensor_split,
    concrete_kv,
)

# The codec protocol lives beside its implementations' helpers; re-exported here.
from kvwarm.media import Media, MediaKind
from kvwarm.memory import MemoryKind, MemoryKindName

__all__ = [
    "ContextMemory",
    "KvType",
    "PoolingType",
    "SplitMode",
    "FlashAttn",
    "RopeScaling",
    "KV_TYPES",
    "QUANTIZED_KV_TYPES",
    "concrete_kv",
    "DEFAULT_KV_TYPE",
    "SPLIT_MODES",
    "FLASH_ATTN_MODES",
    "ROPE_SCALINGS",
    "POOLING_BY_ID",
    "POOLING_TYPES",
    "Buffer",
    "WritableBuffer",
    "ProgressCallback",
    "ModelParams",
    "check_tensor_split",
    "ContextParams",
    "SamplingParams",
    "BatchToken",
    "FimTokens",
    "ModelFacts",
    "Sampler",
    "Adapter",
    "MediaSpan",
    "LayoutPiece",
    "ProjectorFacts",
    "ProjectorParams",
    "Projector",
    "AdapterSet",
    "KvCodec",
    "BackendContext",
    "BackendModel",
    "Backend",
    "json_schema_to_grammar",
]


#: Temperatures below this sample greedily. Such a distribution is the argmax already (two
#: logits one float32 step apart near 1, 1e-7, are a factor e**-1000 apart at 1e-10), and
#: llama.cpp divides float32 logits by the temperature: under ~1e-37 that overflows to inf, the
#: softmax of inf is NaN, and its dist sampler then drew an arbitrary token (found by review:
#: ``temperature=1e-45`` generated garbage where greedy generates sense).
GREEDY_BELOW = 1e-10


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """A sampler chain. ``temperature < GREEDY_BELOW`` (0 included) means greedy (argmax),
    ignoring the others."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0  # locally typical sampling (llama-server's typical_p); 1: off
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    grammar: str | None = None
    grammar_root: str = "root"
    #: A lazy grammar (``backends/lazy_grammar.py``): the reply is free until one of these
    #: words appears in it, then the grammar holds from that word on; once complete, the reply
    #: is free again until the next one, or with ``grammar_once`` it ends there.
    grammar_triggers: tuple[str, ...] = ()
    #: Regular expressions a lazy grammar also starts at, matched at the reply's start only
    #: (a format without an opener: Llama 3.x's bare-JSON call); see ``lazy_grammar``.
    grammar_start_patterns: tuple[str, ...] = ()
    grammar_once: bool = False
    #: Special tokens a grammar may match (a tool call's markers, whose text the reply keeps:
    #: ``Request.preserved``). Any other control token is masked while a grammar holds: the
    #: grammar matches its text (``<|im_start|>``), but a reply's text leaves it out.
    preserved_tokens: tuple[int, ...] = ()
    # (token, bias) added to the raw logits before any other step; -inf bans a token.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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
    #: The model's memory kind (``kvwarm.memory``): what its per-sequence state can resume from.
    memory_kind: MemoryKindName = "full"
    #: The sliding window of its SWA layers (``memory_kind`` "swa"), else 0.
    n_swa: int = 0
    #: The pooling the GGUF declares (``{arch}.pooling_type``): ``rank`` for a reranker;
    #: None where it declares none.
    pooling: PoolingType | None = None
    #: Whether its attention is causal (``{arch}.attention.causal``): false for an encoder
    #: (a BERT cross-encoder), each of whose positions depends on the whole sequence.
    causal: bool = True
    #: Values a rank-pooling context gives per sequence (its classifier's labels; 1 without).
    n_cls_out: int = 1
    #: The GGUF's rerank prompt (``tokenizer.chat_template.rerank``) with ``{query}`` and
    #: ``{document}`` in it; None: the pair ``[BOS] query [EOS] [SEP] document [EOS]``.
    rerank_template: str | None = None
    sep: int | None = None  # the separator token, if the vocabulary has one
    add_eos: bool = False  # whether the vocabulary ends a text with EOS (BERT's [SEP])
    add_sep: bool = False  # whether it puts a separator between two texts
    #: The most positions one sequence may hold where the model reads its positions from a
    #: table (a ``position_embd.weight``: BERT, GPT-2; its rows, ``n_ctx_train``): llama.cpp
    #: GGML_ASSERTs on a position past it. None: positions are unbounded (RoPE, ALiBi).
    n_pos: int | None = None
    #: How many of a pass's rows the CPU multiplies some of the weights against at once
    #: (llamafile's tinyBLAS: 4 with AVX-512); 1 where no such kernel runs (a GPU, another
    #: build). A pass of more rows than that, not a multiple of it, reads those weights once
    #: more: speculative decoding sizes its drafts by it (``engine/worker/drafts.Cost``).
    pass_tile: int = 1
    #: The share of the matrix weights' bytes multiplied that way: about what the extra read
    #: costs, in one-token passes, until verify passes are timed.
    pass_tile_share: float = 0.0


@runtime_checkable
class Sampler(Protocol):
    """A stateful sampler chain bound to one model's vocabulary."""

    def sample(self, ctx: BackendContext, index: int) -> int:
        """Sample from the logits of batch row ``index`` (-1: last) and accept the token."""
        ...

    def argmax_rows(self, ctx: BackendContext, first: int, count: int) -> list[int] | None:
        """Where sampling is a stateless argmax (plain greedy): the tokens ``sample`` would
        return for batch rows ``first .. first + count - 1``, all at once (a verify pass's
        rows); None where each row must go through ``sample`` in turn."""
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

    @property
    def size_bytes(self) -> int:
        """What it holds in memory: its LoRA tensors' bytes, as the backend allocates them
        (the memory budget counts them with its model's weights)."""
        ...

    def close(self) -> None: ...


#: LoRA adapters with their scales, as a context has them attached (``set_adapters``).
AdapterSet = tuple[tuple[Adapter, float], ...]


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """A media chunk of a projector's layout: ``n_tokens`` positions of embeddings of
    ``kind``, decoded whole (``BackendContext.decode_embd``)."""

    n_tokens: int
    kind: MediaKind


#: One piece of how a projector lays out an image or clip in a prompt: text token ids (the
#: markers around it, ``<start_of_image>`` ...) or a span of embeddings.
LayoutPiece = tuple[int, ...] | MediaSpan


@dataclass(frozen=True, slots=True)
class ProjectorParams:
    """How a projector (``--mmproj``) runs: CPU threads (None: every CPU this process may
    use) and whether it may use a GPU."""

    n_threads: int | None = None
    use_gpu: bool = False


@dataclass(frozen=True, slots=True)
class ProjectorFacts:
    """A loaded multimodal projector: what it reads (``kinds``), the width of the
    embeddings it hands the text model (``n_embd``, the model's input width), the kinds whose
    spans attend to themselves non-causally (``non_causal``: Gemma 3's images; decoded in one
    ubatch), its audio sample rate (0 without audio) and the memory it holds (weights and
    compute buffers)."""

    path: str
    kinds: tuple[MediaKind, ...]
    n_embd: int
    non_causal: tuple[MediaKind, ...]
    audio_sample_rate: int
    memory_bytes: int
    description: str = ""


@runtime_checkable
class Projector(Protocol):
    """A model's multimodal projector (llama.cpp's ``mtmd``): media in, embeddings out.
    Thread-safe: ``layout`` runs on callers' threads, ``encode`` one at a time anywhere."""

    @property
    def facts(self) -> ProjectorFacts: ...

    def layout(self, media: Media) -> tuple[LayoutPiece, ...]:
        """How ``media`` sits in a prompt: marker tokens and spans, in order (no encoding).
        ``InvalidRequestError`` if this projector cannot read it."""
        ...

    def encode(self, media: Media, index: int) -> bytes:
        """The float32 embeddings (``n_tokens * n_embd``) of the ``index``-th span of
        ``layout(media)``. ``BackendError`` if the encoder fails."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ContextMemory:
    """What a context holds in memory, as its backend allocated it: ``kv_bytes`` the KV (and
    recurrent-state) buffers, ``other_bytes`` the rest (output logits, compute scratch)."""

    kv_bytes: int = 0
    other_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.other_bytes


@runtime_checkable
class BackendContext(Protocol):
    """One inference context with ``n_seq_max`` sequences, driven by a single thread."""

    @property
    def memory_bytes(self) -> ContextMemory:
        """The buffers this context allocated (``ContextMemory``)."""
        ...

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

    def decode_embd(
        self,
        seq: int,
        start_pos: int,
        embd: Buffer,
        n_tokens: int,
        *,
        non_causal: bool,
        logits: bool = False,
    ) -> None:
        """One forward pass over ``n_tokens`` rows of float32 embeddings (a media span) at
        positions ``start_pos…`` of ``seq``, alone and whole: ``n_tokens <= n_batch``, and a
        span that attends to itself ``non_causal``-ly fits one ubatch. ``logits``: keep the last
        row's logits (row ``n_tokens - 1``). ``InvalidRequestError`` for a bad size or a
        position that does not continue ``seq``."""
        ...

    def logits(self, index: int = -1) -> memoryview:
        """float32 logits (n_vocab) of batch row ``index``; ``NoLogitsError`` if none."""
        ...

    def logits_block(self, first: int, count: int) -> memoryview:
        """float32 logits of the ``count`` consecutive batch rows from ``first`` (a verify
        pass's), row after row (``count * n_vocab``); ``NoLogitsError`` unless the last
        decode asked for logits at every one of them."""
        ...

    def kv_pack(self, seq: int) -> bytes:
        """The sequence's KV state as one blob (``llama_state_seq_get_data``)."""
        ...

    def kv_pack_tail(self, seq: int, start: int) -> tuple[bytes, int]:
        """``(blob, first)``: the sequence's positions from ``start`` on, as a blob the codec
        splits into the same chunks the whole sequence's blob gives for those positions, with
        ``first == start``; where this context cannot pack a part of a sequence (no scratch
        sequence, several KV streams, a memory whose state is not per-position cells) it is
        ``(kv_pack(seq), 0)``. For a finish save whose leading chunks a tier already holds:
        only the new positions are copied out of the context."""
        ...

    def kv_unpack(self, seq: int, data: bytes | bytearray | memoryview) -> int:
        """Restore a blob into ``seq`` (cleared first) without copying it; returns the number
        of token positions now in the sequence. ``StateRestoreError`` on a bad blob."""
        ...

    def kv_unpack_chunks(self, seq: int, chunks: Sequence[Buffer], *, base: int = 0) -> int | None:
        """Restore a row's chunks (covering ``[0, n)`` in order) into ``seq`` (cleared first),
        each read in place from its own buffer, with no join copy; the number of positions
        now in the sequence. None, with ``seq`` untouched, when this context cannot (chunks
        of an older format, no room for a scratch sequence): ``kv_join`` them into a buffer
        and ``kv_unpack`` that. ``StateRestoreError`` on bad chunks (``seq`` left empty).

        ``base`` > 0 is a tail restore (only where ``restores_tails``): ``seq`` holds exactly
        positions ``[0, base)`` -- live KV of the same tokens the row holds there -- and keeps
        them; the chunks cover ``[base, n)``. ``StateRestoreError`` if ``seq`` holds anything
        else; on any failure the caller must reset ``seq``."""
        ...

    def kv_unpack_joined(
        self,
        seq: int,
        chunks: Sequence[Buffer],
        out: WritableBuffer,
        *,
        rest: Buffer = b"",
        rest_chunks: Sequence[Buffer] = (),
        rest_from: int = 0,
    ) -> int:
        """Join a row into ``out`` (``kv_codec.join(chunks)`` followed by ``rest``, a row's
        state kept whole after its chunked first cache, or by its window joined from
        ``rest_chunks`` from position ``rest_from``: ``kv_codec.join_rest``) and restore that
        blob into ``seq`` (cleared first); the number of positions it now holds. As
        ``kv_unpack`` of the joined blob, but a backend may check only what its codec's join
        does not guarantee (llama.cpp: the cells' positions against ``n_ctx``, since a join
        writes only the checked chunks' canonical cells). ``JoinBufferTooSmallError`` (with
        the size needed) when ``out`` is too short, and ``StateRestoreError`` for bad chunks,
        both with ``seq`` untouched; ``StateRestoreError`` with ``seq`` left empty when the
        joined blob is refused. A backend may restore a window row one cache at a time, each
        joined into ``out`` just before it is read (llama.cpp's iSWA memory: ``WindowJoin``);
        ``out`` then needs only the larger of the two caches' blobs, and the state is the
        joined blob's."""
        ...

    @property
    def restores_tails(self) -> bool:
        """Whether ``kv_unpack_chunks`` can put a row's later chunks on live KV of its
        earlier ones (``base`` > 0): a state that trims like full attention, and room for a
        scratch sequence in one KV stream."""
        ...

    @property
    def copies_by_pack(self) -> bool:
        """Whether ``seq_cp`` goes through a pack and an unpack (a KV stream per sequence):
        the copy then holds only what a saved state of the source would (a sliding window
        leaves out the masked cells its live state still keeps), so it resumes only where
        such a saved state does (``MemoryKind.saved_floor``), not where the live source
        does."""
        ...

    @property
    def kv_codec(self) -> KvCodec:
        """This context's chunk codec (pure, any thread, outlives the context)."""
        ...

    def kv_split(self, blob: Buffer, bounds: Sequence[int]) -> list[bytes]:
        """``kv_codec.split``; ``HandleClosedError`` after close."""
        ...

    @overload
    def kv_join(self, chunks: Sequence[Buffer], out: None = None) -> bytearray: ...
    @overload
    def kv_join(self, chunks: Sequence[Buffer], out: WritableBuffer) -> memoryview: ...
    def kv_join(
        self, chunks: Sequence[Buffer], out: WritableBuffer | None = None
    ) -> bytearray | memoryview:
        """``kv_codec.join``; ``HandleClosedError`` after close."""
        ...

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Remove positions ``[p0, p1)`` (``p1 < 0``: to the end) from ``seq``.

        ``StateRestoreError`` when the model's memory refuses (a recurrent state cannot lose
        its last positions); the sequence is then as it was. Removing positions a sliding
        window still needs succeeds and leaves a state that is not a prefix's: callers ask
        ``kvwarm.memory`` first."""
        ...

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Share positions ``[p0, p1)`` of ``src`` with ``dst`` (no copy of tensors)."""
        ...

    def seq_pos_max(self, seq: int) -> int:
        """Largest position held by ``seq``, -1 if empty."""
        ...

    def seq_pos_min(self, seq: int) -> int:
        """Smallest position ``seq`` still holds, -1 if empty. Above 0 when a sliding window
        dropped older positions or a recurrent state holds only its last one."""
        ...

    @property
    def memory(self) -> MemoryKind:
        """What this context's per-sequence state can resume from (``kvwarm.memory``)."""
        ...

    def clear(self) -> None:
        """Drop every sequence's KV state."""
        ...

    def reserve_outputs(self, rows: int) -> None:
        """Make room now for a pass that wants logits at ``rows`` rows (at most n_batch),
        so that the first such pass does not pay for it; empties the context (every
        sequence's KV state goes). llama.cpp grows its logits buffer only when a pass needs
        more rows than any before; a backend that holds no such buffer does nothing."""
        ...

    def embed(self, tokens: Sequence[int], *, normalize: bool = True) -> list[float]:
        """Pooled embedding of ``tokens`` (context must have ``embeddings=True``)."""
        ...

    def pooled(self, seq: int) -> tuple[float, ...]:
        """``seq``'s pooled output from the last decode, which must have ended that
        sequence's prompt: in a rank-pooling context its ``n_cls_out`` scores (a causal
        model's read at the sequence's last position, an encoder's from the whole
        sequence). ``InvalidRequestError`` for a context that does not pool,
        ``NoLogitsError`` if the last decode held no position of ``seq``."""
        ...

    @property
    def stateless(self) -> bool:
        """Whether the context keeps nothing of a sequence after a decode (an encoder such as
        a BERT cross-encoder has no KV cache): each sequence is decoded whole, in one ubatch,
        from position 0; the sequence operations do nothing and its KV cannot be packed."""
        ...

    def set_adapters(self, adapters: Sequence[tuple[Adapter, float]]) -> None:
        """Replace the attached LoRA adapters (each with its scale)."""
        ...

    def close(self) -> None: ...


#: ``BackendModel.verify_exactness`` where a verify pass's rows equal one-token passes' however
#: long the context grows.
EXACT_AT_ANY_LENGTH = "at any length"


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

    def vocabulary(self) -> tuple[tuple[bytes, ...], frozenset[int]]:
        """Every token's bytes (``token_to_piece(t, special=True)``, in id order) and the
        end-of-generation tokens, read in one pass: what a draft model's vocabulary is
        compared by (``engine/worker/draftmodel.py``), and where n-gram drafts cross
        sentence ends (``drafts.SentenceEnds``)."""
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

    def context_params(
        self,
        params: ContextParams,
        *,
        deterministic: bool,
        speculative: bool = False,
        exact: bool = True,
    ) -> ContextParams:
        """``params`` as this model's contexts run them, in a model that is or is not
        ``deterministic`` and does or does not ``speculative``-ly decode by default
        (``flash_attn="auto"`` resolved where the backend chooses: both need attention whose
        numerics do not depend on the batch), ``exact``-ly or not (``spec_exact``: where not,
        ``auto`` cells need not be the type whose verify rows are one-token passes'). The
        engine creates its contexts and hashes its cache keys from these, so a key names what
        ran."""
        ...

    @property
    def kernels(self) -> str:
        """The matrix kernels this load computes with, where they are not what the backend
        takes by default on this machine, as a short tag ("" where they are): another kernel
        changes a KV state's last bits, so the engine hashes a tag into the model's cache keys,
        and rows computed one way are never restored as the other's."""
        ...

    def kv_tag(self, params: ContextParams, *, deterministic: bool = False) -> str:
        """What the engine hashes beside ``params`` into this model's cache keys
        (``ContextParams.kv_hash``): ``kernels``, and whatever else of the process makes a
        context of ``params`` made now store other KV bytes or attend otherwise (llama.cpp:
        quantized cells left unrotated, ``LLAMA_ATTN_ROT_DISABLE``; for a ``deterministic``
        model, the threads a one-token pass splits f16 cells among under flash attention), as
        a short tag; "" where all are
        the backend's defaults, so default rows keep their keys."""
        ...

    def verify_exactness(self, params: ContextParams, adapters: AdapterSet = ()) -> str:
        """Where a verify pass's rows are bit for bit what one-token passes compute, in a
        context run with ``params`` (``context_params``' result, its ``n_ctx`` every slot's
        cells): ``EXACT_AT_ANY_LENGTH``, or while what holds (``"while ..."``), or
        ``"not measured ..."``. Greedy speculative decoding is plain decoding's reply only
        there (``docs/internals.md``, "Numerics"). ``adapters``: LoRA adapters attached (their
        products take kernels by rows too: an f32 adapter's do on the CPU)."""
        ...

    def new_context(self, params: ContextParams) -> BackendContext: ...

    def new_sampler(self, params: SamplingParams) -> Sampler:
        """``GrammarError`` if the grammar does not compile."""
        ...

    def load_adapter(self, path: str) -> Adapter: ...

    def load_projector(self, path: str, params: ProjectorParams) -> Projector:
        """The multimodal projector at ``path`` for this model (``--mmproj``);
        ``ModelLoadError`` if it does not load or cannot feed this model."""
        ...

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


def json_schema_to_grammar(schema: Mapping[str, object] | str, scope: bytes | None = None) -> str:
    """GBNF for a JSON schema (llama-cpp-python's converter); ``GrammarError`` if unsupported.
    ``scope``: the cache salt the conversion is remembered under (``grammar.TextMemo``)."""
    from kvwarm.backends.grammar import schema_to_gbnf

    return schema_to_gbnf(schema, scope)
