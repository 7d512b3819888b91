"""Model settings (GPU offload, flash attention, KV types, threads, mmap/mlock, RoPE/YaRN): from
flags, env and the TOML models table to the engine's ``ModelConfig`` and on to the params a
backend is given; bad values are ``ConfigError``s before anything loads."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.cli.test_cli import clean_env

from kvwarm.backends.base import ContextParams, ModelParams
from kvwarm.errors import ConfigError
from kvwarm.settings import (
    ModelSpec,
    Settings,
    add_settings_arguments,
    load_settings,
    model_config,
    settings_flags,
)

ENV = {"XDG_CONFIG_HOME": "/nonexistent-kvwarm-test"}


def _flags(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return settings_flags(parser.parse_args(list(argv)))


def _config(settings: Settings, index: int = 0) -> tuple[ContextParams, ModelParams]:
    cfg = model_config(settings, settings.models[index])
    return cfg.context, cfg.model_params


def test_llama_server_flags_reach_the_model_config() -> None:
    s = load_settings(
        _flags(
            "-ngl", "all", "-sm", "row", "-mg", "1", "-ts", "3,1", "-fa", "on",
            "-ctk", "q8_0", "--cache-type-v", "q4_0", "-t", "2", "-tb", "4",
            "--use-mmap", "false", "--use-mlock", "true", "--rope-scaling", "yarn",
            "--rope-freq-base", "500000", "--rope-freq-scale", "0.25", "--yarn-orig-ctx", "8192",
            "--yarn-ext-factor", "1.0", "--yarn-attn-factor", "1.5", "--yarn-beta-fast", "32",
            "--yarn-beta-slow", "1",
        ),
        ENV,
    )  # fmt: skip
    context, params = _config(s)
    assert (params.n_gpu_layers, params.split_mode, params.main_gpu) == (-1, "row", 1)
    assert params.tensor_split == (3.0, 1.0)
    assert (params.use_mmap, params.use_mlock) == (False, True)
    assert (context.flash_attn, context.type_k, context.type_v) == ("on", "q8_0", "q4_0")
    assert (context.n_threads, context.n_threads_batch) == (2, 4)
    assert (context.rope_scaling, context.rope_freq_base, context.rope_freq_scale) == (
        "yarn",
        500000.0,
        0.25,
    )
    assert (context.yarn_orig_ctx, context.yarn_ext_factor, context.yarn_attn_factor) == (
        8192,
        1.0,
        1.5,
    )
    assert (context.yarn_beta_fast, context.yarn_beta_slow) == (32.0, 1.0)


def test_long_flags_and_env_vars() -> None:
    s = load_settings(
        _flags("--n-gpu-layers", "12", "--flash-attn", "off"),
        {**ENV, "KVWARM_TENSOR_SPLIT": "1,1", "KVWARM_TYPE_K": "Q8_0", "KVWARM_FLASH_ATTN": "on"},
    )
    context, params = _config(s)
    assert params.n_gpu_layers == 12 and params.tensor_split == (1.0, 1.0)
    assert context.flash_attn == "off"  # the flag beats the environment
    assert context.type_k == "q8_0"
    # Defaults: CPU only, llama.cpp's own choices for the rest.
    context, params = _config(load_settings({}, ENV))
    assert (params.n_gpu_layers, params.split_mode, params.tensor_split) == (0, "layer", ())
    assert (context.flash_attn, context.type_k, context.type_v) == ("auto", "auto", "auto")
    assert context.n_threads is None and context.rope_scaling is None


def test_per_model_values_in_the_toml_models_table_win_over_global_ones(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        'n_gpu_layers = 5\ntype_k = "q4_0"\n'
        '[[models]]\nid = "big"\npath = "/m/big.gguf"\nn_gpu_layers = "all"\n'
        'flash_attn = true\ntype_v = "q8_0"\ntensor_split = [3, 1]\nn_threads = 3\n'
        '[[models]]\nid = "small"\npath = "/m/small.gguf"\n'
    )
    s = load_settings({"config": str(config)}, ENV)
    big_ctx, big = _config(s, 0)
    small_ctx, small = _config(s, 1)
    assert (big.n_gpu_layers, big.tensor_split, big_ctx.n_threads) == (-1, (3.0, 1.0), 3)
    assert (big_ctx.flash_attn, big_ctx.type_k, big_ctx.type_v) == ("on", "q4_0", "q8_0")
    assert (small.n_gpu_layers, small_ctx.flash_attn, small_ctx.type_v) == (5, "auto", "auto")
    assert small_ctx.type_k == "q4_0"


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--n-gpu-layers=-2"], {}, "--n-gpu-layers: expected a number of layers >= 0 or 'all'"),
        (
            ["-ngl", "lots"],
            {},
            "--n-gpu-layers: expected a number of layers >= 0 or 'all', got 'lots'",
        ),
        (["--cache-type-k", "q3"], {}, "expected one of f32, f16"),
        ([], {"KVWARM_TYPE_V": "int8"}, "environment setting type_v: expected one of"),
        (["-ts", "0,0"], {}, "at least one GPU a share > 0"),
        (["-ts", "1,-1"], {}, "finite and >= 0"),
        (["-ts", "1,nan"], {}, "--tensor-split: expected a finite number"),
        (["-sm", "diagonal"], {}, "expected one of none, layer, row"),
        (["-fa", "maybe"], {}, "expected one of auto, on, off"),
        (["--main-gpu=-1"], {}, "main_gpu must be >= 0"),
        (["--type-v", "q8_0", "-fa", "off"], {}, "a quantised V cache (type_v=q8_0) needs flash"),
        (["--rope-freq-scale=-0.5"], {}, "rope_freq_scale must be >= 0"),
        (["--rope-freq-base", "inf"], {}, "--rope-freq-base: expected a finite number"),
        (["--rope-scaling", "cubic"], {}, "expected one of none, linear, yarn, longrope"),
        (["--yarn-orig-ctx=-1"], {}, "yarn_orig_ctx must be >= 0"),
        (["-t", "0"], {}, "n_threads must be in [1, 512]"),
        (["-tb", "513"], {}, "n_threads_batch must be in [1, 512]"),
    ],
)
def test_bad_values_are_config_errors(argv: list[str], env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(_flags(*argv), {**ENV, **env})
    assert needle in str(info.value)


def test_bad_per_model_values_name_the_model(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nid = "x"\npath = "/m/x.gguf"\nn_gpu_layers = -3\n')
    with pytest.raises(ConfigError, match=r"model x: n_gpu_layers: expected a number"):
        load_settings({"config": str(config)}, ENV)
    config.write_text('[[models]]\nid = "x"\npath = "/m/x.gguf"\ngpu = 1\n')
    with pytest.raises(ConfigError, match=r"model x: unknown keys gpu"):
        load_settings({"config": str(config)}, ENV)
    # A combination is checked per model, with that model's own values.
    config.write_text(
        'flash_attn = "off"\n[[models]]\nid = "y"\npath = "/m/y.gguf"\ntype_v = "q4_0"\n'
    )
    with pytest.raises(ConfigError, match=r"model y: a quantised V cache"):
        load_settings({"config": str(config)}, ENV)


def test_library_params_are_validated_too() -> None:
    with pytest.raises(ConfigError, match="n_gpu_layers"):
        ModelParams(n_gpu_layers=-5).validate()
    with pytest.raises(ConfigError, match="type_k must be one of"):
        ContextParams(type_k="q3").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tensor_split"):
        ModelParams(tensor_split=(0.0,)).validate()
    with pytest.raises(ConfigError, match="n_gpu_layers"):
        ModelParams(n_gpu_layers=2**40).validate()  # would wrap in the int32 field
    ModelParams(n_gpu_layers=-1, tensor_split=(0.0, 2.0)).validate()  # -1: all layers


def test_kv_types_flash_attention_and_rope_are_folded_into_the_cache_namespace() -> None:
    base = ContextParams()
    # Rows written before these fields existed keep their keys: the defaults hash as v1 did.
    v1 = {"n_batch": 512, "n_ctx": 4096, "n_ubatch": 512, "type_k": "f16", "type_v": "f16"}
    blob = json.dumps(v1, sort_keys=True, separators=(",", ":")).encode()
    assert base.kv_hash() == hashlib.sha256(b"kvwarm-ctx-v1\0" + blob).digest()
    changed = [
        ContextParams(type_k="q8_0"),
        ContextParams(type_v="q8_0"),
        ContextParams(type_k="q4_0", type_v="q4_0"),
        ContextParams(flash_attn="on"),
        ContextParams(flash_attn="off"),
        ContextParams(rope_freq_base=10000.0),
        ContextParams(rope_freq_scale=0.5),
        ContextParams(rope_scaling="yarn"),
        ContextParams(yarn_orig_ctx=2048),
        ContextParams(yarn_ext_factor=1.0),
    ]
    hashes = {c.kv_hash() for c in changed}
    assert len(hashes) == len(changed) and base.kv_hash() not in hashes
    # Where a layer runs and how many threads run it do not change a row's bytes.
    assert ContextParams(n_threads=3, n_threads_batch=5).kv_hash() == base.kv_hash()
    # A model's kernels where they are not the machine's defaults: hashed only then.
    assert base.kv_hash("") == base.kv_hash()
    assert len({base.kv_hash(), base.kv_hash("untiled"), base.kv_hash("untiled,unrepacked")}) == 3


def test_help_lists_the_model_settings_in_their_own_group() -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    text = parser.format_help()
    group = text[text.index("model settings (also per model") :]
    for flag in ("-ngl", "--n-gpu-layers", "-fa", "--cache-type-k", "-ctk", "--rope-freq-scale"):
        assert flag in group, flag


def test_spec_options_are_parsed_values() -> None:
    s = Settings(
        cache_dir=None,
        models=(ModelSpec(path="/m/a.gguf", id="a", options=(("n_gpu_layers", 4),)),),
    )
    assert _config(s)[1].n_gpu_layers == 4


def test_models_dir_alone_replaces_the_default_model(tmp_path: Path) -> None:
    alone = load_settings(_flags("--models-dir", str(tmp_path)), ENV)
    assert alone.models == () and alone.models_dir == tmp_path
    both = load_settings(_flags("--models-dir", str(tmp_path), "--model", "m=/x.gguf"), ENV)
    assert [m.model_id for m in both.models] == ["m"]
    with pytest.raises(ConfigError, match="at least one model"):
        Settings(cache_dir=None, models=()).check()


def test_aliases_from_flags_env_and_toml(tmp_path: Path) -> None:
    flags = load_settings(_flags("--alias", "gpt-4o-mini=m", "--alias", "gpt-4=m"), ENV)
    assert flags.aliases == (("gpt-4o-mini", "m"), ("gpt-4", "m"))
    env = load_settings({}, {**ENV, "KVWARM_ALIASES": "a=m, b=m"})
    assert env.aliases == (("a", "m"), ("b", "m"))
    config = tmp_path / "c.toml"
    config.write_text('[aliases]\n"gpt-4o-mini" = "m"\n')
    assert load_settings({"config": str(config)}, ENV).aliases == (("gpt-4o-mini", "m"),)
    with pytest.raises(ConfigError, match="expected ALIAS=MODEL"):
        load_settings(_flags("--alias", "nomodel"), ENV)
    with pytest.raises(ConfigError, match="names two models"):
        load_settings(_flags("--alias", "a=m", "--alias", "a=n"), ENV)
    with pytest.raises(ConfigError, match="already model ids"):
        load_settings(_flags("--model", "m=/x.gguf", "--alias", "m=n"), ENV)


def test_speculative_decoding_settings_globally_per_model_and_checked(tmp_path: Path) -> None:
    s = load_settings(_flags("--spec-type", "ngram-map-k", "--spec-ngram-n", "3"), ENV)
    cfg = model_config(s, s.models[0])
    assert (cfg.spec_type, cfg.spec_ngram_n, cfg.spec_draft_max) == ("ngram-map-k", 3, 48)
    s = load_settings(
        _flags("--spec-draft-n-max", "8"), {**ENV, "KVWARM_SPEC_TYPE": "ngram-simple"}
    )
    assert model_config(s, s.models[0]).spec_draft_max == 8
    config = tmp_path / "c.toml"
    config.write_text(
        'spec_type = "ngram-simple"\n'
        '[[models]]\nid = "code"\npath = "/m/code.gguf"\nspec_draft_max = 32\n'
        '[[models]]\nid = "chat"\npath = "/m/chat.gguf"\nspec_type = "none"\n'
    )
    s = load_settings({"config": str(config)}, ENV)
    code, chat = (model_config(s, spec) for spec in s.models)
    assert (code.spec_type, code.spec_draft_max, chat.spec_type) == ("ngram-simple", 32, "none")
    for name in ("ngram-map-k4v", "ngram-cache"):
        s = load_settings(_flags("--spec-type", name), ENV)
        assert model_config(s, s.models[0]).spec_type == name
    with pytest.raises(
        ConfigError, match="expected one of none, ngram-simple, ngram-map-k, ngram-map-k4v"
    ):
        load_settings(_flags("--spec-type", "draft-eagle3"), ENV)
    with pytest.raises(ConfigError, match=r"spec_draft_max must be in \[0, 62\]"):
        load_settings(_flags("--spec-type", "ngram-simple", "--spec-draft-max", "63"), ENV)
    with pytest.raises(ConfigError, match="speculative decoding needs flash attention"):
        load_settings(_flags("--spec-type", "ngram-simple", "-fa", "off"), ENV)


def test_a_draft_model_drafts_by_default_and_not_where_spec_type_none_is_given(
    tmp_path: Path,
) -> None:
    """Found by review: ``--spec-type none`` beside ``--draft-model`` read as not given, and
    every request drafted from the draft model."""
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    given = load_settings(_flags("--draft-model", str(draft)), ENV)
    assert model_config(given, given.models[0]).default_spec_type == "draft-simple"
    off = load_settings(_flags("--draft-model", str(draft), "--spec-type", "none"), ENV)
    cfg = model_config(off, off.models[0])
    assert (cfg.spec_type, cfg.default_spec_type, cfg.speculative) == ("none", "none", True)
    assert model_config(load_settings({}, ENV), given.models[0]).default_spec_type == "none"


def test_draft_model_globally_per_model_and_checked(tmp_path: Path) -> None:
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    s = load_settings(_flags("-md", str(draft)), ENV)
    assert model_config(s, s.models[0]).draft_model == str(draft)
    s = load_settings(_flags(), {**ENV, "KVWARM_DRAFT_MODEL": str(draft)})
    assert model_config(s, s.models[0]).draft_model == str(draft)
    config = tmp_path / "c.toml"
    config.write_text(
        f'[[models]]\nid = "code"\npath = "/m/code.gguf"\ndraft_model = "{draft}"\n'
        '[[models]]\nid = "chat"\npath = "/m/chat.gguf"\n'
    )
    s = load_settings({"config": str(config), "backend": "stub"}, ENV)
    assert [model_config(s, m).draft_model for m in s.models] == [str(draft), None]
    with pytest.raises(ConfigError, match="draft_model: no GGUF"):
        load_settings(_flags("--draft-model", str(tmp_path / "missing.gguf")), ENV).check()
    with pytest.raises(ConfigError, match="needs a draft_model"):
        load_settings(_flags("--spec-type", "draft-simple"), ENV).check()


@pytest.mark.parametrize("key", ["n_ctx", "n_parallel"])
def test_a_per_model_zero_is_refused_not_read_as_the_global_value(tmp_path: Path, key: str) -> None:
    """Found by review: ``n_ctx = 0`` (or ``n_parallel = 0``) in a [[models]] table read as
    "not given" (``spec.n_ctx or settings.n_ctx``): the model ran with the global value."""
    config = tmp_path / "kvwarm.toml"
    config.write_text(f'backend = "stub"\n[[models]]\nid = "m"\npath = "m.gguf"\n{key} = 0\n')
    with pytest.raises(ConfigError, match=f"model m: {key} must be >= 1, got 0"):
        load_settings({"config": str(config)}, {})
    config.write_text(f'backend = "stub"\n[[models]]\nid = "m"\npath = "m.gguf"\n{key} = 32\n')
    context, _ = _config(load_settings({"config": str(config)}, {}))
    assert getattr(context, "n_seq_max" if key == "n_parallel" else key) == 32


@pytest.mark.parametrize(
    ("models", "dupe"),
    [
        (["a=stub-x", "a=stub-y"], "a"),  # the same id given twice
        (["stub-x", "stub-x"], "stub-x"),  # the same file: the same id, its stem
        (["/tmp/x.gguf", "/tmp/y/x.gguf"], "x"),  # two files of one stem
    ],
)
def test_serve_refuses_one_model_id_twice_naming_it(
    tmp_path: Path, models: list[str], dupe: str
) -> None:
    """``serve --model`` twice under one id is a usage error naming the id (exit status 2),
    never the first model served and the second dropped."""
    args = [sys.executable, "-m", "kvwarm", "serve", "--backend", "stub", "--port", "0"]
    for model in models:
        args += ["--model", model]
    env = clean_env(tmp_path)
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 2, (result.returncode, result.stderr[-600:])
    assert f"duplicate model ids: {dupe} " in result.stderr, result.stderr


def test_a_typo_in_a_models_table_of_no_id_or_path_names_the_table(tmp_path: Path) -> None:
    """Found by review: a ``[[models]]`` table of the default model (no id, no path) with a
    misspelled key said ``model None: unknown keys ...``; its number names it instead."""
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nid = "a"\npath = "/m/a.gguf"\n[[models]]\nn_gpu_layer = 9\n')
    with pytest.raises(ConfigError, match=r"setting models: model 2: unknown keys n_gpu_layer "):
        load_settings({"config": str(config)}, ENV)


def test_path_default_in_a_models_table_is_the_embedded_model(tmp_path: Path) -> None:
    """Found by review: ``--model m=default``, ``KVWARM_MODELS=m=default`` and ``models =
    ["m=default"]`` serve the embedded model (the help: "PATH 'default' = embedded"), but
    ``path = "default"`` in a ``[[models]]`` table named a file called ``default``, and the
    model failed to load."""
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nid = "m"\npath = "default"\nn_ctx = 1024\n')
    (spec,) = load_settings({"config": str(config)}, ENV).models
    assert (spec.path, spec.model_id, spec.n_ctx) == (None, "m", 1024)
    assert load_settings({"models": ["m=default"]}, ENV).models[0].path is None


def test_a_model_name_that_is_not_utf8_is_refused_at_start() -> None:
    """Found by review: ``--model`` of a file named in Latin-1 (``stub-\\xe9``) gave a model
    id holding a lone surrogate (os.fsdecode's), which no JSON response encodes: the model
    failed to load with a UnicodeEncodeError and /health and /v1/models answered 500. Such
    an id, alias or adapter name is refused before anything starts; the path may stay."""
    import os

    bad = os.fsdecode(b"stub-\xe9")
    env = {**ENV, "KVWARM_BACKEND": "stub"}
    with pytest.raises(ConfigError, match=r"model id 'stub-\\udce9' is not UTF-8 text"):
        load_settings({"models": [bad]}, env)
    with pytest.raises(ConfigError, match=r"alias 'a\\udce9' is not UTF-8 text"):
        load_settings({"models": ["m=stub-m"], "aliases": [f"a{bad[-1]}=m"]}, env)
    assert load_settings({"models": [f"m={bad}"]}, env).models[0].path == bad


def test_a_models_table_with_an_id_and_no_path_is_said_to_serve_the_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: a ``[[models]]`` table whose path was forgotten served the default
    model under the id it gave, without a word; ``path = "default"`` says it is meant."""
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nid = "qwen"\n[[models]]\nid = "smol"\npath = "default"\n')
    with caplog.at_level("WARNING", logger="kvwarm.settings.types"):
        settings = load_settings({"config": str(config)}, ENV)
    assert [(s.id, s.path) for s in settings.models] == [("qwen", None), ("smol", None)]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "models[1] (id 'qwen') names no path" in warned[0]
