"""A randomised crash harness for the local file tiers (``disk``, ``ram_file``): a child
(``crash_child.py``) runs a fixed script of saves (chunked rows sharing chunks, iSWA-like
rows whose window is in chunks, two-part rows, whole-blob rows), deletes (retires) and
evictions under a small quota, acknowledging each operation with the keys the index then
holds; it SIGKILLs itself at the Nth call of one kind of filesystem operation (``write``,
``fsync``, ``link``, ``unlink``, ``rename``), before the call, after it, or (a write) with
half its bytes written. Then a fresh ``Cache`` opens the directory (the startup scan) and:

- every row the last acknowledgement held that the interrupted operation leaves alone (it
  holds it after its own acknowledgement in the reference run) is there and restores
  byte-exactly; nothing is there that neither acknowledgement held (an evicted or deleted
  row never comes back), save the interrupted operation's own row;
- every row there restores byte-exactly, no manifest names a missing chunk, nothing was set
  aside (a kill -9 leaves nothing invalid), no temp file is left or counted;
- the tier's byte count equals the bytes of its ``.kvc`` and ``.kvk`` files;
- a second restart changes nothing (the same rows, files and byte count), and a third, under
  the child's small quota, evicts what the crash left over it and keeps every row whole.

Cases are drawn from ``random.Random(seed)`` over every kind and call number the reference
run made, so a failure names a seed that reproduces it. ``KVWARM_CRASH_CASES`` sets how many
seeds each tier runs (default ``DEFAULT_CASES``); ``all`` runs every crash point of every
kind, each way (about 800 per tier, minutes).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from tests.cache.tierkit import shm_dir
from tests.faults.crash_child import OPS, QUOTA, ROWS, config, restored
from tests.faults.test_kill9 import child_env

from kvwarm.cache import Cache
from kvwarm.cache.tiers.cotenants import PROCS
from kvwarm.cache.tiers.layout import CHUNK_SUFFIX, ROW_SUFFIX, TMP_SUFFIX

CHILD = Path(__file__).with_name("crash_child.py")
DEFAULT_CASES = 12
BIG = 1 << 30  # the restart's quota: it evicts nothing, so what the crash left is checked
TIERS = ("disk", "ram_file")


@dataclass(frozen=True)
class Run:
    """What a child printed: ``begun[i]`` the key operation i saves or deletes (None: an
    eviction), ``acked[i]`` the keys the index held after it, and its call counts."""

    begun: list[bytes | None]
    acked: list[frozenset[bytes]]
    counts: dict[str, int]
    returncode: int
    stderr: str


def _run(root: Path, tier: str, *kill: str) -> Run:
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(root), tier, *kill],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
        check=False,
    )
    begun: list[bytes | None] = []
    acked: list[frozenset[bytes]] = []
    counts: dict[str, int] = {}
    for line in proc.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "BEGIN":
            arg = rest.split()[1]
            begun.append(None if arg == "-" else bytes.fromhex(arg))
        elif word == "ACK":
            keys = json.loads(rest.split(" ", 1)[1])
            acked.append(frozenset(bytes.fromhex(k) for k in keys))
        elif word == "COUNTS":
            counts = json.loads(rest)
    return Run(begun, acked, counts, proc.returncode, proc.stderr)


@cache
def _reference(tier: str) -> Run:
    """The script run to its end: its acknowledgements and how many calls of each kind."""
    with shm_dir() as d:
        ref = _run(d / "kvc", tier)
    assert ref.returncode == 0, ref.stderr
    assert len(ref.acked) == len(ref.begun) and ref.counts, ref.stderr
    return ref


def crash_points(tier: str) -> Iterator[tuple[str, int, str]]:
    counts = _reference(tier).counts
    for kind in OPS:
        for nth in range(1, counts[kind] + 1):
            for when in ("before", "after", "torn") if kind == "write" else ("before", "after"):
                yield kind, nth, when


def _case(tier: str, seed: int) -> tuple[str, int, str]:
    points = list(crash_points(tier))
    return random.Random(f"{tier}:{seed}").choice(points)


def _cases() -> list[tuple[str, int]]:
    want = os.environ.get("KVWARM_CRASH_CASES", str(DEFAULT_CASES))
    if want == "all":
        return [(t, i) for t in TIERS for i in range(len(list(crash_points(t))))]
    return [(t, seed) for t in TIERS for seed in range(int(want))]


@pytest.fixture
def root(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    tier = request.node.callspec.params["tier"]
    if tier == "ram_file":
        with shm_dir() as d:
            yield d / "kvc"
    else:
        yield tmp_path / "kvc"


def _files(root: Path) -> dict[str, int]:
    """Every name in the tier's root (not its directories) and its size."""
    return {e.name: e.stat().st_size for e in os.scandir(root) if e.is_file()}


