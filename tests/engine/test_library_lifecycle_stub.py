"""The library as a program meets it: streams left half-read, engines never closed, models used
after they are closed (stub backend; found by the library review)."""

from __future__ import annotations

import asyncio
import gc
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
from tests.engine.conftest import GatedBackend, make_engine, stub_config

from kvwarm import Engine
from kvwarm.engine import engine as engine_module
from kvwarm.engine.request import Done, Request
from kvwarm.engine.stream import CompletionStream
from kvwarm.engine.types import CompletionStats, GenerationOptions
from kvwarm.errors import (
    ConfigError,
    EngineClosedError,
    InvalidRequestError,
    ModelExistsError,
)

LONG = GenerationOptions(max_tokens=200, temperature=0.0, stop=(), ignore_eos=True)


def _final(req: Request) -> CompletionStats:
    """The stats ``req`` was answered with, read from its channel (its stream is gone)."""
    while not req.answered:
        req.channel.get(timeout=60)
    assert isinstance(req.outcome, Done), req.outcome
    return req.outcome.completion.stats


def test_a_stream_left_with_break_is_cancelled() -> None:
    """``for piece in model.stream(...): break`` frees the slot: the request ends "cancelled"
    after a few tokens, not at its max_tokens (it ran to 200 before)."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        stream = model.stream("Tell me a long story", LONG)
        req = stream.request
        backend.gate.step(3)  # the prefill and two tokens; the worker waits before the next
        for piece in stream:
            assert piece
            break
        del stream
        gc.collect()
        backend.gate.set()
        stats = _final(req)
        assert stats.finish_reason == "cancelled"
        assert stats.completion_tokens < 10
    finally:
        eng.close()


def test_a_stream_dropped_unread_is_cancelled_before_it_is_seated() -> None:
    """A queued request whose stream is dropped is never seated: the next one gets the slot."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        first = model.stream("the first one", LONG)
        dropped = model.stream("the dropped one", LONG)
        req = dropped.request
        del dropped
        gc.collect()
        first.cancel()
        backend.gate.set()
        first.result()
        stats = _final(req)
        assert (stats.finish_reason, stats.completion_tokens) == ("cancelled", 0)
    finally:
        eng.close()


def test_an_async_stream_left_with_break_is_cancelled() -> None:
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        stream = model.stream("Tell me a long story", LONG)
        req = stream.request
        backend.gate.step(3)

        async def read_one(one: CompletionStream) -> None:
            async for piece in one:
                assert piece
                break

        asyncio.run(read_one(stream))  # the loop's shutdown closes the abandoned generator
        del stream
        gc.collect()
        backend.gate.set()
        assert _final(req).finish_reason == "cancelled"
    finally:
        eng.close()


def test_a_kept_stream_is_never_cancelled_and_forks_keep_their_group() -> None:
    """Only a stream nobody holds is abandoned: ``n > 1`` choices whose first stream was
    dropped still run (cancelling the first of a queued group cancels the whole group), and
    are cancelled once every choice's stream is gone."""
    eng = make_engine()
    try:
        backend = GatedBackend()
        model = eng.load_model(config=stub_config(n_parallel=2, backend=backend))  # type: ignore[arg-type]
        short = GenerationOptions(max_tokens=5, temperature=0.0, stop=(), ignore_eos=True)
        first, second = model.streams("two choices", short, n=2)
        head = first.request
        del first
        gc.collect()
        backend.gate.set()
        assert second.result().stats.finish_reason == "length"
        assert _final(head).finish_reason == "length"

        backend.gate.clear()
        first, second = model.streams("two more", LONG, n=2)
        reqs = [first.request, second.request]
        del first, second
        gc.collect()
        backend.gate.set()
        assert [_final(r).finish_reason for r in reqs] == ["cancelled", "cancelled"]
    finally:
        eng.close()


_UNCLOSED = """
import sys
from pathlib import Path
from tests.engine.conftest import LOW_GATES, stub_config
from kvwarm import CacheConfig, Engine, EngineConfig, TierConfig
disk = TierConfig("disk", 1 << 30, Path(sys.argv[1]))
engine = Engine(EngineConfig(cache=CacheConfig(tiers=(disk,)), policy=LOW_GATES))
model = engine.load_model(config=stub_config())
out = model.complete(sys.argv[2], max_tokens=4, temperature=0.0)
print(out.stats.cache_hit, out.stats.cached_tokens)
"""


def test_an_engine_never_closed_is_closed_at_exit(tmp_path: Path) -> None:
    """A program that ends without ``engine.close()`` keeps what it computed: its saves still
    queued and its slots' live KV reach the disk tier, and the next run restores from them
    (nothing was on disk before: the next run prefilled cold)."""
    prompt = "a prompt long enough to be worth a row on disk, " * 4
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _UNCLOSED, str(tmp_path / "disk"), prompt],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert done.returncode == 0, done.stderr
        hit, cached = done.stdout.split()
        runs.append((hit, int(cached)))
    assert runs[0] == ("cold", 0)
    assert runs[1][0] != "cold" and runs[1][1] > 0, runs


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_ctx": "4096"}, "n_ctx must be an integer, got '4096'"),  # TypeError: '<'
        ({"n_batch": "64"}, "n_batch must be an integer, got '64'"),  # ValueError: int()
        ({"deterministic": "no"}, "deterministic must be True or False, got 'no'"),  # loaded!
        ({"n_parallel": 2.0}, "n_parallel must be an integer, got 2.0"),
        ({"use_mmap": 1}, "use_mmap must be True or False, got 1"),
        ({"tensor_split": "1,1"}, "tensor_split must be a tuple, got '1,1'"),
        ({"lora": "a.gguf"}, "lora must be a tuple, got 'a.gguf'"),
    ],
)
def test_a_load_option_of_the_wrong_type_is_a_config_error(
    options: dict[str, object], message: str
) -> None:
    eng = make_engine()
    try:
        with pytest.raises(ConfigError, match=re.escape(message)):
            eng.load_model(backend="stub", **options)  # type: ignore[arg-type]
        assert eng.list_models() == []
    finally:
        eng.close()


