"""Tiny random-weight GGUFs of architectures no small model on PyPI has (recurrent Mamba, hybrid
LFM2), written the way llama.cpp's ``tests/test-llama-archs.cpp`` makes its models.

The metadata is written with the ``gguf`` package (architecture, sizes, a dummy ``test``
tokenizer); llama.cpp itself then creates every tensor its loader expects for that
architecture (``llama_model_init_from_user``), our callback fills each with seeded normal
values (Mamba's ``A`` negative, as a state decay must be), and ``llama_model_save_to_file``
writes the complete GGUF. So the tensor list can never disagree with the pinned llama.cpp.
A few hundred KB each; built once per session by a fixture.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

N_VOCAB = 128
N_EMBD = 64
N_LAYER = 2
N_HEAD = 2
N_CTX = 512


def _arch_keys(w: Any, arch: str) -> None:
    """The sizes of the Mamba, LFM2 and Qwen2-VL models the tests use (Qwen2-VL: the text
    model, M-RoPE over 16 rotary pairs, whose KV cells carry ``llama_kv_cell_ext``)."""
    k = f"{arch}."
    w.add_uint32(k + "vocab_size", N_VOCAB)
    w.add_uint32(k + "context_length", N_CTX)
    w.add_uint32(k + "embedding_length", N_EMBD)
    w.add_uint32(k + "block_count", N_LAYER)
    w.add_uint32(k + "feed_forward_length", 4 * N_EMBD)
    if arch == "lfm2":
        # Layer 1 is attention, layer 0 a short convolution (its recurrent state).
        w.add_array(k + "attention.head_count", [N_HEAD] * N_LAYER)
        w.add_array(
            k + "attention.head_count_kv", [0 if il == 0 else N_HEAD for il in range(N_LAYER)]
        )
        w.add_uint32(k + "shortconv.l_cache", 3)
        w.add_float32(k + "rope.freq_base", 10000.0)
    else:
        w.add_uint32(k + "attention.head_count", N_HEAD)
        w.add_uint32(k + "attention.head_count_kv", N_HEAD)
    if arch == "qwen2vl":
        w.add_array(k + "rope.dimension_sections", [4, 6, 6, 0])
        w.add_float32(k + "rope.freq_base", 10000.0)
    w.add_float32(k + "attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(k + "attention.layer_norm_epsilon", 1e-5)
    w.add_uint32(k + "ssm.conv_kernel", 4)
    w.add_uint32(k + "ssm.inner_size", 2 * N_EMBD)
    w.add_uint32(k + "ssm.state_size", 16)
    w.add_uint32(k + "ssm.time_step_rank", 8)


def _metadata(
    path: Path, arch: str, keys: Callable[[Any, str], None], tokenizer: str = "test"
) -> None:
    """A metadata-only GGUF: ``keys`` adds the architecture's (``vocab_size`` N_VOCAB), then
    a dummy ``tokenizer`` (llama.cpp's ``test`` one, or ``none``: no vocabulary) of N_VOCAB
    tokens."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    keys(w, arch)
    w.add_string("tokenizer.ggml.model", tokenizer)
    w.add_array("tokenizer.ggml.tokens", [f"tok_{i}" for i in range(N_VOCAB)])
    w.add_array("tokenizer.ggml.scores", [0.0] * N_VOCAB)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class _GgufInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def write_tiny_model(
    path: Path,
    arch: str,
    *,
    seed: int = 7,
    stdev: float = 0.1,
    keys: Callable[[Any, str], None] | None = None,
    tokenizer: str = "test",
    ftype: int | None = None,
) -> Path:
    """A complete random-weight GGUF of ``arch`` ("mamba", "lfm2", "qwen2vl") at ``path``; with
    ``keys`` (adding the architecture's metadata to a ``gguf.GGUFWriter``, like
    ``_arch_keys``) any architecture and shape llama.cpp can build with a vocabulary of
    N_VOCAB (``bench/flash_attn.py``'s llama shapes). ``ftype``: a ``llama_ftype`` its
    weights are then quantised to by llama.cpp (``LLAMA_FTYPE_MOSTLY_Q4_1``: 3)."""
    import llama_cpp

    from kvwarm.backends.llama import native

    native.lib()  # backend initialised, llama.cpp's log routed
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    ggml_base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    ggml_base.gguf_init_from_file.restype = ctypes.c_void_p
    ggml_base.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    ggml_base.gguf_free.argtypes = [ctypes.c_void_p]
    ggml_base.ggml_nelements.restype = ctypes.c_int64
    ggml_base.ggml_nelements.argtypes = [ctypes.c_void_p]
    ggml_base.ggml_nbytes.restype = ctypes.c_size_t
    ggml_base.ggml_nbytes.argtypes = [ctypes.c_void_p]
    ggml_base.ggml_get_name.restype = ctypes.c_char_p
    ggml_base.ggml_get_name.argtypes = [ctypes.c_void_p]
    ggml_base.ggml_backend_tensor_set.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
    ]  # fmt: skip

    meta = path.with_suffix(".meta.gguf")
    _metadata(meta, arch, keys or _arch_keys, tokenizer)

    def fill(tensor: Any, _ud: Any) -> None:
        name = ggml_base.ggml_get_name(tensor).decode()
        n = int(ggml_base.ggml_nelements(tensor))
        nbytes = int(ggml_base.ggml_nbytes(tensor))
        rng = np.random.default_rng(
            seed ^ int.from_bytes(hashlib.sha256(name.encode()).digest()[:4])
        )
        values = rng.normal(0.0, stdev, n)
        if "ssm_a" in name:
            values = -np.abs(values)
        # init_from_user creates tensors as F32 unless the metadata names another type.
        data = values.astype(np.float32 if nbytes == 4 * n else np.float16)
        assert data.nbytes == nbytes, (name, nbytes, n)
        ggml_base.ggml_backend_tensor_set(tensor, data.ctypes.data, 0, nbytes)

    # Referenced until init_from_user returns: C calls it from inside that call only.
    callback = llama_cpp.llama_model_set_tensor_data_t(fill)
    gctx = ggml_base.gguf_init_from_file(str(meta).encode(), _GgufInitParams(True, None))
    if not gctx:
        raise RuntimeError(f"gguf could not read {meta}")
    try:
        params = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_init_from_user(ctypes.c_void_p(gctx), callback, None, params)
        if not model:
            raise RuntimeError(f"llama.cpp could not build a {arch} model from {meta}")
        try:
            llama_cpp.llama_model_save_to_file(model, str(path).encode())
        finally:
            llama_cpp.llama_model_free(model)
    finally:
        ggml_base.gguf_free(gctx)
        meta.unlink(missing_ok=True)
    if ftype is not None:
        quantize(path, ftype)
    return path


