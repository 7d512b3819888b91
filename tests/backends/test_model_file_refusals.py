"""Model GGUFs built to trip the pinned llama.cpp's load-time asserts are refused before it
reads them (``backends/llama/model_file.py``; found by review): each of these aborted the
process (GGML_ASSERT, or a C++ exception nothing caught) when loaded, when its first context
was built, or at the first prompt with a character its vocabulary cannot spell. Through the
server that was one file in ``models_dir`` and one request naming it.

The in-process tests read the files only; the engine test loads them all in one child
process, so an abort fails a test and not the run.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.childkit import assert_case_ok
from tests.tinymodels import (
    N_VOCAB,
    write_reranker,
    write_tiny_audio_projector,
    write_tiny_projector,
)

from kvwarm.backends.llama import model_file
from kvwarm.errors import InvalidModelFileError, ModelLoadError

_BYTES = [f"<0x{i:02X}>" for i in range(256)]


def _patch_u32(path: Path, key: str, value: int) -> None:
    """Set the uint32 value of ``key`` in the GGUF at ``path`` in place (a byte edit)."""
    data = bytearray(path.read_bytes())
    needle = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(needle) + len(needle)
    assert struct.unpack_from("<I", data, at)[0] == 4, "not a uint32 key"
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(bytes(data))


def _retype(path: Path, key: str, old: int, new: int) -> None:
    """Give ``key`` of the GGUF at ``path`` GGUF type ``new`` (a type of ``old``'s size) in
    place, its value's bytes kept."""
    data = bytearray(path.read_bytes())
    needle = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(needle) + len(needle)
    assert struct.unpack_from("<I", data, at)[0] == old, f"{key} is not of type {old}"
    struct.pack_into("<I", data, at, new)
    path.write_bytes(bytes(data))


def _retype_first_tensor(path: Path, ggml_type: int) -> None:
    """Give the tensor table's first entry (token_embd.weight, f32) another type of the same
    size in place."""
    from kvwarm import gguf_meta

    data = bytearray(path.read_bytes())
    with path.open("rb") as f:
        gguf_meta.read_metadata(f, len(data), ())
        at = f.tell()
    (n,) = struct.unpack_from("<Q", data, at)
    (n_dims,) = struct.unpack_from("<I", data, at + 8 + n)
    struct.pack_into("<I", data, at + 8 + n + 4 + 8 * n_dims, ggml_type)
    path.write_bytes(bytes(data))


def _vocab(
    model: str,
    tokens: list[str],
    types: list[int] | None = None,
    extra: Callable[[Any], Any] | None = None,
) -> Callable[[Any], int]:
    def add(w: Any) -> int:
        w.add_string("tokenizer.ggml.model", model)
        w.add_array("tokenizer.ggml.tokens", tokens)
        w.add_array("tokenizer.ggml.scores", [0.0] * len(tokens))
        if types is not None:
            w.add_array("tokenizer.ggml.token_type", types)
        if extra is not None:
            extra(w)
        return len(tokens)

    return add


_TEST_TOKENS = [f"tok_{i}" for i in range(N_VOCAB)]


def _keys(extra: Callable[[Any], Any]) -> Callable[[Any], int]:
    return _vocab("test", _TEST_TOKENS, extra=extra)


def _with_u32(key: str, value: int) -> Callable[[Path], None]:
    return lambda path: _patch_u32(path, key, value)


#: name: (tokenizer keys or None, byte edit or None, what the refusal says)
CASES: dict[str, tuple[Callable[[Any], int] | None, Callable[[Path], None] | None, str]] = {
    "no-layers": (None, _with_u32("qwen3.block_count", 0), "block_count is 0"),
    "too-many-layers": (None, _with_u32("qwen3.block_count", 100_000), "block_count is 100000"),
    "nextn-over-layers": (
        _keys(lambda w: w.add_uint32("qwen3.nextn_predict_layers", 9)), None, "nextn_predict",
    ),
    "experts-over-max": (
        _keys(lambda w: (w.add_uint32("qwen3.expert_count", 5000),
                         w.add_uint32("qwen3.expert_used_count", 1))),
        None, "expert_count is 5000",
    ),
    "more-used-than-experts": (
        _keys(lambda w: (w.add_uint32("qwen3.expert_count", 2),
                         w.add_uint32("qwen3.expert_used_count", 5))),
        None, "expert_used_count",
    ),
    "used-experts-without-experts": (
        _keys(lambda w: w.add_uint32("qwen3.expert_used_count", 1)), None, "expert_used_count",
    ),
    "unknown-rope-scaling": (
        _keys(lambda w: w.add_string("qwen3.rope.scaling.type", "bogus")), None, "bogus",
    ),
    "rope-wider-than-head": (
        _keys(lambda w: w.add_uint32("qwen3.rope.dimension_count", 100_000)), None, "100000",
    ),
    "rope-narrower-than-head": (
        _keys(lambda w: w.add_uint32("qwen3.rope.dimension_count", 8)), None, "must equal",
    ),
    "i32-weights": (None, lambda path: _retype_first_tensor(path, 26), "of type i32"),
    "duplicate-tokens": (_vocab("test", ["x"] * N_VOCAB), None, "twice"),
    "empty-token-named-like-another": (
        _vocab("test", ["", "[EMPTY_0]", *_TEST_TOKENS[2:]]), None, "EMPTY_0",
    ),
    "byte-token-in-a-wordpiece-vocab": (
        _vocab("bert", _TEST_TOKENS, [6] * N_VOCAB), None, "typed BYTE",
    ),
    "spm-without-byte-tokens": (
        _vocab("llama", _TEST_TOKENS, [1] * N_VOCAB), None, "no token for byte 0x00",
    ),
    "spm-lower-case-byte-tokens": (
        _vocab("llama", ["<unk>", "<s>", "</s>", *(b.lower() for b in _BYTES)],
               [2, 3, 3] + [6] * 256),
        None, "no token for byte 0x0A",
    ),
}  # fmt: skip


def _build(directory: Path, name: str) -> Path:
    tokenizer, edit, _ = CASES[name]
    path = directory / f"{name}.gguf"
    write_reranker(path, "decoder", template=None, tokenizer=tokenizer)
    if edit is not None:
        edit(path)
    return path


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("hostile")
    return {name: _build(directory, name) for name in CASES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_check_refuses_it(hostile: dict[str, Path], name: str) -> None:
    with pytest.raises(ModelLoadError, match=CASES[name][2]):
        model_file.check_path(hostile[name])


def test_a_sound_file_passes(tmp_path: Path) -> None:
    spm = _vocab("llama", ["<unk>", "<s>", "</s>", *_BYTES, "\u2581hi"], [2, 3, 3] + [6] * 257)
    for tokenizer in (None, spm):
        path = tmp_path / "sound.gguf"
        write_reranker(path, "decoder", template=None, tokenizer=tokenizer)
        model_file.check_path(path)


_ENGINE = """
import sys
import kvwarm
from kvwarm.errors import ModelLoadError
with kvwarm.Engine() as engine:
    for path in sys.argv[1:]:
        print("loading", path, flush=True)
        try:
            model = engine.load_model(path)
        except ModelLoadError as exc:
            print("refused:", exc, flush=True)
            continue
        model.complete("h\\u00e9llo \\u2603", max_tokens=1)  # a tokenize of bytes it lacks
        raise SystemExit(f"{path} loaded and served")
print("CASE-OK")
"""


@pytest.mark.model
def test_an_engine_load_of_each_is_a_typed_error(hostile: dict[str, Path]) -> None:
    assert_case_ok("-c", _ENGINE, *(str(hostile[name]) for name in sorted(CASES)), timeout=300)


def _deeply_nested(path: Path, depth: int = 5000) -> Path:
    """A GGUF whose one key is an array of arrays ``depth`` deep (gguf.cpp refuses any
    array of arrays)."""
    kv = struct.pack("<Q", 1) + b"a" + struct.pack("<I", 9)
    kv += struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv + b"\0" * 64)
    return path


def test_arrays_nested_deep_are_refused_as_the_file_s_fault(tmp_path: Path) -> None:
    """Found by review: the check's walk recursed into each level of an array of arrays,
    and 5000 levels raised RecursionError out of LlamaModel's load, no ModelLoadError; the
    chunked fingerprint's walk (read_metadata) did the same. Now both refuse the file (as
    gguf.cpp would) as the file's fault: an ``InvalidModelFileError``, a 400 from the server."""
    from kvwarm.cache.types import FingerprintMode
    from kvwarm.engine.fingerprint import fingerprint

    path = _deeply_nested(tmp_path / "nested.gguf")
    with pytest.raises(InvalidModelFileError, match="array of arrays"):
        model_file.check_path(path)
    with pytest.raises(InvalidModelFileError, match="array of arrays"):
        fingerprint(path, FingerprintMode.GGUF_CHUNKED)


#: What the pinned llama.cpp logged when it refused a load: the file's fault, or the
#: machine's (an allocation it could not make, a file it could not open).
_LOGGED = {
    "unknown-arch": (
        ["llama_model_load: error loading model: unknown model architecture: 'llamz'\n"],
        True,
        "unknown model architecture: 'llamz'",
    ),
    "gguf-refused": (
        [
            "gguf_init_from_reader: tensor 'x' has invalid ggml type 99\n",
            "gguf_init_from_reader: failed to read tensor info\n",
            "llama_model_load: error loading model: llama_model_loader: failed to load model "
            "from /m.gguf\n",
        ],
        True,
        "tensor 'x' has invalid ggml type 99; failed to read tensor info",
    ),
    "no-memory": (
        ["llama_model_load: error loading model: unable to allocate CPU buffer\n"],
        False,
        "unable to allocate CPU buffer",
    ),
    "cannot-map": (
        ["llama_model_load: error loading model: mmap failed: Cannot allocate memory\n"],
        False,
        "mmap failed",
    ),
    "threw-bad-alloc": (
        ["llama_model_load: error loading model: std::bad_alloc\n"],
        False,
        "std::bad_alloc",
    ),
}


_NO_MEMORY = """
import dataclasses, resource
import psutil
from kvwarm.backends.llama import native
from kvwarm.backends.llama.model import LlamaModel
from kvwarm.backends.params import ModelParams
from kvwarm.embedded import default_model_path
from kvwarm.errors import InvalidModelFileError, ModelLoadError
native.lib()
# Room for some 20 MB more than this process holds: the weights (~96 MB, not mapped) cannot
# be allocated.
room = psutil.Process().memory_info().vms + (20 << 20)
resource.setrlimit(resource.RLIMIT_AS, (room, resource.getrlimit(resource.RLIMIT_AS)[1]))
params = dataclasses.replace(ModelParams(), use_mmap=False)
try:
    LlamaModel(str(default_model_path()), params)
except InvalidModelFileError as exc:
    raise SystemExit(f"the machine's failure blamed on the file: {exc}")
except ModelLoadError as exc:
    assert "unable to allocate" in str(exc), exc
    print("refused:", exc, flush=True)
else:
    raise SystemExit("it loaded within the limit")
print("CASE-OK")
"""


@pytest.mark.model
def test_a_load_out_of_memory_stays_the_machine_s_failure() -> None:
    """The real llama.cpp's words when it cannot allocate the weights: a plain
    ``ModelLoadError`` (the server's 503), not the file's ``InvalidModelFileError``."""
    assert_case_ok("-c", _NO_MEMORY, timeout=120)


@pytest.mark.parametrize("name", sorted(_LOGGED))
def test_a_refused_load_is_the_file_s_fault_or_the_machine_s(name: str) -> None:
    lines, the_file, reason = _LOGGED[name]
    error = model_file.refusal("'/m.gguf'", lines)
    assert isinstance(error, ModelLoadError) and reason in str(error), error
    assert isinstance(error, InvalidModelFileError) is the_file
    assert model_file.refusal("'/m.gguf'", ["llama_model_load: cancelled model load\n"]) is None


@pytest.mark.model
@pytest.mark.parametrize("mode", ["safe", "gguf_chunked"])
def test_an_engine_load_of_deeply_nested_arrays_is_a_typed_error(tmp_path: Path, mode: str) -> None:
    import kvwarm

    path = _deeply_nested(tmp_path / "nested.gguf")
    with kvwarm.Engine() as engine, pytest.raises(ModelLoadError):
        engine.load_model(path, fingerprint_mode=mode)


def _rename_tensor(path: Path, old: str, new: str) -> Path:
    """Rename tensor ``old`` of the GGUF at ``path`` to ``new`` (same length) in place: the
    tensor is then missing under its own name."""
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    needle = struct.pack("<Q", len(old)) + old.encode()
    at = data.index(needle) + 8
    data[at : at + len(old)] = new.encode()
    path.write_bytes(bytes(data))
    return path


def _projector(*edits: tuple[str, int], **kw: Any) -> Callable[[Path], Path]:
    def build(path: Path) -> Path:
        write_tiny_projector(path, 576, **kw)  # SmolLM2's width
        for key, value in edits:
            _patch_u32(path, key, value)
        return path

    return build


def _retyped(key: str, old: int, new: int) -> Callable[[Path], Path]:
    def build(path: Path) -> Path:
        _retype(_projector()(path), key, old, new)
        return path

    return build


def _audio(**kw: Any) -> Callable[[Path], Path]:
    return lambda path: write_tiny_audio_projector(path, 576, **kw)


def _without(tensor: str, **kw: Any) -> Callable[[Path], Path]:
    return lambda path: _rename_tensor(_projector(**kw)(path), tensor, tensor[:-1] + "_")


def _audio_without(tensor: str) -> Callable[[Path], Path]:
    return lambda path: _rename_tensor(_audio()(path), tensor, tensor[:-1] + "_")


#: Projectors: name: (how to write it, what the refusal says). Each crashed the process on
#: the old code: mtmd's load (its encoder graph, built at load) aborted or, for a tensor
#: clip.cpp loads as optional and its graph then uses, SIGSEGV; a scale factor not dividing
#: the patch grid loaded and aborted at the first image. ``qwen2a`` stands for the six audio
#: types of whisper's encoder (ultravox, voxtral, glma, meralion, musicflamingo).
PROJECTOR_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "image-smaller-than-a-patch": (
        _projector(("clip.vision.image_size", 0)), "smaller than one patch",
    ),
    "no-heads": (_projector(("clip.vision.attention.head_count", 0)), "does not divide"),
    "heads-not-dividing-the-width": (
        _projector(("clip.vision.attention.head_count", 3)), "does not divide",
    ),
    "gemma3-relabelled-mlp": (_projector(projector_type="mlp"), "needs tensor 'mm.0.weight'"),
    "gemma3-position-embedding-not-the-grid": (
        _projector(n_pos=63), r"position_embd.weight is \[64, 63\]",
    ),
    "gemma3-scale-factor-not-dividing-the-grid": (
        _projector(scale_factor=3), "does not divide the 8x8 patch grid",
    ),
    "gemma3-without-patch-embedding": (
        _without("v.patch_embd.weight"), "needs tensor 'v.patch_embd.weight'",
    ),
    "gemma3-layer-without-attn-q": (
        _without("v.blk.1.attn_q.weight"), "needs tensor 'v.blk.1.attn_q.weight'",
    ),
    "mlp-layer-without-attn-k": (
        _without("v.blk.0.attn_k.weight", llava=True), "needs tensor 'v.blk.0.attn_k.weight'",
    ),
    "mlp-without-position-embedding": (
        _without("v.position_embd.weight", llava=True), "needs tensor 'v.position_embd.weight'",
    ),
    "mlp-position-embedding-short": (
        _projector(llava=True, n_pos=63), "a row per patch",
    ),
    "mlp-without-mm0-bias": (_without("mm.0.bias", llava=True), "needs tensor 'mm.0.bias'"),
    "qwen2a-without-position-embedding": (
        _audio_without("a.position_embd.weight"), "needs tensor 'a.position_embd.weight'",
    ),
    "qwen2a-position-embedding-short": (_audio(n_pos=1499), "has 1499 positions"),
    "qwen2a-with-a-k-bias": (_audio(k_bias=True), "cannot have tensor 'a.blk.0.attn_k.bias'"),
    "qwen2a-without-ln1-bias": (
        _audio_without("a.blk.0.ln1.bias"), "needs tensor 'a.blk.0.ln1.bias'",
    ),
    "qwen2a-without-q-bias": (
        _audio_without("a.blk.0.attn_q.bias"), "needs tensor 'a.blk.0.attn_q.bias'",
    ),
    "qwen2a-without-attn-v": (
        _audio_without("a.blk.0.attn_v.weight"), "needs tensor 'a.blk.0.attn_v.weight'",
    ),
    # A key of another GGUF type than mtmd reads it as (its typed getters assert the type):
    # u32 4, i32 5, f32 6, bool 7, u8 0, i8 1.
    "image-size-a-float32": (
        _retyped("clip.vision.image_size", 4, 6), "image_size is a GGUF float32, not the uint32",
    ),
    "patch-size-an-int32": (
        _retyped("clip.vision.patch_size", 4, 5), "patch_size is a GGUF int32, not the uint32",
    ),
    "epsilon-a-uint32": (
        _retyped("clip.vision.attention.layer_norm_epsilon", 6, 4),
        "epsilon is a GGUF uint32, not the float32",
    ),
    "has-vision-encoder-a-uint8": (
        _retyped("clip.has_vision_encoder", 7, 0), "encoder is a GGUF uint8, not the bool",
    ),
    "use-gelu-an-int8": (_retyped("clip.use_gelu", 7, 1), "gelu is a GGUF int8, not the bool"),
}  # fmt: skip

