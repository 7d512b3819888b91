"""A seeded concurrency stress of the engine on the stub (review "concur"): client threads
submit a random mix of requests (streamed or not, ``n`` of 1 to 3, stop strings, grammars and
JSON schemas, LoRA sets, speculation on or off: n-grams, or a draft model priced by its own
timed passes, ``DraftCost``; some episodes priced as a CPU whose matrix kernel takes rows 4
at a time, so verify passes take filler rows: ``Cost.pad``) while a chaos thread cancels
some, evicts slots and cache rows, runs the cache's gc, detaches and re-attaches an adapter
and unloads and reloads the model; some requests cancel themselves inside their restore or
between prefill chunks. After each episode:

- every request ended (each wait bounded: a hang fails, never blocks the suite);
- each reply is the reply the same request gets alone on a fresh engine (a cancelled one: a
  prefix of it), or ends in one of the typed errors its chaos explains;
- every slot is idle, the model's gauges (active, queued, and once evicted, KV cells) are 0,
  no row is checked out and no save is in flight;
- ``cache verify`` finds nothing bad;
- once the engine is closed, no thread it started is left and no file descriptor leaked.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from tests.engine.conftest import LOW_GATES, make_engine, stub_config
from tests.engine.test_load_stress_stub import WORDS

from kvwarm.backends.base import ContextParams, ModelParams
from kvwarm.backends.stub import StubBackend, StubModel
from kvwarm.cache.types import CacheConfig, TierConfig
from kvwarm.engine.api import Engine, EngineConfig, Model, ModelConfig
from kvwarm.engine.request import Request
from kvwarm.engine.types import GenerationOptions
from kvwarm.engine.worker.admission import Admission, Planned, Restored
from kvwarm.engine.worker.drafts import Cost, PassCost
from kvwarm.engine.worker.slots import Slot
from kvwarm.engine.worker.tick import Tick
from kvwarm.errors import (
    AdapterError,
    EngineClosedError,
    InvalidRequestError,
    KvwarmError,
    ModelNotFoundError,
    QueueFullError,
    RequestCancelledError,
    UnknownModelError,
)

WAIT_S = 60.0  # every wait's bound: past it the episode hung
#: The RAM tier before the disk, by seed: a few rows, or about one (saves spill for room).
RAM_BYTES = (1 << 14, 1 << 12, 1 << 13)
#: A request whose prompt starts with one of these cancels itself at that point (hooks below).
CANCEL_IN_RESTORE = "RESTORE-CANCEL"
CANCEL_IN_PREFILL = "PREFILL-CANCEL"
YES_NO = 'root ::= "yes" | "no" | "maybe so"'
SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
}


@dataclass(frozen=True)
class Spec:
    prompt: str
    opts: GenerationOptions
    n: int
    stream: bool
    adapters: tuple[tuple[int, float], ...] | None  # indexes into the loaded adapters
    cancel_after: int | None  # fragments read before the client cancels (streamed only)


@dataclass
class Outcome:
    spec: Spec
    texts: list[tuple[int, ...]] | None = None
    reasons: list[str] | None = None
    error: BaseException | None = None


class Loaded:
    """The model the clients use now, and its adapters' handles (a reload changes both)."""

    def __init__(self, engine: Engine, config: ModelConfig, files: list[Path]) -> None:
        self.engine, self.config, self.files = engine, config, files
        self.lock = threading.Lock()
        self.model, self.handles = self._load()

    def _load(self) -> tuple[Model, list[int]]:
        model = self.engine.load_model(config=self.config)
        handles = [model.load_adapter(f, scale=0.0).handle for f in self.files]
        return model, handles

    def current(self) -> tuple[Model, list[int]]:
        with self.lock:
            return self.model, list(self.handles)

    def reload(self) -> None:
        with self.lock:
            self.model.unload()
            self.model, self.handles = self._load()

    def reattach(self, index: int) -> None:
        with self.lock:
            model = self.model
            model.detach_adapter(self.handles[index])
            self.handles[index] = model.load_adapter(self.files[index], scale=0.0).handle


