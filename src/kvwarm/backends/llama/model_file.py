"""A model GGUF's metadata checked in Python before llama.cpp loads it.

llama.cpp's GGUF reader (``gguf.cpp``) refuses a malformed file (lengths past its end, tensor
offsets, sizes, types and dimensions out of range: measured, a refusal, not an abort), but its
model loader then asserts on metadata the reader accepted: a ``GGML_ASSERT`` or an uncaught C++
exception kills the whole process, the server with every model it serves, for one file put in
``models_dir`` and named in a request. Each rule below is one such abort of the pinned
llama.cpp (0.3.36), found by loading hostile files in a child process
(``tests/backends/test_model_file_refusals.py``); the rule is llama.cpp's own condition, so
every file it loads without aborting still passes.

Projectors (``general.architecture`` ``clip``, or any file loaded as one) get the types of
the keys mtmd reads (``_CLIP_TYPES``: its typed getters assert them), the generic rules of
``_clip_problem`` and, for the vision projector types ``gemma3`` and ``mlp`` (LLaVA;
``mlp_norm`` when it has ``mm.3.weight``), ``_clip_tensors_problem``: the tensors clip.cpp
loads as optional and its graph then dereferences (a ``gemma3`` projector relabelled ``mlp``
had no ``mm.0.weight``: SIGSEGV at load), a position embedding the encoder's input cannot
take (GGML_ASSERT at load), and ``gemma3``'s pooling factor not dividing the patch grid
(GGML_ASSERT at the first image); for the audio types of whisper's encoder (``qwen2a``,
``ultravox``, ``voxtral``, ``glma``, ``meralion``, ``musicflamingo``),
``_whisper_tensors_problem``: the position embedding (missing: SIGSEGV; under 1500 rows:
GGML_ASSERT) and the first layer's norms and biases it asserts. Not covered, known: every
other projector type's own tensors and asserts (clip.cpp builds some 60 graphs; tests can
write only gemma3, mlp and qwen2a), each type's head tensors past those named (ultravox's,
voxtral's...), and the widths of the matrices each graph multiplies.

Invariant: ``check`` reads only the key/value section and the tensor table, bounded by the
file's size (``gguf_meta.read_values``, ``read_tensors``; an mmap, never a copy of the file),
and raises ``InvalidModelFileError`` (a ``ModelLoadError``: the file's fault, a 400 from the
server) naming the key or tensor at fault, or what in its key/value section gguf.cpp would
refuse. A tensor table it cannot read is left to llama.cpp's own refusal, which ``refusal``
turns into the same error with llama.cpp's reason; a load that failed for want of memory or
of a readable file stays a plain ``ModelLoadError`` (the machine's fault).
"""

from __future__ import annotations

import io
import math
import mmap
import os
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO, cast

from kvwarm import gguf_meta
from kvwarm.backends.llama.native import TILED_SWITCH
from kvwarm.backends.params import QUANTIZED_KV_TYPES, ContextParams, concrete_kv
from kvwarm.errors import InvalidModelFileError, ModelLoadError

#: llama.cpp's LLAMA_MAX_LAYERS and LLAMA_MAX_EXPERTS (``llama-hparams.h``).
MAX_LAYERS = 512
MAX_EXPERTS = 1024
#: ``llama_rope_scaling_type_from_string``'s names; any other GGML_ASSERTs at load.
ROPE_SCALING_TYPES = frozenset({"none", "linear", "yarn", "longrope"})
#: Architectures whose graph asserts ``n_embd_head == n_rot`` (``src/models/*.cpp``), checked
#: when the first context is created: the model loads, and the engine's context creation
#: (at load) aborts. Listed from the pinned source.
ROPE_WHOLE_HEAD = frozenset(
    [
        "apertus",
        "arcee",
        "arctic",
        "baichuan",
        "chameleon",
        "codeshell",
        "cogvlm",
        "cohere2moe",
        "dbrx",
        "deci",
        "deepseek",
        "dots1",
        "dream",
        "ernie4_5",
        "ernie4_5-moe",
        "exaone",
        "exaone-moe",
        "exaone4",
        "falcon",
        "granite",
        "granite_swa",
        "graniteswitch",
        "grok",
        "grovemoe",
        "hunyuan-moe",
        "hunyuan_vl",
        "hy_v3",
        "internlm2",
        "jais2",
        "llada",
        "llada-moe",
        "llama",
        "llama4",
        "maincoder",
        "mellum",
        "minimax-01",
        "minimax-m2",
        "mistral3",
        "nemotron",
        "olmo",
        "olmo2",
        "olmoe",
        "orion",
        "paddleocr",
        "pangu-embedded",
        "plamo",
        "pockettts",
        "qwen2",
        "qwen2moe",
        "qwen2vl",
        "qwen3",
        "qwen3moe",
        "qwen3vl",
        "qwen3vlmoe",
        "rnd1",
        "seed_oss",
        "smallthinker",
        "smollm3",
        "starcoder2",
        "talkie",
        "xverse",
    ]
)
#: Tokenizers (``tokenizer.ggml.model``) whose token_to_piece GGML_ABORTs on a token typed
#: BYTE (6): llama.cpp reads a byte's value only in SPM, UGM and BPE vocabularies, and a WPM
#: vocabulary's pieces are all made at load.
_NO_BYTE_TOKENS = frozenset({"bert", "rwkv", "plamo2"})
_BYTE = 6
_HUNYUAN_ZEROED = frozenset({"hunyuan_vl", "hunyuan-dense"})