#: Projectors llama.cpp loads and encodes an image with, at the edges of the rules above (a
#: position embedding that repeats over the patches, longer than they need, scale factors
#: of 1 and of the whole grid, an mlp encoder's last layer, which llava.cpp does not run,
#: without attention weights): the check passes them all.
SOUND_PROJECTORS: dict[str, Callable[[Path], Path]] = {
    "gemma3": _projector(),
    "gemma3-one-position-row": _projector(n_pos=1),
    "gemma3-scale-factor-1": _projector(scale_factor=1),
    "gemma3-scale-factor-of-the-grid": _projector(scale_factor=8),
    "mlp": _projector(llava=True),
    "mlp-position-embedding-long": _projector(llava=True, n_pos=65),
    "mlp-last-layer-without-attn-q": _without("v.blk.1.attn_q.weight", llava=True),
    "qwen2a": _audio(),
    "qwen2a-position-embedding-long": _audio(n_pos=1501),
}


def _write_all(directory: Path, builders: dict[str, Callable[[Path], Path]]) -> dict[str, Path]:
    return {name: build(directory / f"{name}.gguf") for name, build in builders.items()}


@pytest.fixture(scope="module")
def hostile_projectors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    builders = {name: build for name, (build, _) in PROJECTOR_CASES.items()}
    return _write_all(tmp_path_factory.mktemp("projectors"), builders)


