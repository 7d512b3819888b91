"""A probe that may take its process down (a segfault, an abort in llama.cpp) runs in a child
Python with this checkout's ``src`` first on its path; the test reads the child's verdict
lines, so a crash is a failed assertion and not the end of the test run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_child(
    code: str, *args: str, stdin: str | None = None, prefixes: tuple[str, ...]
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run ``code`` with ``args``; (the finished process, its stdout lines starting with one
    of ``prefixes``)."""
    src = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        input=stdin,
        env={**os.environ, "PYTHONPATH": f"{src}:{ROOT}"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    return done, [line for line in done.stdout.splitlines() if line.startswith(prefixes)]