#: The keys the rules read: these whole, and any architecture's keys ending so.
_KEYS = frozenset({
    "general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type", "clip.vision.image_size", "clip.vision.patch_size",
    "clip.has_vision_encoder", "clip.projector_type", "clip.vision.projector_type",
    "clip.vision.block_count", "clip.vision.projector.scale_factor",
    "clip.vision.feature_layer", "clip.has_audio_encoder", "clip.audio.projector_type",
    "clip.audio.block_count",
    *(f"clip.{tower}.{key}" for tower in ("vision", "audio")
      for key in ("embedding_length", "attention.head_count")),
})  # fmt: skip
_ARCH_KEYS = frozenset({
    "block_count", "nextn_predict_layers", "expert_count", "expert_used_count",
    "expert_group_count", "expert_group_used_count", "rope.scaling.type",
    "rope.dimension_count", "attention.key_length", "embedding_length",
    "attention.head_count", "posnet.block_count", "convnext.block_count",
})  # fmt: skip


_U32, _I32, _F32, _BOOL, _STR = 4, 5, 6, 7, 8
_TOWERS = ("vision", "audio", "gen.audio")
#: The scalar keys mtmd's ``clip_model_loader`` reads (its ``get_u32``, ``get_i32``,
#: ``get_f32``, ``get_bool``, ``get_string``), by the GGUF type it reads each as: gguf.cpp's
#: typed getters assert it (``GGML_ASSERT(type_to_gguf_type<T>::value == type)``), so a key
#: of another type aborted the process as the projector loaded. (Its arrays it checks itself.)
_CLIP_TYPES: dict[str, int] = {
    **{f"clip.{tower}.{key}": _U32 for tower in _TOWERS for key in (
        "embedding_length", "feed_forward_length", "block_count", "projection_dim",
        "attention.head_count", "attention.head_count_kv", "attention.head_dim",
    )},
    **{f"clip.{tower}.attention.layer_norm_epsilon": _F32 for tower in _TOWERS},
    **dict.fromkeys((
        "clip.audio.chunk_size", "clip.audio.conv_kernel_size", "clip.audio.local_block_count",
        "clip.audio.local_group_size", "clip.audio.max_pos_emb", "clip.audio.num_mel_bins",
        "clip.audio.projector.downsample_rate", "clip.audio.projector.head_count",
        "clip.audio.projector.stack_factor", "clip.audio.projector.window_size",
        "clip.audio.rvq.num_quantizers", "clip.audio.subsampling_factor",
        "clip.audio.window_size", "clip.minicpmv_query_num", "clip.vision.expert_used_count",
        "clip.vision.image_max_pixels", "clip.vision.image_min_pixels",
        "clip.vision.image_size", "clip.vision.n_wa_pattern", "clip.vision.patch_size",
        "clip.vision.preproc_image_size", "clip.vision.preproc_max_tiles",
        "clip.vision.preproc_min_tiles", "clip.vision.projector.query_side",
        "clip.vision.projector.scale_factor", "clip.vision.projector.window_side",
        "clip.vision.sam.block_count", "clip.vision.sam.embedding_length",
        "clip.vision.sam.head_count", "clip.vision.spatial_merge_size",
        "clip.vision.window_size",
    ), _U32),
    "clip.minicpmv_version": _I32,
    "clip.vision.swiglu_clamp": _F32,
    **dict.fromkeys((
        "clip.has_vision_encoder", "clip.has_audio_encoder", "clip.has_gen_audio_encoder",
        "clip.use_gelu", "clip.use_silu",
    ), _BOOL),
    **dict.fromkeys((
        "clip.projector_type", "clip.vision.projector_type", "clip.audio.projector_type",
        "clip.gen.audio.projector_type", "clip.gen.audio.model_variant",
        "clip.vision.mm_patch_merge_type", "general.name", "general.description",
    ), _STR),
}  # fmt: skip


def _wanted(key: str) -> bool:
    return key in _KEYS or key in _CLIP_TYPES or key.partition(".")[2] in _ARCH_KEYS


def check(buf: gguf_meta.Buffer, name: str, *, projector: bool = False) -> None:
    """``InvalidModelFileError`` if the GGUF whose bytes are ``buf`` has a key/value section
    gguf.cpp would refuse (cut short, a length past the file's end, an unknown value type, an
    array of arrays, a version before 2: each a refusal of gguf.cpp's own, named here) or is
    one the pinned llama.cpp would abort the process on; nothing for a file without the GGUF
    magic (``models_dir.check_gguf_magic`` refuses those). ``name`` is what the error calls
    it; ``projector``: it is loaded as a projector (mtmd reads it whatever its architecture):
    its keys must be of the types mtmd reads them as (``_CLIP_TYPES``), as a ``clip`` file's."""
    if bytes(buf[:4]) != gguf_meta.MAGIC:
        return
    try:
        found = gguf_meta.read_values(buf, _wanted)
    except ValueError as exc:
        raise InvalidModelFileError(
            f"{name} is not a readable GGUF file (its header is malformed or cut short): {exc}"
        ) from None
    try:
        problem = (
            _clip_types_problem(found, projector)
            or _problem(found.values)
            or _tensors_problem(buf, found)
        )
    except ValueError:
        # A tensor table this walk cannot read: gguf.cpp refuses it too (a refusal, not an
        # abort, whose reason ``refusal`` reports), save a 0-dimension entry it takes.
        return
    if problem:
        raise InvalidModelFileError(
            f"{name} is a GGUF file llama.cpp cannot load safely: {problem}"
        )


