"""The flat public API: names, typed overrides, flat load_model keywords, one home for
sampling defaults, backend-located model files, and embeddings of token ids (stub backend)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from tests.engine.conftest import make_engine

import kvwarm
from kvwarm.backends.base import SamplingParams
from kvwarm.backends.stub import StubBackend
from kvwarm.engine.config import ModelConfig, with_options
from kvwarm.engine.options import GenerationOverrides
from kvwarm.engine.types import SAMPLING_OPTIONS, GenerationOptions
from kvwarm.errors import ConfigError, InvalidRequestError


def test_everything_a_program_needs_imports_from_kvwarm() -> None:
    from kvwarm import (  # noqa: F401
        CacheConfig,
        Completion,
        ContextParams,
        Engine,
        GenerationOptions,
        Model,
        ModelConfig,
        PolicyConfig,
        TierConfig,
        TtlClass,
        errors,
    )

    assert errors.KvwarmError is kvwarm.KvwarmError
    assert all(hasattr(kvwarm, name) for name in kvwarm.__all__)


def test_importing_kvwarm_loads_neither_the_engine_nor_llama_cpp() -> None:
    code = (
        "import sys, kvwarm; from kvwarm import CacheConfig; "
        "print('llama_cpp' in sys.modules, 'kvwarm.engine.api' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_overrides_name_every_generation_option() -> None:
    keys = set(typing.get_type_hints(GenerationOverrides))
    assert keys == {f.name for f in dataclasses.fields(GenerationOptions)}


def test_sampling_defaults_are_the_samplers() -> None:
    opts, sampler = GenerationOptions(), SamplingParams()
    for name in (*SAMPLING_OPTIONS, "seed"):
        assert getattr(opts, name) == getattr(sampler, name), name
    assert opts.sampling(None) == dataclasses.replace(sampler, logit_bias=())


def test_flat_options_land_in_the_right_config() -> None:
    cfg = with_options(
        ModelConfig(),
        {"n_ctx": 256, "n_batch": 64, "n_gpu_layers": 3, "n_parallel": 2, "deterministic": True},
    )
    assert (cfg.context.n_ctx, cfg.context.n_batch, cfg.context.n_ubatch) == (256, 64, 64)
    assert cfg.model_params.n_gpu_layers == 3
    assert (cfg.n_parallel, cfg.deterministic) == (2, True)
    with pytest.raises(ConfigError, match="n_bogus"):
        with_options(ModelConfig(), {"n_bogus": 1})  # type: ignore[typeddict-unknown-key]


def test_load_model_takes_flat_keywords() -> None:
    eng = make_engine()
    try:
        model = eng.load_model(backend="stub", n_ctx=256, n_batch=32, n_parallel=2)
        info = model.info()
        assert (info.n_ctx, info.n_batch, info.n_parallel) == (256, 32, 2)
        assert model.path.name == "stub.gguf"  # the stub backend located its default
    finally:
        eng.close()


def test_the_llama_backend_needs_a_file(tmp_path: object) -> None:
    from kvwarm.backends.llama.model import LlamaBackend

    with pytest.raises(kvwarm.ModelNotFoundError):
        LlamaBackend().locate("/nonexistent/model.gguf")
    assert StubBackend().locate("anything").name == "anything"


def test_embed_uses_token_ids_as_given() -> None:
    eng = make_engine()
    try:
        model = eng.load_model(backend="stub")
        with_bos = model.tokenize("hello")
        bare = model.tokenize("hello", add_special=False)
        by_text, by_ids, by_bare = model.embed(["hello", with_bos, bare])
        assert by_ids == by_text
        assert by_bare != by_text  # ids without BOS are not re-tokenized into BOS + text
        with pytest.raises(InvalidRequestError):
            model.embed([[10**9]])
        with pytest.raises(InvalidRequestError):
            model.embed([[]])
    finally:
        eng.close()


def test_every_error_class_and_every_name_the_docs_use_is_exported() -> None:
    """``from kvwarm import *`` gave ``KvwarmError`` alone of the errors, and ``LoraSpec``
    and ``MediaPrompt``, which docs/python.md has a program use, were in no ``kvwarm``
    namespace at all (found by review)."""
    star: dict[str, object] = {}
    exec("from kvwarm import *", star)
    errors = [
        name
        for name, value in vars(kvwarm.errors).items()
        if isinstance(value, type) and issubclass(value, kvwarm.KvwarmError)
    ]
    assert errors and [name for name in errors if name not in star] == []
    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "python.md").read_text() + (root / "README.md").read_text()
    imported = re.findall(r"from kvwarm import \(?([\w\s,]+)\)?", text)
    named = {n.strip() for group in imported for n in group.split(",") if n.strip()}
    named |= set(re.findall(r"`(LoraSpec|MediaPrompt)\b", text))
    assert named and [name for name in sorted(named) if name not in star] == []