def quantize(path: Path, ftype: int) -> Path:
    """The GGUF at ``path`` quantised in place by llama.cpp to ``ftype`` (a ``llama_ftype``:
    ``LLAMA_FTYPE_MOSTLY_Q6_K`` is 18); a tensor whose rows do not fill the type's blocks (256
    values for a K-quant) keeps another type, as llama.cpp chooses."""
    import llama_cpp

    whole = path.with_suffix(".f32.gguf")
    path.rename(whole)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    rc = llama_cpp.llama_model_quantize(
        str(whole).encode(), str(path).encode(), ctypes.byref(params)
    )
    whole.unlink()
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantise {path} to ftype {ftype}: {rc}")
    return path


#: ``llama_ftype`` values: mostly Q6_K, mostly Q4_K (Q4_K_S: Q5_K and Q6_K besides).
FTYPE_Q6_K, FTYPE_Q4_K_S = 18, 14
#: A width whose rows fill K-quant blocks (256 values), so that quantising keeps K-quants.
K_QUANT_EMBD, K_QUANT_HEADS = 512, 8


def gemma3_keys(window: int, n_layer: int = N_LAYER) -> Callable[[Any, str], None]:
    """A ``keys`` for ``write_tiny_model(..., "gemma3")``: a tiny Gemma 3 whose sliding window
    is ``window`` tokens. llama.cpp makes five of every six layers sliding-window ones, so
    ``n_layer`` below 6 gives a model with no full-attention layer at all."""

    def keys(w: Any, arch: str) -> None:
        for key, value in {
            "vocab_size": N_VOCAB, "context_length": N_CTX, "embedding_length": N_EMBD,
            "block_count": n_layer, "feed_forward_length": 4 * N_EMBD,
            "attention.head_count": N_HEAD, "attention.head_count_kv": N_HEAD,
            "attention.key_length": 32, "attention.value_length": 32,
            "attention.sliding_window": window,
        }.items():  # fmt: skip
            w.add_uint32(f"{arch}.{key}", value)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_float32(f"{arch}.rope.freq_base", 10000.0)

    return keys