def check_path(path: str | os.PathLike[str], *, projector: bool = False) -> None:
    """``check`` of the file at ``path`` (mapped, not read); a file that cannot be opened or
    mapped is left to llama.cpp."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below, after the check)
    except OSError:
        return
    with f:
        try:
            if os.fstat(f.fileno()).st_size == 0:
                return
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return
        with buf:
            check(buf, repr(os.fspath(path)), projector=projector)


#: What llama.cpp says when the machine, not the file, stopped a load: a buffer it could not
#: allocate (``llama-model.cpp``: "unable to allocate CPU buffer"; a GPU's "out of memory"),
#: a file it could not open, map or read (``llama-mmap.cpp``: "failed to open", "mmap
#: failed", "read error"; ``gguf.cpp``: "failed to open GGUF file"); a C++ allocation that
#: threw (``std::bad_alloc``).
_MACHINE = re.compile(
    r"unable to allocate|failed to allocate|out of memory|cannot allocate|bad_alloc"
    r"|mmap failed|failed to mmap|failed to open|read error|no space left",
    re.IGNORECASE,
)
_ERROR = "error loading model: "
#: ``llama_model_loader``'s line when ``gguf.cpp`` refused the file: the reason is in the
#: lines gguf.cpp logged before it.
_GGUF_REFUSED = "failed to load model from "


def refusal(name: str, lines: Sequence[str]) -> ModelLoadError | None:
    """The error for a model load llama.cpp refused, from the lines it logged meanwhile
    (``native.captured_log``): ``InvalidModelFileError`` with llama.cpp's reason where the
    file is at fault (an unknown architecture, a missing key, a tensor of the wrong shape or
    past the file's end, a header gguf.cpp refuses), a plain ``ModelLoadError`` where the
    machine is (``_MACHINE``: memory, a file it could not open or read); None when it logged
    no reason (a cancelled load)."""
    reason = ""
    for line in lines:
        at = line.find(_ERROR)
        if at >= 0:
            reason = line[at + len(_ERROR) :].strip()
    if not reason:
        return None
    if _GGUF_REFUSED in reason:
        said = [_unprefixed(line) for line in lines if line.startswith(("gguf_", "read:"))]
        reason = "; ".join(s for s in said if s) or reason
    if _MACHINE.search(reason):
        return ModelLoadError(f"llama.cpp could not load {name}: {reason}")
    return InvalidModelFileError(f"{name} is not a model llama.cpp can load: {reason}")


def _unprefixed(line: str) -> str:
    """A log line without its ``function:`` prefix."""
    head, sep, rest = line.strip().partition(": ")
    return rest if sep and " " not in head else line.strip()


#: ggml's integer and f64 types (I8, I16, I32, I64, F64): no model weight is one, and no op
#: of a model's graph takes one as its weight. Found by review: a model whose token
#: embeddings were typed I32 (the same bytes as F32) loaded, and building its first context
#: aborted (GGML_ASSERT in the backend scheduler).
_NOT_WEIGHT_TYPES = {24: "i8", 25: "i16", 26: "i32", 27: "i64", 28: "f64"}


def _tensors_problem(buf: gguf_meta.Buffer, found: gguf_meta.Values) -> str:
    """A model tensor of a type no weight has, or a projector's tensors its graph cannot
    take, from the tensor table."""
    arch = _text(found.values.get("general.architecture"))
    if arch is None:
        return ""
    vit = _vision_vit_type(found.values) if arch == "clip" else None
    whisper = _audio_whisper_type(found.values) if arch == "clip" else None
    if arch == "clip" and vit is None and whisper is None:
        return ""
    # An mmap reads as a file does (read, seek, tell); bytes are wrapped as one.
    reader = cast(BinaryIO, buf) if isinstance(buf, mmap.mmap) else io.BytesIO(bytes(buf))
    reader.seek(found.tensors_at)
    tensors = gguf_meta.read_tensors(reader, len(buf), found.n_tensors)
    if arch == "clip":
        # Only the names the rules read: the table's other entries are not kept.
        shapes = {t.name: t.shape for t in tensors if _clip_tensor_wanted(t.name)}
        n = found.n_tensors
        return (
            (vit and _clip_tensors_problem(vit, found.values, shapes, n))
            or (whisper and _whisper_tensors_problem(whisper, found.values, shapes, n))
            or ""
        )
    for tensor in tensors:
        kind = _NOT_WEIGHT_TYPES.get(tensor.ggml_type)
        if kind is not None:
            return f"tensor {tensor.name!r} is of type {kind}, which no model weight is"
    return ""


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ints(value: object) -> list[int] | None:
    """A scalar or an array of ints as a list; None for anything else."""
    one = _int(value)
    if one is not None:
        return [one]
    if isinstance(value, list):
        many = [_int(v) for v in value]
        return None if None in many else [v for v in many if v is not None]
    return None


def _text(value: object) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else None


def _problem(values: dict[str, gguf_meta.Value]) -> str:
    arch = _text(values.get("general.architecture"))
    if arch is None:
        return ""  # no model llama.cpp would build: it refuses the file itself
    if arch == "clip":
        return _clip_problem(values)
    return _hparams_problem(arch, values) or _vocab_problem(values)


def _clip_types_problem(found: gguf_meta.Values, projector: bool) -> str:
    """A key mtmd reads as another GGUF type than the file's (``_CLIP_TYPES``), in a file
    loaded as a ``projector`` or whose architecture is ``clip``. Found by review: a projector
    whose ``clip.vision.image_size`` was a float32 (or whose ``clip.has_vision_encoder`` was
    no bool, its layer norm epsilon no float32 ...) aborted the process as it loaded."""
    if not projector and _text(found.values.get("general.architecture")) != "clip":
        return ""
    problem = gguf_meta.mistyped(found, _CLIP_TYPES)
    return f"{problem} mtmd reads it as" if problem else ""


def _clip_problem(values: dict[str, gguf_meta.Value]) -> str:
    """A projector (mtmd's ``clip.cpp``) whose encoder graph asserts when mtmd builds it at
    load: heads that do not divide the encoder's width (a reshape), an image smaller than
    one patch (a convolution of no output); and ``gemma3``'s pooling factor, which must
    divide the patch grid. The tensors are ``_clip_tensors_problem``'s."""
    for tower in ("vision", "audio"):
        k = f"clip.{tower}."
        n_embd = _int(values.get(k + "embedding_length"))
        n_head = _int(values.get(k + "attention.head_count"))
        if n_embd and n_head is not None and (n_head == 0 or n_embd % n_head):
            return f"{k}attention.head_count ({n_head}) does not divide its width ({n_embd})"
    image = _int(values.get("clip.vision.image_size"))
    patch = _int(values.get("clip.vision.patch_size"))
    if image is not None and patch and image < patch:
        return f"clip.vision.image_size ({image}) is smaller than one patch ({patch})"
    if image and patch and _vision_vit_type(values) == "gemma3":
        # siglip.cpp pools the patch grid by the scale factor; a factor that does not divide
        # it asserted when the first image's embeddings were read (GGML_ASSERT).
        merge = _int(values.get("clip.vision.projector.scale_factor"))
        merge = _GEMMA3_MERGE if merge is None else merge
        grid = image // patch
        if merge > 0 and grid % merge:
            return (
                f"clip.vision.projector.scale_factor ({merge}) does not divide the "
                f"{grid}x{grid} patch grid (image_size {image} / patch_size {patch})"
            )
    return ""


#: Vision projector types whose encoder is clip.cpp's standard ViT (``build_vit`` for
#: ``gemma3``, ``clip_graph_llava`` for ``mlp``) and whose optional tensors are checked.
_VIT_TYPES = frozenset({"gemma3", "mlp"})
#: ``gemma3``'s pooling factor when the file does not say (clip.cpp's ``n_merge``).
_GEMMA3_MERGE = 4


def _projector_type(values: dict[str, gguf_meta.Value], modality: str) -> str | None:
    """The projector type of a ``modality`` ("vision", "audio") encoder, as mtmd reads it:
    the file's common type, else the modality's own; None without such an encoder."""
    if values.get(f"clip.has_{modality}_encoder") is not True:
        return None
    return _text(values.get("clip.projector_type")) or _text(
        values.get(f"clip.{modality}.projector_type")
    )


def _vision_vit_type(values: dict[str, gguf_meta.Value]) -> str | None:
    """The vision projector type, as mtmd reads it, if it is one of ``_VIT_TYPES``."""
    kind = _projector_type(values, "vision")
    return kind if kind in _VIT_TYPES else None


#: The audio projector types whose encoder is ``clip_graph_whisper_enc``.
_WHISPER_TYPES = frozenset({"ultravox", "voxtral", "qwen2a", "glma", "meralion", "musicflamingo"})
#: Position embeddings whisper's encoder reads: half of the 3000 mel frames of the warmup
#: (``warmup_audio_size``) and of every 30 s window these types pad audio to.
_WHISPER_POSITIONS = 1500


def _audio_whisper_type(values: dict[str, gguf_meta.Value]) -> str | None:
    """The audio projector type, as mtmd reads it, if it is one of ``_WHISPER_TYPES``."""
    kind = _projector_type(values, "audio")
    kind = "qwen2a" if kind == "qwen2.5o" else kind  # clip.cpp's legacy name, for audio
    return kind if kind in _WHISPER_TYPES else None


_CLIP_FIXED = frozenset(
    ["v.patch_embd.weight", "v.position_embd.weight", "v.class_embd", "a.position_embd.weight"]
    + [f"mm.{i}.{part}" for i in range(5) for part in ("weight", "bias")]
)
_ATTN = ("attn_q", "attn_k", "attn_v", "attn_qkv")
_LAYER_PARTS = frozenset([*_ATTN, "ln1", "ln2"])


def _clip_tensor_wanted(name: str) -> bool:
    """``_CLIP_FIXED`` and the encoder layers' attention and norm tensors
    (``v.blk.N.attn_q.weight``, ``a.blk.N.ln1.bias``)."""
    if name in _CLIP_FIXED:
        return True
    parts = name.split(".")
    return (
        len(parts) == 5
        and parts[0] in ("v", "a")
        and parts[1] == "blk"
        and parts[3] in _LAYER_PARTS
        and parts[4] in ("weight", "bias")
    )


def _attention_problem(
    prefix: str, n_layers: int, shapes: dict[str, tuple[int, ...]], fused_ok: bool
) -> str:
    """The first of ``n_layers`` layers without its q, k and v weights (or, where the graph
    takes one, a fused qkv weight): clip.cpp loads them as optional and multiplies by them."""
    for il in range(n_layers):
        names = [f"{prefix}.blk.{il}.{a}.weight" for a in _ATTN]
        missing = [n for n in names[:3] if n not in shapes]
        if missing and not (fused_ok and names[3] in shapes):
            return missing[0]
    return ""


def _whisper_tensors_problem(
    kind: str,
    values: dict[str, gguf_meta.Value],
    shapes: dict[str, tuple[int, ...]],
    n_tensors: int,
) -> str:
    """An audio projector of a whisper-encoder type whose graph, built at load, crashes:
    no position embedding (dereferenced: SIGSEGV), fewer than 1500 rows, or a first layer
    without the norms and biases it asserts (GGML_ASSERT)."""
    where = f"a {kind!r} projector"
    pos = shapes.get("a.position_embd.weight")
    if pos is None:
        return f"{where} needs tensor 'a.position_embd.weight'"
    rows = pos[1] if len(pos) > 1 else 1
    if rows < _WHISPER_POSITIONS:
        return (
            f"a.position_embd.weight has {rows} positions; the audio encoder reads "
            f"{_WHISPER_POSITIONS} (a 30 s window)"
        )
    n_layer = _int(values.get("clip.audio.block_count"))
    if n_layer is None or not 1 <= n_layer <= n_tensors:
        return ""  # clip.cpp refuses more layers than tensors: their weights are missing
    first = "a.blk.0."
    for part in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn_q.bias", "attn_v.bias"):
        if first + part not in shapes:
            return f"{where} needs tensor {first + part!r}"
    if first + "attn_k.bias" in shapes:
        return f"{where} cannot have tensor 'a.blk.0.attn_k.bias' (whisper's K has no bias)"
    if missing := _attention_problem("a", n_layer, shapes, fused_ok=True):
        return f"{where} needs tensor {missing!r}"
    return ""


def _clip_tensors_problem(
    kind: str,
    values: dict[str, gguf_meta.Value],
    shapes: dict[str, tuple[int, ...]],
    n_tensors: int,
) -> str:
    """A ``gemma3`` or ``mlp`` projector's tensors that clip.cpp loads as optional and its
    encoder graph, built at load, then uses: missing, a null pointer dereferenced (SIGSEGV);
    a position embedding the patches cannot take, a GGML_ASSERT (``ggml_can_repeat`` of the
    add, a row index past the table)."""
    where = f"a {kind!r} projector"
    if "v.patch_embd.weight" not in shapes:
        return f"{where} needs tensor 'v.patch_embd.weight'"
    n_layer = _int(values.get("clip.vision.block_count"))
    if n_layer is not None and 0 <= n_layer <= n_tensors:  # more: clip.cpp refuses it
        used = n_layer
        if kind == "mlp":  # llava.cpp runs the layers up to the deepest feature layer
            deepest = max(_ints(values.get("clip.vision.feature_layer")) or [], default=-1)
            used = deepest if deepest >= 0 else n_layer - 1
        # llava's graph has no fused qkv
        missing = _attention_problem("v", min(used, n_layer), shapes, kind == "gemma3")
        if missing:
            return f"{where} needs tensor {missing!r}"
    n_embd = _int(values.get("clip.vision.embedding_length"))
    image = _int(values.get("clip.vision.image_size"))
    patch = _int(values.get("clip.vision.patch_size"))
    if not (n_embd and n_embd > 0 and image and patch and patch > 0):
        return ""  # clip.cpp refuses these itself
    n_patches = (image // patch) ** 2
    pos = shapes.get("v.position_embd.weight")
    if kind == "gemma3":
        if pos is not None:
            ne = (*pos, 1, 1, 1)[:4]
            if any(want % have if have else True for want, have in
                   zip((n_embd, n_patches, 1, 1), ne, strict=True)):  # fmt: skip
                return (
                    f"v.position_embd.weight is {list(pos)}; the encoder adds it to "
                    f"[{n_embd}, {n_patches}] patches ((image_size/patch_size)^2)"
                )
        return ""
    # mlp: the graph reads position rows 0..n_pos-1 and adds them to the patches.
    n_pos = n_patches + ("v.class_embd" in shapes)
    if pos is None:
        return f"{where} needs tensor 'v.position_embd.weight'"
    ne = (*pos, 1, 1)[:2]
    if len(pos) > 2 or ne[1] < n_pos or not ne[0] or n_embd % ne[0]:
        return (
            f"v.position_embd.weight is {list(pos)}; the encoder takes [{n_embd}, {n_pos}] "
            "(a row per patch, and the class embedding's)"
        )
    # mm.3.weight makes it clip.cpp's mlp_norm (Yi-type LLaVA); mm.2 is optional in mlp.
    mm = ["mm.0", "mm.1", "mm.3", "mm.4"] if "mm.3.weight" in shapes else ["mm.0"]
    if "mm.2.weight" in shapes and "mm.3.weight" not in shapes:
        mm.append("mm.2")
    for name in (f"{m}.{part}" for m in mm for part in ("weight", "bias")):
        if name not in shapes:
            return f"{where} needs tensor {name!r}"
    return ""


def _hparams_problem(arch: str, values: dict[str, gguf_meta.Value]) -> str:
    """``load_hparams``'s GGML_ASSERTs (``llama-model.cpp``)."""
    k = arch + "."
    n_layer = _int(values.get(k + "block_count"))
    if n_layer is None:
        return ""  # required: llama.cpp refuses a model without it, or of another type
    if not 1 <= n_layer <= MAX_LAYERS:
        return f"{k}block_count is {n_layer}; llama.cpp takes 1 to {MAX_LAYERS} layers"
    nextn = _int(values.get(k + "nextn_predict_layers")) or 0
    if nextn > n_layer:
        return f"{k}nextn_predict_layers ({nextn}) is more than its {n_layer} layers"
    for sub in ("posnet", "convnext"):
        n = _int(values.get(f"{k}{sub}.block_count")) if arch == "wavtokenizer-dec" else None
        if n is not None and n > n_layer:
            return f"{k}{sub}.block_count ({n}) is more than its {n_layer} layers"
    if problem := _experts_problem(arch, values, n_layer):
        return problem
    scaling = _text(values.get(k + "rope.scaling.type"))
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        return (
            f"{k}rope.scaling.type is {scaling!r}; llama.cpp knows "
            f"{', '.join(sorted(ROPE_SCALING_TYPES))}"
        )
    return _rope_problem(arch, values)


def _experts_problem(arch: str, values: dict[str, gguf_meta.Value], n_layer: int) -> str:
    k = arch + "."
    n_expert = _int(values.get(k + "expert_count")) or 0
    used_raw = values.get(k + "expert_used_count")
    used = _ints(used_raw) if used_raw is not None else [0]
    if used is None or (isinstance(used_raw, list) and len(used) != n_layer):
        return ""  # of a type or length llama.cpp refuses itself
    groups = _int(values.get(k + "expert_group_count")) or 0
    group_used = _int(values.get(k + "expert_group_used_count")) or 0
    if arch in _HUNYUAN_ZEROED and n_expert <= 1:
        return ""  # llama.cpp sets both to 0 for these
    used_max = max(used, default=0)
    why = ""
    if n_expert > MAX_EXPERTS:
        why = f"expert_count is {n_expert}, over llama.cpp's {MAX_EXPERTS}"
    elif used_max > n_expert:
        why = f"expert_used_count ({used_max}) is more than expert_count ({n_expert})"
    elif n_expert > 0 and used_max == 0:
        why = f"expert_count is {n_expert} but expert_used_count is 0"
    elif n_expert > 0 and groups >= n_expert:
        why = f"expert_group_count ({groups}) is not less than expert_count ({n_expert})"
    elif n_expert > 0 and groups > 1 and n_expert % groups:
        why = f"expert_count ({n_expert}) is not a multiple of expert_group_count ({groups})"
    elif n_expert > 0 and groups > 1 and not 0 < group_used < groups:
        why = f"expert_group_used_count ({group_used}) is not in 1 to {groups - 1}"
    elif n_expert == 0 and groups:
        why = f"expert_group_count is {groups} on a model without experts"
    return f"{k}{why}" if why else ""


def _rope_problem(arch: str, values: dict[str, gguf_meta.Value]) -> str:
    """A rotary width the graph asserts on when the first context is built."""
    k = arch + "."
    n_rot = _int(values.get(k + "rope.dimension_count"))
    if n_rot is None:
        return ""
    head_k = _int(values.get(k + "attention.key_length"))
    if head_k is None:
        n_embd = _int(values.get(k + "embedding_length"))
        heads = _ints(values.get(k + "attention.head_count"))
        if n_embd is None or not heads or heads[0] <= 0:
            return ""
        head_k = n_embd // heads[0]
    if n_rot > head_k or (arch in ROPE_WHOLE_HEAD and n_rot != head_k):
        return (
            f"{k}rope.dimension_count is {n_rot} but a head is {head_k} wide "
            f"({'must equal it' if arch in ROPE_WHOLE_HEAD else 'at most that'} for {arch})"
        )
    return ""


def _vocab_problem(values: dict[str, gguf_meta.Value]) -> str:
    """``llama_vocab::load``'s aborts (``llama-vocab.cpp``), and the SPM tokenizer's."""
    model = _text(values.get("tokenizer.ggml.model"))
    tokens = values.get("tokenizer.ggml.tokens")
    if model is None or not isinstance(tokens, list) or not tokens:
        return ""
    if not isinstance(tokens[0], bytes):
        return ""  # not an array of strings: llama.cpp refuses it
    words = tokens  # read_values gives arrays of one type
    # llama.cpp names an empty token "[EMPTY_i]" and then asserts every name is unique.
    if b"" in words:
        words = [w or b"[EMPTY_%d]" % i for i, w in enumerate(words)]
    names = set(words)
    if len(names) != len(words):
        seen: set[bytes] = set()
        dup = b""
        for dup in words:
            if dup in seen:
                break
            seen.add(dup)
        return f"tokenizer.ggml.tokens holds {dup!r} twice (every token must be unique)"
    if model in _NO_BYTE_TOKENS:
        types = _ints(values.get("tokenizer.ggml.token_type")) or []
        if _BYTE in types[: len(words)]:
            return (
                f"token {types.index(_BYTE)} is typed BYTE (tokenizer.ggml.token_type 6), "
                f"which a {model!r} vocabulary cannot have"
            )
    if model == "llama":
        return _spm_bytes_problem(names)
    return ""


def _spm_bytes_problem(names: set[bytes]) -> str:
    """An SPM vocabulary spells a character it has no token for as its UTF-8 bytes, each the
    token ``<0xXX>`` (upper-case hex) or the byte itself; llama.cpp throws, uncaught, for a
    byte that has neither, in the first tokenize of such a character."""
    missing: Sequence[int] = [
        b for b in range(256) if b"<0x%02X>" % b not in names and bytes([b]) not in names
    ]
    if missing:
        return (
            f"its SPM vocabulary ('llama') has no token for byte 0x{missing[0]:02X} (neither "
            f"<0x{missing[0]:02X}> nor the byte itself; {len(missing)} bytes lack one): a "
            "prompt with a character it cannot spell would abort"
        )
    return ""


# --- Weights multiplied by another kernel in passes of several rows than in one -------------

#: ggml types whose matrix products llama.cpp's CPU backend computes with llamafile's tinyBLAS
#: for two rows or more and with ``vec_dot`` for one (``ggml-cpu/llamafile/sgemm.cpp``; ``n < 2``
#: returns to ggml), which sum in other orders: F16 or F32 weights made 11 of 11 probe rows
#: differ, an F32 or F16 LoRA adapter up to 11 of 11 on SmolLM2 (by the KV cells). tinyBLAS
#: takes Q8_0, Q4_0, Q5_0 and IQ4_NL too, but those sum as ``vec_dot`` does on these x86 CPUs
#: (measured 2026-11-29 with the tiled kernel below off: Q4_0 and Q5_0 models 0 of 11 probe
#: rows, Gemma 3 270M's Q5_0 and Q8_0 tensors 0 of 16 rows at 100 and 300 cells; SmolLM2's tied
#: Q8_0 output every logit equal), so they are left to the load's probe.
_ROW_KERNEL_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
#: ggml types llama.cpp's CPU backend multiplies with its tiled kernel (``ggml-cpu/tiled``) in
#: passes of 8 rows or more and with ``vec_dot`` in fewer, in every x86 build (AVX and up),
#: unless ``GGML_CPU_TILED_MM`` in the environment is 0 (read once, at its first product): a
#: Q4_K_S model made 9 of 11 probe rows differ, a Q6_K one 9, Gemma 3 270M (Q4_K_M) 14-16 of
#: 16; with the variable 0, none (``tiled_kernel_on``).
_TILED_TYPES = {
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 16: "IQ2_XXS", 17: "IQ2_XS",
    18: "IQ3_XXS", 19: "IQ1_S", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M",
}  # fmt: skip
#: ggml types llama.cpp repacks for its CPU GEMM/GEMV kernels (``ggml-cpu/repack.cpp``, x86
#: with AVX2) where weights load into its extra buffer types (``ModelParams.use_extra_bufts``):
#: a repacked product takes a GEMM for several rows and a GEMV for one; Gemma 3 270M's
#: repacked Q4_K made 14-16 of 16 rows differ with the tiled kernel off, none without repacking.
_REPACK_TYPES = {2: "Q4_0", 12: "Q4_K", 20: "IQ4_NL", 39: "MXFP4"}
#: ggml types llamafile's tinyBLAS multiplies a pass's rows against a few at a time
#: (``tinyBLAS_Q0_AVX``; ``native.tinyblas_columns``) where they are not repacked: a pass of
#: rows past a multiple of that reads such a weight once more (``WeightKernels.column_share``).
_COLUMN_TILED_TYPES = frozenset({2, 6, 8, 20})  # Q4_0, Q5_0, Q8_0, IQ4_NL
#: ggml types' blocks, (elements, bytes), as ggml's type traits have them: what a tensor of
#: the type holds (``tensor_nbytes``).
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
    14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98),
    19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136),
    29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
}  # fmt: skip


