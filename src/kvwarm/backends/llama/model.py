"""llama.cpp models over the low-level ``llama_cpp`` bindings.

Imports run one way: ``llama_model`` imports ``llama_context``, ``llama_sampler`` and
``llama_adapter``; none of them imports it back except for type checking.

Invariants:

- ``llama_model_free`` runs exactly once, after ``close()`` *and* after every context, sampler
  and adapter created from the model has closed (``_lifetime``): contexts read the model while
  they are freed, samplers hold its vocabulary, adapters are owned by it.
- Every vocabulary call checks token ids against ``n_vocab`` first; llama.cpp indexes its tables
  with them unchecked.
- The "buffer too small" protocol (negative return = needed size) is followed for tokenize,
  detokenize and token_to_piece; nothing is truncated silently.
- The load-progress ctypes callback is referenced from the stack frame (and the model) for as
  long as C may call it, i.e. the whole ``llama_model_load_from_file`` call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvwarm.backends import _checks
from kvwarm.backends.base import (
    EXACT_AT_ANY_LENGTH,
    POOLING_BY_ID,
    QUANTIZED_KV_TYPES,
    AdapterSet,
    ContextParams,
    FimTokens,
    KvType,
    ModelFacts,
    ModelParams,
    PoolingType,
    ProjectorParams,
    SamplingParams,
    concrete_kv,
)
from kvwarm.backends.chat_template import render_chat
from kvwarm.backends.lifetime import Lifetime
from kvwarm.backends.llama import model_file
from kvwarm.backends.llama import native as _native
from kvwarm.backends.llama import params as llama_params
from kvwarm.backends.llama.adapter import LlamaAdapter
from kvwarm.backends.llama.context import LlamaContext
from kvwarm.backends.llama.projector import LlamaProjector
from kvwarm.backends.llama.sampler import LlamaSampler
from kvwarm.backends.verify_rows import PROBE_PROMPT, PROBE_ROWS, differing_rows, probe_tokens
from kvwarm.embedded import default_model_path
from kvwarm.errors import (
    BackendError,
    InvalidModelFileError,
    InvalidRequestError,
    KvwarmError,
    ModelLoadError,
    ModelNotFoundError,
)
from kvwarm.memory import MemoryKind, MemoryKindName
from kvwarm.models_dir import check_gguf_magic
from kvwarm.unicode import encode_utf8

log = logging.getLogger(__name__)

_INT32_MIN = -(2**31)
#: ``{arch}.pooling_type`` values (llama.cpp's ``llama_pooling_type``) by name.
_POOLING_NAMES: dict[str, PoolingType] = {str(i): name for i, name in enumerate(POOLING_BY_ID)}
_MAX_TEXT = 2**31 - 1

#: llama.cpp's CPU flash attention (ggml-cpu ``ops.cpp``) computes a one-token pass over a KV
#: view of ``_SPLIT_KV_CELLS`` cells or more with its split-KV kernel (each thread attends over
#: its share of the cells; the partial sums are combined after), which no pass of two or more
#: rows takes, so a verify row is then not what a one-token pass computes. The view is the
#: cells up to the highest one in use, rounded up to ``_KV_VIEW_PAD``. The kernel runs only for
#: K and V of one type among f16 and f32 (f32 is cast to f16 first, ``llama-graph.cpp``);
#: quantised or bf16 KV attends row by row in every pass (measured: ``docs/internals.md``).
_SPLIT_KV_CELLS = 512
_KV_VIEW_PAD = 256
#: Rows of a pass from which llama.cpp's CPU flash attention takes its tiled kernel for every
#: row (``GGML_FA_TILE_Q``), for the same K and V types as the split-KV one.
_TILED_ROWS = 64
_SPLIT_KV_TYPES = frozenset({"f16", "f32"})
#: The cell type an ``auto`` K becomes in a context that speculates where f16 would not be
#: exact (V stays f16: the kernels take K of f16 or f32 only, and the same type for V), or an
#: ``auto`` V beside a K given f16/f32. Of the ways out of the split-KV and tiled kernels, a
#: q8_0 K with an f16 V is the cheapest (``bench/kv_types.py``, SmolLM2: a cold prefill 1.20x
#: f16's, a one-token pass 0.98-1.02x; q8_0 K and V 1.51x and 1.04-1.15x, since every query
#: row dequantises each V row it adds; f16 K with q8_0 V 1.50x and 1.12-1.24x), at 75% of
#: f16's bytes in memory and in every saved row.
_EXACT_KV_TYPE: KvType = "q8_0"
#: ``llama_vocab_type`` values: no vocabulary, and the tokenizers that add special tokens.
_VOCAB_NONE, _VOCAB_SPM, _VOCAB_BPE, _VOCAB_WPM, _VOCAB_UGM = 0, 1, 2, 3, 4


def _missing_specials(lib: Any, vocab: object, n_vocab: int) -> str:
    """The special tokens llama.cpp's tokenizer adds to a prompt (``add_special``) that this
    vocabulary lacks, as "BOS", "BOS and SEP"...; "" if none. llama.cpp GGML_ASSERTs on such a
    token in every tokenize (found by review: a T5 tokenizer whose GGUF says
    ``add_bos_token`` aborted the process on its first prompt); one out of range would make
    every prompt a token id the model refuses."""
    kind = int(lib.llama_vocab_type(vocab))
    bos, eos, sep = (int(f(vocab)) for f in (lib.llama_vocab_bos, lib.llama_vocab_eos,
                                               lib.llama_vocab_sep))  # fmt: skip
    needed: list[tuple[str, int]] = []
    if kind == _VOCAB_WPM:  # BERT's: [CLS] ... [SEP], whatever its add_* flags say
        needed = [("BOS", bos), ("SEP", sep)]
    elif kind in (_VOCAB_SPM, _VOCAB_BPE, _VOCAB_UGM):
        if lib.llama_vocab_get_add_bos(vocab):
            needed.append(("BOS", bos))
        if lib.llama_vocab_get_add_eos(vocab):
            needed.append(("EOS", eos))
    return " and ".join(name for name, token in needed if not 0 <= token < n_vocab)


def _text_capacity(n_tokens: int) -> int:
    """The first buffer detokenize offers for ``n_tokens``: ~8 bytes a token, never past
    what llama_detokenize's int32 length takes. Found by review: ``n * 8 + 16`` passed
    2**31 from ~268M tokens and ctypes wrapped it negative; a text longer than the cap is
    llama.cpp's INT32_MIN answer, a typed error."""
    return min(n_tokens * 8 + 16, _MAX_TEXT)


