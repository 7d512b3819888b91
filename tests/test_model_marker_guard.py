"""The suite's guard (``tests/conftest.py``): touching the real model needs the ``model`` marker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CASES = """
import pytest

from kvwarm.embedded import default_model_path
from kvwarm.errors import KvwarmError


def touch() -> None:
    try:
        default_model_path()
    except KvwarmError:
        pass  # no model installed: the guard fires before this matters


def test_unmarked() -> None:
    touch()


@pytest.mark.model
def test_marked() -> None:
    touch()


def test_no_model() -> None:
    assert True
"""


def test_an_unmarked_test_that_resolves_the_model_fails(tmp_path: Path) -> None:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    # The copied conftest imports the suite's own helpers (``tests.*``): the repo root too.
    path = os.pathsep.join([str(HERE.parent / "src"), str(HERE.parent)])
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path),
         "-o", "markers=model", "--rootdir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    out = result.stdout
    assert "FAILED test_cases.py::test_unmarked" in out, out
    assert "is not marked @pytest.mark.model" in out
    assert "PASSED test_cases.py::test_marked" in out
    assert "PASSED test_cases.py::test_no_model" in out
