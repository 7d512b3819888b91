"""``kvwarm cache gc --shared --grace-s S`` with a bad S is a usage error (exit status 2).

``-1`` raised a bare ``ValueError`` (a traceback, exit 1). ``nan`` passed the ``< 0`` check and
then compared false with every chunk's age: no chunk counted as young, so unreferenced chunks
written a moment ago (another process's saves in flight, what the grace protects) were
deleted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.cache.test_shared_gc import _chunks, _config, _orphan_r1, _store

from kvwarm.cache import Cache, TierConfig

SRC = Path(__file__).resolve().parents[2] / "src"


def test_nan_grace_does_not_sweep_young_chunks(tmp_path: Path) -> None:
    shared = TierConfig("disk", 1 << 30, tmp_path / "nfs", shared=True)
    _orphan_r1(shared)  # an unreferenced chunk, written just now
    store = _store(shared)
    try:
        with Cache(_config(shared), background=False) as a:
            before = _chunks(store)
            try:
                results = a.gc_shared(grace_s=float("nan"))
            except (ValueError, TypeError):
                return  # refused: fine
            assert [(r.deleted, r.young) for r in results] == [(0, 1)], results
            assert _chunks(store) == before
    finally:
        store.close()


@pytest.mark.parametrize("grace", ["-1", "nan"])
def test_cli_bad_grace_is_a_usage_error(tmp_path: Path, grace: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWARM_") and k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(SRC),
        XDG_CACHE_HOME=str(tmp_path / "xdg-cache"),
        XDG_CONFIG_HOME=str(tmp_path / "xdg-config"),
        KVWARM_CACHE_DIR=str(tmp_path / "nfs"),
        KVWARM_CACHE_DIR_SHARED="true",
    )
    result = subprocess.run(
        [sys.executable, "-m", "kvwarm", "cache", "gc", "--shared", "--grace-s", grace],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in result.stderr, result.stderr[-500:]
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr[-500:])
    assert "grace" in result.stderr, result.stderr