class LlamaBackend:
    """Factory of llama.cpp models (``name == 'llama_cpp'``)."""

    @property
    def name(self) -> str:
        return "llama_cpp"

    def locate(self, path: str | os.PathLike[str] | None) -> Path:
        """``path``, or ``$KVWARM_MODEL`` / the embedded model; it must be a file."""
        resolved = default_model_path() if path is None else Path(os.path.expanduser(path))
        try:
            found = resolved.is_file()
        except (OSError, ValueError) as exc:
            # Found by review: a name too long, a directory not searchable or a NUL byte
            # raised from is_file, a traceback where a typed error belongs.
            raise ModelNotFoundError(f"model file not found: {str(resolved)!r}: {exc}") from exc
        if not found:
            raise ModelNotFoundError(f"model file not found: {resolved}")
        return resolved

    def load_model(self, path: str, params: ModelParams | None = None) -> LlamaModel:
        return LlamaModel(str(path), params or ModelParams())


def untile_for_verifying(path: str, weights: model_file.WeightKernels | None = None) -> bool:
    """Turn llama.cpp's tiled kernel off for this process where the model at ``path`` (its
    matrix ``weights``, read from its file if not given) will verify drafts with weights that
    kernel multiplies while it is on (``native.untile_for_exact_rows``, which refuses where
    it is too late or not safe); True if it did. ``engine/speculating.untile_at_start``
    calls it at a process's start; a load with ``ModelParams.exact_rows``, as a fallback."""
    weights = model_file.WeightKernels.of(path) if weights is None else weights
    if not (weights.tiled and model_file.tiled_kernel_on()):
        return False
    return _native.untile_for_exact_rows(f"{Path(path).name} speculates, with K-quant weights")


def _splits_cells(params: ContextParams) -> bool:
    """Whether a context of ``params`` may attend a one-token pass with llama.cpp's split-KV
    kernel (``_SPLIT_KV_CELLS``): flash attention not off (``auto`` is on on the CPU) and K and
    V both f16 or f32. Whatever its ``n_ctx``: a unified buffer's view spans every slot's
    cells."""
    return (
        params.flash_attn != "off"
        and concrete_kv(params.type_k) in _SPLIT_KV_TYPES
        and concrete_kv(params.type_v) in _SPLIT_KV_TYPES
    )


