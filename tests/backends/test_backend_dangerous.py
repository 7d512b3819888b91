"""Misuse of every backend ends in a typed error, never an abort.

The llama.cpp cases run in child processes: a GGML_ASSERT there fails one test (non-zero exit,
no CASE-OK) instead of killing the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.backends import backend_danger_cases as cases

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_stub_in_process(case: str) -> None:
    cases.CASES[case]("stub")


@pytest.mark.model
@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_llama_in_child_process(case: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "tests.backends.backend_danger_cases", "llama_cpp", case],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    detail = (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    assert proc.returncode == 0, detail
    assert proc.stdout.rstrip().endswith("CASE-OK"), detail
