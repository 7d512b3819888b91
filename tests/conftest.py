"""Suite-wide rule: a test that touches the real model carries the ``model`` marker.

Invariant: ``pytest -m "not model"`` runs exactly the tests that need no model (and no
llama.cpp decoding), so the marker must not be forgotten. In this process, resolving the default
model file (``kvwarm.embedded.default_model_path``) or loading a GGUF through llama.cpp
(``LlamaBackend.load_model``) from a test without the marker fails that test. Tests that run the
model in a child process (the CLI tests) are marked by hand.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import Any

import pytest
from tests.rediskit import RedisServer
from tests.s3kit import MotoServer, aws_env

import kvwarm.embedded

_running: list[pytest.Item] = []
_offenders: dict[str, str] = {}
_restore: list[Callable[[], None]] = []


def _check(what: str) -> None:
    item = _running[-1] if _running else None
    if item is None or item.get_closest_marker("model") is not None:
        return
    if threading.current_thread() is not threading.main_thread():
        _offenders[item.nodeid] = what
    pytest.fail(f"{item.nodeid} uses {what} but is not marked @pytest.mark.model", pytrace=False)


def _guard(owner: Any, name: str, what: str) -> None:
    original = getattr(owner, name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check(what)
        return original(*args, **kwargs)

    setattr(owner, name, guarded)
    _restore.append(lambda: setattr(owner, name, original))


def _own_share_of_the_cpus() -> None:
    """Under pytest-xdist (``make test`` runs two workers) each worker keeps to its own share
    of the CPUs, and so do the servers and children it starts (affinity is inherited).

    llama.cpp's threads wait for each other at every step of a pass: two workers whose
    contexts each spread over both cores of a 2-core machine slowed a model test file 1.8x
    beside one busy process, while two threads kept to one core cost it 1.4x. So each worker
    decodes on its own core and the other worker's stub tests run beside it undisturbed."""
    import os

    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = cpus[int(worker[2:]) % count :: count]
    if share:
        os.sched_setaffinity(0, share)


def pytest_configure(config: pytest.Config) -> None:
    _own_share_of_the_cpus()
    # Before any test module runs ``from kvwarm.embedded import default_model_path``, so that
    # every such import binds the guarded function.
    _guard(kvwarm.embedded, "default_model_path", "the real model file")
    from kvwarm.backends.llama.model import LlamaBackend

    _guard(LlamaBackend, "load_model", "llama.cpp")
    _offload(LlamaBackend)


GPU_LAYERS_ENV = "KVWARM_TEST_GPU_LAYERS"


def _offload(backend: Any) -> None:
    """``KVWARM_TEST_GPU_LAYERS=N`` runs every real-model test with N layers offloaded (a GPU
    machine with a CUDA build of llama.cpp; unset, as in CI: the CPU)."""
    import os
    from dataclasses import replace

    from kvwarm.backends.params import ModelParams

    layers = os.environ.get(GPU_LAYERS_ENV)
    if not layers:
        return
    original = backend.load_model

    def offloaded(self: Any, path: str, params: ModelParams | None = None) -> Any:
        return original(self, path, replace(params or ModelParams(), n_gpu_layers=int(layers)))

    backend.load_model = offloaded
    _restore.append(lambda: setattr(backend, "load_model", original))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test has a node id of its own. pytest-xdist schedules and reports tests by node id,
    and Schemathesis gives each operation of a test the test's id (92 items under 2 ids): run
    with workers, one operation of each ran and the 90 others were dropped, unreported. Such an
    item takes its own name (which holds the operation) into its id; an id still repeated
    fails the run here rather than losing tests."""
    from collections import Counter

    for item in items:
        params = item.name.partition("[")[2].removesuffix("]")
        if params and not item.nodeid.endswith("]"):
            if hasattr(item, "_id"):  # pytest 9: a structured id
                item._id = item._id.with_params(params)
            else:
                item._nodeid = f"{item.nodeid}[{params}]"
    repeated = sorted(i for i, n in Counter(item.nodeid for item in items).items() if n > 1)
    if repeated:
        raise pytest.UsageError(f"tests share node ids, which pytest-xdist would drop: {repeated}")


def pytest_unconfigure(config: pytest.Config) -> None:
    while _restore:
        _restore.pop()()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    # Module-scoped fixtures are set up inside their first test's protocol, so they count too.
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    # A use from a background thread (a server loading its models) cannot fail the test where
    # it happens; it fails it here.
    what = _offenders.pop(item.nodeid, None)
    if what is not None:
        pytest.fail(f"{item.nodeid} uses {what} but is not marked @pytest.mark.model")


@pytest.fixture(scope="session")
def moto_server() -> Generator[MotoServer]:
    """A live S3-compatible server on a free port of 127.0.0.1, for the whole session."""
    with aws_env():
        server = MotoServer()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Generator[RedisServer]:
    """Debian's redis-server on a free port of 127.0.0.1 (temp dir, no persistence), for the
    whole session. Missing redis-server fails the test that needs it, saying how to install."""
    try:
        server = RedisServer()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_moto_server() -> Generator[MotoServer]:
    """A server of this test's own, which the test may stop (a store that dies)."""
    with aws_env():
        server = MotoServer()
        try:
            yield server
        finally:
            server.stop()