def random_spec(
    rng: random.Random,
    n_adapters: int,
    max_tokens: int = 24,
    spec_types: tuple[str | None, ...] = (),
    draft_caps: bool = False,
) -> Spec:
    """``spec_types``: the speculation a request picks from (None: the model's); none given,
    half decode plainly and half as the model speculates. ``draft_caps``: half the requests
    cap their drafts at 1 to 7 tokens (``spec_draft_max``), so drafts end between tiles."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(2, 24))]
    marker = rng.random()
    if marker < 0.08:
        words.insert(0, CANCEL_IN_RESTORE)
    elif marker < 0.16:
        words.insert(0, CANCEL_IN_PREFILL)
    prompt = " ".join(words)
    kind = rng.random()
    opts = GenerationOptions(max_tokens=rng.randint(1, max_tokens), temperature=0.0)
    if kind < 0.15:
        opts = replace(opts, grammar=YES_NO)
    elif kind < 0.25:
        opts = replace(opts, json_schema=SCHEMA)
    elif kind < 0.45:
        opts = replace(opts, stop=(rng.choice("aeiou"), rng.choice(WORDS)[:3]))
    if spec_types:
        opts = replace(opts, spec_type=rng.choice(spec_types))
    elif rng.random() < 0.5:
        opts = replace(opts, spec_type="none")
    if draft_caps and rng.random() < 0.5:
        opts = replace(opts, spec_draft_max=rng.randint(1, 7))
    adapters: tuple[tuple[int, float], ...] | None = None
    pick = rng.random() if n_adapters else 1.0
    if pick < 0.2:
        adapters = ((0, 1.0),)
    elif pick < 0.3:
        adapters = ((0, 0.5), (1, 1.0))
    elif pick < 0.35:
        adapters = ()
    stream = rng.random() < 0.6
    cancel_after = rng.randint(0, 6) if stream and rng.random() < 0.2 else None
    return Spec(prompt, opts, rng.choice((1, 1, 1, 2, 3)), stream, adapters, cancel_after)


def options(spec: Spec, handles: list[int]) -> GenerationOptions:
    if spec.adapters is None:
        return spec.opts
    return replace(spec.opts, lora=tuple((handles[i], s) for i, s in spec.adapters))


def run_alone(model: Model, handles: list[int], spec: Spec) -> list[tuple[int, ...]]:
    """The reply the request gets alone (no speculation, no chaos): its greedy choices."""
    plain = replace(options(spec, handles), spec_type="none")
    got = [s.result() for s in model.streams(spec.prompt, plain, n=spec.n, fragments=False)]
    assert all(c.stats.finish_reason != "cancelled" for c in got)
    return [c.completion_tokens for c in got]


def drive(loaded: Loaded, spec: Spec) -> Outcome:
    """One client request: submit, read (cancelling where the spec says), collect."""
    out = Outcome(spec)
    try:
        model, handles = loaded.current()
        streams = model.streams(
            spec.prompt, options(spec, handles), n=spec.n, fragments=spec.stream
        )
        if spec.cancel_after is not None:
            for i, _ in enumerate(streams[0]):
                if i >= spec.cancel_after:
                    break
            for s in streams:
                s.cancel()
        got = [s.result() for s in streams]
        out.texts = [c.completion_tokens for c in got]
        out.reasons = [c.stats.finish_reason for c in got]
    except KvwarmError as exc:
        out.error = exc
    return out


#: Errors the chaos explains: a model unloaded (or reloading) under the request, an adapter
#: detached under it (or its handle gone by the time it was submitted), a full queue.
EXPLAINED = (
    AdapterError,
    EngineClosedError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    RequestCancelledError,
    UnknownModelError,
)


#: Set while the stressed engine runs: the reference runs are never cancelled.
ARMED = threading.Event()


@pytest.fixture
def cancel_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Requests marked in their prompt cancel themselves inside their restore (from disk or
    RAM) or after their first prefill chunk, on the worker thread, exactly there."""
    restore = Admission.restore

    def restoring(admission: Admission, planned: Planned, req: Request) -> Restored:
        if ARMED.is_set() and req.prompt_text.startswith(CANCEL_IN_RESTORE):
            req.cancelled.set()
        return restore(admission, planned, req)

    after_chunk = Tick._after_chunk

    def chunked(tick: Tick, slot: Slot, row: int, chunk: Any) -> None:
        act = slot.active
        if ARMED.is_set() and act is not None and act.req.prompt_text.startswith(CANCEL_IN_PREFILL):
            act.req.cancelled.set()
        after_chunk(tick, slot, row, chunk)

    monkeypatch.setattr(Admission, "restore", restoring)
    monkeypatch.setattr(Tick, "_after_chunk", chunked)
    # Speculation drafts whatever the timing (one more token costs 5% of a pass).
    monkeypatch.setattr(PassCost, "cost", property(lambda self: Cost(0.0, 0.05)))
    yield
    ARMED.clear()


