"""A request's own LoRA set (``GenerationOptions.lora``, llama-server's per-request ``lora``),
on the stub backend, whose logits are salted by the adapters attached when a pass runs: a
pass run under another request's set would change the text.

What holds: a set is its own cache namespace (rows and live KV never cross, scale 0 is the
base model's); requests of different sets run side by side but never in one forward pass,
each giving exactly what it gives alone; a set naming an adapter the model lacks is refused
before it is queued, and one detached while its request waited fails that request alone;
adapters configured with the model (``ModelConfig.lora``) load with it, off.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvwarm.backends.stub import StubBackend
from kvwarm.engine.api import Engine, LoraSpec, Model
from kvwarm.engine.types import GenerationOptions
from kvwarm.errors import AdapterError, InvalidRequestError

from .conftest import GatedBackend, stub_config

PROMPT = "The quick brown fox jumps over the lazy dog again"
GREEDY = GenerationOptions(max_tokens=6, temperature=0.0)


@pytest.fixture
def adapter_files(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"adapter a")
    b.write_bytes(b"adapter b")
    return a, b


def _with(handle: int, scale: float = 1.0) -> GenerationOptions:
    return GenerationOptions(max_tokens=6, temperature=0.0, lora=((handle, scale),))


def test_a_requests_set_is_its_own_namespace(
    engine: Engine, adapter_files: tuple[Path, Path]
) -> None:
    model = engine.load_model(config=stub_config())
    info = model.load_adapter(adapter_files[0], scale=0.0, name="a")
    assert model.list_adapters()[0].name == "a"
    base = model.complete(PROMPT, GREEDY)
    assert base.stats.cache_hit == "cold"
    lora = model.complete(PROMPT, _with(info.handle))
    # Neither the base row nor the slot's live KV of the base prompt serves it.
    assert lora.stats.cached_tokens == 0 and lora.stats.cache_hit == "cold"
    assert lora.text != base.text
    again = model.complete(PROMPT, _with(info.handle))
    assert again.stats.cache_hit == "exact" and again.text == lora.text
    back = model.complete(PROMPT, GREEDY)
    assert back.stats.cache_hit == "exact" and back.text == base.text
    # Scale 0 is no adapter: the base model's namespace, rows and text.
    off = model.complete(PROMPT, _with(info.handle, 0.0))
    assert off.stats.cache_hit == "exact" and off.text == base.text
    # Another scale is another set.
    half = model.complete(PROMPT, _with(info.handle, 0.5))
    assert half.stats.cached_tokens == 0 and half.text not in (base.text, lora.text)


def test_an_empty_set_turns_the_models_own_adapters_off(
    engine: Engine, adapter_files: tuple[Path, Path]
) -> None:
    model = engine.load_model(config=stub_config())
    base = model.complete(PROMPT, GREEDY)
    info = model.load_adapter(adapter_files[0], scale=1.0)
    on = model.complete(PROMPT, GREEDY)  # the model's set: the adapter at 1.0
    assert on.text != base.text
    assert model.complete(PROMPT, _with(info.handle)).text == on.text
    off = model.complete(PROMPT, GenerationOptions(max_tokens=6, temperature=0.0, lora=()))
    assert off.text == base.text and off.stats.cache_hit == "exact"


class _Recording:
    """A stub context that notes, for every forward pass, the sequences in it and the
    adapters attached when it ran."""

    def __init__(self, inner: object, passes: list[tuple[frozenset[int], tuple[str, ...]]]) -> None:
        self._inner = inner
        self._passes = passes

    def decode(self, batch: list[object]) -> None:
        attached = tuple(a.path for a, _ in self._inner._adapters)  # type: ignore[attr-defined]
        self._passes.append((frozenset(t.seq for t in batch), attached))  # type: ignore[attr-defined]
        self._inner.decode(batch)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


@pytest.fixture
def recorded(
    engine: Engine,
) -> Iterator[tuple[GatedBackend, list[tuple[frozenset[int], tuple[str, ...]]]]]:
    backend = GatedBackend()
    passes: list[tuple[frozenset[int], tuple[str, ...]]] = []
    load = backend.load_model

    def load_model(path: str, params: object = None) -> object:
        gated = load(path, params)
        new_context = gated.new_context

        def recording_context(p: object) -> object:
            return _Recording(new_context(p), passes)

        gated.new_context = recording_context  # type: ignore[method-assign]
        return gated

    backend.load_model = load_model  # type: ignore[method-assign]
    yield backend, passes


def test_sets_run_side_by_side_but_never_in_one_pass(
    engine: Engine,
    adapter_files: tuple[Path, Path],
    recorded: tuple[GatedBackend, list[tuple[frozenset[int], tuple[str, ...]]]],
) -> None:
    backend, passes = recorded
    backend.gate.set()
    model = engine.load_model(config=stub_config(n_parallel=3, backend=backend))  # type: ignore[arg-type]
    a = model.load_adapter(adapter_files[0], scale=0.0)
    b = model.load_adapter(adapter_files[1], scale=0.0)
    options = [GREEDY, _with(a.handle), _with(b.handle)]
    alone = [model.complete(PROMPT, o).text for o in options]
    assert len(set(alone)) == 3
    passes.clear()
    backend.gate.clear()
    streams = [model.submit(PROMPT, o) for o in options]
    backend.gate.set()
    together = [s.result() for s in streams]
    assert [c.text for c in together] == alone
    # Each pass ran under one set, and every sequence always under the same one.
    sets_of: dict[int, set[tuple[str, ...]]] = {}
    for seqs, attached in passes:
        for seq in seqs:
            sets_of.setdefault(seq, set()).add(attached)
    assert len(sets_of) == 3 and all(len(s) == 1 for s in sets_of.values())
    assert len({next(iter(s)) for s in sets_of.values()}) == 3


def test_a_set_naming_an_unknown_adapter_is_refused_before_it_is_queued(
    engine: Engine, adapter_files: tuple[Path, Path]
) -> None:
    model = engine.load_model(config=stub_config())
    with pytest.raises(AdapterError, match="no LoRA adapter 7"):
        model.complete(PROMPT, _with(7))
    info = model.load_adapter(adapter_files[0], scale=0.0)
    for bad in (
        ((info.handle, float("nan")),),
        ((info.handle, 1.0), (info.handle, 0.5)),
        ((-1, 1.0),),
        ((info.handle, "x"),),
        ((True, 1.0),),
        ((info.handle, 1e30),),
    ):
        with pytest.raises(InvalidRequestError):
            model.complete(PROMPT, GenerationOptions(lora=bad))  # type: ignore[arg-type]
    assert model.status().queued == 0


def test_an_adapter_detached_while_its_request_waited_fails_that_request_alone(
    adapter_files: tuple[Path, Path],
) -> None:
    from .conftest import make_engine

    backend = GatedBackend()
    eng = make_engine()
    try:
        model = eng.load_model(config=stub_config(backend=backend))  # type: ignore[arg-type]
        info = model.load_adapter(adapter_files[0], scale=0.0)  # a job: runs with no pass
        first = model.submit(PROMPT, GREEDY)  # seated; its first pass waits at the gate
        waiting = model.submit(PROMPT, _with(info.handle))  # queued: the one slot is taken
        gone = threading.Event()
        detacher = threading.Thread(target=lambda: (model.detach_adapter(info.handle), gone.set()))
        detacher.start()
        _wait_until(lambda: info.handle not in [a.handle for a in model.list_adapters()])
        backend.gate.set()
        assert first.result().text
        with pytest.raises(AdapterError, match="detached"):
            waiting.result()
        detacher.join(timeout=60)
        assert gone.is_set()
        assert model.complete(PROMPT, GREEDY).text == first.result().text
    finally:
        eng.close()


def _wait_until(condition: object) -> None:
    """Wait for ``condition()`` (a state another thread reaches), bounded."""
    done = threading.Event()
    for _ in range(6000):
        if condition():  # type: ignore[operator]
            return
        done.wait(0.01)
    raise AssertionError("condition never held")


def test_adapters_configured_with_the_model_load_with_it_off(
    engine: Engine, adapter_files: tuple[Path, Path]
) -> None:
    plain = engine.load_model(model_id="plain", config=stub_config())
    base_fp = plain.info().fingerprint
    cfg = stub_config()

    model = engine.load_model(
        model_id="with-lora",
        config=replace(
            cfg, lora=(LoraSpec(str(adapter_files[0]), "a"), LoraSpec(str(adapter_files[1]), "b"))
        ),
    )
    listed = model.list_adapters()
    assert [(a.handle, a.name, a.scale) for a in listed] == [(1, "a", 0.0), (2, "b", 0.0)]
    assert model.info().fingerprint == base_fp  # off: the base model's namespace
    assert model.info().adapters == tuple(listed)


def test_a_configured_adapter_that_fails_fails_the_load_and_frees_it(
    engine: Engine, tmp_path: Path
) -> None:

    stub = StubBackend()
    cfg = replace(stub_config(backend=stub), lora=(LoraSpec(str(tmp_path / "missing.gguf")),))
    with pytest.raises(AdapterError, match="not found"):
        engine.load_model(model_id="m", config=cfg)
    assert engine.list_models() == []
    model: Model = engine.load_model(model_id="m", config=stub_config())  # the id is free again
    assert model.complete(PROMPT, GREEDY).text


def test_a_scale_past_the_bound_is_refused_before_the_context_sees_it(
    engine: Engine, adapter_files: tuple[Path, Path]
) -> None:
    """Found by review: 1e39 is finite, so it passed the scale check, reached the context
    (inf as a float32) and only then failed the namespace with a ValueError: the model ran
    under a scale that neither its listing nor its cache namespace had."""
    model = engine.load_model(config=stub_config())
    info = model.load_adapter(adapter_files[0], scale=1.0, name="a")
    before = model.complete(PROMPT, GREEDY).text
    with pytest.raises(InvalidRequestError, match="float32"):
        model.set_adapter_scale(info.handle, 1e39)
    with pytest.raises(InvalidRequestError, match="float32"):
        model.load_adapter(adapter_files[1], scale=-1e39, name="b")
    assert [(a.handle, a.scale) for a in model.list_adapters()] == [(info.handle, 1.0)]
    after = model.complete(PROMPT, GenerationOptions(max_tokens=6, temperature=0.0, seed=1))
    assert after.text == before


def test_an_embedding_may_name_its_own_set(
    engine: Engine, adapter_files: tuple[Path, Path]
) -> None:
    """``Model.embed(lora=...)``: the set to embed under, as a request's own (the server
    passes its global scales); None: the model's own set. An unknown handle or a bad scale is
    refused before anything runs."""
    model = engine.load_model(config=stub_config())
    info = model.load_adapter(adapter_files[0], scale=0.0, name="a")
    base = model.embed(["hello"])
    named = model.embed(["hello"], lora=((info.handle, 1.0),))
    assert named != base
    assert model.embed(["hello"], lora=()) == base
    model.set_adapter_scale(info.handle, 1.0)
    assert model.embed(["hello"]) == named  # the model's own set, now on
    assert model.embed(["hello"], lora=()) == base
    with pytest.raises(AdapterError):
        model.embed(["hello"], lora=((info.handle + 5, 1.0),))
    with pytest.raises(InvalidRequestError):
        model.embed(["hello"], lora=((info.handle, float("nan")),))


def test_a_models_adapters_are_in_its_memory_until_detached(
    engine: Engine, adapter_files: tuple[Path, Path]
) -> None:
    """Found by review (lorabudget): an adapter's weights were in no term of what a model
    holds, so the server's memory budget never counted them. Each adapter reports its bytes
    (the stub's: its file's), the model their sum whatever their scales, and a detach
    releases its part."""
    model = engine.load_model(config=stub_config())
    assert model.info().adapter_bytes == 0
    a = model.load_adapter(adapter_files[0], scale=0.0)
    b = model.load_adapter(adapter_files[1], scale=1.0)
    sizes = [p.stat().st_size for p in adapter_files]
    assert [a.size_bytes, b.size_bytes] == sizes
    assert [i.size_bytes for i in model.list_adapters()] == sizes
    assert model.info().adapter_bytes == sum(sizes)
    model.detach_adapter(b.handle)
    assert model.info().adapter_bytes == sizes[0]


@pytest.mark.parametrize(
    ("deterministic", "n_adapters", "shared"),
    [(True, 3, False), (True, 2, True), (False, 3, True), (True, 1, True)],
)
def test_a_deterministic_set_whose_sum_llama_orders_by_address_keeps_its_rows_in_its_load(
    engine: Engine, tmp_path: Path, deterministic: bool, n_adapters: int, shared: bool
) -> None:
    """llama.cpp adds three or more adapters in an order set by their addresses (libstdc++;
    docs/internals.md, "Three or more LoRA adapters"), so another load's row under such a set
    may not be the bits a cold run here computes: in deterministic mode such a set's namespace
    is this load's alone. Two loads of one file stand for a restart or a replica."""
    import sys

    if sys.platform != "linux" and n_adapters == 2:
        shared = False  # other standard libraries hash a pointer's bits: two already vary
    files = []
    for i in range(n_adapters):
        path = tmp_path / f"{i}.gguf"
        path.write_bytes(f"adapter {i}".encode())
        files.append(path)
    loads = []
    for name in ("first", "second"):
        model = engine.load_model(model_id=name, config=stub_config(deterministic=deterministic))
        handles = [model.load_adapter(f, scale=0.0).handle for f in files]
        loads.append((model, tuple((h, 1.0) for h in handles)))
    (first, lora_1), (second, lora_2) = loads
    opts = GenerationOptions(max_tokens=4, temperature=0.0)
    one = first.complete(PROMPT, replace(opts, lora=lora_1))
    assert one.stats.cache_hit == "cold"
    again = first.complete(PROMPT, replace(opts, lora=lora_1))
    assert again.stats.cache_hit == "exact"  # within its load the set's rows serve it
    other = second.complete(PROMPT, replace(opts, lora=lora_2))
    assert (other.stats.cached_tokens > 0) is shared
    assert other.text == one.text