def _bridge(
    user_progress: Callable[[float], bool], failure: list[BaseException]
) -> Callable[[float, object], bool]:
    """llama.cpp's progress callback over the user's; an exception in it aborts the load and is
    kept in ``failure`` (it must not unwind through C)."""

    def on_progress(fraction: float, _user: object) -> bool:
        try:
            return bool(user_progress(min(max(float(fraction), 0.0), 1.0)))
        except BaseException as exc:
            failure.append(exc)
            return False

    return on_progress


class LlamaModel:
    """Loaded weights + vocabulary. Vocabulary calls are safe from any thread."""

    def __init__(self, path: str, params: ModelParams) -> None:
        if "\0" in path:
            raise ModelNotFoundError("model path contains a NUL byte")
        if not Path(path).is_file():
            raise ModelNotFoundError(f"no model file at {path!r}")
        check_gguf_magic(path)  # before llama.cpp parses it (issue 23)
        model_file.check_path(path)  # metadata llama.cpp would abort the process on
        #: A weight multiplied by another kernel for several rows than for one ("" if none):
        #: read here, where the file is the one that loads (``verify_exactness``), its
        #: repacked types only where the weights load into the extra buffer types.
        weights = model_file.WeightKernels.of(path)
        if params.exact_rows:  # the fallback of a process that did not decide at its start
            untile_for_verifying(path, weights)
        extra = params.use_extra_bufts
        repacked = (not _native.amx_in_use()) if extra is None else extra
        self._row_kernels = weights.first(repacked=repacked)
        # Repacking is the only kernel change: a speculating model gives it up
        # (``ModelParams.exact_rows``), as its KV cells give up f16 (``_kv_cells``).
        unrepacked = (
            repacked
            and extra is None
            and params.exact_rows
            and bool(self._row_kernels)
            and not weights.first(repacked=False)
        )
        if unrepacked:
            log.info("%s: weights not repacked, so verify rows stay exact", path)
            params = replace(params, use_extra_bufts=False)
            self._row_kernels = ""
        #: The share of the weight bytes tinyBLAS multiplies a few rows at a time
        #: (``ModelFacts.pass_tile_share``), of the weights as they load.
        self._column_share = weights.column_share(repacked=repacked and not unrepacked)
        #: ``kernels``: where they are not this machine's defaults (the process's tiled
        #: kernel off, this load's weights not repacked where they would be).
        tags = []
        if weights.tiled and model_file.tiled_kernel_turned_off():
            tags.append("untiled")
        if unrepacked:
            tags.append("unrepacked")
        self._kernels = ",".join(tags)
        lib = _native.lib()
        self._lib = lib
        self._params = params
        failure: list[BaseException] = []
        on_progress = None if params.progress is None else _bridge(params.progress, failure)
        native = llama_params.model_params(lib, params, on_progress)
        # Kept on the instance too (the callback, the tensor-split array), in case llama.cpp
        # ever reads them after load returns.
        self._native_params = native
        with _native.captured_log() as logged:
            ptr = lib.llama_model_load_from_file(os.fsencode(path), native.struct)
        if not ptr:
            if failure:
                raise ModelLoadError(f"loading {path!r} failed in the progress callback") from (
                    failure[0]
                )
            # The file's fault (a 400 from the server) or the machine's, as llama.cpp said.
            refused = model_file.refusal(repr(path), logged)
            if refused is not None:
                raise refused
            if params.progress is not None:
                raise ModelLoadError(f"loading {path!r} failed or was cancelled")
            raise ModelLoadError(f"llama.cpp could not load {path!r}")
        self._ptr: object = ptr
        self._vocab: object = lib.llama_model_get_vocab(ptr)
        # A "no vocab" model (tokenizer "none": an audio decoder's) loads, but llama.cpp
        # GGML_ASSERTs in every tokenize and token_to_piece of it: found by review, the first
        # prompt sent to one an engine had loaded aborted the process.
        if not self._vocab or int(lib.llama_vocab_type(self._vocab)) == _VOCAB_NONE:
            lib.llama_model_free(ptr)
            raise InvalidModelFileError(f"{path!r} has no vocabulary: it cannot read or write text")
        self._n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        missing = _missing_specials(lib, self._vocab, self._n_vocab)
        if missing:
            lib.llama_model_free(ptr)
            raise InvalidModelFileError(
                f"{path!r}: its vocabulary adds {missing} to every prompt but has no such "
                "token (check the GGUF's tokenizer.ggml.*_token_id and add_*_token keys)"
            )
        self._facts = replace(self._read_facts(path), n_pos=model_file.position_rows(path))
        self._grammar_tokens: tuple[tuple[int | None, ...], tuple[int, ...]] | None = None
        self._unspoken: tuple[int, ...] | None = None
        self._byte_lock = threading.Lock()
        self._life = Lifetime("model", self._free)

    # -- facts --------------------------------------------------------------------------------

    def _read_facts(self, path: str) -> ModelFacts:
        lib, ptr = self._lib, self._ptr
        metadata: dict[str, str] = {}
        for i in range(int(lib.llama_model_meta_count(ptr))):
            key = _native.read_string(functools.partial(lib.llama_model_meta_key_by_index, ptr, i))
            value = _native.read_string(
                functools.partial(lib.llama_model_meta_val_str_by_index, ptr, i)
            )
            if key:
                metadata[key] = value
        try:
            file_type = int(metadata["general.file_type"])
        except (KeyError, ValueError):
            file_type = int(lib.llama_model_ftype(ptr))
        raw_template = lib.llama_model_chat_template(ptr, None)
        # The memory kind decides what a saved state can resume from (kvwarm.memory). Hybrid
        # first: a hybrid model is also reported recurrent by some builds.
        memory_kind: MemoryKindName
        n_swa = int(lib.llama_model_n_swa(ptr))
        if bool(lib.llama_model_is_hybrid(ptr)):
            memory_kind = "hybrid"
        elif bool(lib.llama_model_is_recurrent(ptr)):
            memory_kind = "recurrent"
        elif n_swa > 0:
            memory_kind = "swa"
        else:
            memory_kind = "full"
        bos = int(lib.llama_vocab_bos(self._vocab))
        eos = int(lib.llama_vocab_eos(self._vocab))
        sep = int(lib.llama_vocab_sep(self._vocab))
        arch = metadata.get("general.architecture", "")
        rerank_template = lib.llama_model_chat_template(ptr, b"rerank")
        return ModelFacts(
            path=path,
            n_vocab=self._n_vocab,
            n_ctx_train=int(lib.llama_model_n_ctx_train(ptr)),
            n_embd=int(lib.llama_model_n_embd(ptr)),
            n_layer=int(lib.llama_model_n_layer(ptr)),
            size_bytes=int(lib.llama_model_size(ptr)),
            n_params=int(lib.llama_model_n_params(ptr)),
            description=_native.read_string(lambda b, s: lib.llama_model_desc(ptr, b, s)),
            file_type=file_type,
            quant_bits=_native.quant_bits(file_type),
            bos=bos if 0 <= bos < self._n_vocab else None,
            eos=eos if 0 <= eos < self._n_vocab else None,
            add_bos=bool(lib.llama_vocab_get_add_bos(self._vocab)),
            chat_template=raw_template.decode("utf-8", errors="replace") if raw_template else None,
            metadata=metadata,
            fim=self._fim_tokens(),
            memory_kind=memory_kind,
            n_swa=n_swa if memory_kind == "swa" else 0,
            pooling=_POOLING_NAMES.get(metadata.get(f"{arch}.pooling_type", "")),
            # llama.cpp's default is causal; an encoder's GGUF says false.
            causal=metadata.get(f"{arch}.attention.causal", "true").lower() != "false",
            n_cls_out=max(1, int(lib.llama_model_n_cls_out(ptr))),
            rerank_template=(
                rerank_template.decode("utf-8", errors="replace") if rerank_template else None
            ),
            sep=sep if 0 <= sep < self._n_vocab else None,
            add_eos=bool(lib.llama_vocab_get_add_eos(self._vocab)),
            add_sep=bool(lib.llama_vocab_get_add_sep(self._vocab)),
            **self._pass_tile(),
        )

    def _pass_tile(self) -> dict[str, Any]:
        """``ModelFacts.pass_tile`` and ``pass_tile_share``: tinyBLAS's columns where its
        weights run on the CPU (no layer offloaded: the output layer goes with the last)."""
        columns = _native.tinyblas_columns() if self._column_share > 0 else 1
        if columns <= 1 or self._offloaded():
            return {}
        return {"pass_tile": columns, "pass_tile_share": round(self._column_share, 4)}

    def _fim_tokens(self) -> FimTokens | None:
        """llama.cpp's FIM tokens (from the GGUF, or recognised by their text at load)."""
        lib, vocab = self._lib, self._vocab

        def token(fn: Callable[[object], int]) -> int | None:
            t = int(fn(vocab))
            return t if 0 <= t < self._n_vocab else None  # LLAMA_TOKEN_NULL is -1

        pre = token(lib.llama_vocab_fim_pre)
        suf = token(lib.llama_vocab_fim_suf)
        mid = token(lib.llama_vocab_fim_mid)
        if pre is None or suf is None or mid is None:
            return None
        return FimTokens(
            pre,
            suf,
            mid,
            pad=token(lib.llama_vocab_fim_pad),
            rep=token(lib.llama_vocab_fim_rep),
            sep=token(lib.llama_vocab_fim_sep),
        )

    @property
    def facts(self) -> ModelFacts:
        self._life.check()
        return self._facts

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def lifetime(self) -> Lifetime:
        return self._life

    @property
    def native(self) -> object:
        """The ``llama_model *``; valid while a dependent holds ``lifetime``."""
        return self._ptr

    @property
    def vocab(self) -> object:
        return self._vocab

    @property
    def vocab_only(self) -> bool:
        return self._params.vocab_only

    # -- vocabulary ---------------------------------------------------------------------------

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        data = encode_utf8(text, param="prompt")
        if len(data) > _MAX_TEXT // 2:
            raise InvalidRequestError("text too long to tokenize", param="prompt")
        lib = self._lib
        capacity = len(data) + 8
        with self._life.using():
            for _ in range(3):
                buf = (ctypes.c_int32 * capacity)()
                n = int(
                    lib.llama_tokenize(
                        self._vocab, data, len(data), buf, capacity, add_special, parse_special
                    )
                )
                if n == _INT32_MIN:
                    raise InvalidRequestError("tokenization overflowed int32", param="prompt")
                if n >= 0:
                    tokens = list(buf[:n])
                    if tokens and not 0 <= min(tokens) <= max(tokens) < self._n_vocab:
                        # Found by review: an RWKV vocabulary without a token for some text
                        # gave -1 (LLAMA_TOKEN_NULL) for it, refused later as "token id -1",
                        # a token the caller never sent.
                        bad = next(t for t in tokens if not 0 <= t < self._n_vocab)
                        raise InvalidRequestError(
                            f"this model's tokenizer cannot spell the text (it gave token "
                            f"{bad}, outside its vocabulary of {self._n_vocab})",
                            param="prompt",
                        )
                    return tokens
                capacity = -n
        raise InvalidRequestError("tokenizer kept asking for a larger buffer", param="prompt")

    def detokenize(
        self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False
    ) -> str:
        if len(tokens) > _MAX_TEXT:
            # llama_detokenize takes the count as an int32, which ctypes would wrap.
            raise InvalidRequestError(
                f"{len(tokens)} tokens are more than one detokenize takes", param="tokens"
            )
        _checks.check_tokens(tokens, self._n_vocab)
        if not tokens:
            return ""
        arr = (ctypes.c_int32 * len(tokens))(*tokens)
        capacity = _text_capacity(len(tokens))
        with self._life.using():
            for _ in range(3):
                buf = ctypes.create_string_buffer(capacity)
                n = int(
                    self._lib.llama_detokenize(
                        self._vocab, arr, len(tokens), buf, capacity, remove_special,
                        unparse_special,
                    )
                )  # fmt: skip
                if n >= 0:
                    return buf.raw[:n].decode("utf-8", errors="replace")
                if n == _INT32_MIN:
                    break
                capacity = -n
        raise InvalidRequestError("detokenized text too long", param="tokens")

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        _checks.check_tokens([token], self._n_vocab)
        capacity = 32
        with self._life.using():
            for _ in range(3):
                buf = ctypes.create_string_buffer(capacity)
                n = int(
                    self._lib.llama_token_to_piece(self._vocab, token, buf, capacity, 0, special)
                )
                if n >= 0:
                    return buf.raw[:n]
                capacity = -n
        raise InvalidRequestError(f"token {token} has an oversized piece", param="tokens")

    def is_eog(self, token: int) -> bool:
        _checks.check_tokens([token], self._n_vocab)
        with self._life.using():
            return bool(self._lib.llama_vocab_is_eog(self._vocab, token))

    def vocabulary(self) -> tuple[tuple[bytes, ...], frozenset[int]]:
        return self._pieces(special=True)

    def _pieces(self, *, special: bool) -> tuple[tuple[bytes, ...], frozenset[int]]:
        # One buffer, two plain calls a token: Gemma 3's 262,144 tokens in ~0.3 s, where
        # token_to_piece and is_eog per token took ~1 s a model (measured). The model is held
        # as a dependent (it cannot be freed meanwhile), not under its lock: every ctypes call
        # waits for the GIL again, so beside a thread preparing a large grammar (Python that
        # holds it) SmolLM2's pass took 9 s, and the lock held that long stopped every
        # tokenize and sampler of the model, the worker's too (a chat beside it waited 9 s).
        # The vocabulary is only read, as concurrent tokenizes read it.
        lib, vocab = self._lib, self._vocab
        to_piece, eog_of = lib.llama_token_to_piece, lib.llama_vocab_is_eog
        capacity = 256
        buf = ctypes.create_string_buffer(capacity)
        pieces: list[bytes] = []
        eog: list[int] = []
        self._life.acquire()
        try:
            for token in range(self._n_vocab):
                n = int(to_piece(vocab, token, buf, capacity, 0, special))
                if n < 0:  # longer than the buffer: asked again with room for it
                    big = ctypes.create_string_buffer(-n)
                    n = int(to_piece(vocab, token, big, -n, 0, special))
                    if n < 0:
                        raise BackendError(f"token {token}'s piece could not be read")
                    pieces.append(big.raw[:n])
                else:
                    pieces.append(ctypes.string_at(buf, n))
                if eog_of(vocab, token):
                    eog.append(token)
        finally:
            self._life.release()
        return tuple(pieces), frozenset(eog)

    def unspoken_tokens(self) -> tuple[int, ...]:
        """The tokens whose text in a reply (their piece) is not the text llama.cpp's grammar
        matches for them (their piece with special text): control tokens, which a reply
        leaves out, other than the end-of-generation ones. Read once a model (a pass over the
        vocabulary), when the first grammar's sampler is built."""
        with self._byte_lock:
            if self._unspoken is None:
                shown, eog = self._pieces(special=True)
                plain, _ = self._pieces(special=False)
                self._unspoken = tuple(
                    t for t, (a, b) in enumerate(zip(shown, plain, strict=True))
                    if a != b and t not in eog
                )  # fmt: skip
            return self._unspoken

    def grammar_tokens(self) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
        """What a lazy grammar (``backends/lazy_grammar.py``) needs of the vocabulary: for
        each byte value a token whose piece is that byte alone (None where none is; how the
        grammar is given the text its trigger came in), and the end-of-generation tokens (a
        grammar that admits one is complete). Read once a model, on the first call."""
        with self._byte_lock:
            if self._grammar_tokens is None:
                pieces, eog = self.vocabulary()
                table: list[int | None] = [None] * 256
                for token, piece in enumerate(pieces):
                    if len(piece) == 1 and table[piece[0]] is None and token not in eog:
                        table[piece[0]] = token
                self._grammar_tokens = (tuple(table), tuple(sorted(eog)))
            return self._grammar_tokens

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        tools: Sequence[Mapping[str, object]] | None = None,
        add_generation_prompt: bool = True,
        template: str | None = None,
    ) -> str:
        facts = self.facts
        source = template or facts.chat_template
        if not source:
            raise InvalidRequestError("the model has no chat template", param="messages")
        bos = self.token_to_piece(facts.bos, special=True) if facts.bos is not None else b""
        eos = self.token_to_piece(facts.eos, special=True) if facts.eos is not None else b""
        return render_chat(
            source,
            messages,
            bos_token=bos.decode("utf-8", errors="replace"),
            eos_token=eos.decode("utf-8", errors="replace"),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )

    # -- children -----------------------------------------------------------------------------

    def context_params(
        self,
        params: ContextParams,
        *,
        deterministic: bool,
        speculative: bool = False,
        exact: bool = True,
    ) -> ContextParams:
        """``params`` as this model's contexts run them. ``flash_attn="auto"`` becomes ``off``
        where attention runs on the CPU (no layer offloaded, or a build without a GPU), V is
        not quantised (a quantised V needs it) and the model is neither deterministic (without
        flash attention a restored sequence's logits differ from a cold run's in the last
        bits, see ``ModelConfig.validate``) nor speculative (without it a verify pass's rows
        differ from one-token passes' by up to 0.7 in a logit on SmolLM2, so a greedy reply
        changed; with it, a pass of up to 63 tokens gives each row exactly a one-token
        pass's logits: measured, ``docs/internals.md``, "Speculative decoding"); elsewhere
        llama.cpp decides per device.

        KV cell types ``auto`` become f16, except in a model that speculates on the CPU
        (a causal one whose state can roll a rejected draft back),
        where f16 K and V would take the split-KV kernel in one-token passes over 512 cells
        or more (two or more threads) and the tiled one in passes of 64 rows or more (a
        prefill chunk beside a draft), and verify passes not, so a greedy speculative reply
        would stop being plain decoding's there (``verify_exactness``): an ``auto`` K is then
        q8_0 (an ``auto`` V beside a K given f16: V q8_0), with which every pass attends row
        by row (``_EXACT_KV_TYPE``); not where its replies need not be plain decoding's
        (``exact`` false: ``spec_exact``), where q8_0 K would cost a verify pass, a prefill
        in effect, ~1.2x for nothing. A type given is kept as given.

        llama.cpp's own ``auto`` turns flash attention on whenever the device supports it,
        and its CPU kernel is the slower one for what a cache serves: decoding and short
        prefills over a long cached prefix. ``bench/flash_attn.py`` measured it off against
        on at ~1,100 positions, 2 models and 6 layer shapes from 135M to 8B: decode up to 35%
        less time, 20-40-token prefills 18-63% less, a cold prefill 3-33% more (the real
        models 5-10%). Explicit ``on``/``off`` are kept as given.

        ``n_ctx`` is cut to the model's position table (``ModelFacts.n_pos``), with a
        warning: a sequence can hold no position past it.
        """
        n_pos = self._facts.n_pos
        if n_pos is not None and params.n_ctx > n_pos:
            # Found by review: a position past the table reached ggml_get_rows' GGML_ASSERT
            # and aborted the process (a cross-encoder's document of 600 tokens, at the
            # default n_ctx of 4096, with bge-reranker's 512 positions).
            log.warning(
                "%s: n_ctx %d is more than the %d positions its position embedding holds: "
                "a sequence holds at most %d tokens",
                self._facts.path,
                params.n_ctx,
                n_pos,
                n_pos,
            )
            params = replace(params, n_ctx=n_pos)
        params = self._kv_cells(params, speculative=speculative and exact and not deterministic)
        if params.flash_attn != "auto" or params.type_v in QUANTIZED_KV_TYPES:
            return params
        if deterministic or speculative:
            return params
        if self._offloaded():
            return params
        return replace(params, flash_attn="off")

    def _offloaded(self) -> bool:
        """Whether layers of this model run on a GPU."""
        return self._params.n_gpu_layers != 0 and bool(self._lib.llama_supports_gpu_offload())

    def _kv_cells(self, params: ContextParams, *, speculative: bool) -> ContextParams:
        """``params`` with KV cell types ``auto`` resolved (``context_params``)."""
        if "auto" not in (params.type_k, params.type_v):
            return params
        k, v = concrete_kv(params.type_k), concrete_kv(params.type_v)
        facts = self._facts
        # A state that cannot roll a rejected draft back (recurrent, hybrid) or an encoder
        # never verifies a draft: q8_0 would cost its prefill 1.5x for nothing.
        rolls_back = MemoryKind(facts.memory_kind, facts.n_swa, params.swa_full).lookahead(0)
        if (
            speculative
            and facts.causal
            and rolls_back != 0
            and params.flash_attn != "off"
            and not self._offloaded()
            and k in _SPLIT_KV_TYPES
            and v in _SPLIT_KV_TYPES
        ):
            if params.type_k == "auto":
                k = _EXACT_KV_TYPE  # V stays f16 (or what was given): the cheapest way out
            else:
                v = _EXACT_KV_TYPE  # K was given f16 or f32: V of another type takes it out
        return replace(params, type_k=k, type_v=v)

    @property
    def kernels(self) -> str:
        return self._kernels

    def kv_tag(self, params: ContextParams, *, deterministic: bool = False) -> str:
        tags = [self._kernels] if self._kernels else []
        if model_file.kv_rotation_off(params):
            tags.append("unrotated")
        threads = params.n_threads or _native.default_threads()
        if deterministic and threads > 1 and _splits_cells(params):
            # Found by review: the split-KV kernel's shares are the threads', so a one-token
            # pass past 512 cells computes other bits on another count (a prompt's last chunk
            # of one token: its stored logits; n_ubatch 1: every cell), and a row from a
            # process (a replica, a restart) of another count restored as this one's
            # (SmolLM2, f16: logits off by ~0.4-1.0 from the cold run's,
            # ``tests/backends/test_kv_threads.py``). Passes of several rows run on
            # ``n_threads_batch`` and do not split the cells: their bits are the same. Only
            # where bits are promised (deterministic mode): elsewhere another count's row is
            # the same prefix's KV rounded otherwise, as another CPU's, and replicas of
            # other CPU counts keep sharing rows.
            tags.append(f"threads{threads}")
        return ",".join(tags)

    def verify_exactness(self, params: ContextParams, adapters: AdapterSet = ()) -> str:
        if self._offloaded():
            return "not measured on a GPU (its kernels change with the number of rows in a pass)"
        if params.flash_attn == "off":
            return "no: without flash attention a verify row differs from a one-token pass"
        weight = self._row_kernels or next(
            (a.row_kernels for a, _ in adapters if isinstance(a, LlamaAdapter) and a.row_kernels),
            "",
        )
        if weight:
            return (
                f"no: {'an adapter' if not self._row_kernels else 'its'} weight {weight}, is "
                "multiplied with vec_dot in a one-token pass"
            )
        try:
            differ = self._probe_verify_rows(params, adapters)
        except KvwarmError as e:  # a context or a pass refused: say so, keep the model
            log.warning("%s: verify rows not probed: %s", self._facts.path, e)
            return f"not measured: a probe of its verify rows failed ({e})"
        if differ:
            rows = sum(PROBE_ROWS)
            return (
                f"no: {differ} of {rows} rows of verify passes differed from one-token passes "
                "when measured at load (a matrix kernel llama.cpp takes for passes of several "
                "rows, with weights of "
                + ("this adapter's or " if adapters else "")
                + "this model's types)"
            )
        k, v = concrete_kv(params.type_k), concrete_kv(params.type_v)
        if k not in _SPLIT_KV_TYPES or v not in _SPLIT_KV_TYPES:
            return EXACT_AT_ANY_LENGTH
        threads = params.n_threads or _native.default_threads()
        # One thread's split is the whole view, and a context of 256 cells never has a view
        # of 512; several sequences' passes can hold 64 rows or more (a prefill chunk beside
        # a draft), which take the tiled kernel for every row (found by specrev's review).
        short = threads == 1 or params.n_ctx <= _KV_VIEW_PAD
        if short and params.n_seq_max == 1:
            return EXACT_AT_ANY_LENGTH
        where = (
            [] if short else [f"the context uses at most {_SPLIT_KV_CELLS - _KV_VIEW_PAD} KV cells"]
        )
        if params.n_seq_max > 1:
            where.append(f"no pass holds {_TILED_ROWS} rows or more")
        return (
            f"while {' and '.join(where)} (f16 KV on {threads} CPU threads; q8_0 or bf16 KV "
            "is exact at any length)"
        )

    def _probe_verify_rows(self, params: ContextParams, adapters: AdapterSet) -> int:
        """Rows of short verify passes that differ from one-token passes, measured on a
        small context of ``params``' kind (``backends/verify_rows.py``): the matrix kernels
        llama.cpp picks by a pass's rows depend on the weights' types and the CPU, so no rule
        can say it. Under 256 cells: the attention kernels' own limit is ``verify_exactness``'
        rule. Passes of ``PROBE_ROWS`` rows and a one-token pass for each row: a fraction of a
        second on a small model, seconds on an 8B one on the CPU; only where the model may
        speculate."""
        tokens = probe_tokens(
            lambda text: self.tokenize(text, add_special=False), self._facts.n_vocab
        )
        small = replace(
            params, n_ctx=128, n_batch=64, n_ubatch=64, n_seq_max=1, kv_unified=True,
            embeddings=False,
        )  # fmt: skip
        ctx = self.new_context(small)
        try:
            if adapters:
                ctx.set_adapters(adapters)
            return differing_rows(ctx, tokens[:PROBE_PROMPT], tokens[PROBE_PROMPT:], PROBE_ROWS)
        finally:
            ctx.close()

    def new_context(self, params: ContextParams) -> LlamaContext:
        params.validate()
        if self._params.vocab_only:
            raise ModelLoadError("a vocab_only model cannot create contexts")
        return LlamaContext(self, params)

    def new_sampler(self, params: SamplingParams) -> LlamaSampler:
        return LlamaSampler(self, params)

    def load_adapter(self, path: str) -> LlamaAdapter:
        return LlamaAdapter(self, str(path))

    def load_projector(self, path: str, params: ProjectorParams) -> LlamaProjector:
        if self._params.vocab_only:
            raise ModelLoadError("a vocab_only model cannot load a projector")
        return LlamaProjector(self, str(path), params)

    def close(self) -> None:
        self._life.close()

    def _free(self) -> None:
        self._lib.llama_model_free(self._ptr)
        self._ptr = None
        self._vocab = None
        log.debug("freed model %s", self._facts.path)