def _state(cache: Cache, root: Path, tier: str) -> tuple[frozenset[bytes], dict[str, int], float]:
    return (
        frozenset(r.key for r in cache.rows()),
        _files(root),
        cache.counters()[f"tier_{tier}_bytes"],
    )


@pytest.mark.slow
@pytest.mark.parametrize(("tier", "seed"), _cases())
def test_no_acknowledged_save_is_lost_to_a_kill9(tier: str, seed: int, root: Path) -> None:
    if os.environ.get("KVWARM_CRASH_CASES") == "all":
        kind, nth, when = list(crash_points(tier))[seed]
    else:
        kind, nth, when = _case(tier, seed)
    ref = _reference(tier)
    run = _run(root, tier, kind, str(nth), when)
    where = f"{tier} seed {seed}: killed {when} {kind} #{nth}"
    assert run.returncode == -signal.SIGKILL, f"{where}: {run.stderr}"
    done = len(run.acked)
    # The script is deterministic: the killed run said what the reference said, up to its kill.
    assert run.acked == ref.acked[:done], where
    before = ref.acked[done - 1] if done else frozenset()
    if done < len(ref.acked):  # killed in operation ``done``
        after = ref.acked[done]
        own = {k for k in (ref.begun[done],) if k is not None}
    else:  # killed in the close
        after, own = before, set()
    must = before & after
    may = before | after | own

    with Cache(config(root, tier, BIG), background=False) as cache:  # the restart
        keys = _state(cache, root, tier)[0]
        assert must <= keys, f"{where}: lost {[k.hex() for k in must - keys]}"
        assert keys <= may, f"{where}: came back {[k.hex() for k in keys - may]}"
        _check_whole(cache, root, tier, where)
        report = cache.verify()
        assert report.bad == (), where
        assert (report.quarantined_rows, report.quarantined_chunks) == (0, 0), where
        first = _state(cache, root, tier)
    with Cache(config(root, tier, BIG), background=False) as cache:  # and again: no change
        assert _state(cache, root, tier) == first, where
    with Cache(config(root, tier, QUOTA), background=False) as cache:  # evicting what it adopts
        assert cache.flush(), where
        _check_whole(cache, root, tier, where)
        assert cache.counters()[f"tier_{tier}_bytes"] <= QUOTA, where


def _check_whole(cache: Cache, root: Path, tier: str, where: str) -> None:
    """Every row restores byte-exactly, names only chunks that are there; no temp file; the
    tier's byte count is its files'."""
    keys, files, counted = _state(cache, root, tier)
    assert not [n for n in files if n.endswith(TMP_SUFFIX)], f"{where}: {files}"
    strays = [n for n in os.listdir(root / PROCS) if not n.endswith(".lock")]
    assert not strays, f"{where}: left in {PROCS}/: {strays}"
    on_disk = {n[: -len(CHUNK_SUFFIX)] for n in files if n.endswith(CHUNK_SUFFIX)}
    for key in keys:
        assert restored(cache, key) == ROWS[key].expected(), f"{where}: {key.hex()}"
        stored = cache._index.stored_in(key, tier)  # type: ignore[arg-type]
        assert stored is not None
        missing = {c.hex() for c in stored.chunk_refs} - on_disk
        assert not missing, f"{where}: {key.hex()} names missing chunks {missing}"
    data = sum(s for n, s in files.items() if n.endswith((ROW_SUFFIX, CHUNK_SUFFIX)))
    assert counted == data, f"{where}: counted {counted} bytes, {data} on disk"


@pytest.mark.parametrize("tier", TIERS)
def test_a_kill9_while_registering_leaves_no_stray_file(tier: str, root: Path) -> None:
    """Killed between creating its registration and renaming it to its listed name (the
    script's one rename), a process left ``procs/<pid>-<hex>.lock.new`` that no opener
    removed (found by this harness)."""
    run = _run(root, tier, "rename", "1", "before")
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert [n for n in os.listdir(root / PROCS) if n.endswith(".new")]
    with Cache(config(root, tier, BIG), background=False) as cache:
        _check_whole(cache, root, tier, f"{tier}: killed registering")