def k_quant_keys(w: Any, arch: str) -> None:
    """A ``keys`` for ``write_tiny_model``: a llama-like model K_QUANT_EMBD wide (two layers,
    heads of 64), so that its weights quantise to K-quants."""
    k = f"{arch}."
    w.add_uint32(k + "vocab_size", N_VOCAB)
    w.add_uint32(k + "context_length", 4096)
    w.add_uint32(k + "embedding_length", K_QUANT_EMBD)
    w.add_uint32(k + "block_count", N_LAYER)
    w.add_uint32(k + "feed_forward_length", 2 * K_QUANT_EMBD)
    w.add_uint32(k + "attention.head_count", K_QUANT_HEADS)
    w.add_uint32(k + "attention.head_count_kv", K_QUANT_HEADS)
    w.add_float32(k + "attention.layer_norm_rms_epsilon", 1e-5)


# --- A tiny random-weight vision projector (llama.cpp's ``clip`` GGUF, projector ``gemma3``) ---

#: The projector's vision tower: 64x64 images in 8x8 patches, pooled 2x2: 16 positions each.
PROJ_IMAGE, PROJ_PATCH, PROJ_EMBD, PROJ_FF = 64, 8, 64, 128
PROJ_TOKENS = (PROJ_IMAGE // PROJ_PATCH // 2) ** 2


def write_tiny_projector(
    path: Path,
    n_embd_text: int,
    *,
    seed: int = 11,
    projector_type: str = "gemma3",
    n_pos: int | None = None,
    scale_factor: int = 2,
    llava: bool = False,
) -> Path:
    """A complete random-weight ``gemma3`` projector at ``path`` for a text model of width
    ``n_embd_text`` (640 Gemma 3 270M, 576 SmolLM2): what ``/work/shared/DESIGN.md`` measured
    this llama.cpp to accept (~0.26 MB). The same arguments write the same bytes. The
    keywords write hostile variants: another ``projector_type`` label, ``n_pos`` position
    embeddings instead of ``(image/patch)^2``, another ``scale_factor``; ``llava`` writes a
    sound ``mlp`` (LLaVA) projector instead: the same encoder, a two-layer MLP head."""
    import gguf

    rng = np.random.default_rng(seed)
    e, ff, p = PROJ_EMBD, PROJ_FF, PROJ_PATCH
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "mlp" if llava else projector_type)
    w.add_uint32("clip.vision.embedding_length", e)
    w.add_uint32("clip.vision.feed_forward_length", ff)  # != e: or clip.cpp swaps up and down
    w.add_uint32("clip.vision.block_count", 2)
    w.add_uint32("clip.vision.attention.head_count", 2)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", PROJ_IMAGE)
    w.add_uint32("clip.vision.patch_size", p)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.projector.scale_factor", scale_factor)
    w.add_uint32("general.file_type", 1)

    def tensor(name: str, shape: tuple[int, ...], dtype: Any = np.float32) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(dtype))

    tensor("v.patch_embd.weight", (e, 3, p, p), np.float16)
    tensor("v.patch_embd.bias", (e,))
    tensor("v.position_embd.weight", ((PROJ_IMAGE // p) ** 2 if n_pos is None else n_pos, e))
    for il in range(2):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensor(f"v.blk.{il}.{name}.weight", (e, e), np.float16)
            tensor(f"v.blk.{il}.{name}.bias", (e,))
        for name in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{il}.{name}.weight", np.ones(e, np.float32))
            tensor(f"v.blk.{il}.{name}.bias", (e,))
        tensor(f"v.blk.{il}.ffn_up.weight", (ff, e), np.float16)
        tensor(f"v.blk.{il}.ffn_up.bias", (ff,))
        tensor(f"v.blk.{il}.ffn_down.weight", (e, ff), np.float16)
        tensor(f"v.blk.{il}.ffn_down.bias", (e,))
    w.add_tensor("v.post_ln.weight", np.ones(e, np.float32))
    tensor("v.post_ln.bias", (e,))
    if llava:
        tensor("mm.0.weight", (ff, e), np.float16)
        tensor("mm.0.bias", (ff,))
        tensor("mm.2.weight", (n_embd_text, ff), np.float16)
        tensor("mm.2.bias", (n_embd_text,))
    else:
        w.add_tensor("mm.soft_emb_norm.weight", np.ones(e, np.float32))
        tensor("mm.input_projection.weight", (e, n_embd_text), np.float16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_audio_projector(
    path: Path, n_embd_text: int, *, seed: int = 13, n_pos: int = 1500, k_bias: bool = False
) -> Path:
    """A complete random-weight ``qwen2a`` audio projector (a one-layer Whisper encoder and a
    linear projection) for a text model of width ``n_embd_text``. llama.cpp pads audio to
    30 s windows: any clip up to 30 s is one span of 750 positions. The same arguments write
    the same bytes. ``n_pos`` other than 1500 and ``k_bias`` write hostile variants."""
    import gguf

    rng = np.random.default_rng(seed)
    e, ff, n_mel = PROJ_EMBD, PROJ_FF, 128
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.projector_type", "qwen2a")
    w.add_uint32("clip.audio.embedding_length", e)
    w.add_uint32("clip.audio.feed_forward_length", ff)
    w.add_uint32("clip.audio.block_count", 1)
    w.add_uint32("clip.audio.attention.head_count", 2)
    w.add_uint32("clip.audio.projection_dim", n_embd_text)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.audio.num_mel_bins", n_mel)
    w.add_uint32("general.file_type", 1)

    def tensor(name: str, shape: tuple[int, ...], dtype: Any = np.float32) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(dtype))

    tensor("a.conv1d.1.weight", (e, n_mel, 3), np.float16)
    tensor("a.conv1d.1.bias", (e, 1))
    tensor("a.conv1d.2.weight", (e, e, 3), np.float16)
    tensor("a.conv1d.2.bias", (e, 1))
    tensor("a.position_embd.weight", (n_pos, e))
    for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
        tensor(f"a.blk.0.{name}.weight", (e, e), np.float16)
        if name != "attn_k" or k_bias:  # Whisper's K has no bias
            tensor(f"a.blk.0.{name}.bias", (e,))
    for name in ("ln1", "ln2"):
        w.add_tensor(f"a.blk.0.{name}.weight", np.ones(e, np.float32))
        tensor(f"a.blk.0.{name}.bias", (e,))
    tensor("a.blk.0.ffn_up.weight", (ff, e), np.float16)
    tensor("a.blk.0.ffn_up.bias", (ff,))
    tensor("a.blk.0.ffn_down.weight", (e, ff), np.float16)
    tensor("a.blk.0.ffn_down.bias", (e,))
    w.add_tensor("a.post_ln.weight", np.ones(e, np.float32))
    tensor("a.post_ln.bias", (e,))
    tensor("mm.a.fc.weight", (n_embd_text, e), np.float16)
    tensor("mm.a.fc.bias", (n_embd_text,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- Rerankers: written whole with the ``gguf`` package (llama.cpp's model saver leaves out
# what these need: the rerank template, and a BERT's token embeddings), every tensor the
# pinned loader asks for, norms at 1, the rest seeded normal values. Measured facts in
# ``../shared/DESIGN.md`` ("Test models that no package ships").

#: Qwen3-Reranker's prompt (its GGUF's ``tokenizer.chat_template.rerank``): the query before
#: the document, so a query's documents share everything before the document.
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
    "answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def test_tokenizer(w: Any, *, specials: bool = False) -> int:
    """llama.cpp's ``test`` tokenizer (a token per 5 bytes, hashed) of N_VOCAB tokens; with
    ``specials``, BOS/EOS/SEP ids that the vocabulary adds (a BERT's [CLS] q [SEP] [SEP] d
    [SEP] shape). Returns the vocabulary's size."""
    w.add_string("tokenizer.ggml.model", "test")
    w.add_array("tokenizer.ggml.tokens", [f"tok_{i}" for i in range(N_VOCAB)])
    w.add_array("tokenizer.ggml.scores", [0.0] * N_VOCAB)
    if specials:
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_sep_token_id(3)
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
        w.add_add_sep_token(True)
    return N_VOCAB


def write_reranker(
    path: Path,
    kind: str,
    *,
    seed: int = 7,
    n_embd: int = N_EMBD,
    n_layer: int = N_LAYER,
    n_head: int = N_HEAD,
    n_ctx: int = N_CTX,
    stdev: float = 0.1,
    dtype: Any = np.float32,
    tokenizer: Callable[[Any], int] | None = None,
    template: str | None = QWEN3_RERANK_TEMPLATE,
    split_max_tensors: int = 0,
    pooling: int = 4,
) -> Path:
    """A random-weight reranker at ``path``: ``kind`` "decoder" (``qwen3`` with pooling rank,
    labels yes/no and a ``cls.output`` head: scores are p("yes")) or "encoder" (a ``bert``
    cross-encoder: attention not causal, ``cls`` and ``cls.output`` heads, one raw score).
    ``pooling``: its ``pooling_type`` (4, rank; an encoder of 1, mean, is an embedding model,
    its heads unused).
    ``tokenizer`` adds the vocabulary's keys and returns its size (default: ``test``, with
    BOS/EOS/SEP for the encoder); ``template`` is the decoder's rerank prompt. With
    ``split_max_tensors``, a model split into parts of that many tensors, named as
    llama.cpp's gguf-split names them (``NAME-00001-of-0000N.gguf`` beside ``path``).
    Deterministic: the same arguments write the same bytes."""
    import gguf

    decoder = kind == "decoder"
    arch = "qwen3" if decoder else "bert"
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    n_vocab = test_tokenizer(w, specials=not decoder) if tokenizer is None else tokenizer(w)
    n_ff = 4 * n_embd
    head = n_embd // n_head
    k = f"{arch}."
    w.add_uint32(k + "context_length", n_ctx)
    w.add_uint32(k + "embedding_length", n_embd)
    w.add_uint32(k + "block_count", n_layer)
    w.add_uint32(k + "feed_forward_length", n_ff)
    w.add_uint32(k + "attention.head_count", n_head)
    w.add_uint32(k + "pooling_type", pooling)
    if decoder:
        w.add_uint32(k + "attention.head_count_kv", n_head)
        w.add_uint32(k + "attention.key_length", head)
        w.add_uint32(k + "attention.value_length", head)
        w.add_float32(k + "attention.layer_norm_rms_epsilon", 1e-6)
        w.add_float32(k + "rope.freq_base", 10000.0)
        w.add_array(k + "classifier.output_labels", ["yes", "no"])
        if template is not None:
            w.add_string("tokenizer.chat_template.rerank", template)
    else:
        w.add_float32(k + "attention.layer_norm_epsilon", 1e-12)
        w.add_bool(k + "attention.causal", False)
        w.add_uint32("tokenizer.ggml.token_type_count", 2)

    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int, kind: Any = dtype) -> None:
        w.add_tensor(name, rng.normal(0.0, stdev, (rows, cols)).astype(kind))

    def vector(name: str, n: int, *, ones: bool = False) -> None:
        values = np.ones(n) if ones else rng.normal(0.0, stdev, n)
        w.add_tensor(name, values.astype(np.float32))

    matrix("token_embd.weight", n_vocab, n_embd)
    if decoder:
        vector("output_norm.weight", n_embd, ones=True)
        matrix("cls.output.weight", 2, n_embd)  # yes, no
    else:
        # Added to f32 activations as they are (a BERT GGUF keeps them f32: ggml cannot add
        # an f16 tensor to an f32 one, and aborts).
        matrix("token_types.weight", 2, n_embd, np.float32)
        matrix("position_embd.weight", n_ctx, n_embd, np.float32)
        vector("token_embd_norm.weight", n_embd, ones=True)
        vector("token_embd_norm.bias", n_embd)
        matrix("cls.weight", n_embd, n_embd)
        vector("cls.bias", n_embd)
        matrix("cls.output.weight", 1, n_embd)
        vector("cls.output.bias", 1)
    for il in range(n_layer):
        b = f"blk.{il}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            matrix(b + name + ".weight", n_embd, n_embd)
            if not decoder:
                vector(b + name + ".bias", n_embd)
        if decoder:
            vector(b + "attn_norm.weight", n_embd, ones=True)
            vector(b + "attn_q_norm.weight", head, ones=True)
            vector(b + "attn_k_norm.weight", head, ones=True)
            vector(b + "ffn_norm.weight", n_embd, ones=True)
            matrix(b + "ffn_gate.weight", n_ff, n_embd)
            matrix(b + "ffn_up.weight", n_ff, n_embd)
            matrix(b + "ffn_down.weight", n_embd, n_ff)
        else:
            vector(b + "attn_output_norm.weight", n_embd, ones=True)
            vector(b + "attn_output_norm.bias", n_embd)
            matrix(b + "ffn_up.weight", n_ff, n_embd)
            vector(b + "ffn_up.bias", n_ff)
            matrix(b + "ffn_down.weight", n_embd, n_ff)
            vector(b + "ffn_down.bias", n_embd)
            vector(b + "layer_output_norm.weight", n_embd, ones=True)
            vector(b + "layer_output_norm.bias", n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- A chat model whose tool-call markers are control tokens (``write_marker_model``) ---

#: Its vocabulary: SentencePiece's <unk>, BOS, EOS, a token per byte, then special tokens.
MARKER_BYTES = [f"<0x{i:02X}>" for i in range(256)]
MARKER_SPECIALS = (
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|python_tag|>",
    "<tool_call>",
    "</tool_call>",
)


def write_marker_model(
    path: Path,
    template: str,
    favourites: tuple[str, ...],
    *,
    extra: tuple[str, ...] = (),
    after: Mapping[str, str] | None = None,
    n_embd: int = N_EMBD,
    n_layer: int = N_LAYER,
    n_head: int = N_HEAD,
) -> Path:
    """A ``llama`` model of an SPM vocabulary (bytes, and ``MARKER_SPECIALS`` typed CONTROL,
    as Mistral's, Llama 3's markers are) with chat ``template``, whose greedy choice is the
    same order of preference at every position: ``favourites`` first (token texts, in order),
    then EOS, then every other token by id (whitespace last). So, free, it writes
    ``favourites[0]`` and, held by a grammar, the first token the grammar allows: a call
    grammar's markers as their control tokens, its text spelled byte by byte.

    How: its layers add nothing (attention and FFN outputs are zero), so the last position's
    state is its token's embedding, whose first component is 1 for every token; the final
    norm keeps only that component, positive; the output matrix's first column is each
    token's preference.

    ``extra``: ordinary tokens of several characters (a space in one is SentencePiece's
    ``▁``), which only the model writes (a prompt never merges into them). ``after``: a token
    the model writes first right after another, whatever else it prefers (``{"A": "B"}``: B
    follows A; ``</s>`` ends the reply), so a reply can be a short fixed sequence: one more
    state component per pair, 1 for A's embedding only, kept by the norm, and B's output
    weight on it above the whole range of preferences."""
    import gguf

    extra = tuple(t.replace(" ", "\u2581") for t in extra)
    tokens = ["<unk>", "<s>", "</s>", *MARKER_BYTES, *MARKER_SPECIALS, *extra]
    types = [2, 3, 3] + [6] * 256 + [3] * len(MARKER_SPECIALS) + [1] * len(extra)
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", [0.0] * n_vocab)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_string("tokenizer.chat_template", template)
    k = "llama."
    head = n_embd // n_head
    n_ff = 2 * n_embd
    w.add_uint32(k + "context_length", N_CTX)
    w.add_uint32(k + "embedding_length", n_embd)
    w.add_uint32(k + "block_count", n_layer)
    w.add_uint32(k + "feed_forward_length", n_ff)
    w.add_uint32(k + "attention.head_count", n_head)
    w.add_uint32(k + "attention.head_count_kv", n_head)
    w.add_uint32(k + "rope.dimension_count", head)
    w.add_float32(k + "attention.layer_norm_rms_epsilon", 1e-5)

    def index(text: str) -> int:
        return tokens.index(text.replace(" ", "\u2581"))

    order = [index(t) for t in favourites] + [2]
    whitespace = [3 + b for b in b" \t\r\n"]
    order += [t for t in range(n_vocab) if t not in order and t not in whitespace]
    order += whitespace
    preference = np.zeros(n_vocab, np.float32)
    preference[order] = -np.arange(n_vocab, dtype=np.float32) / n_vocab  # first: 0, best

    rng = np.random.default_rng(5)
    embd = rng.normal(0.0, 0.1, (n_vocab, n_embd)).astype(np.float32)
    embd[:, 0] = 1.0
    out = np.zeros((n_vocab, n_embd), np.float32)
    out[:, 0] = preference
    only_first = np.zeros(n_embd, np.float32)
    only_first[0] = 1.0
    pairs = list((after or {}).items())
    if len(pairs) >= n_embd:
        raise ValueError(f"at most {n_embd - 1} pairs in after")
    embd[:, 1 : len(pairs) + 1] = 0.0
    for slot, (first, then) in enumerate(pairs, start=1):
        embd[index(first), slot] = 1.0
        out[index(then), slot] = 2.0
        only_first[slot] = 1.0
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", only_first)
    w.add_tensor("output.weight", out)
    for il in range(n_layer):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(n_embd, np.float32))
        for name in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(
                b + name + ".weight", rng.normal(0.0, 0.1, (n_embd, n_embd)).astype(np.float32)
            )
        w.add_tensor(b + "attn_output.weight", np.zeros((n_embd, n_embd), np.float32))
        w.add_tensor(b + "ffn_gate.weight", rng.normal(0.0, 0.1, (n_ff, n_embd)).astype(np.float32))
        w.add_tensor(b + "ffn_up.weight", rng.normal(0.0, 0.1, (n_ff, n_embd)).astype(np.float32))
        w.add_tensor(b + "ffn_down.weight", np.zeros((n_embd, n_ff), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