GEMMA_ENV = "KVWARM_GEMMA"


@pytest.fixture(scope="session")
def gemma_path() -> str:
    """Gemma 3 270M (sliding-window attention), assembled from its PyPI packages by
    `make gemma` (``make test`` runs it). Missing is a failure, not a skip: the memory-kind
    tests are what prove the cache exact on such models."""
    import os
    from pathlib import Path

    path = Path(
        os.environ.get(GEMMA_ENV)
        or Path(__file__).parents[1] / ".venv" / "models" / "gemma-3-270m-q4_k_m.gguf"
    )
    if not path.is_file():
        pytest.fail(f"Gemma 3 270M is missing at {path}: run `make gemma` (or set {GEMMA_ENV})")
    return str(path)


#: Put in a child process's script (or run in process) to price a draft model's passes at
#: nothing: see ``free_draft_passes``.
FREE_DRAFT_PASSES = (
    "from kvwarm.engine.worker.drafts import DraftCost\n"
    "DraftCost.per_token = lambda self, plain: 0.0\n"
)


@pytest.fixture
def free_draft_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model's own passes priced at nothing (``DraftCost``). The draft models of the
    tests (the stub's, SmolLM2 or Gemma 3 drafting for itself, the tiny chain models) cost
    what the model's passes cost, which prices every draft out; a test of what drafts do
    (not of whether they pay) needs them made."""
    from kvwarm.engine.worker.drafts import DraftCost

    monkeypatch.setattr(DraftCost, "per_token", lambda self, plain: 0.0)


@pytest.fixture
def tiled_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Passes priced as on a CPU whose matrix kernel takes rows 4 at a time, a row costing far
    less than the sweep of the weights the rows past a multiple pay: a verify pass whose rows
    end between tiles takes filler rows (``Cost.pad``, ``Tick._pad``). The list it gives
    gets each such pass's filler rows, as the worker verifies it (``Sampling.on_verify``)."""
    from kvwarm.engine.worker.drafts import Cost, PassCost
    from kvwarm.engine.worker.sampling import Sampling
    from kvwarm.engine.worker.slots import Slot

    tiled = Cost(0.0, 0.05, tile=4, step=1.0)
    monkeypatch.setattr(PassCost, "cost", property(lambda self: tiled))
    filled: list[int] = []
    on_verify = Sampling.on_verify

    def verified(
        sampling: Sampling, slot: Slot, first: int, draft: list[int], pad: int = 0
    ) -> None:
        if pad:
            filled.append(pad)
        on_verify(sampling, slot, first, draft, pad)

    monkeypatch.setattr(Sampling, "on_verify", verified)
    return filled


@pytest.fixture(autouse=True)
def _process_limits_kept() -> Generator[None, None, None]:
    """A test that bounds this process's address space (a danger case run in process) must
    put the bound back: every later test's allocations would fail under it, at random and far
    from the cause (found: a whole run failed that way and aborted)."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_AS)
    yield
    after = resource.getrlimit(resource.RLIMIT_AS)
    if after != before:
        resource.setrlimit(resource.RLIMIT_AS, before)
        pytest.fail(f"the test left RLIMIT_AS at {after} (was {before})")