@pytest.fixture(scope="module")
def sound_projectors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _write_all(tmp_path_factory.mktemp("sound-projectors"), SOUND_PROJECTORS)


@pytest.mark.parametrize("name", sorted(PROJECTOR_CASES))
def test_the_check_refuses_the_projector(hostile_projectors: dict[str, Path], name: str) -> None:
    with pytest.raises(ModelLoadError, match=PROJECTOR_CASES[name][1]):
        model_file.check_path(hostile_projectors[name])


@pytest.mark.parametrize("name", sorted(SOUND_PROJECTORS))
def test_the_check_passes_the_sound_projector(sound_projectors: dict[str, Path], name: str) -> None:
    model_file.check_path(sound_projectors[name])


_PROJECTOR = """
import struct
import sys
from kvwarm.backends.base import ProjectorParams
from kvwarm.backends.llama import LlamaBackend
from kvwarm.embedded import default_model_path
from kvwarm.errors import ModelLoadError
from kvwarm.media import Audio, Image
model = LlamaBackend().load_model(str(default_model_path()))
sound = sys.argv[1] == "sound"
image = Image(64, 64, bytes(range(256)) * 48)
audio = Audio(struct.pack("<4f", 0.1, -0.2, 0.3, -0.1) * 4000, 16000)  # 1 s
for path in sys.argv[2:]:
    print("loading", path, flush=True)
    try:
        projector = model.load_projector(path, ProjectorParams())
    except ModelLoadError as exc:
        if sound:
            raise
        print("refused:", exc, flush=True)
        continue
    # The first image: where a scale factor not dividing the patch grid aborted.
    media = audio if "qwen2a" in path else image
    print("encoded", len(projector.encode(media, 0)), flush=True)
    projector.close()
    if not sound:
        raise SystemExit(f"{path} loaded")
print("CASE-OK")
"""


@pytest.mark.model
def test_a_projector_load_of_each_is_a_typed_error(hostile_projectors: dict[str, Path]) -> None:
    paths = [str(hostile_projectors[name]) for name in sorted(PROJECTOR_CASES)]
    assert_case_ok("-c", _PROJECTOR, "hostile", *paths, timeout=300)


@pytest.mark.model
def test_the_sound_projectors_load_and_encode_an_image(sound_projectors: dict[str, Path]) -> None:
    paths = [str(sound_projectors[name]) for name in sorted(SOUND_PROJECTORS)]
    assert_case_ok("-c", _PROJECTOR, "sound", *paths, timeout=300)