def test_list_options_are_taken_as_llama_cpp_takes_them() -> None:
    eng = make_engine()
    try:
        model = eng.load_model(backend="stub", tensor_split=[3, 1])  # type: ignore[arg-type]
        assert model.config.model_params.tensor_split == (3, 1)
    finally:
        eng.close()


def test_the_library_entry_points_refuse_what_they_do_not_take() -> None:
    """Each was an AttributeError or a TypeError from deep inside, or worse, accepted."""
    with pytest.raises(ConfigError, match="config must be an EngineConfig"):
        Engine("engine.toml")  # type: ignore[arg-type]
    eng = make_engine()
    try:
        with pytest.raises(ConfigError, match="model_id must be a string"):
            eng.load_model(backend="stub", model_id=5)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="path must be a file path"):
            eng.load_model(5, backend="stub")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="config must be a ModelConfig"):
            eng.load_model(backend="stub", config={"n_ctx": 512})  # type: ignore[arg-type]
        model = eng.load_model(config=stub_config())
        with pytest.raises(InvalidRequestError, match="options must be a GenerationOptions"):
            model.complete("hi", "max_tokens=4")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="stop must be a string or a list"):
            model.complete("hi", stop=5)  # type: ignore[typeddict-item]
        with pytest.raises(InvalidRequestError, match="messages must be a list of messages"):
            model.chat("hello")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="message 0 must be a mapping with a"):
            model.chat([{"content": "who am I?"}])
        with pytest.raises(InvalidRequestError, match=r"ttl_class must be a kvwarm\.TtlClass"):
            model.prewarm("a prompt", ttl_class="long")  # type: ignore[arg-type]
        assert model.status().requests == 0  # nothing reached the worker
    finally:
        eng.close()


def test_every_operation_of_a_closed_model_is_engine_closed(tmp_path: Path) -> None:
    """``unload()`` twice is a no-op, and every call after it is ``EngineClosedError``, as
    ``complete`` is: ``apply_chat_template`` raised ``HandleClosedError`` (the backend's), and
    the adapter calls reached the backend or the stopped worker."""
    eng = make_engine()
    model = eng.load_model(config=stub_config())
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(b"GGUF")
    model.unload()
    model.unload()
    eng.close()
    eng.close()
    hi = [{"role": "user", "content": "hi"}]
    calls = {
        "complete": lambda: model.complete("hi"),
        "apply_chat_template": lambda: model.apply_chat_template(hi),
        "load_adapter": lambda: model.load_adapter(adapter),
        "set_adapter_scale": lambda: model.set_adapter_scale(1, 0.5),
        "detach_adapter": lambda: model.detach_adapter(1),
        "evict": model.evict,
    }
    for name, call in calls.items():
        with pytest.raises(EngineClosedError, match="model 'stub' is closed"):
            call()
        assert name
    with pytest.raises(EngineClosedError):
        eng.load_model(config=stub_config())


def test_an_engine_dropped_unclosed_stops_its_workers_and_frees_its_models(
    tmp_path: Path,
) -> None:
    """An engine and its models that nobody holds any more are closed as ``close()`` would:
    the worker's thread held the model (hence the engine) through bound methods, so each such
    engine kept its thread and its native model for the process's life (~120 MiB an engine of
    SmolLM2, measured). The shutdown save of the slot's live KV still reaches the disk."""
    eng = make_engine(tmp_path)
    model = eng.load_model(config=stub_config(), save_tier="disk")
    model.complete("a prompt long enough to be saved", max_tokens=4, temperature=0.0)
    thread, life = model._worker._thread, model._bmodel._life  # type: ignore[attr-defined]
    dropped = weakref.ref(eng)
    assert thread is not None and thread.is_alive()
    del eng, model
    gc.collect()
    assert dropped() is None
    for closing in list(engine_module._DROPPING):
        closing.join(60)
    thread.join(60)
    assert not thread.is_alive()
    assert life.freed
    again = make_engine(tmp_path)
    try:
        model = again.load_model(config=stub_config(), save_tier="disk")
        out = model.complete("a prompt long enough to be saved", max_tokens=4, temperature=0.0)
        assert out.stats.cached_tokens > 0
    finally:
        again.close()


def test_a_stream_keeps_its_model_and_engine_while_it_is_read() -> None:
    """``make_engine().load_model(...).stream(...)``: the engine and the model are held by the
    stream alone, and a collection meanwhile must not close them under it."""
    backend = GatedBackend()
    stream = make_engine().load_model(config=stub_config(backend=backend)).stream("hi", LONG)  # type: ignore[arg-type]
    gc.collect()
    backend.gate.set()
    assert stream.result().stats.finish_reason == "length"


def test_loading_a_model_id_twice_says_what_to_do() -> None:
    """A second ``kvwarm.load_model()`` of the same file said only that the id was taken."""
    eng = make_engine()
    try:
        eng.load_model(config=stub_config())
        with pytest.raises(ModelExistsError, match="give this one another model_id="):
            eng.load_model(config=stub_config())
    finally:
        eng.close()


def test_a_model_is_a_context_manager() -> None:
    with make_engine() as eng:
        with eng.load_model(config=stub_config()) as model:
            assert model.complete("hi", max_tokens=2).stats.completion_tokens == 2
        assert eng.list_models() == []
        with pytest.raises(EngineClosedError):
            model.complete("hi")
