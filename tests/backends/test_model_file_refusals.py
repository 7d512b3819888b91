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
from tests.tinymodels import N_VOCAB, write_reranker, write_tiny_projector

from kvwarm.backends.llama import model_file
from kvwarm.errors import ModelLoadError

_BYTES = [f"<0x{i:02X}>" for i in range(256)]


def _patch_u32(path: Path, key: str, value: int) -> None:
    """Set the uint32 value of ``key`` in the GGUF at ``path`` in place (a byte edit)."""
    data = bytearray(path.read_bytes())
    needle = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(needle) + len(needle)
    assert struct.unpack_from("<I", data, at)[0] == 4, "not a uint32 key"
    struct.pack_into("<I", data, at + 4, value)
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


#: Projectors: name: (byte edits, what the refusal says). Each aborted mtmd's load (its
#: encoder graph, built at load).
PROJECTOR_CASES = {
    "image-smaller-than-a-patch": ((("clip.vision.image_size", 0),), "smaller than one patch"),
    "no-heads": ((("clip.vision.attention.head_count", 0),), "does not divide"),
    "heads-not-dividing-the-width": (
        (("clip.vision.attention.head_count", 3),), "does not divide",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def hostile_projectors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("projectors")
    out = {}
    for name, (edits, _) in PROJECTOR_CASES.items():
        path = write_tiny_projector(directory / f"{name}.gguf", 576)  # SmolLM2's width
        for key, value in edits:
            _patch_u32(path, key, value)
        out[name] = path
    return out


@pytest.mark.parametrize("name", sorted(PROJECTOR_CASES))
def test_the_check_refuses_the_projector(hostile_projectors: dict[str, Path], name: str) -> None:
    with pytest.raises(ModelLoadError, match=PROJECTOR_CASES[name][1]):
        model_file.check_path(hostile_projectors[name])


_PROJECTOR = """
import sys
from kvwarm.backends.base import ProjectorParams
from kvwarm.backends.llama import LlamaBackend
from kvwarm.embedded import default_model_path
from kvwarm.errors import ModelLoadError
model = LlamaBackend().load_model(str(default_model_path()))
for path in sys.argv[1:]:
    print("loading", path, flush=True)
    try:
        model.load_projector(path, ProjectorParams()).close()
    except ModelLoadError as exc:
        print("refused:", exc, flush=True)
        continue
    raise SystemExit(f"{path} loaded")
print("CASE-OK")
"""


@pytest.mark.model
def test_a_projector_load_of_each_is_a_typed_error(hostile_projectors: dict[str, Path]) -> None:
    paths = [str(hostile_projectors[name]) for name in sorted(PROJECTOR_CASES)]
    assert_case_ok("-c", _PROJECTOR, *paths, timeout=300)
