"""The library's calls given what they do not take (stub backend; found by the library and CLI
review). Each was a ``TypeError`` from inside, a switch taken for its truth without a word, or
a half-unloaded model."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.engine.conftest import make_engine, stub_config

from kvwarm.cache.types import CacheConfig
from kvwarm.engine.api import Engine, EngineConfig
from kvwarm.engine.model import Model
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import (
    ConfigError,
    EngineClosedError,
    InvalidRequestError,
    UnknownModelError,
)

SHORT = GenerationOptions(max_tokens=3, temperature=0.0, ignore_eos=True)
HI = [{"role": "user", "content": "hi"}]


def _calls(model: Model) -> dict[str, Callable[[], object]]:
    return {
        "tokenize add_special": lambda: model.tokenize("hi", add_special="no"),  # type: ignore[arg-type]
        "tokenize parse_special": lambda: model.tokenize("hi", parse_special=None),  # type: ignore[arg-type]
        "apply_chat_template": lambda: model.apply_chat_template(
            HI,
            add_generation_prompt="no",  # type: ignore[arg-type]
        ),
        "chat_tokens": lambda: model.chat_tokens(HI, add_generation_prompt=None),  # type: ignore[arg-type]
        "streams fragments": lambda: model.streams("hi", SHORT, n=1, fragments="no"),  # type: ignore[arg-type]
        "embed normalize": lambda: model.embed("hi", normalize="no"),  # type: ignore[arg-type]
        "complete ignore_eos": lambda: model.complete("hi", max_tokens=2, ignore_eos="false"),  # type: ignore[typeddict-item]
        "prewarm add_special": lambda: model.prewarm("a prompt to prewarm", add_special="no"),  # type: ignore[arg-type]
        "prewarm None": lambda: model.prewarm(None),  # type: ignore[arg-type]
        "prewarm int": lambda: model.prewarm(5),  # type: ignore[arg-type]
        "complete parent_key": lambda: model.complete("hi", max_tokens=2, parent_key=5),  # type: ignore[typeddict-item]
        "load_adapter None": lambda: model.load_adapter(None),  # type: ignore[arg-type]
        "load_adapter name": lambda: model.load_adapter(Path(__file__), name=5),  # type: ignore[arg-type]
    }


def test_ill_typed_arguments_are_invalid_requests_and_reach_nothing() -> None:
    """Each was a ``TypeError`` (``prewarm(None)``, ``parent_key=5``, ``load_adapter(None)``)
    or taken for its truth: ``normalize="no"`` normalized, ``add_special="no"`` added BOS,
    ``ignore_eos="false"`` generated to ``max_tokens``."""
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config())
        for call_name, call in _calls(model).items():
            try:
                call()
            except InvalidRequestError as exc:
                assert "must be" in str(exc) or " not " in str(exc), (call_name, exc)
            else:
                raise AssertionError(f"{call_name}: accepted")
        assert model.status().requests == 0  # nothing reached the worker
        assert model.list_adapters() == []
        assert model.complete("hi", SHORT).stats.finish_reason == "length"  # still serves
    finally:
        eng.close()


@pytest.mark.parametrize("bad", ["30", math.nan, -1.0, math.inf, True])
def test_a_bad_unload_or_close_bound_changes_nothing(bad: object) -> None:
    """``unload(timeout_s="30")`` raised ``TypeError`` from the worker's stop, with the model
    already forgotten and its native state never freed; NaN or a negative bound was taken for
    no wait at all. Refused before anything changes: the model serves on, and a proper unload
    frees it."""
    eng = make_engine()
    model = eng.load_model(config=stub_config())
    with pytest.raises(InvalidRequestError, match="timeout_s must be a finite number"):
        model.unload(timeout_s=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="timeout_s must be a finite number"):
        eng.close(timeout_s=bad)  # type: ignore[arg-type]
    assert [info.id for info in eng.list_models()] == ["stub"]
    assert model.complete("hi", SHORT).stats.finish_reason == "length"
    life = model._bmodel._life  # type: ignore[attr-defined]
    eng.close(timeout_s=30)
    assert eng.list_models() == []
    thread = model._worker._thread
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive() and life.freed


def test_the_engine_refuses_what_its_lookups_and_loads_do_not_take() -> None:
    eng = make_engine()
    try:
        with pytest.raises(UnknownModelError, match="an id is a string"):
            eng.get_model(["stub"])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="progress must be a function"):
            eng.load_model(config=stub_config(), progress=5)  # type: ignore[arg-type]
        assert eng.list_models() == []
    finally:
        eng.close()


def test_token_ids_of_any_integer_type_are_taken_and_a_float_is_named() -> None:
    """``complete([np.int64(5)])`` was refused as "token 5 is not a valid id for this
    vocabulary (0..264)", a message that named no fault, while ``detokenize`` took the same
    ids: a tokenizer's arrays hold numpy integers."""
    np = pytest.importorskip("numpy")
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config())
        ids = model.tokenize("a prompt of several tokens")
        as_numpy = [np.int64(t) for t in ids]
        plain = model.complete(ids, SHORT)
        out = model.complete(as_numpy, SHORT)
        assert out.prompt_tokens == plain.prompt_tokens == tuple(ids)
        assert all(type(t) is int for t in out.prompt_tokens)
        assert out.text == plain.text
        assert model.embed([as_numpy]) == model.embed([ids])
        with pytest.raises(InvalidRequestError, match=r"token 5\.0 is not a token id: a float"):
            model.complete([1, 5.0], SHORT)
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: EngineConfig(cache="ram"), "EngineConfig.cache must be a CacheConfig, not str"),
        (lambda: EngineConfig(policy={"min_tokens": 4}), "policy must be a PolicyConfig, not dict"),
        (lambda: EngineConfig(backend=5), "backend must be a string or Backend, got 5"),
        (lambda: EngineConfig(backend="llama"), "unknown backend 'llama'"),
        (lambda: EngineConfig(cache=CacheConfig(tiers=("ram",))), "a TierConfig, not str"),
        (lambda: EngineConfig(cache=CacheConfig(tiers="ram")), "a tuple of TierConfig, not str"),
        (lambda: EngineConfig(cache=CacheConfig(ttl_seconds=60)), "ttl_seconds needs three"),
    ],
)
def test_an_engine_config_of_the_wrong_shape_is_a_config_error_at_construction(
    build: Callable[[], EngineConfig], message: str
) -> None:
    """Found by the library and CLI review: ``Engine(EngineConfig(cache="ram"))`` and a
    policy given as a dict were ``AttributeError`` from inside; a tier named by its string
    alone, or ``ttl_seconds=60``, an ``AttributeError`` or ``TypeError`` from the cache's
    checks; and ``backend=5`` or a misspelled backend was taken, each later load failing
    (``backend=5`` with an ``AttributeError``)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        Engine(build())


def test_an_engine_given_a_cache_that_is_not_one_is_a_config_error() -> None:
    """``Engine(cache=...)`` took anything, and the first load failed with an
    ``AttributeError`` ('int' object has no attribute 'tier_names')."""
    with pytest.raises(ConfigError, match="cache must be a Cache, not CacheConfig"):
        Engine(cache=CacheConfig())  # type: ignore[arg-type]


def test_a_closed_engine_s_lookups_are_engine_closed() -> None:
    """docs/python.md: a closed engine raises ``EngineClosedError``. ``get_model`` and
    ``unload_model`` of a model it had loaded said ``no loaded model with id 'stub'``
    (``UnknownModelError``, a 404 model_not_found to a server), as of a typo."""
    eng = make_engine()
    eng.load_model(config=stub_config())
    eng.close()
    with pytest.raises(EngineClosedError, match="engine is closed"):
        eng.get_model("stub")
    with pytest.raises(EngineClosedError, match="engine is closed"):
        eng.unload_model("stub")
    assert eng.list_models() == []  # an inspection: what is loaded, nothing
