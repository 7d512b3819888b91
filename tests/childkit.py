"""A probe that may take its process down (a segfault, an abort in llama.cpp) runs in a child
Python with this checkout's ``src`` first on its path; the test reads the child's verdict
lines, so a crash is a failed assertion and not the end of the test run."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_child(
    code: str,
    *args: str,
    stdin: str | None = None,
    prefixes: tuple[str, ...],
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run ``code`` with ``args`` (in ``env``, by default this process's environment); (the
    finished process, its stdout lines starting with one of ``prefixes``)."""
    src = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        input=stdin,
        env={**(os.environ if env is None else env), "PYTHONPATH": f"{src}:{ROOT}"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    return done, [line for line in done.stdout.splitlines() if line.startswith(prefixes)]


def assert_case_ok(*args: str, timeout: float = 180) -> None:
    """Run ``python *args`` from the checkout's root, its ``src`` and root first on the path:
    it must exit 0 with ``CASE-OK`` as its last line (a crash in llama.cpp fails the test with
    the exit status and the ends of both outputs, not the test run)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    detail = (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    assert proc.returncode == 0, detail
    assert proc.stdout.rstrip().endswith("CASE-OK"), detail