def tensor_nbytes(tensor: gguf_meta.TensorInfo) -> int | None:
    """A tensor's bytes as ggml holds it (``ggml_nbytes``): rows of ``shape[0]`` elements in
    blocks of its type; None for a type not in ``GGML_BLOCKS``."""
    block = GGML_BLOCKS.get(tensor.ggml_type)
    if block is None:
        return None
    elements, size = block
    return -(-tensor.shape[0] // elements) * size * math.prod(tensor.shape[1:])


#: Tensors read by row (``ggml_get_rows``), never multiplied: a lookup, not a matrix product.
_LOOKUPS = ("token_embd.weight", "position_embd.weight", "token_types.weight")
_X86 = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


def tiled_kernel_on() -> bool:
    """Whether llama.cpp's CPU backend multiplies K-quant and IQ weights with its tiled kernel
    in passes of 8 rows or more (``_TILED_TYPES``): on x86, unless ``GGML_CPU_TILED_MM`` is
    0, as ggml reads it (``atoi``: an unparsable value is 0)."""
    if platform.machine().lower() not in _X86:
        return False
    value = os.environ.get(TILED_SWITCH)
    return value is None or _atoi(value) != 0


def tiled_kernel_turned_off() -> bool:
    """Whether ``GGML_CPU_TILED_MM`` turns off a tiled kernel this machine has (x86): the
    process computes K-quant products otherwise than by default (``LlamaModel.kernels``)."""
    return platform.machine().lower() in _X86 and not tiled_kernel_on()


#: llama.cpp's switch for the Hadamard rotation of quantized KV cells, read (``atoi``) each time
#: a context's KV cache is made.
ROTATION_SWITCH = "LLAMA_ATTN_ROT_DISABLE"


def kv_rotation_off(params: ContextParams) -> bool:
    """Whether a context of ``params`` made now keeps its quantized KV cells unrotated.

    llama.cpp multiplies K by a Hadamard matrix before it quantizes K into cells of a
    quantized type (V likewise, and the attention's output back), and the queries by the same
    matrix, unless ``LLAMA_ATTN_ROT_DISABLE`` parses to nonzero when the context is made. A
    state saved one way and restored into the other attends with rotated keys and unrotated
    queries: a wrong answer, silently. So where the switch is set and a cell type is quantized,
    the tag ``unrotated`` goes into the cache keys (``LlamaModel.kv_tag``); unset (llama.cpp's
    default), rows keep their keys. Conservative: a head size llama.cpp does not rotate (not a
    multiple of 64) is tagged too, which only keeps such rows apart."""
    value = os.environ.get(ROTATION_SWITCH)
    if value is None or _atoi(value) == 0:
        return False
    return any(concrete_kv(t) in QUANTIZED_KV_TYPES for t in (params.type_k, params.type_v))


def _atoi(text: str) -> int:
    """C's ``atoi``: optional leading whitespace and sign, then digits; 0 if none."""
    digits = re.match(r"\s*([+-]?\d+)", text)
    return int(digits.group(1)) if digits else 0


def _matrix_weights(path: str | os.PathLike[str], *, adapter: bool) -> list[gguf_meta.TensorInfo]:
    """The GGUF's matrix weights (``several_row_kernels``); none if it cannot be read."""
    try:
        with gguf_meta.tensors_of(path) as tensors:
            table = [t for t in tensors if len(t.shape) >= 2 and t.shape[1] > 1]
    except (OSError, ValueError):
        return []
    names = {t.name for t in table}
    return [
        t
        for t in table
        if adapter
        or not (t.name in _LOOKUPS or t.name.endswith("_token_embd.weight"))
        or (t.name == "token_embd.weight" and "output.weight" not in names)
    ]


def position_rows(path: str | os.PathLike[str]) -> int | None:
    """The rows of the GGUF's position table (``position_embd.weight``, ``[n_embd, rows]``:
    an absolute position embedding, BERT's or GPT-2's), the most positions one sequence may
    hold; None without one, or if the table cannot be read."""
    try:
        with gguf_meta.tensors_of(path) as tensors:
            for t in tensors:
                if t.name == "position_embd.weight" and len(t.shape) >= 2:
                    return t.shape[1]
    except (OSError, ValueError):
        return None
    return None


def several_row_kernels(
    path: str | os.PathLike[str], *, adapter: bool = False, repacked: bool = False
) -> str:
    """``WeightKernels.first`` of the GGUF at ``path``: "" if it cannot be read (the load's
    probe still runs); ``adapter``: a LoRA adapter's, each of its 2-D tensors a weight."""
    return WeightKernels.of(path, adapter=adapter).first(repacked=repacked)


@dataclass(frozen=True, slots=True)
class WeightKernels:
    """A GGUF's matrix weights, read once from its tensor table: what kernels llama.cpp
    multiplies them with in passes of several rows."""

    weights: tuple[gguf_meta.TensorInfo, ...]

    @classmethod
    def of(cls, path: str | os.PathLike[str], *, adapter: bool = False) -> WeightKernels:
        return cls(tuple(_matrix_weights(path, adapter=adapter)))

    @property
    def tiled(self) -> bool:
        """Whether a weight is of a type the tiled kernel multiplies, on or not."""
        return any(t.ggml_type in _TILED_TYPES for t in self.weights)

    def column_share(self, *, repacked: bool = False) -> float:
        """The share of the matrix weights' bytes that llamafile's tinyBLAS multiplies a
        pass's rows against a few at a time (``_COLUMN_TILED_TYPES``; repacked Q4_0 and
        IQ4_NL go to the repacked kernels instead): a pass whose rows are not a multiple of
        its columns reads these bytes once more, which in a one-token pass (a read of every
        weight byte) is about that share of the pass (Gemma 3 270M: 0.91, measured ~1.15
        one-token passes; SmolLM2-135M: 0.31, measured ~0.3)."""
        total = tiled = 0.0
        for t in self.weights:
            nbytes = tensor_nbytes(t)  # a type not listed: Q4_K's 4.5 bits an element
            size = math.prod(t.shape) * 4.5 / 8 if nbytes is None else float(nbytes)
            total += size
            if t.ggml_type in _COLUMN_TILED_TYPES and not (
                repacked and t.ggml_type in _REPACK_TYPES
            ):
                tiled += size
        return tiled / total if total else 0.0

    def first(self, *, repacked: bool = False) -> str:
        """The first weight llama.cpp multiplies with another kernel in a pass of several
        rows than in a one-token pass, as "name (TYPE), what kernel"; "" if none. The
        kernels: tinyBLAS (``_ROW_KERNEL_TYPES``), the tiled one while it is on
        (``_TILED_TYPES``, ``tiled_kernel_on``) and, with ``repacked`` (weights in the extra
        buffer types), the repacked ones (``_REPACK_TYPES``). A model's weights are its 2-D
        tensors other than row lookups (``token_embd`` is one only where an ``output.weight``
        exists: a tied output multiplies it)."""
        tiled = tiled_kernel_on()
        for t in self.weights:
            if (kind := _ROW_KERNEL_TYPES.get(t.ggml_type)) is not None:
                return f"{t.name} ({kind}), which llamafile's tinyBLAS multiplies for several rows"
            if tiled and (kind := _TILED_TYPES.get(t.ggml_type)) is not None:
                return (
                    f"{t.name} ({kind}), which llama.cpp's tiled kernel multiplies in passes of "
                    "8 rows or more (GGML_CPU_TILED_MM=0 in kvwarm's environment turns it off)"
                )
            if repacked and (kind := _REPACK_TYPES.get(t.ggml_type)) is not None:
                return f"{t.name} ({kind}), repacked for llama.cpp's GEMM kernel for several rows"
        return ""