def chaos(
    rng: random.Random,
    loaded: Loaded,
    stop: threading.Event,
    errors: list[str],
    reloads: int,
) -> None:
    def evict_slots() -> int:  # the model of now: a reload replaces it
        return loaded.current()[0].evict()

    actions: list[Callable[[], object]] = [
        evict_slots,
        lambda: loaded.engine.cache.evict_bytes(rng.randint(1, 1 << 15)),
        loaded.engine.cache.gc,
        lambda: loaded.reattach(rng.randrange(len(loaded.files))),
        loaded.reload,
    ]
    weights = [4, 4, 2, 2 if loaded.files else 0, reloads]
    while not stop.is_set():
        action = rng.choices(actions, weights)[0]
        try:
            action()
        except EXPLAINED:
            pass
        except Exception as exc:  # reported as the episode's failure
            errors.append(f"chaos {action}: {exc!r}")
        stop.wait(0.002)  # pacing only: what the episode asserts never depends on it


def fd_targets() -> dict[str, str]:
    """This process's open file descriptors and what each is (a path, ``socket:[inode]``)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
    return out


def assert_no_fd_leaked(before: dict[str, str]) -> None:
    """No more descriptors open than ``before``, sockets aside; where there are, the message
    names the new ones. An episode opens no socket (its tiers are ram and disk, its backend
    the stub): the one more that full runs saw now and then (187 -> 188, ``socket:[inode]``,
    three times in 2026-11's full runs, never alone) is an earlier test's background thread's
    (a client pool of the S3 or Redis tiers' tests), opened while the episode ran."""
    now = {fd: what for fd, what in fd_targets().items() if not what.startswith("socket:")}
    then = {fd: what for fd, what in before.items() if not what.startswith("socket:")}
    new = sorted(f"{fd}: {what}" for fd, what in now.items() if then.get(fd) != what)
    assert len(now) <= len(then), f"file descriptors leaked: {len(then)} -> {len(now)}: {new}"


def engine_config(backend: StubBackend) -> ModelConfig:
    return replace(
        stub_config(n_parallel=3, backend=backend),
        spec_type="ngram-simple",
        max_queue=64,
    )


class DraftingBackend(StubBackend):
    """The stub, whose models named ``draft`` come from a stub of their own: a sixteenth of
    the weights (``DraftCost``'s prior prices a drafted token at 1/16 of a pass) and no
    simulated latency, while the model's passes take ``decode_delay_s``: the draft model's
    timed passes cost a fraction of the model's, so its drafts pay, measured, as a small
    draft model's do (the stub drafting for itself, a pass as costly as the model's, drafts
    nothing once its passes are timed)."""

    def __init__(self, *, decode_delay_s: float, copy_bias: float) -> None:
        super().__init__(decode_delay_s=decode_delay_s, copy_bias=copy_bias)
        self.drafts = StubBackend(copy_bias=copy_bias, weights_bytes=self.weights_bytes // 16)

    def load_model(self, path: str, params: ModelParams | None = None) -> StubModel:
        if "draft" in Path(path).name:
            return self.drafts.load_model(path, params)
        return super().load_model(path, params)


#: The speculation a request picks where the model drafts with a draft model (None: it).
DRAFT_SPEC_TYPES: tuple[str | None, ...] = (None, None, "draft-simple", "ngram-simple", "none")


def drafting_config() -> ModelConfig:
    """The speculating stub drafting with a draft model (``draftmodel.py``): its prompt's KV
    restored from and saved to the cache under its own namespace, reply tokens it lacks
    batched into its first draft pass, its drafts priced by its own timed passes."""
    backend = DraftingBackend(decode_delay_s=2e-4, copy_bias=8.0)
    return replace(engine_config(backend), spec_type=None, draft_model="copy-draft.gguf")


@pytest.fixture
def adapter_files(tmp_path: Path) -> list[Path]:
    files = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for f in files:
        f.write_bytes(f"adapter {f.stem}".encode())
    return files


def stressed_engine(tmp: Path, *, on_disk_only: bool, ram_bytes: int = 1 << 14) -> Engine:
    """Rows on disk only (every restore reads files), or a small RAM tier before the disk
    (``ram_bytes``: at 4 KiB, a row or two, so saves racing for it, or beside a row a restore
    has checked out, spill to the disk for room); small chunks, so rows share chunks and
    restores join several."""
    disk = TierConfig("disk", 256 << 20, tmp / "disk")
    tiers = (disk,) if on_disk_only else (TierConfig("ram", ram_bytes), disk)
    cache = CacheConfig(tiers=tiers, chunk_tokens=16)
    return Engine(EngineConfig(cache=cache, policy=LOW_GATES))


def episode(
    seed: int,
    tmp: Path,
    files: list[Path],
    n_requests: int = 40,
    *,
    config: ModelConfig | None = None,
    max_tokens: int = 24,
    reloads: int = 1,
    spec_types: tuple[str | None, ...] = (),
    draft_caps: bool = False,
    then: Callable[[Model], None] | None = None,
) -> None:
    """``config``: the model (None: the speculating stub); the reference runs it alone.
    ``spec_types``, ``draft_caps``: as ``random_spec``'s. ``then``: run on the model once the
    chaos is over, before the checks of its state."""
    rng = random.Random(seed)
    config = config or engine_config(StubBackend(copy_bias=8.0))
    specs = [
        random_spec(rng, len(files), max_tokens, spec_types, draft_caps) for _ in range(n_requests)
    ]
    with make_engine() as ref_engine:
        ref = Loaded(ref_engine, config, files)
        model, handles = ref.current()
        expected = [run_alone(model, handles, s) for s in specs]

    threads_before = set(threading.enumerate())
    fds_before = fd_targets()
    eng = stressed_engine(tmp, on_disk_only=seed % 2 == 0, ram_bytes=RAM_BYTES[seed % 3])
    ARMED.set()
    try:
        loaded = Loaded(eng, config, files)
        results: list[Outcome | None] = [None] * n_requests
        stop = threading.Event()
        chaos_errors: list[str] = []
        chaotic = threading.Thread(
            target=chaos, args=(random.Random(seed + 1), loaded, stop, chaos_errors, reloads)
        )
        order = list(range(n_requests))
        rng.shuffle(order)
        lanes = [order[i::4] for i in range(4)]

        def client(lane: list[int]) -> None:
            for i in lane:
                results[i] = drive(loaded, specs[i])

        clients = [threading.Thread(target=client, args=(lane,)) for lane in lanes]
        run_lanes(clients, chaotic, stop, chaos_errors, seed, "chaos")

        for i, (spec, out, want) in enumerate(zip(specs, results, expected, strict=True)):
            assert out is not None
            where = f"seed {seed} request {i} {spec}"
            if out.error is not None:
                assert isinstance(out.error, EXPLAINED), f"{where}: {out.error!r}"
                continue
            assert out.texts is not None and out.reasons is not None
            for text, reason, alone in zip(out.texts, out.reasons, want, strict=True):
                if reason == "cancelled":
                    assert alone[: len(text)] == text, f"{where}: {text} not a prefix of {alone}"
                else:
                    assert text == alone, f"{where}: {text} != alone {alone}"

        ARMED.clear()
        model, handles = loaded.current()
        # The model still answers as it does alone.
        for spec, want in list(zip(specs, expected, strict=True))[:3]:
            assert run_alone(model, handles, spec) == want
        if then is not None:
            then(model)
        status = model.status()
        assert (status.active, status.queued) == (0, 0), status
        worker = model._worker  # its slots read on its own thread, between its rounds
        assert worker.call(lambda: [s.active for s in worker.slots]).result(WAIT_S) == [None] * 3
        model.evict()
        assert eng.cache.flush(WAIT_S)
        assert model.status().kv_cells_used == 0
        index = eng.cache._index
        for info in eng.cache.rows():
            assert index.refcount(info.key) == 0, "a row left checked out"
        assert not index._inflight._marks, "a save or hold left in flight"
        report = eng.cache.verify()
        assert not report.bad, report
    finally:
        eng.close()
    left = [t for t in threading.enumerate() if t not in threads_before]
    for t in left:
        t.join(WAIT_S)
    assert not [t for t in left if t.is_alive()], f"threads left: {left}"
    assert_no_fd_leaked(fds_before)


def stress_seeds(default: int) -> range:
    """The episodes to run: ``KVWARM_STRESS_SEEDS=N`` runs N (a longer hunt), else a few."""
    return range(int(os.environ.get("KVWARM_STRESS_SEEDS", default)))


def run_lanes(
    clients: list[threading.Thread],
    chaos: threading.Thread,
    stop: threading.Event,
    errors: list[Any],
    seed: int,
    chaos_name: str,
) -> None:
    """Run an episode's threads: the chaos thread, then the clients; each client waited for
    (bounded: past ``WAIT_S`` it hung), then the chaos thread stopped and waited for, with
    nothing it did having failed."""
    chaos.start()
    for t in clients:
        t.start()
    for t in clients:
        t.join(WAIT_S)
        assert not t.is_alive(), f"seed {seed}: a client hung"
    stop.set()
    chaos.join(WAIT_S)
    assert not chaos.is_alive(), f"seed {seed}: the {chaos_name} thread hung"
    assert not errors, errors


@pytest.mark.parametrize("seed", stress_seeds(3))
def test_random_concurrent_mix_keeps_every_reply_and_the_engine_consistent(
    seed: int, tmp_path: Path, adapter_files: list[Path], cancel_hooks: None
) -> None:
    episode(seed, tmp_path / f"s{seed}", adapter_files)


@pytest.mark.parametrize("seed", stress_seeds(2))
def test_random_concurrent_mix_with_a_draft_model_keeps_every_reply_and_the_engine_consistent(
    seed: int, tmp_path: Path, adapter_files: list[Path], cancel_hooks: None
) -> None:
    """The same chaos over a model drafting with a draft model (its context one sequence a
    slot, its rows in the cache beside the model's, reloaded with the model), requests
    choosing it, n-grams or none."""
    episode(
        seed,
        tmp_path / f"s{seed}",
        adapter_files,
        config=drafting_config(),
        spec_types=DRAFT_SPEC_TYPES,
    )


def tiled_config(seed: int) -> ModelConfig:
    """The speculating stub, its memory by seed: full attention; a 96-token sliding window,
    inside which alone it drafts, a draft and its filler rows stopping at its edge
    (``MemoryKind.lookahead``); or a full-size one in ubatches of 8, where a verify pass and
    its filler rows stay within one ubatch (``Tick._splits_verify``)."""
    kind = seed % 3
    if kind == 0:
        return engine_config(StubBackend(copy_bias=8.0))
    config = engine_config(StubBackend(copy_bias=8.0, memory_kind="swa", n_swa=96))
    if kind == 1:
        return config
    return replace(config, context=replace(config.context, swa_full=True, n_ubatch=8))


def fills(filled: list[int]) -> Callable[[Model], None]:
    """A check for ``episode``'s ``then``: a copy whose drafts are capped at 5 tokens (6 rows,
    2 filler rows a pass) takes filler rows, and its reply is plain decoding's. Whether the
    chaos's own requests took any depends on how the threads met (112 of 120 episodes did)."""

    def check(model: Model) -> None:
        prompt = "Copy: the cat sat on the mat. the cat sat on the mat. the cat"
        opts = GenerationOptions(max_tokens=30, temperature=0.0, spec_draft_max=5)
        plain = model.complete(prompt, replace(opts, spec_type="none"), cache_salt="plain")
        before = len(filled)
        spec = model.complete(prompt, replace(opts, spec_type="ngram-simple"), cache_salt="fill")
        assert spec.completion_tokens == plain.completion_tokens
        assert spec.stats.accepted_tokens > 0 and len(filled) > before, filled

    return check


@pytest.mark.parametrize("seed", stress_seeds(6))
def test_random_concurrent_mix_with_filled_verify_passes_keeps_every_reply_and_the_engine(
    seed: int,
    tmp_path: Path,
    adapter_files: list[Path],
    cancel_hooks: None,
    tiled_passes: list[int],
) -> None:
    """The same chaos where verify passes are filled to a whole tile with filler rows (half
    the requests capping their drafts, so drafts end between tiles), over each memory kind
    that speculates: the filler's cells go with the rejected drafts', whatever the
    cancellations, evictions, reloads and neighbours, and every reply is its request's
    alone."""
    episode(
        seed,
        tmp_path / f"s{seed}",
        adapter_files,
        config=tiled_config(seed),
        draft_caps=True,
        then=fills(tiled_passes),
    )


@pytest.mark.parametrize("seed", stress_seeds(2))
def test_random_concurrent_mix_with_a_draft_model_and_filled_verify_passes(
    seed: int,
    tmp_path: Path,
    adapter_files: list[Path],
    cancel_hooks: None,
    tiled_passes: list[int],
) -> None:
    """Filled verify passes where a draft model drafts (its drafted token priced with its own
    pass, a filler row as a verify row: ``DraftCost.total``)."""
    episode(
        seed,
        tmp_path / f"s{seed}",
        adapter_files,
        config=drafting_config(),
        spec_types=DRAFT_SPEC_TYPES,
        draft_caps=True,
        then=fills(tiled_passes),
    )


@pytest.mark.model
@pytest.mark.slow
def test_random_concurrent_mix_on_the_real_model(tmp_path: Path, cancel_hooks: None) -> None:
    """SmolLM2 in deterministic mode (each reply bit-identical to its cold one-slot run
    whatever its neighbours, restores and cuts), bounded to about a minute: short prompts
    and replies, no reload (a load takes seconds)."""
    ctx = ContextParams(n_ctx=1024, n_batch=32, n_ubatch=32, n_threads=2, n_threads_batch=2)
    config = ModelConfig(context=ctx, n_parallel=3, deterministic=True, max_queue=64)
    episode(8, tmp_path, [], n_requests=16, config=config, max_tokens=8, reloads=0)
